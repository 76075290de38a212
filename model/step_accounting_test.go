package model

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// stepAccount divides the wall time of observed steps between their parts (stepPart) and, within
// a part, between the work the pool's goroutines did together and the time some waited.
type stepAccount struct {
	workers int
	steps   int
	marks   []partMark
	spans   []kernel.ParallelSpan
	// per part: wall, time outside Parallel calls (the caller alone), and inside them the time
	// every goroutine was busy, some but not all, and none (before the first item started or
	// after the last finished).
	wall, serial, all, some, none [numParts]time.Duration
	calls                         [numParts]int
	// per part: the helpers' items and their delay from the call's start to their first item,
	// the caller's items, and the calls no helper took part in.
	helperItems, callerItems, alone [numParts]int
	helperDelay                     [numParts]time.Duration
	outside                         time.Duration // between steps: the caller's own per-step work
}

type partMark struct {
	p stepPart
	t time.Time
}

// observe attaches the account to m for the steps that follow; detach with m.mark = nil.
func (a *stepAccount) observe(m *Model) {
	a.workers = m.pool.Workers()
	m.mark = func(p stepPart) { a.marks = append(a.marks, partMark{p, time.Now()}) }
	m.pool.Observe(func(sp kernel.ParallelSpan) { a.spans = append(a.spans, sp) })
}

// close folds the step just observed (its marks and spans) into the totals.
func (a *stepAccount) close() {
	a.steps++
	si := 0
	for i := 0; i+1 < len(a.marks); i++ {
		p, t0, t1 := a.marks[i].p, a.marks[i].t, a.marks[i+1].t
		a.wall[p] += t1.Sub(t0)
		in := time.Duration(0)
		for ; si < len(a.spans) && a.spans[si].Start.Before(t1); si++ {
			sp := a.spans[si]
			d := sp.End.Sub(sp.Start)
			in += d
			a.calls[p]++
			helped := false
			for _, sh := range sp.Shares {
				if sh.Caller {
					a.callerItems[p] += sh.Items
				} else {
					a.helperItems[p] += sh.Items
					a.helperDelay[p] += sh.First.Sub(sp.Start)
					helped = true
				}
			}
			if !helped {
				a.alone[p]++
			}
			all, some := busy(sp.Shares, a.workers)
			a.all[p] += all
			a.some[p] += some
			a.none[p] += d - all - some
		}
		a.serial[p] += t1.Sub(t0) - in
	}
	a.marks, a.spans = a.marks[:0], a.spans[:0]
}

// busy returns how long all workers, and some but not all, were running items of one call.
func busy(shares []kernel.ShareSpan, workers int) (all, some time.Duration) {
	type edge struct {
		t time.Time
		d int
	}
	var ev []edge
	for _, s := range shares {
		ev = append(ev, edge{s.First, 1}, edge{s.Last, -1})
	}
	slices.SortFunc(ev, func(a, b edge) int { return a.t.Compare(b.t) })
	n := 0
	for i, e := range ev {
		if i > 0 && n > 0 {
			d := e.t.Sub(ev[i-1].t)
			if n >= workers {
				all += d
			} else {
				some += d
			}
		}
		n += e.d
	}
	return all, some
}

func (a *stepAccount) String() string {
	var b strings.Builder
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 / float64(a.steps) }
	var tot [5]time.Duration
	fmt.Fprintf(&b, "%-11s %6s %9s %9s %9s %9s %9s %7s %7s %6s %8s\n", "part", "calls", "wall µs", "all busy", "some idle", "none", "serial", "items c", "items h", "alone", "h delay")
	for p := range numParts {
		if a.wall[p] == 0 {
			continue
		}
		calls := float64(a.calls[p])
		helped := float64(a.calls[p] - a.alone[p])
		fmt.Fprintf(&b, "%-11s %6.0f %9.1f %9.1f %9.1f %9.1f %9.1f %7.1f %7.1f %6.2f %8.1f\n", p, calls/float64(a.steps), us(a.wall[p]), us(a.all[p]), us(a.some[p]), us(a.none[p]), us(a.serial[p]),
			float64(a.callerItems[p])/max(1, calls), float64(a.helperItems[p])/max(1, calls), float64(a.alone[p])/max(1, calls), float64(a.helperDelay[p].Nanoseconds())/1e3/max(1, helped))
		for i, d := range []time.Duration{a.wall[p], a.all[p], a.some[p], a.none[p], a.serial[p]} {
			tot[i] += d
		}
	}
	fmt.Fprintf(&b, "%-11s %6s %9.1f %9.1f %9.1f %9.1f %9.1f\n", "step", "", us(tot[0]), us(tot[1]), us(tot[2]), us(tot[3]), us(tot[4]))
	fmt.Fprintf(&b, "outside Forward (argmax, next Seq): %.1f µs a step\n", us(a.outside))
	return b.String()
}

