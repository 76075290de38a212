package model

import (
	"encoding/json"
	"fmt"
	"math"
)

// Config is the subset of a Hugging Face config.json that the forward pass needs.
type Config struct {
	// Architecture is the first entry of "architectures", e.g. "Qwen3ForCausalLM".
	Architecture string
	// VocabSize is the number of rows of the embedding and of lm_head (the logits length).
	VocabSize int
	// HiddenSize is the width of the residual stream.
	HiddenSize int
	// IntermediateSize is the width of the SwiGLU MLP.
	IntermediateSize int
	// NumLayers is the number of decoder layers.
	NumLayers int
	// NumHeads is the number of query heads.
	NumHeads int
	// NumKVHeads is the number of key/value heads (grouped-query attention); it divides NumHeads.
	NumKVHeads int
	// HeadDim is the width of one attention head (may differ from HiddenSize/NumHeads).
	HeadDim int
	// RMSNormEps is the epsilon of every RMSNorm.
	RMSNormEps float64
	// RopeTheta is the RoPE base frequency.
	RopeTheta float64
	// RopeScaling describes an optional RoPE frequency scaling ("llama3" or "linear"); nil if none.
	RopeScaling *RopeScaling
	// TieWordEmbeddings says lm_head shares the embedding matrix.
	TieWordEmbeddings bool
	// QKNorm says each head's query and key pass through an RMSNorm over HeadDim (Qwen3).
	QKNorm bool
	// AttentionBias says the q, k and v projections carry biases (Qwen2).
	AttentionBias bool
	// MaxPositionEmbeddings is the longest context the model was trained for.
	MaxPositionEmbeddings int
	// DType is the checkpoint's torch_dtype, e.g. "bfloat16"; compute is always float32.
	DType string
	// BOSTokenID and EOSTokenIDs are the config.json token ids, if given (-1 / nil when absent).
	BOSTokenID int32
	// EOSTokenIDs are config.json's eos_token_id entries.
	EOSTokenIDs []int32
}

// RopeScaling is a config.json "rope_scaling" object.
type RopeScaling struct {
	// Type is "llama3" or "linear".
	Type string
	// Factor is the scaling factor.
	Factor float64
	// LowFreqFactor, HighFreqFactor and OriginalMaxPositionEmbeddings parameterise "llama3".
	LowFreqFactor, HighFreqFactor float64
	// OriginalMaxPositionEmbeddings is the "llama3" pre-scaling context length.
	OriginalMaxPositionEmbeddings int
}

// hfConfig mirrors the config.json fields we read.
type hfConfig struct {
	Architectures         []string        `json:"architectures"`
	ModelType             string          `json:"model_type"`
	VocabSize             int             `json:"vocab_size"`
	HiddenSize            int             `json:"hidden_size"`
	IntermediateSize      int             `json:"intermediate_size"`
	NumHiddenLayers       int             `json:"num_hidden_layers"`
	NumAttentionHeads     int             `json:"num_attention_heads"`
	NumKeyValueHeads      int             `json:"num_key_value_heads"`
	HeadDim               int             `json:"head_dim"`
	RMSNormEps            float64         `json:"rms_norm_eps"`
	RopeTheta             float64         `json:"rope_theta"`
	RopeScaling           json.RawMessage `json:"rope_scaling"`
	TieWordEmbeddings     *bool           `json:"tie_word_embeddings"`
	AttentionBias         *bool           `json:"attention_bias"`
	MaxPositionEmbeddings int             `json:"max_position_embeddings"`
	TorchDType            string          `json:"torch_dtype"`
	DType                 string          `json:"dtype"`
	HiddenAct             string          `json:"hidden_act"`
	BOSTokenID            json.RawMessage `json:"bos_token_id"`
	EOSTokenID            json.RawMessage `json:"eos_token_id"`
}

// hfRopeScaling mirrors config.json's rope_scaling.
type hfRopeScaling struct {
	RopeType                      string  `json:"rope_type"`
	Type                          string  `json:"type"`
	Factor                        float64 `json:"factor"`
	LowFreqFactor                 float64 `json:"low_freq_factor"`
	HighFreqFactor                float64 `json:"high_freq_factor"`
	OriginalMaxPositionEmbeddings int     `json:"original_max_position_embeddings"`
}

