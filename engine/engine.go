package engine

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// Config configures an Engine. Zero values take the defaults documented on each field; New
// applies them (Engine.Config returns the result).
type Config struct {
	// BlockSize is the KV block size in tokens; 0 = the pool's. It must equal the pool's.
	BlockSize int
	// NumBlocks is the number of KV blocks; 0 = the pool's. It must equal the pool's.
	NumBlocks int
	// MaxModelLen bounds prompt plus output tokens; 0 = the model's MaxPositionEmbeddings,
	// lowered to the pool's capacity. A larger value than either is an error.
	MaxModelLen int
	// MaxNumSeqs caps running requests; 0 = DefaultMaxNumSeqs.
	MaxNumSeqs int
	// MaxNumBatchedTokens caps the tokens of one step (prefills are chunked to fit);
	// 0 = DefaultMaxNumBatchedTokens.
	MaxNumBatchedTokens int
	// PrefixCaching must equal the pool's setting (kvcache.PoolConfig.PrefixCaching).
	PrefixCaching bool
	// Seed seeds the samplers of requests that bring no seed (with their arrival number).
	Seed int64
	// KVLoadFailurePolicy is kv_load_failure_policy (default fail).
	KVLoadFailurePolicy FailurePolicy
	// Connector is the KV connector's scheduler side; nil = NoConnector.
	Connector Connector
	// Observer receives per-request metrics; nil = none.
	Observer Observer
	// KVEvents receives the pool's prefix-cache events (kvcache.Pool.TakeEvents) once per step
	// when set; the pool must record them (kvcache.PoolConfig.RecordEvents). nil = none.
	KVEvents KVEventSink
}

// KVEventSink takes the KV cache events of one engine step, oldest first, on the step loop: it
// must not block (a publisher queues them and drops the oldest when it falls behind).
type KVEventSink interface {
	PublishKVEvents(events []kvcache.Event)
}

// KVGeometry returns the KV block geometry of m's layers with blockSize tokens per block, in the
// default HND layout and m's KV cache dtype: the geometry of the pool an Engine for m needs. On
// tensor-parallel ranks it is one rank's: its KV heads (model.Model.RankKVHeads), and the pool
// needs one memory per rank (kvcache.PoolConfig.RankMemory).
func KVGeometry(m *model.Model, blockSize int) kvcache.Geometry {
	c := m.Config()
	dt, _ := kvcache.ParseDType(m.KVCacheDType()) // the model only says kvcache's names
	_, heads := m.RankKVHeads(0)
	return kvcache.Geometry{NumLayers: c.NumLayers, NumKVHeads: heads, HeadDim: c.HeadDim, BlockSize: blockSize, DType: dt}
}

// shards returns each tensor-parallel rank's view of pool, as the model reads them.
func shards(pool *kvcache.Pool) []model.KVBlocks {
	kv := make([]model.KVBlocks, pool.TensorParallelSize())
	for r := range kv {
		kv[r] = pool.Shard(r)
	}
	return kv
}

// Engine runs requests on a model over a paged KV pool. It owns one step-loop goroutine, started
// by New and ended by Close; all scheduling happens there. Its methods are safe for concurrent
// use.
type Engine struct {
	m        *model.Model
	pool     *kvcache.Pool
	kv       []model.KVBlocks // each tensor-parallel rank's shard of pool
	cfg      Config
	log      *slog.Logger
	obs      Observer
	tok      *tokenizer.Tokenizer
	vocab    int
	suppress []int32

	mu      sync.Mutex
	inbox   []command
	ids     map[string]struct{} // ids of requests live in the engine (including held ones)
	arrived uint64              // requests added, for default ids and seeds
	closed  bool

	wake      chan struct{} // buffered 1: work arrived
	quit      chan struct{} // closed by Close
	done      chan struct{} // closed when the loop has exited
	ctx       context.Context
	cancel    context.CancelFunc
	closeOnce sync.Once

	statsMu sync.Mutex
	stats   Stats

	// Owned by the step loop.
	sched  *Scheduler
	live   map[string]*liveRequest
	logits [][]float32
	raw    []float32 // the model's logits of the request being sampled, for its logprobs
	steps  int64
}

