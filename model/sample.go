package model

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"maps"
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
	// MinP drops tokens whose probability (after temperature) is below MinP times the most
	// likely token's; 0 = off, and values above 1 count as 1. Like top-k and top-p it does not
	// apply to greedy decoding.
	MinP float64
	// Seed seeds the request's random stream: the same seed gives the same draws.
	Seed int64

	// The processors below change the logits before temperature, in vLLM's order: allowed
	// tokens, bad words, logit bias, then the penalties (see Sampler.Process).

	// AllowedTokenIDs, if non-empty, are the only tokens that may be drawn.
	AllowedTokenIDs []int32
	// BadWords are token sequences that may not be generated: the last token of one is masked
	// when the output ends with the rest of it.
	BadWords [][]int32
	// LogitBias is added to the logits of its tokens.
	LogitBias map[int32]float32
	// RepetitionPenalty divides the positive logits and multiplies the negative ones of every
	// token present in the prompt or the output; 0 and 1 are off.
	RepetitionPenalty float64
	// FrequencyPenalty is subtracted from a token's logit once per occurrence in the output.
	FrequencyPenalty float64
	// PresencePenalty is subtracted from the logit of every token present in the output.
	PresencePenalty float64
}

// greedyEpsilon is the temperature below which sampling is greedy (vLLM's _SAMPLING_EPS).
const greedyEpsilon = 1e-5

