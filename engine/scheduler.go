package engine

import (
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
)

// Scheduler defaults, applied when a SchedulerConfig field is zero.
const (
	// DefaultMaxNumSeqs is the default cap on running requests (vLLM's max_num_seqs).
	DefaultMaxNumSeqs = 256
	// DefaultMaxNumBatchedTokens is the default token budget of one step (vLLM's
	// max_num_batched_tokens with chunked prefill).
	DefaultMaxNumBatchedTokens = 2048
)

// SchedulerConfig configures a Scheduler. The block size is the pool's.
type SchedulerConfig struct {
	// MaxModelLen bounds prompt plus output tokens of a request (> 0).
	MaxModelLen int
	// MaxNumSeqs caps the running requests (0 = DefaultMaxNumSeqs).
	MaxNumSeqs int
	// MaxNumBatchedTokens caps the tokens computed in one step; longer prompts are prefilled in
	// chunks across steps (0 = DefaultMaxNumBatchedTokens).
	MaxNumBatchedTokens int
	// EOSTokenIDs end a request (unless it ignores EOS) once it has MinTokens tokens.
	EOSTokenIDs []int32
	// LoadFailurePolicy says what a failed asynchronous KV load does (default fail).
	LoadFailurePolicy FailurePolicy
	// Connector is the KV connector's scheduler side (nil = NoConnector).
	Connector Connector
	// Log receives warnings (nil = discard).
	Log *slog.Logger
}

// Work is one request's share of a step: compute the KV of Tokens at positions
// [Start, Start+len(Tokens)) into Blocks and, if Sample, produce the logits of the last one.
type Work struct {
	// Seq is the request.
	Seq *Sequence
	// Start is the position of Tokens[0]; positions [0, Start) already hold KV.
	Start int
	// Tokens are the tokens to compute (a view of the request's tokens: do not modify).
	Tokens []int32
	// Blocks is the block table, covering at least Start+len(Tokens) positions (do not modify).
	Blocks []int32
	// Sample is set when the chunk reaches the request's last token: the caller samples the next
	// token from the logits of Tokens[len(Tokens)-1] and passes it to Update.
	Sample bool
}

// Plan is one step: the work of each scheduled request, running requests first (FCFS), then
// newly admitted ones (FCFS).
type Plan struct {
	// Work lists the scheduled requests.
	Work []Work
	// NumTokens is the total number of tokens computed (≤ MaxNumBatchedTokens).
	NumTokens int
	// Preempted lists the requests preempted while building the plan (for the caller's logs
	// and metrics; they are WAITING again).
	Preempted []*Sequence
	// Released lists finished requests whose held blocks were freed while building the plan
	// because the connector evicted its hold (HoldEvicter); they hold nothing any more.
	Released []string
}

// Empty reports whether the plan schedules nothing.
func (p Plan) Empty() bool { return len(p.Work) == 0 }

// Event tells the caller what happened to one request in Update, LoadsDone or Finish.
type Event struct {
	// Seq is the request; Seq.Status() tells whether it finished and how.
	Seq *Sequence
	// HasToken is set when Token was appended to the output.
	HasToken bool
	// Token is the appended token.
	Token int32
	// KVTransfer holds the connector's params when the request finished and the connector
	// returned some.
	KVTransfer map[string]any
	// Err explains a FINISHED_ERROR set by the scheduler (a failed KV load: wraps ErrKVLoad).
	Err error
}

// SchedulerStats are the scheduler's gauges and counters. Token counters follow vLLM: prefix
// queries and hits are in tokens and counted once per request, at its first admission.
type SchedulerStats struct {
	// Running, Waiting (all queued, WAITING_FOR_REMOTE_KVS included), WaitingForRemote and
	// Delayed (finished, blocks held for the connector) count requests.
	Running, Waiting, WaitingForRemote, Delayed int
	// PrefixQueries is the prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries).
	PrefixQueries int64
	// PrefixHits is the tokens found there (vllm:prefix_cache_hits).
	PrefixHits int64
	// ExternalHits is the tokens the connector supplied at first admissions.
	ExternalHits int64
	// PromptTokens counts prompts of requests that produced their first token
	// (vllm:prompt_tokens_total).
	PromptTokens int64
	// GenerationTokens counts sampled tokens (vllm:generation_tokens_total).
	GenerationTokens int64
	// Preemptions counts preemptions (vllm:num_preemptions_total).
	Preemptions int64
	// LoadFailures counts requests whose asynchronous KV load failed.
	LoadFailures int64
	// RecomputedTokens counts tokens recomputed after failed loads (policy recompute).
	RecomputedTokens int64
}

