package model

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// --- writing checkpoints ---------------------------------------------------------------------

// Test shorthands for the kernel's conversions.
var (
	f32ToBF16 = kernel.F32ToBF16
	f32ToF16  = kernel.F32ToF16
	f16ToF32  = kernel.F16ToF32
)

// roundTo replaces every value of s by its nearest value representable in dtype.
func roundTo(dtype string, s []float32) {
	for i, v := range s {
		switch dtype {
		case "BF16":
			s[i] = math.Float32frombits(uint32(f32ToBF16(v)) << 16)
		case "F16":
			s[i] = f16ToF32(f32ToF16(v))
		}
	}
}

// namedTensor is one tensor to write.
type namedTensor struct {
	name  string
	shape []int
	data  []float32
}

// writeSafetensors writes tensors to path in dtype (F32, BF16 or F16).
func writeSafetensors(t *testing.T, path, dtype string, tensors []namedTensor) {
	t.Helper()
	header := map[string]any{"__metadata__": map[string]string{"format": "pt"}}
	var data []byte
	for _, x := range tensors {
		begin := len(data)
		for _, v := range x.data {
			switch dtype {
			case "F32":
				data = binary.LittleEndian.AppendUint32(data, math.Float32bits(v))
			case "BF16":
				data = binary.LittleEndian.AppendUint16(data, f32ToBF16(v))
			case "F16":
				data = binary.LittleEndian.AppendUint16(data, f32ToF16(v))
			}
		}
		header[x.name] = map[string]any{"dtype": dtype, "shape": x.shape, "data_offsets": []int{begin, len(data)}}
	}
	h, err := json.Marshal(header)
	if err != nil {
		t.Fatal(err)
	}
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
	out = append(append(out, h...), data...)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

// tensorsOf lists w's tensors under their HF names.
func tensorsOf(c Config, w *weights) []namedTensor {
	var out []namedTensor
	for _, s := range w.specs(c) {
		data := s.mat.dataOrNil()
		if s.vec != nil {
			data = *s.vec
		}
		if data != nil {
			shape := s.shape
			if s.scalar {
				shape = []int{}
			}
			out = append(out, namedTensor{name: s.name, shape: shape, data: data})
		}
	}
	return out
}

// dataOrNil returns the in-memory data of m (nil for a nil matrix).
func (m *matrix) dataOrNil() []float32 {
	if m == nil {
		return nil
	}
	return m.data
}

// testTokenizerJSON is a minimal byte-level BPE tokenizer.json: ids 0..255 are the bytes,
// 256..258 three merges, 259..261 the special tokens.
func testTokenizerJSON(t *testing.T) []byte {
	t.Helper()
	// GPT-2's byte → unicode alphabet.
	var alphabet [256]rune
	n := 0
	for b := range 256 {
		if (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff) {
			alphabet[b] = rune(b)
		} else {
			alphabet[b] = rune(256 + n)
			n++
		}
	}
	vocab := map[string]int{}
	for b := range 256 {
		vocab[string(alphabet[b])] = b
	}
	vocab["he"], vocab["ll"], vocab["hell"] = 256, 257, 258
	added := []map[string]any{}
	for i, s := range []string{"<|endoftext|>", "<|im_start|>", "<|im_end|>"} {
		added = append(added, map[string]any{"id": 259 + i, "content": s, "single_word": false, "lstrip": false,
			"rstrip": false, "normalized": false, "special": true})
	}
	doc := map[string]any{
		"version":       "1.0",
		"added_tokens":  added,
		"normalizer":    nil,
		"pre_tokenizer": map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
		"decoder":       map[string]any{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
		"model": map[string]any{"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": "",
			"end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "vocab": vocab,
			"merges": []string{"h e", "l l", "he ll"}},
	}
	b, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// testTokenizerConfig is a tokenizer_config.json with a small Jinja chat template.
const testTokenizerConfig = `{"bos_token": null, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
 "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}`

// writeModelDir writes a complete HF model directory for (c, w) with tensors in dtype, split
// over shards files (1: model.safetensors; more: an index and model-0000i-of-0000n files).
func writeModelDir(t *testing.T, dir string, c Config, w *weights, dtype string, shards int) {
	t.Helper()
	write := func(name string, data []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("config.json", hfConfigJSON(c))
	write("tokenizer.json", testTokenizerJSON(t))
	write("tokenizer_config.json", []byte(testTokenizerConfig))
	write("generation_config.json", []byte(`{"eos_token_id": [261, 259], "temperature": 0.6, "top_p": 0.95, "top_k": 20}`))
	tensors := tensorsOf(c, w)
	if shards == 1 {
		writeSafetensors(t, filepath.Join(dir, "model.safetensors"), dtype, tensors)
		return
	}
	weightMap := map[string]string{}
	for i := range shards {
		file := fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, shards)
		var part []namedTensor
		for j, x := range tensors {
			if j%shards == i {
				part = append(part, x)
				weightMap[x.name] = file
			}
		}
		writeSafetensors(t, filepath.Join(dir, file), dtype, part)
	}
	idx, err := json.Marshal(map[string]any{"metadata": map[string]any{"total_size": 0}, "weight_map": weightMap})
	if err != nil {
		t.Fatal(err)
	}
	write("model.safetensors.index.json", idx)
}

// --- tests -----------------------------------------------------------------------------------

func TestF16ToF32(t *testing.T) {
	cases := map[uint16]float32{
		0x0000: 0, 0x3c00: 1, 0xc000: -2, 0x7bff: 65504, 0x0001: 1.0 / (1 << 24), 0x0400: 1.0 / (1 << 14),
		0x3555: 0.333251953125, 0x03ff: 1023.0 / (1 << 24), 0x8001: -1.0 / (1 << 24),
	}
	for h, want := range cases {
		if got := f16ToF32(h); got != want {
			t.Errorf("f16ToF32(%#04x) = %g, want %g", h, got, want)
		}
	}
	if v := f16ToF32(0x7c00); !math.IsInf(float64(v), 1) {
		t.Errorf("0x7c00 = %g", v)
	}
	if v := f16ToF32(0x7e00); !math.IsNaN(float64(v)) {
		t.Errorf("0x7e00 = %g", v)
	}
	// Every finite half survives f16 → f32 → f16.
	for h := range uint16(0x7c00) {
		for _, s := range []uint16{0, 0x8000} {
			if got := f32ToF16(f16ToF32(h | s)); got != h|s && h != 0 {
				t.Fatalf("round trip %#04x → %#04x", h|s, got)
			}
		}
	}
}

// hfTestConfig is a small Qwen3 config with the test tokenizer's padded vocabulary.
func hfTestConfig() Config {
	return Config{
		Architecture: "Qwen3ForCausalLM", VocabSize: 300, HiddenSize: 32, IntermediateSize: 64, NumLayers: 2,
		NumHeads: 4, NumKVHeads: 2, HeadDim: 8, RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true,
		MaxPositionEmbeddings: 4096, DType: "bfloat16", BOSTokenID: -1, EOSTokenIDs: []int32{261},
	}
}

func TestLoadHFDirectory(t *testing.T) {
	qwen3 := hfTestConfig()
	qwen3Tied := qwen3
	qwen3Tied.TieWordEmbeddings = true
	qwen2 := qwen3Tied
	qwen2.Architecture, qwen2.QKNorm, qwen2.AttentionBias = "Qwen2ForCausalLM", false, true
	llama := qwen3
	llama.Architecture, llama.QKNorm = "LlamaForCausalLM", false
	llama.RopeScaling = &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositionEmbeddings: 8}
	cases := []struct {
		name   string
		cfg    Config
		dtype  string
		shards int
	}{
		{"f32-untied", qwen3, "F32", 1},
		{"bf16-tied", qwen3Tied, "BF16", 1},
		{"f16-qwen2-bias", qwen2, "F16", 1},
		{"bf16-sharded-llama", llama, "BF16", 3},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			w := variantWeights(tc.cfg, uint64(100+i))
			for _, x := range tensorsOf(tc.cfg, w) {
				roundTo(tc.dtype, x.data)
			}
			writeModelDir(t, dir, tc.cfg, w, tc.dtype, tc.shards)

			// config.json says bfloat16, so dtype auto computes in bfloat16; float32 compares
			// with the in-memory float32 model bit for bit.
			auto, err := Open(t.Context(), dir, OpenOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if auto.DType() != "bfloat16" {
				t.Errorf("dtype auto of a bfloat16 checkpoint: %s", auto.DType())
			}
			auto.Close()
			loaded, err := Open(t.Context(), dir, OpenOptions{DType: "float32"})
			if err != nil {
				t.Fatal(err)
			}
			defer loaded.Close()
			tok, err := tokenizer.Load(testTokenizerJSON(t), []byte(testTokenizerConfig))
			if err != nil {
				t.Fatal(err)
			}
			mem, err := newModel("mem", tc.cfg, w, tok, tokenizer.ChatML(), GenerationConfig{})
			if err != nil {
				t.Fatal(err)
			}
			defer mem.Close()

			got := loaded.Config()
			if got.Architecture != tc.cfg.Architecture || got.VocabSize != 300 || got.QKNorm != tc.cfg.QKNorm ||
				got.TieWordEmbeddings != tc.cfg.TieWordEmbeddings || got.AttentionBias != tc.cfg.AttentionBias {
				t.Errorf("config = %+v", got)
			}
			if loaded.Name() != dir {
				t.Errorf("Name() = %q", loaded.Name())
			}
			// Matrices stay in the checkpoint's dtype (2 bytes a weight for bf16 and f16);
			// vectors are float32.
			c := tc.cfg
			qd, kd := c.NumHeads*c.HeadDim, c.NumKVHeads*c.HeadDim
			matrices := c.NumLayers*((qd+2*kd)*c.HiddenSize+c.HiddenSize*qd+3*c.IntermediateSize*c.HiddenSize) + c.VocabSize*c.HiddenSize
			vectors := c.NumLayers*2*c.HiddenSize + c.HiddenSize
			if c.QKNorm {
				vectors += c.NumLayers * 2 * c.HeadDim
			}
			if c.AttentionBias {
				vectors += c.NumLayers * (qd + 2*kd)
			}
			size := map[string]int{"F32": 4, "BF16": 2, "F16": 2}[tc.dtype]
			if want := int64(size*matrices + 4*vectors); loaded.WeightBytes() != want || mem.WeightBytes() != int64(4*matrices+4*vectors) {
				t.Errorf("WeightBytes %d (in memory %d), want %d (%d)", loaded.WeightBytes(), mem.WeightBytes(), want, 4*matrices+4*vectors)
			}
			tokens := randomTokens(21, 262, uint64(i))
			a := prefillChunked(t, loaded, newTestKV(got, 8, 3, false), 8, blockRange(0, 3), tokens, 21)
			b := prefillChunked(t, mem, newTestKV(got, 8, 3, false), 8, blockRange(0, 3), tokens, 21)
			requireSameBits(t, "logits of loaded vs in-memory weights", b, a)

			g := loaded.Generation()
			if !slices.Equal(g.EOSTokenIDs, []int32{261, 259}) || g.Temperature != 0.6 || g.TopP != 0.95 || g.TopK != 20 {
				t.Errorf("generation = %+v", g)
			}
			if len(g.SuppressTokens) != 300-262 || g.SuppressTokens[0] != 262 {
				t.Errorf("suppress = %v", g.SuppressTokens)
			}
			text, err := loaded.ChatTemplate().Render([]tokenizer.Message{{Role: "user", Content: "hello"}}, tokenizer.RenderOptions{AddGenerationPrompt: true})
			if err != nil || text != "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n" {
				t.Errorf("chat template: %q, %v", text, err)
			}
			if ids := loaded.Tokenizer().Encode("hello<|im_end|>"); !slices.Equal(ids, []int32{258, 'o', 261}) {
				t.Errorf("Encode = %v", ids)
			}
		})
	}
}

func TestLoadHFDirectoryErrors(t *testing.T) {
	c := hfTestConfig()
	good := t.TempDir()
	writeModelDir(t, good, c, variantWeights(c, 1), "BF16", 1)
	copyDir := func(t *testing.T) string {
		dir := t.TempDir()
		entries, _ := os.ReadDir(good)
		for _, e := range entries {
			b, err := os.ReadFile(filepath.Join(good, e.Name()))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, e.Name()), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return dir
	}
	cases := []struct {
		name   string
		mutate func(t *testing.T, dir string)
		want   error
	}{
		{"missing tensor", func(t *testing.T, dir string) {
			w := variantWeights(c, 1)
			ts := tensorsOf(c, w)
			writeSafetensors(t, filepath.Join(dir, "model.safetensors"), "BF16", ts[1:])
		}, ErrMissingTensor},
		{"wrong shape", func(t *testing.T, dir string) {
			ts := tensorsOf(c, variantWeights(c, 1))
			ts[0].shape = []int{ts[0].shape[1], ts[0].shape[0]}
			writeSafetensors(t, filepath.Join(dir, "model.safetensors"), "BF16", ts)
		}, ErrBadWeights},
		{"truncated file", func(t *testing.T, dir string) {
			p := filepath.Join(dir, "model.safetensors")
			b, _ := os.ReadFile(p)
			os.WriteFile(p, b[:len(b)-10], 0o644)
		}, ErrBadWeights},
		{"header too long", func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, "model.safetensors"), binary.LittleEndian.AppendUint64(nil, 1<<40), 0o644)
		}, ErrBadWeights},
		{"unsupported dtype", func(t *testing.T, dir string) {
			ts := tensorsOf(c, variantWeights(c, 1))
			writeSafetensors(t, filepath.Join(dir, "model.safetensors"), "F32", ts)
			p := filepath.Join(dir, "model.safetensors")
			b, _ := os.ReadFile(p)
			os.WriteFile(p, []byte(strings.ReplaceAll(string(b), `"F32"`, `"I32"`)), 0o644)
		}, ErrUnsupported},
		{"unknown architecture", func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"architectures":["GPT2LMHeadModel"]}`), 0o644)
		}, ErrUnsupported},
		{"no weights", func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, "model.safetensors")) }, ErrBadWeights},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := copyDir(t)
			tc.mutate(t, dir)
			m, err := Open(t.Context(), dir, OpenOptions{})
			if !errors.Is(err, tc.want) {
				if m != nil {
					m.Close()
				}
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestOpenFromHubCache(t *testing.T) {
	c := hfTestConfig()
	cache := t.TempDir()
	repo := filepath.Join(cache, "models--acme--tiny-qwen")
	for _, rev := range []string{"0000old", "abc123"} {
		d := filepath.Join(repo, "snapshots", rev)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		writeModelDir(t, d, c, variantWeights(c, 5), "BF16", 1)
	}
	// refs/main names the snapshot to use; break the other one so picking it would fail.
	os.MkdirAll(filepath.Join(repo, "refs"), 0o755)
	os.WriteFile(filepath.Join(repo, "refs", "main"), []byte("abc123\n"), 0o644)
	os.Remove(filepath.Join(repo, "snapshots", "0000old", "model.safetensors"))

	m, err := Open(t.Context(), "acme/tiny-qwen", OpenOptions{HubCache: cache})
	if err != nil {
		t.Fatal(err)
	}
	if m.Name() != "acme/tiny-qwen" {
		t.Errorf("Name() = %q", m.Name())
	}
	m.Close()

	t.Run("revision", func(t *testing.T) {
		d := filepath.Join(repo, "snapshots", "def456")
		os.MkdirAll(d, 0o755)
		writeModelDir(t, d, c, variantWeights(c, 5), "BF16", 1)
		os.WriteFile(filepath.Join(d, "chat_template.jinja"), []byte("release {{ messages[0].content }}"), 0o644)
		os.WriteFile(filepath.Join(d, "tokenizer_config.json"), []byte(`{"eos_token": "<|im_end|>"}`), 0o644)
		os.MkdirAll(filepath.Join(repo, "refs", "tags"), 0o755)
		os.WriteFile(filepath.Join(repo, "refs", "tags", "v1"), []byte("def456"), 0o644)
		for _, rev := range []string{"tags/v1", "def456"} {
			m, err := Open(t.Context(), "acme/tiny-qwen", OpenOptions{HubCache: cache, Revision: rev})
			if err != nil {
				t.Fatalf("revision %s: %v", rev, err)
			}
			text, err := m.ChatTemplate().Render([]tokenizer.Message{{Role: "user", Content: "hi"}}, tokenizer.RenderOptions{})
			m.Close()
			if err != nil || text != "release hi" {
				t.Fatalf("revision %s loaded the wrong snapshot: chat template gives %q, %v", rev, text, err)
			}
		}
		_, err := Open(t.Context(), "acme/tiny-qwen", OpenOptions{HubCache: cache, Revision: "nope"})
		if !errors.Is(err, ErrModelNotFound) || !strings.Contains(err.Error(), `revision "nope"`) {
			t.Fatalf("unknown revision: err = %v", err)
		}
		// --tokenizer takes the tokenizer and chat template from another directory.
		m, err := Open(t.Context(), filepath.Join(repo, "snapshots", "abc123"), OpenOptions{Tokenizer: d})
		if err != nil {
			t.Fatal(err)
		}
		text, _ := m.ChatTemplate().Render([]tokenizer.Message{{Role: "user", Content: "hi"}}, tokenizer.RenderOptions{})
		m.Close()
		if text != "release hi" {
			t.Fatalf("--tokenizer: chat template gives %q", text)
		}
		if _, err := Open(t.Context(), Tiny, OpenOptions{Tokenizer: d}); !errors.Is(err, ErrBadConfig) {
			t.Fatalf("built-in model with a tokenizer: err = %v", err)
		}
	})

	t.Run("env", func(t *testing.T) {
		t.Setenv("HF_HUB_CACHE", "")
		t.Setenv("HUGGINGFACE_HUB_CACHE", "")
		home := t.TempDir()
		if err := os.Rename(cache, filepath.Join(home, "hub")); err != nil {
			t.Fatal(err)
		}
		t.Setenv("HF_HOME", home)
		m, err := Open(t.Context(), "acme/tiny-qwen", OpenOptions{})
		if err != nil {
			t.Fatal(err)
		}
		m.Close()
	})

	t.Run("not found", func(t *testing.T) {
		empty := t.TempDir()
		_, err := Open(t.Context(), "acme/nothing-here", OpenOptions{HubCache: empty})
		if !errors.Is(err, ErrModelNotFound) {
			t.Fatalf("err = %v", err)
		}
		msg := err.Error()
		for _, want := range []string{filepath.Join(empty, "models--acme--nothing-here", "snapshots"), "kvbridge serve kvbridge/small", "acme/nothing-here"} {
			if !strings.Contains(msg, want) {
				t.Errorf("error %q does not mention %q", msg, want)
			}
		}
		t.Setenv("HF_HUB_CACHE", empty)
		t.Setenv("HF_HOME", filepath.Join(empty, "home"))
		_, err = Open(t.Context(), "acme/nothing-here", OpenOptions{})
		if !errors.Is(err, ErrModelNotFound) || !strings.Contains(err.Error(), filepath.Join(empty, "home", "hub")) {
			t.Fatalf("err = %v", err)
		}
		if _, err := Open(t.Context(), "no such ./dir", OpenOptions{}); !errors.Is(err, ErrModelNotFound) {
			t.Fatalf("plain path: err = %v", err)
		}
	})
}