// liveRequest is the step loop's per-request state beside the scheduler's Sequence.
type liveRequest struct {
	req     *Request
	stream  *Stream
	sampler *model.Sampler
	text    *stopText
	ctx     context.Context
	stopCtx func() bool
	seq     *Sequence

	// promptLP collects the prompt logprobs (entry k: prompt token k+1) as prefill chunks
	// compute them; promptSent is set once they went out. lastLP is the logprobs of the token
	// sampled in the current step.
	promptLP   []model.PositionLogprobs
	promptSent bool
	lastLP     *model.PositionLogprobs
}

type commandKind uint8

const (
	cmdAdd commandKind = iota
	cmdAbort
	cmdLoadsDone
	cmdLoadsMissed
	cmdRelease
	cmdResetPrefixCache
)

// command is an event for the step loop.
type command struct {
	kind   commandKind
	live   *liveRequest
	id     string
	ok     []string
	first  map[string]FirstToken
	failed map[string]int
	reply  chan<- bool // cmdResetPrefixCache's result, buffered 1
}

// New starts an engine for m over pool. The pool's geometry must be KVGeometry(m, BlockSize);
// cfg fields that conflict with the pool or the model are errors wrapping ErrConfig. log may be
// nil.
func New(m *model.Model, pool *kvcache.Pool, cfg Config, log *slog.Logger) (*Engine, error) {
	if m == nil || pool == nil {
		return nil, fmt.Errorf("engine: New needs a model and a pool: %w", ErrConfig)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	mc := m.Config()
	g := pool.Geometry()
	if cfg.BlockSize == 0 {
		cfg.BlockSize = g.BlockSize
	}
	if cfg.NumBlocks == 0 {
		cfg.NumBlocks = pool.NumBlocks()
	}
	capacity := pool.NumBlocks() * g.BlockSize
	if cfg.MaxModelLen == 0 {
		cfg.MaxModelLen = capacity
		if mc.MaxPositionEmbeddings > 0 {
			cfg.MaxModelLen = min(capacity, mc.MaxPositionEmbeddings)
		}
	}
	if cfg.MaxNumSeqs == 0 {
		cfg.MaxNumSeqs = DefaultMaxNumSeqs
	}
	if cfg.MaxNumBatchedTokens == 0 {
		cfg.MaxNumBatchedTokens = DefaultMaxNumBatchedTokens
	}
	if cfg.Connector == nil {
		cfg.Connector = NoConnector{}
	}
	if cfg.Observer == nil {
		cfg.Observer = noObserver{}
	}
	switch want := KVGeometry(m, g.BlockSize); {
	case g.NumLayers != want.NumLayers || g.NumKVHeads != want.NumKVHeads || g.HeadDim != want.HeadDim || g.DType != want.DType:
		return nil, fmt.Errorf("engine: pool geometry %+v does not fit model %s (%d layers, %d KV heads of %d): %w",
			g, m.Name(), mc.NumLayers, mc.NumKVHeads, mc.HeadDim, ErrConfig)
	case pool.TensorParallelSize() != m.TensorParallelSize():
		return nil, fmt.Errorf("engine: the pool holds %d tensor-parallel ranks' KV, the model runs on %d: %w",
			pool.TensorParallelSize(), m.TensorParallelSize(), ErrConfig)
	case cfg.BlockSize != g.BlockSize:
		return nil, fmt.Errorf("engine: block size %d, pool has %d: %w", cfg.BlockSize, g.BlockSize, ErrConfig)
	case cfg.NumBlocks != pool.NumBlocks():
		return nil, fmt.Errorf("engine: %d blocks, pool has %d: %w", cfg.NumBlocks, pool.NumBlocks(), ErrConfig)
	case cfg.PrefixCaching != pool.PrefixCaching():
		return nil, fmt.Errorf("engine: prefix caching %v, pool has %v: %w", cfg.PrefixCaching, pool.PrefixCaching(), ErrConfig)
	case mc.MaxPositionEmbeddings > 0 && cfg.MaxModelLen > mc.MaxPositionEmbeddings:
		return nil, fmt.Errorf("engine: max model length %d exceeds the model's %d positions: %w",
			cfg.MaxModelLen, mc.MaxPositionEmbeddings, ErrConfig)
	}
	gen := m.Generation()
	sched, err := NewScheduler(pool, SchedulerConfig{
		MaxModelLen:         cfg.MaxModelLen,
		MaxNumSeqs:          cfg.MaxNumSeqs,
		MaxNumBatchedTokens: cfg.MaxNumBatchedTokens,
		EOSTokenIDs:         gen.EOSTokenIDs,
		LoadFailurePolicy:   cfg.KVLoadFailurePolicy,
		Connector:           cfg.Connector,
		Log:                 log,
	})
	if err != nil {
		return nil, err
	}
	var suppress []int32
	for _, id := range gen.SuppressTokens {
		if id >= 0 && int(id) < mc.VocabSize {
			suppress = append(suppress, id)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &Engine{
		m:        m,
		pool:     pool,
		kv:       shards(pool),
		cfg:      cfg,
		log:      log,
		obs:      cfg.Observer,
		tok:      m.Tokenizer(),
		vocab:    mc.VocabSize,
		suppress: suppress,
		ids:      make(map[string]struct{}),
		wake:     make(chan struct{}, 1),
		quit:     make(chan struct{}),
		done:     make(chan struct{}),
		ctx:      ctx,
		cancel:   cancel,
		sched:    sched,
		live:     make(map[string]*liveRequest),
	}
	e.publish()
	go e.loop()
	return e, nil
}

// Config returns the configuration with defaults applied.
func (e *Engine) Config() Config { return e.cfg }

// Model returns the engine's model.
func (e *Engine) Model() *model.Model { return e.m }

// Pool returns the engine's KV pool.
func (e *Engine) Pool() *kvcache.Pool { return e.pool }

// Add validates r and queues it; its Outputs arrive on the returned Stream until one has
// Finished set. Cancelling ctx (the client went away) aborts the request and frees its blocks.
// Invalid requests fail with errors wrapping ErrInvalidRequest (ErrPromptTooLong for a prompt of
// MaxModelLen tokens or more); after Close, Add fails with ErrClosed. r must not be modified
// afterwards.
func (e *Engine) Add(ctx context.Context, r *Request) (*Stream, error) {
	if err := r.validate(e.cfg.MaxModelLen, e.vocab); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("engine: request %q: %w", r.ID, err)
	}
	rc := *r
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, fmt.Errorf("engine: request %q: %w", r.ID, ErrClosed)
	}
	n := e.arrived
	e.arrived++
	if rc.ID == "" {
		rc.ID = fmt.Sprintf("req-%d", n)
	}
	if _, dup := e.ids[rc.ID]; dup {
		e.mu.Unlock()
		return nil, fmt.Errorf("engine: request id %q is already in use: %w", rc.ID, ErrInvalidRequest)
	}
	e.ids[rc.ID] = struct{}{}
	e.mu.Unlock()

	if rc.Stops == nil && (len(rc.Stop) > 0 || len(rc.StopTokenIDs) > 0) {
		rc.Stops = NewStops(rc.Stop, rc.StopTokenIDs)
	}
	if rc.Sampling.Seed == 0 {
		rc.Sampling.Seed = int64(splitmix64(uint64(e.cfg.Seed) + n))
	}
	l := &liveRequest{
		req:     &rc,
		stream:  newStream(rc.ID, min(rc.MaxTokens, e.cfg.MaxModelLen-len(rc.Prompt))),
		sampler: model.NewSampler(rc.Sampling),
		text:    newStopText(e.tok, rc.Stops, rc.MinTokens),
	}
	if rc.PromptLogprobs {
		l.promptLP = make([]model.PositionLogprobs, len(rc.Prompt)-1)
	}
	id := rc.ID
	// The watcher's abort may reach the loop before the add if ctx ends meanwhile; the loop then
	// sees ctx done when it applies the add (l.ctx), so the request never runs.
	l.ctx = ctx
	l.stopCtx = context.AfterFunc(ctx, func() { e.post(command{kind: cmdAbort, id: id}) })
	if !e.post(command{kind: cmdAdd, live: l}) {
		l.stopCtx()
		e.unreserve(id)
		return nil, fmt.Errorf("engine: request %q: %w", id, ErrClosed)
	}
	return l.stream, nil
}

// LoadsDone reports the connector's finished asynchronous KV loads (see Scheduler.LoadsDone):
// ok lists loaded requests, first the first tokens another engine sampled for some of them
// (their samplers skip its draws), failed maps failed ones to the block-table index of their
// first bad block. It returns at once; the step loop applies it.
func (e *Engine) LoadsDone(ok []string, first map[string]FirstToken, failed map[string]int) {
	e.post(command{kind: cmdLoadsDone, ok: ok, first: first, failed: failed})
}

// LoadsMissed reports the connector's asynchronous loads that found nothing to load (see
// Scheduler.LoadsMissed). It returns at once; the step loop applies it.
func (e *Engine) LoadsMissed(ids []string) {
	e.post(command{kind: cmdLoadsMissed, ok: ids})
}

// ReleaseDelayed frees the blocks the connector held for finished request id (Connector.Finished
// returned delayFree). It returns at once; the step loop applies it.
func (e *Engine) ReleaseDelayed(id string) {
	e.post(command{kind: cmdRelease, id: id})
}

// ResetPrefixCache drops every block from the prefix cache on the step loop, as vLLM's
// reset_prefix_cache (kvcache.Pool.ResetPrefixCache): only when no block is in use — no request
// running or waiting with blocks, none held for the connector. It reports whether it did; the
// reset's KV cache event is published with that loop turn. ctx bounds the wait.
func (e *Engine) ResetPrefixCache(ctx context.Context) (bool, error) {
	reply := make(chan bool, 1)
	if !e.post(command{kind: cmdResetPrefixCache, reply: reply}) {
		return false, fmt.Errorf("engine: reset the prefix cache: %w", ErrClosed)
	}
	select {
	case ok := <-reply:
		return ok, nil
	case <-ctx.Done():
		return false, ctx.Err()
	case <-e.done:
		return false, fmt.Errorf("engine: reset the prefix cache: %w", ErrClosed)
	}
}

// Stats returns a snapshot of the engine's gauges and counters.
func (e *Engine) Stats() Stats {
	e.statsMu.Lock()
	st := e.stats
	e.statsMu.Unlock()
	st.NumBlocks = e.pool.NumBlocks()
	st.FreeBlocks = e.pool.NumFree()
	st.KVUsage = e.pool.Usage()
	return st
}

// Close stops the step loop: requests still live end with FinishAbort and Err
// ErrClosed, blocks held for the connector are released, and the pool is full again. It waits for
// the loop to exit and is idempotent.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() {
		e.mu.Lock()
		e.closed = true
		e.mu.Unlock()
		close(e.quit)
		e.cancel()
	})
	<-e.done
	return nil
}

