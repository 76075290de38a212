// Package conversation drives scripted multi-turn chat conversations through running P/D stacks
// and measures every turn: the time to first token a client sees, the tokens P computed, found
// in its own prefix cache or pulled from D, each engine's own time to first token, and the KV
// moved each way. `kvbridge demo` and `kvbridge bench bidirectional` run on it. It reads the
// engines through instance.Stats only. See docs/architecture.md for where the package sits.
package conversation

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
	"github.com/kvbridge/kvbridge/stack"
	"github.com/kvbridge/kvbridge/stats"
)

// Options configure a workload and the stacks it runs on. Zero values take the defaults noted
// on each field.
type Options struct {
	// Model is the model of every engine; it is shared, never closed. Required.
	Model *model.Model
	// PrefixCaching turns P's prefix cache on (default off, vLLM's --no-enable-prefix-caching
	// evaluation); D always caches prefixes, as vLLM's default does, so that it pulls from P
	// only what it lacks.
	PrefixCaching bool
	// Conversations (default DefaultConversations) run interleaved, one request at a time, for
	// Turns turns each (default DefaultTurns).
	Conversations, Turns int
	// UserTokens is the length of every user message in tokens (default DefaultUserTokens);
	// AnswerTokens the length of every answer (default DefaultAnswerTokens; greedy, EOS
	// ignored).
	UserTokens, AnswerTokens int
	// BlockSize is the KV block size (default kvcache.DefaultBlockSize); NumBlocks each engine's
	// pool (default: three times what the conversations' longest histories need).
	BlockSize, NumBlocks int
	// Seed chooses the user messages (default 1).
	Seed uint64
	// Progress, if non-nil, receives one line per turn.
	Progress io.Writer
	// Logger receives the engines' and the proxy's logs; nil discards.
	Logger *slog.Logger
	// After, if set, runs after every measured request (a benchmark samples its floor right
	// after the turns it bounds, in the same machine weather).
	After func(ctx context.Context, s *stack.Stack, t Turn) error
}

// Default workload sizes: with 32-token answers the history passes 2,000 tokens by turn 8.
const (
	DefaultConversations = 2
	DefaultTurns         = 8
	DefaultUserTokens    = 212
	DefaultAnswerTokens  = 32
)

// WithDefaults returns o with every default applied.
func (o Options) WithDefaults() Options {
	o.defaults()
	return o
}

func (o *Options) defaults() {
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
		o.BlockSize = kvcache.DefaultBlockSize
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
}

// MaxModelLen is the context the workload needs: the last turn's prompt and answer, with room
// for the chat template, rounded up to whole blocks.
func (o Options) MaxModelLen() int {
	o.defaults()
	n := o.Turns*(o.UserTokens+o.AnswerTokens+16) + 256
	n += n / 4
	return (n + o.BlockSize - 1) / o.BlockSize * o.BlockSize
}

func (o Options) numBlocks() int {
	if o.NumBlocks > 0 {
		return o.NumBlocks
	}
	return 3*o.Conversations*(o.MaxModelLen()/o.BlockSize) + 32
}

