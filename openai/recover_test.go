package openai

import (
	"bytes"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestPanicBecomes500(t *testing.T) {
	s := &Server{log: slog.New(slog.DiscardHandler)}
	h := s.recoverPanics(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic("boom") }))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/completions", nil))
	if rec.Code != http.StatusInternalServerError {
		t.Fatalf("status %d", rec.Code)
	}
	errorOf(t, rec.Body.Bytes(), http.StatusInternalServerError)

	// Mid-stream: the error event and [DONE] follow what was already sent.
	h = s.recoverPanics(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		sse := newSSEWriter(w)
		sse.start()
		sse.raw([]byte(`{"x":1}`))
		panic("boom")
	}))
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/completions", nil))
	events := sseEvents(t, rec.Body.Bytes())
	if len(events) != 3 || !bytes.Contains([]byte(events[1]), []byte("InternalServerError")) {
		t.Errorf("events %q", events)
	}
}
