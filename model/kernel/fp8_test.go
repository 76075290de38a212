package kernel

import (
	"bufio"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestFP8RoundTrips checks FromF32 and ToF32 of both formats against testdata/fp8_roundtrip.txt,
// derived independently by testdata/fp8_table.py (every code's exact value from the format's
// definition, each input's code by exhaustive nearest search with ties to the even code, after
// vLLM's clamp to the largest finite value): every code's value, every tie between neighbours and
// the float32s either side of it, overflows, underflows, signed zeros, NaN and random values.
func TestFP8RoundTrips(t *testing.T) {
	f, err := os.Open("testdata/fp8_roundtrip.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	hex := func(s string) uint32 {
		v, err := strconv.ParseUint(s, 16, 32)
		if err != nil {
			t.Fatal(err)
		}
		return uint32(v)
	}
	sc := bufio.NewScanner(f)
	n := 0
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) != 5 {
			t.Fatalf("line %q", sc.Text())
		}
		x := math.Float32frombits(hex(fs[0]))
		for i, format := range []FP8{E4M3, E5M2} {
			code, back := uint8(hex(fs[1+2*i])), hex(fs[2+2*i])
			if got := format.FromF32(x); got != code {
				t.Fatalf("%v.FromF32(%g = %s) = %#02x, want %#02x", format, x, fs[0], got, code)
			}
			got := format.ToF32(code)
			if want := math.Float32frombits(back); math.Float32bits(got) != back && !(math.IsNaN(float64(got)) && math.IsNaN(float64(want))) {
				t.Fatalf("%v.ToF32(%#02x) = %g, want %g", format, code, got, want)
			}
		}
		n++
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if n < 5000 {
		t.Fatalf("only %d round trips in the table", n)
	}
}

// TestFP8Slices: NarrowFP8 divides by the scale before rounding and an FP8Table multiplies by it
// after widening, code for code what FromF32 and ToF32 give; scale 1 widens exactly.
func TestFP8Slices(t *testing.T) {
	// More than eight values, so that WidenFP8 takes both its paths.
	src := []float32{0, -0.3, 1, 2.5, 447, 1000, -1e9, 3e-3, float32(math.Inf(-1)), 17, -0.001, 60000}
	for _, format := range []FP8{E4M3, E5M2} {
		for _, scale := range []float32{1, 0.037, 4} {
			codes := make([]uint8, len(src))
			NarrowFP8(codes, src, format, scale)
			wide := make([]float32, len(src))
			WidenFP8(wide, codes, NewFP8Table(format, scale))
			for i, x := range src {
				if codes[i] != format.FromF32(x/scale) {
					t.Fatalf("%v scale %g: NarrowFP8(%g) = %#02x, FromF32 gives %#02x", format, scale, x, codes[i], format.FromF32(x/scale))
				}
				if want := format.ToF32(codes[i]) * scale; wide[i] != want {
					t.Fatalf("%v scale %g: WidenFP8(%#02x) = %g, want %g", format, scale, codes[i], wide[i], want)
				}
				if m := format.MaxFinite() * scale; wide[i] > m || wide[i] < -m {
					t.Fatalf("%v scale %g: %g widened to %g, beyond the saturation bound %g", format, scale, x, wide[i], m)
				}
			}
		}
	}
}

// fp8Scales are the scales the kernels are checked with: exact ones, non-powers of two, ones
// whose products are float32 subnormals (or underflow to zero) or overflow to infinity, and a
// negative one.
var fp8Scales = []float32{1, 0.037, 4, 0.3, 1.7e-38, 1e-42, 3e-30, 2.5e36, -0.75, 1.0 / 3, float32(math.NaN())}

// TestWidenFP8Kernels checks every widening kernel the CPU has (and WidenFP8's choice) against
// the portable table lookup, bit for bit, for all 256 codes of both formats times every scale —
// subnormal codes, ±0, the largest finite values, E5M2's infinities and both formats' NaNs,
// subnormal, infinite and NaN products — and for random codes at every length up to 70 (the
// kernels' 64-, 16-code and masked tail steps), leaving dst past len(src) untouched.
func TestWidenFP8Kernels(t *testing.T) {
	ks := fp8Widens()
	ks["WidenFP8"] = WidenFP8
	t.Logf("kernels: %d (generic, WidenFP8 and those of this CPU)", len(ks))
	r := rand.New(rand.NewPCG(7, 8))
	check := func(format FP8, scale float32, src []uint8) {
		t.Helper()
		tab := NewFP8Table(format, scale)
		want := make([]float32, len(src))
		for i, b := range src {
			want[i] = tab.vals[b]
		}
		for name, widen := range ks {
			if name == "vbmi" && !tab.mirrored {
				continue
			}
			got := make([]float32, len(src)+1)
			got[len(src)] = 7
			widen(got, src, tab)
			for i, b := range src {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("%s, %v scale %g, %d codes: code %#02x at %d widened to %08x, the table holds %08x",
						name, format, scale, len(src), b, i, math.Float32bits(got[i]), math.Float32bits(want[i]))
				}
			}
			if got[len(src)] != 7 {
				t.Fatalf("%s, %v: %d codes: wrote past len(src)", name, format, len(src))
			}
		}
	}
	forCodeRuns(r, fp8Scales, 71, check)
}

