package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// The decode leg, shared by both proxies. D's answer is relayed without D's
// kv_transfer_params — a stream an event at a time, a JSON body whole — and the caller's
// bookkeeping runs when D's answer has ended, before the client gets its end ([DONE], or the
// body): most clients close the connection as soon as they read [DONE], so nothing may depend on
// the client reading further. What differs between the proxies is chosen through decodeOptions:
//
//   - the one-way proxy forwards the client's body unchanged (conformance item 2), and D's
//     usage chunk goes through as the client asked for it;
//   - the multi-turn proxy asks D for a stream with usage when the client streams (D's params
//     ride on its last chunk), forwards the usage chunk only to a client that asked for it, and
//     stores the turn when D's answer ends. A client that asked for no stream gets D's own JSON
//     answer (every choice, logprobs and prompt logprobs included), D's params taken out of it.

// decodeOptions adapt the decode leg to a proxy.
type decodeOptions struct {
	// usage says whether a usage-only chunk from D is forwarded to a streaming client.
	usage bool
	// first, if set, is called when the first content reaches the client (TTFT).
	first func()
	// done, if set, sees the answer once D's successful answer has ended, before the client
	// gets its end. Without it the answer is not tracked at all.
	done func(*answer)
	// unreachable, if set, is called when D could not be reached (no answer at all).
	unreachable func()
	// sawUsage, if set, sees the usage of D's successful answer when it has one (a JSON
	// answer's, or a stream's usage chunk), before the client gets its end.
	sawUsage func(map[string]any)
	// lazyHeader holds a stream's response headers back until its first event (or its end), so
	// that a leg cancelled before D said anything leaves the client's response untouched (the
	// concurrent push flow answers P's failure then).
	lazyHeader bool
	// beforeHeader, if set, may add to the client's response headers just before they go out.
	beforeHeader func(http.Header)
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
	d := &decodeRelay{l: l, w: w, r: r, inst: inst, reqID: reqID, o: o, ctx: ctx, cancel: cancel, detach: detach}
	if resp.StatusCode/100 != 2 || !isSSE(resp) {
		return d.body(resp)
	}
	return d.stream(resp)
}

// decodeRelay relays D's answer to the client: the state of one decode leg once D answered.
type decodeRelay struct {
	l      *legs
	w      http.ResponseWriter
	r      *http.Request
	inst   Instance
	reqID  string
	o      decodeOptions
	ctx    context.Context // the leg's context (legContext)
	cancel context.CancelCauseFunc
	detach func()
}

// body relays an answer that is no stream (a JSON body, or an error), whole.
func (d *decodeRelay) body(resp *http.Response) error {
	l, w, o := d.l, d.w, d.o
	data, err := readAllIdle(resp.Body, l.cfg.IdleTimeout, d.cancel)
	if err != nil {
		err = legCause(d.ctx, err)
		if d.r.Context().Err() == nil {
			l.fail("decode", d.inst, d.reqID, &legError{status: http.StatusBadGateway, code: codeDecodeFailed, msg: err.Error()}).write(w)
		}
		return err
	}
	data, params := withoutParams(data)
	if resp.StatusCode/100 == 2 && o.sawUsage != nil {
		if u := usageOf(data); u != nil {
			o.sawUsage(u)
		}
	}
	if resp.StatusCode/100 == 2 && o.done != nil {
		ans := answerOf(data)
		ans.params = params
		d.detach()
		o.done(ans)
	}
	if o.first != nil {
		o.first()
	}
	if o.beforeHeader != nil {
		o.beforeHeader(w.Header())
	}
	copyHeaders(w, resp, d.reqID)
	w.Header().Del("Content-Length")
	w.WriteHeader(resp.StatusCode)
	_, err = w.Write(data)
	return err
}

