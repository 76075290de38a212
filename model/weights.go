package model

import (
	"fmt"
	"math"

	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// weights are a model's parameters in Hugging Face layout (matrices out × in, row-major),
// before packing for the kernel.
type weights struct {
	embed  []float32 // VocabSize × HiddenSize
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
}

// matrix is a row-major weight matrix held in memory (data) or read row by row, widened to
// float32, from a memory-mapped checkpoint (row), so loading never holds an unpacked float32
// copy of a whole checkpoint.
type matrix struct {
	data []float32
	row  func(n int, dst []float32) // set when data is nil
}

// empty reports whether m holds nothing.
func (m matrix) empty() bool { return m.data == nil && m.row == nil }

// fill writes row n (len(dst) values) into dst.
func (m matrix) fill(n int, dst []float32) {
	if m.row != nil {
		m.row(n, dst)
		return
	}
	copy(dst, m.data[n*len(dst):(n+1)*len(dst)])
}

// tensorSpec is one HF tensor the architecture uses: its name, shape, whether it may be absent,
// and the field receiving it (vec for vectors and the embedding, mat for projection matrices).
type tensorSpec struct {
	name     string
	shape    []int
	optional bool
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
		{name: "model.embed_tokens.weight", shape: []int{c.VocabSize, h}, vec: &w.embed},
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
	}
	return s
}

// newModel packs w for the kernel and assembles a Model. The tokenizer's vocabulary must not
// exceed cfg.VocabSize.
func newModel(name string, cfg Config, w *weights, tok *tokenizer.Tokenizer, tmpl tokenizer.ChatTemplate, gen GenerationConfig) (*Model, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if tok.VocabSize() > cfg.VocabSize {
		return nil, fmt.Errorf("%w: tokenizer has %d tokens but the embedding only %d rows", ErrBadConfig, tok.VocabSize(), cfg.VocabSize)
	}
	h, hd := cfg.HiddenSize, cfg.HeadDim
	qd, kd := cfg.NumHeads*hd, cfg.NumKVHeads*hd
	m := &Model{
		name:       name,
		cfg:        cfg,
		tok:        tok,
		tmpl:       tmpl,
		gen:        gen,
		embed:      w.embed,
		norm:       w.norm,
		rope:       newRope(cfg),
		pool:       kernel.NewPool(0),
		serial:     kernel.NewPool(1),
		qScale:     float32(1 / math.Sqrt(float64(hd))),
		prefillMin: cfg.tileTokens() + 1,
		inPlace:    kernel.RowKernels(cfg.HeadDim),
	}
	var floats int64
	for i := range w.layers {
		l := &w.layers[i]
		in := cfg.IntermediateSize
		d := decoderLayer{
			inNorm:   l.inNorm,
			postNorm: l.postNorm,
			qkv: kernel.NewLinearFrom(m.pool, qd+2*kd, h, func(n int, dst []float32) {
				switch {
				case n < qd:
					l.q.fill(n, dst)
				case n < qd+kd:
					l.k.fill(n-qd, dst)
				default:
					l.v.fill(n-qd-kd, dst)
				}
			}),
			qNorm: l.qNorm,
			kNorm: l.kNorm,
			o:     kernel.NewLinearFrom(m.pool, h, qd, l.o.fill),
			gateUp: kernel.NewLinearFrom(m.pool, 2*in, h, func(n int, dst []float32) {
				if n < in {
					l.gate.fill(n, dst)
				} else {
					l.up.fill(n-in, dst)
				}
			}),
			down: kernel.NewLinearFrom(m.pool, h, in, l.down.fill),
		}
		if l.qb != nil || l.kb != nil || l.vb != nil {
			d.qkvBias = make([]float32, qd+2*kd)
			copy(d.qkvBias, l.qb)
			copy(d.qkvBias[qd:], l.kb)
			copy(d.qkvBias[qd+kd:], l.vb)
		}
		floats += int64((qd+2*kd)*h+h*qd+3*in*h+len(d.qkvBias)) +
			int64(len(l.inNorm)+len(l.postNorm)+len(l.qNorm)+len(l.kNorm))
		m.layer = append(m.layer, d)
	}
	head := w.lmHead
	if head.empty() {
		head = matrix{data: w.embed}
	}
	m.head = kernel.NewLinearFrom(m.pool, cfg.VocabSize, h, head.fill)
	floats += int64(cfg.VocabSize*h + len(w.norm))
	m.weightBytes = 4 * floats
	return m, nil
}