// BenchmarkStepAccounting divides the wall time of batch-1 decode steps of the model at
// $KVBRIDGE_BENCH_MODEL (skipped without it; e.g. /tmp/qwen3-0.6b), in the dtypes of
// $KVBRIDGE_BENCH_DTYPE (default bfloat16 and float32), at contexts 128 and 1024, between the
// step's parts and, within each, the pool's busy and idle time (stepAccount), and logs the table
// (-v), for the former structure of the step (splitOnCaller) and the current one, alternated step
// by step. Between steps it reads memory for as long as the step took, as `kvbridge bench engine`'s
// bandwidth probe does, so that the pool's workers park between steps as they do there.
func BenchmarkStepAccounting(b *testing.B) {
	eachBatch1(b, func(b *testing.B, m *Model, kv *testKV, seqs []Seq, probe *kernel.ReadProbe, dtype string, ctx int) {
		const blockSize = batch1BlockSize
		logits := seqs[0].Logits
		for range 3 {
			if err := m.Forward(b.Context(), kv, blockSize, seqs); err != nil {
				b.Fatal(err)
			}
		}
		// Steps alternate between the step's former structure (old: splitOnCaller) and
		// its current one, each with its own account.
		var acc [2]stepAccount
		defer func() { m.mark, m.splitOnCaller = nil, false; m.pool.Observe(nil) }()
		var wall time.Duration
		i := 0
		for b.Loop() {
			old := i%2 == 0
			i++
			a := &acc[i%2]
			m.splitOnCaller = old
			a.observe(m)
			t0 := time.Now()
			seqs[0].Tokens[0] = Argmax(logits)
			t1 := time.Now()
			if err := m.Forward(b.Context(), kv, blockSize, seqs); err != nil {
				b.Fatal(err)
			}
			d := time.Since(t0)
			wall += d
			a.outside += t1.Sub(t0)
			a.close()
			probe.GBps(d)
		}
		b.ReportMetric(float64(wall.Microseconds())/float64(b.N), "µs/step")
		b.Logf("%s context %d, %d workers, old structure (%d steps):\n%s", dtype, ctx, acc[1].workers, acc[1].steps, &acc[1])
		b.Logf("%s context %d, %d workers, new structure (%d steps):\n%s", dtype, ctx, acc[0].workers, acc[0].steps, &acc[0])
	})
}

