package model

import (
	"errors"
	"math"
	"testing"
)

// TestInt8MatchesReference: with int8 weights kvbridge/tiny's logits stay close to float32's —
// the RMS of the difference within 3% of the logits' RMS at every position, the most likely
// token the same at nearly every position — and differ from them (the weights were quantized).
// int8 with groups of 32 has a relative error of about 2⁻⁸/√3 per weight and activation, a few
// times bfloat16's: 3% is about 8σ over kvbridge/tiny's 9 products.
func TestInt8MatchesReference(t *testing.T) {
	m := openTinyWith(t, precision{int8: true})
	if m.Quantization() != "int8" || openTiny(t).Quantization() != "" {
		t.Fatalf("Quantization() = %q", m.Quantization())
	}
	tokens := randomTokens(64, m.cfg.VocabSize, 2)
	got := forwardAll(t, m, tokens, 16)
	want := forwardAll(t, openTiny(t), tokens, 16)
	agree, differs, worst := 0, false, 0.0
	for pos := range tokens {
		var rms, diff float64
		for i, v := range want[pos] {
			rms += float64(v) * float64(v)
			d := float64(got[pos][i] - v)
			diff += d * d
			differs = differs || d != 0
		}
		e := math.Sqrt(diff / rms)
		worst = max(worst, e)
		if e > 0.03 {
			t.Errorf("position %d: RMS(int8 − float32) = %.3g of the logits' RMS, want ≤ 0.03", pos, e)
		}
		if Argmax(got[pos]) == Argmax(want[pos]) {
			agree++
		}
	}
	if !differs {
		t.Fatal("int8 logits equal float32's: the weights were not quantized")
	}
	if agree < len(tokens)*9/10 {
		t.Errorf("top-1 agrees at %d of %d positions, want ≥ 90%%", agree, len(tokens))
	}
	t.Logf("worst relative RMS %.3g, top-1 agreement %d/%d", worst, agree, len(tokens))
}

// TestOpenQuantization: Open takes --quantization int8 (any case) and none, and refuses other
// schemes with ErrUnsupported naming them; the int8 model's weight bytes are about a quarter
// of float32's.
func TestOpenQuantization(t *testing.T) {
	f32, err := Open(t.Context(), Tiny, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer f32.Close()
	for _, q := range []string{"int8", "INT8"} {
		m, err := Open(t.Context(), Tiny, OpenOptions{Quantization: q})
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		if m.Quantization() != "int8" || m.WeightBytes() > f32.WeightBytes()*3/10 {
			t.Errorf("%s: quantization %q, %d weight bytes (float32: %d)", q, m.Quantization(), m.WeightBytes(), f32.WeightBytes())
		}
		m.Close()
	}
	if m, err := Open(t.Context(), Tiny, OpenOptions{Quantization: "none"}); err != nil || m.Quantization() != "" {
		t.Fatalf("none: %v", err)
	} else {
		m.Close()
	}
	if _, err := Open(t.Context(), Tiny, OpenOptions{Quantization: "awq"}); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("awq: %v, want ErrUnsupported", err)
	}
}
