package openai

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"github.com/kvbridge/kvbridge/model"
)

// greedyEpsilon is vLLM's _SAMPLING_EPS: temperatures below it mean greedy sampling.
const greedyEpsilon = 1e-5

// explicitSeedZero stands for a request's "seed": 0, since engine.Request reads Seed 0 as "no
// seed" (the engine then derives one per request).
const explicitSeedZero = math.MinInt64

// DefaultMaxLogprobs is vLLM's default --max-logprobs: the most logprobs a request may ask for
// per position.
const DefaultMaxLogprobs = 20

// genParams are a request's validated generation parameters, before the prompt is known.
type genParams struct {
	// n is the number of choices returned; bestOf ≥ n the number of sequences generated (the
	// n with the highest cumulative logprob are returned).
	n, bestOf int
	// logprobs: report the sampled tokens' logprobs with topLogprobs alternatives (−1: all);
	// promptLogprobs: the prompt's, with topPromptLogprobs alternatives.
	logprobs, promptLogprobs       bool
	topLogprobs, topPromptLogprobs int
	maxTokens                      int // 0: not given (defaults to max_model_len − prompt length)
	minTokens                      int
	sampling                       model.SamplingParams
	stop                           []string
	stopTokenIDs                   []int32
	ignoreEOS                      bool
	stream                         bool
	streamOptions                  bool // stream_options was given
	includeUsage                   bool
	continuousUsage                bool
	kvTransfer                     map[string]any
}

// params validates the fields common to both routes. vocab is the tokenizer's size. The checks
// run in a fixed order (the first failing one is reported): choices, prompt logprobs,
// penalties, token lists, response format, lengths, sampling, stops, streaming, KV transfer.
func (s *Server) params(c *commonRequest, vocab int) (genParams, *APIError) {
	p := genParams{n: 1}
	if apiErr := choiceParams(c, &p); apiErr != nil {
		return p, apiErr
	}
	if apiErr := s.promptLogprobParams(c, vocab, &p); apiErr != nil {
		return p, apiErr
	}
	if apiErr := penaltyParams(c, &p.sampling); apiErr != nil {
		return p, apiErr
	}
	if apiErr := logitBiasParam(c.LogitBias, vocab, &p.sampling); apiErr != nil {
		return p, apiErr
	}
	if apiErr := allowedTokensParam(c.AllowedTokenIDs, vocab, &p.sampling); apiErr != nil {
		return p, apiErr
	}
	var apiErr *APIError
	if p.sampling.BadWords, apiErr = s.badWords(c.BadWords); apiErr != nil {
		return p, apiErr
	}
	if c.ResponseFormat != nil && c.ResponseFormat.Type != "" && c.ResponseFormat.Type != "text" {
		return p, unsupported("response_format", "response_format "+c.ResponseFormat.Type)
	}
	if apiErr := lengthParams(c, &p); apiErr != nil {
		return p, apiErr
	}
	if apiErr := s.samplingParams(c, &p.sampling); apiErr != nil {
		return p, apiErr
	}
	if apiErr := stopParams(c, vocab, &p); apiErr != nil {
		return p, apiErr
	}
	if apiErr := streamParams(c, &p); apiErr != nil {
		return p, apiErr
	}
	if c.KVTransferParams != nil && s.cfg.CheckKV != nil {
		if err := s.cfg.CheckKV(c.KVTransferParams); err != nil {
			return p, badRequest("kv_transfer_params", "%v", err)
		}
	}
	p.kvTransfer = c.KVTransferParams
	return p, nil
}

// choiceParams applies n, best_of and use_beam_search.
func choiceParams(c *commonRequest, p *genParams) *APIError {
	if c.N != nil {
		if *c.N < 1 {
			return badRequest("n", "n must be at least 1, got %d.", *c.N)
		}
		if *c.N > maxChoices {
			return badRequest("n", "n must be at most %d, got %d.", maxChoices, *c.N)
		}
		p.n = int(*c.N)
	}
	p.bestOf = p.n
	if c.BestOf != nil {
		switch b := *c.BestOf; {
		case b < jsonInt(p.n):
			return badRequest("best_of", "best_of must be greater than or equal to n, got n=%d and best_of=%d.", p.n, b)
		case b > maxChoices:
			return badRequest("best_of", "best_of must be at most %d, got %d.", maxChoices, b)
		case b > jsonInt(p.n) && c.Stream != nil && *c.Stream:
			return badRequest("best_of", "best_of must equal n to stream, got n=%d and best_of=%d.", p.n, b)
		}
		p.bestOf = int(*c.BestOf)
	}
	if c.UseBeamSearch != nil && *c.UseBeamSearch {
		return unsupported("use_beam_search", "beam search")
	}
	return nil
}

