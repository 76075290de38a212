//go:build amd64 && !purego

package kernel

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"
)

// fusedRowDots is the scores' chain computed in Go with fma32 (the AVX-512 kernels' FMAs):
// dst[r*ldd+j] = one fused chain over d ascending from zero of q[r][d]·k[j][d].
func fusedRowDots(dst []float32, ldd int, q []float32, ldq, rows int, k []float32, ldk, n, dim int) {
	for r := range rows {
		for j := range n {
			var acc float32
			for d := range dim {
				acc = fma32(q[r*ldq+d], k[j*ldk+d], acc)
			}
			dst[r*ldd+j] = acc
		}
	}
}

// TestRowDotsGroupsMatchSingleGroup checks the grouped scores kernels (2 and 4 groups of 16 keys
// a call, rows_amd64.s) against the single-group kernels (rowDots512, rowDotsBF16p512) and the
// chains computed in Go (fma32), bit for bit, for 1–8 and 32 query rows, head dims around the
// blocks, and strides as the model's paged KV store and score rows have them (keys a KV head
// apart or packed, score rows wider than the keys): each group with its own keys, query rows
// and score rows (different heads or blocks), or all groups the consecutive keys of one block
// with the same query rows. Nothing outside a group's rows·16 scores is written.
func TestRowDotsGroupsMatchSingleGroup(t *testing.T) {
	if !RowKernels(128) || defaultImpl.rowDim != 16 {
		t.Skip("no AVX-512 row kernels")
	}
	r := rand.New(rand.NewPCG(41, 42))
	var tmp [rowDotsTmp]float32
	for _, groups := range []int{2, 4} {
		for _, shared := range []bool{false, true} {
			for _, dim := range []int{16, 32, 48, 64, 128, 256} {
				for _, rows := range []int{1, 2, 3, 4, 5, 6, 7, 8, 32} {
					for _, ldk := range []int{dim, 8 * dim, dim + 7} {
						name := fmt.Sprintf("g%d/shared%v/dim%d/rows%d/ldk%d", groups, shared, dim, rows, ldk)
						t.Run(name, func(t *testing.T) {
							testRowDotsGroups(t, r, &tmp, groups, shared, dim, rows, ldk)
						})
					}
				}
			}
		}
	}
}

// testRowDotsGroups is one case of TestRowDotsGroupsMatchSingleGroup.
func testRowDotsGroups(t *testing.T, r *rand.Rand, tmp *[rowDotsTmp]float32, groups int, shared bool, dim, rows, ldk int) {
	ldq, ldd := dim+3, 16*groups+5
	keys := make([][]float32, groups)
	qs := make([][]float32, groups)
	if shared {
		all := randSlice(r, (16*groups-1)*ldk+dim)
		q := randSlice(r, rows*ldq)
		for g := range groups {
			keys[g], qs[g] = all[16*g*ldk:], q
		}
	} else {
		for g := range groups {
			keys[g], qs[g] = randSlice(r, 15*ldk+dim), randSlice(r, rows*ldq)
		}
	}
	for _, bf16 := range []bool{false, true} {
		if bf16 && dim%32 != 0 {
			continue
		}
		var args rowDotsGroupArgs
		keys16 := make([][]uint16, groups)
		keysW := make([][]float32, groups)
		for g := range groups {
			keys16[g], keysW[g] = to16(keys[g], BF16)
		}
		dst := randSlice(r, groups*rows*ldd)
		want, old := slices.Clone(dst), slices.Clone(dst)
		for g := range groups {
			o := g * 16
			if !shared {
				o = g * rows * ldd // each group its own score rows
			}
			args.q[g], args.dst[g] = &qs[g][0], &dst[o]
			if bf16 {
				args.k[g] = unsafe.Pointer(&keys16[g][0])
				fusedRowDots(want[o:], ldd, qs[g], ldq, rows, keysW[g], ldk, 16, dim)
				rowDotsBF16p512(&old[o], ldd, &qs[g][0], ldq, rows, &keys16[g][0], ldk, 16, dim, &tmp[0])
			} else {
				args.k[g] = unsafe.Pointer(&keys[g][0])
				fusedRowDots(want[o:], ldd, qs[g], ldq, rows, keys[g], ldk, 16, dim)
				rowDots512(&old[o], ldd, &qs[g][0], ldq, rows, &keys[g][0], ldk, 16, dim, &tmp[0])
			}
		}
		rowDotsGroups(groups, bf16, &args, ldd, ldq, rows, ldk, dim, &tmp[0])
		if !slices.Equal(bits(dst), bits(want)) {
			t.Fatalf("bf16=%v: the grouped kernel differs from the chains computed in Go", bf16)
		}
		if !slices.Equal(bits(dst), bits(old)) {
			t.Fatalf("bf16=%v: the grouped kernel differs from the single-group kernel", bf16)
		}
	}
}

