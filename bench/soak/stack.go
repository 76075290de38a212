package soak

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/faultproxy"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

// The stack's sizes and timeouts. The lease and the decoder TTL are short so that everything
// held for a reader that never came is back in the pool soon after the run; the proxy's cache
// TTL stays below the decoder's less the 5 s margin within which P declines a pull. D pins the
// blocks of every finished turn for the TTL and nothing reclaims them under pressure (as in
// vLLM); a conversation's last turn stays pinned until the TTL passes, so the pools are sized for
// the workload's steady state: up to ~30 conversations end every second, each pinning up to
// ~20 blocks for 8 s.
const (
	numBlocks     = 8192
	maxModelLen   = 4096
	leaseSeconds  = 5
	decoderTTL    = 8
	proxyCacheTTL = 2 * time.Second
	headerTimeout = 15 * time.Second
	idleTimeout   = 5 * time.Second
	clientTimeout = 60 * time.Second
)

// member is one engine of the stack with the fault proxies in front of its HTTP server, its
// side channel and its transfer listener. Restarts replace the instance behind the proxies.
type member struct {
	name     string
	role     connector.Role
	engineID string
	backend  string
	policy   connector.FailurePolicy
	model    *model.Model
	log      *slog.Logger

	http, side, xfer *faultproxy.Proxy

	mu       sync.Mutex
	in       *instance.Instance
	sidePort int                // fixed after the first start, as a restarted `kvbridge serve` keeps it
	past     map[string]float64 // transfer counters of the incarnations closed so far
}

// counterNames returns the engines' transfer counters the report sums over incarnations.
func counterNames() []string {
	return []string{
		"vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total",
		"vllm:nixl_num_kv_expired_reqs_total", "vllm:nixl_num_notifications_after_expiry_total",
	}
}

// counters returns the transfer counters of in.
func counters(in *instance.Instance) map[string]float64 {
	out := map[string]float64{}
	families, err := in.Registry.Prometheus().Gather()
	if err != nil {
		return out
	}
	names := counterNames()
	for _, f := range families {
		if !slices.Contains(names, f.GetName()) {
			continue
		}
		for _, m := range f.GetMetric() {
			out[f.GetName()] += m.GetCounter().GetValue()
		}
	}
	return out
}

// totals returns the transfer counters summed over every incarnation.
func (m *member) totals() map[string]float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := maps.Clone(m.past)
	if out == nil {
		out = map[string]float64{}
	}
	if m.in != nil {
		for k, v := range counters(m.in) {
			out[k] += v
		}
	}
	return out
}

// start starts a new incarnation and points the fault proxies at it. m.mu must be held.
func (m *member) start(ctx context.Context) error {
	extra := map[string]any{"bidirectional_kv_xfer": true, "backends": []string{m.backend},
		"kv_lease_duration": leaseSeconds, "decoder_kv_blocks_ttl": decoderTTL}
	doc, _ := json.Marshal(map[string]any{"kv_connector": "NixlConnector", "kv_role": string(m.role), "engine_id": m.engineID,
		"kv_load_failure_policy": string(m.policy), "kv_connector_extra_config": extra})
	kv, err := connector.ParseConfig(doc, m.log)
	if err != nil {
		return err
	}
	listen, err := freeAddr()
	if err != nil {
		return err
	}
	side := -1
	if m.sidePort > 0 {
		side = m.sidePort
	}
	// P caches no prefixes, so that every turn after the first pulls the conversation from D
	// (with its own prefix cache P would hold the history and pull nothing); D caches them.
	in, err := instance.Start(ctx, instance.Config{
		OpenedModel: m.model, Host: "127.0.0.1", NumBlocks: numBlocks, MaxModelLen: maxModelLen, PrefixCaching: m.role == connector.RoleConsumer,
		KVTransfer: kv, SideChannelPort: side, StatsInterval: time.Hour, Logger: m.log.With("engine", m.name), PromptTokensDetails: true,
		ConnectorHooks: func(o *connector.Options) {
			o.Transfer.ListenTCP = listen
			o.Transfer.AdvertiseTCP = m.xfer.Addr()
		},
	})
	if err != nil {
		return fmt.Errorf("soak: start %s: %w", m.name, err)
	}
	m.in = in
	sideAddr := in.Connector.SideChannelAddr()
	_, port, _ := net.SplitHostPort(sideAddr)
	m.sidePort, _ = strconv.Atoi(port)
	m.http.SetTarget(in.Addr.String())
	m.side.SetTarget(sideAddr)
	m.xfer.SetTarget(listen)
	return nil
}