// ParseConfig parses a Hugging Face config.json of a Qwen3, Qwen2 or Llama causal LM.
func ParseConfig(data []byte) (Config, error) {
	var h hfConfig
	if err := json.Unmarshal(data, &h); err != nil {
		return Config{}, fmt.Errorf("%w: config.json: %w", ErrBadConfig, err)
	}
	c := Config{
		VocabSize:             h.VocabSize,
		HiddenSize:            h.HiddenSize,
		IntermediateSize:      h.IntermediateSize,
		NumLayers:             h.NumHiddenLayers,
		NumHeads:              h.NumAttentionHeads,
		NumKVHeads:            h.NumKeyValueHeads,
		HeadDim:               h.HeadDim,
		RMSNormEps:            h.RMSNormEps,
		RopeTheta:             h.RopeTheta,
		MaxPositionEmbeddings: h.MaxPositionEmbeddings,
		DType:                 h.TorchDType,
		BOSTokenID:            -1,
	}
	if c.DType == "" {
		c.DType = h.DType
	}
	if len(h.Architectures) > 0 {
		c.Architecture = h.Architectures[0]
	}
	switch c.Architecture {
	case "Qwen3ForCausalLM":
		c.QKNorm = true
	case "Qwen2ForCausalLM":
		c.AttentionBias = true
	case "LlamaForCausalLM", "MistralForCausalLM":
	default:
		return Config{}, fmt.Errorf("%w: architecture %q (supported: Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM)", ErrUnsupported, c.Architecture)
	}
	if h.AttentionBias != nil {
		c.AttentionBias = *h.AttentionBias
	}
	// HF's default for tie_word_embeddings is true for Qwen configs and false for Llama.
	c.TieWordEmbeddings = c.Architecture != "LlamaForCausalLM" && c.Architecture != "MistralForCausalLM"
	if h.TieWordEmbeddings != nil {
		c.TieWordEmbeddings = *h.TieWordEmbeddings
	}
	if c.NumKVHeads == 0 {
		c.NumKVHeads = c.NumHeads
	}
	if c.HeadDim == 0 && c.NumHeads > 0 {
		c.HeadDim = c.HiddenSize / c.NumHeads
	}
	if c.RMSNormEps == 0 {
		c.RMSNormEps = 1e-6
	}
	if c.RopeTheta == 0 {
		c.RopeTheta = 10000
	}
	if h.HiddenAct != "" && h.HiddenAct != "silu" {
		return Config{}, fmt.Errorf("%w: hidden_act %q (only silu)", ErrUnsupported, h.HiddenAct)
	}
	if len(h.RopeScaling) > 0 && string(h.RopeScaling) != "null" {
		var rs hfRopeScaling
		if err := json.Unmarshal(h.RopeScaling, &rs); err != nil {
			return Config{}, fmt.Errorf("%w: rope_scaling: %w", ErrBadConfig, err)
		}
		t := rs.RopeType
		if t == "" {
			t = rs.Type
		}
		switch t {
		case "default", "":
		case "llama3", "linear":
			c.RopeScaling = &RopeScaling{Type: t, Factor: rs.Factor, LowFreqFactor: rs.LowFreqFactor,
				HighFreqFactor: rs.HighFreqFactor, OriginalMaxPositionEmbeddings: rs.OriginalMaxPositionEmbeddings}
		default:
			return Config{}, fmt.Errorf("%w: rope_scaling type %q (supported: llama3, linear)", ErrUnsupported, t)
		}
	}
	if ids, err := tokenIDs(h.BOSTokenID); err == nil && len(ids) > 0 {
		c.BOSTokenID = ids[0]
	}
	if ids, err := tokenIDs(h.EOSTokenID); err == nil {
		c.EOSTokenIDs = ids
	}
	if err := c.validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}

// validate checks that the dimensions are usable.
func (c Config) validate() error {
	switch {
	case c.VocabSize <= 0, c.HiddenSize <= 0, c.IntermediateSize <= 0, c.NumLayers <= 0,
		c.NumHeads <= 0, c.NumKVHeads <= 0, c.HeadDim <= 0:
		return fmt.Errorf("%w: non-positive dimension (vocab %d, hidden %d, intermediate %d, layers %d, heads %d, kv heads %d, head_dim %d)",
			ErrBadConfig, c.VocabSize, c.HiddenSize, c.IntermediateSize, c.NumLayers, c.NumHeads, c.NumKVHeads, c.HeadDim)
	case c.NumHeads%c.NumKVHeads != 0:
		return fmt.Errorf("%w: num_attention_heads %d not a multiple of num_key_value_heads %d", ErrBadConfig, c.NumHeads, c.NumKVHeads)
	case c.HeadDim%2 != 0:
		return fmt.Errorf("%w: head_dim %d is odd", ErrBadConfig, c.HeadDim)
	case c.RMSNormEps <= 0 || math.IsNaN(c.RMSNormEps), c.RopeTheta <= 1 || math.IsNaN(c.RopeTheta):
		return fmt.Errorf("%w: rms_norm_eps %g / rope_theta %g", ErrBadConfig, c.RMSNormEps, c.RopeTheta)
	}
	return nil
}

// tokenIDs decodes a token id field that is null, a number or a list of numbers.
func tokenIDs(raw json.RawMessage) ([]int32, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one int32
	if err := json.Unmarshal(raw, &one); err == nil {
		return []int32{one}, nil
	}
	var many []int32
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, err
	}
	return many, nil
}
