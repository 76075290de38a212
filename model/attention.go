package model

import (
	"cmp"
	"slices"
	"unsafe"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// Attention arithmetic. For the query q (already scaled by 1/sqrt(HeadDim)) of a token at
// position p and the keys k_0..k_p, v_0..v_p of its KV head, the result is defined as:
//
//	s_j       = one FMA chain over d ascending of q[d]·k_j[d]   (a kernel.Linear output element)
//	p_·       = kernel.Softmax(s_0..s_p)                         (fixed order for length p+1)
//	part_c[d] = one FMA chain over j ascending in chunk c, j ≤ p, of p_j·v_j[d]
//	out       = part_0 + part_1 + ... (kernel.Add, chunk order)
//
// with chunks of attnChunk keys at absolute positions [c·attnChunk, (c+1)·attnChunk). Every
// quantity depends only on p and the stored KV, so the result is the same whatever the batch,
// the chunking or the block size.
//
// Both products are the kernel's GEMM. The keys of a chunk packed into a kernel.Linear
// (outputs = keys) applied to the query rows give the scores; the chunk's values packed
// transposed (inputs = keys) applied to the probability rows give part_c. The kernel documents
// a Linear output element as one FMA chain over the input index ascending — exactly s_j and
// part_c[d] — and a zero probability adds an exact zero, so a chunk packed with more keys
// than a row reaches (up to the last position of the step or of the work item) gives the same
// bits.
//
// Attention reads the KV store afresh in every step, whoever filled it (the model itself or a KV
// transfer), and keeps nothing of it across steps. A sequence with several work items per KV head
// (prefill) has its chunks packed into the step's Linears before the work starts, shared by its
// items. A sequence with one item per KV head (decode) has each chunk packed into the item's
// scratch Linears just before use, while it stays in L1 — or, where the kernel has
// kernel.RowDots and kernel.AccumulateRows for HeadDim (AVX-512, portable Go; Model.inPlace), not
// packed at all: the item computes its scores and value sums straight from the blocks' key and
// value rows (float32, or bfloat16 widened inside the kernels' loads: kernel.RowDotsBF16,
// kernel.AccumulateRowsBF16) with the packed Linears' chains (one FMA chain over d per score;
// per value element one chain over the chunk's keys, carried from block to block). Such an item
// of a sequence whose tokens fit one tile (decode) covers several KV heads, up to all of them:
// a block holds a layer's keys of all heads side by side (then their values), so the item reads
// each block's keys, then values, as one stretch of memory — what the hardware streams fastest
// (reading one head's 8 KB per block, as one item per head did, ran at half the bandwidth).
// Packing only moves data — kernel.Linear.SetRows transposes the keys with SIMD shuffles,
// SetColumns copies the values — into reused memory, so a context that arrived by transfer costs
// what one the model computed costs, and no packed copy outlives the step to go stale (a cache of
// packed chunks across steps, removed earlier, cost a full re-pack after every transfer; reading
// in place replaced decode's per-step re-packing, which had cost about as much again as the
// products). However a chunk is packed, the Linear holds the same numbers, and the in-place
// kernels compute what it computes; TestAttentionPathsAgree, the transfer tests and
// TestAttentionMixedBatch force each way and compare bits.
const (
	attnChunk = 64
	// tileRows is the number of query rows (tokens × heads of a KV group) per work item.
	tileRows = 64
	// touchAheadBytes is the most keys and values of an in-place work item whose values are
	// read ahead with its keys (a core's L2 on the machines measured: 1 MB on Zen 4). At a
	// 128-token context that is a bfloat16 item of 8 heads (528 KB, 7% faster), not a float32
	// one (1.06 MB, no faster).
	touchAheadBytes = 1 << 20
)

// seqAttn is one sequence's attention state for one step.
type seqAttn struct {
	seq   int // index in seqs
	row0  int // first token row in the workspace
	n     int // tokens this step
	start int // position of the first token
	nch   int // chunks attended over: positions [0, start+n)
	// packs is the index in workspace.packs of the sequence's first chunk packed for the whole
	// step (keys and values, KV head-major), or -1 when its work items pack their own.
	packs int
}

// chunk returns the step's packed keys and values of chunk ch, KV head g (packs ≥ 0).
func (sa *seqAttn) chunk(w *workspace, g, ch int) (k, v *kernel.Linear) {
	i := 2 * (sa.packs + g*sa.nch + ch)
	return w.packs[i], w.packs[i+1]
}

// attnItem is one unit of attention work: a tile [t0,t1) of the tokens of a sequence, for its
// KV heads [g0,g1) (one head unless the item reads its keys and values in place).
type attnItem struct {
	sa     *seqAttn
	g0, g1 int
	t0, t1 int
	cost   int
}

// packItem is one packing job of a step: chunk ch of KV head g of a sequence.
type packItem struct {
	sa    *seqAttn
	g, ch int
}

// attnScratch holds one work item's temporary buffers.
type attnScratch struct {
	xq, scores, acc, part []float32
	kl, vl                kernel.Linear // chunks packed for this item only
	wide                  []float32     // FP8 rows widened for the in-place kernels (kvfp8.go)
	set                   scoreSet      // a stretch's scores calls of several KV heads
}

// tileTokens returns the number of a sequence's tokens in one attention work item.
func (c Config) tileTokens() int {
	return max(1, tileRows/(c.NumHeads/c.NumKVHeads))
}

// planAttention prepares the step's per-sequence attention state and packing jobs (once per
// Forward call).
func (m *Model) planAttention(w *workspace, seqs []Seq) {
	nkv := m.cfg.NumKVHeads
	w.seqAttn = grow(w.seqAttn, 0)
	row, packs := 0, 0
	for i, s := range seqs {
		n := len(s.Tokens)
		if n > 0 {
			sa := seqAttn{seq: i, row0: row, n: n, start: s.Start, nch: (s.Start+n-1)/attnChunk + 1, packs: -1}
			if n >= m.prefillMin {
				sa.packs = packs
				packs += nkv * sa.nch
			}
			w.seqAttn = append(w.seqAttn, sa)
		}
		row += n
	}
	for len(w.packs) < 2*packs {
		w.packs = append(w.packs, new(kernel.Linear))
	}
	w.packItems = w.packItems[:0]
	for i := range w.seqAttn {
		sa := &w.seqAttn[i]
		if sa.packs < 0 {
			continue
		}
		for g := range nkv {
			for ch := range sa.nch {
				w.packItems = append(w.packItems, packItem{sa: sa, g: g, ch: ch})
			}
		}
	}
}

// attention computes the attention output of the current layer (the one w.views shows) for
// every token row into w.attn. The KV of the step's tokens must already be in the store.
func (m *Model) attention(w *workspace, seqs []Seq, blockSize int) {
	c := m.cfg
	group := c.NumHeads / c.NumKVHeads

	// The chunks of the sequences whose work items share them, packed once.
	m.pool.Parallel(len(w.packItems), func(i int) {
		b := w.packItems[i]
		k, v := b.sa.chunk(w, b.g, b.ch)
		lo := b.ch * attnChunk
		n := min(attnChunk, b.sa.start+b.sa.n-lo)
		m.packKeys(k, w, seqs, blockSize, b.sa, b.g, lo, n)
		m.packValues(v, w, seqs, blockSize, b.sa, b.g, lo, n)
	})

	// Attention work items, the most expensive first. A sequence read in place whose tokens
	// fit one tile (decode) has several KV heads per item, so that the item walks each block's
	// keys (then values) of those heads — adjacent in the block — in one stretch of memory.
	// A decoding sequence whose items would cover fewer than all KV heads is split by positions
	// instead (attention_split.go): its items, each a run of its chunks of all heads, compute
	// their scores here, beside the other items, and finishSplits the rest.
	w.items = w.items[:0]
	tile := c.tileTokens()
	span := m.headSpan(w)
	m.planSplits(w, span)
	for i := range w.seqAttn {
		sa := &w.seqAttn[i]
		if m.splits(sa, span) {
			continue
		}
		heads := 1
		if m.inPlace && sa.packs < 0 && sa.n <= tile {
			heads = max(1, min(span, tileRows/(sa.n*group)))
		}
		for g0 := 0; g0 < c.NumKVHeads; g0 += heads {
			g1 := min(c.NumKVHeads, g0+heads)
			for t0 := 0; t0 < sa.n; t0 += tile {
				t1 := min(sa.n, t0+tile)
				w.items = append(w.items, attnItem{sa: sa, g0: g0, g1: g1, t0: t0, t1: t1, cost: (g1 - g0) * (t1 - t0) * group * (sa.start + t1)})
			}
		}
	}
	slices.SortStableFunc(w.items, func(a, b attnItem) int { return cmp.Compare(b.cost, a.cost) })
	n := len(w.items)
	m.pool.Parallel(n+m.scoreItems(w), func(i int) {
		if i >= n {
			m.splitScoreItem(w, seqs, blockSize, i-n)
		} else if it := w.items[i]; it.sa.packs < 0 && m.inPlace {
			m.attendInPlace(w, seqs, blockSize, it)
		} else {
			m.attend(w, seqs, blockSize, it)
		}
	})
	if len(w.splits) > 0 {
		m.finishSplits(w, seqs, blockSize)
	}
}

// headSpan returns how many KV heads an item of a one-tile sequence read in place covers: all of
// them, unless there are too few such sequences to give every worker two items.
func (m *Model) headSpan(w *workspace) int {
	nkv := m.cfg.NumKVHeads
	n := 0
	for i := range w.seqAttn {
		if w.seqAttn[i].packs < 0 && w.seqAttn[i].n <= m.cfg.tileTokens() {
			n++
		}
	}
	span := nkv
	for span > 1 && n*((nkv+span-1)/span) < 2*m.pool.Workers() {
		span = (span + 1) / 2
	}
	if m.itemHeads > 0 {
		span = min(span, m.itemHeads)
	}
	return span
}

// getScratch returns a scratch set from the model's pool.
func (m *Model) getScratch() *attnScratch {
	sc, _ := m.scratch.Get().(*attnScratch)
	if sc == nil {
		sc = new(attnScratch)
	}
	return sc
}

// packKeys packs the keys of positions [lo, lo+n) of sa, KV head g, into l (outputs = keys),
// straight from the store.
func (m *Model) packKeys(l *kernel.Linear, w *workspace, seqs []Seq, blockSize int, sa *seqAttn, g, lo, n int) {
	rows := w.positions(seqs, blockSize, sa, g, lo, m.cfg.HeadDim)
	l.SetRows(m.serial, n, m.cfg.HeadDim, func(int) []float32 { k, _ := rows.next(); return k })
}

// packValues packs the values of positions [lo, lo+n) of sa, KV head g, into l transposed
// (inputs = keys), straight from the store.
func (m *Model) packValues(l *kernel.Linear, w *workspace, seqs []Seq, blockSize int, sa *seqAttn, g, lo, n int) {
	rows := w.positions(seqs, blockSize, sa, g, lo, m.cfg.HeadDim)
	l.SetColumns(m.serial, m.cfg.HeadDim, n, func(int) []float32 { _, v := rows.next(); return v })
}

// positionIter walks the stored keys and values of consecutive positions of one sequence and
// KV head, resolving each block's view once. Bfloat16 and FP8 values are widened into ring, whose last
// ringRows keys and values stay valid (a Linear's SetRows holds up to 16 rows at once).
type positionIter struct {
	w               *workspace
	seqs            []Seq
	sa              *seqAttn
	g, hd           int
	block, slot, bs int
	view            headView
	ring            []float32 // 2·ringRows rows of hd floats (bfloat16 stores only)
	next16          int
}

// ringRows is how many widened keys (and values) a bfloat16 positionIter keeps valid.
const ringRows = 16

// positions returns an iterator over the KV of sa, KV head g, from position lo.
func (w *workspace) positions(seqs []Seq, blockSize int, sa *seqAttn, g, lo, hd int) *positionIter {
	return &positionIter{w: w, seqs: seqs, sa: sa, g: g, hd: hd, block: lo / blockSize, slot: lo % blockSize, bs: blockSize,
		view: w.view(seqs, blockSize, sa.seq, g, lo/blockSize)}
}

// next returns the key and value of the current position and advances to the next one.
func (it *positionIter) next() (k, v []float32) {
	if it.slot == it.bs {
		it.block, it.slot = it.block+1, 0
		it.view = it.w.view(it.seqs, it.bs, it.sa.seq, it.g, it.block)
	}
	o := it.slot * it.view.stride
	it.slot++
	if it.view.k16 == nil && it.view.k8 == nil {
		return it.view.k[o : o+it.hd], it.view.v[o : o+it.hd]
	}
	if it.ring == nil {
		it.ring = make([]float32, 2*ringRows*it.hd)
	}
	r := it.next16 % ringRows
	it.next16++
	k = it.ring[2*r*it.hd : (2*r+1)*it.hd]
	v = it.ring[(2*r+1)*it.hd : (2*r+2)*it.hd]
	if it.view.k8 != nil {
		it.view.widenFP8(k, v, o)
		return k, v
	}
	kernel.WidenBF16(k, it.view.k16[o:o+it.hd])
	kernel.WidenBF16(v, it.view.v16[o:o+it.hd])
	return k, v
}

// stretches calls fn for each stretch of the positions [lo, lo+n) of sa that lies in one block,
// in position order, and in each for the KV heads [g0,g1) in order: j0 is the stretch's offset
// from lo, cnt its length, view the head's view of the block and o the offset in it of the
// stretch's first key (value). Before the heads of a stretch are computed, the stretch's rows
// of all of them are read in address order (kernel.Touch) — the keys in the scores pass (and,
// with ahead, the values as well: adjacent in the block, read next), the values in the values
// pass unless read ahead. The kernels' strided reads then find them in the caches, and the
// sequential reads let the hardware prefetchers stream the next rows meanwhile; prefetching the
// same rows instead (a burst that waits for miss buffers) measured 20% slower, reading nothing
// ahead 40% slower.
func (w *workspace) stretches(seqs []Seq, blockSize int, sa *seqAttn, g0, g1, lo, n int, values, ahead bool, fn func(g, j0, cnt int, view *headView, o int)) {
	s := seqs[sa.seq]
	nb := (s.Start + len(s.Tokens) + blockSize - 1) / blockSize
	base := w.viewBase[sa.seq]
	views := w.views[base : base+g1*nb]
	for j0 := 0; j0 < n; {
		p := lo + j0
		b, slot := p/blockSize, p%blockSize
		cnt := min(n-j0, blockSize-slot)
		if !values || !ahead {
			w.touchHeads(views, nb, b, g0, g1, slot, cnt, values)
		}
		if !values && ahead {
			w.touchHeads(views, nb, b, g0, g1, slot, cnt, true)
		}
		for g := g0; g < g1; g++ {
			view := &views[g*nb+b]
			fn(g, j0, cnt, view, slot*view.stride)
		}
		j0 += cnt
	}
}

// touchHeads reads the keys (or values) of the rows [slot, slot+rows) of the KV heads [g0, g1)
// of block index b (views[g*nb+b]) in address order. An HND block's heads lie apart and are read
// one by one. An NHD block's lie side by side in each row (a view's stride is wider than a
// head), so one head's rows run over the next heads' vectors: read head by head, the same lines
// were read up to NumKVHeads times (10% more CPU a bfloat16 batch-32 step than HND). They are
// read once instead, from the first head's vector in the first row to the last head's in the
// last.
func (w *workspace) touchHeads(views []headView, nb, b, g0, g1, slot, rows int, values bool) {
	first := &views[g0*nb+b]
	if first.stride > w.headDim && g1-g0 > 1 {
		first.touch(slot*first.stride, (rows-1)*first.stride+(g1-g0)*w.headDim, values)
		return
	}
	for g := g0; g < g1; g++ {
		v := &views[g*nb+b]
		o := slot * v.stride
		v.touch(o, min(rows*v.stride, v.len()-o), values)
	}
}

// len returns the number of values (codes) of the view's keys, as of its values.
func (v *headView) len() int {
	switch {
	case v.k8 != nil:
		return len(v.k8)
	case v.k16 != nil:
		return len(v.k16)
	}
	return len(v.k)
}

// touch reads n values (codes) of the keys, or the values, from offset o on in address order.
// They may run past the view's end (an NHD block's later heads of its last row: touchHeads) but
// not past its layer's keys (values) in the block.
func (v *headView) touch(o, n int, values bool) {
	switch {
	case v.k8 != nil:
		touchFrom(v.k8, v.v8, o, n, values)
	case v.k16 != nil:
		touchFrom(v.k16, v.v16, o, n, values)
	default:
		touchFrom(v.k, v.v, o, n, values)
	}
}

// touchFrom reads n elements of k (or v, with values) from offset o on, through its backing array
// past its length if need be (headView.touch).
func touchFrom[T float32 | uint16 | uint8](k, v []T, o, n int, values bool) {
	x := k
	if values {
		x = v
	}
	if n <= 0 || o >= len(x) {
		return
	}
	kernel.Touch(unsafe.Slice(&x[o], n))
}

// gatherQueries copies the query vectors of tokens [t0,t1) of sa, heads of KV group g, into
// rows (token-major, then head) of hd floats at the start of dst.
func (m *Model) gatherQueries(dst []float32, w *workspace, sa *seqAttn, g, t0, t1 int) {
	c := m.cfg
	hd, group := c.HeadDim, c.NumHeads/c.NumKVHeads
	width := (c.NumHeads + 2*c.NumKVHeads) * hd
	for t := t0; t < t1; t++ {
		src := w.qkv[(sa.row0+t)*width+g*group*hd : (sa.row0+t)*width+(g+1)*group*hd]
		copy(dst[(t-t0)*group*hd:], src)
	}
}

// attend computes attention for one tile of query tokens of a (sequence, KV head), from keys
// and values packed into Linears: the step's, or the item's own.
func (m *Model) attend(w *workspace, seqs []Seq, blockSize int, it attnItem) {
	c := m.cfg
	hd, group := c.HeadDim, c.NumHeads/c.NumKVHeads
	sa, g := it.sa, it.g0
	sc := m.getScratch()
	defer m.scratch.Put(sc)

	rows, maxPos, nch, stride := m.itemRows(sc, w, it)
	xq, scores := sc.xq, sc.scores
	firstRow := it.firstRow(group)

	// packed returns the keys (or values) of chunk ch: packed for the step, or packed now into
	// the scratch Linears up to the tile's last position.
	packed := func(ch int, values bool) *kernel.Linear {
		if sa.packs >= 0 {
			k, v := sa.chunk(w, g, ch)
			if values {
				return v
			}
			return k
		}
		lo, n := ch*attnChunk, min(attnChunk, maxPos+1-ch*attnChunk)
		if values {
			m.packValues(&sc.vl, w, seqs, blockSize, sa, g, lo, n)
			return &sc.vl
		}
		m.packKeys(&sc.kl, w, seqs, blockSize, sa, g, lo, n)
		return &sc.kl
	}

	// Scores, chunk by chunk, for the rows that reach the chunk, straight into the score rows.
	for ch := range nch {
		r0 := firstRow(ch)
		packed(ch, false).ApplyStrided(scores[r0*stride+ch*attnChunk:], stride, xq[r0*hd:], hd, rows-r0)
	}
	m.softmaxRows(scores, stride, rows, sa.start+it.t0, group)
	// Values, chunk by chunk: each chunk's partial sums (one FMA chain over its keys) from the
	// probability rows, added to the rows' accumulators in chunk order.
	acc := grow(sc.acc, rows*hd)
	sc.acc = acc
	part := grow(sc.part, rows*hd)
	sc.part = part
	for ch := range nch {
		r0 := firstRow(ch)
		nr := rows - r0
		dst := part // every row reaches chunk 0: its sums go straight to acc
		if ch == 0 {
			dst = acc
		}
		packed(ch, true).ApplyStrided(dst, hd, scores[r0*stride+ch*attnChunk:], stride, nr)
		if ch > 0 {
			kernel.Add(acc[r0*hd:rows*hd], acc[r0*hd:rows*hd], part[:nr*hd])
		}
	}
	m.scatterOutputs(w, sa, g, it.t0, it.t1, acc)
}

// attendInPlace computes attention for one tile of query tokens of a sequence and its KV heads
// [g0,g1), reading the keys and values where the store holds them (kernel.RowDots and
// kernel.AccumulateRows, or their bfloat16 forms) with the chains of attend's packed Linears:
// one FMA chain over d per score; per value element one chain over the chunk's keys, carried
// from block to block. Block by block, it reads the keys of all its heads (adjacent in a block)
// for the scores, then, after the softmax, their values, reading each block in address order
// just before use (see stretches).
func (m *Model) attendInPlace(w *workspace, seqs []Seq, blockSize int, it attnItem) {
	c := m.cfg
	hd, group := c.HeadDim, c.NumHeads/c.NumKVHeads
	sa := it.sa
	sc := m.getScratch()
	defer m.scratch.Put(sc)

	rows, maxPos, nch, stride := m.itemRows(sc, w, it)
	xq, scores := sc.xq, sc.scores
	all := (it.g1 - it.g0) * rows
	firstRow := it.firstRow(group)
	chunkLen := func(ch int) int { return min(attnChunk, maxPos+1-ch*attnChunk) }

	// The values are read with the keys when the item's keys and values fit a core's L2 (so they
	// are still there for the values pass), else just before use.
	ahead := (it.g1-it.g0)*(maxPos+1)*hd*2*m.kvValueBytes() <= touchAheadBytes
	// Scores, chunk by chunk, for the rows that reach the chunk (up to the tile's last position,
	// as a packed chunk holds), straight into the score rows.
	for ch := range nch {
		r0, lo := firstRow(ch), ch*attnChunk
		w.stretches(seqs, blockSize, sa, it.g0, it.g1, lo, chunkLen(ch), false, ahead, func(g, j0, n int, v *headView, o int) {
			r := (g-it.g0)*rows + r0
			sc.set.add(sc, v, scores[r*stride+lo+j0:], stride, xq[r*hd:], hd, rows-r0, o, n, hd)
			if g == it.g1-1 {
				sc.set.flush()
			}
		})
	}
	for g := range it.g1 - it.g0 {
		m.softmaxRows(scores[g*rows*stride:], stride, rows, sa.start+it.t0, group)
	}
	// Values, chunk by chunk: each chunk's partial sums from the probability rows, added to the
	// rows' accumulators in chunk order.
	acc := grow(sc.acc, all*hd)
	sc.acc = acc
	part := grow(sc.part, all*hd)
	sc.part = part
	for ch := range nch {
		r0, lo := firstRow(ch), ch*attnChunk
		nr := rows - r0
		dst := part // every row reaches chunk 0: its sums go straight to acc
		if ch == 0 {
			dst = acc
		}
		// The chains start from zero, as in a packed Linear.
		for g := range it.g1 - it.g0 {
			clear(dst[g*rows*hd : (g*rows+nr)*hd])
		}
		w.stretches(seqs, blockSize, sa, it.g0, it.g1, lo, chunkLen(ch), true, ahead, func(g, j0, n int, v *headView, o int) {
			gi := g - it.g0
			v.rowProducts(sc, true, dst[gi*rows*hd:], hd, scores[(gi*rows+r0)*stride+lo+j0:], stride, nr, o, n, hd)
		})
		if ch > 0 {
			for g := range it.g1 - it.g0 {
				a := acc[(g*rows+r0)*hd : (g+1)*rows*hd]
				kernel.Add(a, a, part[g*rows*hd:(g*rows+nr)*hd])
			}
		}
	}
	for g := it.g0; g < it.g1; g++ {
		m.scatterOutputs(w, sa, g, it.t0, it.t1, acc[(g-it.g0)*rows*hd:])
	}
}

// rowProducts runs, over the n keys (values) of the view from offset o on, kernel.RowDots: the
// scores of rows query rows x (ldx apart) into dst (row r at dst[r*ldd:]), one FMA chain over d
// each — or, for values, kernel.AccumulateRows: the rows probability rows x weighting the values
// added into the rows of dst (ldd apart), per value element one chain over the keys, carried on
// from what dst holds. Bfloat16 rows are widened inside the kernels, FP8 ones into sc first (FP8
// keys of a bfloat16-exact table go through scoreSet instead: widened to bfloat16).
func (v *headView) rowProducts(sc *attnScratch, values bool, dst []float32, ldd int, x []float32, ldx, rows, o, n, hd int) {
	f32, f16, x32, x16, x8 := kernel.RowDots, kernel.RowDotsBF16, v.k, v.k16, v.k8
	if values {
		f32, f16, x32, x16, x8 = kernel.AccumulateRows, kernel.AccumulateRowsBF16, v.v, v.v16, v.v8
	}
	switch {
	case x8 != nil:
		f32(dst, ldd, x, ldx, rows, v.widenRows(sc, values, o, n, hd), hd, n, hd)
	case x16 != nil:
		f16(dst, ldd, x, ldx, rows, x16[o:], v.stride, n, hd)
	default:
		f32(dst, ldd, x, ldx, rows, x32[o:], v.stride, n, hd)
	}
}

// itemRows gathers the query rows of item it into sc.xq — per KV head its group's query heads ×
// the tile's tokens (token-major), head after head — and sizes sc.scores for their score rows.
// It returns the rows per KV head, the tile's last position, the chunks attended over and the
// score rows' stride (whole chunks).
func (m *Model) itemRows(sc *attnScratch, w *workspace, it attnItem) (rows, maxPos, nch, stride int) {
	c := m.cfg
	hd := c.HeadDim
	rows = (it.t1 - it.t0) * (c.NumHeads / c.NumKVHeads)
	all := (it.g1 - it.g0) * rows
	sc.xq = grow(sc.xq, all*hd)
	for g := it.g0; g < it.g1; g++ {
		m.gatherQueries(sc.xq[(g-it.g0)*rows*hd:], w, it.sa, g, it.t0, it.t1)
	}
	maxPos = it.sa.start + it.t1 - 1
	nch = maxPos/attnChunk + 1
	stride = nch * attnChunk
	sc.scores = grow(sc.scores, all*stride)
	return rows, maxPos, nch, stride
}

// firstRow returns, for each chunk ch, the first of the item's rows (per KV head: token-major,
// then query head) whose position reaches the chunk (rows are position-ordered).
func (it attnItem) firstRow(group int) func(ch int) int {
	return func(ch int) int {
		t := max(it.t0, ch*attnChunk-it.sa.start)
		return (t - it.t0) * group
	}
}

// softmaxRows turns rows score rows (stride apart; row r holds the scores of the token at
// position start + r/group) into probabilities over positions 0..p, and zeroes the rest of p's
// chunk so the value chains add exact zeros there.
func (m *Model) softmaxRows(scores []float32, stride, rows, start, group int) {
	for r := range rows {
		p := start + r/group
		s := scores[r*stride : (r+1)*stride]
		kernel.Softmax(s[:p+1])
		clear(s[p+1 : min(stride, (p/attnChunk+1)*attnChunk)])
	}
}

// scatterOutputs copies the attention outputs of tokens [t0,t1) of sa, KV head g (acc: rows
// token-major, then query head of the group) into the workspace's attention rows (at the
// model's columns of them: attnCol, attnWidth).
func (m *Model) scatterOutputs(w *workspace, sa *seqAttn, g, t0, t1 int, acc []float32) {
	c := m.cfg
	hd, group := c.HeadDim, c.NumHeads/c.NumKVHeads
	for r := range (t1 - t0) * group {
		t, head := t0+r/group, g*group+r%group
		o := (sa.row0+t)*m.attnWidth + m.attnCol + head*hd
		copy(w.attn[o:o+hd], acc[r*hd:(r+1)*hd])
	}
}
