package kernel

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// TestFP8TableBF16 checks that an FP8Table reports itself bfloat16-exact exactly when every
// value's float32 bits have zero low halves: for both formats with scale 1 and powers of two
// (2, 0.5, 2^±20) — whose every value is a bfloat16 — and not for a non-power of two or powers
// of two that push values into float32's subnormals, and for every scale of fp8Scales.
func TestFP8TableBF16(t *testing.T) {
	exact := []float32{1, 2, 0.5, 0x1p20, 0x1p-20}
	inexact := []float32{0.037, 0.3, 1.0 / 3, 0x1p-140}
	for _, format := range []FP8{E4M3, E5M2} {
		for _, scale := range append(append(append([]float32(nil), exact...), inexact...), fp8Scales...) {
			tab := NewFP8Table(format, scale)
			want := true
			for _, v := range tab.vals {
				if uint16(math.Float32bits(v)) != 0 {
					want = false
				}
			}
			if tab.BF16() != want {
				t.Fatalf("%v scale %g: BF16() = %v, the values say %v", format, scale, tab.BF16(), want)
			}
		}
		for _, scale := range exact {
			if !NewFP8Table(format, scale).BF16() {
				t.Fatalf("%v scale %g: not bfloat16-exact", format, scale)
			}
		}
		for _, scale := range inexact {
			if NewFP8Table(format, scale).BF16() {
				t.Fatalf("%v scale %g: bfloat16-exact", format, scale)
			}
		}
	}
}

// TestWidenFP8BF16Kernels checks every bfloat16 widening kernel the CPU has (and WidenFP8BF16's
// choice) against WidenFP8, bit for bit — each bfloat16 the upper half of the float32 WidenFP8
// writes, whose lower half is zero — for all 256 codes of both formats times the bfloat16-exact
// scales 1, 2 and 0.5, and for random codes at every length up to 140 (the 64-code steps and
// the masked tail, both of its halves), leaving dst past len(src) untouched; WidenFP8BF16
// panics for a table that is not bfloat16-exact (scale 0.037: its values need float32).
func TestWidenFP8BF16Kernels(t *testing.T) {
	ks := fp8BF16Widens()
	ks["WidenFP8BF16"] = WidenFP8BF16
	t.Logf("kernels: %d (generic, WidenFP8BF16 and those of this CPU)", len(ks))
	r := rand.New(rand.NewPCG(11, 12))
	check := func(format FP8, scale float32, src []uint8) {
		t.Helper()
		tab := NewFP8Table(format, scale)
		want := make([]float32, len(src))
		WidenFP8(want, src, tab)
		for name, widen := range ks {
			got := make([]uint16, len(src)+1)
			got[len(src)] = 0x5a5a
			widen(got, src, tab)
			for i, b := range src {
				if w := math.Float32bits(want[i]); uint32(got[i])<<16 != w {
					t.Fatalf("%s, %v scale %g, %d codes: code %#02x at %d widened to %04x, WidenFP8 gives %08x",
						name, format, scale, len(src), b, i, got[i], w)
				}
			}
			if got[len(src)] != 0x5a5a {
				t.Fatalf("%s, %v: %d codes: wrote past len(src)", name, format, len(src))
			}
		}
	}
	forCodeRuns(r, []float32{1, 2, 0.5}, 141, check)
	for _, format := range []FP8{E4M3, E5M2} {
		func() {
			defer func() {
				if recover() == nil {
					t.Fatalf("%v scale 0.037: WidenFP8BF16 did not panic", format)
				}
			}()
			WidenFP8BF16(make([]uint16, 4), make([]uint8, 4), NewFP8Table(format, 0.037))
		}()
	}
}

