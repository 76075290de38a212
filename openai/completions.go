package openai

import (
	"encoding/json"
	"net/http"
	"time"
)

// completionJob decodes and validates a completion request and builds its job.
func (s *Server) completionJob(w http.ResponseWriter, r *http.Request, body []byte) (*job, *APIError) {
	var req completionRequest
	if apiErr := s.decode(body, &req); apiErr != nil {
		return nil, apiErr
	}
	if apiErr := s.checkModel(req.Model); apiErr != nil {
		return nil, apiErr
	}
	if req.Suffix != nil && *req.Suffix != "" {
		return nil, unsupported("suffix", "suffix")
	}
	tok := s.model.Tokenizer()
	echo := req.Echo != nil && *req.Echo
	// echo with max_tokens 0 returns the prompt alone (the engine still generates one token).
	noGeneration := echo && req.MaxTokens != nil && *req.MaxTokens == 0 && req.MaxCompletionTokens == nil
	if noGeneration {
		one := jsonInt(1)
		req.MaxTokens = &one
	}
	p, apiErr := s.params(&req.commonRequest, tok.VocabSize())
	if apiErr != nil {
		return nil, apiErr
	}
	if apiErr := s.completionLogprobs(req.Logprobs, echo, tok.VocabSize(), &p); apiErr != nil {
		return nil, apiErr
	}
	prompt, text, apiErr := s.completionPrompt(req.Prompt, req.AddSpecialTokens == nil || *req.AddSpecialTokens)
	if apiErr != nil {
		return nil, apiErr
	}
	if apiErr := s.fitPrompt(&p, len(prompt), "prompt"); apiErr != nil {
		return nil, apiErr
	}
	base := baseRequestID(w, r, req.RequestID)
	j := &job{
		id:           "cmpl-" + base,
		created:      time.Now().Unix(),
		model:        s.responseModel(),
		prompt:       prompt,
		p:            p,
		reqs:         s.engineRequests("cmpl-"+base+"-0", prompt, p),
		echo:         echo,
		noGeneration: noGeneration,
	}
	if echo {
		j.echoText = text()
	}
	return j, nil
}

// completionPrompt tokenizes the prompt field: a string, a list of one string, a list of token
// ids, or a list of one list of token ids. A text prompt gets the tokenizer's special tokens
// (its BOS) when special is set, as vLLM's add_special_tokens; token ids are taken as they are.
// text returns the prompt's text (for echo).
func (s *Server) completionPrompt(raw json.RawMessage, special bool) (ids []int32, text func() string, apiErr *APIError) {
	tok := s.model.Tokenizer()
	fromString := func(str string) ([]int32, func() string, *APIError) {
		if apiErr := s.checkPromptBytes("prompt", len(str)); apiErr != nil {
			return nil, nil, apiErr
		}
		if special {
			return tok.EncodeSpecial(str), func() string { return str }, nil
		}
		return tok.Encode(str), func() string { return str }, nil
	}
	switch jsonKind(raw) {
	case "nothing", "null":
		return nil, nil, badRequest("prompt", "The prompt field is required.")
	case "a string":
		var str string
		if err := json.Unmarshal(raw, &str); err != nil {
			return nil, nil, badRequest("prompt", "Invalid prompt string: %v", err)
		}
		return fromString(str)
	case "an array":
	default:
		return nil, nil, badRequest("prompt", "The prompt must be a string, a list of strings or a list of token ids, got %s.", jsonKind(raw))
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, nil, badRequest("prompt", "Invalid prompt list: %v", err)
	}
	if len(items) == 0 {
		return nil, nil, badRequest("prompt", "The prompt is empty; at least one token is needed.")
	}
	switch jsonKind(items[0]) {
	case "a string", "an array":
		if len(items) > 1 {
			return nil, nil, unsupported("prompt", "a batch of several prompts in one request")
		}
		if jsonKind(items[0]) == "a string" {
			var str string
			if err := json.Unmarshal(items[0], &str); err != nil {
				return nil, nil, badRequest("prompt", "Invalid prompt string: %v", err)
			}
			return fromString(str)
		}
		raw = items[0]
	}
	var toks []jsonInt
	if err := json.Unmarshal(raw, &toks); err != nil {
		return nil, nil, badRequest("prompt", "The prompt must be a string, a list of strings or a list of token ids.")
	}
	vocab := tok.VocabSize()
	ids = make([]int32, len(toks))
	for i, t := range toks {
		if t < 0 || int64(t) >= int64(vocab) {
			return nil, nil, badRequest("prompt", "Token id %d is out of vocabulary (size %d).", t, vocab)
		}
		ids[i] = int32(t)
	}
	return ids, func() string { return tok.Decode(ids) }, nil
}
