// Package bidibench is `kvbridge bench bidirectional`: the multi-turn workload of package
// conversation driven one-way and bidirectional side by side, with P's prefix caching off and
// on, Repeats times, against the floor of the bidirectional last turn (the KV moved at the
// memcpy ceiling plus the prefill of the new tokens, both measured in the same run), with the
// targets checked and the report, the JSON and the chart written. See docs/architecture.md for
// where the package sits.
package bidibench

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/conversation"
	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/stack"
	"github.com/kvbridge/kvbridge/stats"
)

// BenchOptions configure RunBench. Zero values take the workload defaults of
// conversation.Options.
type BenchOptions struct {
	// Model is the model of both engines (default kvbridge/small).
	Model string
	// Conversations, Turns, UserTokens, AnswerTokens and Seed shape the workload (see
	// conversation.Options).
	Conversations, Turns, UserTokens, AnswerTokens int
	Seed                                           uint64
	// Repeats is how many times each comparison runs, each time with new conversations (seed +
	// repetition) on fresh engines (default 3); each turn's figure is the median over the
	// conversations of every repetition, which a slow spell of a shared machine cannot move much.
	Repeats int
	// Progress, if non-nil, receives one line per phase and turn.
	Progress io.Writer
	// Logger receives the engines' and the proxies' logs; nil discards.
	Logger *slog.Logger
}

// Comparison is one-way against bidirectional with P's prefix caching off or on.
type Comparison struct {
	PrefixCaching bool `json:"prefix_caching"`
	// TTFTOneWayMs and TTFTBidirectionalMs hold each turn's TTFT: the median over the
	// conversations of every repetition. Ratio is their quotient bidirectional ÷ one-way.
	TTFTOneWayMs        []float64 `json:"ttft_ms_oneway"`
	TTFTBidirectionalMs []float64 `json:"ttft_ms_bidirectional"`
	Ratio               []float64 `json:"ratio"`
	// LastTurnRatio is the last turn's ratio; Gain is 1 − LastTurnRatio, the share of the
	// one-way TTFT bidirectional transfer saves at the last turn.
	LastTurnRatio float64 `json:"last_turn_ratio"`
	Gain          float64 `json:"gain"`
	// OutputsIdentical says every repetition's two runs gave the same answers.
	OutputsIdentical bool `json:"outputs_identical"`
	// OneWay and Bidirectional are the runs, one per repetition.
	OneWay        []*conversation.Run `json:"one_way"`
	Bidirectional []*conversation.Run `json:"bidirectional"`
}

// LowerBound is the floor of the bidirectional last-turn TTFT with P's prefix caching off, as the
// issue defines it: the KV moved before the first token (P's read of the history from D and D's
// read of the new blocks from P) at the memcpy ceiling, plus the prefill of the new tokens alone
// on a fresh engine. It also holds a tighter compute floor that explains the difference.
type LowerBound struct {
	Turn int `json:"turn"`
	// PReadBytes and DReadBytes are the last turn's reads (mean over conversations and
	// repetitions); CeilingGBps a single-goroutine memcpy of their sum measured in this run;
	// TransferMs the sum at the ceiling.
	PReadBytes  int64   `json:"p_read_bytes"`
	DReadBytes  int64   `json:"d_read_bytes"`
	CeilingGBps float64 `json:"ceiling_gbps"`
	TransferMs  float64 `json:"transfer_ms"`
	// MeasuredTransferMs is what the reads took (xferDuration of both, median).
	MeasuredTransferMs float64 `json:"measured_transfer_ms"`
	// NewTokens is what P computed in the last turn (mean); PrefillNewMs the median time to
	// first token of a prompt of that many tokens on a fresh engine (no connector, no prefix
	// caching), each sample taken right after a measured last turn.
	NewTokens    int     `json:"new_tokens"`
	PrefillNewMs float64 `json:"prefill_new_ms"`
	// BoundMs = TransferMs + PrefillNewMs; MeasuredMs the bidirectional last-turn TTFT (as in
	// the table); Factor their quotient.
	BoundMs    float64 `json:"bound_ms"`
	MeasuredMs float64 `json:"measured_ms"`
	Factor     float64 `json:"factor"`
	// The compute floor is what any P/D system must compute before the first token, timed as
	// bare forward steps of the model in this process (medians, sampled with PrefillNewMs):
	// ContextPrefillMs is the new tokens attending over the history (what P does; the fresh
	// prefill lacks that attention), DStepMs the one-token step at the end of the prompt that
	// produces the first token on D. ComputeFloorMs = TransferMs + ContextPrefillMs + DStepMs;
	// OverheadFactor = MeasuredMs ÷ ComputeFloorMs is what kvbridge's machinery (HTTP, proxy,
	// scheduling, connector) adds.
	ContextPrefillMs float64 `json:"context_prefill_ms"`
	DStepMs          float64 `json:"d_step_ms"`
	ComputeFloorMs   float64 `json:"compute_floor_ms"`
	OverheadFactor   float64 `json:"overhead_factor"`
}