// TestFP8BF16RowKernels checks the point of the bfloat16 widening: the bfloat16 row kernels on
// rows widened by WidenFP8BF16 give the float32 row kernels' results on rows widened by
// WidenFP8, bit for bit (scores, value sums carried from a nonzero start, and a set of scores),
// for random codes of both formats with bfloat16-exact scales.
func TestFP8BF16RowKernels(t *testing.T) {
	const dim, n, rows = 128, 37, 5
	if !RowKernels(dim) {
		t.Skip("no row kernels for dim 128 here")
	}
	r := rand.New(rand.NewPCG(13, 14))
	for _, format := range []FP8{E4M3, E5M2} {
		for _, scale := range []float32{1, 2, 0.5} {
			tab := NewFP8Table(format, scale)
			codes := make([]uint8, 2*n*dim)
			for i := range codes {
				// Finite codes only: attention's keys and values are saturated, never NaN.
				for {
					codes[i] = uint8(r.Uint32())
					if v := tab.vals[codes[i]]; !math.IsNaN(float64(v)) && !math.IsInf(float64(v), 0) {
						break
					}
				}
			}
			wide := make([]float32, len(codes))
			WidenFP8(wide, codes, tab)
			half := make([]uint16, len(codes))
			WidenFP8BF16(half, codes, tab)
			q := randSlice(r, rows*dim)
			p := randSlice(r, rows*n)
			start := randSlice(r, rows*dim)
			same := func(what string, a, b []float32) {
				t.Helper()
				for i := range a {
					if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
						t.Fatalf("%v scale %g: %s element %d: %g (bfloat16) != %g (float32)", format, scale, what, i, a[i], b[i])
					}
				}
			}
			s32, s16 := make([]float32, rows*n), make([]float32, rows*n)
			RowDots(s32, n, q, dim, rows, wide, dim, n, dim)
			RowDotsBF16(s16, n, q, dim, rows, half, dim, n, dim)
			same("RowDots", s16, s32)
			a32, a16 := append([]float32(nil), start...), append([]float32(nil), start...)
			AccumulateRows(a32, dim, p, n, rows, wide, dim, n, dim)
			AccumulateRowsBF16(a16, dim, p, n, rows, half, dim, n, dim)
			same("AccumulateRows", a16, a32)
			set16 := [][]float32{make([]float32, rows*n), make([]float32, rows*n)}
			RowDotsBF16Set(set16, n, [][]float32{q, q}, dim, rows, [][]uint16{half, half[n*dim:]}, dim, n, dim)
			same("RowDotsBF16Set 0", set16[0], s32)
			RowDots(s32, n, q, dim, rows, wide[n*dim:], dim, n, dim)
			same("RowDotsBF16Set 1", set16[1], s32)
		}
	}
}

// BenchmarkWidenFP8BF16 is BenchmarkWidenFP8 for WidenFP8BF16 (scale 1), beside WidenFP8 with
// the same table: one 16-slot block of 128-value heads (2048 codes) and one head's row (128).
func BenchmarkWidenFP8BF16(b *testing.B) {
	r := rand.New(rand.NewPCG(3, 4))
	src := make([]uint8, 2048)
	for i := range src {
		src[i] = uint8(r.Uint32())
	}
	dst32, dst16 := make([]float32, len(src)), make([]uint16, len(src))
	for _, format := range []FP8{E4M3, E5M2} {
		tab := NewFP8Table(format, 1)
		for _, n := range []int{2048, 128} {
			for _, bf16 := range []bool{false, true} {
				name := "float32"
				if bf16 {
					name = "bfloat16"
				}
				b.Run(fmt.Sprintf("%v/%d/%s", format, n, name), func(b *testing.B) {
					b.SetBytes(int64(n))
					for b.Loop() {
						if bf16 {
							WidenFP8BF16(dst16, src[:n], tab)
						} else {
							WidenFP8(dst32, src[:n], tab)
						}
					}
					b.ReportMetric(b.Elapsed().Seconds()*1e9/float64(b.N)/float64(n), "ns/value")
				})
			}
		}
	}
}

// BenchmarkFP8BlockProducts times what FP8 attention does with one KV head's block of 16 keys
// (or values) of 128 dimensions for decode's 2 query rows, in L1: widen the codes to float32 and
// run RowDots (AccumulateRows), or widen them to bfloat16 and run RowDotsBF16
// (AccumulateRowsBF16). It reports ns a block.
func BenchmarkFP8BlockProducts(b *testing.B) {
	const dim, n, rows = 128, 16, 2
	if !RowKernels(dim) {
		b.Skip("no row kernels for dim 128 here")
	}
	r := rand.New(rand.NewPCG(15, 16))
	tab := NewFP8Table(E4M3, 1)
	codes := make([]uint8, n*dim)
	for i := range codes {
		codes[i] = E4M3.FromF32(float32(r.NormFloat64()))
	}
	q, p := randSlice(r, rows*dim), randSlice(r, rows*n)
	dst, acc := make([]float32, rows*n), make([]float32, rows*dim)
	wide, half := make([]float32, n*dim), make([]uint16, n*dim)
	cases := map[string]func(){
		"keys/float32": func() { WidenFP8(wide, codes, tab); RowDots(dst, n, q, dim, rows, wide, dim, n, dim) },
		"keys/bfloat16": func() {
			WidenFP8BF16(half, codes, tab)
			RowDotsBF16(dst, n, q, dim, rows, half, dim, n, dim)
		},
		"values/float32": func() {
			WidenFP8(wide, codes, tab)
			AccumulateRows(acc, dim, p, n, rows, wide, dim, n, dim)
		},
		"values/bfloat16": func() {
			WidenFP8BF16(half, codes, tab)
			AccumulateRowsBF16(acc, dim, p, n, rows, half, dim, n, dim)
		},
	}
	for _, name := range []string{"keys/float32", "keys/bfloat16", "values/float32", "values/bfloat16"} {
		b.Run(name, func(b *testing.B) {
			f := cases[name]
			for b.Loop() {
				f()
			}
		})
	}
}
