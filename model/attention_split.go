package model

import (
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/kvbridge/kvbridge/model/kernel"
)

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
// nothing), beside the step's other attention items; then, every score being known, items of the
// same Parallel call turn each row into probabilities (kernel.Softmax over all positions, as
// ever; one row an item); then the items of a second call compute, per chunk, its value sums
// from zero (per value element one chain over the chunk's keys, carried from block to block);
// then, every chunk's sums being known, items of that call add the chunks' sums in chunk order
// (part_0 + part_1 + …, attention.go's definition; one KV head's elements an item). A phase's
// items come after the ones they need in their call and wait for them there (splitGate), so the
// workers share them without a hand-off of their own. Every number is the one an item of one KV
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
				sc.set.add(sc, v, sp.scores[r*sp.stride+lo+j0:], sp.stride, sp.xq[r*hd:], hd, group, o, n, hd)
				if g == m.cfg.NumKVHeads-1 {
					sc.set.flush()
				}
			}
		})
	}
}

// finishSplits completes the split sequences' attention once their scores and probabilities are
// in (splitScoreItem): one Parallel call computes the value sums of every chunk (splitItem), then,
// in the same call, as soon as every chunk's sums are in, the sums of the chunks in chunk order
// into the attention rows, one item per split sequence and KV head.
func (m *Model) finishSplits(w *workspace, seqs []Seq, blockSize int) {
	c := m.cfg
	nkv, hd, group := c.NumKVHeads, c.HeadDim, c.NumHeads/c.NumKVHeads
	all := nkv * group * hd
	if m.splitOnCaller {
		m.at(partSoftmax)
		for i := range w.splits {
			sp := &w.splits[i]
			m.softmaxRows(sp.scores, sp.stride, nkv*group, sp.sa.start, nkv*group)
		}
		m.at(partValues)
		m.pool.Parallel(len(w.posItems), func(i int) { m.splitItem(w, seqs, blockSize, w.posItems[i], true) })
		m.at(partChunkSums)
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
		return
	}
	m.at(partValues)
	np := len(w.posItems)
	w.splitGate.add(np)
	m.pool.Parallel(np+len(w.splits)*nkv, func(i int) {
		if i < np {
			defer w.splitGate.done()
			m.splitItem(w, seqs, blockSize, w.posItems[i], true)
			return
		}
		w.splitGate.wait()
		sp, g := &w.splits[(i-np)/nkv], (i-np)%nkv
		acc := sp.parts[g*group*hd : (g+1)*group*hd]
		for ch := 1; ch < sp.sa.nch; ch++ {
			kernel.Add(acc, acc, sp.parts[ch*all+g*group*hd:ch*all+(g+1)*group*hd])
		}
		m.scatterOutputs(w, sp.sa, g, 0, 1, acc)
	})
}

// scoreItems returns how many items of attention's Parallel call (after its items of the other
// sequences) the split sequences have — their chunks' scores, then their rows' probabilities
// (splitScoreItem) — and readies the gate the probabilities wait at.
func (m *Model) scoreItems(w *workspace) int {
	if len(w.splits) == 0 {
		return 0
	}
	if m.splitOnCaller {
		return len(w.posItems)
	}
	w.splitGate.add(len(w.posItems))
	return len(w.posItems) + len(w.splits)*m.cfg.NumHeads
}

// splitScoreItem runs item i of the split sequences' share of attention's Parallel call: the
// scores of a run of chunks (posItems[i]), or, once every chunk's scores are in, one score row's
// probabilities (kernel.Softmax over all its positions: the same call, so the same bits, as over
// all rows on one goroutine). The probability items come last, so when one is claimed every
// score item has been claimed by a goroutine running it, and the wait ends.
func (m *Model) splitScoreItem(w *workspace, seqs []Seq, blockSize, i int) {
	np := len(w.posItems)
	if i < np {
		if !m.splitOnCaller {
			defer w.splitGate.done()
		}
		m.splitItem(w, seqs, blockSize, w.posItems[i], false)
		return
	}
	i -= np
	w.splitGate.wait()
	rows := m.cfg.NumHeads
	sp := &w.splits[i/rows]
	r := i % rows
	m.softmaxRows(sp.scores[r*sp.stride:], sp.stride, 1, sp.sa.start, 1)
}

// splitGate lets the items of one phase of a Parallel call (the split sequences' probabilities,
// or their chunk sums) wait, inside the call, for those of the phase before it (the scores, or
// the value sums), which come first in the call: it counts the earlier items still running.
type splitGate struct {
	left    atomic.Int64
	running sync.WaitGroup
}

// add readies the gate for n items of the earlier phase.
func (g *splitGate) add(n int) {
	g.left.Store(int64(n))
	g.running.Add(n)
}

// done marks one item of the earlier phase finished.
func (g *splitGate) done() {
	g.left.Add(-1)
	g.running.Done()
}

// wait returns when every item of the earlier phase has finished: it polls for a while (the
// last of them is a chunk's work, microseconds), then blocks.
func (g *splitGate) wait() {
	for i := 0; g.left.Load() > 0 && i < gatePolls; i++ {
		runtime.Gosched()
	}
	g.running.Wait()
}

// gatePolls is how many times splitGate.wait polls before it blocks.
const gatePolls = 256
