package reliability

import (
	"maps"
	"net/http"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/faultproxy"
	kvstack "github.com/kvbridge/kvbridge/stack"
)

// stackOptions describe an in-process P/D stack with fault proxies in its paths.
type stackOptions struct {
	policy        connector.FailurePolicy // D's kv_load_failure_policy (P's too, for bidirectional pulls)
	bidirectional bool                    // bidirectional_kv_xfer on both, behind the multi-turn proxy
	multiTurn     bool                    // the multi-turn proxy even without bidirectional transfer
	pClock        bool                    // P's connector runs on a fake clock (lease expiry on demand)
	dClock        bool                    // D's connector runs on a fake clock (decoder TTL on demand)
	sideProxy     bool                    // a fault proxy in front of P's side channel
	transferProxy bool                    // P publishes a fault proxy as its transfer address (TCP only)
	headerTimeout time.Duration           // the proxy's wait for an engine's response headers (default 1 min)
	idleTimeout   time.Duration           // the proxy's IdleTimeout (default 2 min)
	pEngineID     string
	dEngineID     string
	fixedPorts    bool          // P and D keep their side-channel ports across restarts
	backends      []string      // kv_connector_extra_config.backends (TCP with transferProxy)
	pPrefix       bool          // prefix caching on P (D always caches prefixes)
	dNumBlocks    int           // D's KV pool size (default numBlocks)
	dSlots        int           // D's MaxConcurrentRequests (default none)
	writeTimeout  time.Duration // D's and the proxy's WriteTimeout (default theirs)
}

// stack is P, D and a proxy, each engine behind a fault proxy on its HTTP port.
type stack struct {
	st        *kvstack.Stack
	p, d      *engine
	httpP     *faultproxy.Proxy // proxy ↔ P
	httpD     *faultproxy.Proxy // proxy ↔ D
	side      *faultproxy.Proxy // D → P's side channel (sideProxy)
	xfer      *faultproxy.Proxy // D → P's transfer listener (transferProxy)
	px        *runningProxy
	ref       *reference
	hc        *http.Client
	opts      stackOptions
	proxyOpts proxyOptions
}

func startStack(t *testing.T, o stackOptions) *stack {
	t.Helper()
	s := &stack{opts: o, hc: client(t), ref: startReference(t)}
	backends := o.backends
	pFaults := kvstack.FaultHTTP
	if o.sideProxy {
		pFaults |= kvstack.FaultSideChannel
	}
	if o.transferProxy {
		backends = []string{"TCP"}
		pFaults |= kvstack.FaultTransfer
	}
	po := engineOptions{role: connector.RoleProducer, policy: o.policy, bidirectional: o.bidirectional, backends: backends, engineID: o.pEngineID,
		prefix: o.pPrefix, keepSidePort: o.fixedPorts, faults: pFaults}
	do := engineOptions{role: connector.RoleConsumer, policy: o.policy, bidirectional: o.bidirectional, backends: backends, engineID: o.dEngineID,
		prefix: true, numBlocks: o.dNumBlocks, keepSidePort: o.fixedPorts, faults: kvstack.FaultHTTP,
		slots: o.dSlots, writeTimeout: o.writeTimeout}
	if o.pClock {
		po.clock = newFakeClock()
	}
	if o.dClock {
		do.clock = newFakeClock()
	}
	s.proxyOpts = proxyOptions{multiTurn: o.multiTurn || o.bidirectional, idle: o.idleTimeout, headerTimeout: o.headerTimeout,
		writeTimeout: o.writeTimeout}
	pSink, pLog := engineLog("P")
	dSink, dLog := engineLog("D")
	st, err := kvstack.Start(t.Context(), kvstack.Config{P: po.config("P", pLog), D: do.config("D", dLog), Proxy: s.proxyOpts.config()})
	if err != nil {
		t.Fatal(err)
	}
	s.st = st
	s.p, s.d = newEngine(st.P, pSink, po.clock), newEngine(st.D, dSink, do.clock)
	s.httpP, s.httpD, s.side, s.xfer = st.P.Faults.HTTP, st.D.Faults.HTTP, st.P.Faults.SideChannel, st.P.Faults.Transfer
	s.px = &runningProxy{st.Proxy}
	t.Cleanup(func() {
		s.px.close() // a restarted proxy is not the stack's
		if err := st.Close(); err != nil {
			t.Errorf("close the stack: %v", err)
		}
		for _, e := range []*engine{s.d, s.p} {
			if t.Failed() {
				t.Logf("%s's log:\n%s", e.name, e.log.String())
			}
		}
	})
	return s
}

