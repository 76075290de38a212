package model

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestSampleGreedy(t *testing.T) {
	s := NewSampler(SamplingParams{})
	cases := []struct {
		logits []float32
		want   int32
	}{
		{[]float32{0, 3, 1}, 1},
		{[]float32{2, 5, 5, 1}, 1}, // tie: lowest id
		{[]float32{float32(math.NaN()), -1, -2}, 1},
		{[]float32{float32(math.Inf(-1)), float32(math.Inf(-1)), -7}, 2},
		{[]float32{4}, 0},
	}
	for _, c := range cases {
		if got := s.Sample(slices.Clone(c.logits)); got != c.want {
			t.Errorf("greedy %v = %d, want %d", c.logits, got, c.want)
		}
	}
	// Temperatures below 1e-5 are greedy too.
	if got := NewSampler(SamplingParams{Temperature: 1e-6, Seed: 3}).Sample([]float32{1, 2, 0}); got != 1 {
		t.Errorf("temperature 1e-6 = %d", got)
	}
}

// draws samples n tokens with p from fixed logits.
func draws(p SamplingParams, logits []float32, n int) []int32 {
	s := NewSampler(p)
	out := make([]int32, n)
	for i := range out {
		out[i] = s.Sample(slices.Clone(logits))
	}
	return out
}

func TestSampleDeterministicPerSeed(t *testing.T) {
	logits := []float32{0.1, 0.5, -0.3, 0.2, 0, 0.4, -1, 0.3}
	p := SamplingParams{Temperature: 1, Seed: 42}
	a, b := draws(p, logits, 200), draws(p, logits, 200)
	if !slices.Equal(a, b) {
		t.Fatal("same seed gave different draws")
	}
	p.Seed = 43
	if slices.Equal(a, draws(p, logits, 200)) {
		t.Fatal("different seeds gave identical 200 draws")
	}
	for _, p := range []SamplingParams{{Temperature: 0.7, TopK: 3, Seed: 9}, {Temperature: 1.3, TopP: 0.8, Seed: 9}} {
		if !slices.Equal(draws(p, logits, 100), draws(p, logits, 100)) {
			t.Fatalf("%+v: not deterministic", p)
		}
	}
}

func TestSampleDistribution(t *testing.T) {
	// With temperature 1 the frequencies follow softmax(logits). The seed is fixed, so this is
	// deterministic; the tolerance is ~5 standard deviations.
	logits := []float32{0, float32(math.Log(2)), float32(math.Log(4)), float32(math.Inf(-1))}
	const n = 20000
	count := make([]int, len(logits))
	for _, id := range draws(SamplingParams{Temperature: 1, Seed: 1}, logits, n) {
		count[id]++
	}
	want := []float64{1.0 / 7, 2.0 / 7, 4.0 / 7, 0}
	for i, c := range count {
		got := float64(c) / n
		if math.Abs(got-want[i]) > 0.02 {
			t.Errorf("token %d: frequency %.3f, want %.3f", i, got, want[i])
		}
	}
	// A high temperature flattens, a low one sharpens.
	hot, cold := make([]int, 4), make([]int, 4)
	for _, id := range draws(SamplingParams{Temperature: 100, Seed: 2}, logits, n) {
		hot[id]++
	}
	for _, id := range draws(SamplingParams{Temperature: 0.1, Seed: 2}, logits, n) {
		cold[id]++
	}
	if hot[0] < n/4 || cold[2] < n*99/100 || hot[3]+cold[3] != 0 {
		t.Errorf("hot %v cold %v", hot, cold)
	}
}

