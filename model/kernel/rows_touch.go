package kernel

import "fmt"

// RowDotsTouching is [RowDots] — the same results, bit for bit — that also reads every cache
// line of ahead and of aheadV (nil, or at least as long as ahead: the lines at ahead's offsets),
// the rows a caller computes on next: decode attention passes the next stretch's keys (and
// values). Where the kernel can (AVX-512), it spreads those reads through its own work in
// address order, one line ahead (and one of aheadV) per key line it loads, so that the next
// stretch streams in while this one is computed — instead of a separate [Touch] pass that stalls
// on the memory before any compute starts. What its loads do not cover it reads at the end, as
// it does everywhere else (in the portable build Touch reads nothing). It panics as RowDots does,
// or if aheadV is shorter than ahead but not empty.
func RowDotsTouching(dst []float32, ldd int, q []float32, ldq, rows int, k []float32, ldk, n, dim int, ahead, aheadV []float32) {
	if checkRowDots("RowDotsTouching", dst, ldd, q, ldq, rows, len(k), ldk, n, dim) {
		checkAhead("RowDotsTouching", len(ahead), len(aheadV))
		rowDotsTouching(dst, ldd, q, ldq, rows, k, ldk, n, dim, ahead, aheadV)
	}
}

// RowDotsBF16Touching is [RowDotsBF16] (bfloat16 keys, ahead and aheadV) that reads ahead as
// [RowDotsTouching] does: the same results, bit for bit, as RowDotsBF16.
func RowDotsBF16Touching(dst []float32, ldd int, q []float32, ldq, rows int, k []uint16, ldk, n, dim int, ahead, aheadV []uint16) {
	if checkRowDots("RowDotsBF16Touching", dst, ldd, q, ldq, rows, len(k), ldk, n, dim) {
		checkAhead("RowDotsBF16Touching", len(ahead), len(aheadV))
		rowDotsBF16Touching(dst, ldd, q, ldq, rows, k, ldk, n, dim, ahead, aheadV)
	}
}

// checkAhead panics unless the rows read ahead by op fit: aheadV empty or as long as ahead.
func checkAhead(op string, na, nv int) {
	if nv > 0 && nv < na {
		panic(fmt.Sprintf("kernel.%s: len(aheadV)=%d < len(ahead)=%d", op, nv, na))
	}
}

// touchRest reads, with Touch, the lines of ahead (and aheadV) from element i on.
func touchRest[T float32 | uint16](ahead, aheadV []T, i int) {
	if i < len(ahead) {
		Touch(ahead[i:])
		if len(aheadV) > 0 {
			Touch(aheadV[i:len(ahead)])
		}
	}
}
