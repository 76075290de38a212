package engine

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"
)

// testConnector is a scripted stand-in for the real KV connector: package connector (issue 4)
// does not exist yet, so this records the hook calls and answers MatchedExternal from a table.
// It exercises exactly the scheduler side of the Connector contract; the real connector's tests
// will cover the transfer itself.
type testConnector struct {
	external map[string]int // tokens beyond the local hit it can supply; -1 = the rest of the prompt
	sync     bool           // supply them synchronously (written in AfterAlloc) instead of async
	delay    bool           // hold blocks at every finish
	params   map[string]any // returned at finish
	sim      *simKV         // for sync loads

	matched  map[string]int // MatchedExternal calls per request
	allocs   map[string]allocCall
	finished map[string]Status
}

type allocCall struct {
	blocks   []int32
	localHit int
	external int
}

func newTestConnector() *testConnector {
	return &testConnector{external: map[string]int{}, matched: map[string]int{},
		allocs: map[string]allocCall{}, finished: map[string]Status{}}
}

func (c *testConnector) MatchedExternal(q *Sequence, localHit int) (int, bool) {
	c.matched[q.ID()]++
	n := c.external[q.ID()]
	if n < 0 {
		n = q.NumPromptTokens() - localHit
	}
	if q.NumPreemptions() > 0 || c.allocs[q.ID()].blocks != nil {
		n = 0 // loaded once; like vLLM's do_remote_prefill=false after the first allocation
	}
	return n, !c.sync
}

func (c *testConnector) AfterAlloc(q *Sequence, blocks []int32, numExternal int) {
	if _, again := c.allocs[q.ID()]; again {
		return
	}
	c.allocs[q.ID()] = allocCall{blocks: slices.Clone(blocks), localHit: q.NumLocalHitTokens(), external: numExternal}
	if c.sync && numExternal > 0 {
		lh := q.NumLocalHitTokens()
		c.sim.write(blocks, lh, q.Tokens()[lh:lh+numExternal])
	}
}

func (c *testConnector) Finished(q *Sequence, st Status, _ time.Time) (bool, map[string]any) {
	c.finished[q.ID()] = st
	return c.delay, c.params
}

// transfer simulates the remote read of q's external tokens: correct KV for blocks before bad
// (a block-table index; -1 = all good), garbage from bad on.
func transfer(sim simKV, q *Sequence, a allocCall, bad int) {
	for p := a.localHit; p < a.localHit+a.external; p++ {
		tok := q.Tokens()[p]
		if bad >= 0 && p/sim.bs >= bad {
			tok = -7
		}
		sim.write(a.blocks, p, []int32{tok})
	}
}

func TestSchedulerChunkedPrefillAndBudget(t *testing.T) {
	pool := newTestPool(t, 32, 4, false)
	h := newHarness(t, pool, SchedulerConfig{MaxNumBatchedTokens: 8, MaxNumSeqs: 2})
	a := h.add("a", seqTokens(0, 19), 3)
	b := h.add("b", seqTokens(1, 3), 2)
	c := h.add("c", seqTokens(2, 5), 2)

	type w struct {
		id       string
		start, n int
		sample   bool
	}
	got := func(p Plan) []w {
		var out []w
		for _, x := range p.Work {
			out = append(out, w{x.Seq.ID(), x.Start, len(x.Tokens), x.Sample})
		}
		return out
	}
	want := [][]w{
		{{"a", 0, 8, false}},                    // a's first chunk takes the whole budget
		{{"a", 8, 8, false}},                    // second chunk
		{{"a", 16, 3, true}, {"b", 0, 3, true}}, // last chunk samples; b admitted in the rest
		{{"a", 19, 1, true}, {"b", 3, 1, true}}, // decodes; c waits for max_num_seqs
		{{"a", 20, 1, true}, {"c", 0, 5, true}}, // b finished (2 tokens): c admitted
		{{"c", 5, 1, true}},
	}
	for i, wp := range want {
		p, _ := h.step()
		if g := got(p); !slices.Equal(g, wp) {
			t.Fatalf("step %d: plan %+v, want %+v", i, g, wp)
		}
	}
	for _, q := range []*Sequence{a, b, c} {
		if q.Status() != StatusFinishedLengthCapped {
			t.Errorf("%s: status %v", q.ID(), q.Status())
		}
	}
	if p, _ := h.step(); !p.Empty() {
		t.Fatalf("plan after everything finished: %+v", got(p))
	}
	st := h.s.Stats()
	if st.PromptTokens != 19+3+5 || st.GenerationTokens != 3+2+2 {
		t.Errorf("token counters %+v", st)
	}
}

