package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

// The proxy is tested against real engines (kvbridge/tiny with real connectors). A recorder —
// a plain reverse proxy — may sit in front of an engine to show what the proxy sent it.

var tiny struct {
	once sync.Once
	m    *model.Model
	err  error
}

func openTiny(t *testing.T) *model.Model {
	t.Helper()
	tiny.once.Do(func() { tiny.m, tiny.err = model.Open(context.Background(), model.Tiny, model.OpenOptions{}) })
	if tiny.err != nil {
		t.Fatal(tiny.err)
	}
	return tiny.m
}

func startEngine(t *testing.T, role string, maxLen int, opts ...func(*instance.Config)) *instance.Instance {
	t.Helper()
	cfg := instance.Config{OpenedModel: openTiny(t), Host: "127.0.0.1", NumBlocks: 512, MaxModelLen: maxLen, PrefixCaching: true, SideChannelPort: -1}
	for _, o := range opts {
		o(&cfg)
	}
	if role != "" {
		kv, err := connector.ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"`+role+`"}`), nil)
		if err != nil {
			t.Fatal(err)
		}
		cfg.KVTransfer = kv
	}
	return startInstance(t, cfg)
}

// startInstance starts an engine of cfg; its cleanup checks that its pool is full again.
func startInstance(t *testing.T, cfg instance.Config) *instance.Instance {
	t.Helper()
	in, err := instance.Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := in.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if in.Pool.NumFree() != in.Pool.NumBlocks() {
			t.Errorf("%d of %d blocks free after close", in.Pool.NumFree(), in.Pool.NumBlocks())
		}
	})
	return in
}

// recorder forwards to target and keeps the bodies and headers of the legs (POSTs) it saw.
type recorder struct {
	mu     sync.Mutex
	bodies []map[string]any
	ids    []string
	srv    *httptest.Server
}

func record(t *testing.T, target string) *recorder {
	t.Helper()
	u, _ := url.Parse(target)
	rp := httputil.NewSingleHostReverseProxy(u)
	r := &recorder{}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodPost {
			rp.ServeHTTP(w, req) // the proxy's questions (GET /v1/kv_transfer), not legs
			return
		}
		data, _ := io.ReadAll(req.Body)
		var m map[string]any
		_ = json.Unmarshal(data, &m)
		r.mu.Lock()
		r.bodies = append(r.bodies, m)
		r.ids = append(r.ids, req.Header.Get("X-Request-Id"))
		r.mu.Unlock()
		req.Body = io.NopCloser(bytes.NewReader(data))
		rp.ServeHTTP(w, req)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

func instanceOf(t *testing.T, rawURL string) proxy.Instance {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(u.Host)
	var p int
	for _, c := range port {
		p = p*10 + int(c-'0')
	}
	in, err := proxy.NewInstance(host, p)
	if err != nil {
		t.Fatal(err)
	}
	return in
}

func startProxy(t *testing.T, cfg proxy.Config) *httptest.Server {
	t.Helper()
	h, err := proxy.NewOneWay(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(func() { srv.Close(); h.Close() })
	return srv
}

func do(t *testing.T, method, url string, body any, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		data, _ := json.Marshal(body)
		rd = bytes.NewReader(data)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, method, url, rd)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp, raw
}

// TestOneWayLegs covers conformance items 1–3: what P and D receive, and one request id.
func TestOneWayLegs(t *testing.T) {
	p, d := startEngine(t, "kv_producer", 4096), startEngine(t, "kv_consumer", 4096)
	pr, dr := record(t, p.URL), record(t, d.URL)
	px := startProxy(t, proxy.Config{Prefill: []proxy.Instance{instanceOf(t, pr.srv.URL)}, Decode: []proxy.Instance{instanceOf(t, dr.srv.URL)}})
	body := map[string]any{"model": "kvbridge/tiny", "prompt": "hello there", "max_tokens": 5, "max_completion_tokens": 5, "min_tokens": 2,
		"stream": true, "stream_options": map[string]any{"include_usage": true}, "temperature": 0, "extra_field": []any{1.5, "x"}}
	resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", body, "X-Request-Id", "my-id-1")
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") || !strings.Contains(string(raw), "data: [DONE]") {
		t.Fatalf("%d %s %s", resp.StatusCode, resp.Header.Get("Content-Type"), raw)
	}
	if resp.Header.Get("X-Request-Id") != "my-id-1" || pr.ids[0] != "my-id-1" || dr.ids[0] != "my-id-1" {
		t.Errorf("request ids: client %q, P %q, D %q", resp.Header.Get("X-Request-Id"), pr.ids[0], dr.ids[0])
	}
	pb := pr.bodies[0]
	if pb["stream"] != false || pb["max_tokens"] != 1.0 || pb["max_completion_tokens"] != 1.0 {
		t.Errorf("P's body: %v", pb)
	}
	for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
		if _, ok := pb[k]; ok {
			t.Errorf("P's body still has %s", k)
		}
	}
	kv := pb["kv_transfer_params"].(map[string]any)
	if kv["do_remote_decode"] != true || kv["do_remote_prefill"] != false || kv["remote_block_ids"] != nil {
		t.Errorf("P's kv_transfer_params: %v", kv)
	}
	db := dr.bodies[0]
	dkv, _ := db["kv_transfer_params"].(map[string]any)
	if dkv["do_remote_prefill"] != true || dkv["remote_engine_id"] != p.Connector.EngineID() {
		t.Errorf("D's kv_transfer_params: %v", dkv)
	}
	delete(db, "kv_transfer_params")
	want := map[string]any{}
	data, _ := json.Marshal(body)
	_ = json.Unmarshal(data, &want)
	if a, b := mustJSON(db), mustJSON(want); a != b {
		t.Errorf("D's body changed beyond the params:\n got %s\nwant %s", a, b)
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// TestOneWayRoundRobin covers item 3's independent cursors and item 4's /healthcheck.
func TestOneWayRoundRobin(t *testing.T) {
	var ps, ds []*recorder
	var pis, dis []proxy.Instance
	for range 2 {
		p := record(t, startEngine(t, "kv_producer", 4096).URL)
		d := record(t, startEngine(t, "kv_consumer", 4096).URL)
		ps, ds = append(ps, p), append(ds, d)
		pis, dis = append(pis, instanceOf(t, p.srv.URL)), append(dis, instanceOf(t, d.srv.URL))
	}
	px := startProxy(t, proxy.Config{Prefill: pis, Decode: dis})
	for i := range 4 {
		if resp, raw := do(t, http.MethodPost, px.URL+"/v1/chat/completions", map[string]any{"model": "kvbridge/tiny", "messages": []any{map[string]any{"role": "user", "content": "hi"}}, "max_tokens": 2, "seed": i}); resp.StatusCode != 200 {
			t.Fatal(string(raw))
		}
	}
	for i := range 2 {
		if len(ps[i].bodies) != 2 || len(ds[i].bodies) != 2 {
			t.Errorf("instance %d got %d prefills and %d decodes, want 2 and 2", i, len(ps[i].bodies), len(ds[i].bodies))
		}
	}
	resp, raw := do(t, http.MethodGet, px.URL+"/healthcheck", nil)
	var h map[string]any
	if resp.StatusCode != 200 || json.Unmarshal(raw, &h) != nil || h["status"] != "ok" || h["prefill_instances"] != 2.0 || h["decode_instances"] != 2.0 {
		t.Errorf("/healthcheck: %d %s", resp.StatusCode, raw)
	}
	if resp, raw := do(t, http.MethodGet, px.URL+"/v1/models", nil); resp.StatusCode != 200 || !strings.Contains(string(raw), "kvbridge/tiny") {
		t.Errorf("/v1/models: %d %s", resp.StatusCode, raw)
	}
}

// TestOneWayErrorsReachTheClient: D's own status and error body reach the client (vllm#23981),
// a P that cannot be reached is a 502 with a JSON code, bad JSON is a 400.
func TestOneWayErrorsReachTheClient(t *testing.T) {
	p, d := startEngine(t, "kv_producer", 2048), startEngine(t, "kv_consumer", 256)
	px := startProxy(t, proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, d.URL)}})
	long := make([]int, 300) // fits P's max_model_len, not D's
	for i := range long {
		long[i] = 400 + i
	}
	for _, stream := range []bool{false, true} {
		resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": long, "max_tokens": 4, "stream": stream})
		if resp.StatusCode != 400 || !strings.Contains(string(raw), `"error"`) {
			t.Errorf("D's rejection (stream=%v): %d %s, want D's 400", stream, resp.StatusCode, raw)
		}
	}
	closed := httptest.NewServer(http.NotFoundHandler())
	deadP := instanceOf(t, closed.URL)
	closed.Close()
	px2 := startProxy(t, proxy.Config{Prefill: []proxy.Instance{deadP}, Decode: []proxy.Instance{instanceOf(t, d.URL)}})
	resp, raw := do(t, http.MethodPost, px2.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": "x", "max_tokens": 2})
	var e struct {
		Error struct{ Code string } `json:"error"`
	}
	if resp.StatusCode != 502 || json.Unmarshal(raw, &e) != nil || e.Error.Code != "prefill_request_failed" {
		t.Errorf("dead P: %d %s", resp.StatusCode, raw)
	}
	req, _ := http.NewRequest(http.MethodPost, px.URL+"/v1/completions", strings.NewReader("{not json"))
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 400 {
		t.Errorf("bad JSON: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
}

// TestOneWayClientDisconnectCancelsDecode: a streaming client that goes away aborts D's request,
// whose blocks return to the pool.
func TestOneWayClientDisconnectCancelsDecode(t *testing.T) {
	p, d := startEngine(t, "kv_producer", 4096), startEngine(t, "kv_consumer", 4096)
	px := startProxy(t, proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, d.URL)}})
	ctx, cancel := context.WithCancel(t.Context())
	data, _ := json.Marshal(map[string]any{"model": "kvbridge/tiny", "prompt": "go on forever", "max_tokens": 3000, "ignore_eos": true, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, px.URL+"/v1/completions", bytes.NewReader(data))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	for range 3 { // a few events arrive one by one: the relay flushes
		if _, err := br.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	resp.Body.Close()
	deadline := time.Now().Add(10 * time.Second)
	for d.Pool.NumFree() != d.Pool.NumBlocks() || p.Pool.NumFree() != p.Pool.NumBlocks() {
		if time.Now().After(deadline) {
			t.Fatalf("D %d/%d, P %d/%d blocks free 10 s after the client left", d.Pool.NumFree(), d.Pool.NumBlocks(), p.Pool.NumFree(), p.Pool.NumBlocks())
		}
		select {
		case <-t.Context().Done():
			return
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// TestPrefillLegDropsDecodeOnlyFields: P's one-token leg carries neither n, best_of, logprobs,
// top_logprobs, echo nor prompt_logprobs (only D answers them), but keeps the sampling
// parameters; D gets the client's body and answers all of it.
func TestPrefillLegDropsDecodeOnlyFields(t *testing.T) {
	p, d := startEngine(t, "kv_producer", 4096), startEngine(t, "kv_consumer", 4096)
	pr, dr := record(t, p.URL), record(t, d.URL)
	px := startProxy(t, proxy.Config{Prefill: []proxy.Instance{instanceOf(t, pr.srv.URL)}, Decode: []proxy.Instance{instanceOf(t, dr.srv.URL)}})
	body := map[string]any{"model": "kvbridge/tiny", "prompt": "several answers please", "max_tokens": 4, "n": 2, "best_of": 2,
		"logprobs": 1, "echo": true, "prompt_logprobs": 1, "presence_penalty": 0.5, "logit_bias": map[string]any{"7": -1}, "seed": 3}
	resp, raw := do(t, http.MethodPost, px.URL+"/v1/completions", body)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, raw)
	}
	pb := pr.bodies[0]
	for _, k := range []string{"n", "best_of", "logprobs", "top_logprobs", "echo", "prompt_logprobs"} {
		if _, ok := pb[k]; ok {
			t.Errorf("P's body still has %s: %v", k, pb)
		}
	}
	if pb["presence_penalty"] != 0.5 || pb["seed"] != 3.0 || pb["logit_bias"] == nil {
		t.Errorf("P's body lost sampling parameters: %v", pb)
	}
	if db := dr.bodies[0]; db["n"] != 2.0 || db["echo"] != true || db["prompt_logprobs"] != 1.0 {
		t.Errorf("D's body: %v", db)
	}
	var out struct {
		Choices []struct {
			Logprobs       map[string]any `json:"logprobs"`
			PromptLogprobs []any          `json:"prompt_logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(raw, &out); err != nil || len(out.Choices) != 2 || out.Choices[1].Logprobs == nil || len(out.Choices[0].PromptLogprobs) == 0 {
		t.Errorf("answer through the proxy: %s", raw)
	}
}
