package openai

import (
	"net/http"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// tokenizeRequest is the body of POST /tokenize: vLLM's TokenizeCompletionRequest (prompt) or
// TokenizeChatRequest (messages).
type tokenizeRequest struct {
	Model               *string         `json:"model"`
	Prompt              *string         `json:"prompt"`
	Messages            []chatMessageIn `json:"messages"`
	AddSpecialTokens    *bool           `json:"add_special_tokens"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	ReturnTokenStrs     bool            `json:"return_token_strs"`
}

// tokenizeResponse is vLLM's TokenizeResponse.
type tokenizeResponse struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []int32  `json:"tokens"`
	TokenStrs   []string `json:"token_strs"`
}

// detokenizeRequest is the body of POST /detokenize.
type detokenizeRequest struct {
	Model  *string   `json:"model"`
	Tokens []jsonInt `json:"tokens"`
}

// handleTokenize serves POST /tokenize: a prompt is encoded as a completion prompt (with the
// tokenizer's special tokens — its post-processor's BOS, EOS or separators — when
// add_special_tokens, the default); messages are rendered with the chat template and encoded as
// a chat request's are (add_special_tokens defaults to false). Either way the count is the
// request's prompt_tokens. It takes a concurrency slot while it works (429 when none is free).
func (s *Server) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var req tokenizeRequest
	if !s.readRequest(w, r, &req, func() *string { return req.Model }) {
		return
	}
	release, ok := s.takeSlot(w)
	if !ok {
		return
	}
	defer release()
	tok := s.model.Tokenizer()
	var (
		text       string
		addSpecial bool
		apiErr     *APIError
	)
	switch {
	case req.Messages != nil:
		if text, _, apiErr = s.renderMessages(req.Messages, chatOptions{addGeneration: req.AddGenerationPrompt}); apiErr != nil {
			writeError(w, apiErr)
			return
		}
		addSpecial = req.AddSpecialTokens != nil && *req.AddSpecialTokens
	case req.Prompt != nil:
		text = *req.Prompt
		addSpecial = req.AddSpecialTokens == nil || *req.AddSpecialTokens
	default:
		writeError(w, badRequest("prompt", "Either prompt or messages must be given."))
		return
	}
	encode := tok.Encode
	if addSpecial {
		encode = tok.EncodeSpecial // as completionPrompt and chatJob encode
	}
	ids := encode(text)
	resp := tokenizeResponse{Count: len(ids), MaxModelLen: s.cfg.MaxModelLen, Tokens: ids}
	if req.ReturnTokenStrs {
		resp.TokenStrs = tok.TokenStrings(ids)
	}
	writeJSON(w, http.StatusOK, resp)
}

// handleDetokenize serves POST /detokenize: {"prompt": the text of the tokens}, special tokens
// included. It takes a concurrency slot while it works (429 when none is free).
func (s *Server) handleDetokenize(w http.ResponseWriter, r *http.Request) {
	var req detokenizeRequest
	if !s.readRequest(w, r, &req, func() *string { return req.Model }) {
		return
	}
	release, ok := s.takeSlot(w)
	if !ok {
		return
	}
	defer release()
	tok := s.model.Tokenizer()
	ids, apiErr := tokenIDs(tok, req.Tokens)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"prompt": tok.Decode(ids)})
}

// tokenIDs checks request token ids against the vocabulary.
func tokenIDs(tok *tokenizer.Tokenizer, in []jsonInt) ([]int32, *APIError) {
	ids := make([]int32, len(in))
	for i, t := range in {
		if t < 0 || int64(t) >= int64(tok.VocabSize()) {
			return nil, badRequest("tokens", "Token id %d is out of vocabulary (size %d).", t, tok.VocabSize())
		}
		ids[i] = int32(t)
	}
	return ids, nil
}

// readRequest reads and decodes a JSON body into v and checks the model it names (model is
// called after decoding); it answers the error itself and reports whether to go on.
func (s *Server) readRequest(w http.ResponseWriter, r *http.Request, v any, model func() *string) bool {
	body, apiErr := s.readBody(w, r)
	if apiErr == nil {
		apiErr = decodeJSON(body, v)
	}
	if apiErr == nil {
		apiErr = s.checkModel(model())
	}
	if apiErr != nil {
		writeError(w, apiErr)
		return false
	}
	return true
}
