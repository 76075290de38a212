package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// The decode leg, shared by both proxies. D's answer is relayed (or, for a multi-turn client
// that did not ask for a stream, assembled) an event at a time: D's kv_transfer_params are taken
// out of every event, the caller's bookkeeping runs when D's stream ends, and only then does the
// client get [DONE] — most clients close the connection as soon as they read it, so nothing may
// depend on the client reading further. What differs between the proxies is chosen through
// decodeOptions:
//
//   - the one-way proxy forwards the client's body unchanged (conformance item 2), so D streams
//     only when the client asked, and D's own usage chunk goes through as the client asked for it;
//   - the multi-turn proxy always asks D for a stream with usage (D's params ride on its last
//     chunk), assembles one JSON response for a non-streaming client, forwards the usage chunk
//     only to a client that asked for it, and stores the turn when the stream ends.

// decodeOptions adapt the decode leg to a proxy.
type decodeOptions struct {
	// streaming says whether the client asked for a stream; when it did not but D streams, the
	// client gets one assembled JSON response.
	streaming bool
	// usage says whether a usage-only chunk from D is forwarded to a streaming client.
	usage bool
	// first, if set, is called when the first event reaches the client (TTFT).
	first func()
	// done, if set, sees the answer once D's stream has ended, before the client gets its end.
	done func(answer)
	// unreachable, if set, is called when D could not be reached (no answer at all).
	unreachable func()
}

