package model

import (
	"math"
	"testing"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// promptLogits returns the logits of every position of tokens, prefilled by m in one step.
func promptLogits(t *testing.T, m *Model, tokens []int32) [][]float64 {
	t.Helper()
	const blockSize = 16
	nb := (len(tokens) + blockSize - 1) / blockSize
	out := make([][]float64, len(tokens))
	row := func(i int, logits []float32) {
		out[i] = make([]float64, len(logits))
		for j, v := range logits {
			out[i][j] = float64(v)
		}
	}
	s := Seq{Tokens: tokens, Blocks: blockRange(0, nb), RowLogits: row}
	if err := m.Forward(t.Context(), newTestKVFor(m, blockSize, nb, false), blockSize, []Seq{s}); err != nil {
		t.Fatal(err)
	}
	return out
}

// logSoftmax returns the log-probabilities of logits.
func logSoftmax(logits []float64) []float64 {
	mx := math.Inf(-1)
	for _, v := range logits {
		mx = max(mx, v)
	}
	sum := 0.0
	for _, v := range logits {
		sum += math.Exp(v - mx)
	}
	lse := mx + math.Log(sum)
	out := make([]float64, len(logits))
	for i, v := range logits {
		out[i] = v - lse
	}
	return out
}

// nextTokenAgreement returns the mean KL(ref ‖ m) of the next-token distributions over every
// position of every prompt, and the share of positions whose most likely tokens agree.
func nextTokenAgreement(t *testing.T, ref, m *Model, prompts [][]int32) (kl, top1 float64) {
	t.Helper()
	n := 0
	for _, p := range prompts {
		want, got := promptLogits(t, ref, p), promptLogits(t, m, p)
		for i := range p {
			lp, lq := logSoftmax(want[i]), logSoftmax(got[i])
			d := 0.0
			for j := range lp {
				d += math.Exp(lp[j]) * (lp[j] - lq[j])
			}
			kl += d
			if argmax64(want[i]) == argmax64(got[i]) {
				top1++
			}
			n++
		}
	}
	return kl / float64(n), top1 / float64(n)
}

// argmax64 returns the index of the largest value.
func argmax64(x []float64) int {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return best
}

// TestFP8KVQuality reports how far an FP8 KV cache moves kvbridge/small's next-token
// distributions from float32's (float32 products both, over a few prompts): the mean KL
// divergence and the top-1 agreement, with a bfloat16 KV cache as the yardstick. FP8 changes
// the distributions (the keys and values are rounded: E4M3 keeps 3 mantissa bits, E5M2 2), but
// little: E4M3 by less than E5M2, and both by more than bfloat16 (7 bits). The random model's
// next-token distributions are flat, so its top-1 agreement is a harsh measure (measured: 99.0%,
// 90.6% and 79.2%); only E4M3's, vLLM's fp8, is bounded.
func TestFP8KVQuality(t *testing.T) {
	spec, _ := builtinSpecs(Small)
	open := func(prec precision) *Model {
		m, err := newBuiltin(Small, spec, prec)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	ref := open(precision{})
	var prompts [][]int32
	for i := range 3 {
		prompts = append(prompts, randomTokens(32, ref.cfg.VocabSize, uint64(500+i)))
	}
	kls := map[string]float64{}
	for _, c := range []struct {
		name string
		prec precision
	}{
		{"bfloat16", precision{kvBF16: true}},
		{"fp8_e4m3", precision{kvFP8: true, fp8: kernel.E4M3}},
		{"fp8_e5m2", precision{kvFP8: true, fp8: kernel.E5M2}},
	} {
		kl, top1 := nextTokenAgreement(t, ref, open(c.prec), prompts)
		t.Logf("KV %s against float32: mean KL %.3g nats, top-1 agreement %.1f%%", c.name, kl, 100*top1)
		kls[c.name] = kl
		if !(kl > 0) {
			t.Errorf("KV %s: KL %g; the rounding of the KV changed nothing", c.name, kl)
		}
		if c.name == "fp8_e4m3" && (top1 < 0.85 || kl > 1e-3) {
			t.Errorf("KV %s: top-1 agreement %.1f%%, mean KL %g; want at least 85%% and at most 1e-3", c.name, 100*top1, kl)
		}
	}
	if !(kls["bfloat16"] < kls["fp8_e4m3"] && kls["fp8_e4m3"] < kls["fp8_e5m2"]) {
		t.Errorf("mean KL bfloat16 %g, fp8_e4m3 %g, fp8_e5m2 %g: want them in order of the mantissa bits (7, 3, 2)", kls["bfloat16"], kls["fp8_e4m3"], kls["fp8_e5m2"])
	}
}
