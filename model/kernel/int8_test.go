package kernel

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// randInt8Matrix returns n values of mixed scales: groups of zeros, tiny values, huge ones and
// ordinary normals, so that scales of every size and all-zero groups occur.
func randInt8Matrix(r *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		switch r.IntN(16) {
		case 0:
			x[i] = 0
		case 1:
			x[i] = float32(r.NormFloat64() * 1e-30)
		case 2:
			x[i] = float32(r.NormFloat64() * 1e20)
		default:
			x[i] = float32(r.NormFloat64() * math.Pow(2, float64(r.IntN(10)-5)))
		}
	}
	if n >= 3*Int8Group {
		clear(x[Int8Group : 2*Int8Group]) // one all-zero group
	}
	return x
}

// applyInt8With builds an int8 Linear of w (out × in) for tile and applies it to x.
func applyInt8With(tile int8TileFunc, pool *Pool, w, x []float32, out, in, rows int) []float32 {
	l := newLinearInt8(tile, pool, out, in, nil, func(n int, dst []float32) { copy(dst, w[n*in:(n+1)*in]) })
	dst := make([]float32, rows*out)
	l.Apply(dst, x, rows)
	return dst
}

// TestInt8KernelsAgree: the VPDPBUSD kernels give exactly the bits of the portable Go chain, for
// every tile height (1, 2, 3, 7, 8, 13 and 32 rows: tiles of 1 to 6 rows), no outputs, partial panels, k
// that are not multiples of the group, k in several blocks (320 and 1000 inputs with more than
// 6 rows), one row over pairs of whole panels (520 columns: tasks of two and three panels, a
// partial one last), a prefill split into groups of row tiles (100 rows of 3200 inputs), and
// rows of any magnitude (all-zero groups included), on one goroutine and on a pool.
func TestInt8KernelsAgree(t *testing.T) {
	tiles := int8Tiles()
	if len(tiles) == 1 {
		t.Skip("no AVX-512 VNNI on this CPU: only the portable kernel")
	}
	pool := NewPool(3)
	defer pool.Close()
	r := rand.New(rand.NewPCG(8, 8))
	type shape struct{ out, in, rows int }
	var shapes []shape
	for _, out := range []int{0, 1, 63, 64, 130, 520} {
		for _, in := range []int{1, 31, 32, 33, 96, 320, 1000} {
			for _, rows := range []int{1, 2, 3, 7, 8, 13, 32} {
				shapes = append(shapes, shape{out, in, rows})
			}
		}
	}
	shapes = append(shapes, shape{130, 3200, 100})
	for i, s := range shapes {
		p := []*Pool{nil, pool}[i%2]
		w, x := randInt8Matrix(r, s.out*s.in), randInt8Matrix(r, s.rows*s.in)
		want := applyInt8With(tiles[0], p, w, x, s.out, s.in, s.rows)
		got := applyInt8With(tiles[1], p, w, x, s.out, s.in, s.rows)
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("out %d in %d rows %d: element %d: VNNI %g, Go %g", s.out, s.in, s.rows, i, got[i], want[i])
			}
		}
	}
}

// TestInt8BatchInvariant: a row's outputs are bit-identical alone, at any position of a batch of
// 2, 8, 32 or 40 rows (tiles of different heights, K in blocks) and with any partitioning over a
// pool's workers.
func TestInt8BatchInvariant(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 9))
	const out, in = 200, 416
	w := randInt8Matrix(r, out*in)
	pool := NewPool(3)
	defer pool.Close()
	for _, tile := range int8Tiles() {
		batch := randInt8Matrix(r, 40*in) // more than 16 rows: quantized in parallel
		alone := make([][]float32, 40)
		for m := range alone {
			alone[m] = applyInt8With(tile, nil, w, batch[m*in:(m+1)*in], out, in, 1)
		}
		for _, rows := range []int{2, 8, 32, 40} {
			all := applyInt8With(tile, pool, w, batch[:rows*in], out, in, rows)
			for m := range rows {
				if !slices.Equal(bits(alone[m]), bits(all[m*out:(m+1)*out])) {
					t.Fatalf("row %d of %d differs from the row alone", m, rows)
				}
			}
		}
	}
}

