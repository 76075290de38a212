package model

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"

	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// Qwen3_0_6B returns the configuration of Qwen/Qwen3-0.6B (its config.json): 28 layers, hidden
// 1024, 16 query and 8 KV heads of 128, intermediate 3072, vocabulary 151936, tied embeddings,
// bfloat16, context 40960.
func Qwen3_0_6B() Config {
	return Config{
		Architecture: "Qwen3ForCausalLM", ModelType: "qwen3", VocabSize: 151936, HiddenSize: 1024, IntermediateSize: 3072,
		NumLayers: 28, NumHeads: 16, NumKVHeads: 8, HeadDim: 128, RMSNormEps: 1e-6, RopeTheta: 1e6,
		TieWordEmbeddings: true, QKNorm: true, MaxPositionEmbeddings: 40960, DType: "bfloat16",
		BOSTokenID: 151643, EOSTokenIDs: []int32{151645},
	}
}

// RandomCheckpoint describes a Hugging Face model directory with random weights, written by
// WriteRandomCheckpoint: a real model's shape without its (multi-gigabyte, unfetchable)
// weights, for benchmarks and memory tests.
type RandomCheckpoint struct {
	// Config is the architecture and shape (Qwen3, Qwen2 or Llama).
	Config Config
	// DType is the dtype of the weights: "BF16" (default), "F16" or "F32", or any name
	// ParseWeightDType accepts.
	DType string
	// Seed chooses the weights (default 1).
	Seed uint64
}

// ParseWeightDType returns the safetensors dtype ("BF16", "F16" or "F32") of a weight dtype
// name, case-insensitively: bfloat16 or bf16; float16, half, fp16 or f16; float32, float, fp32 or
// f32. Anything else is an error wrapping ErrUnsupported.
func ParseWeightDType(s string) (string, error) {
	switch strings.ToLower(s) {
	case "bfloat16", "bf16":
		return "BF16", nil
	case "float16", "half", "fp16", "f16":
		return "F16", nil
	case "float32", "float", "fp32", "f32":
		return "F32", nil
	}
	return "", fmt.Errorf("%w: weight dtype %q (want bfloat16, float16 or float32)", ErrUnsupported, s)
}

// WriteRandomCheckpoint writes a model directory into dir (created if missing): config.json as
// transformers writes it, generation_config.json, the built-in tokenizer as tokenizer.json and
// tokenizer_config.json (its vocabulary is padded to Config.VocabSize rows), and
// model.safetensors with every tensor the architecture needs, streamed to disk (norm weights
// near 1, everything else uniform with standard deviation 0.02). It returns the bytes of
// model.safetensors.
func WriteRandomCheckpoint(dir string, rc RandomCheckpoint) (int64, error) {
	c := rc.Config
	if rc.DType == "" {
		rc.DType = "BF16"
	}
	if rc.Seed == 0 {
		rc.Seed = 1
	}
	dt, err := ParseWeightDType(rc.DType)
	if err != nil {
		return 0, fmt.Errorf("random checkpoint: %w", err)
	}
	rc.DType = dt
	size, _ := dtypeSize(rc.DType)
	c.DType = map[string]string{"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[rc.DType]
	if err := c.validate(); err != nil {
		return 0, err
	}
	vocab := min(c.VocabSize, 4096)
	if vocab < tokenizer.BuiltinMinVocab {
		return 0, fmt.Errorf("%w: vocabulary %d is smaller than the built-in tokenizer's minimum %d", ErrBadConfig, c.VocabSize, tokenizer.BuiltinMinVocab)
	}
	tj, tcj := tokenizer.BuiltinJSON(vocab)
	eos := int32(vocab - 1)
	c.EOSTokenIDs, c.BOSTokenID = []int32{eos}, -1
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return 0, err
	}
	files := map[string][]byte{
		"config.json":            hfConfigJSON(c),
		"generation_config.json": fmt.Appendf(nil, `{"eos_token_id": [%d], "max_new_tokens": 256}`+"\n", eos),
		"tokenizer.json":         tj,
		"tokenizer_config.json":  tcj,
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			return 0, err
		}
	}

	specs := new(weights).specs(c)
	header := map[string]any{"__metadata__": map[string]string{"format": "pt"}}
	var off int64
	for _, s := range specs {
		if s.optional {
			continue
		}
		n := int64(size)
		for _, d := range s.shape {
			n *= int64(d)
		}
		header[s.name] = map[string]any{"dtype": rc.DType, "shape": s.shape, "data_offsets": []int64{off, off + n}}
		off += n
	}
	h, err := json.Marshal(header)
	if err != nil {
		return 0, err
	}
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	path := filepath.Join(dir, "model.safetensors")
	f, err := os.Create(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	bw := bufio.NewWriterSize(f, 1<<20)
	bw.Write(binary.LittleEndian.AppendUint64(nil, uint64(len(h))))
	bw.Write(h)
	rng := rand.New(rand.NewPCG(rc.Seed, 0x5eed))
	const std = 0.02
	half := std * math.Sqrt(3) // uniform on [-half, half] has standard deviation std
	buf := make([]byte, 0, 4)
	for _, s := range specs {
		if s.optional {
			continue
		}
		n := 1
		for _, d := range s.shape {
			n *= d
		}
		norm := len(s.shape) == 1
		for range n {
			u := float32((rng.Float64()*2 - 1) * half)
			if norm {
				u = 1 + u
			}
			buf = appendValue(buf[:0], rc.DType, u)
			bw.Write(buf)
		}
	}
	if err := bw.Flush(); err != nil {
		return 0, err
	}
	if err := f.Close(); err != nil {
		return 0, err
	}
	return 8 + int64(len(h)) + off, nil
}

// appendValue appends v in dtype (little-endian; bf16 and f16 rounded to nearest even).
func appendValue(b []byte, dtype string, v float32) []byte {
	switch dtype {
	case "BF16":
		return binary.LittleEndian.AppendUint16(b, kernel.F32ToBF16(v))
	case "F16":
		return binary.LittleEndian.AppendUint16(b, kernel.F32ToF16(v))
	}
	return binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
}

// hfConfigJSON renders c as the config.json transformers 4.x writes for it.
func hfConfigJSON(c Config) []byte {
	m := map[string]any{
		"architectures":           []string{c.Architecture},
		"model_type":              c.modelType(),
		"vocab_size":              c.VocabSize,
		"hidden_size":             c.HiddenSize,
		"intermediate_size":       c.IntermediateSize,
		"num_hidden_layers":       c.NumLayers,
		"num_attention_heads":     c.NumHeads,
		"num_key_value_heads":     c.NumKVHeads,
		"head_dim":                c.HeadDim,
		"rms_norm_eps":            c.RMSNormEps,
		"rope_theta":              c.RopeTheta,
		"rope_scaling":            nil,
		"tie_word_embeddings":     c.TieWordEmbeddings,
		"attention_bias":          c.AttentionBias,
		"max_position_embeddings": c.MaxPositionEmbeddings,
		"torch_dtype":             c.DType,
		"hidden_act":              "silu",
		"use_sliding_window":      false,
		"sliding_window":          nil,
		"eos_token_id":            c.EOSTokenIDs,
	}
	if s := c.RopeScaling; s != nil {
		m["rope_scaling"] = map[string]any{"rope_type": s.Type, "factor": s.Factor, "low_freq_factor": s.LowFreqFactor,
			"high_freq_factor": s.HighFreqFactor, "original_max_position_embeddings": s.OriginalMaxPositionEmbeddings}
	}
	b, _ := json.MarshalIndent(m, "", "  ") // strings, numbers and slices always marshal
	return append(b, '\n')
}
