package kernel

import (
	"fmt"
	"math"
)

// DType is how a [Linear] stores its weights. Products are summed in float32 whatever the
// storage: 16-bit weights are widened exactly inside the kernels.
type DType uint8

const (
	// F32 stores float32 weights (4 bytes each).
	F32 DType = iota
	// BF16 stores bfloat16 weights (2 bytes each): the upper 16 bits of a float32.
	BF16
	// F16 stores IEEE 754 half-precision weights (2 bytes each).
	F16
	// I8 stores int8 weights with a float32 scale per group of Int8Group inputs (see
	// NewLinearInt8From).
	I8
)

// String returns "float32", "bfloat16", "float16" or "int8".
func (d DType) String() string {
	switch d {
	case F32:
		return "float32"
	case BF16:
		return "bfloat16"
	case F16:
		return "float16"
	case I8:
		return "int8"
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// Size returns the bytes of one weight (without an I8 Linear's scales).
func (d DType) Size() int {
	switch d {
	case F32:
		return 4
	case I8:
		return 1
	}
	return 2
}

// BF16ToF32 widens a bfloat16 value exactly.
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F32ToBF16 rounds f to the nearest bfloat16, ties to even; NaNs stay NaNs (quiet), infinities
// and values past the largest finite bfloat16 become infinities.
func F32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x40
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

// F16ToF32 widens an IEEE 754 half-precision value exactly.
func F16ToF32(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // Inf, NaN
		return math.Float32frombits(sign | 0xff<<23 | mant<<13)
	case exp != 0: // normal
		return math.Float32frombits(sign | (exp+127-15)<<23 | mant<<13)
	case mant == 0: // ±0
		return math.Float32frombits(sign)
	}
	// Subnormal: value = mant · 2^-24.
	f := float32(mant) * (1.0 / (1 << 24))
	if sign != 0 {
		f = -f
	}
	return f
}

// widen16 writes the float32 values of the 16-bit values src of dtype into dst.
func widen16(dst []float32, src []uint16, dtype DType) {
	src = src[:len(dst)]
	if dtype == BF16 {
		for i, h := range src {
			dst[i] = BF16ToF32(h)
		}
		return
	}
	for i, h := range src {
		dst[i] = F16ToF32(h)
	}
}

// F32ToF16 rounds f to the nearest IEEE 754 half, ties to even (subnormal halves included);
// values past the largest finite half become infinities and NaNs stay NaNs.
func F32ToF16(f float32) uint16 {
	sign := uint16(math.Float32bits(f)>>16) & 0x8000
	a := math.Abs(float64(f))
	switch {
	case math.IsNaN(a):
		return sign | 0x7e00
	case a == 0:
		return sign
	case a >= 65520: // rounds past 65504, the largest finite half
		return sign | 0x7c00
	}
	_, exp := math.Frexp(a) // a = frac·2^exp, frac in [0.5,1): floor(log2 a) = exp-1
	e := max(exp-1, -14)
	q := math.Ldexp(1, e-10) // spacing of halves with this exponent
	v := math.RoundToEven(a/q) * q
	if v < math.Ldexp(1, -14) {
		return sign | uint16(v/math.Ldexp(1, -24))
	}
	_, exp = math.Frexp(v)
	e = exp - 1
	return sign | uint16(e+15)<<10 | (uint16(v/math.Ldexp(1, e-10)) - 1024)
}

// WidenBF16 writes the float32 values of the bfloat16 values src into dst (len ≥ len(src)), with
// vector instructions where the CPU has them. Widening is exact.
func WidenBF16(dst []float32, src []uint16) {
	if len(dst) < len(src) {
		panic(fmt.Sprintf("kernel.WidenBF16: len(dst) = %d < len(src) = %d", len(dst), len(src)))
	}
	if defaultImpl.widenBF16 != nil {
		defaultImpl.widenBF16(dst, src)
		return
	}
	widen16(dst[:len(src)], src, BF16)
}
