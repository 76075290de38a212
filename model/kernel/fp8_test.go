package kernel

import (
	"bufio"
	"math"
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
