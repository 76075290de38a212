package openai

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/model"
)

// Test limits of the harness (tiny model).
const (
	testBlockSize   = 16
	testNumBlocks   = 64
	testMaxModelLen = 256
	testModelName   = "tiny"
	testWait        = 30 * time.Second // bound on every wait in these tests
)

// env is a real server: the built-in tiny model, a real pool and engine, on 127.0.0.1:0.
type env struct {
	model  *model.Model
	pool   *kvcache.Pool
	engine *engine.Engine
	server *Server
	http   *httptest.Server
	reg    *metrics.Registry

	// handlerDone receives once per finished HTTP handler (to know a request is fully over).
	handlerDone chan struct{}
}

// envEngineOption adjusts the engine config of a test env; newEnv's other options are
// func(*Config), adjusting the server config, and envModel.
type envEngineOption func(*engine.Config)

// envModel is a newEnv option: the model to serve instead of kvbridge/tiny.
type envModel string

// envSmallSendBuffers is a newEnv option: the server's connections get the smallest send
// buffers the kernel allows (fixture.ShrinkSendBuffers), so that writes to a client that does
// not read block after a few KiB.
type envSmallSendBuffers struct{}

func newEnv(t testing.TB, opts ...any) *env {
	t.Helper()
	name := model.Tiny
	for _, o := range opts {
		if o, ok := o.(envModel); ok {
			name = string(o)
		}
	}
	m, err := model.Open(t.Context(), name, model.OpenOptions{})
	if err != nil {
		t.Fatalf("open %s: %v", name, err)
	}
	t.Cleanup(func() { m.Close() })
	geo := engine.KVGeometry(m, testBlockSize) // the model's KV cache dtype: bfloat16 for a bf16 checkpoint
	pool, err := kvcache.NewPool(kvcache.AlignedMemory(geo.BlockBytes()*testNumBlocks),
		kvcache.PoolConfig{Geometry: geo, NumBlocks: testNumBlocks, PrefixCaching: true})
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	log := slog.New(slog.DiscardHandler)
	ecfg := engine.Config{
		BlockSize: testBlockSize, NumBlocks: testNumBlocks, MaxModelLen: testMaxModelLen,
		MaxNumSeqs: 8, MaxNumBatchedTokens: 256, PrefixCaching: true, Seed: 1,
	}
	reg := metrics.NewRegistry()
	cfg := Config{ServedModelNames: []string{testModelName, "alias"}, MaxModelLen: testMaxModelLen,
		Logger: log, Metrics: reg, Version: "test", PromptTokensDetails: true}
	for _, o := range opts {
		switch o := o.(type) {
		case func(*Config):
			o(&cfg)
		case envEngineOption:
			o(&ecfg)
		case envModel, envSmallSendBuffers:
		default:
			t.Fatalf("unknown env option %T", o)
		}
	}
	eng, err := engine.New(m, pool, ecfg, log)
	if err != nil {
		t.Fatalf("engine: %v", err)
	}
	e := &env{model: m, pool: pool, engine: eng, reg: reg, handlerDone: make(chan struct{}, 64)}
	e.server = NewServer(cfg, eng, m)
	e.http = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			select {
			case e.handlerDone <- struct{}{}:
			default:
			}
		}()
		e.server.ServeHTTP(w, r)
	}))
	for _, o := range opts {
		if _, ok := o.(envSmallSendBuffers); ok {
			fixture.ShrinkSendBuffers(e.http.Config)
		}
	}
	e.http.Start()
	t.Cleanup(func() {
		e.http.Close() // waits for handlers to return
		if free, n := pool.NumFree(), pool.NumBlocks(); free != n {
			t.Errorf("pool not full after the test: %d of %d blocks free", free, n)
		}
		eng.Close()
	})
	return e
}

// do sends a request and returns the response with its body read.
func (e *env) do(t testing.TB, method, path string, body []byte, hdr map[string]string) (*http.Response, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), testWait)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, e.http.URL+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := e.http.Client().Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, path, err)
	}
	return resp, b
}

// post sends a JSON body (a string or a value to marshal).
func (e *env) post(t testing.TB, path string, body any, hdr map[string]string) (*http.Response, []byte) {
	t.Helper()
	var b []byte
	switch v := body.(type) {
	case string:
		b = []byte(v)
	case []byte:
		b = v
	default:
		var err error
		if b, err = json.Marshal(v); err != nil {
			t.Fatal(err)
		}
	}
	return e.do(t, http.MethodPost, path, b, hdr)
}

// decode unmarshals a JSON body into a generic map, failing the test on error.
func decode(t testing.TB, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("response is not a JSON object: %v\n%s", err, b)
	}
	return m
}

// sseEvents parses an SSE body strictly: every event is "data: <payload>" followed by a blank
// line; it returns the payloads (the last must be [DONE]).
func sseEvents(t testing.TB, body []byte) []string {
	t.Helper()
	var events []string
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	expectBlank := false
	for sc.Scan() {
		line := sc.Text()
		if expectBlank {
			if line != "" {
				t.Fatalf("SSE event not followed by a blank line: %q", line)
			}
			expectBlank = false
			continue
		}
		payload, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("SSE line without the data: prefix: %q", line)
		}
		events = append(events, payload)
		expectBlank = true
	}
	if len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("SSE stream does not end with [DONE]: %q", events)
	}
	for _, ev := range events[:len(events)-1] {
		if ev == "[DONE]" {
			t.Fatalf("[DONE] before the end of the stream: %q", events)
		}
	}
	return events
}

// errorOf checks an OpenAI error body and returns its error object.
func errorOf(t testing.TB, b []byte, status int) map[string]any {
	t.Helper()
	m := decode(t, b)
	e, ok := m["error"].(map[string]any)
	if !ok {
		t.Fatalf("no error object in %s", b)
	}
	if _, ok := e["message"].(string); !ok {
		t.Errorf("error.message missing: %s", b)
	}
	if _, ok := e["type"].(string); !ok {
		t.Errorf("error.type missing: %s", b)
	}
	if _, ok := e["param"]; !ok {
		t.Errorf("error.param missing: %s", b)
	}
	if code, _ := e["code"].(float64); int(code) != status {
		t.Errorf("error.code = %v, want %d: %s", e["code"], status, b)
	}
	return e
}
