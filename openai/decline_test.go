package openai

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/engine"
)

// declined records the kv_transfer_params handed to Config.DeclineKV.
type declined struct {
	mu     sync.Mutex
	params []map[string]any
}

func (d *declined) record(p map[string]any) {
	d.mu.Lock()
	d.params = append(d.params, p)
	d.mu.Unlock()
}

func (d *declined) ids() []any {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []any
	for _, p := range d.params {
		out = append(out, p["id"])
	}
	return out
}

// TestRefusedRequestsDecline: a request refused before the engine took it — over capacity,
// invalid, too long — hands its kv_transfer_params to DeclineKV (so that the producer frees its
// blocks at once); a request the engine took does not.
func TestRefusedRequestsDecline(t *testing.T) {
	var d declined
	conn := newTestConnector()
	e := newEnv(t, func(c *Config) { c.MaxConcurrentRequests = 1; c.DeclineKV = d.record },
		envEngineOption(func(c *engine.Config) { c.Connector = conn }))
	// A request parked for good (its load never completes) holds the only slot.
	stop := park(t, e, conn, `{"prompt":"park","max_tokens":2,"kv_transfer_params":{"test_park_load":true,"id":"parked"}}`)
	body := func(id string, extra string) map[string]any {
		m := map[string]any{"prompt": "hello", "max_tokens": 2, "kv_transfer_params": map[string]any{"id": id}}
		if extra != "" {
			for _, kv := range strings.Split(extra, ",") {
				k, v, _ := strings.Cut(kv, "=")
				var n int
				fmt.Sscan(v, &n)
				m[k] = n
			}
		}
		return m
	}
	if resp, _ := e.post(t, "/v1/completions", body("busy", ""), nil); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("over capacity: %d", resp.StatusCode)
	}
	stop()
	waitHandlers(t, e, 2) // the refused one and the parked one
	for _, tc := range []struct {
		id, extra string
		status    int
	}{
		{"invalid", "temperature=-1", 400},
		{"too-long", "max_tokens=100000", 400},
		{"taken", "", 200},
	} {
		if resp, raw := e.post(t, "/v1/completions", body(tc.id, tc.extra), nil); resp.StatusCode != tc.status {
			t.Fatalf("%s: %d %s", tc.id, resp.StatusCode, raw)
		}
	}
	if got := fmt.Sprint(d.ids()); got != "[busy invalid too-long]" {
		t.Errorf("declined %s, want [busy invalid too-long]", got)
	}
}

// waitHandlers waits (bounded) for n HTTP handlers to return.
func waitHandlers(t *testing.T, e *env, n int) {
	t.Helper()
	for range n {
		select {
		case <-e.handlerDone:
		case <-time.After(testWait):
			t.Fatal("a handler did not return")
		}
	}
}

// trickle opens a connection, sends a request's headers and half its body, and keeps the
// connection open without sending the rest; it returns the connection.
func trickle(t *testing.T, e *env) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", strings.TrimPrefix(e.http.URL, "http://"), testWait)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(testWait))
	body := `{"prompt":"slow","max_tokens":2}`
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body[:10])
	return c
}

// TestBodyReadDeadline: a client trickling its body holds no concurrency slot while it does
// (another request is served meanwhile, with a limit of one), and is answered 408 once the body
// read deadline passes.
func TestBodyReadDeadline(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.MaxConcurrentRequests = 1; c.BodyReadTimeout = time.Minute })
	trickle(t, e)
	if resp, raw := e.post(t, "/v1/completions", map[string]any{"prompt": "meanwhile", "max_tokens": 2}, nil); resp.StatusCode != 200 {
		t.Fatalf("a request while another's body trickles: %d %s", resp.StatusCode, raw)
	}

	short := newEnv(t, func(c *Config) { c.BodyReadTimeout = 100 * time.Millisecond })
	c := trickle(t, short)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Fatalf("trickled body: %d, want 408", resp.StatusCode)
	}
	var b strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		b.WriteString(sc.Text())
	}
	if !strings.Contains(b.String(), `"type":"RequestTimeoutError"`) {
		t.Errorf("408 body: %s", b.String())
	}
}

// failLaterAdds is an Engine whose Adds after the first fail as a closing engine's do. It has
// no Config method, so the server adds every sequence at once (no prefix-cache sharing).
type failLaterAdds struct {
	eng  *engine.Engine
	mu   sync.Mutex
	adds int
}

func (f *failLaterAdds) Add(ctx context.Context, r *engine.Request) (*engine.Stream, error) {
	f.mu.Lock()
	f.adds++
	n := f.adds
	f.mu.Unlock()
	if n > 1 {
		return nil, engine.ErrClosed
	}
	return f.eng.Add(ctx, r)
}

func (f *failLaterAdds) Stats() engine.Stats { return f.eng.Stats() }

// TestPartlyAddedNotDeclined: when the engine takes a request's first sequence (the one with
// the kv_transfer_params) and refuses a later one, the request fails, and its params are not
// handed to DeclineKV: the aborted first sequence tells the producer through the connector,
// and a second notice would reach a producer that already freed the blocks.
func TestPartlyAddedNotDeclined(t *testing.T) {
	var d declined
	e := newEnv(t)
	fe := &failLaterAdds{eng: e.engine}
	e.server = NewServer(Config{ServedModelNames: []string{testModelName}, MaxModelLen: testMaxModelLen,
		DeclineKV: d.record}, fe, e.model)
	resp, raw := e.post(t, "/v1/completions", map[string]any{"prompt": "hello", "max_tokens": 2, "n": 2,
		"kv_transfer_params": map[string]any{"id": "partly"}}, nil)
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("status %d %s, want 503", resp.StatusCode, raw)
	}
	fe.mu.Lock()
	adds := fe.adds
	fe.mu.Unlock()
	if adds != 2 {
		t.Fatalf("%d adds, want 2 (the first taken, the second refused)", adds)
	}
	if got := d.ids(); len(got) != 0 {
		t.Errorf("declined %v after the engine took the first sequence", got)
	}
	// The single-sequence refusal is still declined.
	fe.mu.Lock()
	fe.adds = 1
	fe.mu.Unlock()
	if resp, raw := e.post(t, "/v1/completions", map[string]any{"prompt": "hello", "max_tokens": 2,
		"kv_transfer_params": map[string]any{"id": "refused"}}, nil); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("refused: %d %s", resp.StatusCode, raw)
	}
	if got := fmt.Sprint(d.ids()); got != "[refused]" {
		t.Errorf("declined %s, want [refused]", got)
	}
}
