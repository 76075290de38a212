package kernel

import "fmt"

// panelWidth is the number of output columns in one packed weight panel. Every implementation
// uses the same packing; the AVX2 kernel walks a panel in 16-column slices.
const panelWidth = 64

// Linear holds a weight matrix W (out × in, row-major as in Hugging Face checkpoints), packed
// once for the kernels. It is safe for concurrent Apply calls; it only changes when re-packed
// in place by [Linear.SetRows] or [Linear.SetColumns] (scratch matrices), which must not
// overlap any other use.
//
// The weights are stored as float32, bfloat16 or float16 ([DType]) in panels of panelWidth
// outputs, zero-padded past out:
//
//   - F32: panel p holds in rows of 64 floats: W[p*64+j][k] at w[p*in*64 + k*64 + j];
//   - BF16: panel p holds ceil(in/2) rows of 64 pairs: W[p*64+j][k] at
//     h[p*kp*128 + (k/2)*128 + 2j + k%2] (kp = ceil(in/2)), the pair of an odd in padded with 0;
//   - F16: panel p holds in rows of 64 halves: W[p*64+j][k] at h[p*in*64 + k*64 + j];
//   - I8: int8 values with a float32 scale per group of 32 inputs (see int8.go).
//
// Widening a bfloat16 or float16 weight to float32 is exact, so a Linear computes the same
// bits whatever its storage holds the same values in.
type Linear struct {
	out, in int
	panels  int // ceil(out / panelWidth)
	dtype   DType
	bf16Dot bool         // BF16 weights times bfloat16-rounded activations (NewLinearBF16Dot)
	w       []float32    // F32 panels
	h       []uint16     // BF16 or F16 panels
	i8      *int8Weights // I8 panels and scales (NewLinearInt8From)
	pool    *Pool
	impl    *impl
}

// NewLinear packs w (len out*in, row n holds the weights of output n) into a new Linear whose
// Apply spreads work over short-lived goroutines (see [Parallel]). w is not retained. It
// panics if len(w) != out*in.
func NewLinear(w []float32, out, in int) *Linear {
	return NewLinearOn(nil, w, out, in)
}

// NewLinearOn is [NewLinear] with Apply running on the workers of pool (nil: as NewLinear).
// The pool must stay open while the Linear is used; the Linear does not own it.
func NewLinearOn(pool *Pool, w []float32, out, in int) *Linear {
	if out < 0 || in < 0 || len(w) != out*in {
		panic(fmt.Sprintf("kernel.NewLinear: len(w) = %d, want out*in = %d*%d", len(w), out, in))
	}
	return newLinear(defaultImpl, pool, out, in, w, nil)
}

// NewLinearFrom builds a Linear row by row without an out×in float32 copy of the weights:
// row(n, dst) must write W[n][0..in) into dst (len in), converting from whatever the weights are
// stored as (bf16, f16, a memory-mapped file). row is called once per n, concurrently from
// several goroutines and in any order. Apply runs on pool's workers (nil: short-lived goroutines).
func NewLinearFrom(pool *Pool, out, in int, row func(n int, dst []float32)) *Linear {
	if out < 0 || in < 0 {
		panic(fmt.Sprintf("kernel.NewLinearFrom: out = %d, in = %d", out, in))
	}
	return newLinear(defaultImpl, pool, out, in, nil, row)
}

// NewLinear16From is [NewLinearFrom] for weights stored as 16-bit values of dtype (BF16 or F16):
// row(n, dst) must write W[n][0..in) as raw bfloat16 or float16 bits into dst (len in). The
// Linear keeps them in 2 bytes each and widens them exactly inside the kernels. It panics if
// dtype is not BF16 or F16.
func NewLinear16From(pool *Pool, dtype DType, out, in int, row func(n int, dst []uint16)) *Linear {
	if out < 0 || in < 0 || (dtype != BF16 && dtype != F16) {
		panic(fmt.Sprintf("kernel.NewLinear16From: %v, out = %d, in = %d", dtype, out, in))
	}
	return newLinear16(defaultImpl, pool, dtype, out, in, row)
}