// Scheduler is the engine's deterministic scheduler: a state machine over requests and the block
// pool, with no goroutines, no I/O and no clock of its own. It is not safe for concurrent use;
// one owner drives it (see the package documentation). The pool itself may be shared with
// others (a connector's transfers), since its methods are safe for concurrent use.
type Scheduler struct {
	cfg       SchedulerConfig
	pool      *kvcache.Pool
	blockSize int
	conn      Connector
	log       *slog.Logger

	seqs    map[string]*Sequence // live requests (not finished)
	waiting []*Sequence          // FCFS; preempted requests go to the front
	running []*Sequence          // admission order
	delayed map[string]*Sequence // finished, blocks held until ReleaseDelayed

	plan  Plan
	stats SchedulerStats
}

// NewScheduler returns a scheduler over pool. It fails with ErrConfig if a limit is invalid or a
// request of MaxModelLen tokens could not fit in the pool.
func NewScheduler(pool *kvcache.Pool, cfg SchedulerConfig) (*Scheduler, error) {
	if pool == nil {
		return nil, fmt.Errorf("engine: scheduler needs a pool: %w", ErrConfig)
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
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	bs := pool.Geometry().BlockSize
	switch {
	case cfg.MaxModelLen <= 1:
		return nil, fmt.Errorf("engine: max model length %d must be at least 2: %w", cfg.MaxModelLen, ErrConfig)
	case cfg.MaxNumSeqs < 0:
		return nil, fmt.Errorf("engine: max_num_seqs %d must be positive: %w", cfg.MaxNumSeqs, ErrConfig)
	case cfg.MaxNumBatchedTokens < 0:
		return nil, fmt.Errorf("engine: max_num_batched_tokens %d must be positive: %w", cfg.MaxNumBatchedTokens, ErrConfig)
	case cfg.MaxModelLen > pool.NumBlocks()*bs:
		return nil, fmt.Errorf("engine: max model length %d exceeds the KV cache capacity of %d blocks × %d tokens: %w",
			cfg.MaxModelLen, pool.NumBlocks(), bs, ErrConfig)
	}
	if cfg.LoadFailurePolicy > FailurePolicyRecompute {
		return nil, fmt.Errorf("engine: %v: %w", cfg.LoadFailurePolicy, ErrConfig)
	}
	cfg.EOSTokenIDs = slices.Clone(cfg.EOSTokenIDs)
	return &Scheduler{
		cfg:       cfg,
		pool:      pool,
		blockSize: bs,
		conn:      cfg.Connector,
		log:       cfg.Log,
		seqs:      make(map[string]*Sequence),
		delayed:   make(map[string]*Sequence),
	}, nil
}

// BlockSize returns the block size in tokens.
func (s *Scheduler) BlockSize() int { return s.blockSize }

// Config returns the configuration with defaults applied.
func (s *Scheduler) Config() SchedulerConfig { return s.cfg }

// Add queues r as WAITING at time now and returns its sequence. It fails with ErrInvalidRequest
// for an invalid request (see Request) or an id already live or held.
func (s *Scheduler) Add(r *Request, now time.Time) (*Sequence, error) {
	if err := r.validate(s.cfg.MaxModelLen, 0); err != nil {
		return nil, err
	}
	if s.seqs[r.ID] != nil || s.delayed[r.ID] != nil {
		return nil, fmt.Errorf("engine: request id %q is already in use: %w", r.ID, ErrInvalidRequest)
	}
	toks := make([]int32, len(r.Prompt), len(r.Prompt)+min(r.MaxTokens, s.cfg.MaxModelLen-len(r.Prompt)))
	copy(toks, r.Prompt)
	q := &Sequence{
		id:           r.ID,
		req:          r,
		tokens:       toks,
		numPrompt:    len(r.Prompt),
		status:       StatusWaiting,
		table:        kvcache.NewBlockTable(s.blockSize),
		cachedTokens: 0,
		arrival:      now,
	}
	s.seqs[r.ID] = q
	s.waiting = append(s.waiting, q)
	if a, ok := s.conn.(ArrivalObserver); ok {
		a.Arrived(q)
	}
	return q, nil
}

// Get returns the live or held request with id, or nil.
func (s *Scheduler) Get(id string) *Sequence {
	if q := s.seqs[id]; q != nil {
		return q
	}
	return s.delayed[id]
}

// HasWork reports whether Schedule could return a non-empty plan: a request is running or
// waiting to be admitted (not counting those parked for remote KV).
func (s *Scheduler) HasWork() bool {
	if len(s.running) > 0 {
		return true
	}
	for _, q := range s.waiting {
		if q.status == StatusWaiting {
			return true
		}
	}
	return false
}

// Schedule builds the next step's plan. Running requests come first, oldest first, each getting
// its remaining tokens (one for a decode, a chunk for a prefill) within the token budget; blocks
// are allocated as needed and, when the pool is exhausted, the newest running request is
// preempted (its blocks freed, back to WAITING at the queue's front; it is recomputed later with
// the same output). If nothing was preempted, waiting requests are then admitted in FCFS order
// while the budget and MaxNumSeqs allow: prefix-cache lookup (never the whole prompt), the
// connector's MatchedExternal, block allocation, AfterAlloc. A request that cannot be admitted
// blocks those behind it (FCFS), except requests parked in WAITING_FOR_REMOTE_KVS, which are
// skipped.
//
// The plan stays valid until the next call to Update, Schedule or any method that changes
// requests; call Update after running it.
func (s *Scheduler) Schedule(now time.Time) Plan {
	s.plan = Plan{Work: s.plan.Work[:0]}
	clear(s.plan.Work[:cap(s.plan.Work)])
	budget := s.cfg.MaxNumBatchedTokens

	for i := 0; i < len(s.running) && budget > 0; i++ {
		q := s.running[i]
		n := min(q.NumTokens()-q.numComputed, budget)
		if n <= 0 {
			continue
		}
		if !s.allocateOrPreempt(q, q.numComputed+n) {
			break // q itself was preempted: it was the newest, nothing after it
		}
		s.addWork(q, n)
		budget -= n
	}

	if len(s.plan.Preempted) == 0 {
		var parked []*Sequence
		for len(s.waiting) > 0 && budget > 0 && len(s.running) < s.cfg.MaxNumSeqs {
			q := s.waiting[0]
			if q.status == StatusWaitingForRemoteKVs {
				parked = append(parked, q)
				s.waiting = s.waiting[1:]
				continue
			}
			res := s.admit(q, budget, now)
			if res == admitBlocked {
				break
			}
			s.waiting = s.waiting[1:]
			if res == admitParked {
				parked = append(parked, q)
				continue
			}
			n := s.plan.Work[len(s.plan.Work)-1].Tokens
			budget -= len(n)
		}
		if len(parked) > 0 {
			s.waiting = append(parked, s.waiting...)
		}
	}
	return s.plan
}

// work returns q's next n tokens as plan work.
func (q *Sequence) work(n int) Work {
	start := q.numComputed
	return Work{
		Seq:    q,
		Start:  start,
		Tokens: q.tokens[start : start+n : start+n],
		Blocks: q.table.IDs(),
		Sample: start+n == len(q.tokens),
	}
}

// addWork appends q's next n tokens to the plan.
func (s *Scheduler) addWork(q *Sequence, n int) {
	s.plan.Work = append(s.plan.Work, q.work(n))
	s.plan.NumTokens += n
}

// allocateOrPreempt gives running request q blocks for numTokens positions, preempting the newest
// running requests while the pool is short. It returns false if q itself had to be preempted.
func (s *Scheduler) allocateOrPreempt(q *Sequence, numTokens int) bool {
	for {
		need := q.table.BlocksFor(numTokens)
		if need == 0 {
			return true
		}
		if ids, err := s.pool.Allocate(need); err == nil {
			q.table.Append(ids...)
			return true
		}
		if s.evictHolds(need) {
			continue
		}
		victim := s.running[len(s.running)-1]
		s.preempt(victim)
		if victim == q {
			return false
		}
	}
}

// preempt frees running request q's blocks and queues it at the front of the waiting queue.
func (s *Scheduler) preempt(q *Sequence) {
	s.removeRunning(q)
	s.releaseBlocks(q)
	q.numComputed = 0
	q.status = StatusWaiting
	q.preemptions++
	s.stats.Preemptions++
	s.waiting = append([]*Sequence{q}, s.waiting...)
	s.plan.Preempted = append(s.plan.Preempted, q)
}

type admitResult uint8

const (
	admitBlocked admitResult = iota // not enough blocks: stop admitting
	admitParked                     // blocks allocated, waiting for the connector's load
	admitRunning                    // running, work added to the plan
)

// evictHolds asks the connector to end holds worth need blocks (beyond the free ones) and frees
// them; it reports whether any was freed.
func (s *Scheduler) evictHolds(need int) bool {
	ev, ok := s.conn.(HoldEvicter)
	if !ok {
		return false
	}
	freed := false
	for _, id := range ev.EvictHolds(max(need-s.pool.NumFree(), 1)) {
		if s.ReleaseDelayed(id) {
			s.plan.Released = append(s.plan.Released, id)
			freed = true
		}
	}
	return freed
}

// allocate takes n blocks, evicting connector holds when the pool is short.
func (s *Scheduler) allocate(n int) ([]int32, error) {
	for {
		ids, err := s.pool.Allocate(n)
		if err == nil || !s.evictHolds(n) {
			return ids, err
		}
	}
}

// admit tries to admit waiting request q within budget tokens at time now.
func (s *Scheduler) admit(q *Sequence, budget int, now time.Time) admitResult {
	fresh := q.table.Len() == 0
	async := false
	if fresh && q.req.PromptLogprobs {
		// Prompt logprobs need the logits of every prompt position: compute it all here.
		q.localHit, q.external, q.numComputed = 0, 0, 0
	} else if fresh {
		q.localHit = q.table.MatchPrefix(s.pool, q.tokens)
		n, a := s.conn.MatchedExternal(q, q.localHit)
		n = max(0, min(n, q.NumTokens()-q.localHit))
		q.external, async = n, a && n > 0
		q.numComputed = q.localHit + q.external
		if !async {
			q.numComputed = min(q.numComputed, q.NumTokens()-1)
		}
	}
	if async {
		if ids, err := s.allocate(q.table.BlocksFor(q.numComputed)); err == nil {
			q.table.Append(ids...)
		} else {
			s.unadmit(q)
			return admitBlocked
		}
		s.admitted(q)
		q.status = StatusWaitingForRemoteKVs
		s.conn.AfterAlloc(q, q.table.IDs(), q.external)
		return admitParked
	}
	n := min(q.NumTokens()-q.numComputed, budget)
	if ids, err := s.allocate(q.table.BlocksFor(q.numComputed + n)); err == nil {
		q.table.Append(ids...)
	} else {
		if fresh {
			s.unadmit(q)
		}
		return admitBlocked
	}
	if fresh {
		s.admitted(q)
		s.conn.AfterAlloc(q, q.table.IDs(), q.external)
	}
	q.status = StatusRunning
	if q.scheduledAt.IsZero() {
		q.scheduledAt = now
	}
	s.running = append(s.running, q)
	s.addWork(q, n)
	return admitRunning
}

// unadmit undoes a failed admission of a fresh request (drops the prefix-cache references).
func (s *Scheduler) unadmit(q *Sequence) {
	s.releaseBlocks(q)
	q.numComputed, q.localHit, q.external = 0, 0, 0
}

// admitted records the first admission's cache statistics.
func (s *Scheduler) admitted(q *Sequence) {
	if q.admitted {
		return
	}
	q.admitted = true
	// The last prompt token is always computed here, even when a connector supplied its KV.
	q.cachedTokens = min(q.localHit+q.external, q.NumTokens()-1)
	q.externalCached = max(0, q.cachedTokens-q.localHit)
	if s.pool.PrefixCaching() {
		s.stats.PrefixQueries += int64(q.NumTokens())
		s.stats.PrefixHits += int64(q.localHit)
	}
	s.stats.ExternalHits += int64(q.external)
}

// Update advances the requests of the last plan: their computed tokens move past the work, blocks
// that became full are committed to the prefix cache, and each Work with Sample gets its token
// sampled[i] (sampled is indexed like plan.Work; other entries are ignored) appended, after which
// the request may finish: length (max_tokens or MaxModelLen), then — once it has MinTokens tokens —
// EOS (unless IgnoreEOS) or a stop token id. Requests finished since the plan was made (Finish)
// are skipped. It returns one Event per appended token. Calling it again without a new plan does
// nothing.
func (s *Scheduler) Update(now time.Time, sampled []int32) []Event {
	var events []Event
	for i, w := range s.plan.Work {
		q := w.Seq
		if q.status != StatusRunning || q.numComputed != w.Start {
			continue
		}
		q.numComputed = w.Start + len(w.Tokens)
		s.commit(q)
		if !w.Sample {
			continue
		}
		if i >= len(sampled) {
			continue
		}
		events = append(events, s.appendToken(q, sampled[i], now))
	}
	s.plan = Plan{Work: s.plan.Work[:0]}
	return events
}

// appendToken appends tok to q's output at time now and applies the stop checks (see Update).
func (s *Scheduler) appendToken(q *Sequence, tok int32, now time.Time) Event {
	q.tokens = append(q.tokens, tok)
	q.lastToken = now
	s.stats.GenerationTokens++
	if q.NumOutputTokens() == 1 {
		q.firstToken = now
		s.stats.PromptTokens += int64(q.numPrompt)
	}
	ev := Event{Seq: q, HasToken: true, Token: tok}
	if st, stopTok, done := s.checkStop(q); done {
		q.stopToken = stopTok
		ev.KVTransfer = s.finish(q, st, now)
	}
	return ev
}

// commit registers q's newly full computed blocks in the prefix cache.
func (s *Scheduler) commit(q *Sequence) {
	if err := q.table.Commit(s.pool, q.tokens, q.numComputed); err != nil {
		s.log.Warn("engine: prefix cache commit failed", "request_id", q.id, "err", err)
	}
}

// checkStop applies vLLM's stop checks after a token was appended.
func (s *Scheduler) checkStop(q *Sequence) (st Status, stopToken, done bool) {
	nOut := q.NumOutputTokens()
	if q.NumTokens() >= s.cfg.MaxModelLen || nOut >= q.req.MaxTokens {
		return StatusFinishedLengthCapped, false, true
	}
	if nOut < q.req.MinTokens {
		return 0, false, false
	}
	last := q.tokens[len(q.tokens)-1]
	if !q.req.IgnoreEOS && slices.Contains(s.cfg.EOSTokenIDs, last) {
		return StatusFinishedStopped, true, true
	}
	if q.req.stopTokenID(last) {
		return StatusFinishedStopped, true, true
	}
	return 0, false, false
}

// StopTokens returns the tokens that may end r: its stop token ids and, unless it ignores EOS,
// the EOS ids. The caller masks them (logits −Inf) while the request has fewer than MinTokens
// output tokens.
func (s *Scheduler) StopTokens(r *Request) []int32 {
	out := slices.Clone(r.StopTokenIDs)
	if !r.IgnoreEOS {
		out = append(out, s.cfg.EOSTokenIDs...)
	}
	return out
}

// Finish ends live request id with status st (a finished status) at time now, in whatever
// state it is: aborts (client gone), errors, and stop strings found by the caller's
// detokenizer. Its blocks are freed at once unless the connector delays the free. It returns
// the event (with the connector's params) and false if id is not live (already finished or
// unknown).
func (s *Scheduler) Finish(id string, st Status, now time.Time) (Event, bool) {
	q := s.seqs[id]
	if q == nil {
		return Event{}, false
	}
	if !st.Finished() {
		st = StatusFinishedAborted
	}
	params := s.finish(q, st, now)
	return Event{Seq: q, KVTransfer: params}, true
}

// finish moves live q to finished status st and frees or holds its blocks.
func (s *Scheduler) finish(q *Sequence, st Status, now time.Time) map[string]any {
	switch q.status {
	case StatusRunning:
		s.removeRunning(q)
	case StatusWaiting, StatusWaitingForRemoteKVs:
		s.removeWaiting(q)
	}
	delete(s.seqs, q.id)
	q.status = st
	q.finishedAt = now
	delay, params := s.conn.Finished(q, st, now)
	if delay && q.table.Len() > 0 {
		s.delayed[q.id] = q
	} else {
		s.releaseBlocks(q)
	}
	return params
}

// ReleaseDelayed frees the blocks of finished request id that the connector held (Finished
// returned delayFree). It returns false if id holds nothing.
func (s *Scheduler) ReleaseDelayed(id string) bool {
	q := s.delayed[id]
	if q == nil {
		return false
	}
	delete(s.delayed, id)
	s.releaseBlocks(q)
	return true
}

// Delayed returns the ids of finished requests whose blocks are held, sorted.
func (s *Scheduler) Delayed() []string {
	ids := make([]string, 0, len(s.delayed))
	for id := range s.delayed {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// LoadsDone reports finished asynchronous loads: ok lists requests whose KV arrived, first gives
// some of them the first output token another engine sampled from that KV (FirstToken), failed
// maps requests whose load failed to the index (in the request's block table) of the first bad
// block. Ids that are not WAITING_FOR_REMOTE_KVS (aborted meanwhile, unknown) are ignored.
//
// A loaded request goes back to WAITING with its loaded blocks committed to the prefix cache; if
// its whole prompt arrived, the last prompt token is still computed locally (for its logits) —
// unless first has its token: then its whole prompt counts as computed (and as cached, the part
// beyond the local hit as the connector's), the token is appended as if sampled now (an Event
// with HasToken, stop checks applied: it may finish the request) and, if it goes on, the request
// starts with the decode step of that token.
// A failed one follows the policy: fail — FINISHED_ERROR (the Event's Err wraps ErrKVLoad) with
// the blocks from the bad one on evicted from the prefix cache; recompute — computed tokens are
// truncated at the bad block and the request goes back to WAITING (with no valid block left, its
// blocks are freed so a new prefix-cache lookup happens).
func (s *Scheduler) LoadsDone(now time.Time, ok []string, first map[string]FirstToken, failed map[string]int) []Event {
	var events []Event
	for _, id := range ok {
		if _, bad := failed[id]; bad {
			continue
		}
		q := s.seqs[id]
		if q == nil || q.status != StatusWaitingForRemoteKVs {
			continue
		}
		q.status = StatusWaiting
		ft, has := first[id]
		if has && q.numComputed >= q.numPrompt && q.NumOutputTokens() == 0 {
			q.numComputed = q.numPrompt
			q.cachedTokens = q.numPrompt
			q.externalCached = q.numPrompt - q.localHit
			if q.scheduledAt.IsZero() {
				q.scheduledAt = now
			}
			s.commit(q)
			events = append(events, s.appendToken(q, ft.Token, now))
			continue
		}
		q.numComputed = min(q.numComputed, q.NumTokens()-1)
		s.commit(q)
	}
	ids := make([]string, 0, len(failed))
	for id := range failed {
		ids = append(ids, id)
	}
	slices.Sort(ids) // deterministic order
	for _, id := range ids {
		q := s.seqs[id]
		if q == nil || q.status != StatusWaitingForRemoteKVs {
			continue
		}
		first := max(0, min(failed[id], q.table.Len()))
		affected := max(0, q.numComputed-first*s.blockSize)
		s.stats.LoadFailures++
		switch s.cfg.LoadFailurePolicy {
		case FailurePolicyRecompute:
			s.recompute(q, first)
			s.log.Warn("Recovered from KV load failure: 1 request(s) rescheduled",
				"request_id", id, "tokens_affected", affected, "first_bad_block", first)
		default:
			if err := q.table.EvictFrom(s.pool, first); err != nil {
				s.log.Warn("engine: evicting bad blocks failed", "request_id", id, "err", err)
			}
			s.log.Error("Failing 1 request(s) due to KV load failure (failure_policy=fail)",
				"request_id", id, "tokens_affected", affected, "first_bad_block", first)
			params := s.finish(q, StatusFinishedError, now)
			events = append(events, Event{Seq: q, KVTransfer: params,
				Err: fmt.Errorf("engine: request %q: KV load failed at block index %d (%d tokens affected): %w",
					id, first, affected, ErrKVLoad)})
		}
	}
	return events
}

// LoadsMissed reports asynchronous loads that found nothing to load — the remote blocks were a
// cache (a decoder's hold for a next turn) that is gone — and loaded nothing: each request goes
// back to WAITING with only its local prefix-cache hit, to compute the rest itself, whatever the
// failure policy. Ids that are not WAITING_FOR_REMOTE_KVS are ignored.
func (s *Scheduler) LoadsMissed(ids []string) {
	for _, id := range ids {
		q := s.seqs[id]
		if q == nil || q.status != StatusWaitingForRemoteKVs {
			continue
		}
		s.recompute(q, q.localHit/s.blockSize)
	}
}

// recompute truncates q's computed tokens at block index first (nothing from there on is to be
// used) and sends it back to WAITING to compute the rest (policy recompute).
func (s *Scheduler) recompute(q *Sequence, first int) {
	affected := max(0, q.numComputed-first*s.blockSize)
	q.numComputed = min(q.numComputed, first*s.blockSize)
	q.cachedTokens = min(q.cachedTokens, q.numComputed)
	q.externalCached = max(0, q.cachedTokens-q.localHit) // what was pulled before first, if any
	q.external = max(0, q.numComputed-q.localHit)
	s.stats.RecomputedTokens += int64(affected)
	q.status = StatusWaiting
	if q.numComputed == 0 {
		s.releaseBlocks(q)
		q.localHit = 0
	} else {
		s.commit(q)
	}
}

// AbortAll finishes every live request with FINISHED_ABORTED (engine shutdown) and returns their
// events in FCFS order of running then waiting requests.
func (s *Scheduler) AbortAll(now time.Time) []Event {
	all := append(slices.Clone(s.running), s.waiting...)
	events := make([]Event, 0, len(all))
	for _, q := range all {
		if ev, ok := s.Finish(q.id, StatusFinishedAborted, now); ok {
			events = append(events, ev)
		}
	}
	return events
}

// ReleaseAllDelayed frees every held block (engine shutdown: the leases die with the engine).
func (s *Scheduler) ReleaseAllDelayed() {
	for _, id := range s.Delayed() {
		s.ReleaseDelayed(id)
	}
}

// Stats returns the scheduler's gauges and counters.
func (s *Scheduler) Stats() SchedulerStats {
	st := s.stats
	st.Running = len(s.running)
	st.Waiting = len(s.waiting)
	for _, q := range s.waiting {
		if q.status == StatusWaitingForRemoteKVs {
			st.WaitingForRemote++
		}
	}
	st.Delayed = len(s.delayed)
	return st
}

// releaseBlocks frees q's whole block table (tail blocks become reusable first).
func (s *Scheduler) releaseBlocks(q *Sequence) {
	if err := q.table.Release(s.pool); err != nil {
		s.log.Error("engine: freeing blocks failed", "request_id", q.id, "err", err)
	}
}

func (s *Scheduler) removeRunning(q *Sequence) {
	if i := slices.Index(s.running, q); i >= 0 {
		s.running = slices.Delete(s.running, i, i+1)
	}
}

func (s *Scheduler) removeWaiting(q *Sequence) {
	if i := slices.Index(s.waiting, q); i >= 0 {
		s.waiting = slices.Delete(s.waiting, i, i+1)
	}
}
