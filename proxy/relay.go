package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
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

// relay copies an engine's response to the client: status and content headers first, then the
// body, flushed after every read so SSE events reach the client as they are produced. onLine, when
// non-nil, sees every complete line of the body (the multi-turn proxy reads D's params from them).
// It returns how many bytes reached the client and the first error.
func relay(w http.ResponseWriter, resp *http.Response, reqID string, idle time.Duration, cancel context.CancelCauseFunc, onLine func([]byte)) (int64, error) {
	for _, h := range []string{"Content-Type", "Cache-Control"} {
		if v := resp.Header.Get(h); v != "" {
			w.Header().Set(h, v)
		}
	}
	w.Header().Set("X-Request-Id", reqID)
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	ir := newIdleReader(resp.Body, idle, cancel)
	defer ir.close()
	var lines lineSplitter
	// SSE is relayed whole events at a time, so that a stream cut in the middle of an event
	// never hands the client half an event (and an error event can follow cleanly).
	sse := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	var pending []byte
	buf := make([]byte, 32<<10)
	var total int64
	write := func(p []byte) error {
		if len(p) == 0 {
			return nil
		}
		if _, werr := w.Write(p); werr != nil {
			return fmt.Errorf("writing to the client: %w", werr)
		}
		total += int64(len(p))
		if ferr := rc.Flush(); ferr != nil {
			return fmt.Errorf("flushing to the client: %w", ferr)
		}
		return nil
	}
	for {
		n, err := ir.Read(buf)
		if n > 0 {
			if onLine != nil {
				lines.feed(buf[:n], onLine)
			}
			out := buf[:n]
			if sse {
				pending = append(pending, out...)
				i := bytes.LastIndex(pending, []byte("\n\n"))
				if i < 0 {
					out = nil
				} else {
					out = pending[:i+2]
				}
			}
			if werr := write(out); werr != nil {
				return total, werr
			}
			if sse && out != nil {
				pending = append(pending[:0], pending[len(out):]...)
			}
		}
		if errors.Is(err, io.EOF) {
			if onLine != nil {
				lines.flush(onLine)
			}
			return total, write(pending)
		}
		if err != nil {
			return total, err
		}
	}
}

// lineSplitter cuts a byte stream into lines.
type lineSplitter struct{ partial []byte }

func (s *lineSplitter) feed(p []byte, fn func([]byte)) {
	for {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			s.partial = append(s.partial, p...)
			return
		}
		if len(s.partial) > 0 {
			s.partial = append(s.partial, p[:i]...)
			fn(bytes.TrimRight(s.partial, "\r"))
			s.partial = s.partial[:0]
		} else {
			fn(bytes.TrimRight(p[:i], "\r"))
		}
		p = p[i+1:]
	}
}

func (s *lineSplitter) flush(fn func([]byte)) {
	if len(s.partial) > 0 {
		fn(s.partial)
		s.partial = nil
	}
}