func TestSchedulerFCFSAndHeadOfLine(t *testing.T) {
	// 6 blocks of 4: while a holds 4-5 blocks, b (3 blocks) cannot be admitted, and c, which
	// would fit, waits behind b (FCFS: no overtaking).
	pool := newTestPool(t, 6, 4, false)
	h := newHarness(t, pool, SchedulerConfig{MaxNumBatchedTokens: 64})
	h.add("a", seqTokens(0, 16), 4) // 4 blocks now
	h.add("b", seqTokens(1, 12), 2) // 3 blocks: does not fit next to a
	h.add("c", seqTokens(2, 2), 2)  // 1 block: would fit, but FCFS keeps it behind b
	p, _ := h.step()
	if len(p.Work) != 1 || p.Work[0].Seq.ID() != "a" {
		t.Fatalf("first plan: %v", ids(p))
	}
	h.run(100)
	var order []string
	for _, p := range h.plans {
		for _, w := range p.Work {
			if w.Start == 0 {
				order = append(order, w.Seq.ID())
			}
		}
	}
	if !slices.Equal(order, []string{"a", "b", "c"}) {
		t.Fatalf("admission order %v, want a b c", order)
	}
}

func ids(p Plan) []string {
	var out []string
	for _, w := range p.Work {
		out = append(out, w.Seq.ID())
	}
	return out
}

func TestSchedulerDecodesBeforePrefills(t *testing.T) {
	pool := newTestPool(t, 32, 4, false)
	h := newHarness(t, pool, SchedulerConfig{MaxNumBatchedTokens: 6})
	h.add("a", seqTokens(0, 5), 5)
	h.step() // a prefilled
	h.add("b", seqTokens(1, 12), 2)
	p, _ := h.step()
	if got := ids(p); !slices.Equal(got, []string{"a", "b"}) || len(p.Work[1].Tokens) != 5 {
		t.Fatalf("plan %v (b gets %d tokens), want a's decode then a 5-token chunk of b", got, len(p.Work[1].Tokens))
	}
	h.run(100)
}

func TestSchedulerPrefixCache(t *testing.T) {
	pool := newTestPool(t, 32, 4, true)
	h := newHarness(t, pool, SchedulerConfig{})
	base := seqTokens(0, 10)
	a := h.add("a", base, 3)
	h.run(100)
	if a.CachedTokens() != 0 {
		t.Fatalf("first request cached %d tokens", a.CachedTokens())
	}

	// Same first 10 tokens plus more: the two full blocks of the prompt hit.
	b := h.add("b", append(slices.Clone(base), 55, 56, 57), 3)
	p, _ := h.step()
	if b.CachedTokens() != 8 || p.Work[0].Start != 8 {
		t.Fatalf("b: cached %d, first work starts at %d; want 8, 8", b.CachedTokens(), p.Work[0].Start)
	}
	h.run(100)

	// A prompt that is exactly two blocks of a's prompt: only one block may hit, so the last
	// prompt token is computed and has logits.
	c := h.add("c", base[:8], 3)
	p, _ = h.step()
	if c.CachedTokens() != 4 || p.Work[0].Start != 4 || len(p.Work[0].Tokens) != 4 {
		t.Fatalf("c: cached %d, work %d+%d; want 4, 4+4", c.CachedTokens(), p.Work[0].Start, len(p.Work[0].Tokens))
	}
	h.run(100)

	// a's output extended its cached chain: prompt + output blocks hit too.
	full := append(slices.Clone(a.Tokens()), 77, 78, 79)
	d := h.add("d", full, 2)
	h.step()
	if d.CachedTokens() != 12 {
		t.Fatalf("d: cached %d, want 12 (prompt and output blocks of a)", d.CachedTokens())
	}
	h.run(100)

	st := h.s.Stats()
	if st.PrefixQueries != int64(10+13+8+len(full)) || st.PrefixHits != 8+4+12 {
		t.Fatalf("prefix stats: queries %d hits %d", st.PrefixQueries, st.PrefixHits)
	}
	// Identical outputs with and without the cache.
	ref := reference(t, 4, map[string][]int32{"b": b.Prompt(), "c": c.Prompt()}, 3)
	if !slices.Equal(ref["b"], b.Output()) || !slices.Equal(ref["c"], c.Output()) {
		t.Fatalf("outputs with prefix hits differ from the reference")
	}
}