func TestSampleTopKTopP(t *testing.T) {
	logits := []float32{1, 5, 3, 4, 2, 0}
	// Top-k 2 only ever draws the two best tokens (ids 1 and 3), and both.
	seen := map[int32]int{}
	for _, id := range draws(SamplingParams{Temperature: 5, TopK: 2, Seed: 7}, logits, 500) {
		seen[id]++
	}
	if len(seen) != 2 || seen[1] == 0 || seen[3] == 0 {
		t.Errorf("top-k 2 drew %v", seen)
	}
	// Top-k 1 is greedy.
	for _, id := range draws(SamplingParams{Temperature: 5, TopK: 1, Seed: 7}, logits, 50) {
		if id != 1 {
			t.Fatalf("top-k 1 drew %d", id)
		}
	}
	// Top-p: probabilities 0.5, 0.3, 0.2 — p=0.75 keeps the first two, p=0.5 only the first.
	pl := []float32{float32(math.Log(0.2)), float32(math.Log(0.5)), float32(math.Log(0.3))}
	seen = map[int32]int{}
	for _, id := range draws(SamplingParams{Temperature: 1, TopP: 0.75, Seed: 8}, pl, 500) {
		seen[id]++
	}
	if len(seen) != 2 || seen[1] == 0 || seen[2] == 0 {
		t.Errorf("top-p 0.75 drew %v", seen)
	}
	for _, id := range draws(SamplingParams{Temperature: 1, TopP: 0.5, Seed: 8}, pl, 100) {
		if id != 1 {
			t.Fatalf("top-p 0.5 drew %d", id)
		}
	}
	// TopP 1 and 0 are off: every token can appear.
	for _, p := range []float64{0, 1} {
		seen = map[int32]int{}
		for _, id := range draws(SamplingParams{Temperature: 1, TopP: p, Seed: 8}, pl, 500) {
			seen[id]++
		}
		if len(seen) != 3 {
			t.Errorf("top-p %g drew %v", p, seen)
		}
	}
	// Masked tokens are never drawn, even at a high temperature.
	masked := []float32{float32(math.Inf(-1)), 0, float32(math.Inf(-1)), 0}
	for _, id := range draws(SamplingParams{Temperature: 50, Seed: 1}, masked, 200) {
		if id != 1 && id != 3 {
			t.Fatalf("drew masked token %d", id)
		}
	}
}

// MinP above 1 (which the exported Sampler must not panic on) keeps only the most likely tokens,
// as MinP 1 does: here the tied best ids 1 and 2, and both.
func TestSampleMinPAboveOne(t *testing.T) {
	logits := []float32{1, 3, 3, 2}
	for _, minP := range []float64{1, 1.5, 2, math.Inf(1)} {
		seen := map[int32]int{}
		for _, id := range draws(SamplingParams{Temperature: 1, MinP: minP, Seed: 5}, logits, 200) {
			seen[id]++
		}
		if len(seen) != 2 || seen[1] == 0 || seen[2] == 0 {
			t.Errorf("min-p %g drew %v, want ids 1 and 2", minP, seen)
		}
	}
	// A +Inf logit makes every logit − max NaN or −Inf, so min-p keeps nothing: no panic either.
	inf := []float32{0, float32(math.Inf(1)), 1}
	for _, id := range draws(SamplingParams{Temperature: 1, MinP: 0.5, Seed: 5}, inf, 20) {
		if id < 0 || id > 2 {
			t.Fatalf("min-p with a +Inf logit drew %d", id)
		}
	}
}

