package kernel

import "fmt"

// RowKernels reports whether [RowDots] and [AccumulateRows] are available for vectors of dim
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
	if rows <= 0 || n <= 0 {
		return
	}
	if !RowKernels(dim) || ldq < dim || ldk < dim || ldd < n || len(q) < (rows-1)*ldq+dim ||
		len(k) < (n-1)*ldk+dim || len(dst) < (rows-1)*ldd+n {
		panic(fmt.Sprintf("kernel.RowDots: rows=%d, n=%d, dim=%d, ldq=%d, ldk=%d, ldd=%d, len(q)=%d, len(k)=%d, len(dst)=%d (implementation %s)",
			rows, n, dim, ldq, ldk, ldd, len(q), len(k), len(dst), defaultImpl.name))
	}
	defaultImpl.rowDots(dst, ldd, q, ldq, rows, k, ldk, n, dim)
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
	if rows <= 0 || n <= 0 {
		return
	}
	if !RowKernels(dim) || ldacc < dim || ldv < dim || ldp < n || len(acc) < (rows-1)*ldacc+dim ||
		len(v) < (n-1)*ldv+dim || len(p) < (rows-1)*ldp+n {
		panic(fmt.Sprintf("kernel.AccumulateRows: rows=%d, n=%d, dim=%d, ldacc=%d, ldv=%d, ldp=%d, len(acc)=%d, len(v)=%d, len(p)=%d (implementation %s)",
			rows, n, dim, ldacc, ldv, ldp, len(acc), len(v), len(p), defaultImpl.name))
	}
	defaultImpl.accRows(acc, ldacc, p, ldp, rows, v, ldv, n, dim)
}

// Prefetch hints that x is about to be read (attention's next block of keys or values), so its
// cache lines start loading while the current ones are worked on. It changes no data and no
// result; in the portable build it does nothing.
func Prefetch(x []float32) {
	if defaultImpl.prefetch != nil {
		defaultImpl.prefetch(x)
	}
}
