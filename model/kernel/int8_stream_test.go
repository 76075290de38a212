//go:build linux

package kernel

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
)

// BenchmarkInt8BatchStream is batched decode's int8 products on one thread: rows (8 or 32) ×
// Qwen3-0.6B-shaped int8 matrices (streamShapes, repeated to about 160 MB of weights, far larger
// than the last-level cache), each read once per pass, on a pool of one worker. It reports GB of
// weights and GFLOP per second of the thread's CPU time, which a shared machine's time slicing
// does not disturb (wall-clock ns/op still does; threadCPU is in bench_tiles_linux_test.go).
func BenchmarkInt8BatchStream(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	src := make([][]float32, len(streamShapes))
	for i, s := range streamShapes {
		src[i] = randSlice(r, s[0]*s[1])
	}
	pool := NewPool(1)
	defer pool.Close()
	var ls []*Linear
	var bytes int64
	for bytes < 160<<20 {
		i := len(ls) % len(streamShapes)
		s := streamShapes[i]
		l := NewLinearInt8ScaledFrom(pool, s[0], s[1], func(v float32) float32 { return v }, func(n int, dst []float32) {
			copy(dst, src[i][n*s[1]:(n+1)*s[1]])
		})
		ls = append(ls, l)
		bytes += l.Bytes()
	}
	for _, rows := range []int{8, 32} {
		b.Run(fmt.Sprintf("rows%d", rows), func(b *testing.B) {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			x, dst := randSlice(r, rows*3072), make([]float32, rows*6144)
			var flops float64
			for _, l := range ls {
				flops += 2 * float64(rows) * float64(l.Out()) * float64(l.In())
			}
			b.SetBytes(bytes)
			var cpu float64
			for b.Loop() {
				t0 := threadCPU(b)
				for _, l := range ls {
					l.Apply(dst, x, rows)
				}
				cpu += threadCPU(b) - t0
			}
			b.ReportMetric(float64(bytes)*float64(b.N)/cpu/1e9, "GB/cpu-s")
			b.ReportMetric(flops*float64(b.N)/cpu/1e9, "GFLOP/cpu-s")
		})
	}
}
