package connector_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/openai"
	"github.com/kvbridge/kvbridge/proxy"
	"github.com/kvbridge/kvbridge/transfer"
)

// The tests in this package start real engines (kvbridge/tiny on a real KV pool in a shared
// arena), real connectors with real transfer agents and side channels on 127.0.0.1, real
// OpenAI HTTP servers and the real proxy.

// models caches opened models per test binary: opening kvbridge/tiny is deterministic and the
// model is read-only, so sharing it only saves time.
var models sync.Map

func openModel(t testing.TB, name string) *model.Model { return openModelKV(t, name, "") }

// openModelKV is openModel with the KV cache dtype kv ("" or "auto": the model's own).
func openModelKV(t testing.TB, name, kv string) *model.Model { return openModelTP(t, name, kv, 1) }

// openModelTP is openModelKV on tp tensor-parallel ranks.
func openModelTP(t testing.TB, name, kv string, tp int) *model.Model {
	t.Helper()
	key := fmt.Sprintf("%s|%s|%d", name, kv, tp)
	if m, ok := models.Load(key); ok {
		return m.(*model.Model)
	}
	m, err := model.Open(context.Background(), name, model.OpenOptions{KVCacheDType: kv, TensorParallelSize: tp})
	if err != nil {
		t.Fatal(err)
	}
	actual, loaded := models.LoadOrStore(key, m)
	if loaded {
		m.Close()
	}
	return actual.(*model.Model)
}

// nodeOptions configure one engine.
type nodeOptions struct {
	model     string
	kvConfig  string // --kv-transfer-config JSON; "" = no connector
	blockSize int
	numBlocks int
	layout    kvcache.Layout
	prefix    bool
	now       func() time.Time
	tick      chan time.Time
	transfer  transfer.Config
	compat    func(*connector.CompatFactors)
	maxSeqs   int
	logw      io.Writer
	// maxRequests is the HTTP server's MaxConcurrentRequests (0: no limit).
	maxRequests int

	// kvCacheDType is the model's --kv-cache-dtype ("": the model's own).
	kvCacheDType string
	// tp is the model's tensor-parallel size (default 1): ranks 1, 2, … get arenas of their own.
	tp int
	// layerHook, if set, is called on the engine's step loop after the connector queued each
	// layer of a step that streams layer by layer, with the step's number among those (from 1).
	layerHook func(step, layer int)
}

// hookedConnector is a Connector whose layer-by-layer streaming calls hook after each layer.
type hookedConnector struct {
	*connector.Connector
	hook  func(step, layer int)
	steps int // streaming steps so far: the step loop's only
}

// StreamStep implements engine.LayerStreamer around the connector's own.
func (h *hookedConnector) StreamStep(work []engine.Work, preempted []*engine.Sequence) func(layer int) {
	done := h.Connector.StreamStep(work, preempted)
	if done == nil {
		return nil
	}
	h.steps++
	step := h.steps
	return func(layer int) {
		done(layer)
		h.hook(step, layer)
	}
}

// node is one running engine with its HTTP server.
type node struct {
	name  string
	eng   *engine.Engine
	conn  *connector.Connector
	pool  *kvcache.Pool
	arena *transfer.Arena
	ranks []*transfer.Arena // tensor-parallel ranks 1, 2, …
	srv   *httptest.Server
	reg   *metrics.Registry
	em    *metrics.EngineMetrics
	host  string
	port  int
}

