package kernel

import (
	"encoding/binary"
	"fmt"
	"math"
)

// Weight-only int8 products (a Linear built with NewLinearInt8From).
//
// Weights are quantized once, at load, in groups of Int8Group consecutive inputs of one output
// row: d = amax/127 (float32), q = round(w·(1/d)) in [-127, 127] — llama.cpp's Q8_0 rule, with
// the scale kept in float32 instead of float16 — then refined by least squares (refineInt8: the
// best of the scales amax/127, amax/126 and amax/125, each refitted to its q; on kvbridge/small
// it lowers the mean KL divergence from float32 by 2–3%, a third more than the rule alone with
// float32 scales, at twice the load-time cost). Apply quantizes each input row by the plain
// rule (cheap enough for every call), per group, so a row's int8 values depend on that row
// alone, and every output element is one fixed chain over the groups, g ascending:
//
//	acc = 0
//	for g: s = Σ_{k in g} qx[k]·qw[k]        // exact, int32
//	       acc = acc + float32(float32(s) · float32(dw[g]·dx[g]))
//
// with each product and sum rounded once to float32 (no fused multiply-add). The int32 sums
// are exact and the float steps are the same IEEE operations in the same order in AVX-512 VNNI
// (VPDPBUSD, then VCVTDQ2PS, VMULPS, VMULPS, VADDPS) and in portable Go, so both give the same
// bits (TestInt8KernelsAgree). Like every Linear, the result of a row does not depend on the
// other rows of the batch.
//
// Why groups of 32: it is Q8_0's block, so the quality matches llama.cpp's int8 at least (a
// larger group, 128 or a whole row, lets one outlier coarsen more weights); 32 inputs are 8
// VPDPBUSD steps of 4 inputs each into an int32 accumulator that cannot overflow
// (32·255·127 < 2³¹), and a group of a 64-column panel is 2 KB of weights plus 256 bytes of
// scales, so a scale costs 1/8 of a byte per weight. The k dimensions of the supported
// architectures are multiples of 32; other k are padded with zero weights.
//
// Activations are quantized to int8 (rather than the weights widened to float32 in registers)
// because VPDPBUSD does 64 multiply-adds per instruction on bytes read straight from the
// panel: batch-1 decode then runs at the memory bandwidth with cycles to spare, and a VPDPBUSD
// does four times the multiply-adds of a float32 FMA for prefill.

// Int8Group is the number of consecutive inputs that share one scale in an int8 Linear.
const Int8Group = 32

// int8TileRows is the most rows one int8 tile computes (its int32 group sums fill 24 of the 32
// zmm registers; the float32 chains live in the output, see int8gen.go).
const int8TileRows = 6

// int8GroupBytes is the bytes of one group of a 64-column panel: 8 steps × 64 columns × 4
// weights as bytes (q+128, k%4 fastest), then 64 float32 scales.
const int8GroupBytes = Int8Group*panelWidth + 4*panelWidth

// int8Weights are the panels of an int8 Linear and its tile kernel.
type int8Weights struct {
	groups int    // ceil(in / Int8Group)
	b      []byte // panel p, group g at b[(p*groups+g)*int8GroupBytes:]
	tile   int8TileFunc
	// roundScale, if not nil, rounds every scale once its group is quantized (the weights' at
	// load, the activations' in Apply).
	roundScale func(float32) float32
}

// int8TileFunc computes rows [0,a.mr) × columns [0,ncols) of one int8 panel over its first
// groups groups (see tileInt8Generic), continuing the chains held in c when cont, prefetching
// pf on the way (nil: nothing); or with a.mr = 1 and ncols = 2·panelWidth, of two consecutive
// whole panels (w holds both; cont false, pf nil).
type int8TileFunc func(c []float32, ldc int, a int8Acts, w []byte, groups, ncols int, pf []byte, cont bool)

