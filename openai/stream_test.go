package openai

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestClientDisconnectMidStreamFreesBlocks: a streaming client that goes away after the first
// chunk while its request holds blocks cancels the request; the engine aborts it and every block
// returns to the pool. The request is parked in WAITING_FOR_REMOTE_KVS by the test connector, so
// it is certain to hold its blocks when the client hangs up.
func TestClientDisconnectMidStreamFreesBlocks(t *testing.T) {
	e, conn := newConnectorEnv(t)
	ctx, cancel := context.WithTimeout(t.Context(), testWait)
	defer cancel()
	body := `{"messages":[{"role":"user","content":"` + strings.Repeat("once upon a time ", 8) +
		`"}],"stream":true,"kv_transfer_params":{"test_park_load":true}}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.http.URL+"/v1/chat/completions", bytes.NewReader([]byte(body)))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := e.http.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	// Read the first chunk (the assistant role), wait until the request holds its blocks, then
	// hang up.
	rd := bufio.NewReader(resp.Body)
	line, err := rd.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("first line %q, err %v", line, err)
	}
	select {
	case <-conn.parking:
	case <-time.After(testWait):
		t.Fatal("the request was never admitted")
	}
	if e.pool.NumFree() == e.pool.NumBlocks() {
		t.Fatal("no block in use while the request is live")
	}
	cancel()
	resp.Body.Close()
	e.waitIdle(t)
	if got := e.scrape(t)["vllm:request_success_total"]; got != 1 {
		t.Errorf("request_success_total = %v, want 1 (abort)", got)
	}
}

// TestClientDisconnectWhileGenerating: a client that hangs up while tokens stream leaves the
// pool full (whether the abort or the natural end came first).
func TestClientDisconnectWhileGenerating(t *testing.T) {
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprintf("n=%d", n), func(t *testing.T) { disconnectWhileGenerating(t, n) })
	}
}

// disconnectWhileGenerating hangs up on a streamed request of n choices after its first chunk.
func disconnectWhileGenerating(t *testing.T, n int) {
	e := newEnv(t)
	ctx, cancel := context.WithTimeout(t.Context(), testWait)
	defer cancel()
	body := fmt.Sprintf(`{"prompt":"%s","ignore_eos":true,"stream":true,"n":%d}`, strings.Repeat("once upon a time ", 8), n)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.http.URL+"/v1/completions", bytes.NewReader([]byte(body)))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := e.http.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("first line %q, err %v", line, err)
	}
	cancel()
	resp.Body.Close()
	e.waitIdle(t)
}

// waitIdle waits for the request's handler to return and checks the pool is full. The handler
// returns only after the engine delivered the request's final output, and the engine frees a
// finished request's blocks before delivering it, so no polling is needed.
func (e *env) waitIdle(t *testing.T) {
	t.Helper()
	select {
	case <-e.handlerDone:
	case <-time.After(testWait):
		t.Fatal("the handler did not return after the client disconnected")
	}
	if free, n := e.pool.NumFree(), e.pool.NumBlocks(); free != n {
		t.Fatalf("pool not full after the disconnect: %d of %d blocks free", free, n)
	}
}
