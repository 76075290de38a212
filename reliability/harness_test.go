package reliability

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/faultproxy"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

// The deadlines the suite states. Every wait in the suite has one of them.
const (
	// waitFor bounds a condition the system reaches on its own (a pool refilled, a log line).
	waitFor = 10 * time.Second
	// requestDeadline bounds one client request: a fault must be answered well within it.
	requestDeadline = 30 * time.Second
	// slack is added to a component's own deadline (a handshake's, a load's) to bound the
	// client's wait for the answer that deadline produces.
	slack = 15 * time.Second
)

// Model and pool sizes of every engine in the suite.
const (
	blockSize   = 16
	numBlocks   = 256
	maxModelLen = 2048
)

// syncLog is a log sink safe for concurrent writers.
type syncLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *syncLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// fakeClock is a connector clock the test moves; tick runs the connector's sweep (lease
// expiry, heartbeats).
type fakeClock struct {
	mu   sync.Mutex
	now  time.Time
	tick chan time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), tick: make(chan time.Time)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// advance moves the clock by d and runs one sweep (it waits at most waitFor for the connector
// to take the tick).
func (c *fakeClock) advance(t *testing.T, d time.Duration) {
	t.Helper()
	c.mu.Lock()
	c.now = c.now.Add(d)
	now := c.now
	c.mu.Unlock()
	select {
	case c.tick <- now:
	case <-time.After(waitFor):
		t.Fatal("the connector did not take the clock tick")
	}
}

// engineOptions configure one in-process engine.
type engineOptions struct {
	role          connector.Role // "" = no connector (the single reference engine)
	policy        connector.FailurePolicy
	bidirectional bool
	engineID      string
	lease         time.Duration // kv_lease_duration (default 30 s)
	clock         *fakeClock    // nil = real time
	backends      []string      // kv_connector_extra_config.backends
	advertiseTCP  string        // the transfer address published to peers (a fault proxy)
	listenTCP     string        // the transfer listen address (set by start when advertiseTCP is)
	sideChannel   int           // side-channel port; 0 = a free one
	prefix        bool
	model         *model.Model
	numBlocks     int      // KV pool size (default numBlocks)
	allowedPeers  []string // kv_connector_extra_config.allowed_peers
}

// engine is one in-process instance.
type engine struct {
	*instance.Instance
	name  string
	opts  engineOptions
	log   *syncLog
	clock *fakeClock
}

// kvConfig renders o as a --kv-transfer-config document.
func (o engineOptions) kvConfig() map[string]any {
	extra := map[string]any{}
	if o.bidirectional {
		extra["bidirectional_kv_xfer"] = true
	}
	if o.lease > 0 {
		extra["kv_lease_duration"] = o.lease.Seconds()
	}
	if len(o.backends) > 0 {
		extra["backends"] = o.backends
	}
	if o.allowedPeers != nil {
		extra["allowed_peers"] = o.allowedPeers
	}
	doc := map[string]any{"kv_connector": "NixlConnector", "kv_role": string(o.role), "kv_connector_extra_config": extra}
	if o.policy != "" {
		doc["kv_load_failure_policy"] = string(o.policy)
	}
	if o.engineID != "" {
		doc["engine_id"] = o.engineID
	}
	return doc
}

// instanceConfig builds the instance configuration of o.
func (o engineOptions) instanceConfig(log *slog.Logger) (instance.Config, error) {
	blocks := numBlocks
	if o.numBlocks > 0 {
		blocks = o.numBlocks
	}
	cfg := instance.Config{
		Model: model.Tiny, OpenedModel: o.model, Host: "127.0.0.1", NumBlocks: blocks, MaxModelLen: min(maxModelLen, blocks*blockSize),
		BlockSize: blockSize, PrefixCaching: o.prefix, Logger: log, StatsInterval: time.Hour, SideChannelPort: -1,
		PromptTokensDetails: true,
	}
	if o.sideChannel > 0 {
		cfg.SideChannelPort = o.sideChannel
	}
	if o.role == "" {
		return cfg, nil
	}
	doc, _ := json.Marshal(o.kvConfig())
	kv, err := connector.ParseConfig(doc, log)
	if err != nil {
		return cfg, err
	}
	cfg.KVTransfer = kv
	cfg.ConnectorHooks = func(co *connector.Options) {
		if o.clock != nil {
			co.Now, co.Tick = o.clock.Now, o.clock.tick
		}
		if o.advertiseTCP != "" {
			co.Transfer.AdvertiseTCP = o.advertiseTCP
		}
		if o.listenTCP != "" {
			co.Transfer.ListenTCP = o.listenTCP
		}
	}
	return cfg, nil
}