// decode runs the D leg and relays its answer, whatever its status (vllm#23981), without D's
// kv_transfer_params. It returns the first error.
func (l *legs) decode(w http.ResponseWriter, r *http.Request, inst Instance, path, reqID string, b body, o decodeOptions) error {
	ctx, cancel, detach := legContext(r.Context())
	defer cancel(nil)
	resp, err := l.post(ctx, inst, path, reqID, r.Header, b, false)
	if err != nil {
		if r.Context().Err() != nil {
			return err // the client left; nobody to answer
		}
		if o.unreachable != nil {
			o.unreachable()
		}
		l.fail("decode", inst, reqID, &legError{status: http.StatusBadGateway, code: codeDecodeFailed, msg: err.Error()}).write(w)
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 || !isSSE(resp) {
		if err := relayJSON(w, resp, reqID, l.cfg.IdleTimeout, cancel); err != nil {
			err = legCause(ctx, err)
			if r.Context().Err() == nil {
				l.fail("decode", inst, reqID, &legError{status: http.StatusBadGateway, code: codeDecodeFailed, msg: err.Error()}).write(w)
			}
			return err
		}
		return nil
	}
	out := newSSEWriter(w)
	if o.streaming {
		copyHeaders(w, resp, reqID)
		w.WriteHeader(http.StatusOK)
		_ = out.rc.Flush()
	}
	ir := newIdleReader(resp.Body, l.cfg.IdleTimeout, cancel)
	defer ir.close()
	events := newEventReader(ir)
	var ans answer
	for {
		data, err := events.next()
		if errors.Is(err, io.EOF) || bytes.Equal(data, doneData) {
			break
		}
		if err != nil {
			err = legCause(ctx, err)
			if r.Context().Err() != nil {
				return err // the client left before the end
			}
			l.cfg.Logger.Warn("proxy decode stream ended early", "instance", inst.String(), "request_id", reqID, "error", err)
			if o.streaming {
				// The 200 is gone: end the stream the way an engine does, so the client sees
				// an error rather than a truncated success.
				writeSSEError(w, "decode stream ended early: "+err.Error())
				_ = out.rc.Flush()
			} else {
				l.fail("decode", inst, reqID, &legError{status: http.StatusBadGateway, code: codeDecodeFailed, msg: err.Error()}).write(w)
			}
			return err
		}
		data, forward := ans.event(data)
		if o.streaming && (forward || (o.usage && isUsageChunk(data))) {
			if o.first != nil {
				o.first()
				o.first = nil
			}
			if err := out.event(data); err != nil {
				return err
			}
		}
	}
	// D's stream is over: finish the bookkeeping, then let the client have the end of it.
	detach()
	if o.done != nil {
		o.done(ans)
	}
	if !o.streaming {
		if o.first != nil {
			o.first()
		}
		writeAssembled(w, reqID, b, ans)
	} else if err := out.event(doneData); err != nil {
		return nil // the client left at [DONE], as most clients do
	}
	drain(ir)
	return nil
}

// answer is what D's stream said.
type answer struct {
	text       string
	finish     string
	params     map[string]any
	usage      map[string]any
	id, model  string
	created    any
	err        map[string]any
	uncachable bool
}

// isUsageChunk reports whether an SSE payload is the usage-only chunk.
func isUsageChunk(data []byte) bool {
	var m struct {
		Choices []any `json:"choices"`
		Usage   any   `json:"usage"`
	}
	return json.Unmarshal(data, &m) == nil && len(m.Choices) == 0 && m.Usage != nil
}

// event records one SSE payload of D's stream. It returns the payload without D's
// kv_transfer_params and whether a streaming client should see it: every event with a choice
// (D puts its params on the one with finish_reason), errors and what the proxy cannot parse;
// not the usage chunk (the caller decides) nor an older engine's chunk that only carried params.
func (a *answer) event(data []byte) ([]byte, bool) {
	data, params := withoutParams(data)
	if params != nil {
		a.params = params
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var m map[string]any
	if dec.Decode(&m) != nil {
		return data, true // not ours to judge
	}
	if e, ok := m["error"].(map[string]any); ok {
		a.err = e
		return data, true
	}
	if id, ok := m["id"].(string); ok {
		a.id = id
	}
	if s, ok := m["model"].(string); ok {
		a.model = s
	}
	if c, ok := m["created"]; ok {
		a.created = c
	}
	choices, _ := m["choices"].([]any)
	for _, c := range choices {
		ch, _ := c.(map[string]any)
		if s, ok := ch["text"].(string); ok {
			a.text += s
		}
		if d, ok := ch["delta"].(map[string]any); ok {
			if s, ok := d["content"].(string); ok {
				a.text += s
			}
			for _, k := range []string{"reasoning", "reasoning_content", "tool_calls", "function_call"} {
				if v, ok := d[k]; ok && v != nil && !isEmptyList(v) {
					a.uncachable = true
				}
			}
		}
		if f, ok := ch["finish_reason"].(string); ok {
			a.finish = f
		}
	}
	if u, ok := m["usage"].(map[string]any); ok {
		a.usage = u
	}
	return data, len(choices) > 0
}

func isEmptyList(v any) bool {
	l, ok := v.([]any)
	return ok && len(l) == 0
}

// writeSSEError ends a stream with an error event and [DONE], as vLLM's engine does.
func writeSSEError(w io.Writer, msg string) {
	data, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "BadGatewayError", "param": nil, "code": http.StatusBadGateway}})
	fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", data)
}

// writeAssembled answers a non-streaming client with the body D's stream amounts to.
func writeAssembled(w http.ResponseWriter, reqID string, client body, a answer) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Request-Id", reqID)
	if a.err != nil {
		status := http.StatusInternalServerError
		if c, ok := a.err["code"].(json.Number); ok {
			if n, err := c.Int64(); err == nil && n >= 400 && n < 600 {
				status = int(n)
			}
		}
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(map[string]any{"error": a.err})
		return
	}
	var finish any
	if a.finish != "" {
		finish = a.finish
	}
	model := a.model
	if model == "" {
		model, _ = client["model"].(string)
	}
	out := map[string]any{"id": a.id, "created": a.created, "model": model, "usage": a.usage}
	if _, chat := client["messages"]; chat {
		out["object"] = "chat.completion"
		out["choices"] = []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": a.text}, "finish_reason": finish, "logprobs": nil}}
	} else {
		out["object"] = "text_completion"
		out["choices"] = []any{map[string]any{"index": 0, "text": a.text, "finish_reason": finish, "logprobs": nil}}
	}
	_ = json.NewEncoder(w).Encode(out)
}
