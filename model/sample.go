package model

import (
	"cmp"
	"math"
	"math/rand/v2"
	"slices"
)

// SamplingParams choose how a request's tokens are drawn.
type SamplingParams struct {
	// Temperature divides the logits; 0 (or below 1e-5) means greedy decoding.
	Temperature float64
	// TopP keeps the smallest set of most likely tokens whose probability reaches TopP; 0 or 1 = off.
	TopP float64
	// TopK keeps the TopK most likely tokens; ≤ 0 = off.
	TopK int
	// Seed seeds the request's random stream: the same seed gives the same draws.
	Seed int64
}

// greedyEpsilon is the temperature below which sampling is greedy (vLLM's _SAMPLING_EPS).
const greedyEpsilon = 1e-5

// Sampler draws tokens for one request. It is not safe for concurrent use.
type Sampler struct {
	p    SamplingParams
	rng  *rand.Rand
	cand []candidate
}

// candidate is one token considered by a non-greedy draw.
type candidate struct {
	id    int32
	logit float32
	prob  float64
}

// NewSampler returns a sampler for p. Same params and seed → same sequence of draws for the same
// logits.
func NewSampler(p SamplingParams) *Sampler {
	seed := uint64(p.Seed)
	return &Sampler{p: p, rng: rand.New(rand.NewPCG(seed, seed^0xda942042e4dd58b5))}
}

// Params returns the sampler's parameters.
func (s *Sampler) Params() SamplingParams { return s.p }

// Sample draws one token id from logits (length = vocabulary). Tokens whose logit is -Inf or NaN
// are never drawn unless every logit is. Greedy mode returns the argmax, the lowest id on ties.
// Sample may modify logits in place.
func (s *Sampler) Sample(logits []float32) int32 {
	if len(logits) == 0 {
		return 0
	}
	if s.p.Temperature < greedyEpsilon {
		return Argmax(logits)
	}
	// Candidates: finite logits, scaled by 1/temperature.
	invT := 1 / s.p.Temperature
	c := s.cand[:0]
	for i, l := range logits {
		if math.IsNaN(float64(l)) || math.IsInf(float64(l), -1) {
			continue
		}
		c = append(c, candidate{id: int32(i), logit: float32(float64(l) * invT)})
	}
	s.cand = c
	if len(c) == 0 {
		return Argmax(logits)
	}
	byLogit := func(a, b candidate) int {
		if x := cmp.Compare(b.logit, a.logit); x != 0 {
			return x
		}
		return cmp.Compare(a.id, b.id)
	}
	topP := s.p.TopP > 0 && s.p.TopP < 1
	if k := s.p.TopK; k > 0 && k < len(c) {
		slices.SortFunc(c, byLogit)
		c = c[:k]
	} else if topP {
		slices.SortFunc(c, byLogit)
	}
	// Softmax over the candidates in float64.
	maxL := math.Inf(-1)
	for _, x := range c {
		maxL = max(maxL, float64(x.logit))
	}
	sum := 0.0
	for i := range c {
		c[i].prob = math.Exp(float64(c[i].logit) - maxL)
		sum += c[i].prob
	}
	if topP {
		// c is sorted by descending logit: keep the shortest prefix reaching TopP of the mass.
		want, acc := s.p.TopP*sum, 0.0
		for i := range c {
			acc += c[i].prob
			if acc >= want {
				c, sum = c[:i+1], acc
				break
			}
		}
	}
	u := s.rng.Float64() * sum
	acc := 0.0
	for _, x := range c {
		acc += x.prob
		if u < acc {
			return x.id
		}
	}
	return c[len(c)-1].id
}

// Argmax returns the index of the largest logit, the lowest index on ties; NaN counts as -Inf.
// It returns 0 for an empty slice.
func Argmax(logits []float32) int32 {
	best, bestV := 0, float32(math.Inf(-1))
	found := false
	for i, v := range logits {
		if v != v { // NaN
			continue
		}
		if !found || v > bestV {
			best, bestV, found = i, v, true
		}
	}
	return int32(best)
}
