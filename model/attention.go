package model

import (
	"cmp"
	"slices"

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
// The keys of each chunk are packed into a kernel.Linear (outputs = keys) applied to the query
// rows — the kernel's GEMM. The values go through a Linear of the chunk's transposed values
// (inputs = keys) applied to the probability rows where one exists (sequences with many tokens
// in the step, i.e. prefill, and complete chunks held in the packed cache), and are otherwise
// accumulated with kernel.Axpy straight from the store (the last, partial chunk while
// decoding). Both give the same bits because the kernel documents a Linear output element as
// one FMA chain over the input index ascending, and Axpy's step y = fma(x, α, y) is that chain
// (a zero probability adds an exact zero); TestAttentionPathsAgree checks it.
//
// Packing a chunk costs about as much as reading it, so complete chunks are kept across steps
// (packedcache.go) when the store exposes block generations; decoding then packs at most the
// last chunk per (layer, KV head).
const (
	attnChunk = 64
	// packedMinTokens is the number of a sequence's tokens in a step from which its values
	// are always packed (the prefill path).
	packedMinTokens = 16
	// tileRows is the number of query rows (tokens × heads of a KV group) per work item.
	tileRows = 64
)

// seqAttn is one sequence's attention state for one step.
type seqAttn struct {
	seq    int      // index in seqs
	row0   int      // first token row in the workspace
	n      int      // tokens this step
	start  int      // position of the first token
	packed bool     // packed-values path (prefill)
	gens   []uint64 // generations of the blocks in use, nil if the packed cache is off
	// k and v are the current layer's packed chunks, [KV head][chunk]; v[g][ch] is nil where
	// the values are accumulated with Axpy.
	k, v [][]*kernel.Linear
}

// attnItem is one unit of attention work: a tile [t0,t1) of the tokens of a (sequence, KV head).
type attnItem struct {
	sa     *seqAttn
	g      int
	t0, t1 int
	cost   int
}

// buildItem is one packing job: (sequence, KV head, key chunk).
type buildItem struct {
	sa    *seqAttn
	g, ch int
}

// attnScratch holds one work item's temporary buffers.
type attnScratch struct {
	xq, scores, tmp, xp, part, kx []float32
}

// planAttention prepares the step's per-sequence attention state (once per Forward call).
func (m *Model) planAttention(w *workspace, kv KVBlocks, blockSize int, seqs []Seq) {
	w.kv = kv
	w.epoch, w.cacheOK = m.packed.begin(kv)
	w.seqAttn = grow(w.seqAttn, 0)
	row := 0
	for i, s := range seqs {
		n := len(s.Tokens)
		if n > 0 {
			sa := seqAttn{seq: i, row0: row, n: n, start: s.Start, packed: n >= m.packedMin}
			if w.cacheOK {
				nb := (s.Start + n + blockSize - 1) / blockSize
				sa.gens = kv.(BlockGenerations).Generations(s.Blocks[:nb])
			}
			w.seqAttn = append(w.seqAttn, sa)
		}
		row += n
	}
}

// attention computes the attention output of layer l for every token row into w.attn. The KV
// of the step's tokens must already be in the store.
func (m *Model) attention(w *workspace, seqs []Seq, blockSize, layer int) {
	c := m.cfg
	group := c.NumHeads / c.NumKVHeads

	// Pack (or find in the cache) K and Vᵀ per chunk.
	w.builds = w.builds[:0]
	for i := range w.seqAttn {
		sa := &w.seqAttn[i]
		nch := (sa.start+sa.n-1)/attnChunk + 1
		sa.k = resizeLinears(sa.k, c.NumKVHeads, nch)
		sa.v = resizeLinears(sa.v, c.NumKVHeads, nch)
		for g := range c.NumKVHeads {
			for ch := range nch {
				w.builds = append(w.builds, buildItem{sa: sa, g: g, ch: ch})
			}
		}
	}
	m.pool.Parallel(len(w.builds), func(i int) { m.packChunk(w, seqs, blockSize, layer, w.builds[i]) })

	// Attention work items, the most expensive first.
	w.items = w.items[:0]
	for i := range w.seqAttn {
		sa := &w.seqAttn[i]
		for g := range c.NumKVHeads {
			tile := max(1, tileRows/group)
			for t0 := 0; t0 < sa.n; t0 += tile {
				t1 := min(sa.n, t0+tile)
				w.items = append(w.items, attnItem{sa: sa, g: g, t0: t0, t1: t1, cost: (t1 - t0) * group * (sa.start + t1)})
			}
		}
	}
	slices.SortStableFunc(w.items, func(a, b attnItem) int { return cmp.Compare(b.cost, a.cost) })
	m.pool.Parallel(len(w.items), func(i int) { m.attend(w, seqs, blockSize, w.items[i]) })
}

// resizeLinears returns a [heads][chunks] table, reusing s's storage.
func resizeLinears(s [][]*kernel.Linear, heads, chunks int) [][]*kernel.Linear {
	s = grow(s, heads)
	for g := range s {
		s[g] = grow(s[g], chunks)
	}
	return s
}

// getScratch returns a scratch set from the model's pool.
func (m *Model) getScratch() *attnScratch {
	sc, _ := m.scratch.Get().(*attnScratch)
	if sc == nil {
		sc = new(attnScratch)
	}
	return sc
}

// keyRow returns the key and value of position j of sequence sa for KV head g.
func (w *workspace) keyRow(seqs []Seq, blockSize int, sa *seqAttn, g, j, hd int) (k, v []float32) {
	hv := w.view(seqs, blockSize, sa.seq, g, j/blockSize)
	o := (j % blockSize) * hv.stride
	return hv.k[o : o+hd], hv.v[o : o+hd]
}

// packChunk provides the packed keys of one chunk (outputs = keys) and, where they will be used
// through a Linear, its transposed values (inputs = keys): from the packed cache if the chunk was
// complete before this step, else packed from the store (and cached if the chunk is complete).
func (m *Model) packChunk(w *workspace, seqs []Seq, blockSize, layer int, b buildItem) {
	hd := m.cfg.HeadDim
	sa := b.sa
	lo := b.ch * attnChunk
	ck := min(attnChunk, sa.start+sa.n-lo)
	key, cacheable := m.chunkKey(w, seqs, blockSize, layer, b, ck)
	if cacheable && lo+attnChunk <= sa.start {
		if e, ok := m.packed.get(key, w.epoch); ok {
			sa.k[b.g][b.ch], sa.v[b.g][b.ch] = e.k, e.v
			return
		}
	}
	sc := m.getScratch()
	defer m.scratch.Put(sc)
	kbuf := grow(sc.xq, ck*hd)
	sc.xq = kbuf
	for j := range ck {
		k, _ := w.keyRow(seqs, blockSize, sa, b.g, lo+j, hd)
		copy(kbuf[j*hd:(j+1)*hd], k)
	}
	kl := kernel.NewLinearOn(m.serial, kbuf, ck, hd)
	var vl *kernel.Linear
	if sa.packed || cacheable {
		vt := grow(sc.tmp, hd*ck)
		sc.tmp = vt
		for j := range ck {
			_, v := w.keyRow(seqs, blockSize, sa, b.g, lo+j, hd)
			for d, x := range v {
				vt[d*ck+j] = x
			}
		}
		vl = kernel.NewLinearOn(m.serial, vt, hd, ck)
	}
	sa.k[b.g][b.ch], sa.v[b.g][b.ch] = kl, vl
	if cacheable {
		m.packed.put(key, &packedEntry{k: kl, v: vl, bytes: linearBytes(ck, hd) + linearBytes(hd, ck)}, w.epoch)
	}
}

// chunkKey returns the cache key of a complete chunk (all attnChunk positions computed by the
// end of this step), or false if the chunk cannot be cached.
func (m *Model) chunkKey(w *workspace, seqs []Seq, blockSize, layer int, b buildItem, ck int) (packedKey, bool) {
	sa := b.sa
	if !w.cacheOK || ck != attnChunk {
		return packedKey{}, false
	}
	lo := b.ch * attnChunk
	first, last := lo/blockSize, (lo+attnChunk-1)/blockSize
	if last-first+1 > maxChunkBlocks {
		return packedKey{}, false
	}
	key := packedKey{store: w.kv, layer: int32(layer), head: int32(b.g), off: int32(lo % blockSize), n: int32(last - first + 1)}
	blocks := seqs[sa.seq].Blocks
	for i := range last - first + 1 {
		key.ids[i] = blocks[first+i]
		key.gens[i] = sa.gens[first+i]
	}
	return key, true
}

// gatherQueries copies the query vectors of tokens [t0,t1) of sa, heads of KV group g, into
// rows (token-major, then head) of hd floats.
func (m *Model) gatherQueries(dst []float32, w *workspace, sa *seqAttn, g, t0, t1 int) []float32 {
	c := m.cfg
	hd, group := c.HeadDim, c.NumHeads/c.NumKVHeads
	width := (c.NumHeads + 2*c.NumKVHeads) * hd
	dst = grow(dst, (t1-t0)*group*hd)
	for t := t0; t < t1; t++ {
		src := w.qkv[(sa.row0+t)*width+g*group*hd : (sa.row0+t)*width+(g+1)*group*hd]
		copy(dst[(t-t0)*group*hd:], src)
	}
	return dst
}

// output returns the attention output slot of row r (token t0 + r/group, head g·group + r%group).
func (m *Model) output(w *workspace, sa *seqAttn, g, t0, r int) []float32 {
	c := m.cfg
	hd, group := c.HeadDim, c.NumHeads/c.NumKVHeads
	t, head := t0+r/group, g*group+r%group
	o := (sa.row0+t)*c.NumHeads*hd + head*hd
	return w.attn[o : o+hd]
}

// attend computes attention for one tile of query tokens of a (sequence, KV head).
func (m *Model) attend(w *workspace, seqs []Seq, blockSize int, it attnItem) {
	c := m.cfg
	hd, group := c.HeadDim, c.NumHeads/c.NumKVHeads
	sa := it.sa
	sc := m.getScratch()
	defer m.scratch.Put(sc)

	rows := (it.t1 - it.t0) * group
	xq := m.gatherQueries(sc.xq, w, sa, it.g, it.t0, it.t1)
	sc.xq = xq
	maxPos := sa.start + it.t1 - 1
	nch := maxPos/attnChunk + 1
	stride := nch * attnChunk
	scores := grow(sc.scores, rows*stride)
	sc.scores = scores
	// firstRow returns the first row whose position reaches chunk ch (rows are position-ordered).
	firstRow := func(ch int) int {
		t := max(it.t0, ch*attnChunk-sa.start)
		return (t - it.t0) * group
	}

	// Scores, chunk by chunk, for the rows that reach the chunk.
	for ch := range nch {
		lin := sa.k[it.g][ch]
		ck := lin.Out()
		r0 := firstRow(ch)
		nr := rows - r0
		tmp := grow(sc.tmp, nr*ck)
		sc.tmp = tmp
		lin.Apply(tmp, xq[r0*hd:], nr)
		for r := range nr {
			copy(scores[(r0+r)*stride+ch*attnChunk:], tmp[r*ck:(r+1)*ck])
		}
	}
	// Softmax over 0..p; zero the rest of p's chunk so the value chain adds exact zeros there.
	for r := range rows {
		p := sa.start + it.t0 + r/group
		s := scores[r*stride : (r+1)*stride]
		kernel.Softmax(s[:p+1])
		clear(s[p+1 : min(stride, (p/attnChunk+1)*attnChunk)])
	}
	// Values, chunk by chunk: through the packed Vᵀ where there is one, else with Axpy.
	for ch := range nch {
		r0 := firstRow(ch)
		nr := rows - r0
		lin := sa.v[it.g][ch]
		if lin == nil {
			m.valuesStreaming(w, seqs, blockSize, it, scores, stride, ch, r0, sc)
			continue
		}
		ck := lin.In()
		xp := grow(sc.xp, nr*ck)
		sc.xp = xp
		for r := range nr {
			copy(xp[r*ck:(r+1)*ck], scores[(r0+r)*stride+ch*attnChunk:])
		}
		part := grow(sc.part, nr*hd)
		sc.part = part
		lin.Apply(part, xp, nr)
		for r := range nr {
			accumulate(m.output(w, sa, it.g, it.t0, r0+r), part[r*hd:(r+1)*hd], ch)
		}
	}
}

// accumulate adds chunk ch's partial value sum into out (chunk 0 initialises it).
func accumulate(out, part []float32, ch int) {
	if ch == 0 {
		copy(out, part)
	} else {
		kernel.Add(out, out, part)
	}
}

// valuesStreaming accumulates chunk ch's values for rows r0.. with kernel.Axpy straight from the
// stored rows: the same FMA chain as the packed values Linear.
func (m *Model) valuesStreaming(w *workspace, seqs []Seq, blockSize int, it attnItem, scores []float32, stride, ch, r0 int, sc *attnScratch) {
	c := m.cfg
	hd, group := c.HeadDim, c.NumHeads/c.NumKVHeads
	sa := it.sa
	rows := (it.t1 - it.t0) * group
	part := grow(sc.kx, hd)
	sc.kx = part
	for r := r0; r < rows; r++ {
		p := sa.start + it.t0 + r/group
		s := scores[r*stride:]
		clear(part)
		for j := ch * attnChunk; j < min((ch+1)*attnChunk, p+1); j++ {
			_, v := w.keyRow(seqs, blockSize, sa, it.g, j, hd)
			kernel.Axpy(s[j], v, part)
		}
		accumulate(m.output(w, sa, it.g, it.t0, r), part, ch)
	}
}
