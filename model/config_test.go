package model

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
)

// The config.json files below are written as each transformers major version writes them (by
// hand, from transformers' PretrainedConfig.to_json_string output for these models: 4.x keeps
// rope_theta and rope_scaling at the top level and says torch_dtype, later 4.x say dtype; 5.x
// moves both into rope_parameters and adds layer_types).

const qwen3Config4x = `{
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}`

// qwen3Config5x is qwen3Config4x as transformers 5 writes it.
var qwen3Config5x = `{
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "dtype": "bfloat16",
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "layer_types": [` + strings.Repeat(`"full_attention", `, 27) + `"full_attention"],
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "pad_token_id": null,
  "rms_norm_eps": 1e-06,
  "rope_parameters": {
    "rope_theta": 1000000,
    "rope_type": "default"
  },
  "sliding_window": null,
  "tie_word_embeddings": true,
  "transformers_version": "5.0.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}`

const llama32Config4x = `{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
}`

const llama32Config5x = `{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.0.0",
  "use_cache": true,
  "vocab_size": 128256
}`

// qwen25YarnConfig4x is Qwen2.5-7B-Instruct's config with the YaRN rope_scaling its model card
// says to add for long contexts (legacy "type" key), as transformers 4.43 writes it; it has no
// head_dim.
const qwen25YarnConfig4x = `{
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "max_position_embeddings": 32768,
  "max_window_layers": 28,
  "model_type": "qwen2",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "factor": 4.0,
    "original_max_position_embeddings": 32768,
    "type": "yarn"
  },
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 152064
}`

// qwen25YarnConfig5x is the same model as transformers 5 writes it.
var qwen25YarnConfig5x = `{
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "dtype": "bfloat16",
  "eos_token_id": 151645,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "layer_types": [` + strings.Repeat(`"full_attention", `, 27) + `"full_attention"],
  "max_position_embeddings": 32768,
  "max_window_layers": 28,
  "model_type": "qwen2",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_parameters": {
    "factor": 4.0,
    "original_max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_type": "yarn"
  },
  "sliding_window": null,
  "tie_word_embeddings": false,
  "transformers_version": "5.0.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 152064
}`

func TestParseConfigTransformersVersions(t *testing.T) {
	qwen3 := Config{
		Architecture: "Qwen3ForCausalLM", ModelType: "qwen3", VocabSize: 151936, HiddenSize: 1024, IntermediateSize: 3072,
		NumLayers: 28, NumHeads: 16, NumKVHeads: 8, HeadDim: 128, RMSNormEps: 1e-6, RopeTheta: 1e6,
		TieWordEmbeddings: true, QKNorm: true, MaxPositionEmbeddings: 40960, DType: "bfloat16",
		BOSTokenID: 151643, EOSTokenIDs: []int32{151645},
	}
	llama := Config{
		Architecture: "LlamaForCausalLM", ModelType: "llama", VocabSize: 128256, HiddenSize: 2048, IntermediateSize: 8192,
		NumLayers: 16, NumHeads: 32, NumKVHeads: 8, HeadDim: 64, RMSNormEps: 1e-5, RopeTheta: 500000,
		RopeScaling:       &RopeScaling{Type: "llama3", Factor: 32, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositionEmbeddings: 8192},
		TieWordEmbeddings: true, MaxPositionEmbeddings: 131072, DType: "bfloat16", BOSTokenID: 128000, EOSTokenIDs: []int32{128001},
	}
	qwen25 := Config{
		Architecture: "Qwen2ForCausalLM", ModelType: "qwen2", VocabSize: 152064, HiddenSize: 3584, IntermediateSize: 18944,
		NumLayers: 28, NumHeads: 28, NumKVHeads: 4, HeadDim: 128, RMSNormEps: 1e-6, RopeTheta: 1e6,
		RopeScaling:   &RopeScaling{Type: "yarn", Factor: 4, OriginalMaxPositionEmbeddings: 32768, BetaFast: 32, BetaSlow: 1},
		AttentionBias: true, MaxPositionEmbeddings: 32768, DType: "bfloat16", BOSTokenID: 151643, EOSTokenIDs: []int32{151645},
	}
	cases := []struct {
		name string
		json string
		want Config
	}{
		{"qwen3-4.x", qwen3Config4x, qwen3},
		{"qwen3-5.x", qwen3Config5x, qwen3},
		{"llama3.2-4.x", llama32Config4x, llama},
		{"llama3.2-5.x", llama32Config5x, llama},
		{"qwen2.5-yarn-4.x", qwen25YarnConfig4x, qwen25},
		{"qwen2.5-yarn-5.x", qwen25YarnConfig5x, qwen25},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseConfig([]byte(tc.json))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got  %+v (rope %+v)\nwant %+v (rope %+v)", got, got.RopeScaling, tc.want, tc.want.RopeScaling)
			}
		})
	}
}