// newLinear16 packs the 16-bit rows of W panel by panel in parallel.
func newLinear16(im *impl, pool *Pool, dtype DType, out, in int, row func(n int, dst []uint16)) *Linear {
	l := &Linear{out: out, in: in, panels: (out + panelWidth - 1) / panelWidth, dtype: dtype, pool: pool, impl: im}
	stride := l.panel16Len()
	l.h = make([]uint16, l.panels*stride)
	if in == 0 {
		return l
	}
	pool.Parallel(l.panels, func(p int) {
		buf := make([]uint16, in)
		dst := l.h[p*stride : (p+1)*stride]
		for j := range min(panelWidth, out-p*panelWidth) {
			row(p*panelWidth+j, buf)
			if dtype == F16 {
				for k, v := range buf {
					dst[k*panelWidth+j] = v
				}
				continue
			}
			for k, v := range buf {
				dst[(k/2)*2*panelWidth+2*j+k%2] = v
			}
		}
	})
	return l
}

// panel16Len returns the number of 16-bit values in one panel of a BF16 or F16 Linear.
func (l *Linear) panel16Len() int {
	if l.dtype == BF16 {
		return (l.in + 1) / 2 * 2 * panelWidth
	}
	return l.in * panelWidth
}

// DType returns how the weights are stored.
func (l *Linear) DType() DType { return l.dtype }

// Bytes returns the bytes of the out × in weights in their storage type (without the panels'
// padding; an I8 Linear's scales included): what one pass over the matrix reads from memory.
func (l *Linear) Bytes() int64 {
	if l.i8 != nil {
		return l.int8Bytes()
	}
	return int64(l.out) * int64(l.in) * int64(l.dtype.Size())
}

// Row writes row n of W (the weights of output n), widened to float32, into dst (len ≥ in):
// a tied embedding's lookup reads the lm_head Linear this way. It panics if n is out of range.
func (l *Linear) Row(n int, dst []float32) {
	if n < 0 || n >= l.out {
		panic(fmt.Sprintf("kernel.Linear.Row(%d): %d outputs", n, l.out))
	}
	dst = dst[:l.in]
	p, j := n/panelWidth, n%panelWidth
	switch l.dtype {
	case F32:
		w := l.w[p*l.in*panelWidth:]
		for k := range dst {
			dst[k] = w[k*panelWidth+j]
		}
	case BF16:
		h := l.h[p*l.panel16Len():]
		for k := range dst {
			dst[k] = BF16ToF32(h[(k/2)*2*panelWidth+2*j+k%2])
		}
	case F16:
		h := l.h[p*l.panel16Len():]
		for k := range dst {
			dst[k] = F16ToF32(h[k*panelWidth+j])
		}
	case I8:
		l.int8Row(n, dst)
	}
}

// widenPanel writes panel p of a 16-bit Linear into dst as the float32 panel an F32 Linear
// holds (len in*panelWidth).
func (l *Linear) widenPanel(dst []float32, p int) {
	h := l.h[p*l.panel16Len() : (p+1)*l.panel16Len()]
	if l.dtype == F16 {
		widen16(dst, h, F16)
		return
	}
	for k := range l.in {
		row := h[(k/2)*2*panelWidth:]
		d := dst[k*panelWidth : (k+1)*panelWidth]
		for j := range d {
			d[j] = BF16ToF32(row[2*j+k%2])
		}
	}
}

// newLinear packs W, given as a row-major slice w or (w == nil) through row, panel by panel
// in parallel.
func newLinear(im *impl, pool *Pool, out, in int, w []float32, row func(n int, dst []float32)) *Linear {
	panels := (out + panelWidth - 1) / panelWidth
	packed := make([]float32, panels*in*panelWidth)
	if in > 0 {
		pool.Parallel(panels, func(p int) {
			var buf []float32
			if w == nil {
				buf = make([]float32, in)
			}
			dst := packed[p*in*panelWidth : (p+1)*in*panelWidth]
			for j := range min(panelWidth, out-p*panelWidth) {
				n := p*panelWidth + j
				src := buf
				if w != nil {
					src = w[n*in : n*in+in]
				} else {
					row(n, buf)
				}
				for k, v := range src {
					dst[k*panelWidth+j] = v
				}
			}
		})
	}
	return &Linear{out: out, in: in, panels: panels, dtype: F32, w: packed, pool: pool, impl: im}
}

// Out returns the number of outputs (rows of W).
func (l *Linear) Out() int { return l.out }