func startNode(t *testing.T, name string, o nodeOptions) *node {
	t.Helper()
	if o.model == "" {
		o.model = model.Tiny
	}
	if o.blockSize == 0 {
		o.blockSize = 16
	}
	if o.numBlocks == 0 {
		o.numBlocks = 256
	}
	m := openModelTP(t, o.model, o.kvCacheDType, max(o.tp, 1))
	geo := engine.KVGeometry(m, o.blockSize)
	geo.Layout = o.layout
	layout := connector.NewArenaLayout(geo.BlockBytes(), o.numBlocks)
	arena, err := transfer.NewArena(name, layout.Size)
	if err != nil {
		t.Fatal(err)
	}
	var ranks []*transfer.Arena
	var rankMem [][]byte
	for r := 1; r < m.TensorParallelSize(); r++ {
		a, err := transfer.NewArena(fmt.Sprintf("%s-tp%d", name, r), int64(geo.BlockBytes())*int64(o.numBlocks))
		if err != nil {
			t.Fatal(err)
		}
		ranks, rankMem = append(ranks, a), append(rankMem, a.Bytes())
	}
	pool, err := kvcache.NewPool(arena.Bytes(), kvcache.PoolConfig{Geometry: geo, NumBlocks: o.numBlocks, PrefixCaching: o.prefix,
		RecordTable: layout.RecordTable(arena.Bytes()), RankMemory: rankMem})
	if err != nil {
		t.Fatal(err)
	}
	n := &node{name: name, pool: pool, arena: arena, ranks: ranks, reg: metrics.NewRegistry()}
	n.em = n.reg.Engine(m.Name(), "0")
	logw := o.logw
	if logw == nil {
		logw = io.Discard
	}
	log := slog.New(slog.NewTextHandler(logw, nil)).With("node", name)
	maxLen := min(2048, o.numBlocks*o.blockSize)
	ecfg := engine.Config{BlockSize: o.blockSize, NumBlocks: o.numBlocks, MaxModelLen: maxLen, MaxNumBatchedTokens: 256, PrefixCaching: o.prefix, MaxNumSeqs: o.maxSeqs}
	if o.kvConfig != "" {
		cfg, err := connector.ParseConfig([]byte(o.kvConfig), log)
		if err != nil {
			t.Fatal(err)
		}
		mc := m.Config()
		compat := connector.CompatFactors{Model: m.Name(), DType: "float32", NumKVHeads: mc.NumKVHeads, HeadSize: mc.HeadDim, NumLayers: mc.NumLayers, CacheDType: m.KVCacheDType()}
		if o.compat != nil {
			o.compat(&compat)
		}
		var tick <-chan time.Time
		if o.tick != nil {
			tick = o.tick
		}
		n.conn, err = connector.New(connector.Options{
			Config: cfg, Pool: pool, Arena: arena, Layout: layout, Compat: compat, RankArenas: ranks,
			SideChannelAddr: "127.0.0.1:0", Logger: log, Metrics: n.em.Nixl(),
			Now: o.now, Tick: tick, Transfer: o.transfer, VocabSize: mc.VocabSize,
		})
		if err != nil {
			t.Fatal(err)
		}
		// As instance.Start does.
		n.reg.Prometheus().MustRegister(n.conn.AuthRefusalsCollector(map[string]string{metrics.LabelModelName: m.Name(), metrics.LabelEngine: "0"}))
		ecfg.Connector = n.conn
		if o.layerHook != nil {
			ecfg.Connector = &hookedConnector{Connector: n.conn, hook: o.layerHook}
		}
		if cfg.LoadFailurePolicy == connector.PolicyRecompute {
			ecfg.KVLoadFailurePolicy = engine.FailurePolicyRecompute
		}
	}
	n.eng, err = engine.New(m, pool, ecfg, log)
	if err != nil {
		t.Fatal(err)
	}
	if n.conn != nil {
		n.conn.Start(n.eng)
	}
	ocfg := openai.Config{ServedModelNames: []string{m.Name()}, MaxModelLen: maxLen, Metrics: n.reg, Logger: log,
		MaxConcurrentRequests: o.maxRequests, PromptTokensDetails: true}
	if n.conn != nil {
		ocfg.DeclineKV = n.conn.Decline // as instance.Start does
		ocfg.CheckKV = n.conn.CheckRole
	}
	n.srv = httptest.NewServer(openai.NewServer(ocfg, n.eng, m))
	n.host, n.port = hostPort(t, n.srv.URL)
	t.Cleanup(func() { n.close(t) })
	return n
}

// close shuts the node down and checks that every block came back to the pool.
func (n *node) close(t *testing.T) {
	n.srv.Close()
	if err := n.eng.Close(); err != nil {
		t.Errorf("%s: engine close: %v", n.name, err)
	}
	if n.conn != nil {
		if err := n.conn.Close(); err != nil {
			t.Errorf("%s: connector close: %v", n.name, err)
		}
		if err := n.conn.Close(); err != nil {
			t.Errorf("%s: second connector close: %v", n.name, err)
		}
	}
	if free, all := n.pool.NumFree(), n.pool.NumBlocks(); free != all {
		t.Errorf("%s: %d of %d blocks free after close", n.name, free, all)
	}
	for _, a := range append([]*transfer.Arena{n.arena}, n.ranks...) {
		if err := a.Close(); err != nil {
			t.Errorf("%s: arena close: %v", n.name, err)
		}
	}
}

