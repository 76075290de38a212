package kernel

import (
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
)

// fma32 returns a·b+c rounded once to float32 (IEEE fusedMultiplyAdd), an oracle for the
// hardware FMA independent of it (a·b is exact in float64; see roundSum).
func fma32(a, b, c float32) float32 { return roundSum(float64(a)*float64(b), c) }

// fma32Big is fma32 by exact arithmetic, to check fma32 itself.
func fma32Big(a, b, c float32) float32 {
	var x, y big.Float
	x.SetPrec(200).SetFloat64(float64(a))
	y.SetPrec(200).SetFloat64(float64(b))
	x.Mul(&x, &y)
	y.SetFloat64(float64(c))
	x.Add(&x, &y)
	f, _ := x.Float32()
	return f
}

func TestFMA32Oracle(t *testing.T) {
	r := rand.New(rand.NewPCG(15, 16))
	for i := range 200000 {
		a, b, c := float32(r.NormFloat64()), float32(r.NormFloat64()), float32(r.NormFloat64())
		if i%2 == 0 { // near-cancellation cases
			c = -a * b * (1 + float32(r.NormFloat64())*1e-6)
		}
		got, want := fma32(a, b, c), fma32Big(a, b, c)
		if math.Float32bits(got) != math.Float32bits(want) && !(got == 0 && want == 0) {
			t.Fatalf("fma32(%v, %v, %v) = %v, exact %v", a, b, c, got, want)
		}
	}
}

// chainRef is the specification of one Linear output element on the implementation im: the
// fixed chain over k ascending, fused (SIMD implementations) or unfused (portable Go).
func chainRef(im *impl, x, w []float32) float32 {
	var acc float32
	for k := range x {
		if im == genericImpl {
			acc = acc + float32(x[k]*w[k])
		} else {
			acc = fma32(x[k], w[k], acc)
		}
	}
	return acc
}

func newLinearW(im *impl, pool *Pool, w []float32, out, in int) *Linear {
	if len(w)%2 == 0 { // exercise both ways of supplying the weights
		return newLinear(im, pool, out, in, w, nil)
	}
	return newLinear(im, pool, out, in, nil, func(n int, dst []float32) { copy(dst, w[n*in:n*in+in]) })
}

func randSlice(r *rand.Rand, n int) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(r.NormFloat64())
	}
	return s
}

func refLinear64(w, x []float32, rows, out, in int) []float64 {
	y := make([]float64, rows*out)
	for m := range rows {
		for n := range out {
			var s float64
			for k := range in {
				s += float64(x[m*in+k]) * float64(w[n*in+k])
			}
			y[m*out+n] = s
		}
	}
	return y
}

var testShapes = [][2]int{ // out, in
	{1, 1}, {1, 7}, {3, 5}, {17, 33}, {63, 64}, {64, 63}, {65, 129}, {100, 257}, {130, 96}, {193, 31}, {256, 512},
}

func TestLinearMatchesChainAndReference(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, im := range candidateImpls() {
		for _, sh := range testShapes {
			out, in := sh[0], sh[1]
			for _, rows := range []int{1, 2, 5, 7, 16, 29} {
				t.Run(fmt.Sprintf("%s/%dx%dx%d", im.name, rows, out, in), func(t *testing.T) {
					w, x := randSlice(r, out*in), randSlice(r, rows*in)
					l := newLinearW(im, nil, w, out, in)
					if l.Out() != out || l.In() != in {
						t.Fatalf("Out/In = %d/%d", l.Out(), l.In())
					}
					dst := make([]float32, rows*out+3)
					dst[rows*out], dst[rows*out+1], dst[rows*out+2] = 7, 8, 9
					l.Apply(dst, x, rows)
					if dst[rows*out] != 7 || dst[rows*out+2] != 9 {
						t.Fatalf("Apply wrote past rows*out")
					}
					ref := refLinear64(w, x, rows, out, in)
					for m := range rows {
						for n := range out {
							got := dst[m*out+n]
							want := chainRef(im, x[m*in:(m+1)*in], w[n*in:(n+1)*in])
							if math.Float32bits(got) != math.Float32bits(want) {
								t.Fatalf("row %d col %d: got %v (%08x), chain spec %v (%08x)", m, n, got, math.Float32bits(got), want, math.Float32bits(want))
							}
							if d := math.Abs(float64(got) - ref[m*out+n]); d > 1e-5*float64(in)+1e-5 {
								t.Fatalf("row %d col %d: got %v, float64 reference %v", m, n, got, ref[m*out+n])
							}
						}
					}
				})
			}
		}
	}
}