// Sampler draws tokens for one request. It is not safe for concurrent use.
type Sampler struct {
	p     SamplingParams
	rng   *rand.Rand
	cand  []candidate
	draws int64 // random numbers drawn so far (Draws)

	// Process state: the allowed-token bitmap, the prompt's distinct tokens (sorted) and the
	// output's token counts, kept up to date incrementally.
	allowed    []uint64
	promptSet  []int32
	promptSeen bool
	outCounts  map[int32]int
	outCounted int
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

// Draws returns how many random numbers the sampler drew so far: Sample draws one per
// non-greedy token (none in greedy mode, or when every logit is masked).
func (s *Sampler) Draws() int64 { return s.draws }

// Skip advances the random stream by n draws, as if Sample had drawn them: a token sampled
// elsewhere with the same params and seed (a prefiller's first token) leaves this sampler where
// sampling it here would have.
func (s *Sampler) Skip(n int) {
	for range n {
		s.rng.Float64()
		s.draws++
	}
}

// Fingerprint returns a SHA-256 of everything in p that shapes a draw from given logits: the
// processors, and — unless p is greedy, where only the argmax counts — temperature, top-p,
// top-k, min-p and the seed. Two samplers with equal fingerprints draw the same token from the
// same logits and output, leaving their random streams in the same state.
func (p SamplingParams) Fingerprint() []byte {
	h := sha256.New()
	var b [8]byte
	u64 := func(v uint64) {
		binary.LittleEndian.PutUint64(b[:], v)
		h.Write(b[:])
	}
	f64 := func(v float64) { u64(math.Float64bits(v)) }
	ids := func(v []int32) {
		u64(uint64(len(v)))
		for _, id := range v {
			u64(uint64(uint32(id)))
		}
	}
	if p.Temperature < greedyEpsilon {
		u64(0)
	} else {
		u64(1)
		f64(p.Temperature)
		f64(p.TopP)
		u64(uint64(int64(p.TopK)))
		f64(p.MinP)
		u64(uint64(p.Seed))
	}
	ids(p.AllowedTokenIDs)
	u64(uint64(len(p.BadWords)))
	for _, w := range p.BadWords {
		ids(w)
	}
	bias := slices.Sorted(maps.Keys(p.LogitBias))
	ids(bias)
	for _, id := range bias {
		u64(uint64(math.Float32bits(p.LogitBias[id])))
	}
	f64(p.RepetitionPenalty)
	f64(p.FrequencyPenalty)
	f64(p.PresencePenalty)
	return h.Sum(nil)
}

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
	if s.p.MinP > 0 {
		c = keepMinP(c, s.p.MinP)
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
	s.draws++
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

// keepMinP drops the candidates less likely than minP times the most likely one, unless that
// would drop them all.
func keepMinP(c []candidate, minP float64) []candidate {
	// vLLM masks p_i < min_p · p_max, that is logit_i − logit_max < ln(min_p).
	maxL := math.Inf(-1)
	for _, x := range c {
		maxL = max(maxL, float64(x.logit))
	}
	// A MinP above 1 counts as 1 (only the most likely tokens), so the list never empties.
	cut := min(math.Log(minP), 0)
	kept := c[:0]
	for _, x := range c {
		if float64(x.logit)-maxL >= cut {
			kept = append(kept, x)
		}
	}
	if len(kept) > 0 { // empty only if a logit is +Inf (+Inf − +Inf is NaN): keep them all
		return kept
	}
	return c
}

// Argmax returns the index of the largest logit, the lowest index on ties; NaN counts as -Inf.
// It returns 0 for an empty slice.
//
// It finds the largest value in eight independent lanes, then the first index holding it (a
// scan of a vocabulary's logits is a decode step's own work outside the forward pass: 152K of
// them took 104 µs in one compare chain, 49 µs so).
func Argmax(logits []float32) int32 {
	inf := float32(math.Inf(-1))
	m0, m1, m2, m3, m4, m5, m6, m7 := inf, inf, inf, inf, inf, inf, inf, inf
	n := len(logits) &^ 7
	for i := 0; i < n; i += 8 {
		s := logits[i : i+8 : i+8]
		// A NaN compares false, so it never becomes a lane's largest.
		if s[0] > m0 {
			m0 = s[0]
		}
		if s[1] > m1 {
			m1 = s[1]
		}
		if s[2] > m2 {
			m2 = s[2]
		}
		if s[3] > m3 {
			m3 = s[3]
		}
		if s[4] > m4 {
			m4 = s[4]
		}
		if s[5] > m5 {
			m5 = s[5]
		}
		if s[6] > m6 {
			m6 = s[6]
		}
		if s[7] > m7 {
			m7 = s[7]
		}
	}
	m := inf
	for _, v := range [...]float32{m0, m1, m2, m3, m4, m5, m6, m7} {
		m = max32(m, v)
	}
	for _, v := range logits[n:] {
		m = max32(m, v)
	}
	// The first index holding m (−0 == +0, as the ordering above has them equal; NaN never
	// matches): the lowest index on ties. All NaN: none, so 0.
	for i, v := range logits {
		if v == m {
			return int32(i)
		}
	}
	return 0
}

// max32 returns v if it is larger than m (not NaN), else m.
func max32(m, v float32) float32 {
	if v > m {
		return v
	}
	return m
}

// Process applies the request's logit processors to logits in place, in vLLM's order: tokens
// outside AllowedTokenIDs and the last token of each bad word whose prefix ends the output are
// masked (−Inf), LogitBias is added, then the repetition penalty (over prompt and output
// tokens), the frequency penalty and the presence penalty (over output tokens) are applied.
// output is the tokens generated so far; it must only grow between calls.
func (s *Sampler) Process(logits []float32, prompt, output []int32) {
	p := &s.p
	if len(p.AllowedTokenIDs) > 0 {
		s.maskDisallowed(logits)
	}
	maskBadWords(logits, p.BadWords, output)
	for id, b := range p.LogitBias {
		if id >= 0 && int(id) < len(logits) {
			logits[id] += b
		}
	}
	rep := p.RepetitionPenalty != 0 && p.RepetitionPenalty != 1
	if !rep && p.FrequencyPenalty == 0 && p.PresencePenalty == 0 {
		return
	}
	s.countOutput(output)
	if rep {
		s.penalizeRepetition(logits, prompt)
	}
	for id, n := range s.outCounts {
		if id < 0 || int(id) >= len(logits) {
			continue
		}
		logits[id] -= float32(p.FrequencyPenalty) * float32(n)
		logits[id] -= float32(p.PresencePenalty)
	}
}

// maskDisallowed masks the tokens outside AllowedTokenIDs (whose set it builds at the first
// call).
func (s *Sampler) maskDisallowed(logits []float32) {
	if s.allowed == nil {
		s.allowed = make([]uint64, (len(logits)+63)/64)
		for _, id := range s.p.AllowedTokenIDs {
			if id >= 0 && int(id) < len(logits) {
				s.allowed[id/64] |= 1 << (id % 64)
			}
		}
	}
	for i := range logits {
		if s.allowed[i/64]&(1<<(i%64)) == 0 {
			logits[i] = float32(math.Inf(-1))
		}
	}
}

// maskBadWords masks the last token of each bad word whose prefix (all but that token) ends
// output.
func maskBadWords(logits []float32, badWords [][]int32, output []int32) {
	for _, w := range badWords {
		if len(w) == 0 || len(w) > len(output)+1 {
			continue
		}
		prefix := w[:len(w)-1]
		if slices.Equal(output[len(output)-len(prefix):], prefix) {
			if last := w[len(w)-1]; last >= 0 && int(last) < len(logits) {
				logits[last] = float32(math.Inf(-1))
			}
		}
	}
}

// penalizeRepetition applies the repetition penalty to the tokens of the prompt and of the
// output counted so far (countOutput), each once.
func (s *Sampler) penalizeRepetition(logits []float32, prompt []int32) {
	if !s.promptSeen {
		s.promptSet = slices.Compact(slices.Sorted(slices.Values(prompt)))
		s.promptSeen = true
	}
	penalty := float32(s.p.RepetitionPenalty)
	penalize := func(id int32) {
		if id < 0 || int(id) >= len(logits) {
			return
		}
		if l := logits[id]; l > 0 {
			logits[id] = l / penalty
		} else {
			logits[id] = l * penalty
		}
	}
	for _, id := range s.promptSet {
		penalize(id)
	}
	for id := range s.outCounts {
		if _, inPrompt := slices.BinarySearch(s.promptSet, id); !inPrompt {
			penalize(id)
		}
	}
}

// countOutput brings the output token counts up to date with output.
func (s *Sampler) countOutput(output []int32) {
	if s.outCounts == nil || len(output) < s.outCounted {
		s.outCounts, s.outCounted = make(map[int32]int), 0
	}
	for _, id := range output[s.outCounted:] {
		s.outCounts[id]++
	}
	s.outCounted = len(output)
}