// forCodeRuns calls check for both formats and each scale with all 256 codes, all but the first
// (unaligned), and random codes of every length below lengths.
func forCodeRuns(r *rand.Rand, scales []float32, lengths int, check func(format FP8, scale float32, src []uint8)) {
	all := make([]uint8, 256)
	for i := range all {
		all[i] = uint8(i)
	}
	for _, format := range []FP8{E4M3, E5M2} {
		for _, scale := range scales {
			check(format, scale, all)
			check(format, scale, all[1:])
			for n := range lengths {
				src := make([]uint8, n)
				for i := range src {
					src[i] = uint8(r.Uint32())
				}
				check(format, scale, src)
			}
		}
	}
}

// TestNarrowFP8Kernels checks NarrowFP8 against FromF32 of each quotient, code for code: every
// float32 either side of every code's value times the scale and of each midpoint between
// neighbouring codes, overflows, underflows, float32 subnormals, ±0, ±Inf, NaN and random
// values, at every length up to 70, leaving dst past len(src) untouched.
func TestNarrowFP8Kernels(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	for _, format := range []FP8{E4M3, E5M2} {
		for _, scale := range fp8Scales {
			var xs []float32
			for b := range 256 {
				v := format.ToF32(uint8(b))
				next := format.ToF32(uint8(b + 1))
				for _, c := range []float32{v, (v + next) / 2} {
					c *= scale
					xs = append(xs, c, math.Nextafter32(c, float32(math.Inf(1))), math.Nextafter32(c, float32(math.Inf(-1))))
				}
			}
			xs = append(xs, 0, float32(math.Copysign(0, -1)), float32(math.Inf(1)), float32(math.Inf(-1)),
				float32(math.NaN()), -float32(math.NaN()), 1e-45, -1e-40, math.MaxFloat32, -math.MaxFloat32)
			for range 200 {
				xs = append(xs, math.Float32frombits(r.Uint32()), float32(r.NormFloat64())*scale)
			}
			for start := 0; start < len(xs); start += 71 {
				n := min(len(xs)-start, r.IntN(71))
				src := xs[start : start+n]
				got := make([]uint8, n+1)
				got[n] = 0x5a
				NarrowFP8(got, src, format, scale)
				for i, x := range src {
					if want := format.FromF32(x / scale); got[i] != want {
						t.Fatalf("%v scale %g, %d values: %g (%08x) narrowed to %#02x, FromF32 gives %#02x",
							format, scale, n, x, math.Float32bits(x), got[i], want)
					}
				}
				if got[n] != 0x5a {
					t.Fatalf("%v: %d values: wrote past len(src)", format, n)
				}
			}
		}
	}
}

// BenchmarkWidenFP8 widens one 16-slot block of 128-value heads (2048 codes), as attention
// does for a block of an HND-layout FP8 cache, and one head's row (128 codes), as it does a row
// at a time otherwise; it reports ns a value.
func BenchmarkWidenFP8(b *testing.B) {
	r := rand.New(rand.NewPCG(3, 4))
	src := make([]uint8, 2048)
	for i := range src {
		src[i] = uint8(r.Uint32())
	}
	dst := make([]float32, len(src))
	for _, format := range []FP8{E4M3, E5M2} {
		tab := NewFP8Table(format, 0.037)
		for _, n := range []int{2048, 128} {
			b.Run(fmt.Sprintf("%v/%d", format, n), func(b *testing.B) {
				b.SetBytes(int64(n))
				for b.Loop() {
					WidenFP8(dst, src[:n], tab)
				}
				b.ReportMetric(b.Elapsed().Seconds()*1e9/float64(b.N)/float64(n), "ns/value")
			})
		}
	}
}

// BenchmarkNarrowFP8 narrows one 128-value head, as the KV write of one token does.
func BenchmarkNarrowFP8(b *testing.B) {
	r := rand.New(rand.NewPCG(5, 6))
	src := randSlice(r, 128)
	dst := make([]uint8, len(src))
	for _, format := range []FP8{E4M3, E5M2} {
		b.Run(format.String(), func(b *testing.B) {
			b.SetBytes(int64(len(src)))
			for b.Loop() {
				NarrowFP8(dst, src, format, 0.037)
			}
			b.ReportMetric(b.Elapsed().Seconds()*1e9/float64(b.N)/float64(len(src)), "ns/value")
		})
	}
}