// TestRoundInt8: the quantizer's rounding is C's roundf (math.Round: halves away from zero),
// clamped to ±127, for ordinary values, exact halves and their neighbours, and NaN gives 0.
func TestRoundInt8(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 4))
	for i := range 200000 {
		v := float32(r.NormFloat64() * 60)
		switch i % 4 {
		case 0:
			v = float32(math.Round(float64(v))) + 0.5*float32(r.IntN(3)-1) // ±k.5 and k
		case 1:
			v = math.Nextafter32(float32(math.Round(float64(v)))+0.5, float32(r.IntN(2)*400-200)) // beside a half
		}
		if want := int8(max(-127, min(127, math.Round(float64(v))))); roundInt8(v) != want {
			t.Fatalf("roundInt8(%v) = %d, want %d", v, roundInt8(v), want)
		}
	}
	if roundInt8(float32(math.NaN())) != 0 || roundInt8(float32(math.Inf(-1))) != -127 {
		t.Error("NaN or -Inf")
	}
}

// TestQuantizeInt8 pins the Q8_0 rule: d = amax/127, q = round(x/d) half away from zero.
func TestQuantizeInt8(t *testing.T) {
	x := make([]float32, 40)
	x[0], x[1], x[2], x[3] = 2.54, -2.54, 0.03, -0.01 // d = 0.02: 127, -127, 1.5 → 2, -0.5 → -1
	x[32] = -1                                        // second group: d = 1/127
	q := make([]int8, 64)
	d := make([]float32, 2)
	sums := make([]int32, 2)
	QuantizeInt8(q, d, sums, x)
	if d[0] != float32(2.54)/127 || d[1] != float32(1)/127 {
		t.Errorf("scales %v", d)
	}
	if want := []int8{127, -127, 2, -1}; !slices.Equal(q[:4], want) || q[32] != -127 || q[39] != 0 {
		t.Errorf("q = %v, want %v … and q[32] = -127", q[:4], want)
	}
	if sums[0] != 1 || sums[1] != -127 {
		t.Errorf("sums %v", sums)
	}
}

// TestInt8Accuracy: an int8 Linear's products stay within 1% (relative to the row's norm) of
// the float64 products of the unquantized weights, its Row returns the dequantized weights,
// and Bytes counts one byte a weight plus the scales.
func TestInt8Accuracy(t *testing.T) {
	r := rand.New(rand.NewPCG(10, 10))
	const out, in, rows = 96, 256, 5
	w := make([]float32, out*in)
	x := make([]float32, rows*in)
	for i := range w {
		w[i] = float32(r.NormFloat64())
	}
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	l := NewLinearInt8From(nil, out, in, func(n int, dst []float32) { copy(dst, w[n*in:(n+1)*in]) })
	got := make([]float32, rows*out)
	l.Apply(got, x, rows)
	for m := range rows {
		var num, den float64
		for n := range out {
			var ref float64
			for k := range in {
				ref += float64(x[m*in+k]) * float64(w[n*in+k])
			}
			num += (float64(got[m*out+n]) - ref) * (float64(got[m*out+n]) - ref)
			den += ref * ref
		}
		if e := math.Sqrt(num / den); e > 0.01 || e == 0 {
			t.Errorf("row %d: relative error %.4g, want (0, 0.01]", m, e)
		}
	}
	// Row returns the dequantized weights, whose squared error is at most that of Q8_0's rule
	// with float32 scales (refineInt8 keeps the best of several scales, that one included).
	row := make([]float32, in)
	q := make([]int8, in)
	d := make([]float32, in/Int8Group)
	sums := make([]int32, in/Int8Group)
	for n := range out {
		l.Row(n, row)
		QuantizeInt8(q, d, sums, w[n*in:(n+1)*in])
		for g := range d {
			var e, plain float64
			for k := g * Int8Group; k < (g+1)*Int8Group; k++ {
				x := float64(w[n*in+k])
				e += (float64(row[k]) - x) * (float64(row[k]) - x)
				plain += (float64(float32(q[k])*d[g]) - x) * (float64(float32(q[k])*d[g]) - x)
				if math.Abs(float64(row[k])-x) > float64(l.i8Scale(n, g)) {
					t.Fatalf("Row(%d)[%d] = %g, weight %g: more than a step (%g) apart", n, k, row[k], x, l.i8Scale(n, g))
				}
			}
			if e > plain {
				t.Fatalf("row %d group %d: squared error %g, Q8_0's rule %g", n, g, e, plain)
			}
		}
	}
	if l.DType() != I8 || l.Bytes() != out*in+out*(in/Int8Group)*4 {
		t.Errorf("dtype %v, bytes %d", l.DType(), l.Bytes())
	}
	if name := Int8Products(); name != "VPDPBUSD" && name != "portable Go" {
		t.Errorf("Int8Products() = %q", name)
	}
}

