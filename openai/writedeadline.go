package openai

import (
	"context"
	"errors"
	"net/http"
	"os"
	"time"
)

// errClientStalled is the cause of a request's context once a write to its client could not
// complete within Config.WriteTimeout.
var errClientStalled = errors.New("openai: the client took no write within the write timeout")

// boundWrites gives every write and flush of a response a deadline of Config.WriteTimeout
// (http.ResponseController.SetWriteDeadline before each), so that a client that stops reading
// fails the write instead of blocking its handler for good. On such a stall the request's
// context is cancelled — its sequences are aborted in the engine, their blocks freed — and the
// stall is counted once (kvbridge:http_client_stalled_total).
func (s *Server) boundWrites(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithCancelCause(r.Context())
		defer cancel(nil)
		dw := &deadlineWriter{ResponseWriter: w, rc: http.NewResponseController(w), timeout: s.cfg.WriteTimeout,
			stalled: func() {
				s.metrics.CountClientStalled()
				cancel(errClientStalled)
			}}
		// Armed from the start: the connection may carry the expired deadline of an earlier
		// response, and the server writes on its own too (100 Continue, the end of the body).
		dw.arm()
		next.ServeHTTP(dw, r.WithContext(ctx))
	})
}

// deadlineWriter arms the connection's write deadline before each write and flush and reports
// the first write that missed it. It is used by the handler's goroutine only.
type deadlineWriter struct {
	http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	stalled func() // called once, at the first write or flush that missed its deadline
	missed  bool
}

// writePiece is the most one deadline covers: a large body goes out in pieces, each under a
// deadline of its own, so that the bound is on the client's progress (a piece per write
// timeout), not on the size of the body.
const writePiece = 64 << 10

// Write implements http.ResponseWriter.
func (d *deadlineWriter) Write(b []byte) (int, error) {
	n := 0
	for {
		d.arm()
		m, err := d.ResponseWriter.Write(b[n:min(len(b), n+writePiece)])
		n += m
		d.check(err)
		if err != nil || n == len(b) {
			return n, err
		}
	}
}

// FlushError flushes under the deadline (http.ResponseController.Flush finds it).
func (d *deadlineWriter) FlushError() error {
	d.arm()
	err := d.rc.Flush()
	d.check(err)
	return err
}

// Unwrap returns the wrapped writer (for http.ResponseController).
func (d *deadlineWriter) Unwrap() http.ResponseWriter { return d.ResponseWriter }

func (d *deadlineWriter) arm() { _ = d.rc.SetWriteDeadline(time.Now().Add(d.timeout)) }

func (d *deadlineWriter) check(err error) {
	if err != nil && !d.missed && errors.Is(err, os.ErrDeadlineExceeded) {
		d.missed = true
		d.stalled()
	}
}