// int8Acts are the quantized activations of one row tile of mr rows, laid out for the tile
// kernels: the int8 values of group g, step s (4 inputs) and row m at q[4·((8g+s)·mr+m):], 4
// bytes; the row's scale and correction (−128 · the group's sum of q) at d[g·mr+m] and
// corr[g·mr+m]. With one row that is the row's values in order.
type int8Acts struct {
	q    []int8
	d    []float32
	corr []int32
	mr   int
}

// from returns the activations from group g on.
func (a int8Acts) from(g int) int8Acts {
	a.q, a.d, a.corr = a.q[g*Int8Group*a.mr:], a.d[g*a.mr:], a.corr[g*a.mr:]
	return a
}

// quantize quantizes the tile's rows x[m*lda : m*lda+in] (m < a.mr) as QuantizeInt8 does
// (whole groups with AVX-512 where the CPU has it, the same bits), rounds their scales with
// roundScale, and lays them out as a holds them.
func (w *int8Weights) quantize(a int8Acts, x []float32, lda, in int) {
	var qs [Int8Group]int8
	whole := in / Int8Group * Int8Group
	for m := range a.mr {
		row := x[m*lda : m*lda+in]
		for g := 0; g < w.groups; {
			if g*Int8Group < whole {
				if n := quantizeGroups(a, m, g, row[g*Int8Group:whole]); n > 0 {
					g += n
					continue
				}
			}
			d, s := quantizeGroupInt8(&qs, row[g*Int8Group:min(in, (g+1)*Int8Group)])
			a.d[g*a.mr+m], a.corr[g*a.mr+m] = d, -128*s
			for st := range Int8Group / 4 {
				copy(a.q[4*((Int8Group/4*g+st)*a.mr+m):][:4], qs[4*st:])
			}
			g++
		}
		if w.roundScale != nil {
			for g := range w.groups {
				a.d[g*a.mr+m] = w.roundScale(a.d[g*a.mr+m])
			}
		}
	}
}

// QuantizeInt8 quantizes x in groups of Int8Group as an int8 Linear quantizes its weights and
// its inputs: for each group, d = amax/127 and q[i] = round(x[i]·(1/d)) (half away from zero,
// clamped to ±127; all zero when amax is 0). q has len(x) rounded up to Int8Group elements
// (the padding zero), d one per group. It returns the sums of each group's q as well.
func QuantizeInt8(q []int8, d []float32, sums []int32, x []float32) {
	groups := (len(x) + Int8Group - 1) / Int8Group
	_, _, _ = q[groups*Int8Group-1], d[groups-1], sums[groups-1]
	for g := range groups {
		d[g], sums[g] = quantizeGroupInt8((*[Int8Group]int8)(q[g*Int8Group:]), x[g*Int8Group:min(len(x), (g+1)*Int8Group)])
	}
}

// quantizeGroupInt8 quantizes one group xs (at most Int8Group values) into q, zero past
// len(xs), and returns its scale and the sum of q.
func quantizeGroupInt8(q *[Int8Group]int8, xs []float32) (float32, int32) {
	amax := absMax(xs)
	dg := amax / 127
	var id float32
	if dg != 0 {
		id = 1 / dg
	}
	var s int32
	for i := range q {
		var v int8
		if i < len(xs) {
			v = roundInt8(xs[i] * id)
		}
		q[i] = v
		s += int32(v)
	}
	return dg, s
}

// roundInt8 rounds v to the nearest integer, halves away from zero (C's roundf), clamped to
// ±127; NaN gives 0. Adding ±½ to a float32 is exact in float64, so the conversion's truncation
// rounds exactly (without branches on the value, which a quantization loop mispredicts).
func roundInt8(v float32) int8 {
	if v != v {
		return 0
	}
	f := float64(v)
	f = min(127, max(-127, f+math.Copysign(0.5, f)))
	return int8(int32(f))
}

// absMax returns the largest |v| of x (0 for an empty x).
func absMax(x []float32) float32 {
	var m float32
	for _, v := range x {
		m = max(m, math.Float32frombits(math.Float32bits(v)&0x7fffffff))
	}
	return m
}

// int8Candidates are the levels c of the scales amax/c refineInt8 tries for a weight group.
var int8Candidates = [...]float32{127, 126, 125}