// Target is one of the benchmark's goals and whether this run met it.
type Target struct {
	Name   string `json:"name"`
	Goal   string `json:"goal"`
	Result string `json:"result"`
	Met    bool   `json:"met"`
	// Informational targets are reported, not passed or failed.
	Informational bool `json:"informational,omitempty"`
}

// Report is the result of RunBench.
type Report struct {
	Model         string `json:"model"`
	Conversations int    `json:"conversations"`
	Turns         int    `json:"turns"`
	UserTokens    int    `json:"user_tokens"`
	AnswerTokens  int    `json:"answer_tokens"`
	Repeats       int    `json:"repeats"`
	// LastTurnPromptTokens is the last turn's prompt (mean over conversations and repetitions).
	LastTurnPromptTokens int `json:"last_turn_prompt_tokens"`
	// PrefixOff and PrefixOn compare the modes with P's prefix caching off and on.
	PrefixOff Comparison `json:"prefix_caching_off"`
	PrefixOn  Comparison `json:"prefix_caching_on"`
	Bound     LowerBound `json:"lower_bound"`
	// OutputsIdentical says that within every repetition all four runs gave the same answers.
	OutputsIdentical bool     `json:"outputs_identical"`
	Targets          []Target `json:"targets"`
	WallSeconds      float64  `json:"wall_seconds"`
}

// RunBench runs the multi-turn workload one-way and bidirectional side by side, with P's prefix
// caching off and then on (each on fresh engines), Repeats times with new conversations, samples
// the floor of the bidirectional last turn right after each such turn, and checks the targets.
func RunBench(ctx context.Context, opts BenchOptions) (*Report, error) {
	start := time.Now()
	if opts.Model == "" {
		opts.Model = model.Small
	}
	if opts.Repeats <= 0 {
		opts.Repeats = 3
	}
	progress := stack.Printer(opts.Progress)
	m, err := stack.OpenModel(ctx, opts.Model, opts.Progress)
	if err != nil {
		return nil, fmt.Errorf("bidibench: %w", err)
	}
	defer m.Close()
	wl := conversation.Options{
		Model: m, Conversations: opts.Conversations, Turns: opts.Turns, UserTokens: opts.UserTokens,
		AnswerTokens: opts.AnswerTokens, Seed: opts.Seed, Progress: opts.Progress, Logger: opts.Logger,
	}.WithDefaults()
	rep := &Report{
		Model: m.Name(), Conversations: wl.Conversations, Turns: wl.Turns, UserTokens: wl.UserTokens, AnswerTokens: wl.AnswerTokens,
		Repeats: opts.Repeats, OutputsIdentical: true,
		PrefixOff: Comparison{PrefixCaching: false}, PrefixOn: Comparison{PrefixCaching: true},
	}
	ref, err := startReference(ctx, m, wl)
	if err != nil {
		return nil, err
	}
	defer ref.close()
	var floor floorSamples
	for r := range opts.Repeats {
		o := wl
		o.Seed = wl.Seed + uint64(r)
		var answers []*conversation.Run
		for _, c := range []*Comparison{&rep.PrefixOff, &rep.PrefixOn} {
			progress("repetition %d of %d: one-way and bidirectional side by side, P's prefix caching %s, %d conversations × %d turns",
				r+1, opts.Repeats, conversation.OnOff(c.PrefixCaching), wl.Conversations, wl.Turns)
			o.PrefixCaching = c.PrefixCaching
			o.After = nil
			if !c.PrefixCaching {
				// The floor of each last bidirectional turn is sampled right after it.
				o.After = func(ctx context.Context, s *stack.Stack, t conversation.Turn) error {
					if s.Mode != stack.Bidirectional || t.Turn != wl.Turns {
						return nil
					}
					return floor.sample(ctx, ref, t)
				}
			}
			runs, err := conversation.RunSideBySide(ctx, o, nil, stack.OneWay, stack.Bidirectional)
			if err != nil {
				return nil, err
			}
			c.OneWay, c.Bidirectional = append(c.OneWay, runs[0]), append(c.Bidirectional, runs[1])
			answers = append(answers, runs...)
		}
		for _, run := range answers[1:] {
			if same, diff := conversation.SameAnswers(answers[0], run); !same {
				rep.OutputsIdentical = false
				progress("answers differ (%s, P's prefix caching %s): %s", run.Mode, conversation.OnOff(run.PrefixCaching), diff)
			}
		}
	}
	rep.PrefixOff.fill()
	rep.PrefixOn.fill()
	rep.OutputsIdentical = rep.OutputsIdentical && rep.PrefixOff.OutputsIdentical && rep.PrefixOn.OutputsIdentical
	rep.LastTurnPromptTokens = int(lastTurnMean(rep.PrefixOff.Bidirectional, func(t conversation.Turn) float64 { return float64(t.PromptTokens) }) + 0.5)
	rep.Bound = lowerBound(rep.PrefixOff, wl.Turns, floor)
	rep.Targets = targets(rep)
	rep.WallSeconds = time.Since(start).Seconds()
	return rep, nil
}

