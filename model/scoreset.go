package model

import (
	"slices"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// scoreSet gathers the scores calls of one stretch of keys — the same positions of a block for
// several KV heads, each with its own query and score rows — and runs them as one
// kernel.RowDotsSet (kernel.RowDotsBF16Set) call, whose AVX-512 kernels take several heads' keys
// at once: decode's two query rows a KV head then keep 4–8 independent FMA chains in flight
// instead of 2. Every score is the one kernel.RowDots computes (one FMA chain over d), so
// nothing of the results changes. FP8 keys of a bfloat16-exact table are widened to bfloat16
// into the set's own scratch (wide, n·hd values a call, hd apart) and gathered as bfloat16 keys;
// other FP8 keys, widened to float32 per call, are not gathered.
type scoreSet struct {
	dst, q [][]float32
	k      [][]float32
	k16    [][]uint16
	// wide holds the widened FP8 keys of the gathered calls, call i's at i·n·hd (k16's entries
	// are set from it at flush: it may move as it grows).
	wide []uint16
	// The shapes the gathered calls share; fp8: their keys are widened FP8 ones.
	ldd, ldq, rows, ldk, n, hd int
	fp8                        bool
}

// add gathers the scores of rows query rows x (ldx apart) against the n keys of view v from
// offset o on, into dst (ldd apart), as v.rowProducts computes them; FP8 keys that are not
// bfloat16-exact are run now. A call of other shapes than the gathered ones runs those first.
func (s *scoreSet) add(sc *attnScratch, v *headView, dst []float32, ldd int, x []float32, ldx, rows, o, n, hd int) {
	fp8 := v.k8 != nil
	if fp8 && !v.keysBF16() {
		v.rowProducts(sc, false, dst, ldd, x, ldx, rows, o, n, hd)
		return
	}
	bf16, ldk := v.k16 != nil || fp8, v.stride
	if fp8 {
		ldk = hd
	}
	if len(s.dst) > 0 && (ldd != s.ldd || ldx != s.ldq || rows != s.rows || ldk != s.ldk || n != s.n || hd != s.hd || bf16 != (len(s.k16) > 0) || fp8 != s.fp8) {
		s.flush()
	}
	s.ldd, s.ldq, s.rows, s.ldk, s.n, s.hd, s.fp8 = ldd, ldx, rows, ldk, n, hd, fp8
	s.dst, s.q = append(s.dst, dst), append(s.q, x)
	switch {
	case fp8:
		i := len(s.k16) * n * hd
		s.wide = slices.Grow(s.wide[:i], n*hd)[:i+n*hd] // no clearing: every value is written
		v.widenKeysBF16(s.wide[i:], o, n, hd)
		s.k16 = append(s.k16, nil)
	case bf16:
		s.k16 = append(s.k16, v.k16[o:])
	default:
		s.k = append(s.k, v.k[o:])
	}
}

// flush runs the gathered calls and forgets them (keeping the slices' room).
func (s *scoreSet) flush() {
	if s.fp8 {
		for i := range s.k16 {
			s.k16[i] = s.wide[i*s.n*s.hd : (i+1)*s.n*s.hd]
		}
	}
	switch {
	case len(s.k16) > 0:
		kernel.RowDotsBF16Set(s.dst, s.ldd, s.q, s.ldq, s.rows, s.k16, s.ldk, s.n, s.hd)
	case len(s.k) > 0:
		kernel.RowDotsSet(s.dst, s.ldd, s.q, s.ldq, s.rows, s.k, s.ldk, s.n, s.hd)
	}
	clear(s.dst)
	clear(s.q)
	clear(s.k)
	clear(s.k16)
	s.dst, s.q, s.k, s.k16 = s.dst[:0], s.q[:0], s.k[:0], s.k16[:0]
}
