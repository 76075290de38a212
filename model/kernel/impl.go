package kernel

import "unsafe"

// impl is one complete set of kernels. Exactly one (defaultImpl) is chosen at program start and
// used for every shape, which is what makes results reproducible within a process.
type impl struct {
	name string
	mr   int // rows per Linear tile

	// tile computes rows [0,mr) × columns [0,ncols) of one panel: c[m*ldc+j] = Σ_k a[m*lda+k]·w[k*panelWidth+j],
	// each element one fixed accumulation chain over k ascending.
	tile func(c []float32, ldc int, a []float32, lda int, w []float32, k, mr, ncols int)

	// tile16 is tile for BF16 or F16 panels (see Linear), widening each weight exactly before
	// its FMA; nil: the panel is widened into a float32 copy and tile runs on that. pf is memory
	// to prefetch on the way (a share of the next panel; nil: none); with cont the chains
	// continue from the values in c (an earlier call computed the preceding k).
	tile16 func(dtype DType, c []float32, ldc int, a []float32, lda int, w []uint16, k, mr, ncols int, pf []uint16, cont bool)
	// tileBF16Wide is tile16 for one row of BF16 panels over np (2 or 4) consecutive whole
	// panels (k > 0; c gets np·panelWidth columns, each the same chain as tile16 computes); nil:
	// tile16 per panel.
	tileBF16Wide func(c []float32, a []float32, w []uint16, k, np int)

	// tileDot is tile for bfloat16 products (see bf16.go): a holds activation pairs, lda pairs
	// apart, w kp pairs of a BF16 panel; toPairs rounds floats to pairs. nil: portable Go.
	// pf is memory to prefetch on the way (a share of the next panel; nil: none). cont: the
	// chains continue from the values in c (an earlier call computed the preceding pairs).
	tileDot func(c []float32, ldc int, a []uint32, lda int, w []uint16, kp, mr, ncols int, pf []uint16, cont bool)
	toPairs func(dst []uint32, src []float32)
	// tileDotWide is tileDot for one row over np (2 or 4) consecutive whole panels (kp > 0; c
	// gets np·panelWidth columns, each the same chain as tileDot computes); nil: tileDot per
	// panel.
	tileDotWide func(c []float32, a []uint32, w []uint16, kp, np int)
	// dpLoop is fmaLoop for bfloat16 products (nil without them).
	dpLoop func(n int) float64

	// tileDotHalf is tileDot over half a panel for up to halfRows rows: w starts at the half's
	// first pair (the second half panelWidth values into the panel), ncols ≤ panelWidth/2, each
	// element the same chain as tileDot computes. nil: whole-panel tiles only (see
	// Linear.scheduleDot).
	tileDotHalf func(c []float32, ldc int, a []uint32, lda int, w []uint16, kp, mr, ncols int, pf []uint16, cont bool)
	halfRows    int
	// tileDotTall is tileDot for more rows than mr, up to tallRows, over a whole panel in one
	// call (each line of the panel read once, in order); nil: none (see Linear.scheduleDot).
	tileDotTall func(c []float32, ldc int, a []uint32, lda int, w []uint16, kp, mr, ncols int, pf []uint16, cont bool)
	tallRows    int

	// widenBF16 widens bfloat16 values to float32 (nil: portable Go).
	widenBF16 func(dst []float32, src []uint16)

	dot      func(a, b []float32) float32
	axpy     func(alpha float32, x, y []float32)
	scale    func(alpha float32, x []float32)
	add      func(dst, a, b []float32)
	siluMul  func(dst, gate, up []float32)
	expShift func(x []float32, shift float32) float32 // x[i] = exp(x[i]-shift); returns Σ x[i] in a fixed order
	max      func(x []float32) float32

	// normScale, rope and narrowBF16 are RMSNorm's scaling, Rope and NarrowBF16 (nil: the
	// portable loops, which compute the same bits).
	normScale  func(dst, x, w []float32, inv float32)
	rope       func(x1, x2, cos, sin []float32)
	narrowBF16 func(dst []uint16, src []float32)

	// transpose copies square blocks of tgroup rows × tgroup columns transposed: for each of
	// blocks column blocks b, columns [b·tgroup, (b+1)·tgroup) of source rows rows[0..tgroup)
	// become rows [b·tgroup, (b+1)·tgroup) of dst, ldd floats apart. nil (tgroup 0): the
	// packing functions move elements one by one.
	transpose func(dst *float32, ldd int, rows *[16]*float32, blocks int)
	tgroup    int

	// rowDots and accRows are the strided-row products ([RowDots], [AccumulateRows]); rowDim
	// is the multiple of the vector length they need (0: not provided).
	rowDots func(dst []float32, ldd int, q []float32, ldq, rows int, k []float32, ldk, n, dim int)
	accRows func(acc []float32, ldacc int, p []float32, ldp, rows int, v []float32, ldv, n, dim int)
	rowDim  int
	// rowDotsBF16 and accRowsBF16 are rowDots and accRows for bfloat16 keys and values, widened
	// exactly on the way ([RowDotsBF16], [AccumulateRowsBF16]; nil: portable Go).
	rowDotsBF16 func(dst []float32, ldd int, q []float32, ldq, rows int, k []uint16, ldk, n, dim int)
	accRowsBF16 func(acc []float32, ldacc int, p []float32, ldp, rows int, v []uint16, ldv, n, dim int)
	// rowDotsSet and rowDotsBF16Set are rowDots and rowDotsBF16 over several sets of operands
	// at once ([RowDotsSet], [RowDotsBF16Set]; nil: one rowDots call a set).
	rowDotsSet     func(dst [][]float32, ldd int, q [][]float32, ldq, rows int, k [][]float32, ldk, n, dim int)
	rowDotsBF16Set func(dst [][]float32, ldd int, q [][]float32, ldq, rows int, k [][]uint16, ldk, n, dim int)
	// touch reads the cache lines of the n bytes at p in order (nil: no-op).
	touch func(p unsafe.Pointer, n int)

	fmaLoop func(n int) float64       // n iterations of independent FMAs; returns FLOPs per iteration
	readSum func(x []float32) float32 // reads all of x
}

// defaultImpl is the implementation chosen for this process (see selectImpl). It is set once
// during package initialisation and never changed.
var defaultImpl = selectImpl()

// Implementation returns the name of the kernel implementation this process uses
// ("avx512", "avx2" or "go").
func Implementation() string { return defaultImpl.name }
