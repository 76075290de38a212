package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// waitTimeout bounds every wait of the engine tests (a hang fails instead of blocking forever).
const waitTimeout = 2 * time.Minute

func openTiny(t *testing.T) *model.Model {
	t.Helper()
	m, err := model.Open(t.Context(), model.Tiny, model.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// newTestEngine starts an engine for m over a real pool of numBlocks blocks of cfg.BlockSize in
// heap memory. At cleanup it asserts the pool is full while the engine still runs (every request
// of the test returned its blocks), then closes the engine.
func newTestEngine(t *testing.T, m *model.Model, numBlocks int, cfg Config) (*Engine, *kvcache.Pool) {
	t.Helper()
	g := KVGeometry(m, cfg.BlockSize)
	pool, err := kvcache.NewPool(kvcache.AlignedMemory(numBlocks*g.BlockBytes()),
		kvcache.PoolConfig{Geometry: g, NumBlocks: numBlocks, PrefixCaching: cfg.PrefixCaching})
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(m, pool, cfg, slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		barrier(t, e)
		assertPoolFull(t, pool)
		if err := e.Close(); err != nil {
			t.Error(err)
		}
		assertPoolFull(t, pool)
	})
	return e, pool
}

// barrier returns once e's step loop has applied every command posted before the call (the
// inbox is FIFO): it runs a one-token request to its end. It does nothing after Close.
func barrier(t *testing.T, e *Engine) {
	t.Helper()
	s, err := e.Add(context.Background(), &Request{Prompt: e.Model().Tokenizer().Encode("x"), MaxTokens: 1})
	if errors.Is(err, ErrClosed) {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	collect(t, s)
}

// result is a stream read to its end.
type result struct {
	tokens  []int32
	text    string
	final   Output
	outputs int
}

// collect reads s until its final Output and checks the stream's shape.
func collect(t *testing.T, s *Stream) result {
	t.Helper()
	return collectAfter(t, s, nil)
}

// collectAfter is collect for a stream of which the outputs read were already consumed.
func collectAfter(t *testing.T, s *Stream, read []Output) result {
	t.Helper()
	var r result
	for _, o := range read {
		r.outputs++
		r.tokens = append(r.tokens, o.Tokens...)
		r.text += o.Text
	}
	timeout := time.After(waitTimeout)
	for {
		select {
		case o, ok := <-s.C():
			if !ok {
				if !r.final.Finished {
					t.Fatalf("stream %s closed without a final output", s.ID())
				}
				return r
			}
			if r.final.Finished {
				t.Fatalf("stream %s: output after the final one", s.ID())
			}
			r.outputs++
			r.tokens = append(r.tokens, o.Tokens...)
			r.text += o.Text
			if o.CompletionTokens != len(r.tokens) {
				t.Fatalf("stream %s: completion tokens %d after %d tokens", s.ID(), o.CompletionTokens, len(r.tokens))
			}
			if o.Finished {
				r.final = o
			}
		case <-timeout:
			t.Fatalf("stream %s: no final output within %v", s.ID(), waitTimeout)
		}
	}
}

// testPrompts returns prompts of the given lengths (printable token ids of the tiny vocab).
func testPrompts(m *model.Model, lengths ...int) [][]int32 {
	tok := m.Tokenizer()
	var out [][]int32
	for i, n := range lengths {
		var p []int32
		for len(p) < n {
			p = append(p, tok.Encode(fmt.Sprintf(" prompt %d says %d and %d;", i, len(p)*31%97, n))...)
		}
		out = append(out, p[:n])
	}
	return out
}

// greedy returns r with greedy sampling and the given limits.
func greedy(id string, prompt []int32, maxTokens int) *Request {
	return &Request{ID: id, Prompt: prompt, MaxTokens: maxTokens}
}

// oneAtATime runs each request alone, in order, on a fresh engine without prefix caching or
// chunking, and returns the results.
func oneAtATime(t *testing.T, m *model.Model, blockSize int, reqs []*Request) []result {
	t.Helper()
	out, _ := oneAtATimeSteps(t, m, blockSize, reqs)
	return out
}

// oneAtATimeSteps is oneAtATime that also returns the number of forward steps it took.
func oneAtATimeSteps(t *testing.T, m *model.Model, blockSize int, reqs []*Request) ([]result, int64) {
	t.Helper()
	e, _ := newTestEngine(t, m, 256, Config{BlockSize: blockSize, MaxNumBatchedTokens: 4096})
	var out []result
	for _, r := range reqs {
		s, err := e.Add(t.Context(), r)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, collect(t, s))
	}
	return out, e.Stats().Steps
}

// gate is a Connector that holds the step loop inside the first AfterAlloc until open is closed:
// a test device that makes every request of a test arrive before the second step, so batching,
// chunking and preemption happen deterministically instead of depending on how fast the loop
// runs. (A real connector must never block.)
type gate struct {
	NoConnector
	once sync.Once
	open chan struct{}
}

func newGate() *gate { return &gate{open: make(chan struct{})} }

func (g *gate) AfterAlloc(*Sequence, []int32, int) {
	g.once.Do(func() {
		select {
		case <-g.open:
		case <-time.After(waitTimeout):
		}
	})
}

// concurrently adds every request from its own goroutine and collects the results. With a gate
// (the engine's connector), all requests are queued before the loop passes the first admission.
func concurrently(t *testing.T, e *Engine, g *gate, reqs []*Request) []result {
	t.Helper()
	out := make([]result, len(reqs))
	errs := make([]error, len(reqs))
	streams := make([]*Stream, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Go(func() { streams[i], errs[i] = e.Add(t.Context(), r) })
	}
	wg.Wait()
	if g != nil {
		close(g.open)
	}
	for i := range reqs {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		out[i] = collect(t, streams[i])
	}
	return out
}

func sameResults(t *testing.T, what string, got, want []result) {
	t.Helper()
	for i := range want {
		if !slices.Equal(got[i].tokens, want[i].tokens) || got[i].text != want[i].text ||
			got[i].final.FinishReason != want[i].final.FinishReason {
			t.Errorf("%s: request %d: %v %q (%s), want %v %q (%s)", what, i,
				got[i].tokens, got[i].text, got[i].final.FinishReason,
				want[i].tokens, want[i].text, want[i].final.FinishReason)
		}
	}
}

func TestEngineBatchedEqualsOneAtATime(t *testing.T) {
	m := openTiny(t)
	const bs = 16
	prompts := testPrompts(m, 1, 5, 15, 16, 17, 32, 33, 47, 48, 70)
	var reqs []*Request
	for i, p := range prompts {
		reqs = append(reqs, greedy(fmt.Sprint("r", i), p, 8+i%5))
	}
	want, seqSteps := oneAtATimeSteps(t, m, bs, reqs)
	for _, r := range want {
		if len(r.tokens) == 0 || r.final.Err != nil {
			t.Fatalf("reference result %+v", r)
		}
	}
	// A small token budget chunks the prefills and mixes them with decodes; a small pool pages.
	g := newGate()
	e, _ := newTestEngine(t, m, 64, Config{BlockSize: bs, MaxNumBatchedTokens: 24, Connector: g})
	got := concurrently(t, e, g, reqs)
	sameResults(t, "batched", got, want)
	for i, r := range got {
		if r.final.PromptTokens != len(prompts[i]) || r.final.CachedTokens != 0 || r.final.CompletionTokens != len(r.tokens) {
			t.Errorf("request %d usage %+v", i, r.final)
		}
		if r.text != m.Tokenizer().DecodeWith(r.tokens, tokenizer.DecodeOptions{SkipSpecial: true}) {
			t.Errorf("request %d: streamed text %q is not the decoded tokens", i, r.text)
		}
	}
	st := e.Stats()
	if st.Steps == 0 || st.GenerationTokens == 0 || st.PromptTokens != int64(lenAll(prompts)) {
		t.Errorf("stats %+v", st)
	}
	if st.Steps >= seqSteps {
		t.Errorf("%d batched steps, %d one at a time: requests were not batched", st.Steps, seqSteps)
	}
}

func lenAll(ps [][]int32) int {
	n := 0
	for _, p := range ps {
		n += len(p)
	}
	return n
}

func TestEnginePrefixCacheHit(t *testing.T) {
	m := openTiny(t)
	const bs = 16
	base := testPrompts(m, 40)[0]
	reqs := []*Request{greedy("a", base, 6), greedy("b", base, 6), greedy("c", base[:32], 6)}
	want := oneAtATime(t, m, bs, reqs)
	e, _ := newTestEngine(t, m, 64, Config{BlockSize: bs, PrefixCaching: true})
	var got []result
	for _, r := range reqs { // in order, so a's blocks are cached before b arrives
		s, err := e.Add(t.Context(), r)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, collect(t, s))
	}
	sameResults(t, "prefix cache", got, want)
	if got[0].final.CachedTokens != 0 || got[1].final.CachedTokens != 32 || got[2].final.CachedTokens != 16 {
		t.Fatalf("cached tokens %d %d %d, want 0 32 16 (the last prompt token is always computed)",
			got[0].final.CachedTokens, got[1].final.CachedTokens, got[2].final.CachedTokens)
	}
	if st := e.Stats(); st.PrefixQueries != 40+40+32 || st.PrefixHits != 48 {
		t.Fatalf("prefix stats queries %d hits %d", st.PrefixQueries, st.PrefixHits)
	}
}

