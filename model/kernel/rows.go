package kernel

import (
	"fmt"
	"unsafe"
)

// RowKernels reports whether [RowDots] and [AccumulateRows] (and [RowDotsBF16] and
// [AccumulateRowsBF16]) are available for vectors of dim
// floats in this process's implementation (AVX-512 for dim a multiple of 16, and the portable
// build; not AVX2). Callers without them pack the rows into a [Linear] instead.
func RowKernels(dim int) bool {
	return dim > 0 && defaultImpl.rowDim > 0 && dim%defaultImpl.rowDim == 0
}

// RowDots computes the dot product of each of rows query rows q[r*ldq : r*ldq+dim] with each of n
// key rows k[j*ldk : j*ldk+dim], read in place at a stride (attention keys in a paged KV store):
//
//	dst[r*ldd+j] = Σ_d q[r][d]·k[j][d]   (r < rows, j < n)
//
// Each element is computed exactly — bit for bit — as a Linear packed with [Linear.SetRows] from
// the key rows (outputs = keys) and applied to the query rows computes it: one FMA chain over d
// ascending from zero. Other elements of dst are not written. It panics if [RowKernels](dim) is
// false or a slice is too short.
func RowDots(dst []float32, ldd int, q []float32, ldq, rows int, k []float32, ldk, n, dim int) {
	if checkRowDots("RowDots", dst, ldd, q, ldq, rows, len(k), ldk, n, dim) {
		defaultImpl.rowDots(dst, ldd, q, ldq, rows, k, ldk, n, dim)
	}
}

// AccumulateRows adds to each of rows accumulator rows acc[r*ldacc : r*ldacc+dim] the weighted
// sum of n value rows v[j*ldv : j*ldv+dim] read in place at a stride, with the weights
// p[r*ldp : r*ldp+n]:
//
//	acc[r][d] = acc[r][d] + Σ_j p[r][j]·v[j][d]   (one FMA per j, j ascending)
//
// continuing each element's chain from its current value. So a chain split over several calls
// (value rows spread over several blocks of a paged KV store) and started from zeros computes
// exactly — bit for bit — what a Linear packed with [Linear.SetColumns] from all the value rows
// (inputs = value rows) applied to the weight rows computes. It panics if [RowKernels](dim) is
// false or a slice is too short.
func AccumulateRows(acc []float32, ldacc int, p []float32, ldp, rows int, v []float32, ldv, n, dim int) {
	if checkAccRows("AccumulateRows", acc, ldacc, p, ldp, rows, len(v), ldv, n, dim) {
		defaultImpl.accRows(acc, ldacc, p, ldp, rows, v, ldv, n, dim)
	}
}

// checkRowDots reports whether a RowDots call (op) has work, and panics if its arguments do not
// fit (nk is the length of its keys).
func checkRowDots(op string, dst []float32, ldd int, q []float32, ldq, rows, nk, ldk, n, dim int) bool {
	if rows <= 0 || n <= 0 {
		return false
	}
	if !RowKernels(dim) || ldq < dim || ldk < dim || ldd < n || len(q) < (rows-1)*ldq+dim ||
		nk < (n-1)*ldk+dim || len(dst) < (rows-1)*ldd+n {
		panic(fmt.Sprintf("kernel.%s: rows=%d, n=%d, dim=%d, ldq=%d, ldk=%d, ldd=%d, len(q)=%d, len(k)=%d, len(dst)=%d (implementation %s)",
			op, rows, n, dim, ldq, ldk, ldd, len(q), nk, len(dst), defaultImpl.name))
	}
	return true
}

// checkAccRows reports whether an AccumulateRows call (op) has work, and panics if its
// arguments do not fit (nv is the length of its values).
func checkAccRows(op string, acc []float32, ldacc int, p []float32, ldp, rows, nv, ldv, n, dim int) bool {
	if rows <= 0 || n <= 0 {
		return false
	}
	if !RowKernels(dim) || ldacc < dim || ldv < dim || ldp < n || len(acc) < (rows-1)*ldacc+dim ||
		nv < (n-1)*ldv+dim || len(p) < (rows-1)*ldp+n {
		panic(fmt.Sprintf("kernel.%s: rows=%d, n=%d, dim=%d, ldacc=%d, ldv=%d, ldp=%d, len(acc)=%d, len(v)=%d, len(p)=%d (implementation %s)",
			op, rows, n, dim, ldacc, ldv, ldp, len(acc), nv, len(p), defaultImpl.name))
	}
	return true
}

