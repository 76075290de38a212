package openai

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// chatJob decodes and validates a chat request, renders its messages with the chat template
// and builds its job.
func (s *Server) chatJob(w http.ResponseWriter, r *http.Request, body []byte) (*job, *APIError) {
	var req chatRequest
	if apiErr := s.decode(body, &req); apiErr != nil {
		return nil, apiErr
	}
	if apiErr := s.checkModel(req.Model); apiErr != nil {
		return nil, apiErr
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
	text, msgs, apiErr := s.renderMessages(req.Messages, chatOptions{
		addGeneration: req.AddGenerationPrompt, continueFinal: req.ContinueFinalMessage, kwargs: req.ChatTemplateKwargs})
	if apiErr != nil {
		return nil, apiErr
	}
	encode := tok.Encode
	if req.AddSpecialTokens != nil && *req.AddSpecialTokens {
		encode = tok.EncodeSpecial
	}
	if apiErr := s.checkPromptBytes("messages", len(text)); apiErr != nil {
		return nil, apiErr
	}
	prompt := encode(text)
	if apiErr := s.fitPrompt(&p, len(prompt), "messages"); apiErr != nil {
		return nil, apiErr
	}
	base := baseRequestID(w, r, req.RequestID)
	j := &job{
		chat:    true,
		id:      "chatcmpl-" + base,
		created: time.Now().Unix(),
		model:   s.responseModel(),
		prompt:  prompt,
		p:       p,
		reqs:    s.engineRequests("chatcmpl-"+base, prompt, p),
	}
	if last := msgs[len(msgs)-1]; req.Echo != nil && *req.Echo && last.Role == "assistant" {
		j.chatEcho = last.Content // vLLM echoes a final assistant message before each answer
	}
	return j, nil
}

// chatOptions are a request's chat template options.
type chatOptions struct {
	addGeneration, continueFinal *bool // add_generation_prompt (default true), continue_final_message
	kwargs                       map[string]any
}

// renderMessages checks the request messages and renders them with the chat template.
func (s *Server) renderMessages(in []chatMessageIn, o chatOptions) (string, []tokenizer.Message, *APIError) {
	if len(in) == 0 {
		return "", nil, badRequest("messages", "The messages field must be a non-empty list.")
	}
	msgs := make([]tokenizer.Message, len(in))
	for i, m := range in {
		if m.Role == nil || *m.Role == "" {
			return "", nil, badRequest("messages", "messages[%d] has no role.", i)
		}
		msgs[i] = tokenizer.Message{Role: *m.Role, Content: m.Content.text}
	}
	opts := tokenizer.RenderOptions{
		AddGenerationPrompt:  o.addGeneration == nil || *o.addGeneration,
		ContinueFinalMessage: o.continueFinal != nil && *o.continueFinal,
		Kwargs:               o.kwargs,
	}
	if opts.ContinueFinalMessage && o.addGeneration == nil {
		opts.AddGenerationPrompt = false // vLLM: continuing a message replaces the generation prompt
	}
	text, err := renderChat(s.model.ChatTemplate(), msgs, opts)
	switch {
	case errors.Is(err, tokenizer.ErrBadRenderOptions):
		return "", nil, badRequest("continue_final_message", "%v", err)
	case err != nil:
		return "", nil, badRequest("messages", "The chat template could not render the messages: %v", err)
	}
	return text, msgs, nil
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