func TestEnginePreemptionKeepsOutputs(t *testing.T) {
	m := openTiny(t)
	const bs = 4
	prompts := testPrompts(m, 9, 3, 12, 6, 10)
	var reqs []*Request
	for i, p := range prompts {
		r := greedy(fmt.Sprint("r", i), p, 20)
		r.IgnoreEOS = true
		reqs = append(reqs, r)
	}
	want := oneAtATime(t, m, bs, reqs)
	for _, prefix := range []bool{false, true} {
		t.Run(fmt.Sprint("prefix=", prefix), func(t *testing.T) {
			// 16 blocks of 4 = 64 slots for 5 requests growing to 23-32 tokens each.
			g := newGate()
			e, _ := newTestEngine(t, m, 16, Config{BlockSize: bs, MaxModelLen: 64, MaxNumBatchedTokens: 16,
				PrefixCaching: prefix, Connector: g})
			got := concurrently(t, e, g, reqs)
			sameResults(t, "preempted", got, want)
			if e.Stats().Preemptions == 0 {
				t.Fatal("no preemption: the pool is too large for this test")
			}
		})
	}
}

func TestEngineLimitsAndStops(t *testing.T) {
	m := openTiny(t)
	tok := m.Tokenizer()
	const bs = 16
	e, _ := newTestEngine(t, m, 64, Config{BlockSize: bs})
	prompt := testPrompts(m, 20)[0]
	run := func(r *Request) result {
		t.Helper()
		s, err := e.Add(t.Context(), r)
		if err != nil {
			t.Fatal(err)
		}
		return collect(t, s)
	}
	free := greedy("free", prompt, 24)
	free.IgnoreEOS = true
	ref := run(free)
	if ref.final.FinishReason != "length" || len(ref.tokens) != 24 {
		t.Fatalf("max_tokens: %d tokens, reason %s", len(ref.tokens), ref.final.FinishReason)
	}

	t.Run("stop_token_ids", func(t *testing.T) {
		stop := ref.tokens[5]
		first := slices.Index(ref.tokens, stop)
		r := greedy("stopid", prompt, 24)
		r.IgnoreEOS, r.StopTokenIDs = true, []int32{stop}
		got := run(r)
		if got.final.FinishReason != "stop" || !slices.Equal(got.tokens, ref.tokens[:first+1]) {
			t.Fatalf("got %v (%s), want %v (stop)", got.tokens, got.final.FinishReason, ref.tokens[:first+1])
		}
		if want := tok.DecodeWith(ref.tokens[:first], tokenizer.DecodeOptions{SkipSpecial: true}); got.text != want {
			t.Fatalf("text %q, want %q (the stop token's text is not emitted)", got.text, want)
		}
	})

	t.Run("min_tokens masks stop tokens", func(t *testing.T) {
		stop := ref.tokens[0]
		r := greedy("min", prompt, 24)
		r.IgnoreEOS, r.StopTokenIDs, r.MinTokens = true, []int32{stop}, 6
		got := run(r)
		if i := slices.Index(got.tokens, stop); i >= 0 && i < 6 {
			t.Fatalf("stop token sampled at %d before min_tokens: %v", i, got.tokens)
		}
		if len(got.tokens) < 6 {
			t.Fatalf("%d tokens, min_tokens 6", len(got.tokens))
		}
	})

	t.Run("stop string", func(t *testing.T) {
		full := ref.text
		// A stop string from the middle of the greedy text: the output ends right before it.
		var stop string
		for _, w := range strings.Fields(full[len(full)/3:]) {
			if len(w) >= 2 {
				stop = w[:2]
				break
			}
		}
		if stop == "" {
			t.Skipf("greedy text %q has no word to stop at", full)
		}
		r := greedy("stopstr", prompt, 24)
		r.IgnoreEOS, r.Stop = true, []string{"\x00never", stop}
		s, err := e.Add(t.Context(), r)
		if err != nil {
			t.Fatal(err)
		}
		var streamed string
		timeout := time.After(waitTimeout)
		var final Output
		for final.Finished == false {
			select {
			case o := <-s.C():
				streamed += o.Text
				if strings.Contains(streamed, stop) {
					t.Fatalf("stop string %q was emitted: %q", stop, streamed)
				}
				final = o
			case <-timeout:
				t.Fatal("timeout")
			}
		}
		if want := full[:strings.Index(full, stop)]; streamed != want || final.FinishReason != "stop" {
			t.Fatalf("text %q (%s), want %q (stop)", streamed, final.FinishReason, want)
		}
		if final.CompletionTokens >= 24 {
			t.Fatalf("%d tokens: the stop string did not end generation", final.CompletionTokens)
		}
	})

	t.Run("max model len", func(t *testing.T) {
		e2, _ := newTestEngine(t, m, 8, Config{BlockSize: bs, MaxModelLen: 26})
		r := greedy("len", prompt, 100)
		r.IgnoreEOS = true
		s, err := e2.Add(t.Context(), r)
		if err != nil {
			t.Fatal(err)
		}
		got := collect(t, s)
		if len(got.tokens) != 6 || got.final.FinishReason != "length" || !slices.Equal(got.tokens, ref.tokens[:6]) {
			t.Fatalf("got %v (%s), want 6 tokens (length)", got.tokens, got.final.FinishReason)
		}
	})
}

