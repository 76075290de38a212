package model

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// weights are a model's parameters in Hugging Face layout (matrices out × in, row-major),
// before packing for the kernel.
type weights struct {
	embed  matrix // VocabSize × HiddenSize
	layers []layerWeights
	norm   []float32 // HiddenSize
	lmHead matrix    // VocabSize × HiddenSize; empty when tied to embed
}

// layerWeights are one decoder layer's parameters.
type layerWeights struct {
	inNorm, postNorm []float32 // HiddenSize
	q, k, v, o       matrix    // q: NumHeads·HeadDim × Hidden; k, v: NumKVHeads·HeadDim × Hidden; o: Hidden × NumHeads·HeadDim
	qb, kb, vb       []float32 // biases, nil when absent
	qNorm, kNorm     []float32 // HeadDim, nil without QK norm
	gate, up, down   matrix    // gate, up: Intermediate × Hidden; down: Hidden × Intermediate
	// kScale, vScale, kvScale are an FP8 KV cache's scales (one value each), nil when the
	// checkpoint has none (kvfp8.go).
	kScale, vScale, kvScale []float32
}

// matrix is a row-major weight matrix held in memory as float32 (data), or as the raw
// little-endian rows of a memory-mapped checkpoint tensor (raw, of safetensors dtype "F32",
// "BF16" or "F16", cols values a row), so loading never holds a widened copy of a checkpoint.
type matrix struct {
	data  []float32
	raw   []byte
	dtype string
	cols  int
}

// empty reports whether m holds nothing.
func (m matrix) empty() bool { return m.data == nil && m.raw == nil }

// storage returns the kernel type m's values are exact in: F32 for in-memory data, the
// checkpoint's type otherwise.
func (m matrix) storage() kernel.DType {
	switch m.dtype {
	case "BF16":
		return kernel.BF16
	case "F16":
		return kernel.F16
	}
	return kernel.F32
}

// fill writes row n (len(dst) values) into dst, widened to float32.
func (m matrix) fill(n int, dst []float32) {
	if m.raw != nil {
		size, _ := dtypeSize(m.dtype)
		widen(dst, m.raw[n*m.cols*size:(n+1)*m.cols*size], m.dtype)
		return
	}
	copy(dst, m.data[n*len(dst):(n+1)*len(dst)])
}

// fill16 writes row n (len(dst) values) into dst as 16-bit values of to (BF16 or F16): the raw
// bits when the checkpoint stores that type, else the values rounded to nearest even.
func (m matrix) fill16(n int, dst []uint16, to kernel.DType) {
	if m.storage() == to {
		raw := m.raw[n*m.cols*2 : (n+1)*m.cols*2]
		for i := range dst {
			dst[i] = binary.LittleEndian.Uint16(raw[2*i:])
		}
		return
	}
	wide := make([]float32, len(dst))
	m.fill(n, wide)
	for i, v := range wide {
		if to == kernel.BF16 {
			dst[i] = kernel.F32ToBF16(v)
		} else {
			dst[i] = kernel.F32ToF16(v)
		}
	}
}

// part is rows [first, first+n) of a matrix, which make up rows [at, at+n) of a fused Linear.
type part struct {
	m            matrix
	at, n, first int
}

// row returns the matrix row that fused row n (in [at, at+n)) reads.
func (p part) row(n int) int { return n - p.at + p.first }

// newFused packs parts (stacked in order; together out rows of in values) into one Linear on
// pool: with bf16, bfloat16 weights (rounded to nearest even where the checkpoint is not
// bfloat16) with bfloat16 products; else stored in the type all parts are exact in (float32
// when they differ) with float32 products.
func newFused(pool *kernel.Pool, bf16 bool, out, in int, parts ...part) *kernel.Linear {
	find := func(n int) part {
		for _, p := range parts {
			if n < p.at+p.n {
				return p
			}
		}
		panic("model: fused row out of range")
	}
	if bf16 {
		return kernel.NewLinearBF16Dot(pool, out, in, func(n int, dst []uint16) {
			p := find(n)
			p.m.fill16(p.row(n), dst, kernel.BF16)
		})
	}
	dtype := parts[0].m.storage()
	for _, p := range parts[1:] {
		if p.m.storage() != dtype {
			dtype = kernel.F32
		}
	}
	if dtype == kernel.F32 {
		return kernel.NewLinearFrom(pool, out, in, func(n int, dst []float32) {
			p := find(n)
			p.m.fill(p.row(n), dst)
		})
	}
	return kernel.NewLinear16From(pool, dtype, out, in, func(n int, dst []uint16) {
		p := find(n)
		p.m.fill16(p.row(n), dst, dtype)
	})
}

