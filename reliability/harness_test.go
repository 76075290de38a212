package reliability

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/faultproxy"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
	kvstack "github.com/kvbridge/kvbridge/stack"
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
	keepSidePort  bool          // restarts keep the side-channel port
	prefix        bool
	model         *model.Model
	numBlocks     int      // KV pool size (default numBlocks)
	allowedPeers  []string // kv_connector_extra_config.allowed_peers
	faults        kvstack.FaultPaths
	slots         int           // the OpenAI server's MaxConcurrentRequests (default none)
	writeTimeout  time.Duration // the OpenAI server's WriteTimeout (default the server's)
	tp            int           // --tensor-parallel-size (default 1)
}

// config returns the stack configuration of an engine with options o. Without an opened model,
// each incarnation opens kvbridge/tiny for itself.
func (o engineOptions) config(name string, log *slog.Logger) kvstack.EngineConfig {
	blocks := cmp.Or(o.numBlocks, numBlocks)
	c := kvstack.EngineConfig{
		Name: name, Model: o.model, ModelName: model.Tiny, Role: o.role, Policy: o.policy, Bidirectional: o.bidirectional,
		EngineID: o.engineID, Lease: o.lease, Backends: o.backends, AllowedPeers: o.allowedPeers, AdvertiseTransfer: o.advertiseTCP,
		KeepSideChannelPort: o.keepSidePort, PrefixCaching: o.prefix, BlockSize: blockSize, NumBlocks: blocks,
		MaxModelLen: min(maxModelLen, blocks*blockSize), Faults: o.faults, StatsInterval: time.Hour, Logger: log,
		MaxConcurrentRequests: o.slots, WriteTimeout: o.writeTimeout, TensorParallelSize: o.tp,
	}
	if o.clock != nil {
		c.Now, c.Tick = o.clock.Now, o.clock.tick
	}
	return c
}

// engine is one in-process engine: the running incarnation of a stack engine, with its log and
// clock.
type engine struct {
	*instance.Instance
	se    *kvstack.Engine
	name  string
	log   *fixture.LogBuffer
	clock *fakeClock
}

// newEngine wraps a started stack engine.
func newEngine(se *kvstack.Engine, log *fixture.LogBuffer, clock *fakeClock) *engine {
	return &engine{Instance: se.Instance(), se: se, name: se.Name, log: log, clock: clock}
}

// engineLog returns a log sink and a logger writing to it, marked with the engine's name.
func engineLog(name string) (*fixture.LogBuffer, *slog.Logger) {
	sink := &fixture.LogBuffer{}
	return sink, slog.New(slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelDebug})).With("engine_name", name)
}

// startEngine starts an in-process engine; at cleanup it is closed.
func startEngine(t *testing.T, name string, o engineOptions) *engine {
	t.Helper()
	sink, log := engineLog(name)
	se, err := kvstack.StartEngine(t.Context(), o.config(name, log))
	if err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	e := newEngine(se, sink, o.clock)
	t.Cleanup(func() { e.close(t) })
	return e
}

// close closes the engine, showing its log if the test failed.
func (e *engine) close(t *testing.T) {
	if err := e.se.Close(); err != nil {
		t.Errorf("%s: close: %v", e.name, err)
	}
	if t.Failed() {
		t.Logf("%s's log:\n%s", e.name, e.log.String())
	}
}

// restart closes e and starts a new incarnation with the same options (the same engine_id and,
// with keepSidePort, the same side-channel port).
func (e *engine) restart(t *testing.T) {
	t.Helper()
	if err := e.se.Restart(t.Context()); err != nil {
		t.Fatalf("%s: restart: %v", e.name, err)
	}
	e.Instance = e.se.Instance()
}

// sidePort returns the engine's side-channel port.
func (e *engine) sidePort(t *testing.T) int {
	t.Helper()
	n := e.se.SideChannelPort()
	if n == 0 {
		t.Fatalf("%s has no side channel", e.name)
	}
	return n
}

// transferAddr returns the engine's transfer TCP listen address (set when the engine
// advertises another one).
func (e *engine) transferAddr() string { return e.se.TransferAddr() }

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
	eventuallyWithin(t, waitFor, what, cond, detail...)
}

// eventuallyWithin is eventually with the deadline d instead of waitFor.
func eventuallyWithin(t *testing.T, within time.Duration, what string, cond func() bool, detail ...func() string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			msg := ""
			for _, d := range detail {
				msg += ": " + d()
			}
			t.Fatalf("timed out after %v waiting for %s%s", within, what, msg)
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
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, requestDeadline)
		defer cancel()
	}
	var h http.Header
	if reqID != "" {
		h = http.Header{"X-Request-Id": {reqID}}
	}
	a, err := apiclient.Post(ctx, hc, url, body, h)
	r := replyOf(a)
	switch {
	case err != nil && a.Status == 0:
		return reply{}, err
	case err != nil:
		return r, fmt.Errorf("reading the body after %q: %w", r.raw, err)
	}
	return r, nil
}

// replyOf is what a client saw, as the suite's cases read it.
func replyOf(a apiclient.Reply) reply {
	return reply{status: a.Status, header: a.Header, raw: string(a.Raw), text: a.Text, finish: a.FinishReason, err: a.Error,
		kv: a.KVTransferParams, elapsed: a.Latency}
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
	writeTimeout  time.Duration // the proxy's WriteTimeout (default the proxy's)
}

// config returns the stack configuration of a proxy with options o; the legs can always be
// intercepted (runningProxy.setRewrite, beforeLeg). The engines run the pull connector and the
// proxy is told so (--transfer-mode pull), so that every byte a fault proxy in front of P
// forwards belongs to a leg: in auto mode the proxy's first request to P asks GET
// /v1/kv_transfer first, and a fault meant for the leg would cut that instead (auto falls back to
// pull then; proxy/push_test.go tests it).
func (o proxyOptions) config() kvstack.ProxyConfig {
	return kvstack.ProxyConfig{MultiTurn: o.multiTurn, RewritePorts: o.rewrite, InterceptLegs: true, IdleTimeout: o.idle,
		HeaderTimeout: cmp.Or(o.headerTimeout, time.Minute), WriteTimeout: o.writeTimeout, TransferMode: proxy.TransferPull}
}

// runningProxy is a P/D proxy served on 127.0.0.1.
type runningProxy struct {
	*kvstack.Proxy
}

// startProxy starts the one-way or multi-turn proxy in front of the engines at pURL and dURL
// (an engine's URL or a fault proxy's); at cleanup it is closed.
func startProxy(t *testing.T, pURL, dURL string, o proxyOptions) *runningProxy {
	t.Helper()
	cfg := o.config()
	cfg.Prefill, cfg.Decode = []string{hostPort(pURL)}, []string{hostPort(dURL)}
	p, err := kvstack.StartProxy(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rp := &runningProxy{p}
	t.Cleanup(rp.close)
	return rp
}

func (rp *runningProxy) close() { rp.Close() }

// beforeLeg sets a function called before each engine leg leaves the proxy, with the leg's
// host:port; nil removes it.
func (rp *runningProxy) beforeLeg(f func(hostPort string)) {
	rp.Legs.SetBefore(f)
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
