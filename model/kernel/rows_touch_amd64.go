//go:build amd64 && !purego

package kernel

import "unsafe"

//go:noescape
func rowDots512t(dst *float32, ldd int, q *float32, ldq int, rows int, k *float32, ldk int, nk int, dim int, tmp *float32, ahead uintptr, dv int, last uintptr)

//go:noescape
func rowDotsBF16pt512(dst *float32, ldd int, q *float32, ldq int, rows int, k *uint16, ldk int, nk int, dim int, tmp *float32, ahead uintptr, dv int, last uintptr)

// aheadSpan returns the arguments of the touching kernels for the rows ahead and aheadV of esz
// bytes an element: the first byte of ahead, aheadV's distance from it (0 without aheadV) and
// ahead's last byte.
func aheadSpan(ahead, aheadV unsafe.Pointer, n, nv, esz int) (start uintptr, dv int, last uintptr) {
	start = uintptr(ahead)
	if nv > 0 {
		dv = int(uintptr(aheadV) - start)
	}
	return start, dv, start + uintptr(n*esz-1)
}

// rowDotsTouching is RowDotsTouching after its checks: rowDotsAVX512 with rowDots512t, whose
// key groups read dim lines ahead each (16 rows of dim floats), then Touch for the rest.
func rowDotsTouching(dst []float32, ldd int, q []float32, ldq, rows int, k []float32, ldk, n, dim int, ahead, aheadV []float32) {
	if defaultImpl.rowDim != 16 || len(ahead) == 0 {
		defaultImpl.rowDots(dst, ldd, q, ldq, rows, k, ldk, n, dim)
		touchRest(ahead, aheadV, 0)
		return
	}
	start, dv, last := aheadSpan(unsafe.Pointer(&ahead[0]), unsafe.Pointer(unsafe.SliceData(aheadV)), len(ahead), len(aheadV), 4)
	var tmp [rowDotsRows * 16]float32
	done := 0 // elements of ahead the kernels read
	for r0 := 0; r0 < rows; r0 += rowDotsRows {
		nr := min(rowDotsRows, rows-r0)
		for j := 0; j < n; j += 16 {
			p := start + uintptr(min(done, len(ahead)-1)*4)
			rowDots512t(&dst[r0*ldd+j], ldd, &q[r0*ldq], ldq, nr, &k[j*ldk], ldk, min(16, n-j), dim, &tmp[0], p, dv, last)
			done += 16 * dim
		}
	}
	touchRest(ahead, aheadV, done)
}

// rowDotsBF16Touching is RowDotsBF16Touching after its checks: rowDotsBF16AVX512 with
// rowDotsBF16pt512 (dim a multiple of 32), whose key groups read dim/2 lines ahead each (16 rows
// of dim bfloat16 values), then Touch for the rest.
func rowDotsBF16Touching(dst []float32, ldd int, q []float32, ldq, rows int, k []uint16, ldk, n, dim int, ahead, aheadV []uint16) {
	if defaultImpl.rowDim != 16 || dim%32 != 0 || len(ahead) == 0 {
		defaultImpl.rowDotsBF16(dst, ldd, q, ldq, rows, k, ldk, n, dim)
		touchRest(ahead, aheadV, 0)
		return
	}
	start, dv, last := aheadSpan(unsafe.Pointer(&ahead[0]), unsafe.Pointer(unsafe.SliceData(aheadV)), len(ahead), len(aheadV), 2)
	var tmp [rowDotsRows * 16]float32
	done := 0
	for r0 := 0; r0 < rows; r0 += rowDotsRows {
		nr := min(rowDotsRows, rows-r0)
		for j := 0; j < n; j += 16 {
			p := start + uintptr(min(done, len(ahead)-1)*2)
			rowDotsBF16pt512(&dst[r0*ldd+j], ldd, &q[r0*ldq], ldq, nr, &k[j*ldk], ldk, min(16, n-j), dim, &tmp[0], p, dv, last)
			done += 16 * dim
		}
	}
	touchRest(ahead, aheadV, done)
}