func TestSchedulerPreemptionKeepsOutputs(t *testing.T) {
	// 10 blocks of 2 tokens; four requests growing to 3+8 tokens each cannot all stay.
	prompts := map[string][]int32{}
	for i, n := range []int{3, 5, 2, 7} {
		prompts[fmt.Sprint("r", i)] = seqTokens(i*13, n)
	}
	const maxTokens = 8
	for _, prefix := range []bool{false, true} {
		t.Run(fmt.Sprint("prefix=", prefix), func(t *testing.T) {
			pool := newTestPool(t, 10, 2, prefix)
			h := newHarness(t, pool, SchedulerConfig{MaxModelLen: 20, MaxNumBatchedTokens: 5})
			for _, id := range slices.Sorted(maps.Keys(prompts)) {
				h.add(id, prompts[id], maxTokens)
			}
			h.run(1000)
			if h.s.Stats().Preemptions == 0 {
				t.Fatal("no preemption happened; the test pool is too large")
			}
			ref := reference(t, 2, prompts, maxTokens)
			for id, out := range h.outputs() {
				if !slices.Equal(out, ref[id]) {
					t.Errorf("%s: output %v, want %v", id, out, ref[id])
				}
			}
		})
	}
}

func TestSchedulerPreemptsNewestAndRequeuesFirst(t *testing.T) {
	pool := newTestPool(t, 4, 2, false)
	h := newHarness(t, pool, SchedulerConfig{MaxModelLen: 8, MaxNumBatchedTokens: 16})
	a := h.add("a", seqTokens(0, 3), 4) // 2 blocks
	b := h.add("b", seqTokens(1, 3), 4) // 2 blocks
	h.step()                            // both prefilled: 4 tokens each, 2 blocks each, pool full
	h.step()                            // decode position 3: still in the second block
	p, _ := h.step()                    // a needs a third block: b (newest) is preempted
	if len(p.Preempted) != 1 || p.Preempted[0] != b || b.Status() != StatusWaiting || b.NumComputed() != 0 {
		t.Fatalf("preempted %v, b %v computed %d", p.Preempted, b.Status(), b.NumComputed())
	}
	if got := ids(p); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("plan %v: no admission in a step that preempted", got)
	}
	h.add("c", seqTokens(2, 1), 1)
	h.run(100)
	// b went back to the queue's front: it is admitted again before c.
	var order []string
	for _, p := range h.plans[2:] {
		for _, w := range p.Work {
			if w.Start == 0 {
				order = append(order, w.Seq.ID())
			}
		}
	}
	if !slices.Equal(order, []string{"b", "c"}) {
		t.Fatalf("re-admission order %v, want b c", order)
	}
	if a.NumPreemptions() != 0 || b.NumPreemptions() != 1 {
		t.Fatalf("preemptions a=%d b=%d", a.NumPreemptions(), b.NumPreemptions())
	}
}

