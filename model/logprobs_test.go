package model

import (
	"math"
	"slices"
	"testing"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

// TestRowLogitsMatchPrefixLogits: the logits RowLogits reports for token j of a 50-token prefill
// (more than one group of rows) are bit-identical to the Logits of a prefill of the first j+1
// tokens alone, so prompt logprobs equal what a decode would have seen at every position.
func TestRowLogitsMatchPrefixLogits(t *testing.T) {
	m := openTiny(t)
	c := m.cfg
	const blockSize = 16
	tokens := randomTokens(50, c.VocabSize, 11)
	nb := (len(tokens) + blockSize - 1) / blockSize
	blocks := blockRange(0, nb)
	rows := make([][]float32, len(tokens))
	kv := newTestKV(c, blockSize, nb, false)
	last := make([]float32, c.VocabSize)
	s := Seq{Tokens: tokens, Blocks: blocks, Logits: last, RowLogits: func(i int, lg []float32) { rows[i] = slices.Clone(lg) }}
	if err := m.Forward(t.Context(), kv, blockSize, []Seq{s}); err != nil {
		t.Fatal(err)
	}
	requireSameBits(t, "last row", last, rows[len(rows)-1])
	for _, j := range []int{0, 1, 15, 16, 31, 32, 33, 48} {
		want := prefillChunked(t, m, newTestKV(c, blockSize, nb, false), blockSize, blocks, tokens[:j+1], 7)
		requireSameBits(t, "row", want, rows[j])
	}
}

func TestLogprobs(t *testing.T) {
	logits := []float32{1, 3, 3, -2, float32(math.Inf(-1)), 0.5, 2}
	ref := fixture.LogSoftmax(logits)
	got := Logprobs(logits, 6, 3)
	// Token 6 (logit 2) has two better tokens (3, 3): rank 3.
	if got.Token.ID != 6 || got.Token.Rank != 3 || math.Abs(got.Token.Logprob-ref[6]) > 1e-12 {
		t.Errorf("token = %+v, want id 6 rank 3 logprob %v", got.Token, ref[6])
	}
	wantTop := []int32{1, 2, 6} // ties by id
	for k, tl := range got.Top {
		if tl.ID != wantTop[k] || tl.Rank != k+1 || math.Abs(tl.Logprob-ref[tl.ID]) > 1e-12 {
			t.Errorf("top[%d] = %+v, want id %d rank %d logprob %v", k, tl, wantTop[k], k+1, ref[wantTop[k]])
		}
	}
	// A tie counts the worse rank (vLLM counts logprobs ≥ the token's).
	if r := Logprobs(logits, 1, 0).Token.Rank; r != 2 {
		t.Errorf("rank of a tied best token = %d, want 2", r)
	}
	if l := Logprobs(logits, 4, 0).Token; !math.IsInf(l.Logprob, -1) || l.Rank != len(logits) {
		t.Errorf("masked token = %+v, want -Inf, last rank", l)
	}
	all := Logprobs(logits, 0, -1).Top
	sum := 0.0
	for _, tl := range all {
		sum += math.Exp(tl.Logprob)
	}
	if len(all) != len(logits) || math.Abs(sum-1) > 1e-12 {
		t.Errorf("all tokens: %d entries summing to %v", len(all), sum)
	}
	// The selection path (top ≪ vocabulary) agrees with a full sort.
	big := make([]float32, 1000)
	for i := range big {
		big[i] = float32(math.Sin(float64(i) * 7.3))
	}
	sel, full := Logprobs(big, 3, 20).Top, Logprobs(big, 3, -1).Top[:20]
	if !slices.Equal(sel, full) {
		t.Errorf("top-20 by selection %v, by sort %v", sel, full)
	}
}

// process applies p's processors to a copy of logits.
func process(p SamplingParams, logits []float32, prompt, output []int32) []float32 {
	out := slices.Clone(logits)
	NewSampler(p).Process(out, prompt, output)
	return out
}

func TestProcessPenalties(t *testing.T) {
	logits := []float32{2, -2, 1, 4, 0.5}
	prompt := []int32{0, 0, 1}
	output := []int32{2, 2, 2, 3}
	inf := float32(math.Inf(-1))
	cases := []struct {
		name string
		p    SamplingParams
		want []float32
	}{
		// vLLM: positive logits of tokens in prompt ∪ output are divided, negative multiplied;
		// each token once however often it occurs.
		{"repetition", SamplingParams{RepetitionPenalty: 2}, []float32{1, -4, 0.5, 2, 0.5}},
		// frequency: −f × count in the output; presence: −p once per token present in the output.
		{"frequency", SamplingParams{FrequencyPenalty: 0.5}, []float32{2, -2, -0.5, 3.5, 0.5}},
		{"presence", SamplingParams{PresencePenalty: 1.5}, []float32{2, -2, -0.5, 2.5, 0.5}},
		{"all three", SamplingParams{RepetitionPenalty: 2, FrequencyPenalty: 0.5, PresencePenalty: 1.5},
			[]float32{1, -4, 0.5 - 1.5 - 1.5, 2 - 0.5 - 1.5, 0.5}},
		{"logit bias", SamplingParams{LogitBias: map[int32]float32{4: 10, 0: -100}}, []float32{-98, -2, 1, 4, 10.5}},
		{"allowed", SamplingParams{AllowedTokenIDs: []int32{1, 4}}, []float32{inf, -2, inf, inf, 0.5}},
		// Bad words: [2 3 4] is banned after ...2 3; [1] always; [3 0] only after 3; [2 2 2 2 9]
		// is longer than the output allows.
		{"bad words", SamplingParams{BadWords: [][]int32{{2, 3, 4}, {1}, {2, 0}, {2, 2, 2, 2, 9}}}, []float32{2, inf, 1, 4, inf}},
	}
	for _, c := range cases {
		got := process(c.p, logits, prompt, output)
		for i := range got {
			if math.Abs(float64(got[i]-c.want[i])) > 1e-6 && got[i] != c.want[i] {
				t.Errorf("%s: logits %v, want %v", c.name, got, c.want)
				break
			}
		}
	}
	// The output counts follow a growing output across calls.
	s := NewSampler(SamplingParams{FrequencyPenalty: 1})
	for n := 1; n <= 3; n++ {
		got := slices.Clone(logits)
		s.Process(got, nil, output[:n])
		if want := logits[2] - float32(n); got[2] != want {
			t.Errorf("after %d outputs: logit %v, want %v", n, got[2], want)
		}
	}
}

func TestSampleMinP(t *testing.T) {
	// Probabilities 0.6, 0.3, 0.1: min_p 0.4 keeps tokens with p ≥ 0.24 (ids 0 and 1).
	logits := []float32{float32(math.Log(0.6)), float32(math.Log(0.3)), float32(math.Log(0.1))}
	seen := map[int32]int{}
	for _, id := range draws(SamplingParams{Temperature: 1, MinP: 0.4, Seed: 3}, logits, 400) {
		seen[id]++
	}
	if len(seen) != 2 || seen[0] == 0 || seen[1] == 0 {
		t.Errorf("min_p 0.4 drew %v", seen)
	}
	// Greedy ignores min_p.
	if got := NewSampler(SamplingParams{MinP: 0.99}).Sample(slices.Clone(logits)); got != 0 {
		t.Errorf("greedy with min_p = %d", got)
	}
}