// fill computes the comparison's figures from its runs.
func (c *Comparison) fill() {
	c.TTFTOneWayMs = conversation.MedianPerTurn(c.OneWay, ttft)
	c.TTFTBidirectionalMs = conversation.MedianPerTurn(c.Bidirectional, ttft)
	c.Ratio = make([]float64, len(c.TTFTOneWayMs))
	for i := range c.Ratio {
		if c.TTFTOneWayMs[i] > 0 {
			c.Ratio[i] = c.TTFTBidirectionalMs[i] / c.TTFTOneWayMs[i]
		}
	}
	if n := len(c.Ratio); n > 0 {
		c.LastTurnRatio = c.Ratio[n-1]
		c.Gain = 1 - c.LastTurnRatio
	}
	c.OutputsIdentical = len(c.OneWay) == len(c.Bidirectional)
	for i := range c.OneWay {
		if same, _ := conversation.SameAnswers(c.OneWay[i], c.Bidirectional[i]); !same {
			c.OutputsIdentical = false
		}
	}
}

// ttft is a turn's time to first token.
func ttft(t conversation.Turn) float64 { return t.TTFTMs }

// lastTurnMean averages f over the last turn's rows of runs.
func lastTurnMean(runs []*conversation.Run, f func(conversation.Turn) float64) float64 {
	if len(runs) == 0 {
		return 0
	}
	return at(conversation.MeanPerTurn(runs, f), runs[0].Turns)
}

// floorSamples are the floor's timings, one set per measured last bidirectional turn.
type floorSamples struct {
	prefill, context, step []float64
}

// sample times, right after the last turn t, the fresh prefill of its new tokens, the same
// tokens over its history, and the one-token step at its end.
func (f *floorSamples) sample(ctx context.Context, ref *reference, t conversation.Turn) error {
	n := max(t.PComputedTokens, 1)
	d, err := ref.ttft(ctx, n)
	if err != nil {
		return err
	}
	f.prefill = append(f.prefill, d)
	if d, err = ref.forward(ctx, t.PromptTokens-n, n); err != nil {
		return err
	}
	f.context = append(f.context, d)
	if d, err = ref.forward(ctx, t.PromptTokens-1, 1); err != nil {
		return err
	}
	f.step = append(f.step, d)
	return nil
}