func TestSchedulerStopConditions(t *testing.T) {
	pool := newTestPool(t, 32, 4, false)
	h := newHarness(t, pool, SchedulerConfig{MaxModelLen: 12})
	script := map[string][]int32{
		"eos":      {20, 1, 21},          // EOS (1) ends it
		"mineos":   {1, 1, 22, 1, 23},    // EOS before min_tokens 3 does not end it
		"ignore":   {1, 1, 1},            // ignore_eos: runs to max_tokens
		"stopid":   {20, 5, 21},          // stop token id 5
		"maxlen":   {20, 21, 22, 23, 24}, // prompt 9 + 3 = MaxModelLen 12
		"maxtoken": {20, 21, 22},
	}
	h.next = func(q *Sequence) int32 { return script[q.ID()][q.NumOutputTokens()] }
	h.addReq(&Request{ID: "eos", Prompt: seqTokens(0, 3), MaxTokens: 10})
	h.addReq(&Request{ID: "mineos", Prompt: seqTokens(0, 3), MaxTokens: 10, MinTokens: 3})
	h.addReq(&Request{ID: "ignore", Prompt: seqTokens(0, 3), MaxTokens: 3, IgnoreEOS: true})
	h.addReq(&Request{ID: "stopid", Prompt: seqTokens(0, 3), MaxTokens: 10, StopTokenIDs: []int32{5}})
	h.addReq(&Request{ID: "maxlen", Prompt: seqTokens(0, 9), MaxTokens: 10})
	h.addReq(&Request{ID: "maxtoken", Prompt: seqTokens(0, 3), MaxTokens: 2})
	h.run(100)
	want := map[string]struct {
		st  Status
		out []int32
		tok bool
	}{
		"eos":      {StatusFinishedStopped, []int32{20, 1}, true},
		"mineos":   {StatusFinishedStopped, []int32{1, 1, 22, 1}, true},
		"ignore":   {StatusFinishedLengthCapped, []int32{1, 1, 1}, false},
		"stopid":   {StatusFinishedStopped, []int32{20, 5}, true},
		"maxlen":   {StatusFinishedLengthCapped, []int32{20, 21, 22}, false},
		"maxtoken": {StatusFinishedLengthCapped, []int32{20, 21}, false},
	}
	for id, w := range want {
		q := h.seqs[id]
		if q.Status() != w.st || !slices.Equal(q.Output(), w.out) || q.StoppedByToken() != w.tok {
			t.Errorf("%s: %v %v byToken=%v, want %v %v %v", id, q.Status(), q.Output(), q.StoppedByToken(), w.st, w.out, w.tok)
		}
	}
	if got := h.s.StopTokens(&Request{StopTokenIDs: []int32{5}}); !slices.Equal(got, []int32{5, 1}) {
		t.Errorf("StopTokens %v", got)
	}
	if got := h.s.StopTokens(&Request{IgnoreEOS: true}); len(got) != 0 {
		t.Errorf("StopTokens with ignore_eos %v", got)
	}
}

func TestSchedulerAddValidation(t *testing.T) {
	pool := newTestPool(t, 8, 4, false)
	h := newHarness(t, pool, SchedulerConfig{MaxModelLen: 16})
	cases := []struct {
		r    *Request
		want error
	}{
		{&Request{ID: "e", MaxTokens: 1}, ErrInvalidRequest},
		{&Request{ID: "l", Prompt: seqTokens(0, 16), MaxTokens: 1}, ErrPromptTooLong},
		{&Request{ID: "l2", Prompt: seqTokens(0, 16), MaxTokens: 1}, ErrInvalidRequest},
		{&Request{ID: "m", Prompt: seqTokens(0, 2), MaxTokens: 0}, ErrInvalidRequest},
		{&Request{ID: "n", Prompt: seqTokens(0, 2), MaxTokens: 2, MinTokens: 3}, ErrInvalidRequest},
		{&Request{ID: "s", Prompt: seqTokens(0, 2), MaxTokens: 2, Stop: []string{""}}, ErrInvalidRequest},
	}
	for _, c := range cases {
		if _, err := h.s.Add(c.r, h.now); !errors.Is(err, c.want) {
			t.Errorf("%s: err %v, want %v", c.r.ID, err, c.want)
		}
	}
	h.add("dup", seqTokens(0, 2), 1)
	if _, err := h.s.Add(&Request{ID: "dup", Prompt: seqTokens(0, 2), MaxTokens: 1}, h.now); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("duplicate id: %v", err)
	}
	h.run(10)
	if _, err := NewScheduler(pool, SchedulerConfig{MaxModelLen: 33}); !errors.Is(err, ErrConfig) {
		t.Errorf("max model len above the pool capacity: %v", err)
	}
}

