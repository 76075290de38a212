package openai

import (
	"bytes"
	"fmt"
	"net/http"
	"time"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// chatJob decodes and validates a chat request, renders its messages with the chat template
// and builds its job.
func (s *Server) chatJob(w http.ResponseWriter, r *http.Request, body []byte) (*job, *APIError) {
	var req chatRequest
	if apiErr := decodeJSON(body, &req); apiErr != nil {
		return nil, apiErr
	}
	if apiErr := s.checkModel(req.Model); apiErr != nil {
		return nil, apiErr
	}
	if req.Echo != nil && *req.Echo {
		return nil, unsupported("echo", "echo on chat completions")
	}
	if t := bytes.TrimSpace(req.Tools); len(t) > 0 && !bytes.Equal(t, []byte("null")) && !bytes.Equal(t, []byte("[]")) {
		return nil, unsupported("tools", "tool calling")
	}
	tok := s.model.Tokenizer()
	p, apiErr := s.params(&req.commonRequest, tok.VocabSize())
	if apiErr != nil {
		return nil, apiErr
	}
	if apiErr := s.chatLogprobs(req.Logprobs, req.TopLogprobs, tok.VocabSize(), &p); apiErr != nil {
		return nil, apiErr
	}
	text, apiErr := s.renderMessages(req.Messages, req.AddGenerationPrompt)
	if apiErr != nil {
		return nil, apiErr
	}
	prompt := tok.Encode(text)
	if apiErr := s.fitPrompt(&p, len(prompt), "messages"); apiErr != nil {
		return nil, apiErr
	}
	base := baseRequestID(w, r, req.RequestID)
	return &job{
		chat:    true,
		id:      "chatcmpl-" + base,
		created: time.Now().Unix(),
		model:   s.responseModel(),
		prompt:  prompt,
		p:       p,
		reqs:    s.engineRequests("chatcmpl-"+base, prompt, p),
	}, nil
}

// renderMessages checks the request messages and renders them with the chat template
// (add_generation_prompt defaults to true).
func (s *Server) renderMessages(in []chatMessageIn, addGeneration *bool) (string, *APIError) {
	if len(in) == 0 {
		return "", badRequest("messages", "The messages field must be a non-empty list.")
	}
	msgs := make([]tokenizer.Message, len(in))
	for i, m := range in {
		if m.Role == nil || *m.Role == "" {
			return "", badRequest("messages", "messages[%d] has no role.", i)
		}
		msgs[i] = tokenizer.Message{Role: *m.Role, Content: m.Content.text}
	}
	text, err := renderChat(s.model.ChatTemplate(), msgs, addGeneration == nil || *addGeneration)
	if err != nil {
		return "", badRequest("messages", "The chat template could not render the messages: %v", err)
	}
	return text, nil
}

// renderChat renders msgs, turning a panic inside the template engine into an error.
func renderChat(t tokenizer.ChatTemplate, msgs []tokenizer.Message, addGen bool) (text string, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("template panicked: %v", v)
		}
	}()
	return t.Render(msgs, addGen)
}
