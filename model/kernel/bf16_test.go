package kernel

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// randBF16Value draws a float32 for bfloat16 tests: mostly normal values of various scales, with
// zeros, denormals, large values and the values that make the order of a pair's two sums
// matter (products of exactly half an ulp of the accumulator).
func randBF16Value(r *rand.Rand) float32 {
	switch r.IntN(12) {
	case 0:
		return 0
	case 1:
		return math.Float32frombits(r.Uint32() & 0x807fffff) // denormal
	case 2:
		return float32(math.Ldexp(1, -12)) * float32(1+r.IntN(4)/128.0)
	case 3:
		return float32(r.NormFloat64() * 1e30)
	}
	return float32(r.NormFloat64() * math.Pow(2, float64(r.IntN(20)-10)))
}

// TestBF16ProductsMatchHardware checks the portable chain (bf16Step, toPairsGeneric) against
// VDPBF16PS and VCVTNE2PS2BF16 on this CPU, lane by lane, over values chosen to expose the order
// of a pair's sums, rounding ties, denormal inputs and results, overflow and NaNs.
func TestBF16ProductsMatchHardware(t *testing.T) {
	if !hasBF16Impl() {
		t.Skip("no AVX512_BF16 on this CPU")
	}
	r := rand.New(rand.NewPCG(41, 42))
	pair := func() uint32 {
		return uint32(F32ToBF16(randBF16Value(r))) | uint32(F32ToBF16(randBF16Value(r)))<<16
	}
	for range 20000 {
		var acc, want [16]float32
		var a, b [16]uint32
		for i := range 16 {
			acc[i] = randBF16Value(r)
			if i%4 == 0 {
				acc[i] = 1
			}
			a[i], b[i] = pair(), pair()
			want[i] = bf16Step(acc[i], a[i], b[i])
		}
		dotBF16Probe(&acc[0], &a[0], &b[0])
		for i := range 16 {
			if math.Float32bits(acc[i]) != math.Float32bits(want[i]) && !(math.IsNaN(float64(acc[i])) && math.IsNaN(float64(want[i]))) {
				t.Fatalf("lane %d: VDPBF16PS %v (%08x), portable %v (%08x) for a %08x b %08x", i, acc[i], math.Float32bits(acc[i]), want[i], math.Float32bits(want[i]), a[i], b[i])
			}
		}
	}
	for _, n := range []int{1, 2, 31, 32, 33, 64, 77} {
		src := make([]float32, n)
		for i := range src {
			src[i] = randBF16Value(r)
		}
		src[0] = float32(math.NaN())
		got := make([]uint32, (n+1)/2+1)
		want := make([]uint32, (n+1)/2+1)
		got[len(got)-1], want[len(want)-1] = 7, 7 // must stay untouched
		toPairsAVX512(got[:(n+1)/2], src)
		toPairsGeneric(want[:(n+1)/2], src)
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("n=%d pair %d: VCVTNE2PS2BF16 %08x, portable %08x", n, i, got[i], want[i])
			}
		}
	}
}

// dotChainRef is the specification of one output element of a bfloat16-product Linear.
func dotChainRef(x, w []float32) float32 {
	xp := make([]uint32, (len(x)+1)/2)
	toPairsGeneric(xp, x)
	var acc float32
	for q, xv := range xp {
		wv := uint32(F32ToBF16(w[2*q]))
		if 2*q+1 < len(w) {
			wv |= uint32(F32ToBF16(w[2*q+1])) << 16
		}
		acc = bf16Step(acc, xv, wv)
	}
	return acc
}

// randTileInputs returns mr rows of random bfloat16 pairs (lda apart) and a panel of kp pairs
// of random bfloat16 weights, the inputs of a tile's equality test.
func randTileInputs(r *rand.Rand, mr, lda, kp int) ([]uint32, []uint16) {
	a := make([]uint32, mr*lda)
	w := make([]uint16, kp*2*panelWidth)
	for i := range a {
		a[i] = uint32(BF16Round(randBF16Value(r))) | uint32(BF16Round(randBF16Value(r)))<<16
	}
	for i := range w {
		w[i] = F32ToBF16(randBF16Value(r))
	}
	return a, w
}