// post queues c for the step loop and wakes it; it reports false after Close.
func (e *Engine) post(c command) bool {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return false
	}
	e.inbox = append(e.inbox, c)
	e.mu.Unlock()
	select {
	case e.wake <- struct{}{}:
	default:
	}
	return true
}

func (e *Engine) unreserve(id string) {
	e.mu.Lock()
	delete(e.ids, id)
	e.mu.Unlock()
}

// loop is the step loop: apply queued commands, schedule, run one step; sleep on the wake
// channel when there is nothing to run.
func (e *Engine) loop() {
	defer close(e.done)
	for {
		e.mu.Lock()
		cmds, closed := e.inbox, e.closed
		e.inbox = nil
		e.mu.Unlock()
		now := time.Now()
		for _, c := range cmds {
			e.apply(now, c)
		}
		// A cancelled request stops before the next step even if its context watcher has not
		// posted the abort yet: once the client's cancel returns, no further token is computed.
		for id, l := range e.live {
			if l.ctx.Err() != nil {
				e.apply(now, command{kind: cmdAbort, id: id})
			}
		}
		if closed {
			e.shutdown(now)
			return
		}
		plan := e.sched.Schedule(now)
		for _, id := range plan.Released {
			e.unreserve(id) // an evicted hold: its id is free again
		}
		if plan.Empty() {
			e.publish()
			if len(plan.Preempted) > 0 {
				continue // admission is skipped in a step that preempted: try again
			}
			select {
			case <-e.wake:
			case <-e.quit:
			}
			continue
		}
		e.step(plan)
		e.publish()
	}
}