// RowDotsBF16 is [RowDots] for keys stored as bfloat16 (the values' bits): each key element is
// widened to float32 — exactly — as it is read, so the results are bit-identical to RowDots on
// the widened keys. It panics if [RowKernels](dim) is false or a slice is too short.
func RowDotsBF16(dst []float32, ldd int, q []float32, ldq, rows int, k []uint16, ldk, n, dim int) {
	if checkRowDots("RowDotsBF16", dst, ldd, q, ldq, rows, len(k), ldk, n, dim) {
		defaultImpl.rowDotsBF16(dst, ldd, q, ldq, rows, k, ldk, n, dim)
	}
}

// AccumulateRowsBF16 is [AccumulateRows] for value rows stored as bfloat16 (the values' bits):
// each value element is widened to float32 — exactly — as it is read, so the results are
// bit-identical to AccumulateRows on the widened values. It panics if [RowKernels](dim) is false
// or a slice is too short.
func AccumulateRowsBF16(acc []float32, ldacc int, p []float32, ldp, rows int, v []uint16, ldv, n, dim int) {
	if checkAccRows("AccumulateRowsBF16", acc, ldacc, p, ldp, rows, len(v), ldv, n, dim) {
		defaultImpl.accRowsBF16(acc, ldacc, p, ldp, rows, v, ldv, n, dim)
	}
}

// RowDotsSet computes [RowDots] for each of len(k) sets of operands that share rows, n, dim and
// the strides: the scores of query rows q[i] against key rows k[i] into dst[i]. Each element is
// computed exactly — bit for bit — as RowDots computes it; the AVX-512 kernels take several
// sets' keys a call, so that a few query rows (decode's) keep more independent chains in
// flight. dst, q and k must have the same length. It panics where RowDots would for a set.
func RowDotsSet(dst [][]float32, ldd int, q [][]float32, ldq, rows int, k [][]float32, ldk, n, dim int) {
	rowDotsSet("RowDotsSet", defaultImpl.rowDotsSet, defaultImpl.rowDots, dst, ldd, q, ldq, rows, k, ldk, n, dim)
}

// RowDotsBF16Set is [RowDotsSet] for keys stored as bfloat16, each set's scores bit-identical to
// [RowDotsBF16]'s.
func RowDotsBF16Set(dst [][]float32, ldd int, q [][]float32, ldq, rows int, k [][]uint16, ldk, n, dim int) {
	rowDotsSet("RowDotsBF16Set", defaultImpl.rowDotsBF16Set, defaultImpl.rowDotsBF16, dst, ldd, q, ldq, rows, k, ldk, n, dim)
}

// rowDotsSet checks the arguments of a set call (op), panicking if dst, q and k differ in length
// or a set's would make RowDots panic, and runs it: with set, or, where the implementation has
// none (nil), one call of one a set.
func rowDotsSet[T float32 | uint16](op string,
	set func(dst [][]float32, ldd int, q [][]float32, ldq, rows int, k [][]T, ldk, n, dim int),
	one func(dst []float32, ldd int, q []float32, ldq, rows int, k []T, ldk, n, dim int),
	dst [][]float32, ldd int, q [][]float32, ldq, rows int, k [][]T, ldk, n, dim int) {
	if len(dst) != len(k) || len(q) != len(k) {
		panic(fmt.Sprintf("kernel.%s: %d score sets, %d query sets, %d key sets", op, len(dst), len(q), len(k)))
	}
	if len(k) == 0 {
		return
	}
	for i := range k {
		if !checkRowDots(op, dst[i], ldd, q[i], ldq, rows, len(k[i]), ldk, n, dim) {
			return // no rows or no keys: no set has work
		}
	}
	if set != nil {
		set(dst, ldd, q, ldq, rows, k, ldk, n, dim)
		return
	}
	for i := range k {
		one(dst[i], ldd, q[i], ldq, rows, k[i], ldk, n, dim)
	}
}

// Touch reads every cache line of x in order, discarding what it reads, so that x is in the
// caches when the row kernels read it in another order (attention's next keys or values, float32
// or bfloat16 bits). Demand loads in address order let the hardware prefetchers run ahead of
// them, which streams from memory faster than a burst of prefetches, whose requests wait for
// free miss buffers and stall the work behind them. It changes no data and no result; in the
// portable build it does nothing.
func Touch[T float32 | uint16 | uint8](x []T) {
	if defaultImpl.touch != nil && len(x) > 0 {
		defaultImpl.touch(unsafe.Pointer(unsafe.SliceData(x)), len(x)*int(unsafe.Sizeof(x[0])))
	}
}
