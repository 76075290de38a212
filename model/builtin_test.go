package model

import (
	"math"
	"slices"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

func TestBuiltinDeterministic(t *testing.T) {
	a, b := openTiny(t), openTiny(t)
	prompt := randomTokens(20, a.cfg.VocabSize, 3)
	la := prefillChunked(t, a, newTestKV(a.cfg, 16, 2, false), 16, blockRange(0, 2), prompt, 20)
	lb := prefillChunked(t, b, newTestKV(b.cfg, 16, 2, false), 16, blockRange(0, 2), prompt, 20)
	requireSameBits(t, "two opens of kvbridge/tiny", la, lb)
}

func TestBuiltinConfig(t *testing.T) {
	m := openTiny(t)
	c := m.Config()
	if c.Architecture != "Qwen3ForCausalLM" || !c.QKNorm || !c.TieWordEmbeddings || c.MaxPositionEmbeddings != 32768 ||
		c.RopeTheta != 1e6 || c.VocabSize != m.Tokenizer().VocabSize() || c.VocabSize < builtinVocab {
		t.Errorf("config %+v", c)
	}
	if m.Name() != Tiny || m.WeightBytes() <= 0 || m.FLOPsPerToken(10) <= m.FLOPsPerToken(1) {
		t.Errorf("name %q, weight bytes %d", m.Name(), m.WeightBytes())
	}
	if got, want := m.PrefillFLOPs(3), m.FLOPsPerToken(1)+m.FLOPsPerToken(2)+m.FLOPsPerToken(3)-2*2*float64(c.VocabSize*c.HiddenSize); math.Abs(got-want) > 1e-6*want {
		t.Errorf("PrefillFLOPs(3) = %g, want %g", got, want)
	}
	g := m.Generation()
	tok := m.Tokenizer()
	imEnd, _ := tok.TokenID("<|im_end|>")
	eot, _ := tok.TokenID("<|endoftext|>")
	imStart, _ := tok.TokenID("<|im_start|>")
	if !slices.Equal(g.EOSTokenIDs, []int32{imEnd, eot}) {
		t.Errorf("EOS = %v", g.EOSTokenIDs)
	}
	if !slices.Contains(g.SuppressTokens, imStart) || slices.Contains(g.SuppressTokens, imEnd) || slices.Contains(g.SuppressTokens, eot) {
		t.Errorf("suppress tokens: im_start suppressed %v, EOS not suppressed", slices.Contains(g.SuppressTokens, imStart))
	}
	text, err := m.ChatTemplate().Render(nil, tokenizer.RenderOptions{AddGenerationPrompt: true})
	if err != nil || !strings.HasSuffix(text, "<|im_start|>assistant\n") {
		t.Errorf("chat template: %q, %v", text, err)
	}
}

func TestBuiltinTextIsPrintable(t *testing.T) {
	// Sampling at a high temperature with the suppressed tokens masked gives valid, printable
	// UTF-8 (plus newlines and tabs) until EOS.
	m := openTiny(t)
	c := m.cfg
	g := m.Generation()
	const n = 200
	kv := newTestKV(c, 16, (n+30)/16+1, false)
	blocks := blockRange(0, (n+30)/16+1)
	prompt := m.Tokenizer().Encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
	logits := prefillChunked(t, m, kv, 16, blocks, prompt, len(prompt))
	s := NewSampler(SamplingParams{Temperature: 1.5, Seed: 9})
	var out []int32
	for pos := len(prompt); len(out) < n; pos++ {
		for _, id := range g.SuppressTokens {
			logits[id] = float32(math.Inf(-1))
		}
		id := s.Sample(logits)
		if slices.Contains(g.EOSTokenIDs, id) {
			break
		}
		out = append(out, id)
		if err := m.Forward(t.Context(), kv, 16, []Seq{{Tokens: []int32{id}, Start: pos, Blocks: blocks, Logits: logits}}); err != nil {
			t.Fatal(err)
		}
	}
	text := m.Tokenizer().Decode(out)
	if !utf8.ValidString(text) {
		t.Fatalf("invalid UTF-8: %q", text)
	}
	for _, r := range text {
		if r != '\n' && r != '\t' && !unicode.IsPrint(r) {
			t.Fatalf("unprintable %U in %q", r, text)
		}
	}
	t.Logf("%d tokens: %.80q", len(out), text)
}

func TestOpenOptions(t *testing.T) {
	m, err := Open(t.Context(), Tiny, OpenOptions{ChatTemplate: "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	text, err := m.ChatTemplate().Render([]tokenizer.Message{{Role: "user", Content: "hi"}}, tokenizer.RenderOptions{})
	if err != nil || text != "[user] hi\n" {
		t.Errorf("custom template: %q, %v", text, err)
	}
	if _, err := Open(t.Context(), Tiny, OpenOptions{ChatTemplate: "{% for %}"}); err == nil {
		t.Error("bad template accepted")
	}
}
