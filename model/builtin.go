package model

import (
	"fmt"
	"math/rand/v2"
	"slices"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// builtinSpec describes a built-in random model.
type builtinSpec struct {
	seed                                                  uint64
	hidden, layers, heads, kvHeads, headDim, intermediate int
}

// builtinVocab is the built-in tokenizer's requested vocabulary size.
const builtinVocab = 4096

// builtinSpecs returns the spec of a built-in model name.
func builtinSpecs(name string) (builtinSpec, bool) {
	switch name {
	case Tiny:
		return builtinSpec{seed: 0x7e1, hidden: 64, layers: 2, heads: 4, kvHeads: 2, headDim: 16, intermediate: 192}, true
	case Small:
		return builtinSpec{seed: 0x5a11, hidden: 512, layers: 8, heads: 8, kvHeads: 4, headDim: 64, intermediate: 1536}, true
	}
	return builtinSpec{}, false
}

// BuiltinNames lists the built-in model names.
func BuiltinNames() []string { return []string{Tiny, Small} }

// builtinConfig returns the Qwen3-style config of spec with the given vocabulary.
func builtinConfig(s builtinSpec, vocab int) Config {
	return Config{
		Architecture:          "Qwen3ForCausalLM",
		VocabSize:             vocab,
		HiddenSize:            s.hidden,
		IntermediateSize:      s.intermediate,
		NumLayers:             s.layers,
		NumHeads:              s.heads,
		NumKVHeads:            s.kvHeads,
		HeadDim:               s.headDim,
		RMSNormEps:            1e-6,
		RopeTheta:             1e6,
		TieWordEmbeddings:     true,
		QKNorm:                true,
		MaxPositionEmbeddings: 32768,
		DType:                 "float32",
		BOSTokenID:            -1,
	}
}

// randomWeights draws the weights of cfg from a PRNG seeded with seed: N(0, 0.02) for the
// embedding and projections, 1 for every norm weight. The draw order is fixed, so the weights
// are a pure function of (cfg, seed).
func randomWeights(cfg Config, seed uint64) *weights {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	normal := func(n int) []float32 {
		s := make([]float32, n)
		for i := range s {
			s[i] = float32(rng.NormFloat64() * 0.02)
		}
		return s
	}
	ones := func(n int) []float32 {
		s := make([]float32, n)
		for i := range s {
			s[i] = 1
		}
		return s
	}
	mat := func(n int) matrix { return matrix{data: normal(n)} }
	h, hd, in := cfg.HiddenSize, cfg.HeadDim, cfg.IntermediateSize
	qd, kd := cfg.NumHeads*hd, cfg.NumKVHeads*hd
	w := &weights{embed: mat(cfg.VocabSize * h)}
	for range cfg.NumLayers {
		l := layerWeights{
			inNorm: ones(h), postNorm: ones(h),
			q: mat(qd * h), k: mat(kd * h), v: mat(kd * h), o: mat(h * qd),
			gate: mat(in * h), up: mat(in * h), down: mat(h * in),
		}
		if cfg.QKNorm {
			l.qNorm, l.kNorm = ones(hd), ones(hd)
		}
		w.layers = append(w.layers, l)
	}
	w.norm = ones(h)
	if !cfg.TieWordEmbeddings {
		w.lmHead = mat(cfg.VocabSize * h)
	}
	return w
}

// newBuiltin builds a built-in model: random weights, the built-in tokenizer, ChatML.
func newBuiltin(name string, s builtinSpec, prec precision) (*Model, error) {
	tok := tokenizer.Builtin(builtinVocab)
	cfg := builtinConfig(s, tok.VocabSize())
	gen, err := builtinGeneration(tok)
	if err != nil {
		return nil, err
	}
	cfg.EOSTokenIDs = gen.EOSTokenIDs
	return buildModel(name, cfg, randomWeights(cfg, s.seed), tok, tokenizer.ChatML(), gen, prec)
}

// builtinGeneration returns the built-in models' generation config: EOS <|im_end|> and
// <|endoftext|>; every other token whose text is not printable UTF-8 (the tokenizer's
// UnprintableIDs, which include the special tokens) and <|im_start|> suppressed, so generated
// text is always valid, printable UTF-8. Their weights are random, so EOS is rare: max_new_tokens
// 256 keeps a request without max_tokens from running to the context length.
func builtinGeneration(tok *tokenizer.Tokenizer) (GenerationConfig, error) {
	gen := GenerationConfig{Temperature: 1, TopP: 1, MaxNewTokens: 256}
	for _, s := range []string{"<|im_end|>", "<|endoftext|>"} {
		id, ok := tok.TokenID(s)
		if !ok {
			return GenerationConfig{}, fmt.Errorf("%w: built-in tokenizer lacks %s", ErrBadConfig, s)
		}
		gen.EOSTokenIDs = append(gen.EOSTokenIDs, id)
	}
	start, ok := tok.TokenID("<|im_start|>")
	if !ok {
		return GenerationConfig{}, fmt.Errorf("%w: built-in tokenizer lacks <|im_start|>", ErrBadConfig)
	}
	// Unprintable ids include the special tokens; EOS must stay sampleable so generation ends.
	for _, id := range tok.UnprintableIDs() {
		if !slices.Contains(gen.EOSTokenIDs, id) {
			gen.SuppressTokens = append(gen.SuppressTokens, id)
		}
	}
	if !slices.Contains(gen.SuppressTokens, start) {
		gen.SuppressTokens = append(gen.SuppressTokens, start)
		slices.Sort(gen.SuppressTokens)
	}
	return gen, nil
}