// BenchmarkBatch1Paired runs batch-1 decode steps of the model at $KVBRIDGE_BENCH_MODEL
// (skipped without it) at contexts 128 and 1024 (dtypes and KV cache dtype as
// BenchmarkStepAccounting), alternating step by step between an old and a new form of the step,
// with the bandwidth probe's read between steps as in BenchmarkStepAccounting, and reports the
// median of the pairs' speed ratios (new÷old: old step time ÷ new step time) and each form's
// median step time. $KVBRIDGE_BENCH_PAIR chooses the forms: "split" (default) the step's former
// structure (old: the split sequence's probabilities and chunk sums on the caller) and its
// current one; "fp8f32" FP8 attention on the float32 row kernels (old: Model.fp8F32) and on the
// bfloat16 ones (with KVBRIDGE_BENCH_KV=fp8).
func BenchmarkBatch1Paired(b *testing.B) {
	pair := os.Getenv("KVBRIDGE_BENCH_PAIR")
	if pair != "" && pair != "split" && pair != "fp8f32" {
		b.Fatalf("KVBRIDGE_BENCH_PAIR %q (want split or fp8f32)", pair)
	}
	eachBatch1(b, func(b *testing.B, m *Model, kv *testKV, seqs []Seq, probe *kernel.ReadProbe, dtype string, ctx int) {
		const blockSize = batch1BlockSize
		logits := seqs[0].Logits
		step := func(old bool) time.Duration {
			if pair == "fp8f32" {
				m.fp8F32 = old
			} else {
				m.splitOnCaller = old
			}
			t0 := time.Now()
			seqs[0].Tokens[0] = Argmax(logits)
			if err := m.Forward(b.Context(), kv, blockSize, seqs); err != nil {
				b.Fatal(err)
			}
			d := time.Since(t0)
			probe.GBps(d)
			return d
		}
		defer func() { m.splitOnCaller, m.fp8F32 = false, false }()
		step(true)
		step(false)
		var ratios, olds, news []float64
		i := 0
		for b.Loop() {
			// Old first in even pairs, new first in odd ones.
			var o, n time.Duration
			if i%2 == 0 {
				o, n = step(true), step(false)
			} else {
				n, o = step(false), step(true)
			}
			i++
			ratios = append(ratios, o.Seconds()/n.Seconds())
			olds, news = append(olds, o.Seconds()*1e3), append(news, n.Seconds()*1e3)
		}
		med := func(x []float64) float64 { slices.Sort(x); return x[len(x)/2] }
		b.ReportMetric(med(ratios), "new/old")
		b.ReportMetric(med(olds), "old-ms")
		b.ReportMetric(med(news), "new-ms")
	})
}

// batch1BlockSize is the block size of eachBatch1's KV stores.
const batch1BlockSize = 16

// eachBatch1 runs fn as a sub-benchmark for each dtype of $KVBRIDGE_BENCH_DTYPE (default
// bfloat16 and float32) of the model at $KVBRIDGE_BENCH_MODEL (skipped without it), with the KV
// cache dtype of $KVBRIDGE_BENCH_KV (default the dtype's), and contexts 128 and 1024: a KV store of one sequence's blocks filled with small values, the sequence
// decoding its last position (Logits set), and a bandwidth probe to read between steps.
func eachBatch1(b *testing.B, fn func(b *testing.B, m *Model, kv *testKV, seqs []Seq, probe *kernel.ReadProbe, dtype string, ctx int)) {
	path := os.Getenv("KVBRIDGE_BENCH_MODEL")
	if path == "" {
		b.Skip("KVBRIDGE_BENCH_MODEL is not set")
	}
	dtypes := []string{"bfloat16", "float32"}
	if s := os.Getenv("KVBRIDGE_BENCH_DTYPE"); s != "" {
		dtypes = strings.Split(s, ",")
	}
	probe := kernel.NewReadProbe(64<<20, 0)
	for _, dtype := range dtypes {
		m, err := Open(b.Context(), path, OpenOptions{DType: dtype, KVCacheDType: os.Getenv("KVBRIDGE_BENCH_KV")})
		if err != nil {
			b.Fatal(err)
		}
		for _, ctx := range []int{128, 1024} {
			b.Run(fmt.Sprintf("%s/ctx%d", dtype, ctx), func(b *testing.B) {
				per := ctx / batch1BlockSize
				kv := newTestKVFor(m, batch1BlockSize, per, false)
				for i := range kv.mem {
					kv.mem[i] = 0.01 * float32(i%7)
				}
				for i := range kv.mem16 {
					kv.mem16[i] = kernel.F32ToBF16(0.01 * float32(i%7))
				}
				for i := range kv.mem8 {
					kv.mem8[i] = m.fp8.FromF32(0.01 * float32(i%7))
				}
				logits := make([]float32, m.cfg.VocabSize)
				seqs := []Seq{{Tokens: []int32{1}, Start: ctx - 1, Blocks: blockRange(0, per), Logits: logits}}
				fn(b, m, kv, seqs, probe, dtype, ctx)
			})
		}
		m.Close()
	}
}