// TestRowDotsSetMatchRowDots checks RowDots, RowDotsBF16 (whole groups of 16 keys through the
// grouped kernels, the rest through the single-group ones) and RowDotsSet, RowDotsBF16Set on
// AVX-512, with at most 1, 2 or 4 groups a kernel call and as exported, against the chains
// computed in Go (fma32) bit for bit, for key counts around the groups (n not a multiple of 16,
// 32 or 64), numbers of sets around the kernels' 2 and 4, more query rows than one kernel call
// takes, and the model's strides (keys a KV head apart in a block; score rows wider than n);
// scores outside the rows' n are not written.
func TestRowDotsSetMatchRowDots(t *testing.T) {
	if !RowKernels(128) || defaultImpl.rowDim != 16 {
		t.Skip("no AVX-512 row kernels")
	}
	r := rand.New(rand.NewPCG(43, 44))
	for _, most := range []int{0, 1, 2, 4} { // 0: the exported functions
		for _, dim := range []int{48, 128} {
			for _, n := range []int{1, 15, 16, 17, 32, 33, 47, 64, 65, 100} {
				for _, sets := range []int{1, 2, 3, 5, 8} {
					for _, rows := range []int{1, 2, 3, 33} {
						t.Run(fmt.Sprintf("most%d/dim%d/n%d/sets%d/rows%d", most, dim, n, sets, rows), func(t *testing.T) {
							testRowDotsSet(t, r, most, dim, n, sets, rows)
						})
					}
				}
			}
		}
	}
}

// testRowDotsSet is one case of TestRowDotsSetMatchRowDots.
func testRowDotsSet(t *testing.T, r *rand.Rand, most, dim, n, sets, rows int) {
	ldk, ldq, ldd := 8*dim, dim, n+9
	keys := randSlice(r, (n-1)*ldk+dim+sets*dim)
	keys16, keysW := to16(keys, BF16)
	q := randSlice(r, sets*rows*ldq)
	ks, ks16, kws := make([][]float32, sets), make([][]uint16, sets), make([][]float32, sets)
	qs, dsts, dsts16 := make([][]float32, sets), make([][]float32, sets), make([][]float32, sets)
	want, want16 := randSlice(r, sets*rows*ldd), randSlice(r, sets*rows*ldd)
	got, got16 := slices.Clone(want), slices.Clone(want16)
	for i := range sets {
		// Set i: KV head i of the same block positions, its own query and score rows.
		ks[i], ks16[i], kws[i] = keys[i*dim:], keys16[i*dim:], keysW[i*dim:]
		qs[i] = q[i*rows*ldq:]
		dsts[i], dsts16[i] = got[i*rows*ldd:], got16[i*rows*ldd:]
		fusedRowDots(want[i*rows*ldd:], ldd, qs[i], ldq, rows, ks[i], ldk, n, dim)
		fusedRowDots(want16[i*rows*ldd:], ldd, qs[i], ldq, rows, kws[i], ldk, n, dim)
	}
	if most == 0 {
		RowDotsSet(dsts, ldd, qs, ldq, rows, ks, ldk, n, dim)
		RowDotsBF16Set(dsts16, ldd, qs, ldq, rows, ks16, ldk, n, dim)
	} else {
		rowDotsSetWith(most, dsts, ldd, qs, ldq, rows, ks, ldk, n, dim)
		rowDotsSetWith(most, dsts16, ldd, qs, ldq, rows, ks16, ldk, n, dim)
	}
	if !slices.Equal(bits(got), bits(want)) {
		t.Fatal("RowDotsSet differs from the chains computed in Go")
	}
	if !slices.Equal(bits(got16), bits(want16)) {
		t.Fatal("RowDotsBF16Set differs from the chains computed in Go")
	}
	got, got16 = randSlice(r, rows*ldd), randSlice(r, rows*ldd)
	want, want16 = slices.Clone(got), slices.Clone(got16)
	fusedRowDots(want, ldd, q, ldq, rows, keys, ldk, n, dim)
	fusedRowDots(want16, ldd, q, ldq, rows, keysW, ldk, n, dim)
	if most == 0 {
		RowDots(got, ldd, q, ldq, rows, keys, ldk, n, dim)
		RowDotsBF16(got16, ldd, q, ldq, rows, keys16, ldk, n, dim)
	} else {
		rowDotsWith(most, got, ldd, q, ldq, rows, keys, ldk, n, dim)
		rowDotsWith(most, got16, ldd, q, ldq, rows, keys16, ldk, n, dim)
	}
	if !slices.Equal(bits(got), bits(want)) {
		t.Fatal("RowDots differs from the chains computed in Go")
	}
	if !slices.Equal(bits(got16), bits(want16)) {
		t.Fatal("RowDotsBF16 differs from the chains computed in Go")
	}
}

// TestRowDotsSetAllocates checks that RowDotsSet and RowDotsBF16Set allocate nothing (the
// kernels' buffers and group pointers stay on the stack).
func TestRowDotsSetAllocates(t *testing.T) {
	if !RowKernels(128) || defaultImpl.rowDim != 16 {
		t.Skip("no AVX-512 row kernels")
	}
	r := rand.New(rand.NewPCG(45, 46))
	const sets, rows, n, dim = 8, 2, 16, 128
	keys := randSlice(r, sets*n*dim)
	keys16, _ := to16(keys, BF16)
	ks, ks16, qs, dsts := make([][]float32, sets), make([][]uint16, sets), make([][]float32, sets), make([][]float32, sets)
	for i := range sets {
		ks[i], ks16[i] = keys[i*n*dim:], keys16[i*n*dim:]
		qs[i], dsts[i] = randSlice(r, rows*dim), make([]float32, rows*n)
	}
	one := make([]float32, rows*4*n)
	if a := testing.AllocsPerRun(10, func() {
		RowDotsSet(dsts, n, qs, dim, rows, ks, dim, n, dim)
		RowDotsBF16Set(dsts, n, qs, dim, rows, ks16, dim, n, dim)
		RowDotsBF16(one, 4*n, qs[0], dim, rows, keys16, dim, 4*n, dim)
	}); a != 0 {
		t.Fatalf("%v allocations a run", a)
	}
}