// startEngine starts an in-process engine; at cleanup it is closed.
func startEngine(t *testing.T, name string, o engineOptions) *engine {
	t.Helper()
	e := &engine{name: name, opts: o, log: &syncLog{}, clock: o.clock}
	if err := e.start(t.Context()); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("%s: close: %v", name, err)
		}
		if t.Failed() {
			t.Logf("%s's log:\n%s", name, e.log.String())
		}
	})
	return e
}

func (e *engine) start(ctx context.Context) error {
	log := slog.New(slog.NewTextHandler(e.log, &slog.HandlerOptions{Level: slog.LevelDebug})).With("engine", e.name)
	if e.opts.advertiseTCP != "" {
		// The agent reports the advertised address, so the listener's is chosen here.
		addr, err := freeAddr()
		if err != nil {
			return err
		}
		e.opts.listenTCP = addr
	}
	cfg, err := e.opts.instanceConfig(log)
	if err != nil {
		return err
	}
	in, err := instance.Start(ctx, cfg)
	if err != nil {
		return err
	}
	e.Instance = in
	return nil
}

// restart closes e and starts a new incarnation with the same options (the same engine_id and,
// when it was fixed, the same side-channel port).
func (e *engine) restart(t *testing.T) {
	t.Helper()
	if err := e.Close(); err != nil {
		t.Fatalf("%s: close: %v", e.name, err)
	}
	if err := e.start(t.Context()); err != nil {
		t.Fatalf("%s: restart: %v", e.name, err)
	}
}

// sidePort returns the engine's side-channel port.
func (e *engine) sidePort(t *testing.T) int {
	t.Helper()
	_, p, err := net.SplitHostPort(e.Connector.SideChannelAddr())
	if err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.Atoi(p)
	return n
}

// transferAddr returns the engine's transfer TCP listen address (set when the engine
// advertises another one).
func (e *engine) transferAddr() string { return e.opts.listenTCP }

// freeAddr returns a loopback address with a port that was free a moment ago.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// waitPoolFull waits (at most waitFor) until every block of e's pool is free.
func (e *engine) waitPoolFull(t *testing.T) {
	t.Helper()
	eventually(t, e.name+"'s block pool to be full", func() bool { return e.Pool.NumFree() == e.Pool.NumBlocks() }, func() string {
		return fmt.Sprintf("%d of %d free; stats %+v", e.Pool.NumFree(), e.Pool.NumBlocks(), e.Engine.Stats())
	})
}

// fired waits (at most waitFor) until a fault proxy's stall or cut has acted: its signal, not a
// byte counter, which also moves for bytes merely passing through.
func fired(t *testing.T, what string, sig *faultproxy.Signal) {
	t.Helper()
	tm := time.NewTimer(waitFor)
	defer tm.Stop()
	select {
	case <-sig.Done():
	case <-tm.C:
		t.Fatalf("timed out after %v waiting for %s", waitFor, what)
	case <-t.Context().Done():
		t.Fatalf("test ended while waiting for %s", what)
	}
}

// eventually polls cond (every millisecond) until it holds, failing after waitFor.
func eventually(t *testing.T, what string, cond func() bool, detail ...func() string) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			msg := ""
			for _, d := range detail {
				msg += ": " + d()
			}
			t.Fatalf("timed out after %v waiting for %s%s", waitFor, what, msg)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("test ended while waiting for %s", what)
		case <-time.After(time.Millisecond):
		}
	}
}