// TestLinearBatchInvariant computes a row alone and inside batches of 2..67 rows at several
// positions, surrounded by random rows, on pools of several sizes: the row's outputs must be
// bit-identical every time.
func TestLinearBatchInvariant(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	pools := []*Pool{nil, NewPool(1), NewPool(2), NewPool(3)}
	t.Cleanup(func() {
		for _, p := range pools {
			p.Close()
		}
	})
	shapes := [][2]int{{1, 3}, {5, 17}, {67, 45}, {129, 100}, {64, 64}, {200, 33}}
	if testing.Short() {
		shapes = shapes[:3]
	}
	for _, im := range candidateImpls() {
		for _, sh := range shapes {
			out, in := sh[0], sh[1]
			t.Run(fmt.Sprintf("%s/%dx%d", im.name, out, in), func(t *testing.T) {
				w := randSlice(r, out*in)
				row := randSlice(r, in)
				alone := make([]float32, out)
				newLinearW(im, nil, w, out, in).Apply(alone, row, 1)
				for i, p := range pools {
					l := newLinearW(im, p, w, out, in)
					for rows := 2; rows <= 67; rows++ {
						pos := []int{0, rows - 1, (rows * (i + 1)) % rows, r.IntN(rows)}
						for _, at := range pos {
							x := randSlice(r, rows*in)
							copy(x[at*in:], row)
							dst := make([]float32, rows*out)
							l.Apply(dst, x, rows)
							for n := range out {
								if math.Float32bits(dst[at*out+n]) != math.Float32bits(alone[n]) {
									t.Fatalf("pool %d rows %d pos %d col %d: %v != alone %v", i, rows, at, n, dst[at*out+n], alone[n])
								}
							}
						}
					}
				}
			})
		}
	}
}

func TestLinearEmpty(t *testing.T) {
	l := NewLinear(nil, 3, 0)
	dst := []float32{1, 2, 3, 4, 5, 6}
	l.Apply(dst, nil, 2)
	for _, v := range dst {
		if v != 0 {
			t.Fatalf("in=0: dst = %v, want zeros", dst)
		}
	}
	NewLinear(nil, 0, 5).Apply(nil, make([]float32, 10), 2)
	l.Apply(nil, nil, 0)
}

func TestLinearPanicsOnShortSlices(t *testing.T) {
	l := NewLinear(make([]float32, 6), 2, 3)
	for name, f := range map[string]func(){
		"bad w":   func() { NewLinear(make([]float32, 5), 2, 3) },
		"short x": func() { l.Apply(make([]float32, 4), make([]float32, 5), 2) },
		"short d": func() { l.Apply(make([]float32, 3), make([]float32, 6), 2) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			f()
		}()
	}
}

func TestNewLinearFromMatchesNewLinear(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 14))
	const out, in, rows = 131, 70, 9
	w, x := randSlice(r, out*in), randSlice(r, rows*in)
	half := make([]uint16, len(w)) // bf16-like storage: the top 16 bits
	for i, v := range w {
		half[i] = uint16(math.Float32bits(v) >> 16)
		w[i] = math.Float32frombits(uint32(half[i]) << 16)
	}
	pool := NewPool(2)
	defer pool.Close()
	a := NewLinearFrom(pool, out, in, func(n int, dst []float32) {
		for k := range dst {
			dst[k] = math.Float32frombits(uint32(half[n*in+k]) << 16)
		}
	})
	b := NewLinear(w, out, in)
	da, db := make([]float32, rows*out), make([]float32, rows*out)
	a.Apply(da, x, rows)
	b.Apply(db, x, rows)
	for i := range da {
		if math.Float32bits(da[i]) != math.Float32bits(db[i]) {
			t.Fatalf("element %d: %v != %v", i, da[i], db[i])
		}
	}
}

