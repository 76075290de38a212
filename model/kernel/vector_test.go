package kernel

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

var vecLens = []int{0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 128, 129, 1000, 4099}

func eachImpl(t *testing.T, f func(t *testing.T, im *impl)) {
	for _, im := range candidateImpls() {
		t.Run(im.name, func(t *testing.T) { f(t, im) })
	}
}

func TestDot(t *testing.T) {
	eachImpl(t, func(t *testing.T, im *impl) {
		r := rand.New(rand.NewPCG(5, 6))
		for _, n := range vecLens {
			a, b := randSlice(r, n+1), randSlice(r, n+1)
			var want float64
			for i := range n {
				want += float64(a[i]) * float64(b[i])
			}
			got := im.dot(a[:n], b[:n])
			if math.Abs(float64(got)-want) > 1e-5*float64(n)+1e-6 {
				t.Fatalf("n=%d: got %v want %v", n, got, want)
			}
			// Same values at another address (shifted by one element) give the same bits.
			a2, b2 := make([]float32, n+1), make([]float32, n+1)
			copy(a2[1:], a[:n])
			copy(b2[1:], b[:n])
			if g2 := im.dot(a2[1:], b2[1:]); math.Float32bits(g2) != math.Float32bits(got) {
				t.Fatalf("n=%d: dot depends on alignment: %v vs %v", n, g2, got)
			}
		}
	})
}

func TestElementwiseIsPositionIndependent(t *testing.T) {
	eachImpl(t, func(t *testing.T, im *impl) {
		r := rand.New(rand.NewPCG(7, 8))
		for _, n := range vecLens {
			g, u, x, y := randSlice(r, n), randSlice(r, n), randSlice(r, n), randSlice(r, n)
			for i := range g {
				g[i] *= 4
			}
			silu := make([]float32, n)
			im.siluMul(silu, g, u)
			axpy := append([]float32(nil), y...)
			im.axpy(0.37, x, axpy)
			sum := make([]float32, n)
			im.add(sum, x, y)
			sc := append([]float32(nil), x...)
			im.scale(-1.7, sc)
			for i := range n {
				// Element i computed alone (a slice of length 1) must match bit for bit.
				var one [1]float32
				im.siluMul(one[:], g[i:i+1], u[i:i+1])
				want := float64(g[i]) / (1 + math.Exp(-float64(g[i]))) * float64(u[i])
				if math.Float32bits(one[0]) != math.Float32bits(silu[i]) || math.Abs(float64(silu[i])-want) > 1e-6*(1+math.Abs(want)) {
					t.Fatalf("silu n=%d i=%d: got %v alone %v want %v", n, i, silu[i], one[0], want)
				}
				one[0] = y[i]
				im.axpy(0.37, x[i:i+1], one[:])
				if math.Float32bits(one[0]) != math.Float32bits(axpy[i]) || math.Abs(float64(axpy[i])-(float64(y[i])+0.37*float64(x[i]))) > 1e-6*(1+math.Abs(float64(axpy[i]))) {
					t.Fatalf("axpy n=%d i=%d: got %v alone %v", n, i, axpy[i], one[0])
				}
				if sum[i] != x[i]+y[i] {
					t.Fatalf("add n=%d i=%d", n, i)
				}
				if sc[i] != x[i]*-1.7 {
					t.Fatalf("scale n=%d i=%d", n, i)
				}
			}
		}
	})
}

func TestSoftmax(t *testing.T) {
	eachImpl(t, testSoftmax)
}

