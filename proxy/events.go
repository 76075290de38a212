package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
)

// The decode leg's stream, event by event. Both proxies read D's SSE stream through here: they
// take D's kv_transfer_params out of every event before a client sees it, and they finish
// their own bookkeeping (the multi-turn proxy stores the turn) before they write [DONE] — most
// clients close the connection as soon as they read [DONE], so nothing may depend on the
// client reading further.

// doneData is the payload of the event that ends an OpenAI stream.
var doneData = []byte("[DONE]")

// legContext returns the context of an engine leg: it ends when the client goes away — until
// detach is called, after which the client's departure no longer touches the leg (the leg
// then ends by cancel, or by the idle clock through cancel). cancel must be called.
func legContext(client context.Context) (ctx context.Context, cancel context.CancelCauseFunc, detach func()) {
	ctx, cancel = context.WithCancelCause(context.WithoutCancel(client))
	stop := context.AfterFunc(client, func() { cancel(context.Cause(client)) })
	return ctx, cancel, func() { stop() }
}

// eventReader splits an SSE body into the data of its events: the "data:" lines of an event,
// joined by newlines, up to the blank line that ends it. Other fields (event:, id:, comments)
// are skipped.
type eventReader struct {
	br   *bufio.Reader
	data []byte
}

func newEventReader(r io.Reader) *eventReader {
	return &eventReader{br: bufio.NewReaderSize(r, 64<<10)}
}

// next returns the data of the next event, or an error (io.EOF at a clean end). A final event
// without its blank line is returned before io.EOF.
func (er *eventReader) next() ([]byte, error) {
	er.data = er.data[:0]
	have := false
	for {
		line, err := er.br.ReadBytes('\n')
		line = bytes.TrimRight(line, "\r\n")
		if len(line) == 0 && err == nil {
			if have {
				return er.data, nil
			}
			continue
		}
		if d, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			d = bytes.TrimPrefix(d, []byte(" "))
			if have {
				er.data = append(er.data, '\n')
			}
			er.data = append(er.data, d...)
			have = true
		}
		if err != nil {
			if have && err == io.EOF {
				return er.data, nil
			}
			return nil, err
		}
	}
}

// withoutParams returns an event's JSON payload without its top-level kv_transfer_params, and
// the params it carried (nil when none). Anything that is not a JSON object comes back as it is.
func withoutParams(data []byte) (out []byte, params map[string]any) {
	if !bytes.Contains(data, []byte(`"kv_transfer_params"`)) {
		return data, nil
	}
	var fields map[string]json.RawMessage
	if json.Unmarshal(data, &fields) != nil {
		return data, nil
	}
	raw, ok := fields["kv_transfer_params"]
	if !ok {
		return data, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	_ = dec.Decode(&params) // null or not an object: no params
	delete(fields, "kv_transfer_params")
	out, err := json.Marshal(fields)
	if err != nil {
		return data, params
	}
	return out, params
}

// isSSE reports whether an engine answered with an event stream.
func isSSE(resp *http.Response) bool {
	return strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
}

// sseWriter writes events to a streaming client, flushing each one.
type sseWriter struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

func newSSEWriter(w http.ResponseWriter) *sseWriter {
	return &sseWriter{w: w, rc: http.NewResponseController(w)}
}

// event writes one data event and flushes it.
func (s *sseWriter) event(data []byte) error {
	buf := make([]byte, 0, len(data)+8)
	buf = append(append(append(buf, "data: "...), data...), "\n\n"...)
	if _, err := s.w.Write(buf); err != nil {
		return err
	}
	return s.rc.Flush()
}

// drain reads what is left of an engine's body after [DONE] (normally nothing but the end of
// the chunked encoding), so that the connection can be reused; errors do not matter any more.
func drain(r io.Reader) { _, _ = io.Copy(io.Discard, io.LimitReader(r, 1<<20)) }
