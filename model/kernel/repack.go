package kernel

import "fmt"

// SetRows re-packs l in place as the out × in matrix W whose row n is row(n)[:in] (the weights
// of output n), for matrices assembled from rows that live elsewhere (attention keys read from
// a paged KV store). It reuses l's storage, growing it only when it is too small, so a Linear
// kept in a scratch buffer is re-filled without allocating; the zero Linear is a valid
// receiver. Apply then runs on pool's workers (nil: short-lived goroutines).
//
// Packing only moves data, so l computes exactly — bit for bit — what NewLinearOn(pool, W, out,
// in) computes. row is called once for every n, in ascending order; its result must have at
// least in elements (SetRows panics otherwise) and is not retained. l must not be used by any
// other goroutine while it is re-packed.
func (l *Linear) SetRows(pool *Pool, out, in int, row func(n int) []float32) {
	l.reset(pool, out, in)
	if in == 0 {
		for n := range out {
			row(n)
		}
		return
	}
	g := l.impl.tgroup // rows transposed per kernel call (0: none)
	blocks := 0        // whole g×g blocks along in
	if g > 0 {
		blocks = in / g
	}
	var ptrs [16]*float32
	for p := range l.panels {
		dst := l.w[p*in*panelWidth : (p+1)*in*panelWidth]
		cols := min(panelWidth, out-p*panelWidth)
		j := 0
		for ; blocks > 0 && j+g <= cols; j += g {
			for i := range g {
				r := row(p*panelWidth + j + i)[:in]
				ptrs[i] = &r[0]
				for k := blocks * g; k < in; k++ { // columns past the last whole block
					dst[k*panelWidth+j+i] = r[k]
				}
			}
			l.impl.transpose(&dst[j], panelWidth, &ptrs, blocks)
		}
		for ; j < cols; j++ {
			for k, v := range row(p*panelWidth + j)[:in] {
				dst[k*panelWidth+j] = v
			}
		}
		if cols < panelWidth {
			for k := range in {
				clear(dst[k*panelWidth+cols : (k+1)*panelWidth])
			}
		}
	}
}

// SetColumns is [Linear.SetRows] for a matrix given column by column: col(k)[:out] is column k
// of W (input k's weight in every output; attention values read from a KV store). col is
// called once for every k, in ascending order.
func (l *Linear) SetColumns(pool *Pool, out, in int, col func(k int) []float32) {
	l.reset(pool, out, in)
	for k := range in {
		c := col(k)[:out]
		for p := range l.panels {
			cols := min(panelWidth, out-p*panelWidth)
			d := l.w[(p*in+k)*panelWidth : (p*in+k+1)*panelWidth]
			copy(d, c[p*panelWidth:p*panelWidth+cols])
			clear(d[cols:])
		}
	}
}

// reset gives l the shape out × in, reusing its storage when large enough.
func (l *Linear) reset(pool *Pool, out, in int) {
	if out < 0 || in < 0 {
		panic(fmt.Sprintf("kernel.Linear: out = %d, in = %d", out, in))
	}
	panels := (out + panelWidth - 1) / panelWidth
	n := panels * in * panelWidth
	if cap(l.w) < n {
		l.w = make([]float32, n)
	}
	l.w = l.w[:n]
	l.out, l.in, l.panels, l.pool, l.dtype, l.h = out, in, panels, pool, F32, nil
	if l.impl == nil {
		l.impl = defaultImpl
	}
}