// lowerBound computes the floor of the bidirectional last turn of c (prefix caching off) from
// the runs' transfer figures, a memcpy ceiling measured now, and the floor's samples.
func lowerBound(c Comparison, turn int, f floorSamples) LowerBound {
	bidi := c.Bidirectional
	b := LowerBound{
		Turn:               turn,
		PReadBytes:         int64(lastTurnMean(bidi, func(t conversation.Turn) float64 { return float64(t.PReadBytes) })),
		DReadBytes:         int64(lastTurnMean(bidi, func(t conversation.Turn) float64 { return float64(t.DReadBytes) })),
		MeasuredTransferMs: at(conversation.MedianPerTurn(bidi, func(t conversation.Turn) float64 { return t.PReadMs + t.DReadMs }), turn),
		NewTokens:          int(lastTurnMean(bidi, func(t conversation.Turn) float64 { return float64(t.PComputedTokens) }) + 0.5),
		PrefillNewMs:       stats.Median(f.prefill),
		ContextPrefillMs:   stats.Median(f.context),
		DStepMs:            stats.Median(f.step),
		MeasuredMs:         at(c.TTFTBidirectionalMs, turn),
	}
	if moved := b.PReadBytes + b.DReadBytes; moved > 0 {
		b.CeilingGBps = kernel.MemcpyGBps(int(moved))
		b.TransferMs = float64(moved) / (b.CeilingGBps * 1e9) * 1e3
	}
	b.BoundMs = b.TransferMs + b.PrefillNewMs
	if b.BoundMs > 0 {
		b.Factor = b.MeasuredMs / b.BoundMs
	}
	b.ComputeFloorMs = b.TransferMs + b.ContextPrefillMs + b.DStepMs
	if b.ComputeFloorMs > 0 {
		b.OverheadFactor = b.MeasuredMs / b.ComputeFloorMs
	}
	return b
}

// reference is a fresh engine (no connector, no prefix caching) that times prefills of random
// token-id prompts, and a KV pool of its own for timing bare forward steps.
type reference struct {
	e   *stack.Engine
	m   *model.Model
	tr  *http.Transport
	hc  *http.Client
	rng *rand.Rand

	bs     int
	pool   *kvcache.Pool
	blocks []int32
	tokens []int32
	logits []float32
}

