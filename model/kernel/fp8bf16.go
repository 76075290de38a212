package kernel

import (
	"fmt"
)

// FP8 codes widened to bfloat16.
//
// Every E4M3 and E5M2 value has at most 3 mantissa bits and an exponent well inside float32's,
// so it is a bfloat16 value; times a scale that keeps it one (1, vLLM's default, or a power of
// two whose products stay in range) every value of an FP8Table is too. Such a table's codes can
// be widened into half the bytes of float32 and read by the bfloat16 row kernels (RowDotsBF16,
// AccumulateRowsBF16, RowDotsBF16Set), which widen each element to float32 exactly before the
// FMA chains RowDots and AccumulateRows run: the same products as on the float32 rows WidenFP8
// writes, bit for bit.

// BF16 reports whether every value of t is a bfloat16 value (the low 16 bits of its float32 bits
// zero), so that [WidenFP8BF16] takes it: true for scale 1 and for powers of two whose products
// stay normal, false for most other scales.
func (t *FP8Table) BF16() bool { return t.bf16 }

// WidenFP8BF16 writes the dequantized values of the FP8 codes src into dst (len ≥ len(src)) as
// bfloat16 bits: the upper halves of the float32 bits [WidenFP8] writes, which are the whole of
// them. With AVX-512 VBMI, 64 codes at a time looked up in t's bytes; else a table lookup a
// code. It panics unless t.BF16().
func WidenFP8BF16(dst []uint16, src []uint8, t *FP8Table) {
	if !t.bf16 {
		panic(fmt.Sprintf("kernel.WidenFP8BF16: the %v table of scale %g has values that are not bfloat16", t.format, t.scale))
	}
	widenFP8BF16(dst[:len(src)], src, t)
}

// widenFP8BF16Generic is WidenFP8BF16 in portable Go.
func widenFP8BF16Generic(dst []uint16, src []uint8, t *FP8Table) { lookupCodes(dst, src, &t.vals16) }
