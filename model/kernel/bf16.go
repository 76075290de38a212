package kernel

import (
	"fmt"
	"math"
)

// Products with bfloat16 inputs (a BF16 Linear built with NewLinearBF16Dot).
//
// Each output element is one fixed chain over the pairs of k, k ascending:
//
//	acc = 0
//	for each pair (2q, 2q+1): acc = round(acc + x[2q+1]·w[2q+1]); acc = round(acc + x[2q]·w[2q])
//
// where x are the activations rounded to bfloat16 (to nearest even, denormals to zero, NaNs
// quiet), w the bfloat16 weights, every product is exact (two 8-bit significands), each sum is
// rounded once to float32 (nearest even), denormal inputs read as zero and denormal sums become
// zero. That is what AVX512_BF16's VDPBF16PS computes per lane (the odd element of a pair first;
// measured on the hardware by TestBF16ProductsMatchHardware), so the instruction and the portable
// Go chain (bf16Step) give the same bits. An odd k is padded with a zero pair element.

// kBlock is the most steps of k (pairs of a BF16 panel, single k of an F16 one) a task of
// several row tiles runs its tiles over at a time, when a panel has more than 2·kBlock steps
// (see kBlockSteps).
const kBlock = 256

// BF16Round rounds f to bfloat16 as the activations of bfloat16 products are rounded
// (VCVTNE2PS2BF16): to nearest even, denormals to signed zero, NaNs quiet. Unlike F32ToBF16 it
// flushes denormals.
func BF16Round(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7f800000 == 0 {
		return uint16(b>>16) & 0x8000
	}
	return F32ToBF16(f)
}

// daz returns the value of a bfloat16, with denormals as zero of the same sign.
func daz(h uint16) float64 {
	if h&0x7f80 == 0 {
		h &= 0x8000
	}
	return float64(BF16ToF32(h))
}

// ftz returns f with a denormal as zero (keeping the sign).
func ftz(f float32) float32 {
	if b := math.Float32bits(f); b&0x7f800000 == 0 {
		return math.Float32frombits(b & 0x80000000)
	}
	return f
}

// roundSum returns p+c rounded once to float32 for a p exact in float64 (a product of two
// bfloat16s): the float64 sum is turned into its round-to-odd value (Boldo–Melquiond), from
// which one rounding to float32 is the correctly rounded result because float64 has more than
// 24+2 significand bits.
func roundSum(p float64, c float32) float32 {
	s := p + float64(c)
	if math.IsInf(s, 0) || math.IsNaN(s) {
		return float32(s)
	}
	bb := s - p
	err := (p - (s - bb)) + (float64(c) - bb) // TwoSum: s + err == p + c exactly
	if err != 0 && math.Float64bits(s)&1 == 0 {
		if (err > 0) == (s > 0) {
			s = math.Float64frombits(math.Float64bits(s) + 1)
		} else {
			s = math.Float64frombits(math.Float64bits(s) - 1)
		}
	}
	return float32(s)
}

// bf16Step is one VDPBF16PS lane: acc plus the products of the activation pair x and the weight
// pair w (low 16 bits: even k, high: odd k), odd first.
func bf16Step(acc float32, x, w uint32) float32 {
	acc = ftz(acc)
	acc = ftz(roundSum(daz(uint16(x>>16))*daz(uint16(w>>16)), acc))
	return ftz(roundSum(daz(uint16(x))*daz(uint16(w)), acc))
}

// toPairsGeneric rounds src to bfloat16 pairs: dst[i] holds src[2i] (low half) and src[2i+1]
// (high half; 0 past the end).
func toPairsGeneric(dst []uint32, src []float32) {
	for i := range (len(src) + 1) / 2 {
		lo := uint32(BF16Round(src[2*i]))
		var hi uint32
		if 2*i+1 < len(src) {
			hi = uint32(BF16Round(src[2*i+1]))
		}
		dst[i] = lo | hi<<16
	}
}

// tileDotGeneric is the portable chain of bfloat16 products for rows [0,mr) × columns [0,ncols)
// of a BF16 panel; a holds the rows' activation pairs, lda pairs apart. With cont the chains
// continue from c.
func tileDotGeneric(c []float32, ldc int, a []uint32, lda int, w []uint16, kp, mr, ncols int, _ []uint16, cont bool) {
	for m := range mr {
		x := a[m*lda : m*lda+kp]
		for j := range ncols {
			var acc float32
			if cont {
				acc = c[m*ldc+j]
			}
			for q, xv := range x {
				wv := uint32(w[q*2*panelWidth+2*j]) | uint32(w[q*2*panelWidth+2*j+1])<<16
				acc = bf16Step(acc, xv, wv)
			}
			c[m*ldc+j] = acc
		}
	}
}