// startReference starts the reference engine, sized for prompts up to the workload's context,
// and warms it up.
func startReference(ctx context.Context, m *model.Model, wl conversation.Options) (*reference, error) {
	maxLen := wl.MaxModelLen()
	e, err := stack.StartEngine(ctx, stack.EngineConfig{
		Name: "reference", Model: m, BlockSize: wl.BlockSize, NumBlocks: maxLen/wl.BlockSize + 8, MaxModelLen: maxLen, Logger: wl.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("bidibench: start the reference engine: %w", err)
	}
	tr := stack.NewTransport(16)
	r := &reference{
		e: e, m: m, tr: tr, hc: &http.Client{Transport: tr}, rng: rand.New(rand.NewPCG(wl.Seed, 0xb0d)),
		bs: wl.BlockSize, logits: make([]float32, m.Config().VocabSize),
	}
	geo := engine.KVGeometry(m, wl.BlockSize)
	n := maxLen / wl.BlockSize
	if r.pool, err = kvcache.NewPool(kvcache.AlignedMemory(n*geo.BlockBytes()), kvcache.PoolConfig{Geometry: geo, NumBlocks: n}); err != nil {
		r.close()
		return nil, fmt.Errorf("bidibench: %w", err)
	}
	if r.blocks, err = r.pool.Allocate(n); err != nil {
		r.close()
		return nil, fmt.Errorf("bidibench: %w", err)
	}
	r.tokens = r.randomTokens(maxLen)
	if _, err := r.ttft(ctx, wl.UserTokens); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

func (r *reference) randomTokens(n int) []int32 {
	vocab := min(r.m.Tokenizer().VocabSize(), r.m.Config().VocabSize)
	p := make([]int32, n)
	for j := range p {
		p[j] = int32(r.rng.IntN(vocab))
	}
	return p
}

// ttft returns the time to first token, as a streaming client sees it, of a new random n-token
// prompt with max_tokens 1.
func (r *reference) ttft(ctx context.Context, n int) (float64, error) {
	url := r.e.URL() + "/v1/completions"
	reply, err := apiclient.Post(ctx, r.hc, url, map[string]any{
		"model": r.m.Name(), "prompt": r.randomTokens(n), "max_tokens": 1, "temperature": 0, "ignore_eos": true, "stream": true,
	}, nil)
	if err == nil {
		err = reply.Check(url)
	}
	if err != nil {
		return 0, fmt.Errorf("bidibench: reference prefill: %w", err)
	}
	return stats.Ms(reply.TTFT), nil
}

// forward times one bare forward step of n tokens at positions [start, start+n) over the
// reference pool (whatever KV it holds, the work is the same), in milliseconds.
func (r *reference) forward(ctx context.Context, start, n int) (float64, error) {
	end := start + n
	if start < 0 || end > len(r.tokens) {
		return 0, fmt.Errorf("bidibench: a forward step over [%d, %d) exceeds the reference context of %d", start, end, len(r.tokens))
	}
	seq := []model.Seq{{Tokens: r.tokens[start:end], Start: start, Blocks: r.blocks[:(end+r.bs-1)/r.bs], Logits: r.logits}}
	t0 := time.Now()
	if err := r.m.Forward(ctx, r.pool, r.bs, seq); err != nil {
		return 0, fmt.Errorf("bidibench: reference forward: %w", err)
	}
	return stats.Ms(time.Since(t0)), nil
}

func (r *reference) close() {
	r.tr.CloseIdleConnections()
	r.e.Close()
	if r.pool != nil && r.blocks != nil {
		r.pool.Free(r.blocks...)
	}
}

// targets checks the goals against rep.
func targets(rep *Report) []Target {
	off, on, b := rep.PrefixOff, rep.PrefixOn, rep.Bound
	last := rep.Turns
	return []Target{
		{
			Name:   fmt.Sprintf("history by turn %d", last),
			Goal:   "≥ 2,000 tokens by turn 8",
			Result: fmt.Sprintf("%d tokens", rep.LastTurnPromptTokens),
			Met:    rep.LastTurnPromptTokens >= 2000 && last >= 8,
		},
		{
			Name:   fmt.Sprintf("prefix caching off: turn-%d TTFT bidirectional ÷ one-way", last),
			Goal:   "≤ 0.20 (1/5)",
			Result: fmt.Sprintf("%.3f (%.1f ms ÷ %.1f ms; 1/%.1f)", off.LastTurnRatio, at(off.TTFTBidirectionalMs, last), at(off.TTFTOneWayMs, last), 1/off.LastTurnRatio),
			Met:    off.LastTurnRatio > 0 && off.LastTurnRatio <= 0.2,
		},
		{
			Name: fmt.Sprintf("prefix caching off: turn-%d bidirectional TTFT ÷ lower bound", last),
			Goal: "≤ 2",
			Result: fmt.Sprintf("%.2f (%.1f ms ÷ (%.2f ms transfer at %.1f GB/s + %.1f ms prefill of %d new tokens))",
				b.Factor, b.MeasuredMs, b.TransferMs, b.CeilingGBps, b.PrefillNewMs, b.NewTokens),
			Met: b.Factor > 0 && b.Factor <= 2,
		},
		{
			Name:          fmt.Sprintf("prefix caching on: turn-%d TTFT gain of bidirectional", last),
			Goal:          "report (vLLM reports 18–41%)",
			Result:        fmt.Sprintf("%.1f%% (%.1f ms → %.1f ms)", 100*on.Gain, at(on.TTFTOneWayMs, last), at(on.TTFTBidirectionalMs, last)),
			Met:           on.Gain > 0,
			Informational: true,
		},
		{
			Name:   "outputs identical across modes",
			Goal:   "yes",
			Result: yesNo(rep.OutputsIdentical),
			Met:    rep.OutputsIdentical,
		},
	}
}

// at returns the value of turn (from 1), or 0.
func at(xs []float64, turn int) float64 {
	if turn < 1 || turn > len(xs) {
		return 0
	}
	return xs[turn-1]
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
