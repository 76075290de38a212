package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"
)

// errIdle reports an engine that sent nothing for longer than the idle timeout.
var errIdle = errors.New("engine stream idle for too long")

// idleReader reads from r, cancelling the leg when a read waits longer than idle.
type idleReader struct {
	r      io.Reader
	idle   time.Duration
	timer  *time.Timer
	cancel context.CancelCauseFunc
}

// newIdleReader starts the idle clock; stop it with close.
func newIdleReader(r io.Reader, idle time.Duration, cancel context.CancelCauseFunc) *idleReader {
	ir := &idleReader{r: r, idle: idle, cancel: cancel}
	ir.timer = time.AfterFunc(idle, func() { cancel(errIdle) })
	return ir
}

func (ir *idleReader) Read(p []byte) (int, error) {
	n, err := ir.r.Read(p)
	ir.timer.Reset(ir.idle)
	return n, err
}

func (ir *idleReader) close() { ir.timer.Stop() }

// readAllIdle reads a whole body through an idle clock that cancels the leg's context.
func readAllIdle(r io.Reader, idle time.Duration, cancel context.CancelCauseFunc) ([]byte, error) {
	ir := newIdleReader(r, idle, cancel)
	defer ir.close()
	return io.ReadAll(ir)
}

// legCause returns the reason a leg's context ended, preferring errIdle over the transport's error.
func legCause(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); errors.Is(cause, errIdle) {
		return errIdle
	}
	return err
}

// relay copies an engine's response to the client verbatim: status and content headers first,
// then the body, flushed after every read. It serves the routes the proxies pass through
// (/v1/models). It returns the first error.
func relay(w http.ResponseWriter, resp *http.Response, reqID string, idle time.Duration, cancel context.CancelCauseFunc) error {
	copyHeaders(w, resp, reqID)
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	ir := newIdleReader(resp.Body, idle, cancel)
	defer ir.close()
	buf := make([]byte, 32<<10)
	for {
		n, err := ir.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return fmt.Errorf("writing to the client: %w", werr)
			}
			if ferr := rc.Flush(); ferr != nil {
				return fmt.Errorf("flushing to the client: %w", ferr)
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// copyHeaders copies an engine's content headers and sets the request id.
func copyHeaders(w http.ResponseWriter, resp *http.Response, reqID string) {
	for _, h := range []string{"Content-Type", "Cache-Control"} {
		if v := resp.Header.Get(h); v != "" {
			w.Header().Set(h, v)
		}
	}
	w.Header().Set("X-Request-Id", reqID)
}