// TestSamplerSkipAndFingerprint: a sampler that skips another's draws continues with the same
// draws; Sample counts one draw per non-greedy token and none greedy. Fingerprints are equal
// for params that draw alike (greedy whatever its seed or top-p; a logit bias whatever its map
// order) and differ for anything that shapes a draw.
func TestSamplerSkipAndFingerprint(t *testing.T) {
	logits := []float32{0.1, 2, 1.5, -1, 0.7, 1.9}
	p := SamplingParams{Temperature: 1, Seed: 42, TopK: 4}
	a, b := NewSampler(p), NewSampler(p)
	first := a.Sample(slices.Clone(logits))
	if a.Draws() != 1 {
		t.Fatalf("a sampled sampler drew %d numbers, want 1", a.Draws())
	}
	b.Skip(1)
	for i := range 20 {
		if x, y := a.Sample(slices.Clone(logits)), b.Sample(slices.Clone(logits)); x != y {
			t.Fatalf("draw %d after the first (%d): %d and %d", i, first, x, y)
		}
	}
	g := NewSampler(SamplingParams{Seed: 42})
	g.Sample(slices.Clone(logits))
	if g.Draws() != 0 {
		t.Fatalf("a greedy sampler drew %d numbers", g.Draws())
	}

	fp := func(p SamplingParams) string { return string(p.Fingerprint()) }
	same := [][2]SamplingParams{
		{{Seed: 1, TopP: 0.5}, {Seed: 2}},
		{{Temperature: 1, Seed: 3, LogitBias: map[int32]float32{1: 2, 5: -1, 9: 0.5}}, {Temperature: 1, Seed: 3, LogitBias: map[int32]float32{9: 0.5, 5: -1, 1: 2}}},
	}
	for _, c := range same {
		if fp(c[0]) != fp(c[1]) {
			t.Errorf("%+v and %+v: fingerprints differ", c[0], c[1])
		}
	}
	base := SamplingParams{Temperature: 1, Seed: 3}
	for _, other := range []SamplingParams{
		{Seed: 3}, {Temperature: 0.5, Seed: 3}, {Temperature: 1, Seed: 4}, {Temperature: 1, Seed: 3, TopP: 0.9},
		{Temperature: 1, Seed: 3, TopK: 5}, {Temperature: 1, Seed: 3, MinP: 0.1}, {Temperature: 1, Seed: 3, AllowedTokenIDs: []int32{1}},
		{Temperature: 1, Seed: 3, BadWords: [][]int32{{1}}}, {Temperature: 1, Seed: 3, LogitBias: map[int32]float32{1: 1}},
		{Temperature: 1, Seed: 3, RepetitionPenalty: 1.1}, {Temperature: 1, Seed: 3, FrequencyPenalty: 0.1}, {Temperature: 1, Seed: 3, PresencePenalty: 0.1},
	} {
		if fp(other) == fp(base) {
			t.Errorf("%+v has the fingerprint of %+v", other, base)
		}
	}
}

// argmaxChain is Argmax's definition: one pass, the first index whose value exceeds every
// earlier one, NaN skipped (all NaN or empty: 0).
func argmaxChain(logits []float32) int32 {
	best, bestV, found := 0, float32(0), false
	for i, v := range logits {
		if v == v && (!found || v > bestV) {
			best, bestV, found = i, v, true
		}
	}
	return int32(best)
}

func TestArgmaxMatchesOneChain(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	negZero := float32(math.Copysign(0, -1))
	cases := [][]float32{
		nil, {nan}, {nan, nan, nan}, {-inf}, {nan, -inf, -inf}, {-inf, nan, 3},
		{1, 2, 3, 3, 2}, {negZero, 0, negZero}, {0, negZero}, {inf, inf, nan, 5},
		{1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {2, nan, 2, 7, nan, 7, 1, 0, 7, 6, 5, 4, 3, 7, nan, 7, 9},
	}
	r := rand.New(rand.NewPCG(1, 2))
	for n := range 40 {
		x := make([]float32, n)
		for i := range x {
			switch r.IntN(8) {
			case 0:
				x[i] = nan
			case 1:
				x[i] = -inf
			default:
				x[i] = float32(r.IntN(5)) // many ties
			}
		}
		cases = append(cases, x)
	}
	big := make([]float32, 151936)
	for i := range big {
		big[i] = r.Float32()
	}
	cases = append(cases, big)
	for _, c := range cases {
		if got, want := Argmax(c), argmaxChain(c); got != want {
			t.Errorf("Argmax(%v) = %d, want %d", c[:min(len(c), 20)], got, want)
		}
	}
}
