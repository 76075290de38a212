//go:build amd64 && !purego

package kernel

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

//go:generate go run asmgen.go

// avx512Impl uses zmm registers: 6×64 Linear tiles (24 accumulators), masked vector tails.
var avx512Impl = &impl{
	name:         "avx512",
	mr:           6,
	tile:         tileAVX512,
	tile16:       tile16AVX512,
	tileBF16Wide: tileBF16WideAVX512,
	widenBF16:    widenBF16AVX512,
	dot:          dotAVX512,
	axpy:         axpyAVX512,
	scale:        scaleAVX512,
	add:          addAVX512,
	siluMul:      siluMulAVX512,

	normScale:  normScaleAVX512,
	rope:       ropeAVX512,
	narrowBF16: narrowBF16AVX512,

	expShift:  expShiftAVX512,
	max:       maxAVX512,
	fmaLoop:   fmaLoopAVX512,
	transpose: transpose512,
	tgroup:    16,
	readSum:   readSumAVX512,
	rowDots:   rowDotsAVX512,
	accRows:   accRowsWith(&tileAcc512Kernels),
	rowDim:    16,
	touch:     touchLines,

	rowDotsBF16: rowDotsBF16AVX512,
	accRowsBF16: accRowsWith(&tileAccBF16x512Kernels),

	rowDotsSet:     rowDotsSetAVX512,
	rowDotsBF16Set: rowDotsBF16SetAVX512,
}

// avx2Impl uses ymm registers: 6×16 Linear tiles (12 accumulators), four per panel. Scale, Add
// and the maximum use the portable Go loops.
var avx2Impl = &impl{
	name:      "avx2",
	mr:        6,
	tile:      tileAVX2,
	dot:       dotAVX2,
	axpy:      axpyAVX2,
	scale:     scaleGeneric,
	add:       addGeneric,
	siluMul:   siluMulAVX2,
	expShift:  expShiftAVX2,
	max:       maxGeneric,
	fmaLoop:   fmaLoopAVX2,
	transpose: transpose256,
	tgroup:    8,
	readSum:   readSumAVX,
	touch:     touchLines,
}

// avx512BF16Impl is avx512Impl with AVX512_BF16's bfloat16 products (VDPBF16PS).
var avx512BF16Impl = func() *impl {
	im := *avx512Impl
	im.tileDot, im.toPairs, im.dpLoop = tileDotAVX512, toPairsAVX512, dpLoopAVX512
	im.tileDotWide, im.tileDotHalf, im.halfRows = tileDotWideAVX512, tileDotHalfAVX512, maxHalfRows
	im.tileDotTall, im.tallRows = tileDotTallAVX512, tallRows
	return &im
}()

func hasAVX512() bool { return cpu.X86.HasAVX512F && cpu.X86.HasAVX2 && cpu.X86.HasFMA }

// hasBF16 reports AVX512_BF16 (and AVX512BW, which the conversion's word-masked store needs).
func hasBF16() bool { return hasAVX512() && cpu.X86.HasAVX512BF16 && cpu.X86.HasAVX512BW }
func hasAVX2() bool { return cpu.X86.HasAVX2 && cpu.X86.HasFMA }

func selectImpl() *impl {
	switch {
	case hasBF16():
		return avx512BF16Impl
	case hasAVX512():
		return avx512Impl
	case hasAVX2():
		return avx2Impl
	}
	return genericImpl
}

// candidateImpls lists every implementation usable on this machine (for tests).
func candidateImpls() []*impl {
	c := []*impl{genericImpl}
	if hasAVX2() {
		c = append(c, avx2Impl)
	}
	if hasAVX512() {
		c = append(c, avx512Impl)
	}
	if hasBF16() {
		c = append(c, avx512BF16Impl)
	}
	return c
}

// maxHalfRows is the most rows of a half-panel tile (tileDot512hN).
const maxHalfRows = 12

