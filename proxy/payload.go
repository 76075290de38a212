package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
)

// body is a decoded request body. Numbers stay json.Number so that forwarding changes no value.
type body map[string]any

// decodeBody parses a JSON object request body.
func decodeBody(data []byte) (body, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var b body
	if err := dec.Decode(&b); err != nil {
		return nil, fmt.Errorf("the request body is not valid JSON: %w", err)
	}
	if b == nil {
		return nil, errors.New("the request body must be a JSON object")
	}
	if dec.More() {
		return nil, errors.New("the request body holds more than one JSON value")
	}
	return b, nil
}

// prefillTemplate is what P is asked to do on a first turn: prefill, hold the blocks for a remote
// decoder, no remote blocks to pull.
func prefillTemplate() map[string]any {
	return map[string]any{
		"do_remote_decode":  true,
		"do_remote_prefill": false,
		"remote_engine_id":  nil,
		"remote_block_ids":  nil,
		"remote_host":       nil,
		"remote_port":       nil,
	}
}

// decodeOnlyFields are the request fields whose results only D produces: P's one-token leg
// computes the prompt's KV once for one sequence and its answer is dropped, so it asks for
// neither several choices (n, best_of), nor logprobs (logprobs, top_logprobs), nor the prompt
// back (echo), nor the prompt's logprobs (prompt_logprobs: D recomputes the prompt for them,
// since they need the logits of every prompt position, which a KV transfer does not carry).
// The sampling parameters stay: they change nothing in P's KV, and P validates them as D will.
var decodeOnlyFields = []string{"n", "best_of", "logprobs", "top_logprobs", "echo", "prompt_logprobs"}

// prefillRequest derives P's request from the client's body: a shallow copy with params as
// kv_transfer_params, stream off, max_tokens 1 (and max_completion_tokens 1 when present), and no
// stream_options, min_tokens or min_completion_tokens (docs/architecture.md, wire contract item
// 1), nor the
// fields only D answers (decodeOnlyFields).
func prefillRequest(b body, params map[string]any) body {
	p := maps.Clone(b)
	p["kv_transfer_params"] = params
	p["stream"] = false
	p["max_tokens"] = 1
	if _, ok := p["max_completion_tokens"]; ok {
		p["max_completion_tokens"] = 1
	}
	delete(p, "stream_options")
	delete(p, "min_tokens")
	delete(p, "min_completion_tokens")
	for _, k := range decodeOnlyFields {
		delete(p, k)
	}
	return p
}

// decodeRequest is a shallow copy of the client's body with P's params substituted and nothing
// else changed (conformance item 2). Without params from P, the copy is the body unchanged and
// D prefills locally. Being a copy, it may be changed without touching the client's body.
func decodeRequest(b body, params map[string]any) body {
	d := maps.Clone(b)
	if len(params) > 0 {
		d["kv_transfer_params"] = params
	}
	return d
}

// streaming reports whether the client asked for SSE.
func (b body) streaming() bool {
	s, _ := b["stream"].(bool)
	return s
}
