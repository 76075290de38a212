package model

import (
	"context"
	"fmt"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// KVBlocks is the paged KV storage the forward pass reads and writes (implemented by *kvcache.Pool).
type KVBlocks interface {
	// HeadView returns the keys and values of one KV head in one block of one layer. The key of
	// slot s (0 ≤ s < block size) is k[s*stride : s*stride+headDim]; the same for v.
	HeadView(layer, block, head int) (k, v []float32, stride int)
}

// KVBlocksBF16 is a KV store of bfloat16 values, which a model with a bfloat16 KV cache
// (OpenOptions.KVCacheDType) needs: HeadViewBF16 is HeadView for the values' bits.
type KVBlocksBF16 interface {
	HeadViewBF16(layer, block, head int) (k, v []uint16, stride int)
}

// Seq is one sequence's share of a forward step.
type Seq struct {
	// Tokens are the tokens computed this step (their KV is written into the blocks).
	Tokens []int32
	// Start is the position of Tokens[0]; positions [0,Start) already hold KV in Blocks.
	Start int
	// Blocks is the block table: position p lives in block Blocks[p/blockSize], slot p%blockSize.
	Blocks []int32
	// Logits, if non-nil (len = vocab size), receives the logits of the last token of Tokens.
	Logits []float32
	// RowLogits, if non-nil, is called with the logits of every token of Tokens, in order (i
	// indexes Tokens), on the goroutine that called Forward; logits is valid only during the
	// call. A prompt's logprobs need them. They are bit-identical to what Logits would receive
	// for the same token.
	RowLogits func(i int, logits []float32)
}

// logitRowGroup bounds the rows whose logits are computed at once (vocab-sized each).
const logitRowGroup = 32

// logitRow is a token row whose logits are wanted: its sequence and its index in Tokens.
type logitRow struct{ row, seq, tok int }

// workspace holds one Forward call's activations; reused across calls through Model.work.
type workspace struct {
	x, h, qkv, attn, proj, gu, act []float32
	rope                           []float32 // per token row: cos (HeadDim/2), then sin
	logits                         []float32 // lm_head's output rows
	tokSeq                         []int32   // sequence index of each token
	tokPos                         []int32   // position of each token
	views                          []headView
	viewBase                       []int      // views index of (seq, head 0, block 0)
	headDim                        int        // the model's, for the views (touchHeads)
	logitRows                      []logitRow // token rows whose logits are wanted
	seqAttn                        []seqAttn
	items                          []attnItem
	packItems                      []packItem
	splits                         []splitAttn // decoding sequences split by positions (attention_split.go)
	posItems                       []posItem
	splitGate                      splitGate // the split sequences' phases within a Parallel call
	// packs holds the chunks packed once per step (keys, values) of the sequences whose
	// attention work items share them; the Linears and their memory are reused across layers
	// and steps.
	packs []*kernel.Linear
}

// release drops the workspace's references to the step's sequences, so the pooled workspace
// does not keep them alive.
func (w *workspace) release() {
	clear(w.views)
	w.items, w.packItems, w.posItems = w.items[:0], w.packItems[:0], w.posItems[:0]
}

// headView is one (layer, block, KV head) view of the KV store: float32 values (k, v),
// bfloat16 ones (k16, v16) or FP8 codes (k8, v8) with their layer's quantization (fp8).
type headView struct {
	k, v     []float32
	k16, v16 []uint16
	k8, v8   []uint8
	fp8      *fp8Layer
	stride   int
	// fp8F32: the FP8 keys go to the float32 kernels even if bfloat16-exact (Model.fp8F32).
	fp8F32 bool
}

// grow returns s resized to n, reallocating only when its capacity is too small.
func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// LayerObserver may be implemented by the KV store given to Forward: LayerDone(l) is called on
// Forward's goroutine after layer l of the step wrote its keys and values of every sequence's
// tokens into the blocks (a connector streams them while the next layers compute). It must not
// block. A model on several tensor-parallel ranks refuses one: layer-by-layer push needs a
// prefiller at TP 1 (P/D otherwise works between any TP sizes).
type LayerObserver interface {
	LayerDone(layer int)
}

// Forward runs one batched step over seqs. blockSize is the KV block size in tokens.
//
// For every sequence it writes the KV of Tokens (positions Start..Start+len-1) into the blocks
// and, if Logits is non-nil, computes the logits of the last token. Attention of the token at
// position p reads positions 0..p from the blocks, in order, so the result does not depend on
// how the sequence was chunked or batched: a token's logits and KV are bit-identical whatever
// batch, batch position or prefill chunking they are computed in.
//
// A model run on several tensor-parallel ranks needs ForwardRanks.
func (m *Model) Forward(ctx context.Context, kv KVBlocks, blockSize int, seqs []Seq) error {
	return m.ForwardRanks(ctx, []KVBlocks{kv}, blockSize, seqs)
}

// ForwardRanks is Forward for a model run on TensorParallelSize ranks: kvs[r] is rank r's KV
// store, which holds under the same block ids the KV heads rank r owns (RankKVHeads). The
// logits, and every KV head's values, are bit-identical to Forward's at one rank (tp.go).
func (m *Model) ForwardRanks(ctx context.Context, kvs []KVBlocks, blockSize int, seqs []Seq) (err error) {
	defer func() {
		// A store that panics (a block id out of range) fails the step, not the process.
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: forward step failed: %v", ErrBadInput, r)
		}
	}()
	m.life.RLock()
	defer m.life.RUnlock()
	if m.closed.Load() {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	total, err := m.checkStep(kvs, blockSize, seqs)
	if err != nil || total == 0 {
		return err
	}

	w, _ := m.work.Get().(*workspace)
	if w == nil {
		w = new(workspace)
	}
	defer m.work.Put(w)
	m.at(partEmbed)
	defer m.at(partEnd)
	m.embedStep(w, seqs, total)
	if m.tp != nil {
		return m.tp.forward(ctx, m, w, kvs, blockSize, seqs, total)
	}
	m.sizeLayerBuffers(w, total)
	m.planViews(w, seqs, blockSize)
	m.planAttention(w, seqs)
	defer w.release()

	obs, _ := kvs[0].(LayerObserver)
	for l := range m.layer {
		if err = ctx.Err(); err != nil {
			return err
		}
		m.at(partViews)
		m.resolveViews(w, kvs[0], l, blockSize, seqs)
		m.layerStep(w, &m.layer[l], seqs, blockSize, total)
		if obs != nil {
			obs.LayerDone(l)
		}
	}
	m.logitsStep(w, seqs, func(rows []logitRow, logits []float32) {
		m.at(partLMHead)
		m.normRows(w.h, w.x, rows)
		m.head.Apply(logits, w.h, len(rows))
	})
	return nil
}

// checkStep validates a step's arguments against the model and the stores and returns the
// number of tokens the step computes.
func (m *Model) checkStep(kvs []KVBlocks, blockSize int, seqs []Seq) (int, error) {
	c := m.cfg
	if blockSize <= 0 {
		return 0, fmt.Errorf("%w: block size %d", ErrBadInput, blockSize)
	}
	if len(kvs) != m.TensorParallelSize() {
		return 0, fmt.Errorf("%w: %d KV stores for a model on %d tensor-parallel ranks", ErrBadInput, len(kvs), m.TensorParallelSize())
	}
	for _, kv := range kvs {
		if _, ok := kv.(LayerObserver); ok && m.tp != nil {
			return 0, fmt.Errorf("%w: a layer observer (%T) needs one rank; the model runs on %d", ErrBadInput, kv, len(kvs))
		}
		if _, ok := kv.(KVBlocksBF16); m.kvBF16 && !ok {
			return 0, fmt.Errorf("%w: the model's KV cache is bfloat16 but the store (%T) has no bfloat16 views", ErrBadInput, kv)
		}
		if _, ok := kv.(KVBlocksFP8); m.kvFP8 && !ok {
			return 0, fmt.Errorf("%w: the model's KV cache is %v but the store (%T) has no FP8 views", ErrBadInput, m.fp8, kv)
		}
	}
	total := 0
	for i, s := range seqs {
		if err := c.checkSeq(i, s, blockSize); err != nil {
			return 0, err
		}
		total += len(s.Tokens)
	}
	return total, nil
}

// checkSeq validates sequence i of a step.
func (c Config) checkSeq(i int, s Seq, blockSize int) error {
	if s.Start < 0 {
		return fmt.Errorf("%w: seq %d: start %d", ErrBadInput, i, s.Start)
	}
	end := s.Start + len(s.Tokens)
	if end > len(s.Blocks)*blockSize {
		return fmt.Errorf("%w: seq %d: %d positions but %d blocks of %d", ErrBadInput, i, end, len(s.Blocks), blockSize)
	}
	if s.Logits != nil && len(s.Logits) != c.VocabSize {
		return fmt.Errorf("%w: seq %d: logits length %d, vocab %d", ErrBadInput, i, len(s.Logits), c.VocabSize)
	}
	if (s.Logits != nil || s.RowLogits != nil) && len(s.Tokens) == 0 {
		return fmt.Errorf("%w: seq %d: logits requested for no tokens", ErrBadInput, i)
	}
	for _, t := range s.Tokens {
		if t < 0 || int(t) >= c.VocabSize {
			return fmt.Errorf("%w: seq %d: token %d outside vocabulary of %d", ErrBadInput, i, t, c.VocabSize)
		}
	}
	return nil
}

// embedStep fills what every layer (and every rank) shares: the embeddings, each row's
// sequence and position, the rows whose logits are wanted and RoPE's cos and sin of every row.
func (m *Model) embedStep(w *workspace, seqs []Seq, total int) {
	c := m.cfg
	h, hd := c.HiddenSize, c.HeadDim
	w.x = grow(w.x, total*h)
	w.tokSeq = grow(w.tokSeq, total)
	w.tokPos = grow(w.tokPos, total)
	w.logitRows = w.logitRows[:0]

	row := 0
	for i, s := range seqs {
		for j, t := range s.Tokens {
			m.lookup(t, w.x[row*h:(row+1)*h])
			w.tokSeq[row] = int32(i)
			w.tokPos[row] = int32(s.Start + j)
			row++
		}
		switch {
		case s.RowLogits != nil:
			for j := range s.Tokens {
				w.logitRows = append(w.logitRows, logitRow{row: row - len(s.Tokens) + j, seq: i, tok: j})
			}
		case s.Logits != nil:
			w.logitRows = append(w.logitRows, logitRow{row: row - 1, seq: i, tok: len(s.Tokens) - 1})
		}
	}

	// RoPE's cos and sin of every token, once for all layers.
	w.rope = grow(w.rope, total*hd)
	m.pool.Parallel((total+63)/64, func(i int) {
		for r := i * 64; r < min(total, (i+1)*64); r++ {
			m.rope.angles(int(w.tokPos[r]), w.rope[r*hd:r*hd+hd/2], w.rope[r*hd+hd/2:(r+1)*hd])
		}
	})
}

// sizeLayerBuffers sizes w's per-layer activations for total token rows.
func (m *Model) sizeLayerBuffers(w *workspace, total int) {
	c := m.cfg
	h, qd, kd := c.HiddenSize, c.NumHeads*c.HeadDim, c.NumKVHeads*c.HeadDim
	w.h = grow(w.h, total*h)
	w.qkv = grow(w.qkv, total*(qd+2*kd))
	w.attn = grow(w.attn, total*qd)
	w.proj = grow(w.proj, total*h)
	w.gu = grow(w.gu, total*2*c.IntermediateSize)
	w.act = grow(w.act, total*c.IntermediateSize)
}

// planViews sizes the view table of the step: for every sequence, the model's KV heads × its
// blocks.
func (m *Model) planViews(w *workspace, seqs []Seq, blockSize int) {
	w.viewBase = grow(w.viewBase, len(seqs))
	nviews := 0
	for i, s := range seqs {
		w.viewBase[i] = nviews
		if len(s.Tokens) > 0 {
			nviews += m.cfg.NumKVHeads * ((s.Start + len(s.Tokens) + blockSize - 1) / blockSize)
		}
	}
	w.views = grow(w.views, nviews)
	w.headDim = m.cfg.HeadDim
}

// layerStep runs decoder layer ly over the step's total token rows (w.views shows its KV).
func (m *Model) layerStep(w *workspace, ly *decoderLayer, seqs []Seq, blockSize, total int) {
	c := m.cfg
	h, in := c.HiddenSize, c.IntermediateSize
	eps := float32(c.RMSNormEps)

	// Attention block.
	m.at(partNorm)
	m.eachRows(total, h, func(r0, r1 int) { kernel.RMSNorm(w.h[r0*h:r1*h], w.x[r0*h:r1*h], ly.inNorm, eps) })
	m.at(partQKV)
	ly.qkv.Apply(w.qkv, w.h, total)
	m.at(partPrepare)
	m.pool.Parallel(total, func(r int) { m.prepareToken(w, ly, seqs, blockSize, r) })
	m.at(partAttention)
	m.attention(w, seqs, blockSize)
	m.at(partO)
	ly.o.Apply(w.proj, w.attn, total)
	m.at(partResidual)
	m.eachRows(total, h, func(r0, r1 int) { kernel.Add(w.x[r0*h:r1*h], w.x[r0*h:r1*h], w.proj[r0*h:r1*h]) })

	// MLP block.
	m.at(partNorm)
	m.eachRows(total, h, func(r0, r1 int) { kernel.RMSNorm(w.h[r0*h:r1*h], w.x[r0*h:r1*h], ly.postNorm, eps) })
	m.at(partGateUp)
	ly.gateUp.Apply(w.gu, w.h, total)
	m.at(partSiLU)
	m.eachRows(total, in, func(r0, r1 int) {
		for r := r0; r < r1; r++ {
			g := w.gu[r*2*in : (r+1)*2*in]
			kernel.SiLUMul(w.act[r*in:(r+1)*in], g[:in], g[in:])
		}
	})
	m.at(partDown)
	ly.down.Apply(w.proj, w.act, total)
	m.at(partResidual)
	m.eachRows(total, h, func(r0, r1 int) { kernel.Add(w.x[r0*h:r1*h], w.x[r0*h:r1*h], w.proj[r0*h:r1*h]) })
}

// logitsStep computes the logits of the rows whose logits are wanted, a group of rows at a
// time (compute: the final norm and lm_head of rows into logits, vocab-sized rows), and hands
// each its logits.
func (m *Model) logitsStep(w *workspace, seqs []Seq, compute func(rows []logitRow, logits []float32)) {
	n := len(w.logitRows)
	if n == 0 {
		return
	}
	v := m.cfg.VocabSize
	w.logits = grow(w.logits, min(n, logitRowGroup)*v)
	logits := w.logits
	if r := w.logitRows[0]; n == 1 && seqs[r.seq].RowLogits == nil {
		// One row whose logits go to its sequence's Logits: computed there, not copied there.
		compute(w.logitRows, seqs[r.seq].Logits)
		return
	}
	for g := 0; g < n; g += logitRowGroup {
		rows := w.logitRows[g:min(n, g+logitRowGroup)]
		compute(rows, logits)
		m.at(partLogitsOut)
		for k, r := range rows {
			if s := seqs[r.seq]; s.RowLogits != nil {
				s.RowLogits(r.tok, logits[k*v:(k+1)*v])
			}
		}
		// The last rows' logits to their sequences, on every worker (a batch of 32 is 19 MB
		// for a 152K vocabulary).
		m.pool.Parallel(len(rows), func(k int) {
			if r, s := rows[k], seqs[rows[k].seq]; s.Logits != nil && r.tok == len(s.Tokens)-1 {
				copy(s.Logits, logits[k*v:(k+1)*v])
			}
		})
	}
}

// normRows writes the final norm of the hidden rows (of x) that rows name into dst, one after
// the other.
func (m *Model) normRows(dst, x []float32, rows []logitRow) {
	h := m.cfg.HiddenSize
	eps := float32(m.cfg.RMSNormEps)
	for k, r := range rows {
		kernel.RMSNorm(dst[k*h:(k+1)*h], x[r.row*h:(r.row+1)*h], m.norm, eps)
	}
}

// eachRows runs fn on ranges [r0, r1) of rows rows of width values, split over the pool's
// workers when there is enough work to pay for it. Row-wise operations compute each row the
// same way wherever it is, so the split changes no result.
func (m *Model) eachRows(rows, width int, fn func(r0, r1 int)) {
	const minValues = 1 << 15
	per := max(1, minValues/width)
	if rows <= per {
		fn(0, rows)
		return
	}
	m.pool.Parallel((rows+per-1)/per, func(i int) { fn(i*per, min(rows, (i+1)*per)) })
}

// resolveViews fills the view table of layer l: for every sequence, KV head and block index.
func (m *Model) resolveViews(w *workspace, kv KVBlocks, l, blockSize int, seqs []Seq) {
	nkv := m.cfg.NumKVHeads
	// The store's typed views, asserted once per layer rather than once per view.
	kv8, _ := kv.(KVBlocksFP8)
	kv16, _ := kv.(KVBlocksBF16)
	for i, s := range seqs {
		if len(s.Tokens) == 0 {
			continue
		}
		nb := (s.Start + len(s.Tokens) + blockSize - 1) / blockSize
		views := w.views[w.viewBase[i] : w.viewBase[i]+nkv*nb]
		for g := range nkv {
			for b, blk := range s.Blocks[:nb] {
				// Only the fields of the model's one kind of view are written, not the whole
				// struct (the others stay nil: a workspace serves one model, and release clears
				// its views): about 12 ns a float32 view instead of 35, 17 a bfloat16 one
				// instead of 20 (docs/performance.md, b1idle).
				v := &views[g*nb+b]
				switch {
				case m.kvFP8:
					v.k8, v.v8, v.stride = kv8.HeadViewFP8(l, int(blk), g)
					v.fp8, v.fp8F32 = &m.fp8Layers[l], m.fp8F32
				case m.kvBF16:
					v.k16, v.v16, v.stride = kv16.HeadViewBF16(l, int(blk), g)
				default:
					v.k, v.v, v.stride = kv.HeadView(l, int(blk), g)
				}
			}
		}
	}
}

// view returns the view of (seq i, KV head g, block index b).
func (w *workspace) view(seqs []Seq, blockSize, i, g, b int) headView {
	s := seqs[i]
	nb := (s.Start + len(s.Tokens) + blockSize - 1) / blockSize
	return w.views[w.viewBase[i]+g*nb+b]
}

// prepareToken adds biases, applies the per-head q/k norms and RoPE to token row r, scales its
// queries by 1/sqrt(HeadDim), and writes its K and V into the KV store.
func (m *Model) prepareToken(w *workspace, ly *decoderLayer, seqs []Seq, blockSize, r int) {
	c := m.cfg
	hd := c.HeadDim
	qd, kd := c.NumHeads*hd, c.NumKVHeads*hd
	row := w.qkv[r*(qd+2*kd) : (r+1)*(qd+2*kd)]
	if ly.qkvBias != nil {
		kernel.Add(row, row, ly.qkvBias)
	}
	if ly.qNorm != nil {
		eps := float32(c.RMSNormEps)
		kernel.RMSNorm(row[:qd], row[:qd], ly.qNorm, eps)
		kernel.RMSNorm(row[qd:qd+kd], row[qd:qd+kd], ly.kNorm, eps)
	}
	cos, sin := w.rope[r*hd:r*hd+hd/2], w.rope[r*hd+hd/2:(r+1)*hd]
	pos := int(w.tokPos[r])
	for hh := range c.NumHeads + c.NumKVHeads {
		kernel.Rope(row[hh*hd:(hh+1)*hd], cos, sin)
	}
	kernel.Scale(m.qScale, row[:qd])
	si := int(w.tokSeq[r])
	b, slot := pos/blockSize, pos%blockSize
	for g := range c.NumKVHeads {
		v := w.view(seqs, blockSize, si, g, b)
		o := slot * v.stride
		if m.kvFP8 {
			m.storeFP8(v, o, row[qd+g*hd:qd+(g+1)*hd], row[qd+kd+g*hd:qd+kd+(g+1)*hd])
			continue
		}
		if m.kvBF16 {
			kernel.NarrowBF16(v.k16[o:o+hd], row[qd+g*hd:qd+(g+1)*hd])
			kernel.NarrowBF16(v.v16[o:o+hd], row[qd+kd+g*hd:qd+kd+(g+1)*hd])
			continue
		}
		copy(v.k[o:o+hd], row[qd+g*hd:qd+(g+1)*hd])
		copy(v.v[o:o+hd], row[qd+kd+g*hd:qd+kd+(g+1)*hd])
	}
}

// lookup writes the embedding of token t into dst (HiddenSize values); in bfloat16 the values
// of an embedding not stored as bfloat16 are rounded to it, as every other weight is.
func (m *Model) lookup(t int32, dst []float32) {
	if m.tiedEmbed {
		m.headRow(int(t), dst)
		return
	}
	m.embed.fill(int(t), dst)
	if m.bf16 && m.embed.storage() != kernel.BF16 {
		for i, x := range dst {
			dst[i] = kernel.BF16ToF32(kernel.F32ToBF16(x))
		}
	}
}