// refineInt8 improves the quantization of the weights x (q, d as QuantizeInt8 made them, in
// groups of Int8Group): for each group it tries the int8 values q = round(x·c/amax) for every
// level c of int8Candidates, each with its least-squares scale d = Σ x·q / Σ q² (the d that
// minimises Σ (x − d·q)² for those q), and keeps the pair of the smallest squared error. The
// level 127 is Q8_0's own q, so the error is never larger than Q8_0's rule with a float32
// scale. Every sum runs in float64 in one fixed order (with explicit roundings, so that no
// compiler fuses them): the result does not depend on the machine.
func refineInt8(q []int8, d []float32, x []float32) {
	var trial [Int8Group]int8
	for g := range d {
		xs := x[g*Int8Group : min(len(x), (g+1)*Int8Group)]
		amax := absMax(xs)
		if amax == 0 {
			continue
		}
		best := math.Inf(1)
		for _, c := range int8Candidates {
			id := c / amax
			var sxq, sqq float64
			for i, v := range xs {
				t := roundInt8(v * id)
				trial[i] = t
				sxq += float64(float64(v) * float64(t))
				sqq += float64(float64(t) * float64(t))
			}
			if sqq == 0 {
				continue
			}
			dc := float32(sxq / sqq)
			var e float64
			for i, v := range xs {
				r := float64(v) - float64(float32(float32(trial[i])*dc))
				e += float64(r * r)
			}
			if e < best {
				best, d[g] = e, dc
				copy(q[g*Int8Group:], trial[:len(xs)])
			}
		}
	}
}

// NewLinearInt8From is [NewLinearFrom] with the weights quantized to int8 in groups of
// Int8Group inputs (see the top of int8.go): row(n, dst) writes W[n] as float32 (widened from
// the checkpoint). Apply quantizes its input rows the same way and sums int8 products exactly
// in int32 per group — VPDPBUSD where the CPU has AVX-512 VNNI ([Int8Products] says which),
// the same bits in portable Go elsewhere. Like every Linear it is batch-invariant.
func NewLinearInt8From(pool *Pool, out, in int, row func(n int, dst []float32)) *Linear {
	if out < 0 || in < 0 {
		panic(fmt.Sprintf("kernel.NewLinearInt8From: out = %d, in = %d", out, in))
	}
	return newLinearInt8(defaultInt8Tile, pool, out, in, nil, row)
}

// NewLinearInt8ScaledFrom is [NewLinearInt8From] with the weights quantized by the plain rule
// (d = amax/127, no least-squares refinement) and every scale — the weights' at load and the
// activations' in Apply — rounded by roundScale once its group is quantized (the int8 values
// stay those of the float32 scale). Rounding to float16 gives llama.cpp's Q8_0 blocks
// and its Q8_0 × Q8_0 products, which kvbridge bench quality simulates this way.
func NewLinearInt8ScaledFrom(pool *Pool, out, in int, roundScale func(float32) float32, row func(n int, dst []float32)) *Linear {
	if out < 0 || in < 0 {
		panic(fmt.Sprintf("kernel.NewLinearInt8ScaledFrom: out = %d, in = %d", out, in))
	}
	return newLinearInt8(defaultInt8Tile, pool, out, in, roundScale, row)
}

