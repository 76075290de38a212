package engine

import (
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
)

// newTestPool returns a real pool over heap memory whose blocks hold one layer, one KV head of
// two floats: enough for simKV to store (token, position) per slot. The cleanup asserts that every
// block went back to the pool and that the pool's bookkeeping is consistent.
func newTestPool(t *testing.T, numBlocks, blockSize int, prefix bool) *kvcache.Pool {
	t.Helper()
	g := kvcache.Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 2, BlockSize: blockSize}
	pool, err := kvcache.NewPool(kvcache.AlignedMemory(numBlocks*g.BlockBytes()),
		kvcache.PoolConfig{Geometry: g, NumBlocks: numBlocks, PrefixCaching: prefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { assertPoolFull(t, pool) })
	return pool
}

// assertPoolFull fails the test unless every block of pool is free and its bookkeeping holds.
func assertPoolFull(t *testing.T, pool *kvcache.Pool) {
	t.Helper()
	if free, n := pool.NumFree(), pool.NumBlocks(); free != n {
		t.Errorf("pool leaks blocks: %d of %d free", free, n)
	}
	if err := pool.CheckInvariants(); err != nil {
		t.Errorf("pool invariants: %v", err)
	}
}

// simKV plays the model for scheduler tests: it "computes" a token by writing (token, position)
// into its KV slot, and checks before each step that every position below Work.Start holds the
// right (token, position) — so a wrong prefix hit, a block reused while still referenced or a
// missed recompute shows up as a KV mismatch, the way it would corrupt a real model's output.
type simKV struct {
	t    *testing.T
	pool *kvcache.Pool
	bs   int
}

func (m simKV) slot(blocks []int32, pos int) []float32 {
	k, _, stride := m.pool.HeadView(0, int(blocks[pos/m.bs]), 0)
	s := pos % m.bs
	return k[s*stride : s*stride+2]
}

// write stores the KV of tokens[i] at position start+i.
func (m simKV) write(blocks []int32, start int, tokens []int32) {
	for i, tok := range tokens {
		kv := m.slot(blocks, start+i)
		kv[0], kv[1] = float32(tok), float32(start+i)
	}
}

// check verifies positions [0, n) of blocks hold tokens[:n].
func (m simKV) check(id string, blocks []int32, tokens []int32, n int) {
	m.t.Helper()
	for p := range n {
		kv := m.slot(blocks, p)
		if kv[0] != float32(tokens[p]) || kv[1] != float32(p) {
			m.t.Fatalf("request %s: KV at position %d holds (token %v, pos %v), want (%d, %d)",
				id, p, kv[0], kv[1], tokens[p], p)
		}
	}
}

// nextToken is the simulated model's greedy choice: a function of the whole sequence, so any
// KV or scheduling mistake that changes what is "seen" changes the output. It never returns the
// test EOS id (1) or stop ids below 10.
func nextToken(tokens []int32) int32 {
	h := fnv.New32a()
	for _, t := range tokens {
		fmt.Fprint(h, t, ",")
	}
	return int32(10 + h.Sum32()%90)
}

// harness drives a Scheduler with a fake clock and simKV.
type harness struct {
	t     *testing.T
	pool  *kvcache.Pool
	s     *Scheduler
	sim   simKV
	now   time.Time
	seqs  map[string]*Sequence
	plans []Plan // copies of every plan, for assertions
	// next overrides nextToken for scripted outputs.
	next func(q *Sequence) int32
}

