// Package demo is `kvbridge demo`: in one process it starts a prefiller, a decoder and a proxy
// on free loopback ports, runs the same multi-turn conversations one-way and then with
// bidirectional KV transfer, and shows what the second saves — time to first token per turn,
// the KV bytes moved, and that the answers are the same. With Serve it keeps a bidirectional
// stack running for curl. It is built on packages stack (P, D and the proxies) and conversation
// (the workload and its measurements), never on a benchmark. See docs/architecture.md.
package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"text/tabwriter"
	"time"

	"github.com/kvbridge/kvbridge/conversation"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/plot"
	"github.com/kvbridge/kvbridge/stack"
)

// DefaultPlot is where the chart goes unless Options.PlotPath says otherwise.
const DefaultPlot = "kvbridge-demo.svg"

// Options configure Run. Zero values take the defaults noted on each field.
type Options struct {
	// Model is served by P and D (default kvbridge/small).
	Model string
	// Conversations (default 2) and Turns (default 8) size the workload; UserTokens and
	// AnswerTokens are the lengths of each user message and answer (the defaults of package
	// conversation: the history passes 2,000 tokens by turn 8).
	Conversations, Turns, UserTokens, AnswerTokens int
	// PlotPath is the SVG chart's path (default kvbridge-demo.svg); JSONPath, if set, receives
	// the Summary as JSON.
	PlotPath, JSONPath string
	// Out receives the table; Progress one line per phase and turn (nil: neither is written).
	Out, Progress io.Writer
	// Logger receives the engines' and the proxies' logs; nil discards.
	Logger *slog.Logger

	// started, if set, sees every stack the demo starts (tests check the pools after Run).
	started func(*stack.Stack)
}

// Summary is what the demo measured; it is also the --json output.
type Summary struct {
	Model         string `json:"model"`
	Conversations int    `json:"conversations"`
	Turns         int    `json:"turns"`
	// OutputsIdentical says the one-way and the bidirectional runs gave the same answers.
	OutputsIdentical bool `json:"outputs_identical"`
	// TTFTOneWayMs and TTFTBidirectionalMs are each turn's time to first token (mean over the
	// conversations); Ratio their quotient bidirectional ÷ one-way; LastTurnRatio the last one.
	TTFTOneWayMs        []float64 `json:"ttft_ms_oneway"`
	TTFTBidirectionalMs []float64 `json:"ttft_ms_bidirectional"`
	Ratio               []float64 `json:"ratio"`
	LastTurnRatio       float64   `json:"last_turn_ratio"`
	// PromptTokens is each turn's prompt (mean over the conversations); PComputed* what P
	// computed in each mode; PPulledBidirectional what P pulled from D.
	PromptTokens           []float64 `json:"prompt_tokens"`
	PComputedOneWay        []float64 `json:"p_computed_tokens_oneway"`
	PComputedBidirectional []float64 `json:"p_computed_tokens_bidirectional"`
	PPulledBidirectional   []float64 `json:"p_pulled_tokens_bidirectional"`
	// KVBytesOneWay and KVBytesBidirectional are the KV bytes moved between P and D in each turn
	// (both directions, summed over the conversations).
	KVBytesOneWay        []int64 `json:"kv_bytes_moved_oneway"`
	KVBytesBidirectional []int64 `json:"kv_bytes_moved_bidirectional"`
	// WallSeconds is the whole demo's duration; Plot the chart's path.
	WallSeconds float64 `json:"wall_seconds"`
	Plot        string  `json:"plot"`
}

// Run runs the demo: the workload one-way, then bidirectional, each on its own fresh P, D and
// proxy (P's prefix caching off, as in vLLM's evaluation), then prints the table and writes the
// chart (and the JSON).
func Run(ctx context.Context, opts Options) (*Summary, error) {
	start := time.Now()
	if opts.Model == "" {
		opts.Model = model.Small
	}
	if opts.PlotPath == "" {
		opts.PlotPath = DefaultPlot
	}
	if opts.Out == nil {
		opts.Out = io.Discard
	}
	progress := stack.Printer(opts.Progress)
	m, err := stack.OpenModel(ctx, opts.Model, opts.Progress)
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	defer m.Close()
	wl := conversation.Options{
		Model: m, Conversations: opts.Conversations, Turns: opts.Turns, UserTokens: opts.UserTokens,
		AnswerTokens: opts.AnswerTokens, Progress: opts.Progress, Logger: opts.Logger,
	}
	// Each mode runs on its own fresh stack, one after the other; RunSideBySide closes it and
	// checks that every KV block went back to its pool.
	started := func(s *stack.Stack) {
		proxyKind := "one-way proxy, bidirectional_kv_xfer off"
		if s.Mode == stack.Bidirectional {
			proxyKind = "multi-turn proxy, bidirectional_kv_xfer on P and D, conversation_id sent"
		}
		progress("%s: P %s, D %s, proxy %s (%s; P's prefix caching off)", s.Mode, s.P.URL(), s.D.URL(), s.URL, proxyKind)
		if opts.started != nil {
			opts.started(s)
		}
	}
	var runs []*conversation.Run
	for _, mode := range []stack.Mode{stack.OneWay, stack.Bidirectional} {
		run, err := conversation.RunSideBySide(ctx, wl, started, mode)
		if err != nil {
			return nil, fmt.Errorf("demo: %w", err)
		}
		runs = append(runs, run...)
	}
	s := summarize(runs[0], runs[1])
	s.Plot = opts.PlotPath
	if err := writeChart(opts.PlotPath, s); err != nil {
		return s, err
	}
	s.WallSeconds = time.Since(start).Seconds()
	if err := writeTable(opts.Out, s, runs[1]); err != nil {
		return s, err
	}
	if opts.JSONPath != "" {
		if err := s.writeJSON(opts.JSONPath); err != nil {
			return s, fmt.Errorf("demo: %w", err)
		}
	}
	return s, nil
}

