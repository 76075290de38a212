//go:build amd64 && !purego

package kernel

import "math"

// Assembly vector kernels (kernel_amd64.s). The *512 ones handle any n (masked tails); the *256
// ones take n a multiple of 8 and their Go wrappers finish the tail.

func dot512(a, b *float32, n int) float32
func axpy512(alpha float32, x, y *float32, n int)
func scale512(alpha float32, x *float32, n int)
func add512(dst, a, b *float32, n int)
func normScale512(dst, x, w *float32, inv float32, n int)
func rope512(x1, x2, c, s *float32, n int)
func narrowBF16x512(dst *uint16, src *float32, n int)
func siluMul512(dst, gate, up *float32, n int)
func expShift512(x *float32, n int, shift float32) float32
func max512(x *float32, n int) float32
func fmaLoop512(n int)
func fmaLoop256(n int)
func readSum256(x *float32, n int) float32
func readSum512(x *float32, n int) float32
func dot256(a, b *float32, n int) float32
func axpy256(alpha float32, x, y *float32, n int)
func siluMul256(dst, gate, up *float32, n int)
func expShift256(x *float32, n int, shift float32) float32
func transpose512(dst *float32, ldd int, rows *[16]*float32, blocks int)
func transpose256(dst *float32, ldd int, rows *[16]*float32, blocks int)

func dotAVX512(a, b []float32) float32 {
	if len(a) == 0 {
		return 0
	}
	b = b[:len(a)]
	return dot512(&a[0], &b[0], len(a))
}

func axpyAVX512(alpha float32, x, y []float32) {
	if len(x) == 0 {
		return
	}
	y = y[:len(x)]
	axpy512(alpha, &x[0], &y[0], len(x))
}

func scaleAVX512(alpha float32, x []float32) {
	if len(x) == 0 {
		return
	}
	scale512(alpha, &x[0], len(x))
}

func addAVX512(dst, a, b []float32) {
	if len(dst) == 0 {
		return
	}
	a, b = a[:len(dst)], b[:len(dst)]
	add512(&dst[0], &a[0], &b[0], len(dst))
}

func normScaleAVX512(dst, x, w []float32, inv float32) {
	if len(x) == 0 {
		return
	}
	dst, w = dst[:len(x)], w[:len(x)]
	normScale512(&dst[0], &x[0], &w[0], inv, len(x))
}

func ropeAVX512(x1, x2, cos, sin []float32) {
	if len(x1) == 0 {
		return
	}
	x2, cos, sin = x2[:len(x1)], cos[:len(x1)], sin[:len(x1)]
	rope512(&x1[0], &x2[0], &cos[0], &sin[0], len(x1))
}

func narrowBF16AVX512(dst []uint16, src []float32) {
	if len(src) == 0 {
		return
	}
	dst = dst[:len(src)]
	narrowBF16x512(&dst[0], &src[0], len(src))
}

func siluMulAVX512(dst, gate, up []float32) {
	if len(dst) == 0 {
		return
	}
	gate, up = gate[:len(dst)], up[:len(dst)]
	siluMul512(&dst[0], &gate[0], &up[0], len(dst))
}

func expShiftAVX512(x []float32, shift float32) float32 {
	if len(x) == 0 {
		return 0
	}
	return expShift512(&x[0], len(x), shift)
}

func maxAVX512(x []float32) float32 {
	if len(x) == 0 {
		return maxGeneric(x)
	}
	return max512(&x[0], len(x))
}

func fmaLoopAVX512(n int) float64 {
	fmaLoop512(n)
	return 24 * 16 * 2
}

func fmaLoopAVX2(n int) float64 {
	fmaLoop256(n)
	return 12 * 8 * 2
}

func readSumAVX512(x []float32) float32 {
	n := len(x) &^ 127
	if n == 0 {
		return readSumGeneric(x)
	}
	return readSum512(&x[0], n) + readSumGeneric(x[n:])
}

func readSumAVX(x []float32) float32 {
	n := len(x) &^ 31
	if n == 0 {
		return readSumGeneric(x)
	}
	return readSum256(&x[0], n) + readSumGeneric(x[n:])
}

// dotAVX2: the body in 8-lane chunks, then the len%8 tail zero-padded to one more chunk whose
// product vector is reduced separately and added last (a fixed order for a given length).
func dotAVX2(a, b []float32) float32 {
	b = b[:len(a)]
	n := len(a) &^ 7
	var s float32
	if n > 0 {
		s = dot256(&a[0], &b[0], n)
	}
	if n < len(a) {
		var ta, tb [8]float32
		copy(ta[:], a[n:])
		copy(tb[:], b[n:])
		s += dot256(&ta[0], &tb[0], 8)
	}
	return s
}

// axpyAVX2: the tail runs the same FMA on a zero-padded copy.
func axpyAVX2(alpha float32, x, y []float32) {
	y = y[:len(x)]
	n := len(x) &^ 7
	if n > 0 {
		axpy256(alpha, &x[0], &y[0], n)
	}
	if n < len(x) {
		var tx, ty [8]float32
		copy(tx[:], x[n:])
		copy(ty[:], y[n:])
		axpy256(alpha, &tx[0], &ty[0], 8)
		copy(y[n:], ty[:])
	}
}

// siluMulAVX2: the tail runs the same kernel on a zero-padded copy.
func siluMulAVX2(dst, gate, up []float32) {
	gate, up = gate[:len(dst)], up[:len(dst)]
	n := len(dst) &^ 7
	if n > 0 {
		siluMul256(&dst[0], &gate[0], &up[0], n)
	}
	if n < len(dst) {
		var td, tg, tu [8]float32
		copy(tg[:], gate[n:])
		copy(tu[:], up[n:])
		siluMul256(&td[0], &tg[0], &tu[0], 8)
		copy(dst[n:], td[:])
	}
}

// expShiftAVX2: the tail runs the same kernel on a copy padded with -Inf (whose exponentials
// are exactly 0); the tail's sum is added last.
func expShiftAVX2(x []float32, shift float32) float32 {
	n := len(x) &^ 7
	var s float32
	if n > 0 {
		s = expShift256(&x[0], n, shift)
	}
	if n < len(x) {
		var t [8]float32
		for i := range t {
			t[i] = float32(math.Inf(-1))
		}
		copy(t[:], x[n:])
		s += expShift256(&t[0], 8, shift)
		copy(x[n:], t[:])
	}
	return s
}