func newHarness(t *testing.T, pool *kvcache.Pool, cfg SchedulerConfig) *harness {
	t.Helper()
	if cfg.MaxModelLen == 0 {
		cfg.MaxModelLen = pool.NumBlocks() * pool.Geometry().BlockSize
	}
	if cfg.EOSTokenIDs == nil {
		cfg.EOSTokenIDs = []int32{1}
	}
	s, err := NewScheduler(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &harness{t: t, pool: pool, s: s, sim: simKV{t: t, pool: pool, bs: s.BlockSize()},
		now: time.Unix(1000, 0), seqs: map[string]*Sequence{}}
}

func (h *harness) add(id string, prompt []int32, maxTokens int) *Sequence {
	h.t.Helper()
	return h.addReq(&Request{ID: id, Prompt: prompt, MaxTokens: maxTokens})
}

func (h *harness) addReq(r *Request) *Sequence {
	h.t.Helper()
	q, err := h.s.Add(r, h.now)
	if err != nil {
		h.t.Fatal(err)
	}
	h.seqs[r.ID] = q
	return q
}

// step runs one Schedule/compute/Update round and returns the plan and the events.
func (h *harness) step() (Plan, []Event) {
	h.t.Helper()
	plan := h.schedule()
	return plan, h.compute(plan)
}

// schedule advances the clock one millisecond and returns the scheduler's next plan, after
// checking it against the budget and max_num_seqs (a copy goes to h.plans).
func (h *harness) schedule() Plan {
	h.t.Helper()
	h.now = h.now.Add(time.Millisecond)
	plan := h.s.Schedule(h.now)
	cp := plan
	cp.Work = slices.Clone(plan.Work)
	cp.Preempted = slices.Clone(plan.Preempted)
	h.plans = append(h.plans, cp)
	if plan.NumTokens > h.s.Config().MaxNumBatchedTokens {
		h.t.Fatalf("plan of %d tokens exceeds the budget %d", plan.NumTokens, h.s.Config().MaxNumBatchedTokens)
	}
	if len(plan.Work) > h.s.Config().MaxNumSeqs {
		h.t.Fatalf("plan of %d requests exceeds max_num_seqs %d", len(plan.Work), h.s.Config().MaxNumSeqs)
	}
	return plan
}

// compute plays the model over plan (checking the KV below each Work's start, writing the
// KV of its tokens, sampling where asked) and returns the events of Update.
func (h *harness) compute(plan Plan) []Event {
	h.t.Helper()
	sampled := make([]int32, len(plan.Work))
	for i, w := range plan.Work {
		all := w.Seq.Tokens()
		if !slices.Equal(w.Tokens, all[w.Start:w.Start+len(w.Tokens)]) {
			h.t.Fatalf("request %s: work tokens are not the sequence's", w.Seq.ID())
		}
		if len(w.Blocks)*h.sim.bs < w.Start+len(w.Tokens) {
			h.t.Fatalf("request %s: %d blocks for %d positions", w.Seq.ID(), len(w.Blocks), w.Start+len(w.Tokens))
		}
		h.sim.check(w.Seq.ID(), w.Blocks, all, w.Start)
		h.sim.write(w.Blocks, w.Start, w.Tokens)
		if w.Sample {
			if h.next != nil {
				sampled[i] = h.next(w.Seq)
			} else {
				sampled[i] = nextToken(all)
			}
		}
	}
	return h.s.Update(h.now, sampled)
}

// run steps until no request can make progress or maxSteps pass; it returns the events.
func (h *harness) run(maxSteps int) []Event {
	h.t.Helper()
	var all []Event
	for range maxSteps {
		if !h.s.HasWork() {
			return all
		}
		_, ev := h.step()
		all = append(all, ev...)
	}
	h.t.Fatalf("still busy after %d steps: %+v", maxSteps, h.s.Stats())
	return nil
}

// outputs returns each request's output tokens.
func (h *harness) outputs() map[string][]int32 {
	out := map[string][]int32{}
	for id, q := range h.seqs {
		out[id] = slices.Clone(q.Output())
	}
	return out
}

// reference runs every prompt alone on a roomy pool and returns the outputs.
func reference(t *testing.T, blockSize int, prompts map[string][]int32, maxTokens int) map[string][]int32 {
	t.Helper()
	out := map[string][]int32{}
	for _, id := range slices.Sorted(maps.Keys(prompts)) {
		pool := newTestPool(t, 64, blockSize, false)
		h := newHarness(t, pool, SchedulerConfig{MaxModelLen: 64 * blockSize})
		q := h.add(id, prompts[id], maxTokens)
		h.run(1000)
		if q.Status() != StatusFinishedLengthCapped {
			t.Fatalf("reference %s: status %v", id, q.Status())
		}
		out[id] = slices.Clone(q.Output())
	}
	return out
}

// seqTokens returns n prompt tokens starting at base (ids ≥ 10, never EOS).
func seqTokens(base, n int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(10 + (base+i*7)%90)
	}
	return p
}
