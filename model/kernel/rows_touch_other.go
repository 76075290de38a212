//go:build !amd64 || purego

package kernel

// rowDotsTouching is RowDotsTouching after its checks: RowDots, then the rows ahead.
func rowDotsTouching(dst []float32, ldd int, q []float32, ldq, rows int, k []float32, ldk, n, dim int, ahead, aheadV []float32) {
	defaultImpl.rowDots(dst, ldd, q, ldq, rows, k, ldk, n, dim)
	touchRest(ahead, aheadV, 0)
}

// rowDotsBF16Touching is RowDotsBF16Touching after its checks: RowDotsBF16, then the rows
// ahead.
func rowDotsBF16Touching(dst []float32, ldd int, q []float32, ldq, rows int, k []uint16, ldk, n, dim int, ahead, aheadV []uint16) {
	defaultImpl.rowDotsBF16(dst, ldd, q, ldq, rows, k, ldk, n, dim)
	touchRest(ahead, aheadV, 0)
}