// In returns the number of inputs (columns of W).
func (l *Linear) In() int { return l.in }

// Apply computes dst[m*out+n] = Σ_k x[m*in+k]·W[n][k] for m < rows. It is batch-invariant: row
// m's result is bit-identical for any rows, any position and any content of the other rows (see
// the package documentation). The work is spread over goroutines. dst must not overlap x. It
// panics if dst or x is too short.
func (l *Linear) Apply(dst, x []float32, rows int) {
	l.ApplyStrided(dst, l.out, x, l.in, rows)
}

// ApplyStrided is [Linear.Apply] for rows that are not packed back to back: input row m is
// x[m*lda : m*lda+in] and output row m is dst[m*ldc : m*ldc+out] (lda ≥ in, ldc ≥ out); the
// elements between rows are neither read nor written. Every output element is computed exactly
// as by Apply, so the results are bit-identical to Apply on the same rows packed densely. It
// panics if a stride is too small or dst or x too short.
func (l *Linear) ApplyStrided(dst []float32, ldc int, x []float32, lda int, rows int) {
	if rows <= 0 {
		return
	}
	if lda < l.in || ldc < l.out || len(x) < (rows-1)*lda+l.in || len(dst) < (rows-1)*ldc+l.out {
		panic(fmt.Sprintf("kernel.Linear.Apply: rows=%d, out=%d, in=%d needs lda ≥ in, ldc ≥ out, len(x) ≥ %d (have lda %d, %d), len(dst) ≥ %d (have ldc %d, %d)",
			rows, l.out, l.in, (rows-1)*lda+l.in, lda, len(x), (rows-1)*ldc+l.out, ldc, len(dst)))
	}
	if l.in == 0 {
		for m := range rows {
			clear(dst[m*ldc : m*ldc+l.out])
		}
		return
	}
	if l.bf16Dot {
		l.applyBF16Dot(dst, ldc, x, lda, rows)
		return
	}
	if l.i8 != nil {
		l.applyInt8(dst, ldc, x, lda, rows)
		return
	}
	if rows > 1 && l.dtype != F32 && l.impl.tile16 != nil {
		l.apply16(dst, ldc, x, lda, rows)
		return
	}
	s := l.schedule(rows)
	if rows == 1 && l.dtype == BF16 && l.impl.tileBF16Wide != nil {
		s.widePanels()
		s.endWithSingles(l.pool.Workers())
	}
	if s.tasks() == 1 {
		l.task(dst, ldc, x, lda, rows, s, 0)
		return
	}
	l.pool.Parallel(s.tasks(), func(t int) { l.task(dst, ldc, x, lda, rows, s, t) })
}

// schedule splits the rows × panels product into tasks of tileGroup row tiles × panelGroup
// panels. The split only decides where and when an element is computed, never how.
type schedule struct {
	mr                    int // rows per tile
	halves                int // tiles per panel and row tile: 1 (whole panels) or 2 (half-panel tiles)
	tiles, panels         int
	tileGroup, panelGroup int
	tileGroups            int
	panelGroups           int // runs of panels: panelGroup each, then tail single panels
	tail                  int // single-panel runs that end a one-row product (endWithSingles)
}

func (s schedule) tasks() int { return s.tileGroups * s.panelGroups }

// endWithSingles ends a one-row product's runs of several panels with 2·workers single-panel
// runs. The workers claim tasks in order, so they finish within about a panel of one another
// instead of a run: down_proj's 16 panels were 4 runs of 4, and the worker that finished first
// waited for most of a run (a quarter of the product) while the other streamed alone.
func (s *schedule) endWithSingles(workers int) {
	tail := 2 * workers
	if s.tileGroups != 1 || s.panelGroup == 1 || s.panels < tail+s.panelGroup {
		return
	}
	s.tail = tail
	s.panelGroups = (s.panels-tail+s.panelGroup-1)/s.panelGroup + tail
}

// panelRun returns the panels [p0, p1) of run pg of a product's panels split into groups runs:
// runs of group panels, the last tail of them width panels each from the end.
func panelRun(pg, group, groups, panels, tail, width int) (p0, p1 int) {
	if pg >= groups-tail {
		p0 = panels - (groups-pg)*width
		return p0, p0 + width
	}
	return pg * group, min(panels-tail*width, (pg+1)*group)
}