func TestSchedulerAbortInEveryState(t *testing.T) {
	conn := newTestConnector()
	pool := newTestPool(t, 12, 4, true)
	h := newHarness(t, pool, SchedulerConfig{MaxModelLen: 48, MaxNumBatchedTokens: 8, Connector: conn})
	conn.external["remote"] = -1
	h.add("remote", seqTokens(5, 9), 4)   // parks in WAITING_FOR_REMOTE_KVS
	h.add("prefill", seqTokens(0, 20), 4) // chunked: RUNNING mid-prefill
	h.add("queued", seqTokens(1, 4), 4)   // WAITING, never admitted (budget)
	h.step()
	st := map[string]Status{}
	for id, q := range h.seqs {
		st[id] = q.Status()
	}
	want := map[string]Status{"remote": StatusWaitingForRemoteKVs, "prefill": StatusRunning, "queued": StatusWaiting}
	if !maps.Equal(st, want) {
		t.Fatalf("states %v, want %v", st, want)
	}
	used := pool.NumBlocks() - pool.NumFree()
	if used != 3+2 {
		t.Fatalf("%d blocks in use, want 5", used)
	}
	for _, id := range []string{"remote", "prefill", "queued"} {
		ev, ok := h.s.Finish(id, StatusFinishedAborted, h.now)
		if !ok || ev.Seq.Status() != StatusFinishedAborted || conn.finished[id] != StatusFinishedAborted {
			t.Fatalf("abort %s: ok=%v status %v connector saw %v", id, ok, ev.Seq.Status(), conn.finished[id])
		}
	}
	assertPoolFull(t, pool)
	if _, ok := h.s.Finish("queued", StatusFinishedAborted, h.now); ok {
		t.Fatal("finishing a finished request succeeded")
	}
	// A decoding request, and a preempted one (WAITING with history).
	h.add("dec", seqTokens(2, 3), 10)
	h.step()
	h.step()
	if q := h.seqs["dec"]; q.Status() != StatusRunning || q.NumOutputTokens() != 2 {
		t.Fatalf("dec: %v with %d tokens", q.Status(), q.NumOutputTokens())
	}
	h.s.Finish("dec", StatusFinishedAborted, h.now)
	// An abort between Schedule and Update: Update skips it.
	h.add("mid", seqTokens(3, 3), 10)
	plan := h.s.Schedule(h.now)
	h.s.Finish("mid", StatusFinishedAborted, h.now)
	if ev := h.s.Update(h.now, make([]int32, len(plan.Work))); len(ev) != 0 {
		t.Fatalf("update after abort produced %v", ev)
	}
	if st := h.s.Stats(); st.Running+st.Waiting != 0 {
		t.Fatalf("live requests after aborts: %+v", st)
	}
}

func TestSchedulerDelayedFree(t *testing.T) {
	conn := newTestConnector()
	conn.delay = true
	conn.params = map[string]any{"do_remote_prefill": true}
	pool := newTestPool(t, 8, 4, true)
	h := newHarness(t, pool, SchedulerConfig{Connector: conn})
	a := h.add("a", seqTokens(0, 6), 1) // P-style: max_tokens 1
	ev := h.run(10)
	if len(ev) != 1 || ev[0].Seq != a || a.Status() != StatusFinishedLengthCapped || ev[0].KVTransfer["do_remote_prefill"] != true {
		t.Fatalf("events %+v", ev)
	}
	if pool.NumFree() != pool.NumBlocks()-2 || !slices.Equal(h.s.Delayed(), []string{"a"}) || h.s.Stats().Delayed != 1 {
		t.Fatalf("held blocks: free %d, delayed %v", pool.NumFree(), h.s.Delayed())
	}
	held := slices.Clone(a.Blocks())
	// The held KV stays intact while other requests churn through the rest of the pool.
	conn.delay = false
	for i := range 4 {
		h.add(fmt.Sprint("x", i), seqTokens(40+i, 9), 2)
	}
	h.run(100)
	conn.delay = true
	h.sim.check("a", held, a.Tokens(), a.NumComputed())
	// The same id may not be reused while held.
	if _, err := h.s.Add(&Request{ID: "a", Prompt: seqTokens(0, 2), MaxTokens: 1}, h.now); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("reusing a held id: %v", err)
	}
	if !h.s.ReleaseDelayed("a") || h.s.ReleaseDelayed("a") {
		t.Fatal("ReleaseDelayed: want true once, then false")
	}
	// Aborted requests are offered to the connector too (it may hold blocks a load still writes).
	h.add("b", seqTokens(1, 6), 5)
	h.step()
	h.s.Finish("b", StatusFinishedAborted, h.now)
	if pool.NumFree() == pool.NumBlocks() {
		t.Fatal("aborted request's blocks were freed although the connector delayed the free")
	}
	h.s.ReleaseAllDelayed()
}

