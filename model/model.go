// Package model is kvbridge's transformer: a Qwen3/Qwen2/Llama-family decoder computed in float32
// over a paged KV store, its weights (Hugging Face safetensors directories or built-in random
// models), its tokenizer and chat template, and token sampling.
//
// The forward pass is batch-invariant: a token's KV and logits are bit-identical whatever batch,
// batch position or prefill chunking they are computed in. Disaggregated prefill/decode relies on
// it to produce exactly the output of a single instance.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package model

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// GenerationConfig holds a model's generation defaults (generation_config.json for HF models).
type GenerationConfig struct {
	// EOSTokenIDs end generation (unless the request ignores EOS).
	EOSTokenIDs []int32
	// SuppressTokens are never sampled: the engine sets their logits to -Inf. For the built-in
	// models these are all tokens whose text is not printable UTF-8, plus <|im_start|>; for HF
	// models the ids between the tokenizer's size and the embedding's (padding rows).
	SuppressTokens []int32
	// Temperature is the default sampling temperature (1 when the model does not say).
	Temperature float64
	// MaxNewTokens is the default max_tokens of a request that sets none (generation_config's
	// max_new_tokens, which vLLM applies the same way); 0 means up to the context length.
	MaxNewTokens int
	// TopP is the default nucleus mass (1 = off when the model does not say).
	TopP float64
	// TopK is the default top-k (0 = off when the model does not say).
	TopK int
}

// OpenOptions tune Open.
type OpenOptions struct {
	// ChatTemplate, if non-empty, is a Jinja chat template source that replaces the model's own.
	ChatTemplate string
	// HubCache, if non-empty, is the only Hugging Face hub cache directory searched for repo ids
	// (instead of $HF_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub and
	// ~/.cache/huggingface/hub).
	HubCache string
}

// Model is a loaded decoder-only transformer. Its methods are safe for concurrent use.
type Model struct {
	name  string
	cfg   Config
	tok   *tokenizer.Tokenizer
	tmpl  tokenizer.ChatTemplate
	gen   GenerationConfig
	embed []float32 // VocabSize × HiddenSize
	layer []decoderLayer
	norm  []float32
	head  *kernel.Linear
	rope  rope
	pool  *kernel.Pool // owned: the workers of every Linear and of attention
	// serial is a one-worker pool: attention's per-step Linears run inline on the calling worker.
	serial *kernel.Pool
	qScale float32 // 1/sqrt(HeadDim)
	// prefillMin is the number of a sequence's tokens in a step from which attention packs each
	// of its chunks once for the step, shared by its work items (from the second item per KV
	// head on: tileTokens+1; tests change it).
	prefillMin int
	// inPlace: work items that pack their own chunks (decode) instead compute scores and value
	// sums straight from the KV store's rows with kernel.RowDots and kernel.AccumulateRows, when
	// the kernel has them for HeadDim (tests change it).
	inPlace bool
	// weightBytes is the float32 bytes streamed per decode step (see WeightBytes).
	weightBytes int64

	work    sync.Pool // *workspace
	scratch sync.Pool // *attnScratch
	closed  atomic.Bool
}

// decoderLayer holds one layer's packed weights.
type decoderLayer struct {
	inNorm, postNorm []float32
	qkv              *kernel.Linear // fused q, k, v projections: rows [q heads | k heads | v heads]
	qkvBias          []float32      // nil without attention biases
	qNorm, kNorm     []float32      // nil without QK norm
	o                *kernel.Linear
	gateUp           *kernel.Linear // fused gate and up projections: rows [gate | up]
	down             *kernel.Linear
}

// Builtin model names.
const (
	// Tiny is a very small built-in random model for tests.
	Tiny = "kvbridge/tiny"
	// Small is the default built-in random model (about 27M parameters).
	Small = "kvbridge/small"
)