// l2Budget is the number of bytes of weights plus inputs one task aims to keep in a core's L2.
const l2Budget = 512 << 10

func (l *Linear) schedule(rows int) schedule {
	return l.scheduleTiles(rows, l.impl.mr, 1)
}

// scheduleTiles is schedule for row tiles of at most mr rows, each over halves column slices of
// a panel (2: half-panel tiles).
func (l *Linear) scheduleTiles(rows, mr, halves int) schedule {
	s := schedule{mr: mr, halves: halves, tiles: (rows + mr - 1) / mr, panels: l.panels}
	workers := l.pool.Workers()
	panelBytes := l.in * panelWidth * l.dtype.Size()
	rowBytes := l.in * 4
	// Panels per task: as many as fit in half the budget, but enough tasks to feed the workers.
	s.panelGroup = max(1, min(s.panels, l2Budget/2/panelBytes))
	// Row tiles per task: the rest of the budget.
	s.tileGroup = max(1, min(s.tiles, (l2Budget/2)/(rowBytes*mr)))
	want := 4 * workers
	if workers == 1 {
		want = 1
	}
	for s.count() < want && (s.panelGroup > 1 || s.tileGroup > 1) {
		if s.tileGroup >= s.panelGroup && s.tileGroup > 1 {
			s.tileGroup = (s.tileGroup + 1) / 2
		} else {
			s.panelGroup = (s.panelGroup + 1) / 2
		}
	}
	s.tileGroups = (s.tiles + s.tileGroup - 1) / s.tileGroup
	s.panelGroups = (s.panels + s.panelGroup - 1) / s.panelGroup
	return s
}

// widePanels rounds the panel groups up to a multiple of 4 panels (when there is more than one
// group), so that a one-row product's tasks run the four-panel kernels over whole quadruples.
func (s *schedule) widePanels() {
	if s.panelGroup%4 != 0 && s.panelGroup < s.panels {
		s.panelGroup = min(s.panels, (s.panelGroup+3)/4*4)
		s.panelGroups = (s.panels + s.panelGroup - 1) / s.panelGroup
	}
}

// widePanelRun returns how many of the panels [p0, p1) of an out-column matrix a one-row wide
// kernel computes next: 4 or 2 whole panels, or 0 (one panel at a time from here).
func widePanelRun(p0, p1, out int) int {
	for _, np := range []int{4, 2} {
		if p0+np <= p1 && (p0+np)*panelWidth <= out {
			return np
		}
	}
	return 0
}

// streamPanels makes s one group of all the row tiles over runs of consecutive panels, two runs
// per worker, when s runs several tiles over a panel (row tiles, or the two halves of a panel)
// and has one group of row tiles anyway or the rows' activations that a task's tiles share
// (actBytes: all of k, or a block of it) fit half the L2 budget: every task then
// runs all row tiles over its run, prefetching each next panel while the current one is
// computed from the cache, so the weights stream from memory under the arithmetic once. (Split
// into groups of row tiles, as schedule splits a long K's, a panel was read by several tasks and
// the next one prefetched by none: o_proj and down_proj of a batch of 32 ran at 0.75 of the
// peak.)
func (s *schedule) streamPanels(actBytes, workers int) {
	if s.tiles*s.halves > 1 && (s.tileGroups == 1 || actBytes <= l2Budget/2) {
		s.tileGroup, s.tileGroups = s.tiles, 1
		s.panelGroup = (s.panels + 2*workers - 1) / (2 * workers)
		s.panelGroups = (s.panels + s.panelGroup - 1) / s.panelGroup
	}
}

// ranges returns task t's row tiles [t0, t1) and panels [p0, p1).
func (s schedule) ranges(t int) (t0, t1, p0, p1 int) {
	tg, pg := t/s.panelGroups, t%s.panelGroups
	p0, p1 = panelRun(pg, s.panelGroup, s.panelGroups, s.panels, s.tail, 1)
	return tg * s.tileGroup, min(s.tiles, (tg+1)*s.tileGroup), p0, p1
}

