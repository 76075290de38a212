package kernel

import (
	"fmt"
	"math"
)

// Dot returns Σ a[i]·b[i] over i < len(a). The reduction order is fixed for a given length (it
// never depends on where the slices live or what else is running), so equal inputs give
// bit-identical results. It panics if len(b) < len(a).
func Dot(a, b []float32) float32 {
	if len(b) < len(a) {
		panic(fmt.Sprintf("kernel.Dot: len(b) = %d < len(a) = %d", len(b), len(a)))
	}
	return defaultImpl.dot(a, b[:len(a)])
}

// Axpy computes y[i] += alpha·x[i] for i < len(x). It panics if len(y) < len(x).
func Axpy(alpha float32, x, y []float32) {
	if len(y) < len(x) {
		panic(fmt.Sprintf("kernel.Axpy: len(y) = %d < len(x) = %d", len(y), len(x)))
	}
	defaultImpl.axpy(alpha, x, y[:len(x)])
}

// Scale computes x[i] *= alpha.
func Scale(alpha float32, x []float32) {
	defaultImpl.scale(alpha, x)
}

// Add computes dst[i] = a[i] + b[i] for i < len(dst); dst may alias a or b (Add(h, h, r) adds
// a residual in place). It panics if a or b is shorter than dst.
func Add(dst, a, b []float32) {
	if len(a) < len(dst) || len(b) < len(dst) {
		panic(fmt.Sprintf("kernel.Add: len(dst) = %d, len(a) = %d, len(b) = %d", len(dst), len(a), len(b)))
	}
	defaultImpl.add(dst, a[:len(dst)], b[:len(dst)])
}

// SiLUMul computes dst[i] = silu(gate[i])·up[i] = gate[i]/(1+e^-gate[i])·up[i] for i < len(dst)
// (the SwiGLU activation). Each element is computed the same way wherever it sits in the
// slice. dst may alias gate or up. It panics if gate or up is shorter than dst.
func SiLUMul(dst, gate, up []float32) {
	if len(gate) < len(dst) || len(up) < len(dst) {
		panic(fmt.Sprintf("kernel.SiLUMul: len(dst) = %d, len(gate) = %d, len(up) = %d", len(dst), len(gate), len(up)))
	}
	defaultImpl.siluMul(dst, gate[:len(dst)], up[:len(dst)])
}

// Softmax replaces x by softmax(x) in place: x[i] = e^(x[i]-max) / Σ_j e^(x[j]-max), the sum in a
// fixed order for a given length. -Inf entries become 0; if every entry is -Inf (or x is
// empty) x is set to zeros.
func Softmax(x []float32) {
	softmax(defaultImpl, x)
}

func softmax(im *impl, x []float32) {
	if len(x) == 0 {
		return
	}
	m := im.max(x)
	if math.IsInf(float64(m), -1) {
		clear(x)
		return
	}
	s := im.expShift(x, m)
	im.scale(1/s, x)
}

// RMSNorm computes dst = x / sqrt(mean(x²) + eps) · weight, row by row: x (and dst) hold
// len(x)/len(weight) rows of len(weight) values, each normalised on its own. The sum of
// squares of a row uses [Dot]'s fixed order. dst may alias x. It panics if len(x) is not a
// multiple of len(weight) or dst is shorter than x.
func RMSNorm(dst, x, weight []float32, eps float32) {
	rmsNorm(defaultImpl, dst, x, weight, eps)
}

func rmsNorm(im *impl, dst, x, weight []float32, eps float32) {
	n := len(weight)
	if n == 0 || len(x)%n != 0 || len(dst) < len(x) {
		panic(fmt.Sprintf("kernel.RMSNorm: len(x) = %d, len(weight) = %d, len(dst) = %d", len(x), n, len(dst)))
	}
	scale := im.normScale
	if scale == nil {
		scale = normScaleGeneric
	}
	for r := 0; r < len(x); r += n {
		xr, dr := x[r:r+n], dst[r:r+n]
		ss := im.dot(xr, xr)
		inv := float32(1 / math.Sqrt(float64(ss/float32(n)+eps)))
		scale(dr, xr, weight, inv)
	}
}

// normScaleGeneric is RMSNorm's scaling of one row: dst[i] = (x[i]·inv)·w[i], each product
// rounded.
func normScaleGeneric(dst, x, w []float32, inv float32) {
	w = w[:len(x)]
	for i, v := range x {
		dst[i] = float32(v*inv) * w[i]
	}
}

// Rope rotates the halves of x (len 2·len(cos)) by the angles whose cosines and sines are cos
// and sin (Hugging Face's "rotate_half"): with a = x[i], b = x[i+half],
//
//	x[i] = a·cos[i] − b·sin[i],  x[i+half] = b·cos[i] + a·sin[i]
//
// each product and sum rounded to float32 on its own (never fused). It panics if x is not twice
// as long as cos or sin is shorter than cos.
func Rope(x, cos, sin []float32) {
	half := len(cos)
	if len(x) != 2*half || len(sin) < half {
		panic(fmt.Sprintf("kernel.Rope: len(x) = %d, len(cos) = %d, len(sin) = %d", len(x), half, len(sin)))
	}
	rope(defaultImpl, x[:half], x[half:], cos, sin[:half])
}

func rope(im *impl, x1, x2, cos, sin []float32) {
	if im.rope != nil {
		im.rope(x1, x2, cos, sin)
		return
	}
	ropeGeneric(x1, x2, cos, sin)
}

func ropeGeneric(x1, x2, cos, sin []float32) {
	x2, sin = x2[:len(x1)], sin[:len(x1)]
	for i, c := range cos[:len(x1)] {
		a, b := x1[i], x2[i]
		x1[i] = float32(a*c) - float32(b*sin[i])
		x2[i] = float32(b*c) + float32(a*sin[i])
	}
}

// NarrowBF16 rounds src to bfloat16 into dst (len ≥ len(src)) exactly as F32ToBF16 rounds each
// value, with vector instructions where the CPU has them.
func NarrowBF16(dst []uint16, src []float32) {
	if len(dst) < len(src) {
		panic(fmt.Sprintf("kernel.NarrowBF16: len(dst) = %d < len(src) = %d", len(dst), len(src)))
	}
	narrowBF16(defaultImpl, dst[:len(src)], src)
}

func narrowBF16(im *impl, dst []uint16, src []float32) {
	if im.narrowBF16 != nil {
		im.narrowBF16(dst, src)
		return
	}
	for i, v := range src {
		dst[i] = F32ToBF16(v)
	}
}
