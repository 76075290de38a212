package engine

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"
)

// TestSchedulerTraces runs the golden traces of testdata/scheduler: each file drives a real
// scheduler over a real pool (simKV plays the model and checks the KV of every step, a fake
// clock gives the time) and compares what each command prints with the file. Regenerate them
// with go test ./engine -run TestSchedulerTraces -rewrite, then read the diff.
//
// Commands:
//
//	config blocks=N block-size=N [budget=N] [max-seqs=N] [max-len=N] [prefix] [policy=recompute]
//	add id=ID prompt=N max=N [base=N] [remote=N|all] [sync] [hold] [evictable]
//	step [n=N]                  one Schedule/compute/Update round per step: plan, finishes, queues
//	load-done id=ID (ok [first=T]|fail=I) the connector's load of ID arrived (with first, the
//	                            first token T another engine sampled), or failed at block index I
//	load-missed id=ID           the connector's load of ID found nothing to load
//	finish id=ID [status=S]     Finish (aborted, stopped, length, error; default aborted)
//	release id=ID               ReleaseDelayed
//	abort-all                   AbortAll, then ReleaseAllDelayed
//	state                       every request's state
//
// add's prompt is seqTokens(base, prompt) (base defaults to a fresh one per request, so prompts
// share a prefix only when asked); remote is how many tokens beyond the local hit the connector
// supplies (all: the rest of the prompt), asynchronously unless sync; hold makes the connector
// keep the blocks at finish, evictable makes that hold one it gives up under memory pressure.
// Every command but state ends with the queues and the free blocks; at the end of each file every
// block must be free again.
func TestSchedulerTraces(t *testing.T) {
	datadriven.Walk(t, "testdata/scheduler", func(t *testing.T, path string) {
		var tr *trace
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			if d.Cmd == "config" {
				tr = newTrace(t, d)
				return tr.queues()
			}
			if tr == nil {
				d.Fatalf(t, "%s before config", d.Cmd)
			}
			return tr.run(t, d)
		})
	})
}

// trace is one trace file's scheduler, harness and connector.
type trace struct {
	h     *harness
	conn  *traceConnector
	bases int // the next fresh prompt base
}

func newTrace(t *testing.T, d *datadriven.TestData) *trace {
	var blocks, bs int
	d.ScanArgs(t, "blocks", &blocks)
	d.ScanArgs(t, "block-size", &bs)
	var cfg SchedulerConfig
	scanOpt(t, d, "budget", &cfg.MaxNumBatchedTokens)
	scanOpt(t, d, "max-seqs", &cfg.MaxNumSeqs)
	scanOpt(t, d, "max-len", &cfg.MaxModelLen)
	if d.HasArg("policy") {
		var s string
		d.ScanArgs(t, "policy", &s)
		p, err := ParseFailurePolicy(s)
		if err != nil {
			d.Fatalf(t, "%v", err)
		}
		cfg.LoadFailurePolicy = p
	}
	conn := &traceConnector{external: map[string]int{}, sync: map[string]bool{}, hold: map[string]bool{},
		evictable: map[string]bool{}, allocs: map[string]allocCall{}}
	cfg.Connector = conn
	h := newHarness(t, newTestPool(t, blocks, bs, d.HasArg("prefix")), cfg)
	conn.sim = &h.sim
	return &trace{h: h, conn: conn}
}

// scanOpt scans the optional int argument key into dst.
func scanOpt(t *testing.T, d *datadriven.TestData, key string, dst *int) {
	if d.HasArg(key) {
		d.ScanArgs(t, key, dst)
	}
}

