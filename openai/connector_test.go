package openai

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/engine"
)

// testConnector is a minimal KV connector for the HTTP tests, driven by kv_transfer_params:
//
//   - {"test_return_params": true}: a request finishing by stop/length returns params (like P's
//     response), so the HTTP layer must surface them;
//   - {"test_fail_load": true}: the whole prompt is "loaded remotely" and the load then fails,
//     so under policy fail the request ends with finish reason "error";
//   - {"test_park_load": true}: the load never completes: the request holds its blocks in
//     WAITING_FOR_REMOTE_KVS until it is aborted.
type testConnector struct {
	loads   chan string // ids of requests whose load must fail
	parking chan string // ids of requests parked for good (their blocks are allocated)

	mu     sync.Mutex
	parked map[string]bool
}

func newTestConnector() *testConnector {
	return &testConnector{loads: make(chan string, 16), parking: make(chan string, 16), parked: map[string]bool{}}
}

// MatchedExternal implements engine.Connector.
func (c *testConnector) MatchedExternal(seq *engine.Sequence, localHit int) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	kv := seq.KVTransfer()
	if (kv["test_fail_load"] != true && kv["test_park_load"] != true) || c.parked[seq.ID()] {
		return 0, false
	}
	return seq.NumPromptTokens() - localHit, true
}

// AfterAlloc implements engine.Connector.
func (c *testConnector) AfterAlloc(seq *engine.Sequence, _ []int32, numExternal int) {
	if numExternal == 0 {
		return
	}
	c.mu.Lock()
	c.parked[seq.ID()] = true
	c.mu.Unlock()
	ch := c.loads
	if seq.KVTransfer()["test_park_load"] == true {
		ch = c.parking
	}
	select {
	case ch <- seq.ID():
	default:
	}
}

// Finished implements engine.Connector.
func (c *testConnector) Finished(seq *engine.Sequence, status engine.Status, _ time.Time) (bool, map[string]any) {
	c.mu.Lock()
	delete(c.parked, seq.ID())
	c.mu.Unlock()
	if seq.KVTransfer()["test_return_params"] != true || status.FinishReason() == "abort" || status.FinishReason() == "error" {
		return false, nil
	}
	return false, map[string]any{
		"do_remote_prefill": true, "do_remote_decode": false,
		"remote_block_ids": []any{[]any{1, 2}}, "remote_engine_id": "engine-x",
		"remote_request_id": seq.ID(), "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
	}
}

// newConnectorEnv starts an env whose engine uses a testConnector, and the connector's "worker"
// goroutine that fails every load marked test_fail_load (it ends with the test).
func newConnectorEnv(t *testing.T) (*env, *testConnector) {
	conn := newTestConnector()
	e := newEnv(t, envEngineOption(func(c *engine.Config) {
		c.Connector = conn
		c.KVLoadFailurePolicy = engine.FailurePolicyFail
	}))
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case <-done:
				return
			case id := <-conn.loads:
				e.engine.LoadsDone(nil, nil, map[string]int{id: 0})
			}
		}
	}()
	t.Cleanup(func() { close(done); <-stopped })
	return e, conn
}

