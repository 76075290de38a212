package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
)

// jsonInt is an integer request field. Like pydantic's lax mode it also accepts integral floats
// (1.0, 1e3); other values are a type error.
type jsonInt int64

// UnmarshalJSON implements json.Unmarshaler.
func (i *jsonInt) UnmarshalJSON(b []byte) error {
	s := string(b)
	if s == "" || (s[0] != '-' && (s[0] < '0' || s[0] > '9')) {
		return typeError(b, reflect.TypeFor[jsonInt]())
	}
	if v, err := strconv.ParseInt(s, 10, 64); err == nil {
		*i = jsonInt(v)
		return nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return &json.UnmarshalTypeError{Value: "number " + s, Type: reflect.TypeFor[jsonInt]()}
	}
	*i = jsonInt(f)
	return nil
}

// stringList is a field that is a string or a list of strings (stop).
type stringList []string

// UnmarshalJSON implements json.Unmarshaler.
func (l *stringList) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		*l = stringList{s}
		return nil
	}
	var ss []string
	if err := json.Unmarshal(b, &ss); err != nil {
		return typeError(b, reflect.TypeFor[stringList]())
	}
	*l = ss
	return nil
}

// typeError is a custom field decoder's type error. encoding/json fills in the field name of a
// *json.UnmarshalTypeError returned by an UnmarshalJSON method.
func typeError(b []byte, t reflect.Type) error {
	return &json.UnmarshalTypeError{Value: strings.TrimPrefix(strings.TrimPrefix(jsonKind(b), "a "), "an "), Type: t}
}

// jsonKind names the JSON type of a raw value for error messages.
func jsonKind(b []byte) string {
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		return "nothing"
	}
	switch b[0] {
	case '"':
		return "a string"
	case '{':
		return "an object"
	case '[':
		return "an array"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "a number"
}

// streamOptions is OpenAI's stream_options.
type streamOptions struct {
	IncludeUsage         *bool `json:"include_usage"`
	ContinuousUsageStats *bool `json:"continuous_usage_stats"`
}

// responseFormat is OpenAI's response_format; only {"type":"text"} is supported.
type responseFormat struct {
	Type string `json:"type"`
}

// commonRequest holds the fields shared by completion and chat requests. Unknown fields are
// ignored, as vLLM does by default.
type commonRequest struct {
	Model               *string            `json:"model"`
	MaxTokens           *jsonInt           `json:"max_tokens"`
	MaxCompletionTokens *jsonInt           `json:"max_completion_tokens"`
	MinTokens           *jsonInt           `json:"min_tokens"`
	Temperature         *float64           `json:"temperature"`
	TopP                *float64           `json:"top_p"`
	TopK                *jsonInt           `json:"top_k"`
	MinP                *float64           `json:"min_p"`
	Seed                *jsonInt           `json:"seed"`
	Stop                *stringList        `json:"stop"`
	StopTokenIDs        []jsonInt          `json:"stop_token_ids"`
	IgnoreEOS           *bool              `json:"ignore_eos"`
	N                   *jsonInt           `json:"n"`
	BestOf              *jsonInt           `json:"best_of"`
	UseBeamSearch       *bool              `json:"use_beam_search"`
	Stream              *bool              `json:"stream"`
	StreamOptions       *streamOptions     `json:"stream_options"`
	PresencePenalty     *float64           `json:"presence_penalty"`
	FrequencyPenalty    *float64           `json:"frequency_penalty"`
	RepetitionPenalty   *float64           `json:"repetition_penalty"`
	LogitBias           map[string]float64 `json:"logit_bias"`
	AllowedTokenIDs     []jsonInt          `json:"allowed_token_ids"`
	BadWords            []string           `json:"bad_words"`
	PromptLogprobs      *jsonInt           `json:"prompt_logprobs"`
	ResponseFormat      *responseFormat    `json:"response_format"`
	User                *string            `json:"user"`
	RequestID           *string            `json:"request_id"`
	// KVTransferParams is vLLM's kv_transfer_params: an object, passed to the engine as is.
	KVTransferParams map[string]any `json:"kv_transfer_params"`
}