// writeJSON writes the summary to path as indented JSON.
func (s *Summary) writeJSON(path string) error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// summarize compares the two runs turn by turn.
func summarize(ow, bd *conversation.Run) *Summary {
	s := &Summary{
		Model: ow.Model, Conversations: ow.Conversations, Turns: ow.Turns,
		TTFTOneWayMs: ow.TTFTPerTurn(), TTFTBidirectionalMs: bd.TTFTPerTurn(),
		KVBytesOneWay: ow.BytesPerTurn(), KVBytesBidirectional: bd.BytesPerTurn(),
	}
	s.OutputsIdentical, _ = conversation.SameAnswers(ow, bd)
	s.Ratio = make([]float64, len(s.TTFTOneWayMs))
	for i := range s.Ratio {
		if s.TTFTOneWayMs[i] > 0 {
			s.Ratio[i] = s.TTFTBidirectionalMs[i] / s.TTFTOneWayMs[i]
		}
	}
	if n := len(s.Ratio); n > 0 {
		s.LastTurnRatio = s.Ratio[n-1]
	}
	mean := func(run *conversation.Run, f func(conversation.Turn) int) []float64 {
		return conversation.MeanPerTurn([]*conversation.Run{run}, func(t conversation.Turn) float64 { return float64(f(t)) })
	}
	s.PromptTokens = mean(bd, func(t conversation.Turn) int { return t.PromptTokens })
	s.PComputedOneWay = mean(ow, func(t conversation.Turn) int { return t.PComputedTokens })
	s.PComputedBidirectional = mean(bd, func(t conversation.Turn) int { return t.PComputedTokens })
	s.PPulledBidirectional = mean(bd, func(t conversation.Turn) int { return t.PPulledTokens })
	return s
}

// writeTable prints the short table and the verdict.
func writeTable(w io.Writer, s *Summary, bd *conversation.Run) error {
	fmt.Fprintf(w, "\nkvbridge demo: %s, %d conversations × %d turns (user messages %d tokens, answers %d tokens, greedy); P's prefix caching off\n",
		s.Model, s.Conversations, s.Turns, bd.UserTokens, bd.AnswerTokens)
	fmt.Fprintln(w, "TTFT = time to the first streamed token through the proxy, mean over the conversations")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "turn\tprompt tokens\tone-way ms\tbidirectional ms\tratio\tP computed (bidi)\tpulled from D\tKV moved one-way MB\tKV moved bidi MB\t")
	for i := range s.Ratio {
		fmt.Fprintf(tw, "%d\t%.0f\t%.1f\t%.1f\t%.2f\t%.0f\t%.0f\t%.1f\t%.1f\t\n", i+1, s.PromptTokens[i], s.TTFTOneWayMs[i], s.TTFTBidirectionalMs[i],
			s.Ratio[i], s.PComputedBidirectional[i], s.PPulledBidirectional[i], float64(s.KVBytesOneWay[i])/1e6, float64(s.KVBytesBidirectional[i])/1e6)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	yes := "no"
	if s.OutputsIdentical {
		yes = "yes"
	}
	fmt.Fprintf(w, "outputs identical: %s\n", yes)
	if n := len(s.Ratio); n > 0 && s.LastTurnRatio > 0 {
		fmt.Fprintf(w, "turn %d: bidirectional TTFT %.1f ms against %.1f ms one-way (%.2f, 1/%.1f): P pulled %.0f tokens of history from D and computed %.0f instead of %.0f\n",
			n, s.TTFTBidirectionalMs[n-1], s.TTFTOneWayMs[n-1], s.LastTurnRatio, 1/s.LastTurnRatio, s.PPulledBidirectional[n-1], s.PComputedBidirectional[n-1], s.PComputedOneWay[n-1])
	}
	_, err := fmt.Fprintf(w, "chart: %s (%.1f s in all)\n", s.Plot, s.WallSeconds)
	return err
}

// writeChart draws TTFT per turn, both modes, as SVG.
func writeChart(path string, s *Summary) error {
	var buf bytes.Buffer
	err := plot.LineChart(&buf, plot.Chart{
		Title:  fmt.Sprintf("kvbridge demo: TTFT per turn (%s, mean of %d conversations)", s.Model, s.Conversations),
		XLabel: "turn", YLabel: "TTFT (ms)",
		Series: []plot.Series{{Name: "one-way", Y: s.TTFTOneWayMs}, {Name: "bidirectional", Y: s.TTFTBidirectionalMs}},
	})
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	return nil
}