// tileKernel16 is the signature of the tile kernels that take 16-bit weights, a prefetch share
// and cont: a holds float32 rows, or bfloat16 pairs (A = uint32).
type tileKernel16[A float32 | uint32] func(a *A, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)

// tileDotKernels are the bfloat16-product tile kernels by rows − 1; tileDotHalfKernels the
// half-panel ones.
var (
	tileDotKernels = []tileKernel16[uint32]{
		tileDot512x1, tileDot512x2, tileDot512x3, tileDot512x4, tileDot512x5, tileDot512x6,
	}
	tileDotHalfKernels = []tileKernel16[uint32]{
		tileDot512h1, tileDot512h2, tileDot512h3, tileDot512h4, tileDot512h5, tileDot512h6,
		tileDot512h7, tileDot512h8, tileDot512h9, tileDot512h10, tileDot512h11, tileDot512h12,
	}
)

// tileDotAVX512 checks bounds, then runs the VDPBF16PS kernel for mr rows; columns ≥ ncols are
// masked off at the store. pf (a share of the next panel) is prefetched evenly on the way by
// tiles of two or more rows (prefetchStreams; the one-row kernel leaves its stream to the
// hardware). With cont the chains continue from c.
func tileDotAVX512(c []float32, ldc int, a []uint32, lda int, w []uint16, kp, mr, ncols int, pf []uint16, cont bool) {
	runTile16(tileDotKernels, panelWidth, 2*panelWidth, c, ldc, a, lda, w, kp, kp, mr, ncols, pf, cont)
}

// tileDotHalfAVX512 is tileDotAVX512 over half a panel (w at the half's first pair, ncols ≤ 32)
// for up to 12 rows; every tile prefetches its share of pf.
func tileDotHalfAVX512(c []float32, ldc int, a []uint32, lda int, w []uint16, kp, mr, ncols int, pf []uint16, cont bool) {
	runTile16(tileDotHalfKernels, panelWidth/2, 2*panelWidth, c, ldc, a, lda, w, kp, kp, mr, ncols, pf, cont)
}

// runTile16 checks bounds, then runs kernels[mr-1] for mr rows × width columns (a panel or half
// of one; columns ≥ ncols are masked off at the store) over k (the kernel's count: elements of
// a row of a) in steps steps of stepValues panel values (pairs of k of a BF16 panel, single k
// of an F16 one), prefetching pf evenly over the steps (prefetchStreams). With cont the chains
// continue from c.
func runTile16[A float32 | uint32](kernels []tileKernel16[A], width, stepValues int, c []float32, ldc int, a []A, lda int, w []uint16, k, steps, mr, ncols int, pf []uint16, cont bool) {
	if mr < 1 || mr > len(kernels) || ncols < 1 || ncols > width {
		panic("kernel: bad tile shape")
	}
	_ = a[(mr-1)*lda+k-1]
	_ = w[(steps-1)*stepValues+stepValues*width/panelWidth-1]
	_ = c[(mr-1)*ldc+ncols-1]
	pf, off, step := prefetchStreams(pf, w, steps)
	var cn int
	if cont {
		cn = 1
	}
	kernels[mr-1](&a[0], lda, &w[0], k, &c[0], ldc, ^uint64(0)>>(panelWidth-ncols), &pf[0], off, step, cn)
}

// prefetchStreams returns how a multi-row tile of steps steps of k prefetches pf evenly over its
// steps, a line or two a step (prefetch2): the start, the byte offset of the second stream (0:
// none) and the bytes a stream moves on a step. Without pf (or steps) the tile prefetches the
// first line of its own panel w over and over, which costs next to nothing.
func prefetchStreams(pf, w []uint16, steps int) (start []uint16, off, step int) {
	n := 2 * len(pf) // bytes
	if n == 0 || steps == 0 {
		return w, 0, 0
	}
	step = (n + steps - 1) / steps
	if step <= 64 {
		return pf, 0, step
	}
	// Two streams, each over half of pf (more than 128 bytes a step: the rest is left to the
	// hardware).
	step = min(64, (step+1)/2)
	return pf, n / 2, step
}