func (tr *trace) run(t *testing.T, d *datadriven.TestData) string {
	h := tr.h
	var id string
	if d.HasArg("id") {
		d.ScanArgs(t, "id", &id)
	}
	var b strings.Builder
	switch d.Cmd {
	case "add":
		tr.add(t, d, id)
	case "step":
		n := 1
		scanOpt(t, d, "n", &n)
		for i := range n {
			plan := h.schedule()
			if n > 1 {
				fmt.Fprintf(&b, "step %d ", i+1)
			}
			b.WriteString(planText(plan))
			b.WriteString(eventsText(h.compute(plan)))
		}
	case "load-done":
		q := h.s.Get(id)
		a, ok := tr.conn.allocs[id]
		if q == nil || !ok {
			d.Fatalf(t, "load-done: %q has no load", id)
		}
		if d.HasArg("ok") {
			transfer(h.sim, q, a, -1)
			var first map[string]FirstToken
			if d.HasArg("first") {
				var tok int
				d.ScanArgs(t, "first", &tok)
				first = map[string]FirstToken{id: {Token: int32(tok)}}
			}
			b.WriteString(eventsText(h.s.LoadsDone(h.now, []string{id}, first, nil)))
			break
		}
		var bad int
		d.ScanArgs(t, "fail", &bad)
		transfer(h.sim, q, a, bad)
		b.WriteString(eventsText(h.s.LoadsDone(h.now, nil, nil, map[string]int{id: bad})))
	case "load-missed":
		h.s.LoadsMissed([]string{id})
	case "finish":
		st := "aborted"
		if d.HasArg("status") {
			d.ScanArgs(t, "status", &st)
		}
		statuses := map[string]Status{"aborted": StatusFinishedAborted, "stopped": StatusFinishedStopped,
			"length": StatusFinishedLengthCapped, "error": StatusFinishedError}
		if _, ok := statuses[st]; !ok {
			d.Fatalf(t, "unknown status %q", st)
		}
		ev, ok := h.s.Finish(id, statuses[st], h.now)
		if !ok {
			b.WriteString("not live\n")
			break
		}
		b.WriteString(eventsText([]Event{ev}))
	case "release":
		tr.conn.unhold(id)
		fmt.Fprintf(&b, "released: %v\n", h.s.ReleaseDelayed(id))
	case "abort-all":
		b.WriteString(eventsText(h.s.AbortAll(h.now)))
		tr.conn.held = nil
		h.s.ReleaseAllDelayed()
	case "state":
		return tr.state()
	default:
		d.Fatalf(t, "unknown command %q", d.Cmd)
	}
	b.WriteString(tr.queues())
	return b.String()
}

// add queues a request as the add command describes it.
func (tr *trace) add(t *testing.T, d *datadriven.TestData, id string) {
	var n, maxTokens int
	d.ScanArgs(t, "prompt", &n)
	d.ScanArgs(t, "max", &maxTokens)
	base := 100 + 13*tr.bases // never one of the explicit small bases
	tr.bases++
	scanOpt(t, d, "base", &base)
	if d.HasArg("remote") {
		var s string
		d.ScanArgs(t, "remote", &s)
		ext := -1
		if s != "all" {
			var err error
			if ext, err = strconv.Atoi(s); err != nil {
				d.Fatalf(t, "remote=%s: %v", s, err)
			}
		}
		tr.conn.external[id] = ext
	}
	tr.conn.sync[id] = d.HasArg("sync")
	tr.conn.hold[id] = d.HasArg("hold")
	tr.conn.evictable[id] = d.HasArg("evictable")
	if _, err := tr.h.s.Add(&Request{ID: id, Prompt: seqTokens(base, n), MaxTokens: maxTokens}, tr.h.now); err != nil {
		d.Fatalf(t, "add: %v", err)
	}
}