func TestEngineSeededSamplingIsReproducible(t *testing.T) {
	m := openTiny(t)
	e, _ := newTestEngine(t, m, 64, Config{BlockSize: 16, MaxNumBatchedTokens: 16})
	p := testPrompts(m, 21, 9)
	mk := func(id string, prompt []int32, seed int64) *Request {
		return &Request{ID: id, Prompt: prompt, MaxTokens: 12,
			Sampling: model.SamplingParams{Temperature: 0.9, TopP: 0.95, TopK: 50, Seed: seed}}
	}
	got := concurrently(t, e, nil, []*Request{mk("a", p[0], 7), mk("b", p[1], 8), mk("c", p[0], 7)})
	if !slices.Equal(got[0].tokens, got[2].tokens) {
		t.Fatalf("same seed, different draws: %v vs %v", got[0].tokens, got[2].tokens)
	}
	alone := oneAtATime(t, m, 16, []*Request{mk("a", p[0], 7)})
	if !slices.Equal(alone[0].tokens, got[0].tokens) {
		t.Fatalf("seeded sampling depends on batching: %v vs %v", alone[0].tokens, got[0].tokens)
	}
}

func TestEngineAddValidation(t *testing.T) {
	m := openTiny(t)
	e, _ := newTestEngine(t, m, 8, Config{BlockSize: 16, MaxModelLen: 64})
	p := testPrompts(m, 70)[0]
	cases := []struct {
		name string
		r    *Request
		want []error
	}{
		{"empty prompt", &Request{MaxTokens: 4}, []error{ErrInvalidRequest}},
		{"prompt too long", &Request{Prompt: p[:64], MaxTokens: 4}, []error{ErrPromptTooLong, ErrInvalidRequest}},
		{"max_tokens 0", &Request{Prompt: p[:4]}, []error{ErrInvalidRequest}},
		{"max_tokens negative", &Request{Prompt: p[:4], MaxTokens: -1}, []error{ErrInvalidRequest}},
		{"min above max", &Request{Prompt: p[:4], MaxTokens: 2, MinTokens: 3}, []error{ErrInvalidRequest}},
		{"token out of vocab", &Request{Prompt: []int32{1, 1 << 30}, MaxTokens: 2}, []error{ErrInvalidRequest}},
		{"negative token", &Request{Prompt: []int32{-1}, MaxTokens: 2}, []error{ErrInvalidRequest}},
		{"nil", nil, []error{ErrInvalidRequest}},
	}
	for _, c := range cases {
		_, err := e.Add(t.Context(), c.r)
		for _, w := range c.want {
			if !errors.Is(err, w) {
				t.Errorf("%s: err %v, want %v", c.name, err, w)
			}
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := e.Add(ctx, &Request{Prompt: p[:4], MaxTokens: 2}); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled context: %v", err)
	}
	// A duplicate id is refused while the first is live.
	ctx, cancel = context.WithCancel(t.Context())
	s, err := e.Add(ctx, &Request{ID: "x", Prompt: p[:4], MaxTokens: 40, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Add(t.Context(), &Request{ID: "x", Prompt: p[:4], MaxTokens: 2}); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("duplicate id: %v", err)
	}
	cancel()
	collect(t, s)
	// Default ids are distinct.
	s1, _ := e.Add(t.Context(), &Request{Prompt: p[:4], MaxTokens: 1})
	s2, _ := e.Add(t.Context(), &Request{Prompt: p[:4], MaxTokens: 1})
	if s1.ID() == "" || s1.ID() == s2.ID() {
		t.Errorf("default ids %q %q", s1.ID(), s2.ID())
	}
	collect(t, s1)
	collect(t, s2)
}

// pauseObserver holds the step loop when request id samples its first token, until resume is
// closed: a test device to act "mid-stream" deterministically (the tiny model would otherwise
// finish a request before the test gets to act). paused is closed when the loop is held.
type pauseObserver struct {
	id     string
	paused chan struct{}
	resume chan struct{}
	quit   <-chan struct{} // optional: also resume when the engine is closing
}

func newPause(id string) *pauseObserver {
	return &pauseObserver{id: id, paused: make(chan struct{}), resume: make(chan struct{})}
}

func (p *pauseObserver) FirstToken(id string, _ time.Duration) {
	if id != p.id {
		return
	}
	close(p.paused)
	select {
	case <-p.resume:
	case <-p.quit:
	case <-time.After(waitTimeout):
	}
}

func (p *pauseObserver) Finished(RequestMetrics) {}
func (p *pauseObserver) Stepped(StepMetrics)     {}

func TestEngineClientCancelFreesBlocks(t *testing.T) {
	m := openTiny(t)
	pause := newPause("a")
	e, pool := newTestEngine(t, m, 32, Config{BlockSize: 4, PrefixCaching: true, Observer: pause})
	p := testPrompts(m, 30, 11)
	// One client reads its first output then goes away; another never reads and goes away.
	// "a" is added first: the loop pauses at its first token, before "b" (added after it) can
	// have finished, however the goroutines are scheduled.
	ctx, cancel := context.WithCancel(t.Context())
	s, err := e.Add(ctx, &Request{ID: "a", Prompt: p[0], MaxTokens: 90, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx2, cancel2 := context.WithCancel(t.Context())
	s2, err := e.Add(ctx2, &Request{ID: "b", Prompt: p[1], MaxTokens: 90, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	recv(t, pause.paused)
	if pool.NumFree() == pool.NumBlocks() {
		t.Fatal("no blocks in use mid-stream")
	}
	cancel()
	cancel2()
	close(pause.resume)
	read := readN(t, s, 1)
	for i, st := range []*Stream{s, s2} {
		r := collectAfter(t, st, [][]Output{read, nil}[i])
		if r.final.FinishReason != "abort" || !errors.Is(r.final.Err, ErrAborted) {
			t.Fatalf("final output %+v", r.final)
		}
	}
	assertPoolFull(t, pool)
	if st := e.Stats(); st.Running != 0 || st.Waiting != 0 || st.KVUsage != 0 {
		t.Fatalf("stats after cancel %+v", st)
	}
}

// readN reads n outputs of s.
func readN(t *testing.T, s *Stream, n int) []Output {
	t.Helper()
	var out []Output
	timeout := time.After(waitTimeout)
	for len(out) < n {
		select {
		case o := <-s.C():
			out = append(out, o)
		case <-timeout:
			t.Fatal("timeout")
		}
	}
	return out
}

// finishSignal is an Observer that reports finished request ids on a channel.
type finishSignal chan string

func (finishSignal) FirstToken(string, time.Duration) {}
func (f finishSignal) Finished(m RequestMetrics)      { f <- m.ID }
func (finishSignal) Stepped(StepMetrics)              {}

func TestEngineSlowReaderNeverBlocksTheLoop(t *testing.T) {
	m := openTiny(t)
	done := make(finishSignal, 4)
	e, _ := newTestEngine(t, m, 64, Config{BlockSize: 16, Observer: done})
	p := testPrompts(m, 8, 8)
	slow, err := e.Add(t.Context(), &Request{Prompt: p[0], MaxTokens: 200, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	// While slow is not read at all, another request completes: the loop is not stuck on it.
	fast, err := e.Add(t.Context(), &Request{Prompt: p[1], MaxTokens: 150, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, fast); len(r.tokens) != 150 {
		t.Fatalf("fast: %d tokens", len(r.tokens))
	}
	// Wait until slow has finished without reading it: its 200 tokens were coalesced into at
	// most a buffer's worth of outputs.
	for range 2 {
		select {
		case <-done:
		case <-time.After(waitTimeout):
			t.Fatal("timeout")
		}
	}
	r := collect(t, slow)
	if len(r.tokens) != 200 || r.outputs > maxStreamBuffer+1 {
		t.Fatalf("slow: %d tokens in %d outputs", len(r.tokens), r.outputs)
	}
}

// recordingObserver counts observations.
type recordingObserver struct {
	mu       sync.Mutex
	ttft     map[string]time.Duration
	finished map[string]RequestMetrics
	steps    StepMetrics // summed
}

func (o *recordingObserver) Stepped(s StepMetrics) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.steps.Tokens += s.Tokens
	o.steps.LocalCompute += s.LocalCompute
	o.steps.LocalCacheHit += s.LocalCacheHit
	o.steps.ExternalKVTransfer += s.ExternalKVTransfer
}

func (o *recordingObserver) FirstToken(id string, d time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.ttft[id] = d
}

func (o *recordingObserver) Finished(m RequestMetrics) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.finished[m.ID] = m
}

func TestEngineObserver(t *testing.T) {
	m := openTiny(t)
	obs := &recordingObserver{ttft: map[string]time.Duration{}, finished: map[string]RequestMetrics{}}
	e, _ := newTestEngine(t, m, 64, Config{BlockSize: 16, Observer: obs})
	p := testPrompts(m, 10, 20)
	got := concurrently(t, e, nil, []*Request{greedy("a", p[0], 5), greedy("b", p[1], 7)})
	obs.mu.Lock()
	defer obs.mu.Unlock()
	for i, id := range []string{"a", "b"} {
		f, ok := obs.finished[id]
		if _, first := obs.ttft[id]; !ok || !first {
			t.Fatalf("%s: observations missing", id)
		}
		if f.CompletionTokens != len(got[i].tokens) || f.PromptTokens != len(p[i]) || f.E2E < f.TTFT || f.FinishReason != got[i].final.FinishReason {
			t.Fatalf("%s: metrics %+v", id, f)
		}
		// vLLM's phases: queue then prefill make the time to first token; prefill then decode
		// the time running.
		if !f.Scheduled || f.Queue+f.Prefill != f.TTFT || f.Prefill+f.Decode != f.Inference || f.Decode < 0 || f.MaxTokens != []int{5, 7}[i] {
			t.Fatalf("%s: phases %+v", id, f)
		}
	}
	// Every prompt token was computed here, and every step's tokens were: the prompts and every
	// sampled token but the last of each request.
	want := StepMetrics{Tokens: len(p[0]) + len(got[0].tokens) - 1 + len(p[1]) + len(got[1].tokens) - 1, LocalCompute: len(p[0]) + len(p[1])}
	if obs.steps != want {
		t.Fatalf("steps summed to %+v, want %+v", obs.steps, want)
	}
}

func TestEngineForwardErrorFinishesRequests(t *testing.T) {
	m := openTiny(t)
	e, _ := newTestEngine(t, m, 16, Config{BlockSize: 16})
	m.Close() // every later Forward fails with model.ErrClosed
	s, err := e.Add(t.Context(), greedy("a", testPrompts(m, 5)[0], 4))
	if err != nil {
		t.Fatal(err)
	}
	r := collect(t, s)
	if r.final.FinishReason != "error" || !errors.Is(r.final.Err, ErrForward) || !errors.Is(r.final.Err, model.ErrClosed) {
		t.Fatalf("final %+v", r.final)
	}
}

func TestEngineCloseEndsLiveRequests(t *testing.T) {
	m := openTiny(t)
	pause := newPause("2")
	e, pool := newTestEngine(t, m, 32, Config{BlockSize: 16, MaxNumBatchedTokens: 16, Observer: pause})
	pause.quit = e.quit // published to the loop by the Adds below
	p := testPrompts(m, 40, 12, 7)
	var streams []*Stream
	for i, pr := range p {
		s, err := e.Add(t.Context(), &Request{ID: fmt.Sprint(i), Prompt: pr, MaxTokens: 500, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	// Close while request 2 is generating and the others are mid-prefill or queued.
	recv(t, pause.paused)
	if err := e.Close(); err != nil { // the held loop resumes once Close has begun
		t.Fatal(err)
	}
	read := readN(t, streams[2], 1)
	if err := e.Close(); err != nil { // idempotent
		t.Fatal(err)
	}
	for i, s := range streams {
		var r result
		if i == 2 {
			r = collectAfter(t, s, read)
		} else {
			r = collect(t, s)
		}
		if r.final.FinishReason != "abort" || !errors.Is(r.final.Err, ErrClosed) {
			t.Fatalf("stream %s final %+v", s.ID(), r.final)
		}
	}
	assertPoolFull(t, pool)
	if _, err := e.Add(t.Context(), greedy("late", p[2], 2)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Add after Close: %v", err)
	}
	e.LoadsDone([]string{"x"}, nil, nil) // no-ops after Close
	e.ReleaseDelayed("x")
	assertNoEngineGoroutines(t)
}

// assertNoEngineGoroutines fails if a goroutine still runs engine code (the step loop or a
// context watcher). Goroutines that are exiting may linger for a moment, so it looks again
// until a deadline. It sees every engine of the process: the engine tests do not run in
// parallel, and every other engine of the calling test must be closed already.
func assertNoEngineGoroutines(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var buf bytes.Buffer
		pprof.Lookup("goroutine").WriteTo(&buf, 1)
		var leaked []string
		for _, g := range strings.Split(buf.String(), "\n\n") {
			if strings.Contains(g, "engine.(*Engine)") {
				leaked = append(leaked, g)
			}
		}
		if len(leaked) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("engine goroutines still running after Close:\n%s", strings.Join(leaked, "\n\n"))
		}
		runtimeYield()
	}
}