// restart closes the running incarnation and starts a new one with the same engine_id and
// side-channel port.
func (m *member) restart(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.past == nil {
		m.past = map[string]float64{}
	}
	for k, v := range counters(m.in) {
		m.past[k] += v
	}
	if err := m.in.Close(); err != nil {
		return fmt.Errorf("soak: close %s: %w", m.name, err)
	}
	var err error
	for range 3 { // the side-channel port may linger for a moment
		if err = m.start(ctx); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

// instance returns the running incarnation.
func (m *member) instance() *instance.Instance {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.in
}

func (m *member) proxies() []*faultproxy.Proxy { return []*faultproxy.Proxy{m.http, m.side, m.xfer} }

// stack is P, D, the multi-turn proxy, the single reference engine and the fault proxies.
type stack struct {
	p, d      *member
	ref       *instance.Instance
	mt        *proxy.MultiTurn
	srv       *http.Server
	served    chan error
	URL       string
	transport *http.Transport
	hook      *faultproxy.PortRewriter
	client    *http.Client // the workload's client to the proxy
	refClient *http.Client // to the reference engine
	backend   string
}

// path is one fault proxy of the stack, named for the report.
type path struct {
	name string
	fp   *faultproxy.Proxy
}

// paths returns the fault proxies in the stack's paths (over SHM the transfers bypass them).
func (s *stack) paths() []path {
	ps := []path{{"http-P", s.p.http}, {"http-D", s.d.http}, {"side-P", s.p.side}, {"side-D", s.d.side}}
	if s.backend == BackendTCP {
		ps = append(ps, path{"transfer-P", s.p.xfer}, path{"transfer-D", s.d.xfer})
	}
	return ps
}

// allProxies returns every fault proxy of the stack.
func (s *stack) allProxies() []*faultproxy.Proxy {
	return append(s.p.proxies(), s.d.proxies()...)
}

func startStack(ctx context.Context, m *model.Model, policy connector.FailurePolicy, backend string, log *slog.Logger) (_ *stack, err error) {
	s := &stack{served: make(chan error, 1), backend: backend}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	if s.ref, err = instance.Start(ctx, instance.Config{OpenedModel: m, Host: "127.0.0.1", NumBlocks: numBlocks, MaxModelLen: maxModelLen,
		Logger: log.With("engine", "single")}); err != nil {
		return nil, fmt.Errorf("soak: start the reference engine: %w", err)
	}
	newMember := func(name string, role connector.Role) (*member, error) {
		mb := &member{name: name, role: role, engineID: "soak-" + name, backend: backend, policy: policy, model: m, log: log}
		for _, fp := range []**faultproxy.Proxy{&mb.http, &mb.side, &mb.xfer} {
			if *fp, err = faultproxy.New(""); err != nil {
				return mb, err
			}
		}
		mb.mu.Lock()
		defer mb.mu.Unlock()
		return mb, mb.start(ctx)
	}
	if s.p, err = newMember("P", connector.RoleProducer); err != nil {
		return nil, err
	}
	if s.d, err = newMember("D", connector.RoleConsumer); err != nil {
		return nil, err
	}
	s.transport = &http.Transport{MaxIdleConnsPerHost: 64, ResponseHeaderTimeout: headerTimeout,
		DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext}
	s.hook = faultproxy.NewPortRewriter(s.transport, map[int]int{s.p.sidePort: s.p.side.Port(), s.d.sidePort: s.d.side.Port()})
	inst := func(fp *faultproxy.Proxy) proxy.Instance {
		in, _ := proxy.NewInstance("127.0.0.1", fp.Port())
		return in
	}
	if s.mt, err = proxy.NewMultiTurn(proxy.MultiTurnConfig{CacheTTL: proxyCacheTTL, Config: proxy.Config{
		Prefill: []proxy.Instance{inst(s.p.http)}, Decode: []proxy.Instance{inst(s.d.http)},
		HeaderTimeout: headerTimeout, IdleTimeout: idleTimeout, Transport: s.hook, Logger: log.With("component", "proxy"),
	}}); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s.URL = "http://" + ln.Addr().String()
	s.srv = &http.Server{Handler: s.mt, ReadHeaderTimeout: 30 * time.Second}
	go func() { s.served <- s.srv.Serve(ln) }()
	s.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: clientTimeout}
	s.refClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: clientTimeout}
	return s, nil
}

