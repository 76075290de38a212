package bidibench

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

// Options configure a multi-turn workload and the stack it runs on. Zero values take the
// defaults noted on each field.
type Options struct {
	// Model is the model to open (default kvbridge/small) unless OpenedModel is set; an opened
	// model is shared and not closed.
	Model       string
	OpenedModel *model.Model
	// Mode is one-way or bidirectional (default bidirectional).
	Mode Mode
	// PrefixCaching turns P's prefix cache on (default off, vLLM's --no-enable-prefix-caching
	// evaluation).
	PrefixCaching bool
	// Conversations (default 2) run interleaved, one request at a time, for Turns turns each
	// (default 8).
	Conversations, Turns int
	// UserTokens is the length of every user message in tokens (default 212: with 32-token answers
	// the history passes 2,000 tokens by turn 8); AnswerTokens the length of every answer
	// (default 32; greedy, EOS ignored).
	UserTokens, AnswerTokens int
	// BlockSize is the KV block size (default 16); NumBlocks each engine's pool (default: three
	// times what the conversations' longest histories need).
	BlockSize, NumBlocks int
	// Seed chooses the user messages (default 1).
	Seed uint64
	// Progress, if non-nil, receives one line per turn.
	Progress io.Writer
	// Logger receives the engines' and the proxy's logs; nil discards.
	Logger *slog.Logger

	// after, if set, runs after every measured request (the benchmark samples its floor right
	// after the turns it bounds, on the same machine weather).
	after func(ctx context.Context, s *Stack, t Turn) error
}

// Default workload sizes.
const (
	DefaultConversations = 2
	DefaultTurns         = 8
	DefaultUserTokens    = 212
	DefaultAnswerTokens  = 32
)