func testSoftmax(t *testing.T, im *impl) {
	r := rand.New(rand.NewPCG(9, 10))
	for _, n := range vecLens[1:] {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			x := randSlice(r, n)
			for i := range x {
				x[i] *= 10
			}
			if n > 3 {
				x[2] = float32(math.Inf(-1))
			}
			mx := math.Inf(-1)
			for _, v := range x {
				mx = math.Max(mx, float64(v))
			}
			var s float64
			for _, v := range x {
				s += math.Exp(float64(v) - mx)
			}
			got := append([]float32(nil), x...)
			softmax(im, got)
			again := append([]float32(nil), x...)
			softmax(im, again)
			var total float64
			for i, v := range x {
				want := math.Exp(float64(v)-mx) / s
				if math.Abs(float64(got[i])-want) > 1e-6+1e-5*want {
					t.Fatalf("i=%d: got %v want %v", i, got[i], want)
				}
				if math.Float32bits(got[i]) != math.Float32bits(again[i]) {
					t.Fatalf("not deterministic")
				}
				if math.IsInf(float64(v), -1) && got[i] != 0 {
					t.Fatalf("-Inf gave %v", got[i])
				}
				total += float64(got[i])
			}
			if math.Abs(total-1) > 1e-5 {
				t.Fatalf("sum = %v", total)
			}
		})
	}
	inf := []float32{float32(math.Inf(-1)), float32(math.Inf(-1))}
	softmax(im, inf)
	if inf[0] != 0 || inf[1] != 0 {
		t.Fatalf("all -Inf: %v", inf)
	}
	softmax(im, nil)
	Softmax(nil)
}

// TestExpRange checks the exponential at the edges through SiLUMul and Softmax: huge, tiny and
// infinite inputs give the right limits, never NaN.
func TestExpRange(t *testing.T) {
	eachImpl(t, func(t *testing.T, im *impl) {
		g := []float32{-200, -90, -88, -50, -1e-30, 0, 1e-30, 50, 88, 90, 200, float32(math.Inf(1))}
		u := make([]float32, len(g))
		for i := range u {
			u[i] = 1
		}
		d := make([]float32, len(g))
		im.siluMul(d, g, u)
		for i, v := range g {
			want := float64(v) / (1 + math.Exp(-float64(v)))
			if math.IsNaN(float64(d[i])) || math.Abs(float64(d[i])-want) > 1e-6*(1+math.Abs(want)) {
				t.Errorf("silu(%v) = %v, want %v", v, d[i], want)
			}
		}
		x := []float32{0, -10, -80, -87, -88, -100, -104, -200, float32(math.Inf(-1))}
		for i := range x {
			y := []float32{0, x[i]}
			softmax(im, y)
			e := math.Exp(float64(x[i]))
			want := e / (1 + e)
			if math.IsNaN(float64(y[1])) || math.Abs(float64(y[1])-want) > 1e-6*want+1e-37 {
				t.Errorf("softmax([0 %v])[1] = %v, want %v", x[i], y[1], want)
			}
		}
	})
}

func TestRMSNorm(t *testing.T) {
	eachImpl(t, testRMSNorm)
	RMSNorm(make([]float32, 2), []float32{3, 4}, []float32{1, 1}, 0)
}

func testRMSNorm(t *testing.T, im *impl) {
	r := rand.New(rand.NewPCG(11, 12))
	for _, n := range []int{1, 7, 64, 129} {
		const rows = 3
		x, w := randSlice(r, rows*n), randSlice(r, n)
		dst := make([]float32, rows*n)
		rmsNorm(im, dst, x, w, 1e-6)
		for m := range rows {
			var ss float64
			for _, v := range x[m*n : (m+1)*n] {
				ss += float64(v) * float64(v)
			}
			inv := 1 / math.Sqrt(ss/float64(n)+1e-6)
			for i := range n {
				want := float64(x[m*n+i]) * inv * float64(w[i])
				if math.Abs(float64(dst[m*n+i])-want) > 1e-5*(1+math.Abs(want)) {
					t.Fatalf("n=%d row %d i=%d: got %v want %v", n, m, i, dst[m*n+i], want)
				}
			}
			one := make([]float32, n)
			rmsNorm(im, one, x[m*n:(m+1)*n], w, 1e-6)
			for i := range n {
				if math.Float32bits(one[i]) != math.Float32bits(dst[m*n+i]) {
					t.Fatalf("row alone differs")
				}
			}
		}
		in := append([]float32(nil), x...)
		rmsNorm(im, in, in, w, 1e-6)
		for i := range in {
			if in[i] != dst[i] {
				t.Fatalf("in-place differs")
			}
		}
	}
}