// StackConfig returns the configuration of a stack of mode sized for the workload: each engine
// holds three times the blocks of the conversations' longest histories, and its context fits
// the last turn.
func (o Options) StackConfig(mode stack.Mode) stack.Config {
	o.defaults()
	return stack.Config{
		Model: o.Model, Mode: mode, BlockSize: o.BlockSize, NumBlocks: o.numBlocks(), MaxModelLen: o.MaxModelLen(), Logger: o.Logger,
		P: stack.EngineConfig{PrefixCaching: o.PrefixCaching}, D: stack.EngineConfig{PrefixCaching: true},
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
	// PPulledTokens were pulled from D, PComputedTokens it computed (from P's counters).
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

// Run is one workload's measurements on one stack.
type Run struct {
	Model         string     `json:"model"`
	Mode          stack.Mode `json:"mode"`
	PrefixCaching bool       `json:"prefix_caching"`
	Conversations int        `json:"conversations"`
	Turns         int        `json:"turns"`
	UserTokens    int        `json:"user_tokens"`
	AnswerTokens  int        `json:"answer_tokens"`
	WallMs        float64    `json:"wall_ms"`
	// Rows are in the order sent: turn 1 of every conversation, then turn 2, and so on.
	Rows []Turn `json:"rows"`
}

// TTFTPerTurn returns each turn's TTFT in milliseconds, the mean over the conversations.
func (r *Run) TTFTPerTurn() []float64 {
	return MeanPerTurn([]*Run{r}, func(t Turn) float64 { return t.TTFTMs })
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

// perTurn gathers f of every run's rows by turn; runs are of the same workload.
func perTurn(runs []*Run, f func(Turn) float64) [][]float64 {
	if len(runs) == 0 {
		return nil
	}
	per := make([][]float64, runs[0].Turns)
	for _, run := range runs {
		for _, t := range run.Rows {
			per[t.Turn-1] = append(per[t.Turn-1], f(t))
		}
	}
	return per
}

// MeanPerTurn returns, for each turn, the mean of f over that turn's rows of every run.
func MeanPerTurn(runs []*Run, f func(Turn) float64) []float64 {
	return summarize(perTurn(runs, f), stats.Mean)
}

// MedianPerTurn returns, for each turn, the median of f over that turn's rows of every run.
func MedianPerTurn(runs []*Run, f func(Turn) float64) []float64 {
	return summarize(perTurn(runs, f), stats.Median)
}

func summarize(per [][]float64, f func([]float64) float64) []float64 {
	if per == nil {
		return nil
	}
	out := make([]float64, len(per))
	for i, xs := range per {
		out[i] = f(xs)
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

// RunSideBySide starts one stack per mode (see StackConfig) and drives the same workload through
// all of them in lockstep (see DriveSideBySide), then closes them and checks that every KV
// block went back to its pool. The runs are in the order of modes; started, if set, sees each
// stack once it runs.
func RunSideBySide(ctx context.Context, opts Options, started func(*stack.Stack), modes ...stack.Mode) (_ []*Run, err error) {
	var stacks []*stack.Stack
	defer func() {
		for _, s := range stacks {
			if cerr := s.Close(); cerr != nil {
				err = errors.Join(err, fmt.Errorf("closing the %s stack: %w", s.Mode, cerr))
			}
			err = errors.Join(err, s.CheckPools())
		}
	}()
	for _, mode := range modes {
		s, err := stack.Start(ctx, opts.StackConfig(mode))
		if err != nil {
			return nil, err
		}
		stacks = append(stacks, s)
		if started != nil {
			started(s)
		}
	}
	return DriveSideBySide(ctx, stacks, opts)
}

// Drive runs the workload of opts against a running stack: the conversations interleaved turn by
// turn, one streaming request at a time, each answer appended to its conversation's history.
func Drive(ctx context.Context, s *stack.Stack, opts Options) (*Run, error) {
	runs, err := DriveSideBySide(ctx, []*stack.Stack{s}, opts)
	if len(runs) == 0 {
		return nil, err
	}
	return runs[0], err
}

// message is one message of a conversation's history.
type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// DriveSideBySide runs the workload of opts against every stack in lockstep: each turn of each
// conversation goes to one stack after the other (the first stack first on odd turns, the last
// first on even ones), one request at a time, so that a slow spell of a shared machine falls on
// all of them alike. Each stack's conversations carry that stack's own answers. Only one request
// is ever in flight, so each engine's counters around a request are that request's.
func DriveSideBySide(ctx context.Context, stacks []*stack.Stack, opts Options) ([]*Run, error) {
	opts.defaults()
	if len(stacks) == 0 {
		return nil, nil
	}
	m := opts.Model
	if m == nil {
		return nil, errors.New("conversation: no model to write the conversations with")
	}
	convs := scripts(m.Tokenizer(), opts.Seed, opts.Conversations, opts.Turns, opts.UserTokens)
	runs := make([]*Run, len(stacks))
	history := make([][][]message, len(stacks))
	for i, s := range stacks {
		runs[i] = &Run{
			Model: m.Name(), Mode: s.Mode, PrefixCaching: s.PrefixCaching, Conversations: opts.Conversations,
			Turns: opts.Turns, UserTokens: opts.UserTokens, AnswerTokens: opts.AnswerTokens,
		}
		history[i] = make([][]message, len(convs))
	}
	tr := stack.NewTransport(16)
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
				history[i][c] = append(history[i][c], message{Role: "user", Content: conv.users[turn]})
				body := map[string]any{
					"model": m.Name(), "messages": history[i][c], "max_tokens": opts.AnswerTokens, "temperature": 0,
					"ignore_eos": true, "stream": true, "stream_options": map[string]any{"include_usage": true},
				}
				if s.Mode == stack.Bidirectional {
					body["conversation_id"] = conv.id
				}
				t0 := time.Now()
				row, err := measureTurn(ctx, s, hc, body)
				wall[i] += time.Since(t0)
				if err != nil {
					return runs, fmt.Errorf("conversation: %s, conversation %d turn %d: %w", s.Mode, c+1, turn+1, err)
				}
				row.Conversation, row.Turn = c+1, turn+1
				runs[i].Rows = append(runs[i].Rows, row)
				if opts.After != nil {
					if err := opts.After(ctx, s, row); err != nil {
						return runs, err
					}
				}
				history[i][c] = append(history[i][c], message{Role: "assistant", Content: row.Answer})
				if opts.Progress != nil {
					fmt.Fprintf(opts.Progress, "  %-13s P prefix caching %-3s  conversation %d turn %d: prompt %4d tokens, P computed %4d, pulled %4d; TTFT %7.1f ms\n",
						s.Mode, OnOff(s.PrefixCaching), c+1, turn+1, row.PromptTokens, row.PComputedTokens, row.PPulledTokens, row.TTFTMs)
				}
			}
		}
	}
	for i := range runs {
		runs[i].WallMs = stats.Ms(wall[i])
	}
	return runs, nil
}

// measureTurn sends one turn and reads what each engine did for it from the difference of its
// Stats around the request (requests are sent one at a time, so the differences are this
// turn's).
func measureTurn(ctx context.Context, s *stack.Stack, hc *http.Client, body map[string]any) (Turn, error) {
	p0, d0, err := snapshot(s)
	if err != nil {
		return Turn{}, err
	}
	url := s.URL + "/v1/chat/completions"
	r, err := apiclient.Post(ctx, hc, url, body, nil)
	if err == nil {
		err = r.Check(url)
	}
	if err != nil {
		return Turn{}, err
	}
	p1, d1, err := snapshot(s)
	if err != nil {
		return Turn{}, err
	}
	t := Turn{
		TTFTMs: stats.Ms(r.TTFT), LatencyMs: stats.Ms(r.Latency), Answer: r.Text, AnswerTokens: r.CompletionTokens,
		PromptTokens:  int(p1.PromptTokens - p0.PromptTokens),
		PCachedTokens: int(p1.PrefixHitTokens - p0.PrefixHitTokens), PPulledTokens: int(p1.PulledTokens - p0.PulledTokens),
		DPulledTokens:      int(d1.PulledTokens - d0.PulledTokens),
		Cache:              r.Header.Get(proxy.HeaderCache),
		HeaderPulledTokens: headerInt(r.Header, proxy.HeaderPulledTokens), HeaderComputedTokens: headerInt(r.Header, proxy.HeaderComputedTokens),
		PEngineMs: stats.Ms(p1.TTFT - p0.TTFT), DEngineMs: stats.Ms(d1.TTFT - d0.TTFT),
		PReadBytes: p1.TransferBytes - p0.TransferBytes, PReadMs: stats.Ms(p1.TransferTime - p0.TransferTime),
		DReadBytes: d1.TransferBytes - d0.TransferBytes, DReadMs: stats.Ms(d1.TransferTime - d0.TransferTime),
	}
	t.PComputedTokens = t.PromptTokens - t.PCachedTokens - t.PPulledTokens
	if r.PromptTokens != 0 && t.PromptTokens != r.PromptTokens {
		//lint:ignore ST1005 P is the prefill engine's name
		return t, fmt.Errorf("P counted a %d-token prompt, D %d", t.PromptTokens, r.PromptTokens)
	}
	return t, nil
}

// snapshot returns the Stats of P and D.
func snapshot(s *stack.Stack) (p, d instance.Stats, err error) {
	if p, err = s.P.Stats(); err == nil {
		d, err = s.D.Stats()
	}
	return p, d, err
}

// headerInt reads an integer response header; -1 when absent or malformed.
func headerInt(h http.Header, k string) int {
	n, err := strconv.Atoi(h.Get(k))
	if err != nil {
		return -1
	}
	return n
}

// OnOff returns "on" or "off".
func OnOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}
