package kernel

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestRowDotsTouchingMatchRowDots checks RowDotsTouching and RowDotsBF16Touching against
// RowDots and RowDotsBF16 bit for bit — the same elements written, the others untouched — for
// rows read ahead of every kind: none, shorter and longer than the kernels' loads cover (the
// rest read by Touch), unaligned, with and without the values' rows.
func TestRowDotsTouchingMatchRowDots(t *testing.T) {
	r := rand.New(rand.NewPCG(41, 42))
	mem := randSlice(r, 1<<16)
	mem16, _ := to16(mem, BF16)
	for _, dim := range []int{16, 32, 64, 128} {
		if !RowKernels(dim) {
			continue
		}
		for _, n := range []int{1, 7, 16, 17, 40} {
			for _, rows := range []int{1, 2, 3, 33} {
				for _, na := range []int{0, 1, 100, 16 * dim, 3 * 16 * dim, 9000} {
					t.Run(fmt.Sprintf("dim%d/n%d/rows%d/ahead%d", dim, n, rows, na), func(t *testing.T) {
						ldk, ldq, ldd := dim+8, dim+3, n+5
						keys := randSlice(r, (n-1)*ldk+dim)
						keys16, _ := to16(keys, BF16)
						q := randSlice(r, rows*ldq)
						off := r.IntN(1000)
						ahead, aheadV := mem[off:off+na], mem[off+na+17:off+2*na+17]
						ahead16, aheadV16 := mem16[off:off+na], mem16[off+na+17:off+2*na+17]
						for _, withV := range []bool{false, true} {
							av, av16 := aheadV, aheadV16
							if !withV {
								av, av16 = nil, nil
							}
							want := randSlice(r, rows*ldd)
							got := slices.Clone(want)
							RowDots(want, ldd, q, ldq, rows, keys, ldk, n, dim)
							RowDotsTouching(got, ldd, q, ldq, rows, keys, ldk, n, dim, ahead, av)
							if !slices.Equal(bits(got), bits(want)) {
								t.Fatal("RowDotsTouching differs from RowDots")
							}
							want = randSlice(r, rows*ldd)
							got = slices.Clone(want)
							RowDotsBF16(want, ldd, q, ldq, rows, keys16, ldk, n, dim)
							RowDotsBF16Touching(got, ldd, q, ldq, rows, keys16, ldk, n, dim, ahead16, av16)
							if !slices.Equal(bits(got), bits(want)) {
								t.Fatal("RowDotsBF16Touching differs from RowDotsBF16")
							}
						}
					})
				}
			}
		}
	}
}

// TestRowDotsTouchingShortValues checks that rows read ahead whose values' rows are shorter than
// their keys' are refused.
func TestRowDotsTouchingShortValues(t *testing.T) {
	if !RowKernels(16) {
		t.Skip("no row kernels")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	k, q, dst := make([]float32, 16), make([]float32, 16), make([]float32, 1)
	RowDotsTouching(dst, 1, q, 16, 1, k, 16, 1, 16, make([]float32, 64), make([]float32, 32))
}