// Open loads a model: a built-in name (kvbridge/tiny, kvbridge/small), a local Hugging Face model
// directory, or a repo id ("Qwen/Qwen3-0.6B") looked up in the local Hugging Face cache. It never
// uses the network.
func Open(ctx context.Context, nameOrPath string, opts OpenOptions) (*Model, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var (
		m   *Model
		err error
	)
	if spec, ok := builtinSpecs(nameOrPath); ok {
		m, err = newBuiltin(nameOrPath, spec)
	} else {
		var dir string
		dir, err = resolveModelDir(nameOrPath, opts.HubCache)
		if err == nil {
			m, err = loadDir(ctx, nameOrPath, dir)
		}
	}
	if err != nil {
		return nil, err
	}
	if opts.ChatTemplate != "" {
		t, err := tokenizer.ParseChatTemplate(opts.ChatTemplate, m.tok.BOSToken(), m.tok.EOSToken())
		if err != nil {
			m.Close()
			return nil, fmt.Errorf("model: chat template: %w", err)
		}
		m.tmpl = t
	}
	return m, nil
}

// Name returns the name the model was opened with.
func (m *Model) Name() string { return m.name }

// Config returns the model's configuration.
func (m *Model) Config() Config {
	c := m.cfg
	c.EOSTokenIDs = append([]int32(nil), c.EOSTokenIDs...)
	if c.RopeScaling != nil {
		rs := *c.RopeScaling
		c.RopeScaling = &rs
	}
	return c
}

// Tokenizer returns the model's tokenizer.
func (m *Model) Tokenizer() *tokenizer.Tokenizer { return m.tok }

// ChatTemplate returns the model's chat template.
func (m *Model) ChatTemplate() tokenizer.ChatTemplate { return m.tmpl }

// Generation returns the model's generation defaults.
func (m *Model) Generation() GenerationConfig {
	g := m.gen
	g.EOSTokenIDs = append([]int32(nil), g.EOSTokenIDs...)
	g.SuppressTokens = append([]int32(nil), g.SuppressTokens...)
	return g
}

// WeightBytes returns the bytes of float32 weights one decode step streams from memory: every
// projection matrix, every norm vector and lm_head (the embedding lookup of one row is not
// counted). Memory bandwidth divided by this bounds decode tokens/s.
func (m *Model) WeightBytes() int64 { return m.weightBytes }

// matmulMACs returns the multiply-adds of the per-token projections of all layers (not lm_head).
func (c Config) matmulMACs() float64 {
	qkv := float64((c.NumHeads + 2*c.NumKVHeads) * c.HeadDim * c.HiddenSize)
	o := float64(c.HiddenSize * c.NumHeads * c.HeadDim)
	mlp := 3 * float64(c.HiddenSize*c.IntermediateSize)
	return float64(c.NumLayers) * (qkv + o + mlp)
}

// attentionMACs returns the multiply-adds of one token's attention over contextLen positions
// (scores and weighted values, all layers and heads).
func (c Config) attentionMACs(contextLen int) float64 {
	return 2 * float64(c.NumLayers*c.NumHeads*c.HeadDim) * float64(contextLen)
}

// FLOPsPerToken returns the floating-point operations (2 per multiply-add) of one token whose
// attention spans contextLen positions (its own included) and whose logits are computed: all
// projections, attention scores and weighted values, and lm_head. Norms, RoPE and softmax are
// not counted.
func (m *Model) FLOPsPerToken(contextLen int) float64 {
	c := m.cfg
	return 2 * (c.matmulMACs() + c.attentionMACs(contextLen) + float64(c.VocabSize*c.HiddenSize))
}

// PrefillFLOPs returns the floating-point operations of prefilling promptLen tokens from position
// 0 with logits for the last token only (what a prefill step computes), counted as FLOPsPerToken.
func (m *Model) PrefillFLOPs(promptLen int) float64 {
	c := m.cfg
	n := float64(promptLen)
	// Σ_{p=1..n} p = n(n+1)/2 attended positions.
	return 2 * (n*c.matmulMACs() + c.attentionMACs(1)*n*(n+1)/2 + float64(c.VocabSize*c.HiddenSize))
}

// Close releases the model. It is idempotent; using the model afterwards returns ErrClosed.
func (m *Model) Close() error {
	if m.closed.Swap(true) {
		return nil
	}
	return errors.Join(m.pool.Close(), m.serial.Close())
}

// String describes the model for logs.
func (m *Model) String() string {
	c := m.cfg
	return fmt.Sprintf("%s (%s, %d layers, hidden %d, heads %d/%d×%d, vocab %d)", m.name, c.Architecture,
		c.NumLayers, c.HiddenSize, c.NumHeads, c.NumKVHeads, c.HeadDim, c.VocabSize)
}