// tensorSpec is one HF tensor the architecture uses: its name, shape, whether it may be absent,
// and the field receiving it (vec for vectors and the embedding, mat for projection matrices). A
// scalar (shape nil) may be stored with shape [] or [1].
type tensorSpec struct {
	name     string
	shape    []int
	optional bool
	scalar   bool
	vec      *[]float32
	mat      *matrix
}

// specs returns the tensors the architecture needs, bound to the fields of w that receive or hold
// them (w.layers is allocated if it does not have NumLayers entries).
func (w *weights) specs(c Config) []tensorSpec {
	h, hd := c.HiddenSize, c.HeadDim
	qd, kd := c.NumHeads*hd, c.NumKVHeads*hd
	if len(w.layers) != c.NumLayers {
		w.layers = make([]layerWeights, c.NumLayers)
	}
	s := []tensorSpec{
		{name: "model.embed_tokens.weight", shape: []int{c.VocabSize, h}, mat: &w.embed},
		{name: "model.norm.weight", shape: []int{h}, vec: &w.norm},
	}
	if !c.TieWordEmbeddings {
		s = append(s, tensorSpec{name: "lm_head.weight", shape: []int{c.VocabSize, h}, mat: &w.lmHead})
	}
	for i := range w.layers {
		l := &w.layers[i]
		p := fmt.Sprintf("model.layers.%d.", i)
		s = append(s,
			tensorSpec{name: p + "input_layernorm.weight", shape: []int{h}, vec: &l.inNorm},
			tensorSpec{name: p + "post_attention_layernorm.weight", shape: []int{h}, vec: &l.postNorm},
			tensorSpec{name: p + "self_attn.q_proj.weight", shape: []int{qd, h}, mat: &l.q},
			tensorSpec{name: p + "self_attn.k_proj.weight", shape: []int{kd, h}, mat: &l.k},
			tensorSpec{name: p + "self_attn.v_proj.weight", shape: []int{kd, h}, mat: &l.v},
			tensorSpec{name: p + "self_attn.o_proj.weight", shape: []int{h, qd}, mat: &l.o},
			tensorSpec{name: p + "mlp.gate_proj.weight", shape: []int{c.IntermediateSize, h}, mat: &l.gate},
			tensorSpec{name: p + "mlp.up_proj.weight", shape: []int{c.IntermediateSize, h}, mat: &l.up},
			tensorSpec{name: p + "mlp.down_proj.weight", shape: []int{h, c.IntermediateSize}, mat: &l.down},
		)
		if c.QKNorm {
			s = append(s,
				tensorSpec{name: p + "self_attn.q_norm.weight", shape: []int{hd}, vec: &l.qNorm},
				tensorSpec{name: p + "self_attn.k_norm.weight", shape: []int{hd}, vec: &l.kNorm})
		}
		s = append(s,
			tensorSpec{name: p + "self_attn.q_proj.bias", shape: []int{qd}, vec: &l.qb, optional: !c.AttentionBias},
			tensorSpec{name: p + "self_attn.k_proj.bias", shape: []int{kd}, vec: &l.kb, optional: !c.AttentionBias},
			tensorSpec{name: p + "self_attn.v_proj.bias", shape: []int{kd}, vec: &l.vb, optional: !c.AttentionBias})
		ks, vs, kvs := kvScaleNames(p)
		for _, n := range [...]struct {
			names []string
			vec   *[]float32
		}{{ks, &l.kScale}, {vs, &l.vScale}, {kvs, &l.kvScale}} {
			for _, name := range n.names {
				s = append(s, tensorSpec{name: name, vec: n.vec, optional: true, scalar: true})
			}
		}
	}
	return s
}

// newModel is buildModel in float32.
func newModel(name string, cfg Config, w *weights, tok *tokenizer.Tokenizer, tmpl tokenizer.ChatTemplate, gen GenerationConfig) (*Model, error) {
	return buildModel(name, cfg, w, tok, tmpl, gen, precision{})
}

