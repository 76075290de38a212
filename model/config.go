package model

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
)

// Config is the subset of a Hugging Face config.json that the forward pass needs.
type Config struct {
	// Architecture is the first entry of "architectures", e.g. "Qwen3ForCausalLM".
	Architecture string
	// ModelType is config.json's model_type ("qwen3", "qwen2", "llama", "mistral").
	ModelType string
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
	// HeadDim is the width of one attention head (may differ from HiddenSize/NumHeads; when
	// config.json has no head_dim it is HiddenSize/NumHeads).
	HeadDim int
	// RMSNormEps is the epsilon of every RMSNorm.
	RMSNormEps float64
	// RopeTheta is the RoPE base frequency.
	RopeTheta float64
	// RopeScaling describes the RoPE frequency scaling; nil for the default (unscaled) RoPE.
	RopeScaling *RopeScaling
	// TieWordEmbeddings says lm_head shares the embedding matrix.
	TieWordEmbeddings bool
	// QKNorm says each head's query and key pass through an RMSNorm over HeadDim (Qwen3).
	QKNorm bool
	// AttentionBias says the q, k and v projections carry biases (Qwen2).
	AttentionBias bool
	// MaxPositionEmbeddings is the longest context the model was trained for.
	MaxPositionEmbeddings int
	// DType is the checkpoint's dtype (torch_dtype, or dtype in transformers ≥ 4.56), e.g.
	// "bfloat16".
	DType string
	// BOSTokenID and EOSTokenIDs are the config.json token ids, if given (-1 / nil when absent).
	BOSTokenID int32
	// EOSTokenIDs are config.json's eos_token_id entries.
	EOSTokenIDs []int32
}

// RopeScaling is a RoPE scaling: transformers' rope_parameters (≥ 5) or rope_scaling (4.x).
type RopeScaling struct {
	// Type is "linear", "dynamic", "yarn" or "llama3".
	Type string
	// Factor is the scaling factor (all types).
	Factor float64
	// LowFreqFactor and HighFreqFactor parameterise "llama3".
	LowFreqFactor, HighFreqFactor float64
	// OriginalMaxPositionEmbeddings is the pre-scaling context length ("llama3", "yarn",
	// "dynamic"; for the last two it defaults to max_position_embeddings).
	OriginalMaxPositionEmbeddings int
	// BetaFast and BetaSlow bound "yarn"'s interpolation ramp (default 32 and 1).
	BetaFast, BetaSlow float64
	// AttentionFactor scales cos and sin ("yarn"; 0: 0.1·ln(factor)+1, or DeepSeek's ratio
	// of Mscale and MscaleAllDim when both are given).
	AttentionFactor      float64
	Mscale, MscaleAllDim float64
	// NoTruncate keeps "yarn"'s correction range unrounded (transformers' truncate: false).
	NoTruncate bool
}

// Supported architectures with their model_type.
var architectures = map[string]string{
	"Qwen3ForCausalLM":   "qwen3",
	"Qwen2ForCausalLM":   "qwen2",
	"LlamaForCausalLM":   "llama",
	"MistralForCausalLM": "mistral",
}

// modelType returns ModelType, or the model_type of Architecture when it is empty.
func (c Config) modelType() string {
	if c.ModelType != "" {
		return c.ModelType
	}
	return architectures[c.Architecture]
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
	HeadDim               *int            `json:"head_dim"`
	RMSNormEps            float64         `json:"rms_norm_eps"`
	RopeTheta             *float64        `json:"rope_theta"`
	RopeScaling           json.RawMessage `json:"rope_scaling"`
	RopeParameters        json.RawMessage `json:"rope_parameters"`
	PartialRotaryFactor   *float64        `json:"partial_rotary_factor"`
	TieWordEmbeddings     *bool           `json:"tie_word_embeddings"`
	AttentionBias         *bool           `json:"attention_bias"`
	MLPBias               *bool           `json:"mlp_bias"`
	MaxPositionEmbeddings int             `json:"max_position_embeddings"`
	TorchDType            string          `json:"torch_dtype"`
	DType                 string          `json:"dtype"`
	HiddenAct             string          `json:"hidden_act"`
	UseSlidingWindow      *bool           `json:"use_sliding_window"`
	SlidingWindow         *int            `json:"sliding_window"`
	LayerTypes            []string        `json:"layer_types"`
	QuantizationConfig    json.RawMessage `json:"quantization_config"`
	BOSTokenID            json.RawMessage `json:"bos_token_id"`
	EOSTokenID            json.RawMessage `json:"eos_token_id"`
}

