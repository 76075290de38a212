package proxy_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/proxy"
)

// TestProxiesRefuseClientParams: kv_transfer_params name engines' blocks; a client may not send
// them through either proxy (400 in OpenAI's error shape), and no engine sees the request.
func TestProxiesRefuseClientParams(t *testing.T) {
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	pr, dr := record(t, p.URL), record(t, d.URL)
	oneway := startProxy(t, proxy.Config{Prefill: []proxy.Instance{instanceOf(t, pr.srv.URL)}, Decode: []proxy.Instance{instanceOf(t, dr.srv.URL)}})
	mt, _ := startMultiTurn(t, p, d)
	forged := map[string]any{"do_remote_prefill": true, "remote_engine_id": "x", "remote_request_id": "y",
		"remote_block_ids": []any{[]any{1, 2}}, "remote_host": "127.0.0.1", "remote_port": 1}
	for _, url := range []string{oneway.URL, mt.URL} {
		resp, raw := do(t, http.MethodPost, url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": "hi", "max_tokens": 2,
			"kv_transfer_params": forged, "conversation_id": "c"})
		var e struct {
			Error struct{ Message, Type string } `json:"error"`
		}
		if resp.StatusCode != 400 || json.Unmarshal(raw, &e) != nil || !strings.Contains(e.Error.Message, "kv_transfer_params") {
			t.Errorf("%s: %d %s, want a 400 naming kv_transfer_params", url, resp.StatusCode, raw)
		}
	}
	if len(pr.bodies)+len(dr.bodies) != 0 {
		t.Errorf("engines saw %d requests", len(pr.bodies)+len(dr.bodies))
	}
}

// TestOneWayStripsParams: the one-way proxy hands the client D's answer without D's
// kv_transfer_params (D is bidirectional here, so it returns some), streaming or not.
func TestOneWayStripsParams(t *testing.T) {
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	dr := record(t, d.URL)
	px := startProxy(t, proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, dr.srv.URL)}})
	for _, stream := range []bool{false, true} {
		for _, route := range []string{"/v1/completions", "/v1/chat/completions"} {
			body := map[string]any{"model": "kvbridge/tiny", "max_tokens": 4, "stream": stream}
			if route == "/v1/completions" {
				body["prompt"] = "strip me"
			} else {
				body["messages"] = []any{map[string]any{"role": "user", "content": "strip me"}}
			}
			resp, raw := do(t, http.MethodPost, px.URL+route, body)
			if resp.StatusCode != 200 || strings.Contains(string(raw), "kv_transfer_params") || strings.Contains(string(raw), "remote_block_ids") {
				t.Errorf("%s stream=%v: %d %s", route, stream, resp.StatusCode, raw)
			}
			if stream && !strings.HasSuffix(string(raw), "data: [DONE]\n\n") {
				t.Errorf("%s: the stream does not end with [DONE]: %q", route, raw)
			}
		}
	}
}

// TestMultiTurnConversationIDBound: a conversation id longer than MaxConversationIDBytes is a 400.
func TestMultiTurnConversationIDBound(t *testing.T) {
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	srv, _ := startMultiTurn(t, p, d)
	msgs := []map[string]any{{"role": "user", "content": "hello"}}
	if r := (chatClient{t, srv.URL}).send(strings.Repeat("x", proxy.MaxConversationIDBytes), msgs, false, 2); r.status != 200 {
		t.Errorf("an id of %d bytes: %d %s", proxy.MaxConversationIDBytes, r.status, r.raw)
	}
	r := (chatClient{t, srv.URL}).send(strings.Repeat("x", proxy.MaxConversationIDBytes+1), msgs, false, 2)
	if r.status != 400 || !strings.Contains(r.raw, "conversation_id") {
		t.Errorf("an id of %d bytes: %d %s, want a 400", proxy.MaxConversationIDBytes+1, r.status, r.raw)
	}
}

