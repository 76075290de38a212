package openai

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// handleChat serves POST /v1/chat/completions.
func (s *Server) handleChat(w http.ResponseWriter, r *http.Request) {
	body, apiErr := s.readBody(w, r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	var req chatRequest
	if apiErr := decodeJSON(body, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	j, apiErr := s.chatJob(w, r, &req)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	s.serve(w, r, j)
}

// chatJob validates a chat request, renders its messages with the chat template and builds
// its job.
func (s *Server) chatJob(w http.ResponseWriter, r *http.Request, req *chatRequest) (*job, *APIError) {
	if apiErr := s.checkModel(req.Model); apiErr != nil {
		return nil, apiErr
	}
	if req.Logprobs != nil && *req.Logprobs {
		return nil, unsupported("logprobs", "logprobs")
	}
	if req.TopLogprobs != nil && *req.TopLogprobs > 0 {
		return nil, unsupported("top_logprobs", "top_logprobs")
	}
	if t := bytes.TrimSpace(req.Tools); len(t) > 0 && !bytes.Equal(t, []byte("null")) && !bytes.Equal(t, []byte("[]")) {
		return nil, unsupported("tools", "tool calling")
	}
	tok := s.model.Tokenizer()
	p, apiErr := s.params(&req.commonRequest, tok.VocabSize())
	if apiErr != nil {
		return nil, apiErr
	}
	if len(req.Messages) == 0 {
		return nil, badRequest("messages", "The messages field must be a non-empty list.")
	}
	msgs := make([]tokenizer.Message, len(req.Messages))
	for i, m := range req.Messages {
		if m.Role == nil || *m.Role == "" {
			return nil, badRequest("messages", "messages[%d] has no role.", i)
		}
		msgs[i] = tokenizer.Message{Role: *m.Role, Content: m.Content.text}
	}
	opts := tokenizer.RenderOptions{
		AddGenerationPrompt:  req.AddGenerationPrompt == nil || *req.AddGenerationPrompt,
		ContinueFinalMessage: req.ContinueFinalMessage != nil && *req.ContinueFinalMessage,
		Kwargs:               req.ChatTemplateKwargs,
	}
	if opts.ContinueFinalMessage && req.AddGenerationPrompt == nil {
		opts.AddGenerationPrompt = false // vLLM: continuing a message replaces the generation prompt
	}
	text, err := renderChat(s.model.ChatTemplate(), msgs, opts)
	switch {
	case errors.Is(err, tokenizer.ErrBadRenderOptions):
		return nil, badRequest("continue_final_message", "%v", err)
	case err != nil:
		return nil, badRequest("messages", "The chat template could not render the messages: %v", err)
	}
	prompt := tok.Encode(text)
	if req.AddSpecialTokens != nil && *req.AddSpecialTokens {
		prompt = tok.EncodeSpecial(text)
	}
	if apiErr := s.fitPrompt(&p, len(prompt), "messages"); apiErr != nil {
		return nil, apiErr
	}
	base := baseRequestID(w, r, req.RequestID)
	j := &job{
		chat:    true,
		id:      "chatcmpl-" + base,
		created: time.Now().Unix(),
		model:   s.responseModel(),
		p:       p,
		req:     s.engineRequest(engineID("chatcmpl-"+base), prompt, p),
	}
	if last := msgs[len(msgs)-1]; req.Echo != nil && *req.Echo && last.Role == "assistant" {
		j.echo = last.Content
	}
	return j, nil
}

// renderChat renders msgs, turning a panic inside the template engine into an error.
func renderChat(t tokenizer.ChatTemplate, msgs []tokenizer.Message, opts tokenizer.RenderOptions) (text string, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("template panicked: %v", v)
		}
	}()
	return t.Render(msgs, opts)
}