// tileDotWideAVX512 checks bounds, then runs the one-row VDPBF16PS kernel over np (2 or 4)
// consecutive whole panels.
func tileDotWideAVX512(c []float32, a []uint32, w []uint16, kp, np int) {
	_ = a[kp-1]
	_ = w[np*kp*2*panelWidth-1]
	_ = c[np*panelWidth-1]
	if np == 4 {
		tileDot512x1p4(&a[0], &w[0], kp, &c[0])
		return
	}
	tileDot512x1p2(&a[0], &w[0], kp, &c[0])
}

// toPairsAVX512 rounds src to bfloat16 pairs with VCVTNE2PS2BF16.
func toPairsAVX512(dst []uint32, src []float32) {
	if len(src) == 0 {
		return
	}
	_ = dst[(len(src)+1)/2-1]
	toBF16Pairs512(&dst[0], &src[0], len(src))
}

// dpLoopAVX512 runs dpLoop512 and returns its FLOPs per iteration.
func dpLoopAVX512(n int) float64 {
	dpLoop512(n)
	return 24 * 16 * 2 * 2
}

func tile512x1(a *float32, lda int, w *float32, k int, c *float32, ldc int, mask uint64)
func tile512x2(a *float32, lda int, w *float32, k int, c *float32, ldc int, mask uint64)
func tile512x3(a *float32, lda int, w *float32, k int, c *float32, ldc int, mask uint64)
func tile512x4(a *float32, lda int, w *float32, k int, c *float32, ldc int, mask uint64)
func tile512x5(a *float32, lda int, w *float32, k int, c *float32, ldc int, mask uint64)
func tile512x6(a *float32, lda int, w *float32, k int, c *float32, ldc int, mask uint64)

