package kernel

import (
	"encoding/binary"
	"fmt"
	"math"
)

// FP8 is an 8-bit floating-point format of KV cache values (vLLM's --kv-cache-dtype fp8,
// fp8_e4m3 and fp8_e5m2).
type FP8 uint8

const (
	// E4M3 is OCP FP8 E4M3 as PyTorch's torch.float8_e4m3fn holds it: 4 exponent bits (bias 7),
	// 3 mantissa bits, no infinities, 0x7f and 0xff NaN, largest finite value ±448.
	E4M3 FP8 = iota
	// E5M2 is OCP FP8 E5M2 (torch.float8_e5m2): 5 exponent bits (bias 15), 2 mantissa bits,
	// IEEE infinities and NaNs, largest finite value ±57344 — the upper byte of a float16.
	E5M2
)

// String returns vLLM's names, "fp8_e4m3" or "fp8_e5m2".
func (f FP8) String() string {
	switch f {
	case E4M3:
		return "fp8_e4m3"
	case E5M2:
		return "fp8_e5m2"
	}
	return fmt.Sprintf("FP8(%d)", uint8(f))
}

// MaxFinite returns the largest finite value of the format: 448 for E4M3, 57344 for E5M2.
func (f FP8) MaxFinite() float32 {
	if f == E5M2 {
		return 57344
	}
	return 448
}

// ToF32 widens the FP8 value b exactly.
func (f FP8) ToF32(b uint8) float32 {
	if f == E5M2 {
		return F16ToF32(uint16(b) << 8)
	}
	sign := uint32(b>>7) << 31
	exp := uint32(b>>3) & 0xf
	mant := uint32(b) & 7
	switch {
	case exp == 0xf && mant == 7: // the only NaN encodings (0x7f, 0xff)
		return math.Float32frombits(sign | 0x7fc00000)
	case exp != 0: // normal: 1.mant · 2^(exp-7)
		return math.Float32frombits(sign | (exp+127-7)<<23 | mant<<20)
	}
	// Zero or subnormal: mant · 2^-9, exact in float32.
	return math.Float32frombits(sign | math.Float32bits(float32(mant)*(1.0/512)))
}

// FromF32 rounds x to the nearest value of the format, ties to even, after saturating it to
// ±MaxFinite: the conversion vLLM's kernels make when they write an FP8 KV cache (a clamp to
// the format's range, then PyTorch's rounding cast, c10's fp8e4m3fn_from_fp32_value or
// fp8e5m2_from_fp32_value; the cast alone would turn E4M3 overflows into NaN and E5M2 ones into
// infinities). Infinities saturate too; a NaN stays NaN (0x7f with x's sign, as in c10).
func (f FP8) FromF32(x float32) uint8 {
	// The format's mantissa bits and exponent bias, the float32 bits of its largest finite value
	// and smallest normal, and a float32 power of two whose spacing is the format's smallest
	// subnormal: adding it rounds a subnormal to nearest even in float32's own arithmetic.
	mant, bias, maxBits, minNormal, magic := uint32(3), uint32(7), uint32(0x43e00000), uint32(121)<<23, uint32(141)<<23
	if f == E5M2 {
		mant, bias, maxBits, minNormal, magic = 2, 15, 0x47600000, uint32(113)<<23, uint32(134)<<23
	}
	b := math.Float32bits(x)
	sign := uint8(b>>24) & 0x80
	b &^= 1 << 31
	switch {
	case b > 0x7f800000:
		return sign | 0x7f
	case b > maxBits:
		b = maxBits
	case b < minNormal:
		r := math.Float32bits(math.Float32frombits(b) + math.Float32frombits(magic))
		return sign | uint8(r-magic)
	}
	// Normal: rebias the exponent and round the dropped mantissa bits to nearest, ties to even
	// (half of the dropped range minus one, plus the kept mantissa's last bit).
	shift := 23 - mant
	odd := (b >> shift) & 1
	b += (bias-127)<<23 + (1<<(shift-1) - 1) + odd
	return sign | uint8(b>>shift)
}

