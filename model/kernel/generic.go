package kernel

import "math"

// genericImpl is the portable pure-Go implementation. Multiplications are explicitly rounded
// (float32(a*b)) so the compiler never fuses them into FMAs: the result is the same on every
// architecture.
var genericImpl = &impl{
	name:     "go",
	mr:       4,
	tile:     tileGeneric,
	dot:      dotGeneric,
	axpy:     axpyGeneric,
	scale:    scaleGeneric,
	add:      addGeneric,
	siluMul:  siluMulGeneric,
	expShift: expShiftGeneric,
	max:      maxGeneric,
	fmaLoop:  fmaLoopGeneric,
	readSum:  readSumGeneric,
	rowDots:  rowDotsGeneric,
	accRows:  accRowsGeneric,
	rowDim:   1,

	rowDotsBF16: rowDotsBF16Generic,
	accRowsBF16: accRowsBF16Generic,
}

func tileGeneric(c []float32, ldc int, a []float32, lda int, w []float32, k, mr, ncols int) {
	w = w[:k*panelWidth]
	for m := range mr {
		var acc [panelWidth]float32
		for kk, av := range a[m*lda : m*lda+k] {
			wk := (*[panelWidth]float32)(w[kk*panelWidth:])
			for j := range acc {
				acc[j] = acc[j] + float32(av*wk[j])
			}
		}
		copy(c[m*ldc:m*ldc+ncols], acc[:ncols])
	}
}

// dotGeneric sums in 8 interleaved partial sums (element i goes to sum i%8, tail elements in
// order), combined as ((s0+s4)+(s2+s6))+((s1+s5)+(s3+s7)).
func dotGeneric(a, b []float32) float32 {
	b = b[:len(a)]
	var s [8]float32
	i := 0
	for ; i+8 <= len(a); i += 8 {
		for j := range s {
			s[j] = s[j] + float32(a[i+j]*b[i+j])
		}
	}
	for j := 0; i < len(a); i, j = i+1, j+1 {
		s[j] = s[j] + float32(a[i]*b[i])
	}
	return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
}

func axpyGeneric(alpha float32, x, y []float32) {
	y = y[:len(x)]
	for i, v := range x {
		y[i] = y[i] + float32(alpha*v)
	}
}

func scaleGeneric(alpha float32, x []float32) {
	for i := range x {
		x[i] *= alpha
	}
}

func addGeneric(dst, a, b []float32) {
	a, b = a[:len(dst)], b[:len(dst)]
	for i := range dst {
		dst[i] = a[i] + b[i]
	}
}

func siluMulGeneric(dst, gate, up []float32) {
	gate, up = gate[:len(dst)], up[:len(dst)]
	for i, g := range gate {
		s := g / (1 + float32(math.Exp(float64(-g))))
		dst[i] = float32(s * up[i])
	}
}

func expShiftGeneric(x []float32, shift float32) float32 {
	var s [8]float32
	for i, v := range x {
		e := float32(math.Exp(float64(v - shift)))
		x[i] = e
		s[i%8] += e
	}
	return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
}

func maxGeneric(x []float32) float32 {
	m := float32(math.Inf(-1))
	for _, v := range x {
		if v > m {
			m = v
		}
	}
	return m
}

// rowDotsGeneric is tileGeneric's chain for each (query row, key) pair.
func rowDotsGeneric(dst []float32, ldd int, q []float32, ldq, rows int, k []float32, ldk, n, dim int) {
	rowDotsPortable(dst, ldd, q, ldq, rows, k, ldk, n, dim, func(x float32) float32 { return x })
}

// accRowsGeneric continues tileGeneric's chains from the values in acc.
func accRowsGeneric(acc []float32, ldacc int, p []float32, ldp, rows int, v []float32, ldv, n, dim int) {
	accRowsPortable(acc, ldacc, p, ldp, rows, v, ldv, n, dim, func(x float32) float32 { return x })
}

// rowDotsBF16Generic is rowDotsGeneric with each key element widened from bfloat16.
func rowDotsBF16Generic(dst []float32, ldd int, q []float32, ldq, rows int, k []uint16, ldk, n, dim int) {
	rowDotsPortable(dst, ldd, q, ldq, rows, k, ldk, n, dim, BF16ToF32)
}

// accRowsBF16Generic is accRowsGeneric with each value element widened from bfloat16.
func accRowsBF16Generic(acc []float32, ldacc int, p []float32, ldp, rows int, v []uint16, ldv, n, dim int) {
	accRowsPortable(acc, ldacc, p, ldp, rows, v, ldv, n, dim, BF16ToF32)
}

// rowDotsPortable is tileGeneric's chain for each (query row, key) pair, each key element
// widened to float32 by widen (exactly).
func rowDotsPortable[T float32 | uint16](dst []float32, ldd int, q []float32, ldq, rows int, k []T, ldk, n, dim int, widen func(T) float32) {
	for r := range rows {
		qr := q[r*ldq : r*ldq+dim]
		for j := range n {
			kj := k[j*ldk : j*ldk+dim]
			var acc float32
			for d, x := range qr {
				acc = acc + float32(x*widen(kj[d]))
			}
			dst[r*ldd+j] = acc
		}
	}
}

// accRowsPortable continues tileGeneric's chains from the values in acc, each value element
// widened to float32 by widen (exactly).
func accRowsPortable[T float32 | uint16](acc []float32, ldacc int, p []float32, ldp, rows int, v []T, ldv, n, dim int, widen func(T) float32) {
	for r := range rows {
		ar := acc[r*ldacc : r*ldacc+dim]
		for j, pj := range p[r*ldp : r*ldp+n] {
			vj := v[j*ldv : j*ldv+dim]
			for d := range ar {
				ar[d] = ar[d] + float32(pj*widen(vj[d]))
			}
		}
	}
}
