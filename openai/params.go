package openai

import (
	"math"

	"github.com/kvbridge/kvbridge/model"
)

// greedyEpsilon is vLLM's _SAMPLING_EPS: temperatures below it mean greedy sampling.
const greedyEpsilon = 1e-5

// explicitSeedZero stands for a request's "seed": 0, since engine.Request reads Seed 0 as "no
// seed" (the engine then derives one per request).
const explicitSeedZero = math.MinInt64

// genParams are a request's validated generation parameters, before the prompt is known.
type genParams struct {
	maxTokens       int // 0: not given (defaults to max_model_len − prompt length)
	minTokens       int
	sampling        model.SamplingParams
	stop            []string
	stopTokenIDs    []int32
	ignoreEOS       bool
	stream          bool
	includeUsage    bool
	continuousUsage bool
	kvTransfer      map[string]any
}

// params validates the fields common to both routes. vocab is the tokenizer's size.
func (s *Server) params(c *commonRequest, vocab int) (genParams, *APIError) {
	var p genParams
	if c.N != nil && *c.N != 1 {
		if *c.N < 1 {
			return p, badRequest("n", "n must be at least 1, got %d.", *c.N)
		}
		return p, unsupported("n", "n > 1 (several choices per request)")
	}
	if c.BestOf != nil && *c.BestOf > 1 {
		return p, unsupported("best_of", "best_of > 1")
	}
	if c.UseBeamSearch != nil && *c.UseBeamSearch {
		return p, unsupported("use_beam_search", "beam search")
	}
	if c.PromptLogprobs != nil {
		return p, unsupported("prompt_logprobs", "prompt_logprobs")
	}
	if c.PresencePenalty != nil && *c.PresencePenalty != 0 {
		return p, unsupported("presence_penalty", "presence_penalty")
	}
	if c.FrequencyPenalty != nil && *c.FrequencyPenalty != 0 {
		return p, unsupported("frequency_penalty", "frequency_penalty")
	}
	if c.RepetitionPenalty != nil && *c.RepetitionPenalty != 1 {
		return p, unsupported("repetition_penalty", "repetition_penalty")
	}
	if c.MinP != nil && *c.MinP != 0 {
		return p, unsupported("min_p", "min_p")
	}
	if len(c.LogitBias) > 0 {
		return p, unsupported("logit_bias", "logit_bias")
	}
	if c.ResponseFormat != nil && c.ResponseFormat.Type != "" && c.ResponseFormat.Type != "text" {
		return p, unsupported("response_format", "response_format "+c.ResponseFormat.Type)
	}

	// max_completion_tokens (the newer name) wins over max_tokens when both are given.
	maxTok, maxParam := c.MaxTokens, "max_tokens"
	if c.MaxCompletionTokens != nil {
		maxTok, maxParam = c.MaxCompletionTokens, "max_completion_tokens"
	}
	if maxTok != nil {
		if *maxTok < 1 {
			return p, badRequest(maxParam, "%s must be at least 1, got %d.", maxParam, *maxTok)
		}
		p.maxTokens = int(min(int64(*maxTok), math.MaxInt32))
	}
	if c.MinTokens != nil {
		if *c.MinTokens < 0 {
			return p, badRequest("min_tokens", "min_tokens must be greater than or equal to 0, got %d.", *c.MinTokens)
		}
		if p.maxTokens > 0 && int64(*c.MinTokens) > int64(p.maxTokens) {
			return p, badRequest("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.", p.maxTokens, *c.MinTokens)
		}
		p.minTokens = int(min(int64(*c.MinTokens), math.MaxInt32))
	}

	gen := s.model.Generation()
	p.sampling = model.SamplingParams{Temperature: gen.Temperature, TopP: gen.TopP, TopK: gen.TopK}
	if c.Temperature != nil {
		t := *c.Temperature
		if t < 0 || math.IsNaN(t) || math.IsInf(t, 0) {
			return p, badRequest("temperature", "temperature must be non-negative, got %v.", t)
		}
		p.sampling.Temperature = t
	}
	if p.sampling.Temperature < greedyEpsilon {
		p.sampling.Temperature = 0
	}
	if c.TopP != nil {
		tp := *c.TopP
		if !(tp > 0 && tp <= 1) {
			return p, badRequest("top_p", "top_p must be in (0, 1], got %v.", tp)
		}
		p.sampling.TopP = tp
	}
	if c.TopK != nil {
		k := *c.TopK
		if k < -1 {
			return p, badRequest("top_k", "top_k must be 0 or -1 (disable), or at least 1, got %d.", k)
		}
		p.sampling.TopK = int(max(min(k, math.MaxInt32), 0))
	}
	if c.Seed != nil {
		// The engine reads Seed 0 as "no seed"; an explicit seed 0 must still be reproducible.
		p.sampling.Seed = int64(*c.Seed)
		if p.sampling.Seed == 0 {
			p.sampling.Seed = explicitSeedZero
		}
	}

	if c.Stop != nil {
		for _, st := range *c.Stop {
			if st != "" {
				p.stop = append(p.stop, st)
			}
		}
	}
	for _, id := range c.StopTokenIDs {
		if id < 0 || int64(id) >= int64(vocab) {
			return p, badRequest("stop_token_ids", "Stop token id %d is out of vocabulary (size %d).", id, vocab)
		}
		p.stopTokenIDs = append(p.stopTokenIDs, int32(id))
	}
	p.ignoreEOS = c.IgnoreEOS != nil && *c.IgnoreEOS

	p.stream = c.Stream != nil && *c.Stream
	if p.stream && c.StreamOptions != nil {
		// As in vLLM, include_usage defaults to true once stream_options is given: {} asks for usage.
		p.includeUsage = c.StreamOptions.IncludeUsage == nil || *c.StreamOptions.IncludeUsage
		p.continuousUsage = p.includeUsage && c.StreamOptions.ContinuousUsageStats != nil && *c.StreamOptions.ContinuousUsageStats
	}
	p.kvTransfer = c.KVTransferParams
	return p, nil
}

// fitPrompt checks the prompt length against max_model_len and settles max_tokens (default:
// max_model_len − prompt length, capped by the model's max_new_tokens), as vLLM's
// _validate_input and generation-config defaults do. promptParam names the field
// holding the prompt ("prompt" or "messages").
func (s *Server) fitPrompt(p *genParams, promptLen int, promptParam string) *APIError {
	maxLen := s.cfg.MaxModelLen
	if promptLen == 0 {
		return badRequest(promptParam, "The prompt is empty; at least one token is needed.")
	}
	if promptLen >= maxLen {
		return badRequest(promptParam, "This model's maximum context length is %d tokens. However, your request has %d input tokens. Please reduce the length of the input messages.", maxLen, promptLen)
	}
	if p.maxTokens == 0 {
		p.maxTokens = maxLen - promptLen
		if n := s.model.Generation().MaxNewTokens; n > 0 {
			p.maxTokens = min(p.maxTokens, n)
		}
	} else if promptLen+p.maxTokens > maxLen {
		return badRequest("max_tokens", "'max_tokens' or 'max_completion_tokens' is too large: %d. This model's maximum context length is %d tokens and your request has %d input tokens (%d > %d - %d).",
			p.maxTokens, maxLen, promptLen, p.maxTokens, maxLen, promptLen)
	}
	if p.minTokens > p.maxTokens {
		return badRequest("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.", p.maxTokens, p.minTokens)
	}
	return nil
}