// stream relays D's successful stream an event at a time.
func (d *decodeRelay) stream(resp *http.Response) error {
	l, w, o := d.l, d.w, d.o
	out := newSSEWriter(w)
	committed := false
	commit := func() { // the client's status and headers
		if committed {
			return
		}
		committed = true
		if o.beforeHeader != nil {
			o.beforeHeader(w.Header())
		}
		copyHeaders(w, resp, d.reqID)
		w.WriteHeader(http.StatusOK)
		_ = out.rc.Flush()
	}
	if !o.lazyHeader {
		commit()
	}
	ir := newIdleReader(resp.Body, l.cfg.IdleTimeout, d.cancel)
	defer ir.close()
	events := newEventReader(ir)
	var ans *answer // nil: nobody reads it, so nothing is tracked
	if o.done != nil {
		ans = &answer{}
	}
	for {
		data, err := events.next()
		if errors.Is(err, io.EOF) || bytes.Equal(data, doneData) {
			break
		}
		if err != nil {
			err = legCause(d.ctx, err)
			if d.r.Context().Err() != nil {
				return err // the client left before the end
			}
			l.cfg.Logger.Warn("proxy decode stream ended early", "instance", d.inst.String(), "request_id", d.reqID, "err", err)
			// The 200 is gone: end the stream the way an engine does, so the client sees an
			// error rather than a truncated success.
			commit()
			writeSSEError(w, "decode stream ended early: "+err.Error())
			_ = out.rc.Flush()
			return err
		}
		data, forward, usage := ans.event(data)
		if usage && o.sawUsage != nil {
			if u := usageOf(data); u != nil {
				o.sawUsage(u)
			}
		}
		if forward || (o.usage && usage) {
			if o.first != nil {
				o.first()
				o.first = nil
			}
			commit()
			if err := out.event(data); err != nil {
				return err
			}
		}
	}
	// D's stream is over: finish the bookkeeping, then let the client have the end of it.
	d.detach()
	if o.done != nil {
		o.done(ans)
	}
	commit()
	if err := out.event(doneData); err != nil {
		return nil // the client left at [DONE], as most clients do
	}
	drain(ir)
	return nil
}

// answer is what D's answer said, as far as the multi-turn proxy needs it to store the turn.
type answer struct {
	text       strings.Builder // the first choice's text
	params     map[string]any
	failed     bool // D's answer was an error
	uncachable bool
}

// event reads one SSE payload of D's stream, recording what it says in a unless a is nil. It
// returns the payload without D's kv_transfer_params; whether a streaming client should see it:
// every event with a choice (D puts its params on the one with finish_reason), errors and what
// the proxy cannot parse, not the usage chunk (the caller decides) nor an older engine's chunk
// that only carried params; and whether it is the usage-only chunk (no choices, a usage).
func (a *answer) event(data []byte) (out []byte, forward, usage bool) {
	data, params := withoutParams(data)
	if a != nil && params != nil {
		a.params = params
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	var m map[string]json.RawMessage
	if dec.Decode(&m) != nil {
		return data, true, false // not ours to judge
	}
	if e := m["error"]; len(e) > 0 && e[0] == '{' {
		if a != nil {
			a.failed = true
		}
		return data, true, false
	}
	n := 0 // choices
	raw := m["choices"]
	isList := len(raw) > 0 && raw[0] == '['
	switch {
	case isList && a != nil:
		var choices []any
		d := json.NewDecoder(bytes.NewReader(raw))
		d.UseNumber()
		_ = d.Decode(&choices)
		n = len(choices)
		a.choices(choices, "delta")
	case isList:
		var choices []json.RawMessage
		_ = json.Unmarshal(raw, &choices)
		n = len(choices)
	}
	if n > 0 {
		return data, true, false
	}
	// The usage chunk: choices absent, null or [], a usage, and nothing after the object.
	_, err := dec.Token()
	u := m["usage"]
	usage = err == io.EOF && (len(raw) == 0 || isList || string(raw) == "null") && len(u) > 0 && string(u) != "null"
	return data, false, usage
}

// choices records what the first choice (index 0: the one a next turn continues) says, in a
// stream's deltas or a whole answer's message (key "delta" or "message").
func (a *answer) choices(choices []any, key string) {
	for _, c := range choices {
		ch, _ := c.(map[string]any)
		if idx, ok := ch["index"].(json.Number); ok && idx.String() != "0" {
			continue
		}
		if s, ok := ch["text"].(string); ok {
			a.text.WriteString(s)
		}
		if d, ok := ch[key].(map[string]any); ok {
			if s, ok := d["content"].(string); ok {
				a.text.WriteString(s)
			}
			for _, k := range []string{"reasoning", "reasoning_content", "tool_calls", "function_call"} {
				if v, ok := d[k]; ok && v != nil && !isEmptyList(v) {
					a.uncachable = true
				}
			}
		}
	}
}

// answerOf reads a whole (non-streaming) JSON answer, without its params.
func answerOf(data []byte) *answer {
	a := &answer{}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var m map[string]any
	if dec.Decode(&m) != nil {
		return a
	}
	if _, ok := m["error"].(map[string]any); ok {
		a.failed = true
	}
	choices, _ := m["choices"].([]any)
	a.choices(choices, "message")
	return a
}

// usageOf returns the usage object of a JSON answer or chunk, nil when it has none.
func usageOf(data []byte) map[string]any {
	var m struct {
		Usage map[string]any `json:"usage"`
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if dec.Decode(&m) != nil {
		return nil
	}
	return m.Usage
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