func TestParseConfigRopeTypes(t *testing.T) {
	base := `{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
	  "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 4096, `
	for _, tc := range []struct {
		rope string
		want *RopeScaling
	}{
		{`"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}`, &RopeScaling{Type: "linear", Factor: 2, OriginalMaxPositionEmbeddings: 4096}},
		{`"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}`, &RopeScaling{Type: "linear", Factor: 2, OriginalMaxPositionEmbeddings: 4096}},
		{`"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}`, &RopeScaling{Type: "dynamic", Factor: 2, OriginalMaxPositionEmbeddings: 4096}},
		{`"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}`, &RopeScaling{Type: "dynamic", Factor: 2, OriginalMaxPositionEmbeddings: 4096}},
		{`"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.5, "truncate": false, "rope_theta": 10000.0}`,
			&RopeScaling{Type: "yarn", Factor: 8, OriginalMaxPositionEmbeddings: 4096, BetaFast: 16, BetaSlow: 2, AttentionFactor: 1.5, NoTruncate: true}},
		{`"rope_theta": 10000.0, "rope_scaling": {"rope_type": "default"}`, nil},
		{`"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}`, nil},
	} {
		c, err := ParseConfig([]byte(base + tc.rope + "}"))
		if err != nil {
			t.Fatalf("%s: %v", tc.rope, err)
		}
		if !reflect.DeepEqual(c.RopeScaling, tc.want) || c.RopeTheta != 10000 || c.HeadDim != 16 {
			t.Errorf("%s: rope %+v theta %g head_dim %d, want %+v, 10000, 16", tc.rope, c.RopeScaling, c.RopeTheta, c.HeadDim, tc.want)
		}
	}
}

func TestParseConfigErrorsNameTheKey(t *testing.T) {
	good := strings.TrimSuffix(qwen3Config4x, "}")
	for _, tc := range []struct {
		name, json, key string
		want            error
	}{
		{"unknown rope type", strings.Replace(qwen3Config5x, `"rope_type": "default"`, `"rope_type": "longrope"`, 1), "rope_parameters.rope_type", ErrUnsupported},
		{"legacy unknown rope type", strings.Replace(qwen3Config4x, `"rope_scaling": null`, `"rope_scaling": {"type": "su", "factor": 2}`, 1), "rope_scaling.rope_type", ErrUnsupported},
		{"per-layer-type rope", strings.Replace(qwen3Config5x, `"rope_type": "default"`, `"full_attention": {"rope_type": "default"}`, 1), "rope_parameters", ErrBadConfig},
		{"rope_parameters without theta", strings.Replace(qwen3Config5x, `"rope_theta": 1000000,`, ``, 1), "rope_theta", ErrBadConfig},
		{"yarn without factor", strings.Replace(qwen25YarnConfig5x, `"factor": 4.0,`, ``, 1), "rope_parameters.factor", ErrBadConfig},
		{"sliding window on", strings.Replace(qwen3Config4x, `"use_sliding_window": false`, `"use_sliding_window": true`, 1), "use_sliding_window", ErrUnsupported},
		{"mistral sliding window", `{"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}`, "sliding_window", ErrUnsupported},
		{"sliding layer type", strings.Replace(qwen3Config5x, `"full_attention"]`, `"sliding_attention"]`, 1), "layer_types[27]", ErrUnsupported},
		{"unknown architecture", strings.Replace(qwen3Config4x, `"Qwen3ForCausalLM"`, `"Gemma3ForCausalLM"`, 1), "architectures", ErrUnsupported},
		{"unknown model_type", strings.Replace(strings.Replace(qwen3Config4x, `"model_type": "qwen3"`, `"model_type": "gemma3"`, 1), `"architectures": ["Qwen3ForCausalLM"],`, ``, 1), "model_type", ErrUnsupported},
		{"model_type mismatch", strings.Replace(qwen3Config4x, `"model_type": "qwen3"`, `"model_type": "llama"`, 1), "model_type", ErrBadConfig},
		{"quantized", good + `, "quantization_config": {"quant_method": "awq"}}`, "quantization_config", ErrUnsupported},
		{"mlp bias", strings.Replace(llama32Config4x, `"mlp_bias": false`, `"mlp_bias": true`, 1), "mlp_bias", ErrUnsupported},
		{"activation", strings.Replace(qwen3Config4x, `"hidden_act": "silu"`, `"hidden_act": "gelu"`, 1), "hidden_act", ErrUnsupported},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(tc.json))
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.key) {
				t.Fatalf("err = %v, want %v naming %q", err, tc.want, tc.key)
			}
		})
	}
}