// promptLogprobParams applies prompt_logprobs.
func (s *Server) promptLogprobParams(c *commonRequest, vocab int, p *genParams) *APIError {
	if c.PromptLogprobs == nil {
		return nil
	}
	k := *c.PromptLogprobs
	if k < -1 {
		return badRequest("prompt_logprobs", "`prompt_logprobs` must be a positive value or -1.")
	}
	if c.Stream != nil && *c.Stream && k != 0 {
		return badRequest("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
	}
	if apiErr := s.checkNumLogprobs("prompt_logprobs", "prompt", k, vocab); apiErr != nil {
		return apiErr
	}
	p.promptLogprobs, p.topPromptLogprobs = true, int(k)
	return nil
}

// penaltyParams applies presence_penalty, frequency_penalty, repetition_penalty and min_p.
func penaltyParams(c *commonRequest, sp *model.SamplingParams) *APIError {
	var apiErr *APIError
	if sp.PresencePenalty, apiErr = penalty("presence_penalty", c.PresencePenalty); apiErr != nil {
		return apiErr
	}
	if sp.FrequencyPenalty, apiErr = penalty("frequency_penalty", c.FrequencyPenalty); apiErr != nil {
		return apiErr
	}
	if c.RepetitionPenalty != nil {
		if r := *c.RepetitionPenalty; !(r > 0) || math.IsInf(r, 0) {
			return badRequest("repetition_penalty", "repetition_penalty must be greater than zero, got %v.", r)
		}
		sp.RepetitionPenalty = *c.RepetitionPenalty
	}
	if c.MinP != nil {
		if m := *c.MinP; !(m >= 0 && m <= 1) {
			return badRequest("min_p", "min_p must be in [0, 1], got %v.", m)
		}
		sp.MinP = *c.MinP
	}
	return nil
}

// penalty checks an additive penalty (presence or frequency): in [-2, 2], 0 when not given.
func penalty(name string, v *float64) (float64, *APIError) {
	if v == nil {
		return 0, nil
	}
	if !(*v >= -2 && *v <= 2) {
		return 0, badRequest(name, "%s must be in [-2, 2], got %v.", name, *v)
	}
	return *v, nil
}

// logitBiasParam applies logit_bias: token ids (as strings) inside the vocabulary, biases
// clamped to [-100, 100].
func logitBiasParam(bias map[string]float64, vocab int, sp *model.SamplingParams) *APIError {
	if apiErr := checkCount("logit_bias", len(bias), vocab, "entries (the vocabulary's size)"); apiErr != nil {
		return apiErr
	}
	if len(bias) == 0 {
		return nil
	}
	sp.LogitBias = make(map[int32]float32, len(bias))
	var bad []int64
	for k, v := range bias {
		id, err := strconv.ParseInt(k, 10, 64)
		if err != nil {
			return badRequest("logit_bias", "Found token_id %q in logit_bias that is not an integer or string representing an integer.", k)
		}
		if id < 0 || id >= int64(vocab) {
			bad = append(bad, id)
			continue
		}
		// OpenAI and vLLM clamp a bias to [-100, 100].
		sp.LogitBias[int32(id)] = float32(max(-100, min(100, v)))
	}
	if len(bad) > 0 {
		slices.Sort(bad)
		more := ""
		if len(bad) > maxListedIDs {
			more = fmt.Sprintf(" (and %d more)", len(bad)-maxListedIDs)
			bad = bad[:maxListedIDs]
		}
		return badRequest("logit_bias", "token_id(s) %v%s in logit_bias contain out-of-vocab token ids. Vocabulary size: %d", bad, more, vocab)
	}
	return nil
}

// allowedTokensParam applies allowed_token_ids: when given, a non-empty list of ids inside the
// vocabulary.
func allowedTokensParam(ids []jsonInt, vocab int, sp *model.SamplingParams) *APIError {
	if ids == nil {
		return nil
	}
	if len(ids) == 0 {
		return badRequest("allowed_token_ids", "allowed_token_ids is not None and empty!")
	}
	if apiErr := checkCount("allowed_token_ids", len(ids), vocab, "ids (the vocabulary's size)"); apiErr != nil {
		return apiErr
	}
	sp.AllowedTokenIDs = make([]int32, 0, len(ids))
	for _, id := range ids {
		if id < 0 || int64(id) >= int64(vocab) {
			return badRequest("allowed_token_ids", "allowed_token_ids contains out-of-vocab token id!")
		}
		sp.AllowedTokenIDs = append(sp.AllowedTokenIDs, int32(id))
	}
	return nil
}

// lengthParams applies max_tokens (or max_completion_tokens, the newer name, which wins when
// both are given) and min_tokens.
func lengthParams(c *commonRequest, p *genParams) *APIError {
	maxTok, maxParam := c.MaxTokens, "max_tokens"
	if c.MaxCompletionTokens != nil {
		maxTok, maxParam = c.MaxCompletionTokens, "max_completion_tokens"
	}
	if maxTok != nil {
		if *maxTok < 1 {
			return badRequest(maxParam, "%s must be at least 1, got %d.", maxParam, *maxTok)
		}
		p.maxTokens = int(min(int64(*maxTok), math.MaxInt32))
	}
	if c.MinTokens != nil {
		if *c.MinTokens < 0 {
			return badRequest("min_tokens", "min_tokens must be greater than or equal to 0, got %d.", *c.MinTokens)
		}
		if p.maxTokens > 0 && int64(*c.MinTokens) > int64(p.maxTokens) {
			return badRequest("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.", p.maxTokens, *c.MinTokens)
		}
		p.minTokens = int(min(int64(*c.MinTokens), math.MaxInt32))
	}
	return nil
}

// samplingParams applies temperature, top_p and top_k over the model's generation defaults,
// and seed.
func (s *Server) samplingParams(c *commonRequest, sp *model.SamplingParams) *APIError {
	gen := s.model.Generation()
	sp.Temperature, sp.TopP, sp.TopK = gen.Temperature, gen.TopP, gen.TopK
	if c.Temperature != nil {
		t := *c.Temperature
		if t < 0 || math.IsNaN(t) || math.IsInf(t, 0) {
			return badRequest("temperature", "temperature must be non-negative, got %v.", t)
		}
		sp.Temperature = t
	}
	if sp.Temperature < greedyEpsilon {
		sp.Temperature = 0
	}
	if c.TopP != nil {
		tp := *c.TopP
		if !(tp > 0 && tp <= 1) {
			return badRequest("top_p", "top_p must be in (0, 1], got %v.", tp)
		}
		sp.TopP = tp
	}
	if c.TopK != nil {
		k := *c.TopK
		if k < -1 {
			return badRequest("top_k", "top_k must be 0 or -1 (disable), or at least 1, got %d.", k)
		}
		sp.TopK = int(max(min(k, math.MaxInt32), 0))
	}
	if c.Seed != nil {
		// The engine reads Seed 0 as "no seed"; an explicit seed 0 must still be reproducible.
		sp.Seed = int64(*c.Seed)
		if sp.Seed == 0 {
			sp.Seed = explicitSeedZero
		}
	}
	return nil
}

// stopParams applies stop (empty strings dropped), stop_token_ids and ignore_eos.
func stopParams(c *commonRequest, vocab int, p *genParams) *APIError {
	if c.Stop != nil {
		if apiErr := checkStops(*c.Stop); apiErr != nil {
			return apiErr
		}
		for _, st := range *c.Stop {
			if st != "" {
				p.stop = append(p.stop, st)
			}
		}
	}
	if apiErr := checkCount("stop_token_ids", len(c.StopTokenIDs), vocab, "ids (the vocabulary's size)"); apiErr != nil {
		return apiErr
	}
	for _, id := range c.StopTokenIDs {
		if id < 0 || int64(id) >= int64(vocab) {
			return badRequest("stop_token_ids", "Stop token id %d is out of vocabulary (size %d).", id, vocab)
		}
		p.stopTokenIDs = append(p.stopTokenIDs, int32(id))
	}
	p.ignoreEOS = c.IgnoreEOS != nil && *c.IgnoreEOS
	return nil
}

// streamParams applies stream and stream_options.
func streamParams(c *commonRequest, p *genParams) *APIError {
	p.stream = c.Stream != nil && *c.Stream
	// As vLLM's validate_stream_options: stream_options with a field set needs stream (an
	// empty object is falsy in Python, so {} passes).
	if so := c.StreamOptions; !p.stream && so != nil && (so.IncludeUsage != nil || so.ContinuousUsageStats != nil) {
		return badRequest("stream_options", "Stream options can only be defined when `stream=True`.")
	}
	if p.stream && c.StreamOptions != nil {
		p.streamOptions = true
		// As in vLLM, include_usage defaults to true once stream_options is given: {} asks for usage.
		p.includeUsage = c.StreamOptions.IncludeUsage == nil || *c.StreamOptions.IncludeUsage
		p.continuousUsage = p.includeUsage && c.StreamOptions.ContinuousUsageStats != nil && *c.StreamOptions.ContinuousUsageStats
	}
	return nil
}

// completionLogprobs applies completions' logprobs (an integer: how many alternatives) and, with
// echo, makes the prompt's logprobs default to the same count, as vLLM does.
func (s *Server) completionLogprobs(k *jsonInt, echo bool, vocab int, p *genParams) *APIError {
	if k == nil {
		return nil
	}
	if *k < -1 {
		return badRequest("logprobs", "`logprobs` must be a positive value or -1.")
	}
	if apiErr := s.checkNumLogprobs("logprobs", "sample", *k, vocab); apiErr != nil {
		return apiErr
	}
	p.logprobs, p.topLogprobs = true, int(*k)
	if echo && !p.promptLogprobs {
		if apiErr := s.checkNumLogprobs("logprobs", "prompt", *k, vocab); apiErr != nil {
			return apiErr
		}
		p.promptLogprobs, p.topPromptLogprobs = true, int(*k)
	}
	return nil
}

// chatLogprobs applies chat's logprobs (a boolean) and top_logprobs.
func (s *Server) chatLogprobs(on *bool, top *jsonInt, vocab int, p *genParams) *APIError {
	enabled := on != nil && *on
	if top != nil {
		if *top < -1 {
			return badRequest("top_logprobs", "`top_logprobs` must be a positive value or -1.")
		}
		if *top != 0 && !enabled {
			return badRequest("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.")
		}
	}
	if !enabled {
		return nil
	}
	var k jsonInt
	if top != nil {
		k = *top
	}
	if apiErr := s.checkNumLogprobs("top_logprobs", "sample", k, vocab); apiErr != nil {
		return apiErr
	}
	p.logprobs, p.topLogprobs = true, int(k)
	return nil
}

// checkNumLogprobs checks a logprobs count against --max-logprobs (−1 means the vocabulary).
func (s *Server) checkNumLogprobs(param, kind string, k jsonInt, vocab int) *APIError {
	n := int64(k)
	if n == -1 {
		n = int64(vocab)
	}
	limit := int64(s.cfg.MaxLogprobs)
	if limit == -1 {
		limit = int64(vocab)
	}
	if n > limit {
		return badRequest(param, "Requested %s logprobs of %d, which is greater than max allowed: %d", kind, n, limit)
	}
	return nil
}

// badWords tokenizes bad_words as vLLM does: each word as written (leading spaces stripped)
// and, when that makes a different first token of the same length, with a leading space, so
// that it is banned at the start of the text and after a space. More than maxBadWords words, or
// encodings of more than maxBadWordTokens tokens in all, are refused.
func (s *Server) badWords(words []string) ([][]int32, *APIError) {
	if len(words) > maxBadWords {
		return nil, badRequest("bad_words", "bad_words may hold at most %d words, got %d.", maxBadWords, len(words))
	}
	tok := s.model.Tokenizer()
	var out [][]int32
	total := 0
	for _, w := range words {
		w = strings.TrimLeftFunc(w, unicode.IsSpace)
		plain := tok.Encode(w)
		if len(plain) == 0 {
			continue
		}
		out = append(out, plain)
		total += len(plain)
		if spaced := tok.Encode(" " + w); len(spaced) == len(plain) && spaced[0] != plain[0] {
			out = append(out, spaced)
			total += len(spaced)
		}
		if total > maxBadWordTokens {
			return nil, badRequest("bad_words", "bad_words may encode to at most %d tokens in all (leading-space variants included).", maxBadWordTokens)
		}
	}
	return out, nil
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
