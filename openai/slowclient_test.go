package openai

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/fixture"
)

// slowLimit is the concurrency limit of the slow-client tests: the non-reader's request takes
// all of it.
const slowLimit = 4

// bigRequest asks for slowLimit sequences of 200 tokens with 20 logprobs each: about 600 KB of
// response, far more than the socket buffers between a non-reader and a server that shrinks
// its send buffers (envSmallSendBuffers) take.
func bigRequest(stream bool) string {
	return fmt.Sprintf(`{"prompt":"a client that does not read","max_tokens":200,"ignore_eos":true,"n":%d,"logprobs":20,"stream":%t}`, slowLimit, stream)
}

// counter returns the value of the counter name (summed over its series) in e's registry.
func (e *env) counter(t testing.TB, name string) float64 {
	t.Helper()
	mfs, err := e.reg.Prometheus().Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// eventually polls cond every millisecond until it holds, failing after testWait.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(testWait)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", testWait, what)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("test ended while waiting for %s", what)
		case <-time.After(time.Millisecond):
		}
	}
}

// fillsTheLimit sends a request with limit sequences and returns its status.
func fillsTheLimit(t *testing.T, e *env, limit int) int {
	t.Helper()
	resp, raw := e.post(t, "/v1/completions", map[string]any{"prompt": "a bystander", "max_tokens": 2, "n": limit}, nil)
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("bystander: %d %s", resp.StatusCode, raw)
	}
	return resp.StatusCode
}

// TestStalledStreamIsAborted: a client asks for a stream of the whole concurrency limit's
// sequences and never reads. Once a write to it has waited WriteTimeout, the request is aborted
// and counted in kvbridge:http_client_stalled_total; its slots are back (a request as large gets
// 200, not 429), the engine runs nothing, and the pool is full (cleanup).
func TestStalledStreamIsAborted(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.MaxConcurrentRequests = slowLimit; c.WriteTimeout = 300 * time.Millisecond }, envSmallSendBuffers{})
	fixture.NonReader(t, e.http.Listener.Addr().String(), "/v1/completions", bigRequest(true))
	waitHandlers(t, e, 1) // the non-reader's handler returns only once a write missed its deadline
	if got := e.counter(t, "kvbridge:http_client_stalled_total"); got != 1 {
		t.Errorf("kvbridge:http_client_stalled_total = %v, want 1", got)
	}
	eventually(t, "the engine to run nothing", func() bool {
		st := e.engine.Stats()
		return st.Running == 0 && st.Waiting == 0
	})
	if got := fillsTheLimit(t, e, slowLimit); got != http.StatusOK {
		t.Errorf("a request of the whole limit after the stalled one was aborted: %d, want 200", got)
	}
}

// TestSlotsFollowTheEngine: a client that does not read its response (stream or not), with a
// write timeout far beyond the test: its slots are back as soon as the engine has ended its
// sequences, while the response still waits for the client (a request of the whole limit gets
// 200 meanwhile); nothing is counted as stalled, and the client, reading at last, gets its
// whole answer. In the chat case the writes block before any token, on the echo of a final
// assistant message that every choice starts with: the sequences that wait for the first one's
// prompt are added all the same.
func TestSlotsFollowTheEngine(t *testing.T) {
	echoed := fmt.Sprintf(`{"messages":[{"role":"user","content":"go on"},{"role":"assistant","content":%q}],"echo":true,"max_tokens":1,"n":32,"stream":true}`,
		strings.Repeat("the ", 200))
	for _, c := range []struct {
		name, path, body string
		limit            int
		stream           bool
	}{
		{"completion", "/v1/completions", bigRequest(false), slowLimit, false},
		{"completion-stream", "/v1/completions", bigRequest(true), slowLimit, true},
		{"chat-echo-stream", "/v1/chat/completions", echoed, 32, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, func(cfg *Config) { cfg.MaxConcurrentRequests = c.limit; cfg.WriteTimeout = 4 * testWait }, envSmallSendBuffers{})
			conn := fixture.NonReader(t, e.http.Listener.Addr().String(), c.path, c.body)
			// The status line only (a stream's comes at once, a JSON answer's once it is
			// built): the request holds its slots, or did, before anyone else asks for them.
			br := bufio.NewReaderSize(conn, 16)
			_ = conn.SetReadDeadline(time.Now().Add(testWait))
			if status, err := br.Peek(12); err != nil || string(status) != "HTTP/1.1 200" {
				t.Fatalf("the slow client's status line: %q, %v", status, err)
			}
			eventually(t, "a request of the whole limit to be served beside the unread response", func() bool {
				return fillsTheLimit(t, e, c.limit) == http.StatusOK
			})
			if got := e.counter(t, "kvbridge:http_client_stalled_total"); got != 0 {
				t.Errorf("kvbridge:http_client_stalled_total = %v, want 0", got)
			}
			_ = conn.SetReadDeadline(time.Now().Add(testWait))
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("the slow client's answer: %d, %v", resp.StatusCode, err)
			}
			finished := 0
			if c.stream {
				for _, ev := range sseEvents(t, body) {
					finished += strings.Count(ev, `"finish_reason":"length"`)
				}
			} else {
				var r struct {
					Choices []struct {
						FinishReason string `json:"finish_reason"`
					}
				}
				if err := json.Unmarshal(body, &r); err != nil {
					t.Fatal(err)
				}
				for _, ch := range r.Choices {
					if ch.FinishReason == "length" {
						finished++
					}
				}
			}
			if finished != c.limit {
				t.Errorf("the slow client got %d finished choices, want %d", finished, c.limit)
			}
		})
	}
}

// TestTokenizeTakesASlot: /tokenize and /detokenize take a concurrency slot: while a parked
// completion holds the only one they get 429 as a completion would; then they are served.
func TestTokenizeTakesASlot(t *testing.T) {
	conn := newTestConnector()
	e := newEnv(t, func(c *Config) { c.MaxConcurrentRequests = 1 },
		envEngineOption(func(c *engine.Config) { c.Connector = conn }))
	calls := []struct{ path, body string }{
		{"/tokenize", `{"prompt":"hello"}`},
		{"/detokenize", `{"tokens":[1,2]}`},
	}
	stop := park(t, e, conn, `{"prompt":"x","max_tokens":2,"kv_transfer_params":{"test_park_load":true}}`)
	for _, c := range calls {
		resp, raw := e.post(t, c.path, c.body, nil)
		if resp.StatusCode != http.StatusTooManyRequests || errorOf(t, raw, 429)["type"] != "RateLimitError" {
			t.Errorf("%s with every slot taken: %d %s, want 429", c.path, resp.StatusCode, raw)
		}
	}
	stop()
	waitHandlers(t, e, 1+len(calls))
	for _, c := range calls {
		if resp, raw := e.post(t, c.path, c.body, nil); resp.StatusCode != http.StatusOK {
			t.Errorf("%s with a slot free: %d %s", c.path, resp.StatusCode, raw)
		}
	}
}
