package openai

import (
	"fmt"
	"net/http"
	"sync"

	"golang.org/x/sync/semaphore"
)

// slotHold is the concurrency slots (Config.MaxConcurrentRequests) one request holds. Slots
// follow the work, not the socket: a completion's are given back as soon as the engine has
// ended all its sequences — a response still waiting for a slow client holds none — or when its
// handler returns, whichever comes first. release gives back everything taken, exactly once,
// whoever calls it; it is safe for concurrent use. A hold over a nil semaphore (no limit)
// holds nothing.
type slotHold struct {
	sem *semaphore.Weighted

	mu sync.Mutex
	n  int64 // slots taken and not given back
}

// release gives back every slot the hold has taken; later calls do nothing.
func (h *slotHold) release() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n > 0 {
		h.sem.Release(h.n)
		h.n = 0
	}
}

// acquire adds n concurrency slots to h without waiting; it answers 429 when fewer are free
// (the sequences of MaxConcurrentRequests are already running).
func (s *Server) acquire(h *slotHold, n int) *APIError {
	if h.sem == nil {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.sem.TryAcquire(int64(n)) {
		return &APIError{Status: http.StatusTooManyRequests, Type: "RateLimitError", RetryAfter: 1,
			Message: fmt.Sprintf("The server is already running its limit of %d concurrent sequences (a request runs max(n, best_of) of them); retry later.", s.cfg.MaxConcurrentRequests)}
	}
	h.n += int64(n)
	return nil
}

// takeSlot takes one concurrency slot for a request that is not a completion (tokenize,
// detokenize), answering 429 itself when none is free; ok reports whether to go on, and
// release must then be called when the request is done.
func (s *Server) takeSlot(w http.ResponseWriter) (release func(), ok bool) {
	h := &slotHold{sem: s.slots}
	if apiErr := s.acquire(h, 1); apiErr != nil {
		writeError(w, apiErr)
		return nil, false
	}
	return h.release, true
}