func TestSchedulerAsyncLoad(t *testing.T) {
	conn := newTestConnector()
	pool := newTestPool(t, 16, 4, true)
	h := newHarness(t, pool, SchedulerConfig{Connector: conn, MaxNumBatchedTokens: 64})
	// A local hit first: a's prompt is cached.
	a := h.add("a", seqTokens(0, 9), 1)
	h.run(10)
	prompt := append(slices.Clone(a.Prompt()[:8]), seqTokens(50, 8)...) // 16 tokens: 8 local + 8 remote
	conn.external["d"] = -1
	conn.external["full"] = -1
	d := h.add("d", prompt, 3)
	full := h.add("full", seqTokens(70, 12), 3) // whole prompt from remote, exact block multiple
	h.add("other", seqTokens(90, 5), 2)

	p, _ := h.step()
	if got := ids(p); !slices.Equal(got, []string{"other"}) {
		t.Fatalf("plan %v: parked requests must not be scheduled, others must pass them", got)
	}
	if d.Status() != StatusWaitingForRemoteKVs || full.Status() != StatusWaitingForRemoteKVs {
		t.Fatalf("states %v %v", d.Status(), full.Status())
	}
	ad, af := conn.allocs["d"], conn.allocs["full"]
	if ad.localHit != 8 || ad.external != 8 || len(ad.blocks) != 4 || af.localHit != 0 || af.external != 12 || len(af.blocks) != 3 {
		t.Fatalf("AfterAlloc d %+v full %+v", ad, af)
	}
	if st := h.s.Stats(); st.WaitingForRemote != 2 || st.ExternalHits != 20 {
		t.Fatalf("stats %+v", st)
	}
	if h.s.HasWork() != true {
		t.Fatal("other still runs")
	}
	h.run(10)
	if h.s.HasWork() {
		t.Fatal("HasWork with only parked requests")
	}
	// The loads complete (the "transfer" writes correct KV); unknown ids are ignored.
	transfer(h.sim, d, ad, -1)
	transfer(h.sim, full, af, -1)
	if ev := h.s.LoadsDone(h.now, []string{"d", "full", "nobody"}, nil, nil); len(ev) != 0 {
		t.Fatalf("events %v", ev)
	}
	if d.Status() != StatusWaiting || full.NumComputed() != 11 {
		t.Fatalf("after load: d %v, full computed %d (want 11: the last prompt token is recomputed)", d.Status(), full.NumComputed())
	}
	p, _ = h.step()
	for _, w := range p.Work {
		wantStart := map[string]int{"d": 15, "full": 11}[w.Seq.ID()]
		if w.Start != wantStart || len(w.Tokens) != 1 || !w.Sample {
			t.Fatalf("%s: work %d+%d, want %d+1", w.Seq.ID(), w.Start, len(w.Tokens), wantStart)
		}
	}
	h.run(10)
	if d.CachedTokens() != 15 || full.CachedTokens() != 11 { // the last prompt token is computed locally
		t.Fatalf("cached tokens d=%d full=%d", d.CachedTokens(), full.CachedTokens())
	}
	ref := reference(t, 4, map[string][]int32{"d": d.Prompt(), "full": full.Prompt()}, 3)
	if !slices.Equal(ref["d"], d.Output()) || !slices.Equal(ref["full"], full.Output()) {
		t.Fatal("outputs after a remote load differ from the reference")
	}
	// The loaded blocks were committed: a new request with full's prompt hits them.
	e := h.add("e", full.Prompt(), 1)
	h.run(10)
	if e.CachedTokens() != 8 || conn.matched["d"] != 1 {
		t.Fatalf("e cached %d (want 8), MatchedExternal(d) called %d times", e.CachedTokens(), conn.matched["d"])
	}
}

func TestSchedulerLoadFailurePolicyFail(t *testing.T) {
	conn := newTestConnector()
	pool := newTestPool(t, 16, 4, true)
	h := newHarness(t, pool, SchedulerConfig{Connector: conn})
	conn.external["d"] = -1
	d := h.add("d", seqTokens(3, 14), 3)
	h.step()
	transfer(h.sim, d, conn.allocs["d"], 1)
	ev := h.s.LoadsDone(h.now, []string{"d"}, nil, map[string]int{"d": 1})
	if len(ev) != 1 || d.Status() != StatusFinishedError || !errors.Is(ev[0].Err, ErrKVLoad) {
		t.Fatalf("events %+v, status %v", ev, d.Status())
	}
	if conn.finished["d"] != StatusFinishedError || h.s.Stats().LoadFailures != 1 {
		t.Fatalf("connector saw %v; stats %+v", conn.finished["d"], h.s.Stats())
	}
	// Nothing of the failed load may be reused: the same prompt computes from scratch.
	r := h.add("r", d.Prompt(), 3)
	h.run(10)
	if r.CachedTokens() != 0 {
		t.Fatalf("retry hit %d cached tokens of a failed load", r.CachedTokens())
	}
}