// TestTileDotHalfMatchesChain runs each half-panel tile (every height, both halves of a panel,
// whole and partial halves, pair counts around the kernels' unrolling) against the portable
// chain over the whole panel, in one call and in two that continue the chains through c, with a
// prefetch share, and checks that nothing outside the tile's columns is written.
func TestTileDotHalfMatchesChain(t *testing.T) {
	r := rand.New(rand.NewPCG(45, 46))
	for _, im := range candidateImpls() {
		if im.tileDotHalf == nil {
			continue
		}
		for mr := 1; mr <= im.halfRows; mr++ {
			for _, kp := range []int{1, 3, 4, 5, 9, 70} {
				const lda, ldc = 75, 70 // strides past a row's pairs and the panel's columns
				a, w := randTileInputs(r, mr, lda, kp)
				want := make([]float32, mr*ldc)
				tileDotGeneric(want, ldc, a, lda, w, kp, mr, panelWidth, nil, false)
				for h := range 2 {
					for _, ncols := range []int{32, 17, 1} {
						for _, split := range []int{0, kp / 2} {
							got := make([]float32, mr*ldc)
							for i := range got {
								got[i] = -7
							}
							col, wh := h*32, w[h*panelWidth:]
							if split > 0 {
								im.tileDotHalf(got[col:], ldc, a, lda, wh, split, mr, ncols, w[:64], false)
								im.tileDotHalf(got[col:], ldc, a[split:], lda, wh[split*2*panelWidth:], kp-split, mr, ncols, w[64:], true)
							} else {
								im.tileDotHalf(got[col:], ldc, a, lda, wh, kp, mr, ncols, w, false)
							}
							for m := range mr {
								for j := range ldc {
									g, in := got[m*ldc+j], j >= col && j < col+ncols
									if in && math.Float32bits(g) != math.Float32bits(want[m*ldc+j]) {
										t.Fatalf("%s rows %d pairs %d half %d cols %d split %d: row %d col %d = %v, chain %v", im.name, mr, kp, h, ncols, split, m, j, g, want[m*ldc+j])
									}
									if !in && g != -7 {
										t.Fatalf("%s rows %d pairs %d half %d cols %d: wrote row %d col %d", im.name, mr, kp, h, ncols, m, j)
									}
								}
							}
						}
					}
				}
			}
		}
	}
}

// TestLinearBF16DotMatchesChain: every implementation computes each output of a
// bfloat16-product Linear as the specified chain (rows of all tile heights, odd and even widths,
// partial panels, k long enough for several blocks of pairs when several row tiles share a
// panel, one row over pairs of whole panels and a lone whole or partial panel after them), and
// the result is batch-invariant.
func TestLinearBF16DotMatchesChain(t *testing.T) {
	r := rand.New(rand.NewPCG(43, 44))
	pool := NewPool(2)
	defer pool.Close()
	for _, im := range candidateImpls() {
		for _, sh := range [][2]int{{1, 1}, {3, 5}, {17, 33}, {64, 64}, {65, 129}, {130, 96}, {193, 31}, {192, 33}, {256, 1025}, {384, 2*(2*kBlock+1) + 45}} {
			out, in := sh[0], sh[1]
			w := randSlice(r, out*in)
			h, _ := to16(w, BF16)
			l := newLinear16(im, pool, BF16, out, in, func(n int, dst []uint16) { copy(dst, h[n*in:(n+1)*in]) })
			l.bf16Dot = true
			t.Run(fmt.Sprintf("%s/%dx%d", im.name, out, in), func(t *testing.T) {
				alone := make([]float32, out)
				row := randSlice(r, in)
				l.Apply(alone, row, 1)
				for n := range out {
					if want := dotChainRef(row, w[n*in:(n+1)*in]); math.Float32bits(alone[n]) != math.Float32bits(want) {
						t.Fatalf("col %d: %v, chain %v", n, alone[n], want)
					}
				}
				for _, rows := range []int{2, 6, 7, 8, 12, 13, 16, 32} {
					x := randSlice(r, rows*in)
					at := r.IntN(rows)
					copy(x[at*in:], row)
					dst := make([]float32, rows*out)
					l.Apply(dst, x, rows)
					for m := range rows {
						for n := range out {
							want := dotChainRef(x[m*in:(m+1)*in], w[n*in:(n+1)*in])
							if math.Float32bits(dst[m*out+n]) != math.Float32bits(want) {
								t.Fatalf("rows %d row %d col %d: %v, chain %v", rows, m, n, dst[m*out+n], want)
							}
						}
					}
					for n := range out {
						if math.Float32bits(dst[at*out+n]) != math.Float32bits(alone[n]) {
							t.Fatalf("rows %d: row at %d differs from the row alone", rows, at)
						}
					}
				}
			})
		}
	}
}
