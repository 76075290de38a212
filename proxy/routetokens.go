package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"
)

// The prompt's tokens, for hashing its blocks: a completion's token-id prompt as it is, anything
// else from a prefiller's POST /tokenize (vLLM's route, which kvbridge serve has too), under
// RoutingConfig.TokenizeTimeout. A failure is never the request's: it is routed without KV.

// maxTokenizeAnswer bounds the /tokenize answer the proxy reads.
const maxTokenizeAnswer = 64 << 20

// tokenizeFields are the keys of a chat completion /tokenize renders alike (vLLM's
// TokenizeChatRequest).
var tokenizeFields = []string{"model", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "add_special_tokens", "chat_template", "tools", "documents", "mm_processor_kwargs"}

// errNoPrompt is a request whose prompt the router cannot tokenize (none, or a shape it does not
// know); the request itself goes on, and the engine judges it.
var errNoPrompt = errors.New("no prompt to tokenize")

// promptTokens returns the tokens of b's prompt (the first prompt of a batch), asking inst's
// /tokenize when they are not in the body.
func (l *legs) promptTokens(ctx context.Context, inst Instance, path, reqID string, hdr http.Header, b body, timeout time.Duration) ([]int32, error) {
	tb := body{}
	if path == "/v1/chat/completions" {
		if _, ok := b["messages"].([]any); !ok {
			return nil, errNoPrompt
		}
		tb["messages"] = b["messages"]
		for _, k := range tokenizeFields {
			if v, ok := b[k]; ok {
				tb[k] = v
			}
		}
	} else {
		p := b["prompt"]
		if list, ok := p.([]any); ok && len(list) > 0 {
			if ids, ok := tokenIDs(list); ok {
				return ids, nil
			}
			p = list[0] // a batch: route by its first prompt
			if inner, ok := p.([]any); ok {
				if ids, ok := tokenIDs(inner); ok {
					return ids, nil
				}
			}
		}
		s, ok := p.(string)
		if !ok {
			return nil, errNoPrompt
		}
		tb["prompt"] = s
		for _, k := range []string{"model", "add_special_tokens"} {
			if v, ok := b[k]; ok {
				tb[k] = v
			}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	resp, err := l.post(ctx, inst, "/tokenize", reqID, hdr, tb, false)
	if err != nil {
		return nil, fmt.Errorf("tokenize on %s: %w", inst, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxTokenizeAnswer))
	if err != nil {
		return nil, fmt.Errorf("tokenize on %s: reading the answer: %w", inst, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("tokenize on %s: %s: %s", inst, resp.Status, truncate(data, 200))
	}
	var out struct {
		Tokens []int32 `json:"tokens"`
	}
	if err := json.NewDecoder(bytes.NewReader(data)).Decode(&out); err != nil {
		return nil, fmt.Errorf("tokenize on %s: the answer: %w", inst, err)
	}
	return out.Tokens, nil
}

// tokenIDs returns list as token ids when every element is an integer that fits in int32.
func tokenIDs(list []any) ([]int32, bool) {
	out := make([]int32, len(list))
	for i, v := range list {
		n, ok := jsonInt(v)
		if !ok || n < 0 || n > 1<<31-1 {
			return nil, false
		}
		if f, isFloat := v.(float64); isFloat && f != float64(n) {
			return nil, false
		}
		out[i] = int32(n)
	}
	return out, true
}