// newLinearInt8 quantizes and packs the rows of W panel by panel in parallel, for tile.
func newLinearInt8(tile int8TileFunc, pool *Pool, out, in int, roundScale func(float32) float32, row func(n int, dst []float32)) *Linear {
	l := &Linear{out: out, in: in, panels: (out + panelWidth - 1) / panelWidth, dtype: I8, pool: pool, impl: defaultImpl}
	groups := (in + Int8Group - 1) / Int8Group
	w := &int8Weights{groups: groups, b: make([]byte, l.panels*groups*int8GroupBytes), tile: tile, roundScale: roundScale}
	l.i8 = w
	if in == 0 {
		return l
	}
	for i := range w.b { // q = 0 everywhere, padding included
		w.b[i] = 128
	}
	pool.Parallel(l.panels, func(p int) {
		buf := make([]float32, in)
		q := make([]int8, groups*Int8Group)
		d := make([]float32, groups)
		sums := make([]int32, groups)
		for j := range min(panelWidth, out-p*panelWidth) {
			row(p*panelWidth+j, buf)
			QuantizeInt8(q, d, sums, buf)
			if roundScale == nil {
				refineInt8(q, d, buf)
			}
			w.round(d)
			for g := range groups {
				blk := w.b[(p*groups+g)*int8GroupBytes:]
				for k := range Int8Group {
					blk[(k/4)*4*panelWidth+4*j+k%4] = byte(int(q[g*Int8Group+k]) + 128)
				}
				binary.LittleEndian.PutUint32(blk[Int8Group*panelWidth+4*j:], math.Float32bits(d[g]))
			}
		}
	})
	return l
}

// round applies roundScale to the scales d.
func (w *int8Weights) round(d []float32) {
	if w.roundScale != nil {
		for i, v := range d {
			d[i] = w.roundScale(v)
		}
	}
}

// Int8Products names how this process computes int8 products: "VPDPBUSD" (AVX-512 VNNI) or
// "portable Go" (the same bits, much slower).
func Int8Products() string {
	if hasInt8Asm() {
		return "VPDPBUSD"
	}
	return "portable Go"
}

// int8Bytes returns the bytes an int8 Linear streams per pass: one byte a weight plus a float32
// scale per group.
func (l *Linear) int8Bytes() int64 {
	return int64(l.out) * (int64(l.in) + 4*int64(l.i8.groups))
}

// int8Row writes row n of an int8 Linear, dequantized (q·d), into dst.
func (l *Linear) int8Row(n int, dst []float32) {
	p, j := n/panelWidth, n%panelWidth
	for g := range l.i8.groups {
		blk := l.i8.b[(p*l.i8.groups+g)*int8GroupBytes:]
		d := l.i8Scale(n, g)
		for k := g * Int8Group; k < min(l.in, (g+1)*Int8Group); k++ {
			kk := k - g*Int8Group
			dst[k] = float32(int(blk[(kk/4)*4*panelWidth+4*j+kk%4])-128) * d
		}
	}
}

// tileInt8Generic is the portable chain of int8 products (see the top of int8.go) for rows
// [0,a.mr) × columns [0,ncols) of an int8 panel over its first groups groups, continuing the
// chains in c when cont.
func tileInt8Generic(c []float32, ldc int, a int8Acts, w []byte, groups, ncols int, _ []byte, cont bool) {
	if ncols > panelWidth { // two whole panels
		for q := range 2 {
			tileInt8Generic(c[q*panelWidth:], ldc, a, w[q*groups*int8GroupBytes:], groups, panelWidth, nil, false)
		}
		return
	}
	_ = w[groups*int8GroupBytes-1]
	for m := range a.mr {
		for j := range ncols {
			var acc float32
			if cont {
				acc = c[m*ldc+j]
			}
			for g := range groups {
				blk := w[g*int8GroupBytes : (g+1)*int8GroupBytes]
				var s int32
				for k := range Int8Group {
					xv := a.q[4*((Int8Group/4*g+k/4)*a.mr+m)+k%4]
					s += (int32(blk[(k/4)*4*panelWidth+4*j+k%4]) - 128) * int32(xv)
				}
				dw := math.Float32frombits(binary.LittleEndian.Uint32(blk[Int8Group*panelWidth+4*j:]))
				d := dw * a.d[g*a.mr+m]
				acc = acc + float32(float32(s)*d)
			}
			c[m*ldc+j] = acc
		}
	}
}

// i8Scale returns the scale of group g of output n.
func (l *Linear) i8Scale(n, g int) float32 {
	blk := l.i8.b[((n/panelWidth)*l.i8.groups+g)*int8GroupBytes:]
	return math.Float32frombits(binary.LittleEndian.Uint32(blk[Int8Group*panelWidth+4*(n%panelWidth):]))
}