// restartP starts a new incarnation of P (same engine_id; same side-channel port with
// fixedPorts); the fault proxies and the proxy's port rewriting follow it.
func (s *stack) restartP(t *testing.T) {
	t.Helper()
	s.restart(t, s.p)
}

// restartD does the same for D.
func (s *stack) restartD(t *testing.T) {
	t.Helper()
	s.restart(t, s.d)
}

func (s *stack) restart(t *testing.T, e *engine) {
	t.Helper()
	if err := s.st.Restart(t.Context(), e.se); err != nil {
		t.Fatalf("%s: restart: %v", e.name, err)
	}
	e.Instance = e.se.Instance()
}

// restartProxy replaces the proxy with a new one (a multi-turn proxy loses its cache).
func (s *stack) restartProxy(t *testing.T) {
	t.Helper()
	s.px.close()
	o := s.proxyOpts
	if s.side != nil {
		o.rewrite = map[int]int{s.p.sidePort(t): s.side.Port()}
	}
	s.px = startProxy(t, s.httpP.URL(), s.httpD.URL(), o)
}

// sampled is the sampling of every request whose output the suite compares: seeded sampling
// at temperature 1 makes the output depend on every logit, so wrong KV shows.
func sampled(seed int) []any { return []any{"temperature", 1.0, "seed", seed} }

// ask sends a completion through the proxy and checks it against the single engine.
func (s *stack) askOK(t *testing.T, prompt string, seed int) reply {
	t.Helper()
	body := completion(prompt, 12, sampled(seed)...)
	r := post(t, s.hc, s.px.URL+"/v1/completions", "", body)
	if want := s.ref.answer(t, "/v1/completions", body); r.status != 200 || r.text != want {
		t.Fatalf("P/D answer %d %q (%s); the single engine says %q", r.status, r.text, r.raw, want)
	}
	return r
}

// wantError checks a JSON error reply's status and code.
func wantError(t *testing.T, r reply, status int, code string) {
	t.Helper()
	if r.status != status || r.errorCode() != code || r.err["message"] == nil || r.err["type"] == nil {
		t.Fatalf("got %d %s; want %d with an OpenAI error JSON of code %q", r.status, r.raw, status, code)
	}
}

// wantPolicyOutcome checks the client's outcome of a failed KV load under the stack's policy:
// 500 with OpenAI's error JSON under fail, the single engine's answer under recompute.
func (s *stack) wantPolicyOutcome(t *testing.T, r reply, body map[string]any) {
	t.Helper()
	switch s.opts.policy {
	case connector.PolicyRecompute:
		if want := s.ref.answer(t, "/v1/completions", body); r.status != 200 || r.text != want {
			t.Fatalf("under recompute: %d %q (%s); the single engine says %q", r.status, r.text, r.raw, want)
		}
	default:
		if r.status != 500 || r.errorCode() != "500" || r.err["message"] != "Internal server error" {
			t.Fatalf("under fail: %d %s; want 500 with OpenAI's error JSON", r.status, r.raw)
		}
	}
}

// policies runs f once per load-failure policy.
func policies(t *testing.T, f func(t *testing.T, policy connector.FailurePolicy)) {
	for _, p := range []connector.FailurePolicy{connector.PolicyFail, connector.PolicyRecompute} {
		t.Run(string(p), func(t *testing.T) { f(t, p) })
	}
}

// expireP runs P's lease sweep after its kv_lease_duration (P must run on a fake clock) once
// P's finished requests hold their blocks, and waits for P's pool to be full.
func (s *stack) expireP(t *testing.T) {
	t.Helper()
	s.p.clock.advance(t, 31*time.Second)
	s.p.waitPoolFull(t)
}

// withBody returns a copy of body with extra fields.
func withBody(body map[string]any, kv ...any) map[string]any {
	b := maps.Clone(body)
	for i := 0; i+1 < len(kv); i += 2 {
		b[kv[i].(string)] = kv[i+1]
	}
	return b
}