// completionRequest is the body of POST /v1/completions.
type completionRequest struct {
	commonRequest
	Prompt json.RawMessage `json:"prompt"`
	// AddSpecialTokens (vLLM's add_special_tokens, default true) adds the special tokens the
	// tokenizer's post-processor puts around a text prompt (Llama's BOS).
	AddSpecialTokens *bool    `json:"add_special_tokens"`
	Echo             *bool    `json:"echo"`
	Logprobs         *jsonInt `json:"logprobs"`
	Suffix           *string  `json:"suffix"`
}

// chatRequest is the body of POST /v1/chat/completions.
type chatRequest struct {
	commonRequest
	chatTemplateFields
	Messages    []chatMessageIn `json:"messages"`
	Logprobs    *bool           `json:"logprobs"`
	TopLogprobs *jsonInt        `json:"top_logprobs"`
	// Echo prefixes the response with the final message's content when that message is the
	// assistant's (with continue_final_message, the whole assistant turn).
	Echo *bool `json:"echo"`
}

// chatMessageIn is one request message. Content is a string, null, or a list of content parts
// of which only text parts are supported.
type chatMessageIn struct {
	Role    *string        `json:"role"`
	Content messageContent `json:"content"`
}

// messageContent is a message's text after joining its text parts with "\n" (as vLLM does).
type messageContent struct{ text string }

// contentPart is one element of a content-part array.
type contentPart struct {
	Type string  `json:"type"`
	Text *string `json:"text"`
}

// UnmarshalJSON implements json.Unmarshaler.
func (c *messageContent) UnmarshalJSON(b []byte) error {
	switch jsonKind(b) {
	case "null":
		c.text = ""
		return nil
	case "a string":
		return json.Unmarshal(b, &c.text)
	case "an array":
		var parts []contentPart
		if err := json.Unmarshal(b, &parts); err != nil {
			return typeError(b, reflect.TypeFor[messageContent]())
		}
		texts := make([]string, 0, len(parts))
		for _, p := range parts {
			if p.Type != "text" {
				return errUnsupportedPart{p.Type}
			}
			if p.Text == nil {
				return typeError([]byte("null"), reflect.TypeFor[messageContent]())
			}
			texts = append(texts, *p.Text)
		}
		c.text = strings.Join(texts, "\n")
		return nil
	}
	return typeError(b, reflect.TypeFor[messageContent]())
}

// errUnsupportedPart reports a content part kvbridge cannot handle (images, audio, …).
type errUnsupportedPart struct{ typ string }

func (e errUnsupportedPart) Error() string {
	return fmt.Sprintf("content part type %q is not supported (only \"text\")", e.typ)
}

// decodeJSON decodes a request body into v, turning every failure into a 400 APIError.
func decodeJSON(body []byte, v any) *APIError {
	if len(bytes.TrimSpace(body)) == 0 {
		return badRequest("", "The request body is empty; expected a JSON object.")
	}
	if jsonKind(body) != "an object" {
		return badRequest("", "The request body must be a JSON object, got %s.", jsonKind(body))
	}
	err := json.Unmarshal(body, v)
	if err == nil {
		return nil
	}
	var (
		syn  *json.SyntaxError
		typ  *json.UnmarshalTypeError
		part errUnsupportedPart
	)
	switch {
	case errors.As(err, &syn):
		return badRequest("", "Invalid JSON in request body at offset %d: %v", syn.Offset, syn)
	case errors.As(err, &typ):
		field := strings.NewReplacer("commonRequest.", "", "chatTemplateFields.", "").Replace(typ.Field)
		if field == "" {
			field = "request"
		}
		return badRequest(field, "Invalid type for `%s`: got JSON %s, expected %s.", field, typ.Value, goTypeName(typ.Type.String()))
	case errors.As(err, &part):
		return badRequest("messages", "%v", part)
	}
	return badRequest("", "Invalid request body: %v", err)
}

// goTypeName turns a Go type into a JSON-ish name for messages.
func goTypeName(t string) string {
	switch t {
	case "openai.jsonInt":
		return "an integer"
	case "openai.stringList":
		return "a string or a list of strings"
	case "openai.messageContent":
		return "a string or a list of text content parts"
	}
	switch {
	case strings.HasPrefix(t, "map["), strings.HasPrefix(t, "openai."):
		return "an object"
	case strings.HasPrefix(t, "[]"):
		return "an array"
	case t == "string":
		return "a string"
	case t == "bool":
		return "a boolean"
	case strings.HasPrefix(t, "float"), strings.HasPrefix(t, "int"):
		return "a number"
	}
	return t
}