func (o *Options) defaults() {
	if o.Model == "" {
		o.Model = model.Small
	}
	if o.Mode == "" {
		o.Mode = ModeBidirectional
	}
	if o.Conversations <= 0 {
		o.Conversations = DefaultConversations
	}
	if o.Turns <= 0 {
		o.Turns = DefaultTurns
	}
	if o.UserTokens <= 0 {
		o.UserTokens = DefaultUserTokens
	}
	if o.AnswerTokens <= 0 {
		o.AnswerTokens = DefaultAnswerTokens
	}
	if o.BlockSize <= 0 {
		o.BlockSize = 16
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
}

// maxModelLen is the context the workload needs: the last turn's prompt and answer, with room
// for the chat template, rounded up to whole blocks.
func (o *Options) maxModelLen() int {
	n := o.Turns*(o.UserTokens+o.AnswerTokens+16) + 256
	n += n / 4
	return (n + o.BlockSize - 1) / o.BlockSize * o.BlockSize
}

func (o *Options) numBlocks() int {
	if o.NumBlocks > 0 {
		return o.NumBlocks
	}
	return 3*o.Conversations*(o.maxModelLen()/o.BlockSize) + 32
}

// StackConfig returns the configuration of a stack of mode sized for the workload of o: each
// engine holds three times the blocks of the conversations' longest histories, and its context
// fits the last turn. Model is o.OpenedModel.
func (o Options) StackConfig(mode Mode) StackConfig {
	o.defaults()
	return StackConfig{
		Model: o.OpenedModel, Mode: mode, PrefixCaching: o.PrefixCaching, BlockSize: o.BlockSize,
		NumBlocks: o.numBlocks(), MaxModelLen: o.maxModelLen(), Logger: o.Logger,
	}
}

// Turn is one turn of one conversation as measured.
type Turn struct {
	// Conversation and Turn number from 1.
	Conversation int `json:"conversation"`
	Turn         int `json:"turn"`
	// TTFTMs is the time from sending the request to the first content chunk; LatencyMs to the
	// end of the stream.
	TTFTMs    float64 `json:"ttft_ms"`
	LatencyMs float64 `json:"latency_ms"`
	// Answer is the assistant's text; AnswerTokens its usage.completion_tokens.
	Answer       string `json:"answer"`
	AnswerTokens int    `json:"answer_tokens"`
	// PromptTokens is the prompt's length. On P: PCachedTokens came from its own prefix cache,
	// PPulledTokens were pulled from D, PComputedTokens it computed (from P's engine counters).
	PromptTokens    int `json:"prompt_tokens"`
	PCachedTokens   int `json:"p_cached_tokens"`
	PPulledTokens   int `json:"p_pulled_tokens"`
	PComputedTokens int `json:"p_computed_tokens"`
	// Cache, HeaderPulledTokens and HeaderComputedTokens are the multi-turn proxy's headers
	// (X-KVBridge-Cache, -Prefill-Pulled-Tokens, -Prefill-Computed-Tokens); "" and -1 in one-way
	// mode.
	Cache                string `json:"cache,omitempty"`
	HeaderPulledTokens   int    `json:"header_pulled_tokens"`
	HeaderComputedTokens int    `json:"header_computed_tokens"`
	// DPulledTokens is the prompt tokens D pulled from P.
	DPulledTokens int `json:"d_pulled_tokens"`
	// PReadBytes and PReadMs are P's KV reads from D (bidirectional); DReadBytes and DReadMs D's
	// reads from P (transfer telemetry of each engine: bytes and xferDuration).
	PReadBytes int64   `json:"p_read_bytes"`
	PReadMs    float64 `json:"p_read_ms"`
	DReadBytes int64   `json:"d_read_bytes"`
	DReadMs    float64 `json:"d_read_ms"`
	// PEngineMs and DEngineMs are each engine's own time to first token for this turn (engine
	// accepted the request → first output; vllm:time_to_first_token_seconds): P's includes its
	// read from D and its prefill, D's its read from P and the step that samples the first token.
	// What TTFTMs holds beyond their sum is HTTP, the proxy and the hand-offs between them.
	PEngineMs float64 `json:"p_engine_ms"`
	DEngineMs float64 `json:"d_engine_ms"`
}

// BytesMoved is the KV moved between the engines for this turn, both directions.
func (t Turn) BytesMoved() int64 { return t.PReadBytes + t.DReadBytes }

// Run is one workload's measurements.
type Run struct {
	Model         string  `json:"model"`
	Mode          Mode    `json:"mode"`
	PrefixCaching bool    `json:"prefix_caching"`
	Conversations int     `json:"conversations"`
	Turns         int     `json:"turns"`
	UserTokens    int     `json:"user_tokens"`
	AnswerTokens  int     `json:"answer_tokens"`
	WallMs        float64 `json:"wall_ms"`
	// Rows are in the order sent: turn 1 of every conversation, then turn 2, and so on.
	Rows []Turn `json:"rows"`
}

// TTFTPerTurn returns each turn's TTFT in milliseconds, the mean over the conversations.
func (r *Run) TTFTPerTurn() []float64 {
	return r.meanPerTurn(func(t Turn) float64 { return t.TTFTMs })
}

// meanPerTurn averages f over the conversations of each turn.
func (r *Run) meanPerTurn(f func(Turn) float64) []float64 {
	sum := make([]float64, r.Turns)
	n := make([]int, r.Turns)
	for _, t := range r.Rows {
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

// BytesPerTurn returns the KV bytes moved in each turn, summed over the conversations.
func (r *Run) BytesPerTurn() []int64 {
	out := make([]int64, r.Turns)
	for _, t := range r.Rows {
		out[t.Turn-1] += t.BytesMoved()
	}
	return out
}

// BytesMoved is the KV moved between the engines over the whole run.
func (r *Run) BytesMoved() int64 {
	var n int64
	for _, t := range r.Rows {
		n += t.BytesMoved()
	}
	return n
}

// Answers returns the answers indexed by conversation then turn (both from 0).
func (r *Run) Answers() [][]string {
	out := make([][]string, r.Conversations)
	for c := range out {
		out[c] = make([]string, r.Turns)
	}
	for _, t := range r.Rows {
		out[t.Conversation-1][t.Turn-1] = t.Answer
	}
	return out
}

// SameAnswers reports whether two runs of the same workload gave the same answers, and the first
// turn where they differ.
func SameAnswers(a, b *Run) (bool, string) {
	x, y := a.Answers(), b.Answers()
	if len(x) != len(y) {
		return false, fmt.Sprintf("%d conversations against %d", len(x), len(y))
	}
	for c := range x {
		if len(x[c]) != len(y[c]) {
			return false, fmt.Sprintf("conversation %d: %d turns against %d", c+1, len(x[c]), len(y[c]))
		}
		for t := range x[c] {
			if x[c][t] != y[c][t] {
				return false, fmt.Sprintf("conversation %d turn %d: %q against %q", c+1, t+1, x[c][t], y[c][t])
			}
		}
	}
	return true, ""
}

// RunWorkload starts a stack for opts.Mode, drives the workload through it, closes it and checks
// that every KV block went back to its pool.
func RunWorkload(ctx context.Context, opts Options) (*Run, error) {
	opts.defaults()
	runs, err := RunSideBySide(ctx, opts, opts.Mode)
	if len(runs) == 0 {
		return nil, err
	}
	return runs[0], err
}

// RunSideBySide starts one stack per mode (P's prefix caching as opts says) and drives the same
// workload through all of them in lockstep (see DriveSideBySide), then closes them and checks
// that every KV block went back to its pool. The runs are in the order of modes.
func RunSideBySide(ctx context.Context, opts Options, modes ...Mode) (_ []*Run, err error) {
	opts.defaults()
	m := opts.OpenedModel
	if m == nil {
		if m, err = model.Open(ctx, opts.Model, model.OpenOptions{}); err != nil {
			return nil, fmt.Errorf("bidibench: %w", err)
		}
		defer m.Close()
	}
	var stacks []*Stack
	defer func() {
		for _, s := range stacks {
			if cerr := s.Close(); cerr != nil && err == nil {
				err = fmt.Errorf("bidibench: closing the %s stack: %w", s.Mode, cerr)
			}
			for name, in := range map[string]*instance.Instance{"P": s.P, "D": s.D} {
				if free, all := in.Pool.NumFree(), in.Pool.NumBlocks(); free != all && err == nil {
					err = fmt.Errorf("bidibench: %s's %s leaked KV blocks: %d of %d free after close", s.Mode, name, free, all)
				}
			}
		}
	}()
	for _, mode := range modes {
		cfg := opts.StackConfig(mode)
		cfg.Model = m
		s, err := StartStack(ctx, cfg)
		if err != nil {
			return nil, err
		}
		stacks = append(stacks, s)
	}
	return DriveSideBySide(ctx, stacks, opts)
}

// Drive runs the workload of opts against a running stack: the conversations interleaved turn by
// turn, one streaming request at a time, each answer appended to its conversation's history.
func Drive(ctx context.Context, s *Stack, opts Options) (*Run, error) {
	runs, err := DriveSideBySide(ctx, []*Stack{s}, opts)
	if len(runs) == 0 {
		return nil, err
	}
	return runs[0], err
}

// DriveSideBySide runs the workload of opts against every stack in lockstep: each turn of each
// conversation goes to one stack after the other (the first stack first on odd turns, the last
// first on even ones), one request at a time, so that a slow spell of a shared machine falls on
// all of them alike. Each stack's conversations carry that stack's own answers. Only one request
// is ever in flight, so each engine's counters and transfer samples around a request are that
// request's.
func DriveSideBySide(ctx context.Context, stacks []*Stack, opts Options) ([]*Run, error) {
	opts.defaults()
	if len(stacks) == 0 {
		return nil, nil
	}
	m := stacks[0].P.Model
	convs := scripts(m.Tokenizer(), opts.Seed, opts.Conversations, opts.Turns, opts.UserTokens)
	runs := make([]*Run, len(stacks))
	history := make([][][]chatMessage, len(stacks))
	for i, s := range stacks {
		runs[i] = &Run{
			Model: m.Name(), Mode: s.Mode, PrefixCaching: s.PrefixCaching, Conversations: opts.Conversations,
			Turns: opts.Turns, UserTokens: opts.UserTokens, AnswerTokens: opts.AnswerTokens,
		}
		history[i] = make([][]chatMessage, len(convs))
	}
	tr := newTransport()
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	wall := make([]time.Duration, len(stacks))
	for turn := range opts.Turns {
		for c, conv := range convs {
			for k := range stacks {
				i := k
				if turn%2 == 1 {
					i = len(stacks) - 1 - k
				}
				s := stacks[i]
				history[i][c] = append(history[i][c], chatMessage{Role: "user", Content: conv.users[turn]})
				body := map[string]any{
					"model": m.Name(), "messages": history[i][c], "max_tokens": opts.AnswerTokens, "temperature": 0,
					"ignore_eos": true, "stream": true, "stream_options": map[string]any{"include_usage": true},
				}
				if s.Mode == ModeBidirectional {
					body["conversation_id"] = conv.id
				}
				t0 := time.Now()
				row, err := measureTurn(ctx, s, hc, body)
				wall[i] += time.Since(t0)
				if err != nil {
					return runs, fmt.Errorf("bidibench: %s, conversation %d turn %d: %w", s.Mode, c+1, turn+1, err)
				}
				row.Conversation, row.Turn = c+1, turn+1
				runs[i].Rows = append(runs[i].Rows, row)
				if opts.after != nil {
					if err := opts.after(ctx, s, row); err != nil {
						return runs, err
					}
				}
				history[i][c] = append(history[i][c], chatMessage{Role: "assistant", Content: row.Answer})
				if opts.Progress != nil {
					fmt.Fprintf(opts.Progress, "  %-13s P prefix caching %-3s  conversation %d turn %d: prompt %4d tokens, P computed %4d, pulled %4d; TTFT %7.1f ms\n",
						s.Mode, onOff(s.PrefixCaching), c+1, turn+1, row.PromptTokens, row.PComputedTokens, row.PPulledTokens, row.TTFTMs)
				}
			}
		}
	}
	for i := range runs {
		runs[i].WallMs = ms(wall[i])
	}
	return runs, nil
}

// measureTurn sends one turn and reads what each engine did for it from their counters and
// transfer telemetry (requests are sent one at a time, so the differences are this turn's).
func measureTurn(ctx context.Context, s *Stack, hc *http.Client, body map[string]any) (Turn, error) {
	pn, dn := s.P.Metrics.Nixl(), s.D.Metrics.Nixl()
	pn.TakeInterval()
	dn.TakeInterval()
	p0, d0 := s.P.Engine.Stats(), s.D.Engine.Stats()
	pt0, err := s.P.Registry.TimeToFirstTokenTotal()
	if err != nil {
		return Turn{}, err
	}
	dt0, err := s.D.Registry.TimeToFirstTokenTotal()
	if err != nil {
		return Turn{}, err
	}
	r, err := streamChat(ctx, hc, s.URL+"/v1/chat/completions", body)
	if err != nil {
		return Turn{}, err
	}
	p1, d1 := s.P.Engine.Stats(), s.D.Engine.Stats()
	pt1, err := s.P.Registry.TimeToFirstTokenTotal()
	if err != nil {
		return Turn{}, err
	}
	dt1, err := s.D.Registry.TimeToFirstTokenTotal()
	if err != nil {
		return Turn{}, err
	}
	t := Turn{
		TTFTMs: ms(r.ttft), LatencyMs: ms(r.latency), Answer: r.text, AnswerTokens: r.outputTokens,
		PromptTokens:  int(p1.PromptTokens - p0.PromptTokens),
		PCachedTokens: int(p1.PrefixHits - p0.PrefixHits), PPulledTokens: int(p1.ExternalHits - p0.ExternalHits),
		DPulledTokens:      int(d1.ExternalHits - d0.ExternalHits),
		Cache:              r.header.Get(proxy.HeaderCache),
		HeaderPulledTokens: headerInt(r.header, proxy.HeaderPulledTokens), HeaderComputedTokens: headerInt(r.header, proxy.HeaderComputedTokens),
	}
	t.PComputedTokens = t.PromptTokens - t.PCachedTokens - t.PPulledTokens
	t.PEngineMs, t.DEngineMs = ms(pt1-pt0), ms(dt1-dt0)
	for _, x := range pn.TakeInterval().Transfers {
		t.PReadBytes += x.Bytes
		t.PReadMs += ms(x.Duration)
	}
	for _, x := range dn.TakeInterval().Transfers {
		t.DReadBytes += x.Bytes
		t.DReadMs += ms(x.Duration)
	}
	if r.promptTokens != 0 && t.PromptTokens != r.promptTokens {
		return t, fmt.Errorf("P counted a %d-token prompt, D %d", t.PromptTokens, r.promptTokens)
	}
	return t, nil
}

// ms converts a duration to milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