// leakCheck labels the test's goroutine so that every goroutine started from it (engines,
// servers, connectors, proxies, clients) carries the label, and at cleanup — after everything
// the test started was closed — waits (at most waitFor) until no labelled goroutine is left.
// Call it first in a test, before anything that registers a cleanup.
func leakCheck(t *testing.T) {
	t.Helper()
	label := t.Name()
	pprof.SetGoroutineLabels(pprof.WithLabels(context.Background(), pprof.Labels("reliability_case", label)))
	t.Cleanup(func() {
		pprof.SetGoroutineLabels(context.Background())
		var stacks string
		deadline := time.Now().Add(waitFor)
		for {
			var n int
			n, stacks = labelled(label)
			if n == 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("%d goroutines started by the test are still running after %v:\n%s", n, waitFor, stacks)
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	})
}

// labelled returns how many goroutines carry the case label, and their stacks.
func labelled(label string) (int, string) {
	var buf bytes.Buffer
	_ = pprof.Lookup("goroutine").WriteTo(&buf, 1)
	want := fmt.Sprintf(`"reliability_case":%q`, label)
	n := 0
	var out strings.Builder
	for _, rec := range strings.Split(buf.String(), "\n\n") {
		if !strings.Contains(rec, want) {
			continue
		}
		first, _, _ := strings.Cut(rec, " @ ")
		k, _ := strconv.Atoi(strings.TrimSpace(first))
		n += k
		out.WriteString(rec + "\n\n")
	}
	return n, out.String()
}

// client is an HTTP client with its own connections, closed at cleanup.
func client(t *testing.T) *http.Client {
	t.Helper()
	tr := &http.Transport{MaxIdleConnsPerHost: 4}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// reply is what a client saw.
type reply struct {
	status  int
	header  http.Header
	raw     string
	text    string
	finish  string
	err     map[string]any // the error object of a JSON error or of an SSE error event
	kv      map[string]any
	elapsed time.Duration
}

// errorCode returns the error's code as a string ("500", "decode_request_failed").
func (r reply) errorCode() string {
	if r.err == nil {
		return ""
	}
	switch c := r.err["code"].(type) {
	case string:
		return c
	case float64:
		return strconv.Itoa(int(c))
	}
	return fmt.Sprint(r.err["code"])
}

// post sends a JSON body (with X-Request-Id reqID when not empty) and parses the answer,
// streaming or not. The request has requestDeadline.
func post(t *testing.T, hc *http.Client, url, reqID string, body map[string]any) reply {
	t.Helper()
	r, err := tryPost(t.Context(), hc, url, reqID, body)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return r
}

// postWithin is post with the deadline d instead of requestDeadline: the case's stated
// deadline plus slack.
func postWithin(t *testing.T, hc *http.Client, d time.Duration, url string, body map[string]any) reply {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	r, err := tryPost(ctx, hc, url, "", body)
	if err != nil {
		t.Fatalf("POST %s (deadline %v): %v", url, d, err)
	}
	return r
}

// tryPost sends body and parses the answer; the request is bounded by ctx and requestDeadline,
// whichever ends first.
func tryPost(ctx context.Context, hc *http.Client, url, reqID string, body map[string]any) (reply, error) {
	data, _ := json.Marshal(body)
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, requestDeadline)
		defer cancel()
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(data))
	req.Header.Set("Content-Type", "application/json")
	if reqID != "" {
		req.Header.Set("X-Request-Id", reqID)
	}
	start := time.Now()
	resp, err := hc.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	r := reply{status: resp.StatusCode, header: resp.Header, raw: string(raw), elapsed: time.Since(start)}
	if err != nil {
		return r, fmt.Errorf("reading the body after %q: %w", raw, err)
	}
	parse(&r, raw, strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream"))
	return r, nil
}

func parse(r *reply, raw []byte, sse bool) {
	apply := func(m map[string]any) {
		if e, ok := m["error"].(map[string]any); ok {
			r.err = e
		}
		if kv, ok := m["kv_transfer_params"].(map[string]any); ok {
			r.kv = kv
		}
		choices, _ := m["choices"].([]any)
		for _, c := range choices {
			ch, _ := c.(map[string]any)
			if s, ok := ch["text"].(string); ok {
				r.text += s
			}
			for _, k := range []string{"message", "delta"} {
				if msg, ok := ch[k].(map[string]any); ok {
					if s, ok := msg["content"].(string); ok {
						r.text += s
					}
				}
			}
			if f, ok := ch["finish_reason"].(string); ok {
				r.finish = f
			}
		}
	}
	if !sse {
		var m map[string]any
		if json.Unmarshal(raw, &m) == nil {
			apply(m)
		}
		return
	}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var m map[string]any
		if json.Unmarshal([]byte(data), &m) == nil {
			apply(m)
		}
	}
}

// chat returns a chat request body.
func chat(msgs []map[string]any, maxTokens int, extra ...any) map[string]any {
	b := map[string]any{"model": model.Tiny, "messages": msgs, "max_tokens": maxTokens, "temperature": 0}
	for i := 0; i+1 < len(extra); i += 2 {
		b[extra[i].(string)] = extra[i+1]
	}
	return b
}

// completion returns a completion request body.
func completion(prompt string, maxTokens int, extra ...any) map[string]any {
	b := map[string]any{"model": model.Tiny, "prompt": prompt, "max_tokens": maxTokens, "temperature": 0}
	for i := 0; i+1 < len(extra); i += 2 {
		b[extra[i].(string)] = extra[i+1]
	}
	return b
}

func user(s string) map[string]any { return map[string]any{"role": "user", "content": s} }

func assistant(s string) map[string]any { return map[string]any{"role": "assistant", "content": s} }

// longPrompt returns a prompt of several blocks, distinct per seed.
func longPrompt(seed int) string {
	return fmt.Sprintf("Conversation %d. ", seed) + strings.Repeat(fmt.Sprintf("the KV cache of prompt %d moves between engines; ", seed), 8)
}

// reference is the single-instance engine that says what the right answer is.
type reference struct {
	e  *engine
	hc *http.Client
}

