// Package model is kvbridge's transformer: a Qwen3/Qwen2/Llama-family decoder over a paged KV
// store, its weights (Hugging Face safetensors directories or built-in random models) kept in
// float32 or in the checkpoint's bfloat16 (OpenOptions.DType: products then take bfloat16
// inputs and sum in float32; norms, softmax and RoPE stay float32; the KV store holds float32 or,
// with OpenOptions.KVCacheDType, bfloat16 or FP8 scaled as vLLM scales it, kvfp8.go) — or, with
// OpenOptions.Quantization int8, in int8 with products on int8 activations —, its tokenizer and
// chat template, and token sampling.
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
	"strings"
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
	// Revision, if non-empty, picks the snapshot of a repo id in the hub cache: a branch or tag
	// (refs/<revision>) or a commit hash (snapshots/<revision>). vLLM's --revision.
	Revision string
	// Tokenizer, if non-empty, is a directory or cached repo id whose tokenizer.json,
	// tokenizer_config.json and chat template replace the model's. vLLM's --tokenizer.
	Tokenizer string
	// DType is vLLM's --dtype: "auto" (or empty: the checkpoint's dtype — bfloat16 for bf16 and,
	// as vLLM's CPU backend casts them, f16 checkpoints; float32 for f32 checkpoints and the
	// built-in models), "bfloat16" or "float32". In bfloat16 the weight matrices are stored as
	// bfloat16, the activations are rounded to bfloat16 at every matrix product's input and the
	// products are summed in float32 (VDPBF16PS where the CPU has it); norms, softmax, RoPE and
	// attention stay float32. In float32 the products are float32; 16-bit checkpoint weights
	// stay 2 bytes and are widened exactly in the kernels.
	DType string
	// KVCacheDType is vLLM's --kv-cache-dtype: "auto" (or empty) follows the compute dtype, as
	// vLLM's does (a bf16 checkpoint gets a bfloat16 KV cache, an f32 one or --dtype float32 a
	// float32 one); "float32" keeps keys and values as float32, "bfloat16" rounds them to
	// bfloat16 (2 bytes a value); "fp8" or "fp8_e4m3", and "fp8_e5m2", store each key (value)
	// divided by its layer's k_scale (v_scale) as one byte of FP8 (see kvfp8.go).
	KVCacheDType string
	// Quantization is vLLM's --quantization: "" (or "none") runs the weights as DType says;
	// "int8" quantizes every weight matrix (lm_head and a tied embedding included) to int8 at
	// load, in groups of 32 inputs with a float32 scale each, and runs the products on int8
	// activations quantized the same way per token (see ParseQuantization).
	Quantization string
	// Int8RoundScale, if not nil, rounds every scale of int8 weights and activations once its
	// group is quantized (with Quantization int8; see kernel.NewLinearInt8ScaledFrom): kvbridge
	// bench quality simulates llama.cpp's Q8_0 (float16 scales) with it.
	Int8RoundScale func(float32) float32
	// TensorParallelSize is vLLM's --tensor-parallel-size: the number of ranks the forward pass
	// runs on (0 or 1: one). It must divide the attention heads, and divide the KV heads or be a
	// multiple of them (then each KV head is replicated on the ranks whose query heads need it,
	// as vLLM does). See tp.go: the logits and KV are bit-identical at every size.
	TensorParallelSize int
	// RankCPUs, if not empty, pins the ranks' threads to CPU sets: rank r of the i-th group of
	// ranks (one group per concurrent Forward, so one per data-parallel engine) runs on
	// RankCPUs[(i·TensorParallelSize + r) mod len(RankCPUs)]. Linux only (sched_setaffinity).
	// A rank with more than one kernel worker (more CPUs than ranks) pins only its own thread.
	RankCPUs [][]int
}

// precision is how a model computes: bfloat16 products and a bfloat16 KV cache, or float32;
// kvFP8, an FP8 KV cache of format fp8; int8: int8 weight matrices (OpenOptions.Quantization)
// whatever bf16 says.
type precision struct {
	bf16, kvBF16, kvFP8 bool
	fp8                 kernel.FP8
	int8                bool
	roundScale          func(float32) float32 // OpenOptions.Int8RoundScale
	tp                  int                   // OpenOptions.TensorParallelSize (≥ 1)
	rankCPUs            [][]int               // OpenOptions.RankCPUs
}

