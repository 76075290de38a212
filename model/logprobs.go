package model

import (
	"cmp"
	"math"
	"slices"
)

// TokenLogprob is one token's log-probability under the model and its rank: 1 + the number of
// tokens that are more likely (ties share the worse rank, as vLLM counts them).
type TokenLogprob struct {
	ID      int32
	Logprob float64
	Rank    int
}

// PositionLogprobs is the model's distribution at one position: the token that stands there
// (sampled, or the prompt's next token) and the most likely tokens, best first (ties by id).
type PositionLogprobs struct {
	Token TokenLogprob
	Top   []TokenLogprob
}

// Logprobs computes the log-softmax of logits (in float64) for token and the top most likely
// tokens (top < 0 or ≥ the vocabulary: all of them). These are the model's logprobs: logits as
// the forward pass produced them, before any penalty, bias, mask or temperature. NaN logits
// count as −Inf.
func Logprobs(logits []float32, token int32, top int) PositionLogprobs {
	val := func(i int) float64 {
		v := float64(logits[i])
		if math.IsNaN(v) {
			return math.Inf(-1)
		}
		return v
	}
	maxL := math.Inf(-1)
	for i := range logits {
		maxL = max(maxL, val(i))
	}
	logZ := maxL
	if !math.IsInf(maxL, -1) {
		sum := 0.0
		for i := range logits {
			sum += math.Exp(val(i) - maxL)
		}
		logZ = maxL + math.Log(sum)
	}
	lp := func(i int) float64 { return val(i) - logZ }
	var out PositionLogprobs
	if token >= 0 && int(token) < len(logits) {
		t := val(int(token))
		rank := 0
		for i := range logits {
			if val(i) >= t {
				rank++
			}
		}
		out.Token = TokenLogprob{ID: token, Logprob: lp(int(token)), Rank: rank}
	}
	if top < 0 || top > len(logits) {
		top = len(logits)
	}
	if top == 0 {
		return out
	}
	order := func(a, b int) int { // best first, ties by id
		if c := cmp.Compare(val(b), val(a)); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	}
	var ids []int
	if top*8 >= len(logits) {
		ids = make([]int, len(logits))
		for i := range ids {
			ids[i] = i
		}
		slices.SortFunc(ids, order)
		ids = ids[:top]
	} else {
		// Insertion into a sorted window of the best top ids seen so far.
		ids = make([]int, 0, top+1)
		for i := range logits {
			if len(ids) == top && order(i, ids[top-1]) > 0 {
				continue
			}
			j, _ := slices.BinarySearchFunc(ids, i, order)
			ids = slices.Insert(ids, j, i)
			if len(ids) > top {
				ids = ids[:top]
			}
		}
	}
	// vLLM ranks the top tokens by position (1..top), whatever the ties.
	out.Top = make([]TokenLogprob, len(ids))
	for k, i := range ids {
		out.Top[k] = TokenLogprob{ID: int32(i), Logprob: lp(i), Rank: k + 1}
	}
	return out
}