// buildModel packs w for the kernel and assembles a Model computing with prec. The tokenizer's
// vocabulary must not exceed cfg.VocabSize. Matrices are stored in the type their values are
// exact in (a bf16 checkpoint stays 2 bytes a weight), or in bfloat16 with bfloat16 products; a
// tied embedding is stored once, as lm_head, and looked up from it. An untied embedding stays
// where it is (the mapped checkpoint, whose files the model then keeps open and closes in Close).
func buildModel(name string, cfg Config, w *weights, tok *tokenizer.Tokenizer, tmpl tokenizer.ChatTemplate, gen GenerationConfig, prec precision) (*Model, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if tok.VocabSize() > cfg.VocabSize {
		return nil, fmt.Errorf("%w: tokenizer has %d tokens but the embedding only %d rows", ErrBadConfig, tok.VocabSize(), cfg.VocabSize)
	}
	hd := cfg.HeadDim
	m := &Model{
		name:       name,
		cfg:        cfg,
		tok:        tok,
		tmpl:       tmpl,
		gen:        gen,
		norm:       w.norm,
		rope:       newRope(cfg),
		pool:       kernel.NewPool(0),
		serial:     kernel.NewPool(1),
		qScale:     float32(1 / math.Sqrt(float64(hd))),
		prefillMin: cfg.tileTokens() + 1,
		inPlace:    kernel.RowKernels(cfg.HeadDim),
		bf16:       prec.bf16,
		kvBF16:     prec.kvBF16,
		int8:       prec.int8,
		kvFP8:      prec.kvFP8,
		fp8:        prec.fp8,
		attnWidth:  cfg.NumHeads * hd,
	}
	if prec.kvFP8 {
		var err error
		if m.fp8Layers, err = newFP8Layers(w, prec.fp8); err != nil {
			return nil, err
		}
	}
	head := w.lmHead
	if head.empty() {
		head = w.embed
		m.tiedEmbed = true
	} else {
		m.embed = w.embed
	}
	if prec.tp > 1 {
		tp, err := newTensorParallel(m, w, head, prec)
		if err != nil {
			m.Close()
			return nil, err
		}
		m.tp = tp
		for _, r := range tp.ranks {
			m.weightBytes += r.m.weightBytes
		}
		m.weightBytes += 4 * int64(len(w.norm))
		return m, nil
	}
	m.weightBytes = m.pack(w, head, prec, wholeModel(cfg)) + 4*int64(len(w.norm))
	return m, nil
}

// pack packs the share sh of w's matrices (head is lm_head's) into m's Linears on m.pool and
// returns their bytes (biases and norm vectors included, the final norm not).
func (m *Model) pack(w *weights, head matrix, prec precision, sh share) int64 {
	cfg := m.cfg
	h, hd, in := cfg.HiddenSize, cfg.HeadDim, cfg.IntermediateSize
	qd, kd := sh.q.len()*hd, sh.kv.len()*hd
	q0, kv0 := sh.q.lo*hd, sh.kv.lo*hd
	hw, iw := sh.hidden.len(), sh.inter.len()
	bf := prec.bf16
	newFused := newFused
	if prec.int8 {
		newFused = func(pool *kernel.Pool, _ bool, out, in int, parts ...part) *kernel.Linear {
			return newFusedInt8(pool, prec.roundScale, out, in, parts...)
		}
	}
	var bytes int64
	for i := range w.layers {
		l := &w.layers[i]
		d := decoderLayer{
			inNorm:   l.inNorm,
			postNorm: l.postNorm,
			qkv: newFused(m.pool, bf, qd+2*kd, h,
				part{l.q, 0, qd, q0}, part{l.k, qd, kd, kv0}, part{l.v, qd + kd, kd, kv0}),
			qNorm:  l.qNorm,
			kNorm:  l.kNorm,
			o:      newFused(m.pool, bf, hw, cfg.NumHeads*hd*sh.n, part{l.o, 0, hw, sh.hidden.lo}),
			gateUp: newFused(m.pool, bf, 2*iw, h, part{l.gate, 0, iw, sh.inter.lo}, part{l.up, iw, iw, sh.inter.lo}),
			down:   newFused(m.pool, bf, hw, in, part{l.down, 0, hw, sh.hidden.lo}),
		}
		if l.qb != nil || l.kb != nil || l.vb != nil {
			d.qkvBias = make([]float32, qd+2*kd)
			copyPart(d.qkvBias[:qd], l.qb, q0)
			copyPart(d.qkvBias[qd:qd+kd], l.kb, kv0)
			copyPart(d.qkvBias[qd+kd:], l.vb, kv0)
		}
		bytes += d.qkv.Bytes() + d.o.Bytes() + d.gateUp.Bytes() + d.down.Bytes() +
			4*int64(len(d.qkvBias)+len(l.inNorm)+len(l.postNorm)+len(l.qNorm)+len(l.kNorm))
		m.layer = append(m.layer, d)
	}
	m.head = newFused(m.pool, bf, sh.vocab.len(), h, part{head, 0, sh.vocab.len(), sh.vocab.lo})
	return bytes + m.head.Bytes()
}

// copyPart copies src[from:from+len(dst)] into dst; a nil src (no bias) leaves dst zero.
func copyPart(dst, src []float32, from int) {
	if src != nil {
		copy(dst, src[from:from+len(dst)])
	}
}
