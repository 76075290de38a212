package kernel

import "unsafe"

// How an int8 Linear's Apply spreads its work (the chains themselves are fixed: see int8.go).
//
// The rows are quantized once per product, split into row tiles of balanced heights (at most
// int8TileRows: 8 rows are two tiles of 4, 32 rows 5, 5, 5, 5, 6, 6), each tile's activations
// laid out for its kernel. A task runs a group of row tiles over a run of consecutive panels;
// within a panel it goes block of K by block of K (int8KBlockGroups groups), every tile of the
// group taking its turn on the block while it sits in L1, the chains carried over from block to
// block in the output, and the tiles prefetch the next block (or the next panel's first) in
// equal shares as they go, so that the weights stream from memory once per group of row tiles,
// under the arithmetic.
// Decode-sized batches are one group of row tiles over two runs of panels per worker, like the
// bfloat16 products (schedule.streamPanels); a prefill's rows are split into groups whose
// activations fit half of l2Budget.

// int8KBlockGroups is the most groups of K a block has when several row tiles share a panel:
// 8 groups are 18 KB of a panel plus up to 10 KB of 32 rows' activations, within a core's L1.
const int8KBlockGroups = 8

// int8Plan is how an int8 product's row tiles and panels are split into tasks.
type int8Plan struct {
	rows, tiles             int // row tile t holds rows [t·rows/tiles, (t+1)·rows/tiles)
	tileGroup, tileGroups   int // row tiles per task, and groups of them
	panelGroup, panelGroups int // panels per task, and runs of them (the last tail of two panels)
	kb                      int // groups of K per block
	tail                    int // two-panel runs that end a one-row product
}

// tasks returns the number of tasks.
func (s int8Plan) tasks() int { return s.tileGroups * s.panelGroups }

// ranges returns task t's row tiles [t0, t1) and panels [p0, p1) of panels panels.
func (s int8Plan) ranges(t, panels int) (t0, t1, p0, p1 int) {
	tg, pg := t/s.panelGroups, t%s.panelGroups
	p0, p1 = panelRun(pg, s.panelGroup, s.panelGroups, panels, s.tail, 2)
	return tg * s.tileGroup, min(s.tiles, (tg+1)*s.tileGroup), p0, p1
}

// tileRows returns row tile t's first row and its height.
func (s int8Plan) tileRows(t int) (m0, mr int) {
	m0 = t * s.rows / s.tiles
	return m0, (t+1)*s.rows/s.tiles - m0
}

// int8Plan plans a product of rows rows on workers workers.
func (l *Linear) int8Plan(rows, workers int) int8Plan {
	groups := l.i8.groups
	s := int8Plan{rows: rows, tiles: (rows + int8TileRows - 1) / int8TileRows, kb: groups}
	if rows == 1 { // the one-row path pairs whole panels (see applyInt8)
		// 2·workers long runs, then (with panels enough) 2·workers pairs, so that the workers
		// finish within a pair of one another (Linear.endWithSingles).
		tasks := min(l.panels, 2*workers)
		head := l.panels
		if l.panels >= 8*workers {
			s.tail = 2 * workers
			head -= 2 * s.tail
		}
		s.tileGroup, s.tileGroups = 1, 1
		s.panelGroup = (head + tasks - 1) / tasks
		s.panelGroup += s.panelGroup % 2 // the runs start on a pair
		s.panelGroups = (head+s.panelGroup-1)/s.panelGroup + s.tail
		return s
	}
	tileBytes := int8TileRows * groups * (Int8Group + 8) // a full tile's values, scales and corrections
	s.tileGroup = max(1, min(s.tiles, l2Budget/2/tileBytes))
	s.tileGroups = (s.tiles + s.tileGroup - 1) / s.tileGroup
	runs := max(1, (2*workers+s.tileGroups-1)/s.tileGroups) // runs of panels per group of row tiles
	s.panelGroup = (l.panels + runs - 1) / runs
	s.panelGroups = (l.panels + s.panelGroup - 1) / s.panelGroup
	if s.tileGroup > 1 && groups > int8KBlockGroups {
		n := (groups + int8KBlockGroups - 1) / int8KBlockGroups
		s.kb = (groups + n - 1) / n
	}
	return s
}

// applyInt8 runs Apply for an int8 Linear (see the top of this file).
func (l *Linear) applyInt8(dst []float32, ldc int, x []float32, lda int, rows int) {
	if l.panels == 0 {
		return
	}
	w := l.i8
	groups := w.groups
	kpad := groups * Int8Group
	s := l.int8Plan(rows, l.pool.Workers())
	// One buffer: the int8 rows (kpad/4 words each), then the scales, then the corrections.
	buf, put := l.pool.pairBuffer(rows*kpad/4 + 2*rows*groups)
	defer put()
	q := unsafe.Slice((*int8)(unsafe.Pointer(&buf[0])), rows*kpad)
	d := unsafe.Slice((*float32)(unsafe.Pointer(&buf[rows*kpad/4])), rows*groups)
	corr := unsafe.Slice((*int32)(unsafe.Pointer(&buf[rows*kpad/4+rows*groups])), rows*groups)
	acts := func(t int) int8Acts {
		m0, mr := s.tileRows(t)
		return int8Acts{q: q[m0*kpad : (m0+mr)*kpad], d: d[m0*groups : (m0+mr)*groups], corr: corr[m0*groups : (m0+mr)*groups], mr: mr}
	}
	quantize := func(t int) {
		m0, _ := s.tileRows(t)
		w.quantize(acts(t), x[m0*lda:], lda, l.in)
	}
	if rows < 16 {
		for t := range s.tiles {
			quantize(t)
		}
	} else { // tile by tile on the pool (the split changes no bit)
		l.pool.Parallel(s.tiles, quantize)
	}
	gb := groups * int8GroupBytes // one panel
	task := func(t int) {
		t0, t1, p0, p1 := s.ranges(t, l.panels)
		if rows == 1 {
			// One row: two whole panels per kernel call (two weight streams, twice the chains).
			for ; p0+1 < p1 && (p0+2)*panelWidth <= l.out; p0 += 2 {
				w.tile(dst[p0*panelWidth:], ldc, acts(0), w.b[p0*gb:(p0+2)*gb], groups, 2*panelWidth, nil, false)
			}
		}
		for p := p0; p < p1; p++ {
			pw := w.b[p*gb : (p+1)*gb]
			col := p * panelWidth
			ncols := min(panelWidth, l.out-col)
			for g0 := 0; g0 < groups; g0 += s.kb {
				gn := min(s.kb, groups-g0)
				var next []byte // the block the tiles prefetch
				switch {
				case g0+gn < groups:
					next = pw[(g0+gn)*int8GroupBytes : min(groups, g0+gn+s.kb)*int8GroupBytes]
				case p+1 < p1:
					next = w.b[(p+1)*gb : (p+1)*gb+min(groups, s.kb)*int8GroupBytes]
				}
				share := (len(next)/64 + t1 - t0 - 1) / (t1 - t0) * 64 // whole lines each
				for ti := t0; ti < t1; ti++ {
					var pf []byte
					if o := (ti - t0) * share; o < len(next) {
						pf = next[o:min(len(next), o+share)]
					}
					m0, _ := s.tileRows(ti)
					w.tile(dst[m0*ldc+col:], ldc, acts(ti).from(g0), pw[g0*int8GroupBytes:(g0+gn)*int8GroupBytes], gn, ncols, pf, g0 > 0)
				}
			}
		}
	}
	if s.tasks() == 1 {
		task(0)
		return
	}
	l.pool.Parallel(s.tasks(), task)
}