// resetFaults turns every fault off.
func (s *stack) resetFaults() {
	for _, fp := range s.allProxies() {
		fp.Reset()
	}
}

// closeIdle drops every idle keep-alive connection of the stack's clients.
func (s *stack) closeIdle() {
	for _, c := range []*http.Client{s.client, s.refClient} {
		if c != nil {
			c.CloseIdleConnections()
		}
	}
	if s.transport != nil {
		s.transport.CloseIdleConnections()
	}
}

// quiesce waits (at most d) until both engines are idle with every block free and no fault
// proxy has an open link, then takes a snapshot. It returns the snapshot even when the wait
// timed out, with an error saying what did not settle.
func (s *stack) quiesce(ctx context.Context, d time.Duration) (Snapshot, error) {
	deadline := time.Now().Add(d)
	var why string
	for {
		s.closeIdle()
		why = s.unsettled()
		if why == "" || time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return s.snapshot(), ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	// Goroutines of closed connections take a moment to end; give them a bounded chance.
	settle := time.Now().Add(2 * time.Second)
	prev := -1
	for time.Now().Before(settle) {
		n := runtime.NumGoroutine()
		if n == prev {
			break
		}
		prev = n
		time.Sleep(100 * time.Millisecond)
	}
	snap := s.snapshot()
	if why != "" {
		return snap, fmt.Errorf("the stack did not quiesce within %v: %s", d, why)
	}
	return snap, nil
}

// unsettled says what still moves, or "".
func (s *stack) unsettled() string {
	var parts []string
	for _, m := range []*member{s.p, s.d} {
		in := m.instance()
		st := in.Engine.Stats()
		if st.Running+st.Waiting+st.Delayed > 0 || in.Pool.NumFree() != in.Pool.NumBlocks() {
			parts = append(parts, fmt.Sprintf("%s: %d running, %d waiting, %d held, %d of %d blocks free",
				m.name, st.Running, st.Waiting, st.Delayed, in.Pool.NumFree(), in.Pool.NumBlocks()))
		}
	}
	for _, p := range s.paths() {
		if n := p.fp.Stats().Open; n > 0 && strings.HasPrefix(p.name, "http") {
			parts = append(parts, fmt.Sprintf("%s: %d open connections", p.name, n))
		}
	}
	return strings.Join(parts, "; ")
}

// snapshot measures the process and the pools.
func (s *stack) snapshot() Snapshot {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	snap := Snapshot{HeapAllocBytes: ms.HeapAlloc, Goroutines: runtime.NumGoroutine(), RSSBytes: rss(),
		FreeBlocks: map[string]int{}, NumBlocks: map[string]int{}}
	for _, m := range []*member{s.p, s.d} {
		in := m.instance()
		snap.FreeBlocks[m.name] = in.Pool.NumFree()
		snap.NumBlocks[m.name] = in.Pool.NumBlocks()
	}
	return snap
}

// rss returns the resident set size from /proc/self/statm (0 where unavailable).
func rss() uint64 {
	data, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(data))
	if len(f) < 2 {
		return 0
	}
	pages, _ := strconv.ParseUint(f[1], 10, 64)
	return pages * uint64(os.Getpagesize())
}

// close stops everything the stack started. It is idempotent in effect (each part's Close is).
func (s *stack) close() {
	if s.srv != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = s.srv.Shutdown(ctx)
		cancel()
		<-s.served
		s.srv = nil
	}
	if s.mt != nil {
		s.mt.Close()
	}
	s.closeIdle()
	for _, m := range []*member{s.p, s.d} {
		if m == nil {
			continue
		}
		m.mu.Lock()
		if m.in != nil {
			_ = m.in.Close()
		}
		m.mu.Unlock()
		for _, fp := range m.proxies() {
			if fp != nil {
				_ = fp.Close()
			}
		}
	}
	if s.ref != nil {
		_ = s.ref.Close()
	}
}

// freeAddr returns a loopback address whose port was free a moment ago (the transfer agent
// reports the advertised address, so the listener's is chosen here).
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}