// TestMultiTurnStoreBoundedByBytes: a client that sends large messages (1 MB of text per turn)
// costs the proxy a digest, not the text: 50 conversations stay far below the byte bound, and a
// small byte bound evicts the least recently stored conversations.
func TestMultiTurnStoreBoundedByBytes(t *testing.T) {
	p, d := startBidirectional(t, "kv_producer", false), startBidirectional(t, "kv_consumer", true)
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)},
		Decode: []proxy.Instance{instanceOf(t, d.URL)}}, MaxConversationBytes: 20 << 10})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mt)
	t.Cleanup(func() { srv.Close(); mt.Close() })
	junk := strings.Repeat("j", 1<<20)
	for i := range 50 {
		// The junk rides in a field the engines ignore; the prompt itself stays short.
		msgs := []map[string]any{{"role": "user", "content": fmt.Sprintf("hello %d", i), "name": junk}}
		if r := (chatClient{t, srv.URL}).send(fmt.Sprintf("conv-%d", i), msgs, false, 2); r.status != 200 {
			t.Fatalf("%d %s", r.status, r.raw)
		}
	}
	if b := mt.Cache().Bytes(); b > 20<<10 {
		t.Errorf("the cache holds %d bytes, bound %d", b, 20<<10)
	}
	n, _ := mt.Cache().Sweep()
	if n == 0 || n == 50 || mt.Cache().Evicted() == 0 {
		t.Errorf("%d conversations cached, %d evicted: want the byte bound to evict some", n, mt.Cache().Evicted())
	}
}

// TestMultiTurnDecoderWithoutParams: a decoder that returns no kv_transfer_params (no
// bidirectional_kv_xfer) makes every turn a miss; the proxy says why once per decoder and counts
// every such turn.
func TestMultiTurnDecoderWithoutParams(t *testing.T) {
	p, d := startBidirectional(t, "kv_producer", false), startEngine(t, "kv_consumer", 4096)
	logs := &logRecorder{}
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)},
		Decode: []proxy.Instance{instanceOf(t, d.URL)}, Logger: slog.New(logs)}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mt)
	t.Cleanup(func() { srv.Close(); mt.Close() })
	msgs := []map[string]any{{"role": "user", "content": "hello"}}
	for turn := range 3 {
		r := (chatClient{t, srv.URL}).send("c", msgs, turn%2 == 1, 4)
		if r.status != 200 || r.header.Get(proxy.HeaderCache) != "miss" {
			t.Fatalf("turn %d: %d %s", turn, r.status, r.header.Get(proxy.HeaderCache))
		}
		msgs = append(msgs, map[string]any{"role": "assistant", "content": r.text}, map[string]any{"role": "user", "content": "more"})
	}
	if n := logs.count("bidirectional_kv_xfer"); n != 1 {
		t.Errorf("%d warnings naming bidirectional_kv_xfer, want 1", n)
	}
	_, raw := do(t, http.MethodGet, srv.URL+"/metrics", nil)
	if !strings.Contains(string(raw), "kvbridge:proxy_decode_without_params_total 3") {
		t.Errorf("metrics lack kvbridge:proxy_decode_without_params_total 3:\n%s", raw)
	}
}

// TestProxyBodyReadDeadline: a client that trickles its request body is answered 408 once the
// proxy's body read deadline passes, through either proxy; nothing reaches the engines.
func TestProxyBodyReadDeadline(t *testing.T) {
	p, d := startEngine(t, "kv_producer", 4096), startEngine(t, "kv_consumer", 4096)
	pr := record(t, p.URL)
	cfg := proxy.Config{Prefill: []proxy.Instance{instanceOf(t, pr.srv.URL)}, Decode: []proxy.Instance{instanceOf(t, d.URL)}, BodyReadTimeout: 100 * time.Millisecond}
	mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	mtSrv := httptest.NewServer(mt)
	t.Cleanup(func() { mtSrv.Close(); mt.Close() })
	for _, url := range []string{startProxy(t, cfg).URL, mtSrv.URL} {
		c, err := net.DialTimeout("tcp", strings.TrimPrefix(url, "http://"), 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		body := `{"model":"kvbridge/tiny","prompt":"slow","max_tokens":2}`
		fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body[:10])
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(raw), "request_timeout") {
			t.Errorf("%s: %d %s, want 408", url, resp.StatusCode, raw)
		}
	}
	if len(pr.bodies) != 0 {
		t.Errorf("P saw %d requests", len(pr.bodies))
	}
}