func tile512bf16x1(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512bf16x2(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512bf16x3(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512bf16x4(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512bf16x5(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512bf16x6(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512bf16x1p2(a *float32, w *uint16, k int, c *float32)
func tile512bf16x1p4(a *float32, w *uint16, k int, c *float32)

func tile512f16x1(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512f16x2(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512f16x3(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512f16x4(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512f16x5(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tile512f16x6(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)

// tile16Kernels are the 16-bit tile kernels by DType (BF16, F16) and rows − 1.
var tile16Kernels = [2][]tileKernel16[float32]{
	{tile512bf16x1, tile512bf16x2, tile512bf16x3, tile512bf16x4, tile512bf16x5, tile512bf16x6},
	{tile512f16x1, tile512f16x2, tile512f16x3, tile512f16x4, tile512f16x5, tile512f16x6},
}

// tileBF16WideAVX512 checks bounds, then runs the one-row kernel over np (2 or 4) consecutive
// whole BF16 panels.
func tileBF16WideAVX512(c []float32, a []float32, w []uint16, k, np int) {
	_ = a[k-1]
	_ = w[np*((k+1)/2)*2*panelWidth-1]
	_ = c[np*panelWidth-1]
	if np == 4 {
		tile512bf16x1p4(&a[0], &w[0], k, &c[0])
		return
	}
	tile512bf16x1p2(&a[0], &w[0], k, &c[0])
}

// tile16AVX512 is tileAVX512 for BF16 or F16 panels. Tiles of two or more rows prefetch pf
// evenly over their steps of k (a pair of k for BF16, one k for F16; prefetchStreams) on the
// way. With cont the chains continue from c.
func tile16AVX512(dtype DType, c []float32, ldc int, a []float32, lda int, w []uint16, k, mr, ncols int, pf []uint16, cont bool) {
	if dtype == BF16 {
		runTile16(tile16Kernels[0], panelWidth, 2*panelWidth, c, ldc, a, lda, w, k, (k+1)/2, mr, ncols, pf, cont)
		return
	}
	runTile16(tile16Kernels[1], panelWidth, panelWidth, c, ldc, a, lda, w, k, k, mr, ncols, pf, cont)
}

func tileAccBF16x512x1(a *float32, lda int, w *uint16, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAccBF16x512x2(a *float32, lda int, w *uint16, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAccBF16x512x3(a *float32, lda int, w *uint16, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAccBF16x512x4(a *float32, lda int, w *uint16, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAccBF16x512x5(a *float32, lda int, w *uint16, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAccBF16x512x6(a *float32, lda int, w *uint16, ldw int, k int, c *float32, ldc int, mask uint64)

func tileAcc512x1(a *float32, lda int, w *float32, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAcc512x2(a *float32, lda int, w *float32, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAcc512x3(a *float32, lda int, w *float32, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAcc512x4(a *float32, lda int, w *float32, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAcc512x5(a *float32, lda int, w *float32, ldw int, k int, c *float32, ldc int, mask uint64)
func tileAcc512x6(a *float32, lda int, w *float32, ldw int, k int, c *float32, ldc int, mask uint64)

//go:noescape
func touchLines(x unsafe.Pointer, n int)

//go:noescape
func rowDots512(dst *float32, ldd int, q *float32, ldq int, rows int, k *float32, ldk int, nk int, dim int, tmp *float32)

//go:noescape
func rowDotsBF16x512(dst *float32, ldd int, q *float32, ldq int, rows int, k *uint16, ldk int, nk int, dim int, tmp *float32)

//go:noescape
func rowDotsBF16p512(dst *float32, ldd int, q *float32, ldq int, rows int, k *uint16, ldk int, nk int, dim int, tmp *float32)

func tile256x1(a *float32, lda int, w *float32, k int, c *float32, ldc int)
func tile256x2(a *float32, lda int, w *float32, k int, c *float32, ldc int)
func tile256x3(a *float32, lda int, w *float32, k int, c *float32, ldc int)
func tile256x4(a *float32, lda int, w *float32, k int, c *float32, ldc int)
func tile256x5(a *float32, lda int, w *float32, k int, c *float32, ldc int)
func tile256x6(a *float32, lda int, w *float32, k int, c *float32, ldc int)

// tileAVX512 checks bounds, then runs the zmm kernel for mr rows; columns ≥ ncols are masked off
// at the store (they were computed from the zero padding of the panel).
func tileAVX512(c []float32, ldc int, a []float32, lda int, w []float32, k, mr, ncols int) {
	_ = a[(mr-1)*lda+k-1]
	_ = w[k*panelWidth-1]
	_ = c[(mr-1)*ldc+ncols-1]
	mask := ^uint64(0) >> (panelWidth - ncols)
	switch mr {
	case 1:
		tile512x1(&a[0], lda, &w[0], k, &c[0], ldc, mask)
	case 2:
		tile512x2(&a[0], lda, &w[0], k, &c[0], ldc, mask)
	case 3:
		tile512x3(&a[0], lda, &w[0], k, &c[0], ldc, mask)
	case 4:
		tile512x4(&a[0], lda, &w[0], k, &c[0], ldc, mask)
	case 5:
		tile512x5(&a[0], lda, &w[0], k, &c[0], ldc, mask)
	case 6:
		tile512x6(&a[0], lda, &w[0], k, &c[0], ldc, mask)
	default:
		panic("kernel: bad tile height")
	}
}

// tileAVX2 runs the ymm kernel on each 16-column slice of the panel; a partial last slice is
// computed in full into a scratch tile (same arithmetic) and its valid columns copied out.
func tileAVX2(c []float32, ldc int, a []float32, lda int, w []float32, k, mr, ncols int) {
	_ = a[(mr-1)*lda+k-1]
	_ = w[k*panelWidth-1]
	_ = c[(mr-1)*ldc+ncols-1]
	const sw = 16
	for s := 0; s*sw < ncols; s++ {
		cols := min(sw, ncols-s*sw)
		if cols == sw {
			tile256(mr, &a[0], lda, &w[s*sw], k, &c[s*sw], ldc)
			continue
		}
		var tmp [maxTileRows * sw]float32
		tile256(mr, &a[0], lda, &w[s*sw], k, &tmp[0], sw)
		for m := range mr {
			copy(c[m*ldc+s*sw:m*ldc+s*sw+cols], tmp[m*sw:m*sw+cols])
		}
	}
}

const maxTileRows = 6

func tile256(mr int, a *float32, lda int, w *float32, k int, c *float32, ldc int) {
	switch mr {
	case 1:
		tile256x1(a, lda, w, k, c, ldc)
	case 2:
		tile256x2(a, lda, w, k, c, ldc)
	case 3:
		tile256x3(a, lda, w, k, c, ldc)
	case 4:
		tile256x4(a, lda, w, k, c, ldc)
	case 5:
		tile256x5(a, lda, w, k, c, ldc)
	case 6:
		tile256x6(a, lda, w, k, c, ldc)
	default:
		panic("kernel: bad tile height")
	}
}

// rowDotsAVX512, rowDotsBF16AVX512, rowDotsSetAVX512 and rowDotsBF16SetAVX512 are RowDots,
// RowDotsBF16, RowDotsSet and RowDotsBF16Set with zmm registers (rowDotsWith and rowDotsSetWith,
// the grouped kernels taking as many groups as measured fastest). Arguments are checked by the
// exported functions.
func rowDotsAVX512(dst []float32, ldd int, q []float32, ldq, rows int, k []float32, ldk, n, dim int) {
	rowDotsWith(rowDotsGroupsF32, dst, ldd, q, ldq, rows, k, ldk, n, dim)
}

func rowDotsBF16AVX512(dst []float32, ldd int, q []float32, ldq, rows int, k []uint16, ldk, n, dim int) {
	rowDotsWith(rowDotsGroupsBF16, dst, ldd, q, ldq, rows, k, ldk, n, dim)
}

func rowDotsSetAVX512(dst [][]float32, ldd int, q [][]float32, ldq, rows int, k [][]float32, ldk, n, dim int) {
	rowDotsSetWith(rowDotsGroupsF32, dst, ldd, q, ldq, rows, k, ldk, n, dim)
}

func rowDotsBF16SetAVX512(dst [][]float32, ldd int, q [][]float32, ldq, rows int, k [][]uint16, ldk, n, dim int) {
	rowDotsSetWith(rowDotsGroupsBF16, dst, ldd, q, ldq, rows, k, ldk, n, dim)
}

// rowDotsWith is RowDots (float32 keys) or RowDotsBF16 (bfloat16 bits, T uint16) with zmm
// registers: the keys in groups of 16, up to most whole groups a kernel call (rowDotsBatch), at
// most rowDotsRows query rows at a time.
func rowDotsWith[T float32 | uint16](most int, dst []float32, ldd int, q []float32, ldq, rows int, k []T, ldk, n, dim int) {
	var b rowDotsBatch
	b.start(isBF16[T](), most, ldd, ldq, ldk, dim)
	for r0 := 0; r0 < rows; r0 += rowDotsRows {
		b.rows = min(rowDotsRows, rows-r0)
		for j := 0; j < n; j += 16 {
			b.add(&dst[r0*ldd+j], &q[r0*ldq], unsafe.Pointer(&k[j*ldk]), min(16, n-j))
		}
		b.flush()
	}
}

// rowDotsSetWith is RowDotsSet (float32 keys) or RowDotsBF16Set (T uint16) with zmm registers:
// every set's groups of 16 keys through one rowDotsBatch, so that the sets' groups share kernel
// calls, up to most a call.
func rowDotsSetWith[T float32 | uint16](most int, dst [][]float32, ldd int, q [][]float32, ldq, rows int, k [][]T, ldk, n, dim int) {
	var b rowDotsBatch
	b.start(isBF16[T](), most, ldd, ldq, ldk, dim)
	for r0 := 0; r0 < rows; r0 += rowDotsRows {
		b.rows = min(rowDotsRows, rows-r0)
		for j := 0; j < n; j += 16 {
			for i := range k {
				b.add(&dst[i][r0*ldd+j], &q[i][r0*ldq], unsafe.Pointer(&k[i][j*ldk]), min(16, n-j))
			}
		}
		b.flush()
	}
}

// isBF16 reports whether keys of type T are bfloat16 bits (uint16) rather than float32.
func isBF16[T float32 | uint16]() bool {
	var z T
	_, ok := any(z).(uint16)
	return ok
}

// tileAcc512Kernels and tileAccBF16x512Kernels are the accumulating tile kernels for float32
// and bfloat16 value rows, by rows − 1.
var (
	tileAcc512Kernels = [maxTileRows]func(a *float32, lda int, w *float32, ldw int, k int, c *float32, ldc int, mask uint64){
		tileAcc512x1, tileAcc512x2, tileAcc512x3, tileAcc512x4, tileAcc512x5, tileAcc512x6,
	}
	tileAccBF16x512Kernels = [maxTileRows]func(a *float32, lda int, w *uint16, ldw int, k int, c *float32, ldc int, mask uint64){
		tileAccBF16x512x1, tileAccBF16x512x2, tileAccBF16x512x3, tileAccBF16x512x4, tileAccBF16x512x5, tileAccBF16x512x6,
	}
)

// accRowsWith returns the strided-row accumulation of value rows of type T (float32, or
// bfloat16 bits widened by the kernels): the kernels run on tiles of up to 6 rows × 64
// columns, each over all n rows of v. Arguments are checked by AccumulateRows.
func accRowsWith[T float32 | uint16](kernels *[maxTileRows]func(a *float32, lda int, w *T, ldw int, k int, c *float32, ldc int, mask uint64)) func(acc []float32, ldacc int, p []float32, ldp, rows int, v []T, ldv, n, dim int) {
	return func(acc []float32, ldacc int, p []float32, ldp, rows int, v []T, ldv, n, dim int) {
		for m0 := 0; m0 < rows; m0 += maxTileRows {
			mr := min(maxTileRows, rows-m0)
			for c0 := 0; c0 < dim; c0 += panelWidth {
				mask := ^uint64(0) >> (panelWidth - min(panelWidth, dim-c0))
				kernels[mr-1](&p[m0*ldp], ldp, &v[c0], ldv, n, &acc[m0*ldacc+c0], ldacc, mask)
			}
		}
	}
}

func tileDot512x1(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512x2(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512x3(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512x4(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512x5(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512x6(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h1(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h2(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h3(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h4(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h5(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h6(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h7(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h8(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h9(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h10(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h11(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512h12(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)
func tileDot512x1p2(a *uint32, w *uint16, kp int, c *float32)
func tileDot512x1p4(a *uint32, w *uint16, kp int, c *float32)

//go:noescape
func toBF16Pairs512(dst *uint32, src *float32, n int)

//go:noescape
func widenBF16x512(dst *float32, src *uint16, n int)

// widenBF16AVX512 is WidenBF16 with zmm registers.
func widenBF16AVX512(dst []float32, src []uint16) {
	if len(src) > 0 {
		_ = dst[len(src)-1]
		widenBF16x512(&dst[0], &src[0], len(src))
	}
}

//go:noescape
func dotBF16Probe(acc *float32, a, b *uint32)

func dpLoop512(n int)

// hasBF16Impl reports whether the tests can run the AVX512_BF16 kernels here.
func hasBF16Impl() bool { return hasBF16() }