// kBlockSteps returns the steps of k (pairs for BF16 panels, single k for F16) a task of tiles
// row tiles runs its tiles over at a time, for a panel of steps steps: all of them, or for
// several tiles over a long panel (more than 2·kBlock steps) equal blocks of at most kBlock.
// While the tiles take turns on a block, the panel's share in the caches is that block instead
// of the whole panel (plus the next one being prefetched and the activations), which measured
// 5–8% faster at K = 2048 and 3072 (shorter blocks cost more than they save).
func kBlockSteps(steps, tiles int) int {
	if tiles > 1 && steps > 2*kBlock {
		n := (steps + kBlock - 1) / kBlock
		return (steps + n - 1) / n
	}
	return steps
}

// blockTask runs the row tiles [t0, t1) of a product over the 16-bit panels [p0, p1) (steps
// steps of k each, panelStep values a step), panel by panel and, within a panel, block of k by
// block of k (kBlockSteps), the chains carrying over from block to block through dst. tile(m0,
// m1, p, h, k0, kn, pf, cont) computes rows [m0, m1) of panel p (of its half h when halves is 2)
// over steps [k0, k0+kn), continuing the chains when cont, prefetching pf on the way. The
// tiles have balanced heights (32 rows in whole-panel tiles: 6, 6, 5, 5, 5, 5, not 6×5 + 2, as
// a short tile computes its rows less efficiently) and they prefetch the next block of the
// panel, or the first of the next panel, an equal share each, spread evenly over their steps
// (prefetchStreams), so that it streams from memory at the pace of the arithmetic while the
// current one is computed from the cache.
func (l *Linear) blockTask(rows, tiles, halves, t0, t1, p0, p1, steps, panelStep int, tile func(m0, m1, p, h, k0, kn int, pf []uint16, cont bool)) {
	stride := l.panel16Len()
	calls := (t1 - t0) * halves // tile calls per block
	kb := kBlockSteps(steps, calls)
	for p := p0; p < p1; p++ {
		w := l.h[p*stride : (p+1)*stride]
		for k0 := 0; k0 < steps; k0 += kb {
			kn := min(kb, steps-k0)
			var next []uint16
			switch {
			case k0+kn < steps:
				next = w[(k0+kn)*panelStep : min(steps, k0+kn+kb)*panelStep]
			case p+1 < p1:
				next = l.h[(p+1)*stride : (p+1)*stride+min(steps, kb)*panelStep]
			}
			// Each tile call a share of whole lines (32 values).
			share := (len(next)/32 + calls - 1) / calls * 32
			for q := range calls {
				ti, h := t0+q/halves, q%halves
				m0, m1 := ti*rows/tiles, (ti+1)*rows/tiles
				var pf []uint16
				if calls > 1 && q*share < len(next) {
					pf = next[q*share : min(len(next), (q+1)*share)]
				}
				tile(m0, m1, p, h, k0, kn, pf, k0 > 0)
			}
		}
	}
}

// apply16 runs Apply for several rows of a 16-bit Linear whose implementation has 16-bit tiles
// (tile16), as bfloat16 products run (applyBF16Dot): the rows' tiles stream over long runs of
// panels (streamPanels), prefetching the next panel, in blocks of k (blockTask).
func (l *Linear) apply16(dst []float32, ldc int, x []float32, lda, rows int) {
	kStep, panelStep := 1, panelWidth // k a step, panel values a step
	if l.dtype == BF16 {
		kStep, panelStep = 2, 2*panelWidth
	}
	steps := (l.in + kStep - 1) / kStep
	s := l.schedule(rows)
	s.streamPanels(rows*min(l.in, kBlockSteps(steps, s.tiles)*kStep)*4, l.pool.Workers())
	stride := l.panel16Len()
	task := func(t int) {
		t0, t1, p0, p1 := s.ranges(t)
		l.blockTask(rows, s.tiles, s.halves, t0, t1, p0, p1, steps, panelStep, func(m0, m1, p, _, k0, kn int, pf []uint16, cont bool) {
			col := p * panelWidth
			l.impl.tile16(l.dtype, dst[m0*ldc+col:], ldc, x[m0*lda+k0*kStep:], lda, l.h[p*stride+k0*panelStep:(p+1)*stride],
				min(l.in-k0*kStep, kn*kStep), m1-m0, min(panelWidth, l.out-col), pf, cont)
		})
	}
	if s.tasks() == 1 {
		task(0)
		return
	}
	l.pool.Parallel(s.tasks(), task)
}

// maxHalfTileRows is the most rows a bfloat16 product runs in half-panel tiles (scheduleDot).
const maxHalfTileRows = 16

