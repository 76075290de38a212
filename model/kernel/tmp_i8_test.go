package kernel

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
)

func BenchmarkTmpI8Tile(b *testing.B) {
	for _, s := range [][3]int{{32, 4096, 1024}, {8, 4096, 1024}, {32, 1024, 3072}} {
		rows, out, in := s[0], s[1], s[2]
		b.Run(fmt.Sprintf("%dx%dx%d", rows, out, in), func(b *testing.B) {
			runtime.LockOSThread()
			r := rand.New(rand.NewPCG(1, 1))
			w := randSlice(r, out*in)
			pool := NewPool(1)
			defer pool.Close()
			l := NewLinearInt8ScaledFrom(pool, out, in, func(v float32) float32 { return v }, func(n int, dst []float32) { copy(dst, w[n*in:(n+1)*in]) })
			x, dst := randSlice(r, rows*in), make([]float32, rows*out)
			var cpu float64
			for b.Loop() {
				t0 := threadCPU(b)
				l.Apply(dst, x, rows)
				cpu += threadCPU(b) - t0
			}
			b.ReportMetric(2*float64(rows*out*in)*float64(b.N)/cpu/1e9, "GFLOP/cpu-s")
		})
	}
}

func BenchmarkTmpI8Quant(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	x := randSlice(r, 32*3072)
	w := &int8Weights{groups: 96}
	a := int8Acts{q: make([]int8, 6*3072), d: make([]float32, 6*96), corr: make([]int32, 6*96), mr: 6}
	b.SetBytes(6 * 3072 * 4)
	for b.Loop() {
		w.quantize(a, x, 3072, 3072)
	}
}
