package openai

import (
	"bytes"
	"encoding/json"
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
	tok := s.model.Tokenizer()
	p, apiErr := s.params(&req.commonRequest, tok.VocabSize())
	if apiErr != nil {
		return nil, apiErr
	}
	if apiErr := s.chatLogprobs(req.Logprobs, req.TopLogprobs, tok.VocabSize(), &p); apiErr != nil {
		return nil, apiErr
	}
	prompt, msgs, apiErr := s.chatPrompt(req.Messages, req.chatTemplateFields)
	if apiErr != nil {
		return nil, apiErr
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
		prompt:  prompt,
		p:       p,
		reqs:    s.engineRequests("chatcmpl-"+base, prompt, p),
	}
	if last := msgs[len(msgs)-1]; req.Echo != nil && *req.Echo && last.Role == "assistant" {
		j.chatEcho = last.Content // vLLM echoes a final assistant message before each answer
	}
	return j, nil
}

// chatTemplateFields are the fields of a request with messages that decide its prompt: vLLM's
// chat template options, shared by chat completions and /tokenize (ChatCompletionRequest and
// TokenizeChatRequest) so that /tokenize gives exactly the ids a chat completion would compute.
type chatTemplateFields struct {
	// AddGenerationPrompt defaults to true, unless ContinueFinalMessage: continuing a message
	// replaces the generation prompt.
	AddGenerationPrompt  *bool          `json:"add_generation_prompt"`
	ContinueFinalMessage *bool          `json:"continue_final_message"`
	ChatTemplateKwargs   map[string]any `json:"chat_template_kwargs"`
	// AddSpecialTokens (default false: the template writes the special tokens) adds the
	// tokenizer's post-processor tokens around the rendered text.
	AddSpecialTokens *bool `json:"add_special_tokens"`
	// ChatTemplate is refused, as vLLM refuses it without --trust-request-chat-template: the
	// model's template (or --chat-template) renders every request.
	ChatTemplate json.RawMessage `json:"chat_template"`
	// Tools are refused unless empty: kvbridge has no tool calling.
	Tools json.RawMessage `json:"tools"`
}

// chatPrompt checks the request messages, renders them with the chat template and encodes the
// text: the prompt of a chat completion, and the ids /tokenize returns for messages.
func (s *Server) chatPrompt(in []chatMessageIn, f chatTemplateFields) ([]int32, []tokenizer.Message, *APIError) {
	if given(f.Tools) {
		return nil, nil, unsupported("tools", "tool calling")
	}
	if given(f.ChatTemplate) {
		return nil, nil, badRequest("chat_template", "A chat template in the request is refused (as vLLM refuses it without --trust-request-chat-template); start the server with --chat-template instead.")
	}
	if len(in) == 0 {
		return nil, nil, badRequest("messages", "The messages field must be a non-empty list.")
	}
	msgs := make([]tokenizer.Message, len(in))
	for i, m := range in {
		if m.Role == nil || *m.Role == "" {
			return nil, nil, badRequest("messages", "messages[%d] has no role.", i)
		}
		msgs[i] = tokenizer.Message{Role: *m.Role, Content: m.Content.text}
	}
	opts := tokenizer.RenderOptions{
		AddGenerationPrompt:  f.AddGenerationPrompt == nil || *f.AddGenerationPrompt,
		ContinueFinalMessage: f.ContinueFinalMessage != nil && *f.ContinueFinalMessage,
		Kwargs:               f.ChatTemplateKwargs,
	}
	if opts.ContinueFinalMessage && f.AddGenerationPrompt == nil {
		opts.AddGenerationPrompt = false // vLLM: continuing a message replaces the generation prompt
	}
	text, err := renderChat(s.model.ChatTemplate(), msgs, opts)
	switch {
	case errors.Is(err, tokenizer.ErrBadRenderOptions):
		return nil, nil, badRequest("continue_final_message", "%v", err)
	case err != nil:
		return nil, nil, badRequest("messages", "The chat template could not render the messages: %v", err)
	}
	if apiErr := s.checkPromptBytes("messages", len(text)); apiErr != nil {
		return nil, nil, apiErr
	}
	tok := s.model.Tokenizer()
	if f.AddSpecialTokens != nil && *f.AddSpecialTokens {
		return tok.EncodeSpecial(text), msgs, nil
	}
	return tok.Encode(text), msgs, nil
}

// given reports whether an optional JSON field holds something other than null or an empty list.
func given(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) > 0 && !bytes.Equal(t, []byte("null")) && !bytes.Equal(t, []byte("[]"))
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
