//go:build linux

package kernel

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// threadCPU returns the CPU seconds the calling thread has used.
func threadCPU(b *testing.B) float64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		b.Fatalf("thread CPU time: %v", err)
	}
	return float64(ts.Nano()) / 1e9
}

// alternateImpls runs pass (a pass of products with an implementation; its thread CPU seconds)
// with base and with defaultImpl, one of each to warm up, then alternately, base first on even
// iterations of b.Loop and defaultImpl first on odd ones, and reports each one's GB of weights
// (gbPerPass a pass) per CPU second as name+"GB/cpu-s" and "newGB/cpu-s", and new ÷ base as
// "new/"+name.
func alternateImpls(b *testing.B, name string, base *impl, gbPerPass float64, pass func(im *impl) float64) {
	pass(base)
	pass(defaultImpl)
	impls := []*impl{base, defaultImpl}
	var cpu [2]float64
	n := 0
	for b.Loop() {
		for j := range impls {
			i := (j + n) % 2
			cpu[i] += pass(impls[i])
		}
		n++
	}
	gb := gbPerPass * float64(b.N)
	b.ReportMetric(gb/cpu[0], name+"GB/cpu-s")
	b.ReportMetric(gb/cpu[1], "newGB/cpu-s")
	b.ReportMetric(cpu[0]/cpu[1], "new/"+name)
}

// BenchmarkBatchStreamTiles is batched decode's bfloat16 products (rows × about 160 MB of
// Qwen3-0.6B-shaped weights, far larger than the last-level cache, each read once a pass) on one
// thread, with the whole-panel tiles (whole) and this implementation's schedule (scheduleDot:
// half-panel tiles for 7–16 rows) alternated pass by pass, each first every other pass, after a
// pass of each to warm up. It reports each one's GB of weights
// per CPU second of the thread, which leaves out what other processes take of a shared
// machine's cores, and new ÷ whole.
func BenchmarkBatchStreamTiles(b *testing.B) {
	if defaultImpl.tileDotHalf == nil {
		b.Skip("no half-panel tiles")
	}
	alternateStreamImpls(b, []int{8, 16, 32}, 160<<20, "whole", func(im *impl) { im.tileDotHalf = nil })
}

// alternateStreamImpls runs alternateImpls, on one thread, for each row count of rowCounts, over
// streamLinearsBF16's matrices of about limit bytes of weights, each read once a pass: the
// current implementation against base (name), which is the current one changed by without.
func alternateStreamImpls(b *testing.B, rowCounts []int, limit int64, name string, without func(im *impl)) {
	for _, rows := range rowCounts {
		b.Run(fmt.Sprintf("rows%d", rows), func(b *testing.B) {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			pool := NewPool(1)
			defer pool.Close()
			ls, bytes := streamLinearsBF16(pool, true, limit)
			r := rand.New(rand.NewPCG(1, 1))
			x, dst := randSlice(r, rows*3072), make([]float32, rows*6144)
			base := *defaultImpl
			without(&base)
			pass := func(im *impl) float64 {
				t0 := threadCPU(b)
				for _, l := range ls {
					l.impl = im
					l.Apply(dst, x, rows)
				}
				return threadCPU(b) - t0
			}
			alternateImpls(b, name, &base, float64(bytes)/1e9, pass)
		})
	}
}