// apply executes one command on the loop.
func (e *Engine) apply(now time.Time, c command) {
	switch c.kind {
	case cmdAdd:
		l := c.live
		q, err := e.sched.Add(l.req, now)
		if err != nil { // validated in Add; kept as a safety net
			l.stopCtx()
			e.unreserve(l.req.ID)
			l.stream.finish(Output{FinishReason: StatusFinishedError.FinishReason(), Err: err,
				PromptTokens: len(l.req.Prompt)})
			return
		}
		l.seq = q
		e.live[q.ID()] = l
		if l.ctx.Err() != nil { // cancelled before the add was applied
			e.apply(now, command{kind: cmdAbort, id: q.ID()})
		}
	case cmdAbort:
		if ev, ok := e.sched.Finish(c.id, StatusFinishedAborted, now); ok {
			e.end(ev, "", false, fmt.Errorf("engine: request %q: %w", c.id, ErrAborted))
		}
	case cmdLoadsDone:
		var tokens []Event
		for _, ev := range e.sched.LoadsDone(now, c.ok, c.first, c.failed) {
			if !ev.HasToken {
				e.end(ev, "", false, ev.Err)
				continue
			}
			if l := e.live[ev.Seq.ID()]; l != nil {
				l.sampler.Skip(c.first[ev.Seq.ID()].Draws)
			}
			tokens = append(tokens, ev)
		}
		if len(tokens) > 0 {
			e.obs.Stepped(promptSources(tokens))
			for _, ev := range tokens {
				e.deliver(now, ev)
			}
		}
	case cmdLoadsMissed:
		e.sched.LoadsMissed(c.ok)
	case cmdRelease:
		if e.sched.ReleaseDelayed(c.id) {
			e.unreserve(c.id)
		}
	case cmdResetPrefixCache:
		c.reply <- e.pool.ResetPrefixCache()
	}
}

