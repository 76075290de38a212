package kernel

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"syscall"
	"testing"
	"unsafe"
)

// TestRowKernelsMatchPackedLinear checks RowDots and AccumulateRows (the latter split over
// several calls, as over the blocks of a paged store) against Linears packed with SetRows and
// SetColumns from the same strided rows, bit for bit, for every implementation that has them;
// and their bfloat16 forms against them on the same values widened.
func TestRowKernelsMatchPackedLinear(t *testing.T) {
	r := rand.New(rand.NewPCG(31, 32))
	for _, im := range candidateImpls() {
		if im.rowDim == 0 {
			continue
		}
		for _, dim := range []int{16, 32, 64, 80, 128} {
			if dim%im.rowDim != 0 {
				continue
			}
			for _, n := range []int{1, 7, 16, 17, 33, 64} {
				for _, rows := range []int{1, 2, 3, 7, 13} {
					t.Run(fmt.Sprintf("%s/dim%d/n%d/rows%d", im.name, dim, n, rows), func(t *testing.T) {
						const ld = 3 // extra floats between rows
						ldk := dim + 5
						keys := randSlice(r, (n-1)*ldk+dim)
						vals := randSlice(r, (n-1)*ldk+dim)
						q := randSlice(r, rows*(dim+ld))
						p := randSlice(r, rows*(n+ld))
						for i := range p {
							if i%5 == 0 {
								p[i] = 0 // exact zeros, like probabilities past a row's position
							}
						}

						var kl, vl Linear
						kl.impl, vl.impl = im, im
						kl.SetRows(nil, n, dim, func(j int) []float32 { return keys[j*ldk:] })
						want := randSlice(r, rows*(n+ld))
						got := slices.Clone(want)
						kl.ApplyStrided(want, n+ld, q, dim+ld, rows)
						im.rowDots(got, n+ld, q, dim+ld, rows, keys, ldk, n, dim)
						if !slices.Equal(bits(got), bits(want)) {
							t.Fatal("rowDots differs from SetRows + ApplyStrided")
						}

						vl.SetColumns(nil, dim, n, func(j int) []float32 { return vals[j*ldk:] })
						wantV := randSlice(r, rows*(dim+ld))
						gotV := slices.Clone(wantV)
						vl.ApplyStrided(wantV, dim+ld, p, n+ld, rows)
						for i := range rows {
							clear(gotV[i*(dim+ld) : i*(dim+ld)+dim])
						}
						for j0 := 0; j0 < n; j0 += 5 { // runs of 5 value rows
							j1 := min(n, j0+5)
							im.accRows(gotV, dim+ld, p[j0:], n+ld, rows, vals[j0*ldk:], ldk, j1-j0, dim)
						}
						if !slices.Equal(bits(gotV), bits(wantV)) {
							t.Fatal("accRows differs from SetColumns + ApplyStrided")
						}

						// Bfloat16 keys and values (a bfloat16 KV cache): the same chains on
						// the widened values.
						keys16, keysW := to16(keys, BF16)
						vals16, valsW := to16(vals, BF16)
						want = randSlice(r, rows*(n+ld))
						got = slices.Clone(want)
						im.rowDots(want, n+ld, q, dim+ld, rows, keysW, ldk, n, dim)
						im.rowDotsBF16(got, n+ld, q, dim+ld, rows, keys16, ldk, n, dim)
						if !slices.Equal(bits(got), bits(want)) {
							t.Fatal("rowDotsBF16 differs from rowDots on the widened keys")
						}
						wantV = randSlice(r, rows*(dim+ld))
						gotV = slices.Clone(wantV)
						for j0 := 0; j0 < n; j0 += 5 {
							j1 := min(n, j0+5)
							im.accRows(wantV, dim+ld, p[j0:], n+ld, rows, valsW[j0*ldk:], ldk, j1-j0, dim)
							im.accRowsBF16(gotV, dim+ld, p[j0:], n+ld, rows, vals16[j0*ldk:], ldk, j1-j0, dim)
						}
						if !slices.Equal(bits(gotV), bits(wantV)) {
							t.Fatal("accRowsBF16 differs from accRows on the widened values")
						}
					})
				}
			}
		}
	}
}

// TestTouchReadsOnlyItsSlice: Touch reads nothing past its slice, for every length of float32
// and bfloat16 slices that end at the last byte of a page followed by an unmapped one.
func TestTouchReadsOnlyItsSlice(t *testing.T) {
	page := syscall.Getpagesize()
	mem, err := syscall.Mmap(-1, 0, 2*page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Skip(err)
	}
	defer syscall.Munmap(mem)
	if err := syscall.Mprotect(mem[page:], syscall.PROT_NONE); err != nil {
		t.Skip(err)
	}
	for n := range 300 {
		end := unsafe.Pointer(&mem[page-1])
		Touch(unsafe.Slice((*uint16)(unsafe.Add(end, 1-2*n)), n))
		Touch(unsafe.Slice((*float32)(unsafe.Add(end, 1-4*n)), n))
	}
}

// TestRowDotsSetMatchesRowDots checks RowDotsSet and RowDotsBF16Set against one RowDots
// (RowDotsBF16) call a set, bit for bit, in this process's implementation: several KV heads'
// keys of the same block positions, each with its own query and score rows.
func TestRowDotsSetMatchesRowDots(t *testing.T) {
	if !RowKernels(64) {
		t.Skip("no row kernels")
	}
	r := rand.New(rand.NewPCG(47, 48))
	const dim, sets, rows = 64, 5, 2
	for _, n := range []int{1, 16, 37, 64} {
		ldk, ldd := sets*dim, n+3
		keys := randSlice(r, (n-1)*ldk+sets*dim)
		keys16, _ := to16(keys, BF16)
		q := randSlice(r, sets*rows*dim)
		got, got16 := randSlice(r, sets*rows*ldd), randSlice(r, sets*rows*ldd)
		want, want16 := slices.Clone(got), slices.Clone(got16)
		ks, ks16, qs := make([][]float32, sets), make([][]uint16, sets), make([][]float32, sets)
		dsts, dsts16 := make([][]float32, sets), make([][]float32, sets)
		for i := range sets {
			ks[i], ks16[i], qs[i] = keys[i*dim:], keys16[i*dim:], q[i*rows*dim:]
			dsts[i], dsts16[i] = got[i*rows*ldd:], got16[i*rows*ldd:]
			RowDots(want[i*rows*ldd:], ldd, qs[i], dim, rows, ks[i], ldk, n, dim)
			RowDotsBF16(want16[i*rows*ldd:], ldd, qs[i], dim, rows, ks16[i], ldk, n, dim)
		}
		RowDotsSet(dsts, ldd, qs, dim, rows, ks, ldk, n, dim)
		RowDotsBF16Set(dsts16, ldd, qs, dim, rows, ks16, ldk, n, dim)
		if !slices.Equal(bits(got), bits(want)) {
			t.Fatalf("n=%d: RowDotsSet differs from RowDots", n)
		}
		if !slices.Equal(bits(got16), bits(want16)) {
			t.Fatalf("n=%d: RowDotsBF16Set differs from RowDotsBF16", n)
		}
	}
}