// ParseDType checks a compute dtype (OpenOptions.DType, vLLM's --dtype), case-insensitively,
// and returns its canonical name: "auto" for "" and "auto", "bfloat16" for "bfloat16" and
// "bf16", "float32" for "float32", "float" and "fp32". Anything else, float16 included, is an
// error wrapping ErrUnsupported.
func ParseDType(s string) (string, error) {
	switch strings.ToLower(s) {
	case "", "auto":
		return "auto", nil
	case "bfloat16", "bf16":
		return "bfloat16", nil
	case "float32", "float", "fp32":
		return "float32", nil
	case "float16", "half", "fp16":
		return "", fmt.Errorf("%w: dtype %q: float16 is not supported on the CPU; use bfloat16 or float32", ErrUnsupported, s)
	}
	return "", fmt.Errorf("%w: dtype %q (want auto, bfloat16 or float32)", ErrUnsupported, s)
}

// parsePrecision resolves OpenOptions' dtypes for a checkpoint of dtype ckpt ("" for a built-in
// model).
func parsePrecision(opts OpenOptions, ckpt string) (precision, error) {
	var p precision
	dt, err := ParseDType(opts.DType)
	if err != nil {
		return p, err
	}
	if p.int8, err = parseInt8(opts.Quantization); err != nil {
		return p, err
	}
	p.roundScale = opts.Int8RoundScale
	if p.tp = max(1, opts.TensorParallelSize); opts.TensorParallelSize < 0 {
		return p, fmt.Errorf("%w: size %d", ErrTensorParallel, opts.TensorParallelSize)
	}
	p.rankCPUs = opts.RankCPUs
	switch dt {
	case "auto":
		p.bf16 = ckpt == "bfloat16" || ckpt == "float16"
	case "bfloat16":
		p.bf16 = true
	}
	switch strings.ToLower(opts.KVCacheDType) {
	case "", "auto":
		p.kvBF16 = p.bf16 // vLLM: the KV cache takes the model's dtype
	case "float32", "fp32", "float":
	case "bfloat16", "bf16":
		p.kvBF16 = true
	case "fp8", "fp8_e4m3":
		p.kvFP8, p.fp8 = true, kernel.E4M3
	case "fp8_e5m2":
		p.kvFP8, p.fp8 = true, kernel.E5M2
	default:
		return p, fmt.Errorf("%w: KV cache dtype %q (want auto, float32, bfloat16, fp8, fp8_e4m3 or fp8_e5m2)", ErrUnsupported, opts.KVCacheDType)
	}
	return p, nil
}