// step runs one plan: forward, sample, update, deliver.
func (e *Engine) step(plan Plan) {
	for _, q := range plan.Preempted {
		e.log.Debug("engine: request preempted (KV pool exhausted); it will be recomputed",
			"request_id", q.ID(), "preemptions", q.NumPreemptions())
	}
	for len(e.logits) < len(plan.Work) {
		e.logits = append(e.logits, nil)
	}
	seqs := make([]model.Seq, len(plan.Work))
	for i, w := range plan.Work {
		seqs[i] = model.Seq{Tokens: w.Tokens, Start: w.Start, Blocks: w.Blocks}
		if l := e.live[w.Seq.ID()]; l != nil && l.promptLP != nil && w.Start < len(l.promptLP) {
			seqs[i].RowLogits = l.promptRowLogits(w.Start)
		}
		if w.Sample {
			if e.logits[i] == nil {
				e.logits[i] = make([]float32, e.vocab)
			}
			seqs[i].Logits = e.logits[i]
		}
	}
	e.steps++
	kv := e.kv
	if ls, ok := e.cfg.Connector.(LayerStreamer); ok {
		if done := ls.StreamStep(plan.Work, plan.Preempted); done != nil {
			kv = []model.KVBlocks{layerStore{e.pool, done}} // one rank: layer-by-layer push needs a prefiller at TP 1
		}
	}
	if err := e.m.ForwardRanks(e.ctx, kv, e.cfg.BlockSize, seqs); err != nil {
		if e.ctx.Err() != nil {
			return // closing: the loop aborts everything next
		}
		e.log.Error("engine: forward step failed", "requests", len(plan.Work), "tokens", plan.NumTokens, "err", err)
		now := time.Now()
		for _, w := range plan.Work {
			if ev, ok := e.sched.Finish(w.Seq.ID(), StatusFinishedError, now); ok {
				e.end(ev, "", false, fmt.Errorf("engine: request %q: %w: %w", w.Seq.ID(), ErrForward, err))
			}
		}
		return
	}
	sampled := make([]int32, len(plan.Work))
	for i, w := range plan.Work {
		if !w.Sample {
			continue
		}
		l := e.live[w.Seq.ID()]
		logits := e.logits[i]
		if l != nil && l.req.Logprobs {
			e.raw = append(e.raw[:0], logits...)
		}
		for _, id := range e.suppress {
			logits[id] = float32(math.Inf(-1))
		}
		if l == nil { // cannot happen: every scheduled request is live
			sampled[i] = model.Argmax(logits)
			continue
		}
		if w.Seq.NumOutputTokens() < l.req.MinTokens {
			l.maskStopTokens(logits, e.m.Generation().EOSTokenIDs)
		}
		l.sampler.Process(logits, w.Seq.Prompt(), w.Seq.Output())
		draws := l.sampler.Draws()
		sampled[i] = l.sampler.Sample(logits)
		if w.Seq.NumOutputTokens() == 0 {
			w.Seq.firstDraws = int(l.sampler.Draws() - draws)
		}
		if l.req.Logprobs {
			lp := model.Logprobs(e.raw, sampled[i], l.req.TopLogprobs)
			l.lastLP = &lp
		}
	}
	now := time.Now()
	events := e.sched.Update(now, sampled)
	sm := promptSources(events)
	sm.Tokens = plan.NumTokens
	e.obs.Stepped(sm)
	for _, ev := range events {
		e.deliver(now, ev)
	}
}