// TestApplyStridedMatchesApply: rows read and written at strides give the bits of Apply on the
// same rows packed densely, and the gaps between rows are left alone.
func TestApplyStridedMatchesApply(t *testing.T) {
	r := rand.New(rand.NewPCG(25, 26))
	pool := NewPool(2)
	defer pool.Close()
	for _, im := range candidateImpls() {
		for _, sh := range testShapes {
			out, in := sh[0], sh[1]
			for _, rows := range []int{1, 6, 13} {
				l := newLinear(im, pool, out, in, randSlice(r, out*in), nil)
				lda, ldc := in+3, out+5
				x := randSlice(r, (rows-1)*lda+in)
				dense := make([]float32, rows*in)
				for m := range rows {
					copy(dense[m*in:], x[m*lda:m*lda+in])
				}
				want := make([]float32, rows*out)
				l.Apply(want, dense, rows)
				dst := randSlice(r, (rows-1)*ldc+out)
				orig := append([]float32(nil), dst...)
				l.ApplyStrided(dst, ldc, x, lda, rows)
				for m := range rows {
					for n := range ldc {
						i := m*ldc + n
						switch {
						case n < out && math.Float32bits(dst[i]) != math.Float32bits(want[m*out+n]):
							t.Fatalf("%s %dx%dx%d: row %d col %d: %v, Apply %v", im.name, rows, out, in, m, n, dst[i], want[m*out+n])
						case n >= out && i < len(dst) && math.Float32bits(dst[i]) != math.Float32bits(orig[i]):
							t.Fatalf("%s %dx%dx%d: gap element %d written", im.name, rows, out, in, i)
						}
					}
				}
			}
		}
	}
}

// to16 returns w rounded to dtype, as 16-bit values and widened back to float32.
func to16(w []float32, dtype DType) ([]uint16, []float32) {
	h := make([]uint16, len(w))
	wide := make([]float32, len(w))
	for i, v := range w {
		if dtype == BF16 {
			h[i] = F32ToBF16(v)
		} else {
			h[i] = F32ToF16(v)
		}
	}
	widen16(wide, h, dtype)
	return h, wide
}

// TestLinear16MatchesChain: a Linear storing bfloat16 or float16 weights computes every output
// element with the chain of an F32 Linear holding the same (exactly widened) values, on every
// implementation (native 16-bit tiles or a widened panel), for odd and even widths, and its Row
// returns the widened weights. The extra shapes give one row whole pairs of bfloat16 panels with
// an odd k (the two-panel kernel's unpaired last k) and a lone whole panel after them.
func TestLinear16MatchesChain(t *testing.T) {
	r := rand.New(rand.NewPCG(31, 32))
	pool := NewPool(2)
	defer pool.Close()
	for _, im := range candidateImpls() {
		for _, dtype := range []DType{BF16, F16} {
			// 130 × 1100: several blocks of k (kBlockSteps) in both storages.
			for _, sh := range append(testShapes, [2]int{192, 33}, [2]int{256, 255}, [2]int{130, 1100}) {
				out, in := sh[0], sh[1]
				h, wide := to16(randSlice(r, out*in), dtype)
				l := newLinear16(im, pool, dtype, out, in, func(n int, dst []uint16) { copy(dst, h[n*in:(n+1)*in]) })
				if l.Bytes() != int64(2*out*in) || l.DType() != dtype {
					t.Fatalf("Bytes %d, DType %v", l.Bytes(), l.DType())
				}
				row := make([]float32, in)
				for n := range out {
					l.Row(n, row)
					for k := range in {
						if math.Float32bits(row[k]) != math.Float32bits(wide[n*in+k]) {
							t.Fatalf("%s %v %dx%d: Row(%d)[%d] = %v, want %v", im.name, dtype, out, in, n, k, row[k], wide[n*in+k])
						}
					}
				}
				for _, rows := range []int{1, 3, 6, 7, 8, 13, 32} {
					x := randSlice(r, rows*in)
					dst := make([]float32, rows*out)
					l.Apply(dst, x, rows)
					for m := range rows {
						for n := range out {
							want := chainRef(im, x[m*in:(m+1)*in], wide[n*in:(n+1)*in])
							if got := dst[m*out+n]; math.Float32bits(got) != math.Float32bits(want) {
								t.Fatalf("%s %v %dx%dx%d: row %d col %d: %v, chain %v", im.name, dtype, rows, out, in, m, n, got, want)
							}
						}
					}
				}
			}
		}
	}
}
