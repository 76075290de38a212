package kernel

import "fmt"

// panelWidth is the number of output columns in one packed weight panel. Every implementation
// uses the same packing; the AVX2 kernel walks a panel in 16-column slices.
const panelWidth = 64

// Linear holds a weight matrix W (out × in, row-major as in Hugging Face checkpoints), packed
// once for the kernels. It is safe for concurrent Apply calls; it only changes when re-packed
// in place by [Linear.SetRows] or [Linear.SetColumns] (scratch matrices), which must not
// overlap any other use.
type Linear struct {
	out, in int
	panels  int       // ceil(out / panelWidth)
	w       []float32 // panel p: w[p*in*panelWidth:][k*panelWidth+j] = W[p*panelWidth+j][k], zero-padded
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
	return &Linear{out: out, in: in, panels: panels, w: packed, pool: pool, impl: im}
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
	s := l.schedule(rows)
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
	tiles, panels         int
	tileGroup, panelGroup int
	tileGroups            int
	panelGroups           int
}

func (s schedule) tasks() int { return s.tileGroups * s.panelGroups }

// l2Budget is the number of bytes of weights plus inputs one task aims to keep in a core's L2.
const l2Budget = 512 << 10

func (l *Linear) schedule(rows int) schedule {
	mr := l.impl.mr
	s := schedule{mr: mr, tiles: (rows + mr - 1) / mr, panels: l.panels}
	workers := l.pool.Workers()
	panelBytes := l.in * panelWidth * 4
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

func (s schedule) count() int {
	return ((s.tiles + s.tileGroup - 1) / s.tileGroup) * ((s.panels + s.panelGroup - 1) / s.panelGroup)
}

// task computes one block of tiles × panels: panel-major, so a panel stays in cache while the
// block's row tiles stream past it.
func (l *Linear) task(dst []float32, ldc int, x []float32, lda int, rows int, s schedule, t int) {
	tg, pg := t/s.panelGroups, t%s.panelGroups
	t0, t1 := tg*s.tileGroup, min(s.tiles, (tg+1)*s.tileGroup)
	p0, p1 := pg*s.panelGroup, min(s.panels, (pg+1)*s.panelGroup)
	in, out := l.in, l.out
	for p := p0; p < p1; p++ {
		w := l.w[p*in*panelWidth : (p+1)*in*panelWidth]
		col := p * panelWidth
		ncols := min(panelWidth, out-col)
		for tile := t0; tile < t1; tile++ {
			m0 := tile * s.mr
			mr := min(s.mr, rows-m0)
			l.impl.tile(dst[m0*ldc+col:], ldc, x[m0*lda:], lda, w, in, mr, ncols)
		}
	}
}