// promptSources sums Sequence.PromptSources over the events that carry a first token.
func promptSources(events []Event) StepMetrics {
	var sm StepMetrics
	for _, ev := range events {
		if ev.HasToken && ev.Seq.NumOutputTokens() == 1 {
			c, l, x := ev.Seq.PromptSources()
			sm.LocalCompute += c
			sm.LocalCacheHit += l
			sm.ExternalKVTransfer += x
		}
	}
	return sm
}

// deliver sends a token event to its stream, ending the request at a stop string.
func (e *Engine) deliver(now time.Time, ev Event) {
	q := ev.Seq
	l := e.live[q.ID()]
	if l == nil {
		return
	}
	if q.NumOutputTokens() == 1 {
		e.obs.FirstToken(q.ID(), q.FirstTokenAt().Sub(q.Arrival()))
	}
	text, stopped := l.text.push(ev.Token, q.NumOutputTokens(), q.StoppedByToken())
	if stopped && !q.Status().Finished() {
		fev, _ := e.sched.Finish(q.ID(), StatusFinishedStopped, now)
		ev.KVTransfer = fev.KVTransfer
	}
	if q.Status().Finished() {
		e.end(ev, text, stopped, nil)
		return
	}
	out := Output{Tokens: []int32{ev.Token}, Text: text,
		PromptTokens: q.NumPromptTokens(), CachedTokens: q.CachedTokens(), ExternalCachedTokens: q.ExternalCachedTokens(),
		CompletionTokens: q.NumOutputTokens()}
	l.attachLogprobs(&out)
	l.stream.send(out)
}

// maskStopTokens masks the tokens that would end the request (its stop token ids and, unless
// it ignores EOS, eos), as it has fewer than MinTokens output tokens.
func (l *liveRequest) maskStopTokens(logits []float32, eos []int32) {
	mask := func(ids []int32) {
		for _, id := range ids {
			if id >= 0 && int(id) < len(logits) {
				logits[id] = float32(math.Inf(-1))
			}
		}
	}
	if l.req.Stops != nil {
		mask(l.req.Stops.ids)
	}
	if !l.req.IgnoreEOS {
		mask(eos)
	}
}

// promptRowLogits returns the Forward callback that records the prompt logprobs of a chunk
// starting at position start: row j scores prompt token start+j+1. A recomputed chunk (after a
// preemption) writes the same values again.
func (l *liveRequest) promptRowLogits(start int) func(int, []float32) {
	prompt, k := l.req.Prompt, l.req.TopPromptLogprobs
	return func(j int, logits []float32) {
		if pos := start + j; pos+1 < len(prompt) {
			l.promptLP[pos] = model.Logprobs(logits, prompt[pos+1], k)
		}
	}
}