func TestSchedulerLoadFailurePolicyRecompute(t *testing.T) {
	for _, bad := range []int{0, 1, 3} {
		t.Run(fmt.Sprint("bad=", bad), func(t *testing.T) {
			conn := newTestConnector()
			pool := newTestPool(t, 16, 4, true)
			h := newHarness(t, pool, SchedulerConfig{Connector: conn, LoadFailurePolicy: FailurePolicyRecompute})
			conn.external["d"] = -1
			d := h.add("d", seqTokens(3, 14), 3)
			h.step()
			transfer(h.sim, d, conn.allocs["d"], bad)
			if ev := h.s.LoadsDone(h.now, nil, nil, map[string]int{"d": bad}); len(ev) != 0 {
				t.Fatalf("events %+v", ev)
			}
			if d.Status() != StatusWaiting || d.NumComputed() != bad*4 || d.CachedTokens() != bad*4 {
				t.Fatalf("after failure: %v computed %d cached %d", d.Status(), d.NumComputed(), d.CachedTokens())
			}
			p, _ := h.step()
			if p.Work[0].Start != bad*4 {
				t.Fatalf("recompute starts at %d, want %d", p.Work[0].Start, bad*4)
			}
			h.run(10)
			ref := reference(t, 4, map[string][]int32{"d": d.Prompt()}, 3)
			if !slices.Equal(ref["d"], d.Output()) || d.Status() != StatusFinishedLengthCapped {
				t.Fatalf("recomputed output %v (%v), want %v", d.Output(), d.Status(), ref["d"])
			}
			if st := h.s.Stats(); st.RecomputedTokens != int64(14-bad*4) {
				t.Fatalf("recomputed tokens %d", st.RecomputedTokens)
			}
		})
	}
}

// TestSchedulerRecomputeClampsExternalCached: a load that missed, or failed under policy
// recompute, keeps only what was really pulled in ExternalCachedTokens (usage's
// external_cached_tokens), however large the local prefix-cache hit.
func TestSchedulerRecomputeClampsExternalCached(t *testing.T) {
	for _, tc := range []struct {
		name     string
		bad      int // block-table index of the first bad block; -1: the load missed
		cached   int
		external int
	}{
		{"missed", -1, 8, 0},
		{"failed at block 3", 3, 12, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn := newTestConnector()
			pool := newTestPool(t, 16, 4, true)
			h := newHarness(t, pool, SchedulerConfig{Connector: conn, LoadFailurePolicy: FailurePolicyRecompute})
			a := h.add("a", seqTokens(0, 9), 1)
			h.run(10)
			conn.external["d"] = -1
			d := h.add("d", append(slices.Clone(a.Prompt()[:8]), seqTokens(50, 8)...), 3) // 8 local + 8 remote
			h.step()
			if d.Status() != StatusWaitingForRemoteKVs || d.CachedTokens() != 15 || d.ExternalCachedTokens() != 7 {
				t.Fatalf("parked: %v, cached %d, external %d", d.Status(), d.CachedTokens(), d.ExternalCachedTokens())
			}
			if tc.bad < 0 {
				h.s.LoadsMissed([]string{"d"})
			} else {
				transfer(h.sim, d, conn.allocs["d"], tc.bad)
				if ev := h.s.LoadsDone(h.now, nil, nil, map[string]int{"d": tc.bad}); len(ev) != 0 {
					t.Fatalf("events %+v", ev)
				}
			}
			if d.Status() != StatusWaiting || d.CachedTokens() != tc.cached || d.ExternalCachedTokens() != tc.external {
				t.Fatalf("after the load: %v, cached %d, external %d; want cached %d, external %d",
					d.Status(), d.CachedTokens(), d.ExternalCachedTokens(), tc.cached, tc.external)
			}
			h.run(10)
			ref := reference(t, 4, map[string][]int32{"d": d.Prompt()}, 3)
			if !slices.Equal(ref["d"], d.Output()) || d.CachedTokens() != tc.cached || d.ExternalCachedTokens() != tc.external {
				t.Fatalf("finished: output %v (want %v), cached %d, external %d", d.Output(), ref["d"], d.CachedTokens(), d.ExternalCachedTokens())
			}
		})
	}
}

