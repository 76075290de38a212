package engine

import (
	"fmt"
	"slices"

	"github.com/kvbridge/kvbridge/model"
)

// Request is one generation request. The engine does not modify it; its slices and map must not
// be modified by the caller after Add.
type Request struct {
	// ID names the request (the HTTP layer's request id). Empty means the engine picks one. It
	// must be unique among live requests.
	ID string
	// Prompt is the tokenized prompt; it must not be empty.
	Prompt []int32
	// Sampling configures the per-request sampler. A zero Seed means "no seed": the engine
	// derives one from Config.Seed and the request's arrival number.
	Sampling model.SamplingParams
	// MaxTokens bounds the generated tokens (> 0). Generation also stops at MaxModelLen.
	MaxTokens int
	// MinTokens is the number of tokens generated before EOS, stop token ids and stop strings
	// may end the request (their logits are masked until then).
	MinTokens int
	// Stop lists stop strings: the output text ends before the first occurrence of any of them.
	Stop []string
	// StopTokenIDs end the request when sampled (the token counts, its text is not emitted).
	StopTokenIDs []int32
	// Stops, if set, is NewStops(Stop, StopTokenIDs), built once and shared by the sequences of
	// one request (n, best_of) so that each does not compile and hold its own. Nil makes Add
	// build it for this request.
	Stops *Stops
	// IgnoreEOS keeps generating past EOS (until MaxTokens or MaxModelLen).
	IgnoreEOS bool
	// Logprobs asks for the model's logprobs of every sampled token (Output.Logprobs), with the
	// TopLogprobs most likely tokens at each position (negative: the whole vocabulary). They are
	// computed from the logits as the model produced them, before penalties, biases, masks and
	// temperature (vLLM's default raw logprobs).
	Logprobs    bool
	TopLogprobs int
	// PromptLogprobs asks for the logprobs of the prompt tokens after the first
	// (Output.PromptLogprobs), with the TopPromptLogprobs most likely tokens (negative: all).
	// They need the logits of every prompt position, so such a request computes its whole
	// prompt: it takes nothing from the prefix cache or the connector (as vLLM skips the prefix
	// cache for it); a connector's producer is still told to free its blocks.
	PromptLogprobs    bool
	TopPromptLogprobs int
	// KVTransfer is kv_transfer_params, opaque to the engine; the Connector interprets it.
	KVTransfer map[string]any
}

// validate checks the request against the engine limits. vocab ≤ 0 skips the token range check.
func (r *Request) validate(maxModelLen, vocab int) error {
	if r == nil {
		return fmt.Errorf("nil request: %w", ErrInvalidRequest)
	}
	if len(r.Prompt) == 0 {
		return fmt.Errorf("request %q: empty prompt: %w", r.ID, ErrInvalidRequest)
	}
	if maxModelLen > 0 && len(r.Prompt) >= maxModelLen {
		return &promptTooLongError{msg: fmt.Sprintf(
			"engine: request %q: prompt of %d tokens leaves no room to generate within max model length %d: %v",
			r.ID, len(r.Prompt), maxModelLen, ErrPromptTooLong)}
	}
	if r.MaxTokens <= 0 {
		return fmt.Errorf("request %q: max_tokens %d must be positive: %w", r.ID, r.MaxTokens, ErrInvalidRequest)
	}
	if r.MinTokens < 0 || r.MinTokens > r.MaxTokens {
		return fmt.Errorf("request %q: min_tokens %d must be in [0, max_tokens %d]: %w",
			r.ID, r.MinTokens, r.MaxTokens, ErrInvalidRequest)
	}
	if vocab > 0 {
		for i, t := range r.Prompt {
			if t < 0 || int(t) >= vocab {
				return fmt.Errorf("request %q: prompt token %d at position %d is outside the vocabulary of %d: %w",
					r.ID, t, i, vocab, ErrInvalidRequest)
			}
		}
	}
	for _, s := range r.Stop {
		if s == "" {
			return fmt.Errorf("request %q: empty stop string: %w", r.ID, ErrInvalidRequest)
		}
	}
	return nil
}

// stopTokenID reports whether id is one of the request's stop token ids.
func (r *Request) stopTokenID(id int32) bool {
	if r.Stops != nil {
		return r.Stops.isStopID(id)
	}
	return slices.Contains(r.StopTokenIDs, id)
}