// NewLinearBF16Dot is [NewLinear16From] for BF16 weights whose products take bfloat16
// activations: Apply rounds the input rows to bfloat16 (BF16Round) and sums the products in
// float32 with the chain described at the top of bf16.go — VDPBF16PS where the CPU has
// AVX512_BF16 ([BF16Products] says which), the same chain in portable Go elsewhere. Like every
// Linear it is batch-invariant. row(n, dst) writes W[n] as bfloat16 bits.
func NewLinearBF16Dot(pool *Pool, out, in int, row func(n int, dst []uint16)) *Linear {
	if out < 0 || in < 0 {
		panic(fmt.Sprintf("kernel.NewLinearBF16Dot: out = %d, in = %d", out, in))
	}
	l := newLinear16(defaultImpl, pool, BF16, out, in, row)
	l.bf16Dot = true
	return l
}

// BF16Products names how this process computes bfloat16 products: "VDPBF16PS" (AVX512_BF16)
// or "portable Go" (the same bits, much slower).
func BF16Products() string {
	if defaultImpl.tileDot != nil {
		return "VDPBF16PS"
	}
	return "portable Go"
}

// applyBF16Dot runs Apply for a Linear with bfloat16 products: the rows are rounded to pairs
// once, then the tiles run on them.
func (l *Linear) applyBF16Dot(dst []float32, ldc int, x []float32, lda int, rows int) {
	kp := (l.in + 1) / 2
	pairs, put := l.pool.pairBuffer(rows * kp)
	defer put()
	toPairs := l.impl.toPairs
	if toPairs == nil {
		toPairs = toPairsGeneric
	}
	for m := range rows {
		toPairs(pairs[m*kp:(m+1)*kp], x[m*lda:m*lda+l.in])
	}
	s := l.scheduleDot(rows)
	// A few rows (batched decode): see streamPanels.
	s.streamPanels(rows*kp*4, l.pool.Workers())
	if rows == 1 && l.impl.tileDotWide != nil {
		s.widePanels()
		s.endWithSingles(l.pool.Workers())
	}
	if s.tasks() == 1 {
		l.dotTask(dst, ldc, pairs, kp, rows, s, 0)
		return
	}
	l.pool.Parallel(s.tasks(), func(t int) { l.dotTask(dst, ldc, pairs, kp, rows, s, t) })
}

// dotTask is task for bfloat16 products.
func (l *Linear) dotTask(dst []float32, ldc int, a []uint32, kp int, rows int, s schedule, t int) {
	t0, t1, p0, p1 := s.ranges(t)
	tile := l.impl.tileDot
	if tile == nil {
		tile = tileDotGeneric
	}
	stride := l.panel16Len()
	if rows == 1 && l.impl.tileDotWide != nil {
		// Four (or two) whole panels at a time: as many weight streams and independent chains
		// (two panels measured 10–14% more of the read bandwidth than one, four 5–15% more
		// than two).
		for np := widePanelRun(p0, p1, l.out); np > 0; np = widePanelRun(p0, p1, l.out) {
			l.impl.tileDotWide(dst[p0*panelWidth:], a, l.h[p0*stride:(p0+np)*stride], kp, np)
			p0 += np
		}
	}
	switch {
	case s.halves == 2:
		tile = l.impl.tileDotHalf
	case s.mr > l.impl.mr:
		tile = l.impl.tileDotTall
	}
	l.blockTask(rows, s.tiles, s.halves, t0, t1, p0, p1, kp, 2*panelWidth, func(m0, m1, p, h, k0, kn int, pf []uint16, cont bool) {
		col, ncols := halfColumns(p, h, s.halves, l.out)
		if ncols <= 0 {
			return
		}
		tile(dst[m0*ldc+col:], ldc, a[m0*kp+k0:], kp, l.h[p*stride+k0*2*panelWidth+h*panelWidth:(p+1)*stride], kn, m1-m0, ncols, pf, cont)
	})
}
