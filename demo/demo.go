// Package demo is `kvbridge demo`: in one process it starts a prefiller, a decoder and a proxy
// on free loopback ports, runs the same multi-turn conversations one-way and then with
// bidirectional KV transfer, and shows what the second saves — time to first token per turn,
// the KV bytes moved, and that the answers are the same. With Serve it keeps a bidirectional
// stack running for curl.
package demo

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"text/tabwriter"
	"time"

	"github.com/kvbridge/kvbridge/bench/bidibench"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/plot"
)

// DefaultPlot is where the chart goes unless Options.PlotPath says otherwise.
const DefaultPlot = "kvbridge-demo.svg"

// Options configure Run. Zero values take the defaults noted on each field.
type Options struct {
	// Model is served by P and D (default kvbridge/small).
	Model string
	// Conversations (default 2) and Turns (default 8) size the workload; UserTokens and
	// AnswerTokens are the lengths of each user message and answer (defaults of bidibench:
	// the history passes 2,000 tokens by turn 8).
	Conversations, Turns, UserTokens, AnswerTokens int
	// PlotPath is the SVG chart's path (default kvbridge-demo.svg); JSONPath, if set, receives
	// the Summary as JSON.
	PlotPath, JSONPath string
	// Out receives the table; Progress one line per phase and turn (nil: neither is written).
	Out, Progress io.Writer
	// Logger receives the engines' and the proxies' logs; nil discards.
	Logger *slog.Logger

	// started, if set, sees every stack the demo starts (tests check the pools after Run).
	started func(*bidibench.Stack)
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
	progress := func(format string, args ...any) {
		if opts.Progress != nil {
			fmt.Fprintf(opts.Progress, format+"\n", args...)
		}
	}
	progress("loading %s", opts.Model)
	m, err := model.Open(ctx, opts.Model, model.OpenOptions{})
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	defer m.Close()
	wl := bidibench.Options{
		OpenedModel: m, Conversations: opts.Conversations, Turns: opts.Turns, UserTokens: opts.UserTokens,
		AnswerTokens: opts.AnswerTokens, Progress: opts.Progress, Logger: opts.Logger,
	}
	var runs []*bidibench.Run
	for _, mode := range []bidibench.Mode{bidibench.ModeOneWay, bidibench.ModeBidirectional} {
		run, err := runMode(ctx, mode, wl, progress, opts.started)
		if err != nil {
			return nil, err
		}
		runs = append(runs, run)
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
		if err := bidibench.WriteJSON(opts.JSONPath, s); err != nil {
			return s, fmt.Errorf("demo: %w", err)
		}
	}
	return s, nil
}

// runMode starts a stack for mode, runs the workload on it and closes it, checking that every
// KV block went back to its pool.
func runMode(ctx context.Context, mode bidibench.Mode, wl bidibench.Options, progress func(string, ...any), started func(*bidibench.Stack)) (_ *bidibench.Run, err error) {
	s, err := bidibench.StartStack(ctx, wl.StackConfig(mode))
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	if started != nil {
		started(s)
	}
	defer func() {
		if cerr := s.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("demo: closing the %s stack: %w", mode, cerr)
		}
		if p, d := s.P.Pool, s.D.Pool; (p.NumFree() != p.NumBlocks() || d.NumFree() != d.NumBlocks()) && err == nil {
			err = fmt.Errorf("demo: %s stack leaked KV blocks (P %d of %d free, D %d of %d)", mode, p.NumFree(), p.NumBlocks(), d.NumFree(), d.NumBlocks())
		}
	}()
	proxyKind := "one-way proxy, bidirectional_kv_xfer off"
	if mode == bidibench.ModeBidirectional {
		proxyKind = "multi-turn proxy, bidirectional_kv_xfer on P and D, conversation_id sent"
	}
	progress("%s: P %s, D %s, proxy %s (%s; P's prefix caching off)", mode, s.P.URL, s.D.URL, s.URL, proxyKind)
	run, err := bidibench.Drive(ctx, s, wl)
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	return run, nil
}

// summarize compares the two runs turn by turn.
func summarize(ow, bd *bidibench.Run) *Summary {
	s := &Summary{
		Model: ow.Model, Conversations: ow.Conversations, Turns: ow.Turns,
		TTFTOneWayMs: ow.TTFTPerTurn(), TTFTBidirectionalMs: bd.TTFTPerTurn(),
		KVBytesOneWay: ow.BytesPerTurn(), KVBytesBidirectional: bd.BytesPerTurn(),
	}
	s.OutputsIdentical, _ = bidibench.SameAnswers(ow, bd)
	s.Ratio = make([]float64, len(s.TTFTOneWayMs))
	for i := range s.Ratio {
		if s.TTFTOneWayMs[i] > 0 {
			s.Ratio[i] = s.TTFTBidirectionalMs[i] / s.TTFTOneWayMs[i]
		}
	}
	if n := len(s.Ratio); n > 0 {
		s.LastTurnRatio = s.Ratio[n-1]
	}
	s.PromptTokens = perTurn(bd, func(t bidibench.Turn) float64 { return float64(t.PromptTokens) })
	s.PComputedOneWay = perTurn(ow, func(t bidibench.Turn) float64 { return float64(t.PComputedTokens) })
	s.PComputedBidirectional = perTurn(bd, func(t bidibench.Turn) float64 { return float64(t.PComputedTokens) })
	s.PPulledBidirectional = perTurn(bd, func(t bidibench.Turn) float64 { return float64(t.PPulledTokens) })
	return s
}

// perTurn averages f over the conversations of each turn of run.
func perTurn(run *bidibench.Run, f func(bidibench.Turn) float64) []float64 {
	sum := make([]float64, run.Turns)
	n := make([]int, run.Turns)
	for _, t := range run.Rows {
		sum[t.Turn-1] += f(t)
		n[t.Turn-1]++
	}
	for i := range sum {
		if n[i] > 0 {
			sum[i] /= float64(n[i])
		}
	}
	return sum
}

// writeTable prints the short table and the verdict.
func writeTable(w io.Writer, s *Summary, bd *bidibench.Run) error {
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