// BenchmarkInt8Decode times one row through a 1024 × 3072 int8 Linear (down_proj of a
// Qwen3-0.6B layer) against its bytes.
func BenchmarkInt8Decode(b *testing.B) {
	const out, in = 1024, 3072
	r := rand.New(rand.NewPCG(1, 1))
	w := randInt8Matrix(r, out*in)
	x := randInt8Matrix(r, in)
	for i, tile := range int8Tiles() {
		b.Run([]string{"go", "vnni"}[i], func(b *testing.B) {
			l := newLinearInt8(tile, nil, out, in, nil, func(n int, dst []float32) { copy(dst, w[n*in:(n+1)*in]) })
			dst := make([]float32, out)
			b.SetBytes(l.Bytes())
			for b.Loop() {
				l.Apply(dst, x, 1)
			}
		})
	}
}

// q8_0Block is a block of GGUF's Q8_0 type (ggml's block_q8_0: a float16 scale d and 32 int8
// values), quantized as ggml's quantize_row_q8_0_ref does.
type q8_0Block struct {
	d  uint16
	qs [32]int8
}

// quantizeQ8_0 is quantize_row_q8_0_ref: d = amax/127, id = 1/d, qs = roundf(x·id), d stored
// as float16. x is padded with zeros to whole blocks.
func quantizeQ8_0(x []float32) []q8_0Block {
	b := make([]q8_0Block, (len(x)+31)/32)
	for i := range b {
		var amax float32
		for j := i * 32; j < min(len(x), (i+1)*32); j++ {
			amax = max(amax, float32(math.Abs(float64(x[j]))))
		}
		d := amax / 127
		var id float32
		if d != 0 {
			id = 1 / d
		}
		b[i].d = F32ToF16(d)
		for j := i * 32; j < min(len(x), (i+1)*32); j++ {
			b[i].qs[j-i*32] = int8(math.Round(float64(x[j] * id)))
		}
	}
	return b
}