// Model is a loaded decoder-only transformer. Its methods are safe for concurrent use.
type Model struct {
	name string
	cfg  Config
	tok  *tokenizer.Tokenizer
	tmpl tokenizer.ChatTemplate
	gen  GenerationConfig
	// embed is the untied embedding (VocabSize × HiddenSize), possibly in the mapped
	// checkpoint; with tiedEmbed the embedding is head's weights and embed is empty.
	embed     matrix
	tiedEmbed bool
	// bf16: bfloat16 products (OpenOptions.DType); kvBF16: a bfloat16 KV cache; int8: int8
	// weight matrices (OpenOptions.Quantization).
	bf16, kvBF16 bool
	int8         bool
	files        mappedFiles // the checkpoint files embed reads; closed by Close
	layer        []decoderLayer
	norm         []float32
	head         *kernel.Linear
	rope         rope
	pool         *kernel.Pool // owned: the workers of every Linear and of attention
	// serial is a one-worker pool: attention's per-step Linears run inline on the calling worker.
	serial *kernel.Pool
	qScale float32 // 1/sqrt(HeadDim)
	// prefillMin is the number of a sequence's tokens in a step from which attention packs each
	// of its chunks once for the step, shared by its work items (from the second item per KV
	// head on: tileTokens+1; tests change it).
	prefillMin int
	// inPlace: work items that pack their own chunks (decode) instead compute scores and value
	// sums straight from the KV store's rows with kernel.RowDots and kernel.AccumulateRows (or
	// their bfloat16 forms), when the kernel has them for HeadDim (tests change it).
	inPlace bool
	// itemHeads, if positive, caps the KV heads of an in-place work item (tests change it; 0:
	// as many as headSpan allows).
	itemHeads int
	// splitOnCaller: a split sequence's probabilities and chunk sums run on the goroutine that
	// called Forward, as they did before they were shared by the workers (tests change it, to
	// compare the two).
	splitOnCaller bool
	// fp8F32: FP8 attention widens the keys to float32 for the float32 scores kernels even where
	// the layer's key table is bfloat16-exact (kvfp8.go), as it did before it used the bfloat16
	// kernels there (tests change it, to compare the two; not passed on to TP ranks).
	fp8F32 bool
	// mark, if set (by a measurement), is called at the start of each part of a step
	// (steppart.go) on the goroutine that called Forward.
	mark func(stepPart)
	// weightBytes is the weight bytes streamed per decode step (see WeightBytes).
	weightBytes int64
	// checkpointBytes is the size of the safetensors files loaded (0 for built-in models).
	checkpointBytes int64

	work    sync.Pool // *workspace
	scratch sync.Pool // *attnScratch
	// life is held (read) by every Forward and (write) by Close, so the checkpoint mapping is
	// never unmapped under a running step.
	life   sync.RWMutex
	closed atomic.Bool

	// kvFP8: an FP8 KV cache of format fp8, quantized per layer as fp8Layers say (kvfp8.go).
	kvFP8     bool
	fp8       kernel.FP8
	fp8Layers []fp8Layer

	// tp holds the tensor-parallel ranks (tp.go) when the model runs on more than one; then
	// layer and head are empty: each rank's shard holds its share.
	tp *tensorParallel
	// attnCol and attnWidth place attention's outputs: head h's values go to columns
	// [attnCol+h·HeadDim, …) of attention rows attnWidth wide (a rank's heads among all of them;
	// 0 and NumHeads·HeadDim for the whole model).
	attnCol, attnWidth int
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
		if opts.Tokenizer != "" || opts.Revision != "" {
			return nil, fmt.Errorf("%w: the built-in model %s has its own tokenizer and no revisions", ErrBadConfig, nameOrPath)
		}
		var prec precision
		prec, err = parsePrecision(opts, "")
		if err == nil {
			m, err = newBuiltin(nameOrPath, spec, prec)
		}
	} else {
		var dir string
		dir, err = resolveModelDir(nameOrPath, opts.HubCache, opts.Revision)
		tokDir := dir
		if err == nil && opts.Tokenizer != "" {
			tokDir, err = resolveModelDir(opts.Tokenizer, opts.HubCache, "")
		}
		if err == nil {
			m, err = loadDir(ctx, nameOrPath, dir, tokDir, opts)
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

// DType returns how the model computes its matrix products: "bfloat16" or "float32"
// (OpenOptions.DType resolved).
func (m *Model) DType() string {
	if m.bf16 {
		return "bfloat16"
	}
	return "float32"
}

// KVCacheDType returns the type of the keys and values the model writes and reads: "float32",
// "bfloat16" (then Forward needs a KVBlocksBF16 store), "fp8_e4m3" or "fp8_e5m2" (a KVBlocksFP8
// store).
func (m *Model) KVCacheDType() string {
	if m.kvFP8 {
		return m.fp8.String()
	}
	if m.kvBF16 {
		return "bfloat16"
	}
	return "float32"
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

// WeightBytes returns the weight bytes one decode step streams from memory, each matrix in its
// storage type (2 bytes a weight for bf16 and f16 checkpoints, 4 for float32, 1 plus a float32
// scale per 32 with --quantization int8): every projection
// matrix, every norm vector and lm_head (the embedding lookup of one row is not counted).
// Memory bandwidth divided by this bounds decode tokens/s.
func (m *Model) WeightBytes() int64 { return m.weightBytes }

// CheckpointBytes returns the size of the safetensors files the weights were loaded from (0 for
// a built-in model): what "the memory it takes on disk" means for a loaded model.
func (m *Model) CheckpointBytes() int64 { return m.checkpointBytes }

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

// AttentionFLOPsPerToken returns the part of FLOPsPerToken(contextLen) that attention computes
// (scores and weighted values, in float32 whatever DType is); the rest are matrix products.
func (m *Model) AttentionFLOPsPerToken(contextLen int) float64 {
	return 2 * m.cfg.attentionMACs(contextLen)
}

// KVBytesPerToken returns the bytes of one token's keys and values in the KV cache, all layers
// (KVCacheDType's size each): what attention reads per position of a context at every step.
// With tensor-parallel ranks it counts each rank's heads (a replicated KV head once per rank
// that holds it).
func (m *Model) KVBytesPerToken() int64 {
	c := m.cfg
	_, heads := m.RankKVHeads(0)
	return int64(c.NumLayers * 2 * heads * m.TensorParallelSize() * c.HeadDim * m.kvValueBytes())
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
	m.life.Lock()
	defer m.life.Unlock()
	if m.closed.Swap(true) {
		return nil
	}
	m.files.close()
	m.files, m.embed = nil, matrix{}
	return errors.Join(m.tp.close(), m.pool.Close(), m.serial.Close())
}

// String describes the model for logs.
func (m *Model) String() string {
	c := m.cfg
	return fmt.Sprintf("%s (%s, %d layers, hidden %d, heads %d/%d×%d, vocab %d)", m.name, c.Architecture,
		c.NumLayers, c.HiddenSize, c.NumHeads, c.NumKVHeads, c.HeadDim, c.VocabSize)
}