// hfRope mirrors one rope_parameters (transformers ≥ 5) or rope_scaling (4.x) object.
type hfRope struct {
	RopeType                      string   `json:"rope_type"`
	Type                          string   `json:"type"`
	RopeTheta                     *float64 `json:"rope_theta"`
	Factor                        *float64 `json:"factor"`
	LowFreqFactor                 float64  `json:"low_freq_factor"`
	HighFreqFactor                float64  `json:"high_freq_factor"`
	OriginalMaxPositionEmbeddings int      `json:"original_max_position_embeddings"`
	BetaFast                      float64  `json:"beta_fast"`
	BetaSlow                      float64  `json:"beta_slow"`
	AttentionFactor               float64  `json:"attention_factor"`
	Mscale                        float64  `json:"mscale"`
	MscaleAllDim                  float64  `json:"mscale_all_dim"`
	Truncate                      *bool    `json:"truncate"`
	PartialRotaryFactor           *float64 `json:"partial_rotary_factor"`
}

// present reports whether raw holds a JSON value other than null.
func present(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) > 0 && !bytes.Equal(t, []byte("null"))
}

// ParseConfig parses a Hugging Face config.json of a Qwen3, Qwen2, Llama or Mistral causal LM,
// as transformers 4.x (rope_theta and rope_scaling at the top level) or 5.x (rope_parameters)
// writes it. Anything the forward pass does not implement — another architecture or
// model_type, a RoPE type other than default, linear, dynamic, yarn and llama3, sliding-window
// attention, quantized weights — is an error naming the config key, never a silent fallback.
func ParseConfig(data []byte) (Config, error) {
	var h hfConfig
	if err := json.Unmarshal(data, &h); err != nil {
		return Config{}, fmt.Errorf("%w: config.json: %w", ErrBadConfig, err)
	}
	c := Config{
		ModelType:             h.ModelType,
		VocabSize:             h.VocabSize,
		HiddenSize:            h.HiddenSize,
		IntermediateSize:      h.IntermediateSize,
		NumLayers:             h.NumHiddenLayers,
		NumHeads:              h.NumAttentionHeads,
		NumKVHeads:            h.NumKeyValueHeads,
		RMSNormEps:            h.RMSNormEps,
		MaxPositionEmbeddings: h.MaxPositionEmbeddings,
		DType:                 h.TorchDType,
		BOSTokenID:            -1,
	}
	if c.DType == "" {
		c.DType = h.DType
	}
	if err := c.parseArchitecture(h); err != nil {
		return Config{}, err
	}
	if h.AttentionBias != nil {
		c.AttentionBias = *h.AttentionBias
	}
	// HF's default for tie_word_embeddings is true for Qwen configs and false for Llama/Mistral.
	c.TieWordEmbeddings = c.ModelType == "qwen3" || c.ModelType == "qwen2"
	if h.TieWordEmbeddings != nil {
		c.TieWordEmbeddings = *h.TieWordEmbeddings
	}
	if c.NumKVHeads == 0 {
		c.NumKVHeads = c.NumHeads
	}
	if h.HeadDim != nil && *h.HeadDim > 0 {
		c.HeadDim = *h.HeadDim
	} else if c.NumHeads > 0 {
		c.HeadDim = c.HiddenSize / c.NumHeads
	}
	if c.RMSNormEps == 0 {
		c.RMSNormEps = 1e-6
	}
	if err := c.checkFeatures(h); err != nil {
		return Config{}, err
	}
	if err := c.parseRope(h); err != nil {
		return Config{}, err
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

// parseArchitecture reads architectures and model_type, which must name the same supported
// family.
func (c *Config) parseArchitecture(h hfConfig) error {
	supported := slices.Sorted(func(yield func(string) bool) {
		for a := range architectures {
			if !yield(a) {
				return
			}
		}
	})
	if len(h.Architectures) > 0 {
		c.Architecture = h.Architectures[0]
		mt, ok := architectures[c.Architecture]
		if !ok {
			return fmt.Errorf("%w: architectures %q (supported: %s)", ErrUnsupported, c.Architecture, strings.Join(supported, ", "))
		}
		if c.ModelType == "" {
			c.ModelType = mt
		}
		if c.ModelType != mt {
			return fmt.Errorf("%w: model_type %q does not match architectures %q (want %q)", ErrBadConfig, c.ModelType, c.Architecture, mt)
		}
	} else {
		for a, mt := range architectures {
			if mt == c.ModelType {
				c.Architecture = a
			}
		}
		if c.Architecture == "" {
			return fmt.Errorf("%w: model_type %q without architectures (supported: qwen3, qwen2, llama, mistral)", ErrUnsupported, c.ModelType)
		}
	}
	switch c.ModelType {
	case "qwen3":
		c.QKNorm = true
	case "qwen2":
		c.AttentionBias = true
	}
	return nil
}

// checkFeatures rejects config keys that switch on something the forward pass does not do.
func (c *Config) checkFeatures(h hfConfig) error {
	if h.HiddenAct != "" && h.HiddenAct != "silu" {
		return fmt.Errorf("%w: hidden_act %q (only silu)", ErrUnsupported, h.HiddenAct)
	}
	if h.MLPBias != nil && *h.MLPBias {
		return fmt.Errorf("%w: mlp_bias true (MLP projections without biases only)", ErrUnsupported)
	}
	if h.PartialRotaryFactor != nil && *h.PartialRotaryFactor != 1 {
		return fmt.Errorf("%w: partial_rotary_factor %g (only 1)", ErrUnsupported, *h.PartialRotaryFactor)
	}
	if present(h.QuantizationConfig) {
		return fmt.Errorf("%w: quantization_config (quantized checkpoints are not supported; use the bf16, f16 or f32 weights)", ErrUnsupported)
	}
	// Qwen2/Qwen3 say use_sliding_window; Mistral has only sliding_window, which is on when set
	// below the context length.
	switch {
	case h.UseSlidingWindow != nil:
		if *h.UseSlidingWindow {
			return fmt.Errorf("%w: use_sliding_window true (sliding-window attention is not implemented)", ErrUnsupported)
		}
	case h.SlidingWindow != nil && *h.SlidingWindow > 0 && *h.SlidingWindow < h.MaxPositionEmbeddings:
		return fmt.Errorf("%w: sliding_window %d below max_position_embeddings %d (sliding-window attention is not implemented)",
			ErrUnsupported, *h.SlidingWindow, h.MaxPositionEmbeddings)
	}
	for i, lt := range h.LayerTypes {
		if lt != "full_attention" {
			return fmt.Errorf("%w: layer_types[%d] %q (only full_attention)", ErrUnsupported, i, lt)
		}
	}
	return nil
}

// parseRope reads the RoPE base and scaling from rope_parameters (transformers ≥ 5) or from the
// legacy top-level rope_theta and rope_scaling.
func (c *Config) parseRope(h hfConfig) error {
	key := "rope_scaling"
	raw := h.RopeScaling
	if present(h.RopeParameters) {
		key, raw = "rope_parameters", h.RopeParameters
	}
	r, err := decodeRope(key, raw)
	if err != nil {
		return err
	}
	switch {
	case r.RopeTheta != nil:
		c.RopeTheta = *r.RopeTheta
	case h.RopeTheta != nil:
		c.RopeTheta = *h.RopeTheta
	case key == "rope_parameters":
		return fmt.Errorf("%w: rope_parameters has no rope_theta", ErrBadConfig)
	default:
		c.RopeTheta = 10000 // transformers' default for these families
	}
	if r.PartialRotaryFactor != nil && *r.PartialRotaryFactor != 1 {
		return fmt.Errorf("%w: %s.partial_rotary_factor %g (only 1)", ErrUnsupported, key, *r.PartialRotaryFactor)
	}
	t := r.RopeType
	if t == "" {
		t = r.Type
	}
	switch t {
	case "", "default":
		return nil
	case "linear", "dynamic", "yarn", "llama3":
		s, err := ropeScaling(key, t, r, h.MaxPositionEmbeddings)
		if err != nil {
			return err
		}
		c.RopeScaling = s
		return nil
	}
	return fmt.Errorf("%w: %s.rope_type %q (supported: default, linear, dynamic, yarn, llama3)", ErrUnsupported, key, t)
}

// decodeRope decodes the RoPE object raw found at key (zero when absent); parameters per layer
// type are refused.
func decodeRope(key string, raw json.RawMessage) (hfRope, error) {
	var r hfRope
	if !present(raw) {
		return r, nil
	}
	var fields map[string]json.RawMessage
	err := json.Unmarshal(raw, &fields)
	for k, v := range fields {
		if t := bytes.TrimSpace(v); len(t) > 0 && t[0] == '{' {
			err = fmt.Errorf("%q holds parameters per layer type", k)
		}
	}
	if err == nil {
		err = json.Unmarshal(raw, &r)
	}
	if err != nil {
		return r, fmt.Errorf("%w: %s: %w (want one object with rope_type; per-layer-type parameters are not supported)", ErrBadConfig, key, err)
	}
	return r, nil
}

// ropeScaling checks and completes the scaling of rope_type t (linear, dynamic, yarn or llama3)
// read at key; maxPos is the model's max_position_embeddings.
func ropeScaling(key, t string, r hfRope, maxPos int) (*RopeScaling, error) {
	if r.Factor == nil || !(*r.Factor >= 1) {
		return nil, fmt.Errorf("%w: %s.factor must be a number ≥ 1 for rope_type %q", ErrBadConfig, key, t)
	}
	s := &RopeScaling{Type: t, Factor: *r.Factor, LowFreqFactor: r.LowFreqFactor, HighFreqFactor: r.HighFreqFactor,
		OriginalMaxPositionEmbeddings: r.OriginalMaxPositionEmbeddings, BetaFast: r.BetaFast, BetaSlow: r.BetaSlow,
		AttentionFactor: r.AttentionFactor, Mscale: r.Mscale, MscaleAllDim: r.MscaleAllDim,
		NoTruncate: r.Truncate != nil && !*r.Truncate}
	if t == "llama3" && (s.OriginalMaxPositionEmbeddings <= 0 || !(s.HighFreqFactor > s.LowFreqFactor) || !(s.LowFreqFactor > 0)) {
		return nil, fmt.Errorf("%w: %s for llama3 needs original_max_position_embeddings > 0 and 0 < low_freq_factor < high_freq_factor", ErrBadConfig, key)
	}
	if s.OriginalMaxPositionEmbeddings <= 0 {
		s.OriginalMaxPositionEmbeddings = maxPos
	}
	if t == "yarn" {
		if s.BetaFast == 0 {
			s.BetaFast = 32
		}
		if s.BetaSlow == 0 {
			s.BetaSlow = 1
		}
	}
	return s, nil
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
	case c.MaxPositionEmbeddings <= 0:
		return fmt.Errorf("%w: max_position_embeddings %d", ErrBadConfig, c.MaxPositionEmbeddings)
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