func TestKVTransferParamsReturned(t *testing.T) {
	e, _ := newConnectorEnv(t)
	kv := map[string]any{"test_return_params": true, "do_remote_decode": true}

	_, b := e.post(t, "/v1/completions", map[string]any{"prompt": "hello", "max_tokens": 1, "kv_transfer_params": kv}, nil)
	got, ok := decode(t, b)["kv_transfer_params"].(map[string]any)
	if !ok || got["remote_engine_id"] != "engine-x" || got["do_remote_prefill"] != true {
		t.Fatalf("non-stream kv_transfer_params = %v", decode(t, b)["kv_transfer_params"])
	}

	for _, route := range []string{"/v1/chat/completions", "/v1/completions"} {
		// stream_options {} means include_usage, as in vLLM.
		body := map[string]any{"max_tokens": 3, "ignore_eos": true, "stream": true,
			"stream_options": map[string]any{}, "kv_transfer_params": kv}
		object := "text_completion"
		if route == "/v1/chat/completions" {
			body["messages"] = []any{map[string]any{"role": "user", "content": "hi"}}
			object = "chat.completion.chunk"
		} else {
			body["prompt"] = "hi"
		}
		resp, sb := e.post(t, route, body, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: status %d", route, resp.StatusCode)
		}
		events := sseEvents(t, sb)
		if len(events) < 3 || events[len(events)-1] != "[DONE]" {
			t.Fatalf("%s: events %q", route, events)
		}
		// vLLM's benchmark reads choices[0] of every event but the usage one: every other
		// event must have a choice.
		for i, ev := range events[:len(events)-2] {
			if c, _ := decode(t, []byte(ev))["choices"].([]any); len(c) == 0 {
				t.Errorf("%s: event %d has no choice: %s", route, i, ev)
			}
		}
		// … the chunk with finish_reason carries the params, then the usage chunk, [DONE].
		final := decode(t, []byte(events[len(events)-3]))
		choice, _ := final["choices"].([]any)[0].(map[string]any)
		if final["object"] != object || choice["finish_reason"] != "length" {
			t.Errorf("%s: final chunk = %s", route, events[len(events)-3])
		}
		if p, ok := final["kv_transfer_params"].(map[string]any); !ok || p["remote_engine_id"] != "engine-x" {
			t.Errorf("%s: final chunk params = %v", route, final["kv_transfer_params"])
		}
		usage := decode(t, []byte(events[len(events)-2]))
		if c, _ := usage["choices"].([]any); len(c) != 0 || usage["kv_transfer_params"] != nil {
			t.Errorf("%s: usage chunk = %s", route, events[len(events)-2])
		}
		usageOf(t, usage)
		for _, ev := range events[:len(events)-3] {
			if strings.Contains(ev, "kv_transfer_params") {
				t.Errorf("%s: params on a chunk before the final one: %s", route, ev)
			}
		}
	}
}

// TestEngineErrorIs500: a request whose KV load fails under policy fail finishes with reason
// "error"; the client gets vLLM's generic 500 (non-stream) or one SSE error event and [DONE].
func TestEngineErrorIs500(t *testing.T) {
	e, _ := newConnectorEnv(t)
	body := map[string]any{"prompt": "load me remotely", "max_tokens": 4, "kv_transfer_params": map[string]any{"test_fail_load": true}}
	resp, b := e.post(t, "/v1/completions", body, nil)
	if resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	const want = `{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}`
	if string(b) != want {
		t.Errorf("body %s, want %s", b, want)
	}

	body["stream"] = true
	resp, b = e.post(t, "/v1/completions", body, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("stream status %d", resp.StatusCode)
	}
	events := sseEvents(t, b)
	if len(events) != 2 || events[0] != want {
		t.Errorf("stream events %q, want the error event then [DONE]", events)
	}

	chat := map[string]any{"messages": []any{map[string]any{"role": "user", "content": "x"}}, "stream": true,
		"kv_transfer_params": map[string]any{"test_fail_load": true}}
	_, b = e.post(t, "/v1/chat/completions", chat, nil)
	events = sseEvents(t, b)
	if len(events) != 3 || events[1] != want {
		t.Errorf("chat stream events %q, want role chunk, error event, [DONE]", events)
	}
	if after := e.scrape(t); after["vllm:request_success_total"] != 3 {
		t.Errorf("request_success_total = %v, want 3 (finished_reason=error)", after["vllm:request_success_total"])
	}
}

// park starts a completion with body, whose kv_transfer_params must hold test_park_load, so that
// its load never completes and it holds its concurrency slots; it returns once the request has
// parked (at most testWait). stop cancels the request and waits for its client to finish.
func park(t *testing.T, e *env, conn *testConnector, body string) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	parked := make(chan struct{})
	go func() {
		defer close(parked)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.http.URL+"/v1/completions", strings.NewReader(body))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	select {
	case <-conn.parking:
	case <-time.After(testWait):
		cancel()
		<-parked
		t.Fatal("the request never parked")
	}
	return func() { cancel(); <-parked }
}