// TestRopeFrequencies checks the scaled RoPE frequencies against values derived by hand from
// transformers' formulas (modeling_rope_utils.py) for the configs above.
func TestRopeFrequencies(t *testing.T) {
	near := func(t *testing.T, what string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-12*math.Abs(want) {
			t.Errorf("%s = %.17g, want %.17g", what, got, want)
		}
	}
	// Llama 3.2 (head_dim 64, θ 500000, llama3 factor 32, low 1, high 4, original 8192):
	// wavelengths below 8192/4 = 2048 keep their frequency, above 8192/1 are divided by 32,
	// between them blend with smooth = (8192/λ − 1)/(4 − 1).
	llama, _ := ParseConfig([]byte(llama32Config4x))
	r := newRope(llama)
	near(t, "llama3 inv_freq[0]", r.invFreq[0], 1)
	f := func(i int) float64 { return math.Pow(500000, -float64(2*i)/64) }
	near(t, "llama3 inv_freq[31]", r.invFreq[31], f(31)/32)
	// i = 16: λ = 2π/f(16) = 2π·√500000 ≈ 4443 is between 2048 and 8192.
	lambda := 2 * math.Pi * math.Sqrt(500000)
	smooth := (8192/lambda - 1) / 3
	near(t, "llama3 inv_freq[16]", r.invFreq[16], (1-smooth)*f(16)/32+smooth*f(16))
	if r.scale != 1 {
		t.Errorf("llama3 scale %g", r.scale)
	}

	// Qwen2.5 YaRN (head_dim 128, θ 1e6, factor 4, original 32768, β 32 and 1): the correction
	// range is [⌊128·ln(32768/(32·2π))/(2 ln 1e6)⌋, ⌈128·ln(32768/(2π))/(2 ln 1e6)⌉] = [23, 40];
	// below it frequencies are kept, above divided by 4, between blended linearly; cos and sin
	// are scaled by 0.1·ln 4 + 1.
	qwen, _ := ParseConfig([]byte(qwen25YarnConfig4x))
	r = newRope(qwen)
	g := func(i int) float64 { return math.Pow(1e6, -float64(2*i)/128) }
	near(t, "yarn inv_freq[10]", r.invFreq[10], g(10))
	near(t, "yarn inv_freq[23]", r.invFreq[23], g(23))
	near(t, "yarn inv_freq[40]", r.invFreq[40], g(40)/4)
	near(t, "yarn inv_freq[30]", r.invFreq[30], g(30)/4*7.0/17+g(30)*10.0/17)
	near(t, "yarn scale", r.scale, 0.1*math.Log(4)+1)

	// Linear: every frequency divided by the factor. Dynamic (vLLM's fixed form): the base
	// becomes θ·(f² − f + 1)^(d/(d−2)) for factor f.
	c := Config{HeadDim: 16, RopeTheta: 10000, RopeScaling: &RopeScaling{Type: "linear", Factor: 2}}
	near(t, "linear inv_freq[3]", newRope(c).invFreq[3], math.Pow(10000, -6.0/16)/2)
	c.RopeScaling = &RopeScaling{Type: "dynamic", Factor: 2, OriginalMaxPositionEmbeddings: 4096}
	near(t, "dynamic inv_freq[3]", newRope(c).invFreq[3], math.Pow(10000*math.Pow(3, 16.0/14), -6.0/16))
}

// ParseDType takes vLLM's --dtype spellings (auto, bfloat16, float32 and float; float16 and half
// refused on the CPU) and the short bf16 and fp32; ParseWeightDType names safetensors dtypes.
func TestParseDType(t *testing.T) {
	for in, want := range map[string]string{"": "auto", "auto": "auto", "AUTO": "auto", "bfloat16": "bfloat16", "BF16": "bfloat16",
		"float32": "float32", "float": "float32", "fp32": "float32"} {
		if got, err := ParseDType(in); err != nil || got != want {
			t.Errorf("ParseDType(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"float16", "half", "fp16", "fp8", "bogus", "f32"} {
		if got, err := ParseDType(in); !errors.Is(err, ErrUnsupported) {
			t.Errorf("ParseDType(%q) = %q, %v; want ErrUnsupported", in, got, err)
		}
	}
	for in, want := range map[string]string{"bfloat16": "BF16", "BF16": "BF16", "float16": "F16", "half": "F16", "F16": "F16",
		"fp16": "F16", "float32": "F32", "float": "F32", "fp32": "F32", "F32": "F32"} {
		if got, err := ParseWeightDType(in); err != nil || got != want {
			t.Errorf("ParseWeightDType(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "auto", "fp8", "int8"} {
		if got, err := ParseWeightDType(in); !errors.Is(err, ErrUnsupported) {
			t.Errorf("ParseWeightDType(%q) = %q, %v; want ErrUnsupported", in, got, err)
		}
	}
}
