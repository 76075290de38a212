package openai

import (
	"net/http"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// tokenizeRequest is the body of POST /tokenize: vLLM's TokenizeCompletionRequest (prompt) or
// TokenizeChatRequest (messages).
type tokenizeRequest struct {
	// chatTemplateFields turn messages into ids exactly as a chat completion does; of them, a
	// prompt reads only add_special_tokens.
	chatTemplateFields
	Model           *string         `json:"model"`
	Prompt          *string         `json:"prompt"`
	Messages        []chatMessageIn `json:"messages"`
	ReturnTokenStrs bool            `json:"return_token_strs"`
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
// add_special_tokens, the default); messages are rendered and encoded by the chat completion's
// own code with the same chat template fields (chat_template_kwargs, add_generation_prompt,
// continue_final_message, add_special_tokens defaulting to false). Either way the count is the
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
	var ids []int32
	switch {
	case req.Messages != nil:
		var apiErr *APIError
		if ids, _, apiErr = s.chatPrompt(req.Messages, req.chatTemplateFields); apiErr != nil {
			writeError(w, apiErr)
			return
		}
	case req.Prompt != nil:
		if apiErr := s.checkPromptBytes("prompt", len(*req.Prompt)); apiErr != nil {
			writeError(w, apiErr)
			return
		}
		if req.AddSpecialTokens == nil || *req.AddSpecialTokens {
			ids = tok.EncodeSpecial(*req.Prompt) // as completionPrompt encodes
		} else {
			ids = tok.Encode(*req.Prompt)
		}
	default:
		writeError(w, badRequest("prompt", "Either prompt or messages must be given."))
		return
	}
	if len(ids) > s.cfg.MaxModelLen {
		param := "prompt"
		if req.Messages != nil {
			param = "messages"
		}
		writeError(w, badRequest(param, "This model's maximum context length is %d tokens, and /tokenize counts no more; the text has %d tokens.", s.cfg.MaxModelLen, len(ids)))
		return
	}
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
	if len(req.Tokens) > s.cfg.MaxModelLen {
		writeError(w, badRequest("tokens", "tokens may hold at most max_model_len = %d ids, got %d.", s.cfg.MaxModelLen, len(req.Tokens)))
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
		apiErr = s.decode(body, v)
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
