// Package httpdeadline bounds every write of an HTTP response by a deadline, so that a client
// that stops reading fails the write instead of blocking its handler for good. The engines'
// OpenAI server and both proxies wrap their handlers with it (docs/architecture.md).
package httpdeadline

import (
	"context"
	"errors"
	"net/http"
	"os"
	"time"
)

// ErrClientStalled is the cause of a request's context once a write to its client could not
// complete within the write timeout.
var ErrClientStalled = errors.New("the client took no write within the write timeout")

// Piece is the most one deadline covers: a large body goes out in pieces, each under a
// deadline of its own, so that the bound is on the client's progress (a piece per write
// timeout), not on the size of the body.
const Piece = 64 << 10

// Bound gives every write and flush of next's responses a deadline of timeout
// (http.ResponseController.SetWriteDeadline before each). At the first write or flush that
// misses it, stalled is called once and the request's context is cancelled with
// ErrClientStalled, so that whatever the handler started for the request (engine sequences,
// a proxy's legs) is aborted.
func Bound(next http.Handler, timeout time.Duration, stalled func()) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithCancelCause(r.Context())
		defer cancel(nil)
		dw := &writer{ResponseWriter: w, rc: http.NewResponseController(w), timeout: timeout,
			stalled: func() {
				stalled()
				cancel(ErrClientStalled)
			}}
		// Armed from the start: the connection may carry the expired deadline of an earlier
		// response, and the server writes on its own too (100 Continue, the end of the body).
		dw.arm()
		next.ServeHTTP(dw, r.WithContext(ctx))
	})
}

// writer arms the connection's write deadline before each write and flush and reports the
// first write that missed it. It is used by the handler's goroutine only.
type writer struct {
	http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	stalled func() // called once, at the first write or flush that missed its deadline
	missed  bool
}

// Write implements http.ResponseWriter.
func (d *writer) Write(b []byte) (int, error) {
	n := 0
	for {
		d.arm()
		m, err := d.ResponseWriter.Write(b[n:min(len(b), n+Piece)])
		n += m
		d.check(err)
		if err != nil || n == len(b) {
			return n, err
		}
	}
}

// FlushError flushes under the deadline (http.ResponseController.Flush finds it).
func (d *writer) FlushError() error {
	d.arm()
	err := d.rc.Flush()
	d.check(err)
	return err
}

// Unwrap returns the wrapped writer (for http.ResponseController).
func (d *writer) Unwrap() http.ResponseWriter { return d.ResponseWriter }

func (d *writer) arm() { _ = d.rc.SetWriteDeadline(time.Now().Add(d.timeout)) }

func (d *writer) check(err error) {
	if err != nil && !d.missed && errors.Is(err, os.ErrDeadlineExceeded) {
		d.missed = true
		d.stalled()
	}
}
