package model

import "github.com/kvbridge/kvbridge/model/kernel"

// Decode attention split by positions.
//
// A decoding sequence read in place has work items that cover several KV heads (attention.go),
// so that an item reads each block's keys, then values, of its heads as one stretch. With few
// such sequences in a step (batch 1: one), there are too few items of all heads to keep every
// worker busy, and headSpan gives each item fewer heads: at batch 1 on two workers, 2 of 8, so
// an item reads 4–8 KB stretches (bfloat16, float32) 1.8–3.7 MB apart, where a block's keys of
// all heads are 32–64 KB in one piece; a read of such short stretches ran at half the rate of
// the long ones (docs/performance.md, Limits).
//
// Such a sequence ("split"), if it attends over splitMinChunks chunks or more, is instead divided
// by positions: each work item covers all KV heads of one of its 64-key chunks. The items compute
// the scores of their chunks (one FMA chain over d each, so which item computes a score changes
// nothing), beside the step's other attention items; then, every score being known, the caller
// turns each row into probabilities (kernel.Softmax over all positions, as ever); then the items
// compute, per chunk, its value sums from zero (per value element one chain over the chunk's
// keys, carried from block to block); then the caller adds the chunks' sums in chunk order
// (part_0 + part_1 + …, attention.go's definition). Every number is the one an item of one KV
// head over all positions computes, whichever worker computes it, so the bits depend neither on
// the batch nor on the workers (TestAttentionPositionSplit). It costs one hand-off a layer more
// (the value sums) than one Parallel call of items split by heads.

// splitMinChunks is the fewest chunks a split sequence attends over: at shorter contexts its KV
// is a small part of a step's bytes, and the split's extra hand-off would cost more than its
// longer stretches save.
const splitMinChunks = 8

// splitRun is the chunks of a split sequence's work item: one, so that the workers share them
// evenly (an item reads each block of its chunks, all heads, in one stretch whatever its run).
const splitRun = 1

// splitAttn is a split sequence's attention in the current layer.
type splitAttn struct {
	sa *seqAttn
	// xq holds the token's query rows, per KV head its group's query heads, head after head;
	// scores their score rows, stride apart; parts the value sums of every row, chunk after chunk
	// (rows × HeadDim each).
	xq, scores, parts []float32
	stride            int
}

// posItem is one work item of a split sequence: its chunks [c0, c1), all KV heads.
type posItem struct {
	sp     *splitAttn
	c0, c1 int
}

// splits reports whether sa's attention is split by positions this step: a sequence decoding one
// token read in place, over splitMinChunks chunks or more, when headSpan (span) leaves its items
// fewer than all KV heads, and no test caps the heads of an item (itemHeads).
func (m *Model) splits(sa *seqAttn, span int) bool {
	return m.inPlace && sa.packs < 0 && sa.n == 1 && sa.nch >= splitMinChunks && span < m.cfg.NumKVHeads && m.itemHeads == 0
}

// planSplits fills w.splits and w.posItems for the current layer: for each split sequence its
// query rows and buffers, and its work items of splitRun chunks.
func (m *Model) planSplits(w *workspace, span int) {
	c := m.cfg
	hd, group := c.HeadDim, c.NumHeads/c.NumKVHeads
	rows := c.NumKVHeads * group
	n := 0
	for i := range w.seqAttn {
		if m.splits(&w.seqAttn[i], span) {
			n++
		}
	}
	w.splits = grow(w.splits, n)
	w.posItems = w.posItems[:0]
	n = 0
	for i := range w.seqAttn {
		sa := &w.seqAttn[i]
		if !m.splits(sa, span) {
			continue
		}
		sp := &w.splits[n]
		n++
		sp.sa, sp.stride = sa, sa.nch*attnChunk
		sp.xq = grow(sp.xq, rows*hd)
		sp.scores = grow(sp.scores, rows*sp.stride)
		sp.parts = grow(sp.parts, sa.nch*rows*hd)
		for g := range c.NumKVHeads {
			m.gatherQueries(sp.xq[g*group*hd:], w, sa, g, 0, 1)
		}
		for c0 := 0; c0 < sa.nch; c0 += splitRun {
			w.posItems = append(w.posItems, posItem{sp: sp, c0: c0, c1: min(sa.nch, c0+splitRun)})
		}
	}
}

// chunkLen returns how many of chunk ch's keys the split sequence's token attends to.
func (sp *splitAttn) chunkLen(ch int) int {
	return min(attnChunk, sp.sa.start+1-ch*attnChunk)
}

// splitItem computes item it's chunks, all KV heads, reading each block's keys (values) of all
// heads in one stretch: their scores, or, for values, each chunk's value sums from zero into
// its part.
func (m *Model) splitItem(w *workspace, seqs []Seq, blockSize int, it posItem, values bool) {
	hd, group := m.cfg.HeadDim, m.cfg.NumHeads/m.cfg.NumKVHeads
	all := m.cfg.NumKVHeads * group * hd
	sp, sc := it.sp, m.getScratch()
	defer m.scratch.Put(sc)
	for ch := it.c0; ch < it.c1; ch++ {
		lo := ch * attnChunk
		part := sp.parts[ch*all : (ch+1)*all]
		if values {
			clear(part)
		}
		w.stretches(seqs, blockSize, sp.sa, 0, m.cfg.NumKVHeads, lo, sp.chunkLen(ch), values, false, func(g, j0, n int, v *headView, o int) {
			r := g * group
			if values {
				v.rowProducts(sc, true, part[r*hd:], hd, sp.scores[r*sp.stride+lo+j0:], sp.stride, group, o, n, hd)
			} else {
				v.rowProducts(sc, false, sp.scores[r*sp.stride+lo+j0:], sp.stride, sp.xq[r*hd:], hd, group, o, n, hd)
			}
		})
	}
}

// finishSplits completes the split sequences' attention once their scores are in: the
// probabilities (on the caller: a sequence's rows are a few, and a hand-off between the workers
// costs more), the value sums (a Parallel call over the work items), and, on the caller, the
// sums of the chunks in chunk order into the attention rows.
func (m *Model) finishSplits(w *workspace, seqs []Seq, blockSize int) {
	c := m.cfg
	nkv, hd, group := c.NumKVHeads, c.HeadDim, c.NumHeads/c.NumKVHeads
	for i := range w.splits {
		sp := &w.splits[i]
		m.softmaxRows(sp.scores, sp.stride, nkv*group, sp.sa.start, nkv*group)
	}
	m.pool.Parallel(len(w.posItems), func(i int) { m.splitItem(w, seqs, blockSize, w.posItems[i], true) })
	all := nkv * group * hd
	for i := range w.splits {
		sp := &w.splits[i]
		acc := sp.parts[:all]
		for ch := 1; ch < sp.sa.nch; ch++ {
			kernel.Add(acc, acc, sp.parts[ch*all:(ch+1)*all])
		}
		for g := range nkv {
			m.scatterOutputs(w, sp.sa, g, 0, 1, acc[g*group*hd:])
		}
	}
}