func TestSchedulerSyncExternal(t *testing.T) {
	conn := newTestConnector()
	pool := newTestPool(t, 16, 4, true)
	h := newHarness(t, pool, SchedulerConfig{Connector: conn})
	conn.sync, conn.sim = true, &h.sim
	conn.external["s"] = -1
	s := h.add("s", seqTokens(8, 10), 2)
	p, _ := h.step()
	if s.CachedTokens() != 9 || p.Work[0].Start != 9 {
		t.Fatalf("cached %d, start %d; want 9 and 9", s.CachedTokens(), p.Work[0].Start)
	}
	h.run(10)
}

func TestSchedulerMatchedExternalAskedAgainAfterBlockedAdmission(t *testing.T) {
	conn := newTestConnector()
	pool := newTestPool(t, 4, 4, false)
	h := newHarness(t, pool, SchedulerConfig{Connector: conn, MaxModelLen: 16})
	h.add("big", seqTokens(0, 12), 2) // 3 blocks
	conn.external["d"] = -1
	d := h.add("d", seqTokens(1, 8), 2) // needs 2 blocks: only 1 free while big runs
	h.step()
	if d.Status() != StatusWaiting || conn.matched["d"] != 1 || pool.NumFree() != 1 {
		t.Fatalf("d %v, asked %d, free %d", d.Status(), conn.matched["d"], pool.NumFree())
	}
	h.run(10) // big finishes, d parks
	if d.Status() != StatusWaitingForRemoteKVs || conn.matched["d"] < 2 {
		t.Fatalf("d %v after %d asks", d.Status(), conn.matched["d"])
	}
	transfer(h.sim, d, conn.allocs["d"], -1)
	h.s.LoadsDone(h.now, []string{"d"}, nil, nil)
	h.run(10)
	if d.Status() != StatusFinishedLengthCapped {
		t.Fatalf("d %v", d.Status())
	}
}

func TestSchedulerAbortPreemptedLoadedAndHeld(t *testing.T) {
	conn := newTestConnector()
	pool := newTestPool(t, 4, 2, true)
	h := newHarness(t, pool, SchedulerConfig{MaxModelLen: 8, MaxNumBatchedTokens: 16, Connector: conn})
	h.add("a", seqTokens(0, 3), 4)
	b := h.add("b", seqTokens(1, 3), 4)
	for b.NumPreemptions() == 0 {
		h.step()
	}
	if b.Status() != StatusWaiting || b.NumOutputTokens() == 0 {
		t.Fatalf("b %v with %d tokens", b.Status(), b.NumOutputTokens())
	}
	h.s.Finish("b", StatusFinishedAborted, h.now) // preempted, with history, no blocks
	h.run(100)

	// Loaded: WAITING again, holding the blocks its load filled.
	conn.external["d"] = -1
	d := h.add("d", seqTokens(2, 5), 2)
	h.s.Schedule(h.now)
	transfer(h.sim, d, conn.allocs["d"], -1)
	h.s.LoadsDone(h.now, []string{"d"}, nil, nil)
	if d.Status() != StatusWaiting || len(d.Blocks()) != 3 {
		t.Fatalf("d %v with %d blocks", d.Status(), len(d.Blocks()))
	}
	h.s.Finish("d", StatusFinishedAborted, h.now)
	assertPoolFull(t, pool)

	// Held: finished with delayed free; Finish does nothing, ReleaseDelayed frees.
	conn.delay = true
	h.add("e", seqTokens(3, 3), 1)
	h.run(10)
	if _, ok := h.s.Finish("e", StatusFinishedAborted, h.now); ok {
		t.Fatal("finished a held request again")
	}
	h.s.ReleaseDelayed("e")
}

func TestSchedulerAbortAll(t *testing.T) {
	conn := newTestConnector()
	pool := newTestPool(t, 16, 4, true)
	h := newHarness(t, pool, SchedulerConfig{Connector: conn, MaxNumBatchedTokens: 4})
	conn.external["p"] = -1
	h.add("p", seqTokens(0, 8), 2)
	h.add("r", seqTokens(1, 8), 2)
	h.add("w", seqTokens(2, 8), 2)
	h.step()
	ev := h.s.AbortAll(h.now)
	if len(ev) != 3 {
		t.Fatalf("%d events", len(ev))
	}
	for _, e := range ev {
		if e.Seq.Status() != StatusFinishedAborted {
			t.Fatalf("%s: %v", e.Seq.ID(), e.Seq.Status())
		}
	}
}
