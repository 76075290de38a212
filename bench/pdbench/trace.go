package pdbench

import (
	"io"
	"net/http"
	"sync"
	"time"
)

// legTimes are the instants of one proxied request's two engine legs, as the proxy's transport
// saw them: the leg's request leaving the proxy and the last byte of the engine's answer read.
type legTimes struct {
	pStart, pEnd time.Time
	dStart, dEnd time.Time
}

// tracer is an http.RoundTripper for the proxy's engine legs that records, per X-Request-Id,
// when each leg started and when its response body was read to the end. It tells the legs
// apart by the engine's host:port (setPrefill).
type tracer struct {
	next http.RoundTripper

	mu    sync.Mutex
	pHost string // P's host:port; any other host is D
	legs  map[string]*legTimes
}

func newTracer(next http.RoundTripper) *tracer {
	return &tracer{next: next, legs: make(map[string]*legTimes)}
}

// setPrefill names P's host:port (known once the stack runs).
func (t *tracer) setPrefill(hostPort string) {
	t.mu.Lock()
	t.pHost = hostPort
	t.mu.Unlock()
}

// RoundTrip implements http.RoundTripper.
func (t *tracer) RoundTrip(r *http.Request) (*http.Response, error) {
	id := r.Header.Get("X-Request-Id")
	t.mu.Lock()
	isP := r.URL.Host == t.pHost
	t.mu.Unlock()
	t.mark(id, isP, false)
	resp, err := t.next.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	resp.Body = &tracedBody{ReadCloser: resp.Body, done: func() { t.mark(id, isP, true) }}
	return resp, nil
}

// CloseIdleConnections passes through to the wrapped transport (the proxy's Close calls it).
func (t *tracer) CloseIdleConnections() {
	if c, ok := t.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func (t *tracer) mark(id string, isP, end bool) {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.legs[id]
	if l == nil {
		l = &legTimes{}
		t.legs[id] = l
	}
	switch {
	case isP && !end:
		l.pStart = now
	case isP:
		l.pEnd = now
	case !end:
		l.dStart = now
	default:
		l.dEnd = now
	}
}

// take returns and forgets the legs of request id.
func (t *tracer) take(id string) (legTimes, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	l, ok := t.legs[id]
	if ok {
		delete(t.legs, id)
		return *l, true
	}
	return legTimes{}, false
}

// tracedBody calls done once, at the first end of the body (EOF, an error, or Close).
type tracedBody struct {
	io.ReadCloser
	once sync.Once
	done func()
}

func (b *tracedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.once.Do(b.done)
	}
	return n, err
}

func (b *tracedBody) Close() error {
	b.once.Do(b.done)
	return b.ReadCloser.Close()
}
