//go:build amd64 && !purego

package kernel

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// BenchmarkRowDotsBF16 compares the two bfloat16 scores kernels on decode's shape — 2 query
// rows (the query heads of a KV head) against a block of 16 keys of 128 dimensions, in L1 —
// one kernel call per op: rowDotsBF16x512 (keys widened and transposed 16 dimensions at a time)
// and rowDotsBF16p512 (transposed as pairs, 32 dimensions at a time). Both compute the same bits.
func BenchmarkRowDotsBF16(b *testing.B) {
	if !RowKernels(128) || defaultImpl.rowDim != 16 {
		b.Skip("no AVX-512 row kernels")
	}
	r := rand.New(rand.NewPCG(5, 6))
	for _, rows := range []int{1, 2, 4} {
		const n, dim = 16, 128
		keys16, _ := to16(randSlice(r, n*dim), BF16)
		q := randSlice(r, rows*dim)
		dst := make([]float32, rows*n)
		var tmp [rowDotsRows * 16]float32
		for _, k := range []struct {
			name string
			fn   func(dst *float32, ldd int, q *float32, ldq int, rows int, k *uint16, ldk int, nk int, dim int, tmp *float32)
		}{{"singles", rowDotsBF16x512}, {"pairs", rowDotsBF16p512}} {
			b.Run(fmt.Sprintf("rows%d/%s", rows, k.name), func(b *testing.B) {
				for b.Loop() {
					k.fn(&dst[0], n, &q[0], dim, rows, &keys16[0], dim, n, dim, &tmp[0])
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/n, "ns/key")
			})
		}
	}
}