// FP8Table is the dequantization of a KV cache in one format with one scale: code b stands for
// f.ToF32(b)·scale, rounded once to float32 (exact for scale 1). The widening kernels read its
// values (portable Go), its values' bytes (AVX-512 VBMI) or compute them (AVX-512F): the same
// bits.
type FP8Table struct {
	format FP8
	scale  float32
	vals   [256]float32
	// planes[k][b] is byte k of vals[b], b < 0x80; mirrored reports that vals[b|0x80] is
	// vals[b] with its sign bit flipped for every b, as IEEE multiplication gives unless the
	// scale is a NaN: then the planes are not used.
	planes   [4][128]uint8
	mirrored bool
	// bf16 reports that every value of vals is a bfloat16 value (the low 16 bits of its float32
	// bits zero), vals16 their upper halves: the values WidenFP8BF16 writes.
	bf16   bool
	vals16 [256]uint16
}

// NewFP8Table returns the table of format f with scale.
func NewFP8Table(f FP8, scale float32) *FP8Table {
	t := &FP8Table{format: f, scale: scale, mirrored: true, bf16: true}
	for b := range t.vals {
		t.vals[b] = f.ToF32(uint8(b)) * scale
		bits := math.Float32bits(t.vals[b])
		t.vals16[b] = uint16(bits >> 16)
		if uint16(bits) != 0 {
			t.bf16 = false
		}
	}
	for b := range 128 {
		bits := math.Float32bits(t.vals[b])
		for k := range t.planes {
			t.planes[k][b] = uint8(bits >> (8 * k))
		}
		if math.Float32bits(t.vals[b|0x80]) != bits^1<<31 {
			t.mirrored = false
		}
	}
	return t
}

// WidenFP8 writes the dequantized values of the FP8 codes src into dst (len ≥ len(src)): with
// AVX-512 VBMI, 64 codes at a time looked up in t's bytes; with AVX-512F, 16 codes at a time
// computed; else a table lookup a code.
func WidenFP8(dst []float32, src []uint8, t *FP8Table) {
	widenFP8(dst[:len(src)], src, t)
}

// widenFP8Generic is WidenFP8 in portable Go.
func widenFP8Generic(dst []float32, src []uint8, t *FP8Table) { lookupCodes(dst, src, &t.vals) }

// lookupCodes writes v[c] for each code c of src into dst (len ≥ len(src)), eight codes a load
// (1.4 times as fast as one at a time, measured): the portable widenings.
func lookupCodes[T float32 | uint16](dst []T, src []uint8, v *[256]T) {
	dst = dst[:len(src)]
	i := 0
	for ; i+8 <= len(src); i += 8 {
		w := binary.LittleEndian.Uint64(src[i:])
		d := dst[i : i+8 : i+8]
		d[0], d[1], d[2], d[3] = v[uint8(w)], v[uint8(w>>8)], v[uint8(w>>16)], v[uint8(w>>24)]
		d[4], d[5], d[6], d[7] = v[uint8(w>>32)], v[uint8(w>>40)], v[uint8(w>>48)], v[uint8(w>>56)]
	}
	for ; i < len(src); i++ {
		dst[i] = v[src[i]]
	}
}

// NarrowFP8 writes the FP8 codes of src divided by scale into dst (len ≥ len(src)), each
// quotient saturated and rounded as FromF32 does: vLLM's quantization of a KV cache entry
// (x / k_scale, then the cast). With AVX-512, 16 values at a time.
func NarrowFP8(dst []uint8, src []float32, f FP8, scale float32) {
	narrowFP8(dst[:len(src)], src, f, scale)
}

// narrowFP8Generic is NarrowFP8 in portable Go.
func narrowFP8Generic(dst []uint8, src []float32, f FP8, scale float32) {
	dst = dst[:len(src)]
	for i, x := range src {
		dst[i] = f.FromF32(x / scale)
	}
}