func TestPublicVectorFuncs(t *testing.T) {
	a, b := []float32{1, 2, 3}, []float32{4, 5, 6, 7}
	if got := Dot(a, b); got != 32 {
		t.Fatalf("Dot = %v", got)
	}
	y := []float32{1, 1, 1}
	Axpy(2, a, y)
	if y[0] != 3 || y[2] != 7 {
		t.Fatalf("Axpy = %v", y)
	}
	Scale(0.5, y)
	if y[0] != 1.5 {
		t.Fatalf("Scale = %v", y)
	}
	Add(y, y, a)
	if y[1] != 2.5+2 {
		t.Fatalf("Add = %v", y)
	}
	d := make([]float32, 3)
	SiLUMul(d, []float32{0, 0, 0}, a)
	if d[0] != 0 {
		t.Fatalf("SiLUMul = %v", d)
	}
	if Implementation() == "" {
		t.Fatal("no implementation name")
	}
}

// TestRopeAndNormScale: every implementation rotates each pair and scales each RMSNorm element
// with the rounded products and sums the definitions spell out (float32 expressions evaluated
// one rounding at a time), for every length, tails included.
func TestRopeAndNormScale(t *testing.T) {
	eachImpl(t, func(t *testing.T, im *impl) {
		r := rand.New(rand.NewPCG(21, 22))
		for _, n := range vecLens {
			x1, x2, c, s := randSlice(r, n), randSlice(r, n), randSlice(r, n), randSlice(r, n)
			y1, y2 := append([]float32(nil), x1...), append([]float32(nil), x2...)
			rope(im, y1, y2, c, s)
			for i := range n {
				// Explicit conversions round each product (the compiler may not fuse them).
				ac, bs := float32(x1[i]*c[i]), float32(x2[i]*s[i])
				bc, as := float32(x2[i]*c[i]), float32(x1[i]*s[i])
				if w1, w2 := ac-bs, bc+as; math.Float32bits(y1[i]) != math.Float32bits(w1) || math.Float32bits(y2[i]) != math.Float32bits(w2) {
					t.Fatalf("rope n=%d i=%d: got %v, %v want %v, %v", n, i, y1[i], y2[i], w1, w2)
				}
			}
			scale := im.normScale
			if scale == nil {
				scale = normScaleGeneric
			}
			dst := make([]float32, n)
			scale(dst, x1, c, 0.731)
			for i := range n {
				if want := float32(x1[i]*0.731) * c[i]; math.Float32bits(dst[i]) != math.Float32bits(want) {
					t.Fatalf("normScale n=%d i=%d: got %v want %v", n, i, dst[i], want)
				}
			}
		}
	})
	x := []float32{1, 2, 3, 4}
	Rope(x, []float32{0, 1}, []float32{1, 0})
	if x[0] != -3 || x[1] != 2 || x[2] != 1 || x[3] != 4 {
		t.Fatalf("Rope by 90° and 0° = %v, want [-3 2 1 4]", x)
	}
}

// TestNarrowBF16: every implementation rounds like F32ToBF16 — ties to even, denormals kept,
// NaNs quiet with their sign and top payload bits, infinities and overflow to infinity — at
// every position of every length.
func TestNarrowBF16(t *testing.T) {
	special := []uint32{0, 0x80000000, 1, 0x80000001, 0x007fffff, 0x00008000, 0x00018000, 0x3f808000, 0x3f818000,
		0x3f807fff, 0x7f7fffff, 0xff7fffff, 0x7f800000, 0xff800000, 0x7f800001, 0xff800001, 0x7fc00000, 0x7fffffff, 0x7f7f8000}
	eachImpl(t, func(t *testing.T, im *impl) {
		r := rand.New(rand.NewPCG(23, 24))
		for _, n := range vecLens {
			src := make([]float32, n)
			for i := range src {
				b := r.Uint32()
				if i%3 == 0 {
					b = special[r.IntN(len(special))]
				}
				src[i] = math.Float32frombits(b)
			}
			dst := make([]uint16, n+1)
			dst[n] = 0xbeef
			narrowBF16(im, dst[:n], src)
			for i, v := range src {
				if want := F32ToBF16(v); dst[i] != want {
					t.Fatalf("n=%d i=%d: %08x -> %04x, want %04x", n, i, math.Float32bits(v), dst[i], want)
				}
			}
			if dst[n] != 0xbeef {
				t.Fatalf("n=%d: wrote past the end", n)
			}
		}
	})
}