func startReference(t *testing.T) *reference {
	t.Helper()
	return &reference{e: startEngine(t, "single", engineOptions{}), hc: client(t)}
}

// answer returns the single engine's answer to body (on the same route).
func (r *reference) answer(t *testing.T, route string, body map[string]any) string {
	t.Helper()
	b := maps.Clone(body)
	delete(b, "conversation_id")
	delete(b, "kv_transfer_params")
	b["stream"] = false
	rep := post(t, r.hc, r.e.URL+route, "", b)
	if rep.status != 200 {
		t.Fatalf("single engine: %d %s", rep.status, rep.raw)
	}
	return rep.text
}

// proxyOptions configure the proxy in front of P and D.
type proxyOptions struct {
	multiTurn bool
	// rewrite maps side-channel ports to the ports a consumer should dial instead (a fault
	// proxy in front of the side channel): the proxy's engine legs rewrite remote_port.
	rewrite       map[int]int
	idle          time.Duration // the proxy's IdleTimeout (default 2 minutes)
	headerTimeout time.Duration // the wait for an engine's response headers (default 1 minute)
}

// runningProxy is a P/D proxy served on 127.0.0.1.
type runningProxy struct {
	URL string
	mt  *proxy.MultiTurn
	srv *httptest.Server
	h   interface {
		http.Handler
		Close() error
	}
	legs      *faultproxy.PortRewriter
	closeOnce sync.Once
}

// startProxy starts the one-way or multi-turn proxy in front of the engines at pURL and dURL
// (an engine's URL or a fault proxy's).
func startProxy(t *testing.T, pURL, dURL string, o proxyOptions) *runningProxy {
	t.Helper()
	inst := func(u string) proxy.Instance {
		host, port, err := net.SplitHostPort(strings.TrimPrefix(u, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.Atoi(port)
		in, err := proxy.NewInstance(host, n)
		if err != nil {
			t.Fatal(err)
		}
		return in
	}
	header := o.headerTimeout
	if header <= 0 {
		header = time.Minute
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 16, ResponseHeaderTimeout: header}
	hook := faultproxy.NewPortRewriter(tr, o.rewrite)
	cfg := proxy.Config{Prefill: []proxy.Instance{inst(pURL)}, Decode: []proxy.Instance{inst(dURL)}, Transport: hook, IdleTimeout: o.idle, HeaderTimeout: header}
	rp := &runningProxy{legs: hook}
	if o.multiTurn {
		mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: cfg})
		if err != nil {
			t.Fatal(err)
		}
		rp.mt, rp.h = mt, mt
	} else {
		ow, err := proxy.NewOneWay(cfg)
		if err != nil {
			t.Fatal(err)
		}
		rp.h = ow
	}
	rp.srv = httptest.NewServer(rp.h)
	rp.URL = rp.srv.URL
	t.Cleanup(func() { rp.close(); tr.CloseIdleConnections() })
	return rp
}

func (rp *runningProxy) close() {
	rp.closeOnce.Do(func() {
		rp.srv.Close()
		rp.h.Close()
	})
}

// setRewrite replaces the side-channel port map.
func (rp *runningProxy) setRewrite(ports map[int]int) {
	rp.legs.SetPorts(ports)
}

// beforeLeg sets a function called before each engine leg leaves the proxy, with the leg's
// host:port; nil removes it.
func (rp *runningProxy) beforeLeg(f func(hostPort string)) {
	rp.legs.SetBefore(f)
}

// newFaultProxy starts a fault proxy to target (may be ""), closed at cleanup.
func newFaultProxy(t *testing.T, target string) *faultproxy.Proxy {
	t.Helper()
	fp, err := faultproxy.New(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fp.Close() })
	return fp
}

// hostPort returns host:port of an http:// URL.
func hostPort(url string) string { return strings.TrimPrefix(url, "http://") }

// metric scrapes url/metrics and returns the sum of every series of name (name may end with
// a label selector such as `{finished_reason="abort"}`, matched as a substring of the labels).
func metric(t *testing.T, hc *http.Client, url, name string) float64 {
	t.Helper()
	name, labels, _ := strings.Cut(name, "{")
	labels = strings.TrimSuffix(labels, "}")
	ctx, cancel := context.WithTimeout(t.Context(), requestDeadline)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, line := range strings.Split(string(raw), "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		if labels != "" && !strings.Contains(line, labels) {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// waitMetric waits (at most waitFor) until the metric reaches at least want.
func waitMetric(t *testing.T, hc *http.Client, url, name string, want float64) {
	t.Helper()
	var got float64
	eventually(t, fmt.Sprintf("%s ≥ %v at %s", name, want, url), func() bool {
		got = metric(t, hc, url, name)
		return got >= want
	}, func() string { return fmt.Sprintf("last value %v", got) })
}