// eventsText lists the requests that finished, with the connector's params and the error if any.
func eventsText(evs []Event) string {
	var b strings.Builder
	for _, ev := range evs {
		if !ev.Seq.Status().Finished() {
			continue
		}
		fmt.Fprintf(&b, "finished %s %v output=%d", ev.Seq.ID(), ev.Seq.Status(), ev.Seq.NumOutputTokens())
		if ev.KVTransfer != nil {
			fmt.Fprintf(&b, " kv_transfer=%v", ev.KVTransfer)
		}
		if ev.Err != nil {
			fmt.Fprintf(&b, " err=%q", ev.Err)
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// queues prints the running and waiting requests in queue order (those waiting for remote KV
// marked), the held ones and the free blocks.
func (tr *trace) queues() string {
	s := tr.h.s
	ids := func(qs []*Sequence) string {
		out := make([]string, len(qs))
		for i, q := range qs {
			out[i] = q.ID()
			if q.Status() == StatusWaitingForRemoteKVs {
				out[i] += "(remote)"
			}
		}
		return strings.Join(out, " ")
	}
	return fmt.Sprintf("running=[%s] waiting=[%s] held=[%s] free=%d/%d\n",
		ids(s.running), ids(s.waiting), strings.Join(s.Delayed(), " "), tr.h.pool.NumFree(), tr.h.pool.NumBlocks())
}

// state prints every live and held request: status, tokens computed of all, output tokens,
// prefix-cache and connector tokens, preemptions and blocks.
func (tr *trace) state() string {
	s := tr.h.s
	var b strings.Builder
	all := slices.Concat(s.running, s.waiting)
	for _, id := range s.Delayed() {
		all = append(all, s.Get(id))
	}
	for _, q := range all {
		fmt.Fprintf(&b, "%s %v computed=%d/%d output=%d cached=%d external=%d preemptions=%d blocks=%v\n",
			q.ID(), q.Status(), q.NumComputed(), q.NumTokens(), q.NumOutputTokens(), q.CachedTokens(),
			q.ExternalCachedTokens(), q.NumPreemptions(), q.Blocks())
	}
	st := s.Stats()
	fmt.Fprintf(&b, "stats: prefix %d/%d external %d preemptions %d load-failures %d recomputed %d\n",
		st.PrefixHits, st.PrefixQueries, st.ExternalHits, st.Preemptions, st.LoadFailures, st.RecomputedTokens)
	return b.String()
}

// traceConnector is the traces' connector: it supplies the tokens the add command asked for,
// once per request (asynchronously, or written at AfterAlloc when sync), holds the blocks of
// the requests asked to hold, and gives up the evictable holds, oldest first.
type traceConnector struct {
	external  map[string]int // tokens beyond the local hit; -1 = the rest of the prompt
	sync      map[string]bool
	hold      map[string]bool
	evictable map[string]bool
	sim       *simKV

	allocs map[string]allocCall
	held   []heldBlocks // oldest first
}

// heldBlocks is one finished request's held blocks.
type heldBlocks struct {
	id     string
	blocks int
}

func (c *traceConnector) MatchedExternal(q *Sequence, localHit int) (int, bool) {
	n, ok := c.external[q.ID()]
	if !ok || c.allocs[q.ID()].blocks != nil || q.NumPreemptions() > 0 {
		return 0, false // loaded at most once, like vLLM's do_remote_prefill=false after the first
	}
	if n < 0 {
		n = q.NumPromptTokens() - localHit
	}
	return n, !c.sync[q.ID()]
}

func (c *traceConnector) AfterAlloc(q *Sequence, blocks []int32, numExternal int) {
	if _, again := c.allocs[q.ID()]; again {
		return
	}
	lh := q.NumLocalHitTokens()
	c.allocs[q.ID()] = allocCall{blocks: slices.Clone(blocks), localHit: lh, external: numExternal}
	if c.sync[q.ID()] && numExternal > 0 {
		c.sim.write(blocks, lh, q.Tokens()[lh:lh+numExternal])
	}
}

func (c *traceConnector) Finished(q *Sequence, _ Status, _ time.Time) (bool, map[string]any) {
	if !c.hold[q.ID()] {
		return false, nil
	}
	if len(q.Blocks()) > 0 {
		c.held = append(c.held, heldBlocks{q.ID(), len(q.Blocks())})
	}
	return true, map[string]any{"held_blocks": len(q.Blocks())}
}

func (c *traceConnector) EvictHolds(blocks int) []string {
	var ids []string
	for _, h := range slices.Clone(c.held) {
		if blocks <= 0 {
			break
		}
		if c.evictable[h.id] {
			ids = append(ids, h.id)
			blocks -= h.blocks
			c.unhold(h.id)
		}
	}
	return ids
}

// unhold forgets id's hold.
func (c *traceConnector) unhold(id string) {
	c.held = slices.DeleteFunc(c.held, func(h heldBlocks) bool { return h.id == id })
}