// TestInt8SimulatesQ8_0: an int8 Linear whose scales are rounded to float16 holds exactly
// GGUF Q8_0's dequantized weights and computes exactly ggml's reference Q8_0 × Q8_0 dot
// product (ggml_vec_dot_q8_0_q8_0: Σ blocks sumi·(d_x·d_y), without contraction).
func TestInt8SimulatesQ8_0(t *testing.T) {
	r := rand.New(rand.NewPCG(12, 12))
	const out, in = 70, 100
	w := make([]float32, out*in)
	x := make([]float32, 2*in)
	for i := range w {
		w[i] = float32(r.NormFloat64() * 0.05)
	}
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	f16 := func(d float32) float32 { return F16ToF32(F32ToF16(d)) }
	l := NewLinearInt8ScaledFrom(nil, out, in, f16, func(n int, dst []float32) { copy(dst, w[n*in:(n+1)*in]) })
	got := make([]float32, 2*out)
	l.Apply(got, x, 2)
	row := make([]float32, in)
	for n := range out {
		wb := quantizeQ8_0(w[n*in : (n+1)*in])
		l.Row(n, row)
		for k, v := range row {
			if want := float32(wb[k/32].qs[k%32]) * F16ToF32(wb[k/32].d); v != want {
				t.Fatalf("Row(%d)[%d] = %g, Q8_0 dequantizes to %g", n, k, v, want)
			}
		}
		for m := range 2 {
			xb := quantizeQ8_0(x[m*in : (m+1)*in])
			var sumf float32
			for i := range wb {
				var sumi int32
				for j := range 32 {
					sumi += int32(wb[i].qs[j]) * int32(xb[i].qs[j])
				}
				sumf += float32(float32(sumi) * (F16ToF32(wb[i].d) * F16ToF32(xb[i].d)))
			}
			if got[m*out+n] != sumf {
				t.Fatalf("row %d output %d: %g, ggml's Q8_0 × Q8_0 %g", m, n, got[m*out+n], sumf)
			}
		}
	}
}

// TestInt8QuantizeTile: the quantization Apply runs (AVX-512 on whole groups where the CPU has
// VNNI) gives QuantizeInt8's values, scales and corrections in the tile layout, for every tile
// height, k not a multiple of the group, and groups that hit every path: exact halves of a step
// and their neighbours, all-zero groups, tiny magnitudes (subnormal included), Inf and NaN.
func TestInt8QuantizeTile(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 13))
	for _, in := range []int{1, 31, 32, 33, 96, 320, 1000} {
		groups := (in + Int8Group - 1) / Int8Group
		w := &int8Weights{groups: groups}
		for mr := 1; mr <= int8TileRows; mr++ {
			x := randInt8Matrix(r, mr*in)
			for g := range mr * groups {
				row, gr := g/groups, g%groups
				xs := x[row*in+gr*Int8Group : row*in+min(in, (gr+1)*Int8Group)]
				switch g % 7 {
				case 1: // d = 1: k + ½ and its neighbours
					for i := range xs {
						h := float32(r.IntN(253)-126) + 0.5
						xs[i] = [...]float32{h, math.Nextafter32(h, 0), math.Nextafter32(h, 200)}[r.IntN(3)]
					}
					xs[0] = 127
				case 2:
					xs[r.IntN(len(xs))] = float32(math.Inf(2*r.IntN(2) - 1))
				case 3:
					xs[r.IntN(len(xs))] = float32(math.NaN())
				case 4:
					for i := range xs {
						xs[i] = float32(r.NormFloat64()) * 1e-36 * float32(r.IntN(3)) // tiny and subnormal products
					}
				case 5:
					clear(xs)
				}
			}
			a := int8Acts{q: make([]int8, mr*groups*Int8Group), d: make([]float32, mr*groups), corr: make([]int32, mr*groups), mr: mr}
			w.quantize(a, x, in, in)
			q := make([]int8, groups*Int8Group)
			d := make([]float32, groups)
			sums := make([]int32, groups)
			for m := range mr {
				QuantizeInt8(q, d, sums, x[m*in:(m+1)*in])
				for g := range groups {
					if math.Float32bits(a.d[g*mr+m]) != math.Float32bits(d[g]) || a.corr[g*mr+m] != -128*sums[g] {
						t.Fatalf("in %d mr %d row %d group %d: scale %g correction %d, want %g and %d", in, mr, m, g, a.d[g*mr+m], a.corr[g*mr+m], d[g], -128*sums[g])
					}
					for k := range Int8Group {
						if got := a.q[4*((Int8Group/4*g+k/4)*mr+m)+k%4]; got != q[g*Int8Group+k] {
							t.Fatalf("in %d mr %d row %d group %d: q[%d] = %d, want %d (x %g)", in, mr, m, g, k, got, q[g*Int8Group+k], x[m*in+g*Int8Group+k])
						}
					}
				}
			}
		}
	}
}