// attachLogprobs adds the logprobs of out's token (and, with the first token, the prompt's).
func (l *liveRequest) attachLogprobs(out *Output) {
	if len(out.Tokens) == 0 {
		return
	}
	if l.lastLP != nil {
		out.Logprobs = []model.PositionLogprobs{*l.lastLP}
		l.lastLP = nil
	}
	if l.promptLP != nil && !l.promptSent {
		out.PromptLogprobs, l.promptSent = l.promptLP, true
	}
}

// end delivers the final Output of a finished request and forgets it.
func (e *Engine) end(ev Event, text string, stoppedByString bool, err error) {
	q := ev.Seq
	l := e.live[q.ID()]
	if l == nil {
		return
	}
	delete(e.live, q.ID())
	l.stopCtx()
	out := Output{
		Text:                 text + l.text.finish(stoppedByString),
		FinishReason:         q.Status().FinishReason(),
		PromptTokens:         q.NumPromptTokens(),
		CachedTokens:         q.CachedTokens(),
		ExternalCachedTokens: q.ExternalCachedTokens(),
		CompletionTokens:     q.NumOutputTokens(),
		KVTransfer:           ev.KVTransfer,
		Err:                  err,
	}
	if ev.HasToken {
		out.Tokens = []int32{ev.Token}
		l.attachLogprobs(&out)
	}
	e.publish() // a client that has its final output sees stats that include its request
	l.stream.finish(out)
	if e.sched.Get(q.ID()) == nil {
		e.unreserve(q.ID())
	}
	m := RequestMetrics{
		ID:               q.ID(),
		FinishReason:     out.FinishReason,
		PromptTokens:     out.PromptTokens,
		CachedTokens:     out.CachedTokens,
		CompletionTokens: out.CompletionTokens,
		E2E:              q.FinishedAt().Sub(q.Arrival()),
		Preemptions:      q.NumPreemptions(),
		MaxTokens:        q.Request().MaxTokens,
	}
	if sched := q.ScheduledAt(); !sched.IsZero() {
		m.Scheduled, m.Queue = true, sched.Sub(q.Arrival())
		if first := q.FirstTokenAt(); !first.IsZero() {
			last := q.LastTokenAt()
			m.Prefill, m.Decode, m.Inference = first.Sub(sched), last.Sub(first), last.Sub(sched)
		}
	}
	if !q.FirstTokenAt().IsZero() {
		m.TTFT = q.FirstTokenAt().Sub(q.Arrival())
	}
	e.obs.Finished(m)
}

// shutdown aborts every live request and releases held blocks (Close).
func (e *Engine) shutdown(now time.Time) {
	for _, ev := range e.sched.AbortAll(now) {
		e.end(ev, "", false, fmt.Errorf("engine: request %q: %w", ev.Seq.ID(), ErrClosed))
	}
	e.sched.ReleaseAllDelayed()
	e.mu.Lock()
	clear(e.ids)
	e.mu.Unlock()
	e.publish()
}

// publish stores the scheduler's counters for Stats and hands the step's KV cache events to
// the sink.
func (e *Engine) publish() {
	if e.cfg.KVEvents != nil {
		if evs := e.pool.TakeEvents(); len(evs) > 0 {
			e.cfg.KVEvents.PublishKVEvents(evs)
		}
	}
	s := e.sched.Stats()
	e.statsMu.Lock()
	e.stats = Stats{
		Running:          s.Running,
		Waiting:          s.Waiting,
		WaitingForRemote: s.WaitingForRemote,
		Delayed:          s.Delayed,
		PrefixQueries:    s.PrefixQueries,
		PrefixHits:       s.PrefixHits,
		ExternalHits:     s.ExternalHits,
		PromptTokens:     s.PromptTokens,
		GenerationTokens: s.GenerationTokens,
		Preemptions:      s.Preemptions,
		LoadFailures:     s.LoadFailures,
		RecomputedTokens: s.RecomputedTokens,
		Steps:            e.steps,
	}
	e.statsMu.Unlock()
}

// splitmix64 scrambles a counter into a seed.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// layerStore is the pool with a model.LayerObserver: a connector's LayerStreamer told of each
// layer of a step as it is computed.
type layerStore struct {
	*kvcache.Pool
	done func(layer int)
}

// LayerDone implements model.LayerObserver.
func (s layerStore) LayerDone(layer int) { s.done(layer) }