// scheduleDot is the schedule of a bfloat16 product of rows rows: whole-panel tiles of impl.mr
// rows; for more rows, up to impl.tallRows (7), the implementation's tall tile (tileDotTall:
// one call a panel, each line read once, in order, with no software prefetch — 6–31% more GB
// per CPU second than half-panel tiles, median 1.19, in passes over 320 MB on one thread;
// docs/performance.md); or, for more rows than those and at most maxHalfTileRows, the
// implementation's half-panel tiles (tileDotHalf) of up to impl.halfRows rows over each half of
// a panel. A half-panel tile reads two of a pair's four cache lines (columns 0–31 or 32–63),
// so its row tile reads every line of a panel once, and holds twice a whole-panel tile's rows:
// 7 to 12 rows read the weights from the caches once instead of twice, 13 to 16 twice instead
// of three times. That is what a memory-bound product needs (below about 16 rows a bfloat16
// product does 16 or fewer FLOPs per weight byte, under the VDPBF16PS peak ÷ one core's read
// bandwidth); with more rows the products are bound by the arithmetic, where the whole-panel
// tiles do better (4 VDPBF16PS per broadcast of an activation pair instead of 2). Passes over
// 160 MB of Qwen3-0.6B-shaped weights on one thread measured (docs/performance.md) 5–15% more
// GB per CPU second at 7, 8, 12 and 16 rows, less at 4 and 20–32.
func (l *Linear) scheduleDot(rows int) schedule {
	if rows > l.impl.mr && rows <= l.impl.tallRows && l.impl.tileDotTall != nil {
		return l.scheduleTiles(rows, l.impl.tallRows, 1)
	}
	if rows > l.impl.mr && rows <= maxHalfTileRows && l.impl.tileDotHalf != nil {
		return l.scheduleTiles(rows, l.impl.halfRows, 2)
	}
	return l.schedule(rows)
}

// halfColumns returns the first output column of tile slice h of panel p (halves slices a
// panel) and how many of its columns are below out (≤ 0: none).
func halfColumns(p, h, halves, out int) (col, ncols int) {
	w := panelWidth / halves
	col = p*panelWidth + h*w
	return col, min(w, out-col)
}

func (s schedule) count() int {
	return ((s.tiles + s.tileGroup - 1) / s.tileGroup) * ((s.panels + s.panelGroup - 1) / s.panelGroup)
}

// task computes one block of tiles × panels: panel-major, so a panel stays in cache while the
// block's row tiles stream past it.
func (l *Linear) task(dst []float32, ldc int, x []float32, lda int, rows int, s schedule, t int) {
	t0, t1, p0, p1 := s.ranges(t)
	in, out := l.in, l.out
	if rows == 1 && l.dtype == BF16 && l.impl.tileBF16Wide != nil {
		// Four (or two) whole panels at a time: as many weight streams and independent chains.
		stride := l.panel16Len()
		for np := widePanelRun(p0, p1, out); np > 0; np = widePanelRun(p0, p1, out) {
			l.impl.tileBF16Wide(dst[p0*panelWidth:], x, l.h[p0*stride:(p0+np)*stride], in, np)
			p0 += np
		}
	}
	var wide []float32 // a 16-bit panel widened, for implementations without 16-bit tiles
	for p := p0; p < p1; p++ {
		col := p * panelWidth
		ncols := min(panelWidth, out-col)
		var w []float32
		var h []uint16
		switch {
		case l.dtype == F32:
			w = l.w[p*in*panelWidth : (p+1)*in*panelWidth]
		case l.impl.tile16 != nil:
			h = l.h[p*l.panel16Len() : (p+1)*l.panel16Len()]
		default:
			if wide == nil {
				wide = make([]float32, in*panelWidth)
			}
			l.widenPanel(wide, p)
			w = wide
		}
		for tile := t0; tile < t1; tile++ {
			m0 := tile * s.mr
			mr := min(s.mr, rows-m0)
			if h != nil {
				l.impl.tile16(l.dtype, dst[m0*ldc+col:], ldc, x[m0*lda:], lda, h, in, mr, ncols, nil, false)
			} else {
				l.impl.tile(dst[m0*ldc+col:], ldc, x[m0*lda:], lda, w, in, mr, ncols)
			}
		}
	}
}
