package openai

import (
	"encoding/json"
	"net/http"
)

// sseWriter writes server-sent events ("data: <json>\n\n") and flushes each one. After the
// first write error (the client went away) it writes nothing more; err reports that error.
type sseWriter struct {
	w   http.ResponseWriter
	rc  *http.ResponseController
	err error
}

func newSSEWriter(w http.ResponseWriter) *sseWriter {
	return &sseWriter{w: w, rc: http.NewResponseController(w)}
}

// start sends the 200 and the event-stream headers.
func (s *sseWriter) start() {
	h := s.w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	s.w.WriteHeader(http.StatusOK)
	s.flush()
}

// event writes v as one data event.
func (s *sseWriter) event(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		b = internalError().JSON()
	}
	s.raw(b)
}

// raw writes one data event with a pre-encoded payload.
func (s *sseWriter) raw(payload []byte) {
	if s.err != nil {
		return
	}
	buf := make([]byte, 0, len(payload)+8)
	buf = append(buf, "data: "...)
	buf = append(buf, payload...)
	buf = append(buf, "\n\n"...)
	if _, err := s.w.Write(buf); err != nil {
		s.err = err
		return
	}
	s.flush()
}

// done writes the terminating "data: [DONE]" event.
func (s *sseWriter) done() { s.raw([]byte("[DONE]")) }

func (s *sseWriter) flush() {
	if s.err != nil {
		return
	}
	if err := s.rc.Flush(); err != nil && err != http.ErrNotSupported {
		s.err = err
	}
}