// waitPoolFull waits (with a deadline) until every block of n's pool is free: the engine
// applies frees on its own goroutine, after a notification or a lease expiry.
func (n *node) waitPoolFull(t *testing.T) {
	t.Helper()
	eventually(t, n.name+"'s pool to be full", func() bool { return n.pool.NumFree() == n.pool.NumBlocks() })
}

func hostPort(t testing.TB, url string) (string, int) {
	t.Helper()
	var port int
	if _, err := fmt.Sscanf(strings.TrimPrefix(url, "http://"), "127.0.0.1:%d", &port); err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	return "127.0.0.1", port
}

// startProxy runs the one-way proxy in front of P and D.
func startProxy(t *testing.T, p, d *node) *httptest.Server {
	t.Helper()
	pi, _ := proxy.NewInstance(p.host, p.port)
	di, _ := proxy.NewInstance(d.host, d.port)
	h, err := proxy.NewOneWay(proxy.Config{Prefill: []proxy.Instance{pi}, Decode: []proxy.Instance{di}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(func() { srv.Close(); h.Close() })
	return srv
}

// post sends a JSON body and returns the status and the decoded body (or, for SSE, the
// assembled text and the final usage). Tests call it from goroutines of their own too, so a
// failure is t.Errorf and status 0 (with the error in Raw), never t.Fatal: that would end only
// the calling goroutine, and leave the test waiting for what it was to send.
func post(t testing.TB, url string, body map[string]any) (int, result) {
	t.Helper()
	data, _ := json.Marshal(body)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Errorf("POST %s: %v", url, err)
		return 0, result{Raw: err.Error()}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Errorf("POST %s: reading the body: %v", url, err)
		return 0, result{Raw: err.Error()}
	}
	return resp.StatusCode, parseResult(t, raw, strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream"))
}

// result is what a client saw.
type result struct {
	Text         string
	FinishReason string
	Usage        map[string]any
	KVParams     map[string]any
	Error        map[string]any
	Raw          string
}

// parseResult decodes a response body; like post, it fails the test with t.Errorf.
func parseResult(t testing.TB, raw []byte, sse bool) result {
	t.Helper()
	r := result{Raw: string(raw)}
	apply := func(m map[string]any) {
		if e, ok := m["error"].(map[string]any); ok {
			r.Error = e
		}
		if u, ok := m["usage"].(map[string]any); ok {
			r.Usage = u
		}
		if kv, ok := m["kv_transfer_params"].(map[string]any); ok {
			r.KVParams = kv
		}
		choices, _ := m["choices"].([]any)
		for _, c := range choices {
			ch := c.(map[string]any)
			if s, ok := ch["text"].(string); ok {
				r.Text += s
			}
			for _, k := range []string{"message", "delta"} {
				if msg, ok := ch[k].(map[string]any); ok {
					if s, ok := msg["content"].(string); ok {
						r.Text += s
					}
				}
			}
			if f, ok := ch["finish_reason"].(string); ok {
				r.FinishReason = f
			}
		}
	}
	if !sse {
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Errorf("response is not JSON: %v: %s", err, raw)
			return r
		}
		apply(m)
		return r
	}
	for _, line := range strings.Split(string(raw), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(data), &m); err != nil {
			t.Errorf("SSE event is not JSON: %v: %s", err, data)
			continue
		}
		apply(m)
	}
	return r
}

func cachedTokens(r result) int {
	d, _ := r.Usage["prompt_tokens_details"].(map[string]any)
	f, _ := d["cached_tokens"].(float64)
	return int(f)
}

// fakeClock is a settable clock for leases and heartbeats; the connector's sweeps run when the
// test sends on tick.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// eventually waits until cond holds, failing the test after 10 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		select {
		case <-t.Context().Done():
			t.Fatal("test ended")
		case <-time.After(2 * time.Millisecond):
		}
	}
}
