package proxy

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbridge/kvbridge/internal/blockhash"
)

// Routing: which prefiller and decoder serve a request (--routing). round-robin is vLLM's toy
// proxy's choice; least-loaded takes the engine with the fewest of this proxy's requests in
// flight; kv-aware picks P by the longest prefix of the prompt's block-hash chain the engine
// holds, weighted by load, from the engines' KV cache events (kvindex.go, kvsub.go), and D by
// load. The cost of P (lower wins) is
//
//	cost_i = (n − m_i) · (1 + ShareWeight · clamp(share_i − 1, −1, 1)) + LoadWeight · n · inflight_i
//
// with n the prompt's full blocks, m_i the blocks of its prefix engine i holds, inflight_i the
// proxy's prefill legs running on i, LoadWeight = 0.5: a request queued ahead costs about half a
// prompt's prefill (requests that share prefixes mostly hit), so a full hit is worth two requests
// in flight, and a hot prefix spreads over the engines once its holder runs two more than
// another instead of melting one (Dynamo's KV router weighs overlap against load the same way).
// share_i is engine i's part of the prompt blocks this proxy sent to prefillers so far, over an
// even part (1 when every engine got as many), ShareWeight = 0.25: the blocks an engine would
// have to compute cost up to a quarter more on an engine that has had more than its part of the
// work (up to a quarter less on one that has had less), so a prompt no engine holds goes to the
// one that has had the least, and prefixes (and the requests that follow them) spread evenly
// instead of as the in-flight counts happened to be when each arrived; what an engine already
// holds costs nothing wherever it is, so a holder of most of a prompt keeps it (a holder of 40 of
// 64 blocks that has had all the work still costs 30 against an idle engine's 48). Ties go to
// the fewer in flight, then in turn. Without tokens (the /tokenize call failed) or
// without an index, kv-aware falls back to least-loaded; it never fails a request.

// Routing policies (--routing).
const (
	RoundRobin  = "round-robin"
	LeastLoaded = "least-loaded"
	KVAware     = "kv-aware"
)

// Reasons of kvbridge:proxy_route_total: what the decision was based on.
const (
	reasonHit      = "hit"       // a prefiller holds a prefix of the prompt
	reasonMiss     = "miss"      // none holds any of it, and every index is up to date
	reasonStale    = "stale"     // none holds any of it as far as the index knows, and an index is stale
	reasonNoTokens = "no-tokens" // the prompt could not be tokenized: least-loaded
	reasonNoIndex  = "no-index"  // no event has told the block size yet: least-loaded
	reasonPolicy   = "policy"    // round-robin or least-loaded chose
)

// loadWeight and shareWeight are LoadWeight and ShareWeight of the cost above.
const (
	loadWeight  = 0.5
	shareWeight = 0.25
)

// Defaults of RoutingConfig.
const (
	// DefaultTokenizeTimeout bounds the /tokenize call of a kv-aware decision.
	DefaultTokenizeTimeout = 2 * time.Second
	// DefaultPrefixHashAlgo is vLLM's --prefix-caching-hash-algo default.
	DefaultPrefixHashAlgo = "sha256"
)

// RoutingConfig configures how a proxy picks engines.
type RoutingConfig struct {
	// Policy is RoundRobin, LeastLoaded or KVAware; "" means KVAware when KVEvents is given, else
	// RoundRobin.
	Policy string
	// KVEvents are the prefillers' KV event endpoints (their --kv-events-config endpoint, e.g.
	// tcp://host:5557), one per prefiller in the order of Config.Prefill. Required by KVAware.
	KVEvents []string
	// KVEventsReplay are the prefillers' replay endpoints, one per prefiller ("" for none), or
	// empty: a sequence gap then marks the engine's index stale.
	KVEventsReplay []string
	// KVEventsDP is how many data-parallel ranks each prefiller has (default 1): rank r publishes
	// on its endpoints' port + r, as vLLM's offset_endpoint_port.
	KVEventsDP int
	// KVEventsTopic is the engines' topic (default "").
	KVEventsTopic string
	// HashAlgo is the engines' --prefix-caching-hash-algo (default DefaultPrefixHashAlgo), and
	// HashSeed their PYTHONHASHSEED when HashSeeded: the proxy hashes prompts as they do, and
	// matches nothing unless they share it.
	HashAlgo   string
	HashSeed   string
	HashSeeded bool
	// MaxIndexBlocks bounds the hashes kept per event source (default DefaultKVIndexBlocks).
	MaxIndexBlocks int
	// TokenizeTimeout bounds the /tokenize call (default DefaultTokenizeTimeout).
	TokenizeTimeout time.Duration
}

// router picks the engines of each request. Its subscribers run from newRouter to close.
type router struct {
	cfg    RoutingConfig
	log    *slog.Logger
	p, d   pool
	ix     *kvIndex // nil without KV events
	subs   []*kvSubscriber
	hasher *blockhash.Hasher
	tokRR  atomic.Uint64 // which prefiller tokenizes next

	routed       *prometheus.CounterVec
	prefixTokens prometheus.Histogram

	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
}

// pool is one role's engines with the proxy's in-flight count for each, and the prompt blocks
// kv-aware choices sent to each.
type pool struct {
	list     []Instance
	inflight []atomic.Int64
	blocks   []atomic.Int64
	next     atomic.Uint64
}

func newPool(list []Instance) pool {
	return pool{list: list, inflight: make([]atomic.Int64, len(list)), blocks: make([]atomic.Int64, len(list))}
}

// shares returns each engine's part of the blocks sent so far over an even part (all 1 before
// any).
func (p *pool) shares() []float64 {
	out := make([]float64, len(p.list))
	var total int64
	for i := range p.blocks {
		total += p.blocks[i].Load()
	}
	for i := range out {
		out[i] = 1
		if total > 0 {
			out[i] = float64(p.blocks[i].Load()) * float64(len(out)) / float64(total)
		}
	}
	return out
}

// has reports whether inst is one of the pool's engines.
func (p *pool) has(inst Instance) bool { return p.index(inst) >= 0 }

func (p *pool) index(inst Instance) int {
	for i, x := range p.list {
		if x == inst {
			return i
		}
	}
	return -1
}

// roundRobin returns the next engine in turn.
func (p *pool) roundRobin() int { return int((p.next.Add(1) - 1) % uint64(len(p.list))) }

// leastLoaded returns the engine with the fewest requests in flight, ties in turn.
func (p *pool) leastLoaded() int {
	return p.best(func(i int) float64 { return float64(p.inflight[i].Load()) })
}

// best returns the engine of the lowest cost; ties go to the fewer in flight, then in turn from
// a rotating start.
func (p *pool) best(cost func(i int) float64) int {
	n := len(p.list)
	start := int((p.next.Add(1) - 1) % uint64(n))
	bi, bc, bl := -1, 0.0, int64(0)
	for k := range n {
		i := (start + k) % n
		c, l := cost(i), p.inflight[i].Load()
		if bi < 0 || c < bc || c == bc && l < bl {
			bi, bc, bl = i, c, l
		}
	}
	return bi
}

// take counts a leg on engine i until the returned release is called (once).
func (p *pool) take(i int) (Instance, func()) {
	p.inflight[i].Add(1)
	var once sync.Once
	return p.list[i], func() { once.Do(func() { p.inflight[i].Add(-1) }) }
}

// ParsePolicy checks a --routing value.
func ParsePolicy(s string) (string, error) {
	switch s {
	case RoundRobin, LeastLoaded, KVAware:
		return s, nil
	}
	return "", fmt.Errorf("proxy: routing policy %q: want %s, %s or %s", s, RoundRobin, LeastLoaded, KVAware)
}

// newRouter returns the router of cfg and starts its subscribers; reg receives its metrics.
func newRouter(cfg Config, reg prometheus.Registerer) (*router, error) {
	rc := cfg.Routing
	if rc.Policy == "" {
		rc.Policy = RoundRobin
		if len(rc.KVEvents) > 0 {
			rc.Policy = KVAware
		}
	}
	if _, err := ParsePolicy(rc.Policy); err != nil {
		return nil, err
	}
	if rc.Policy == KVAware && len(rc.KVEvents) != len(cfg.Prefill) {
		return nil, fmt.Errorf("proxy: kv-aware routing needs one KV events endpoint per prefiller: %d for %d prefillers", len(rc.KVEvents), len(cfg.Prefill))
	}
	if len(rc.KVEvents) > 0 && len(rc.KVEvents) != len(cfg.Prefill) {
		return nil, fmt.Errorf("proxy: %d KV events endpoints for %d prefillers: give one per prefiller, in their order", len(rc.KVEvents), len(cfg.Prefill))
	}
	if len(rc.KVEventsReplay) > 0 && len(rc.KVEventsReplay) != len(rc.KVEvents) {
		return nil, fmt.Errorf("proxy: %d KV events replay endpoints for %d event endpoints: give one per prefiller", len(rc.KVEventsReplay), len(rc.KVEvents))
	}
	if rc.KVEventsDP <= 0 {
		rc.KVEventsDP = 1
	}
	if rc.HashAlgo == "" {
		rc.HashAlgo = DefaultPrefixHashAlgo
	}
	if rc.MaxIndexBlocks <= 0 {
		rc.MaxIndexBlocks = DefaultKVIndexBlocks
	}
	if rc.TokenizeTimeout <= 0 {
		rc.TokenizeTimeout = DefaultTokenizeTimeout
	}
	rt := &router{cfg: rc, log: cfg.Logger, p: newPool(cfg.Prefill), d: newPool(cfg.Decode)}
	rt.routed = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge:proxy_route_total",
		Help: "Prefiller choices, by policy and by what the choice was based on (hit, miss, stale, no-tokens, no-index; policy for round-robin and least-loaded)."}, []string{"policy", "reason"})
	rt.prefixTokens = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvbridge:proxy_route_prefix_tokens",
		Help: "Tokens of the prompt's prefix the chosen prefiller holds, as the KV index knows it, per kv-aware choice with tokens.", Buckets: prometheus.ExponentialBuckets(16, 2, 14)})
	reg.MustRegister(rt.routed, rt.prefixTokens)
	if len(rc.KVEvents) == 0 {
		return rt, nil
	}
	h, err := blockhash.New(blockhash.Algo(rc.HashAlgo), rc.HashSeed, rc.HashSeeded)
	if err != nil {
		return nil, fmt.Errorf("proxy: %w", err)
	}
	rt.hasher = h
	var srcs []kvSourceConfig
	for e, ep := range rc.KVEvents {
		replay := ""
		if len(rc.KVEventsReplay) > 0 {
			replay = rc.KVEventsReplay[e]
		}
		for r := range rc.KVEventsDP {
			pub, err := offsetEndpoint(ep, r)
			if err != nil {
				return nil, err
			}
			rep := replay
			if rep != "" {
				if rep, err = offsetEndpoint(rep, r); err != nil {
					return nil, err
				}
			}
			srcs = append(srcs, kvSourceConfig{endpoint: pub, replay: rep, engine: e})
		}
	}
	owner := make([]int, len(srcs))
	for i, s := range srcs {
		owner[i] = s.engine
	}
	rt.ix = newKVIndex(owner, len(cfg.Prefill), rc.MaxIndexBlocks)
	for i, s := range srcs {
		rt.subs = append(rt.subs, &kvSubscriber{src: i, cfg: s, topic: rc.KVEventsTopic, ix: rt.ix, log: cfg.Logger})
	}
	rt.registerIndexMetrics(reg)
	if !rc.HashSeeded {
		cfg.Logger.Warn("kv-aware routing without PYTHONHASHSEED: the engines' block hashes start from a random seed of their own, so no prompt's hashes will match; give the engines and the proxy the same PYTHONHASHSEED")
	}
	ctx, cancel := context.WithCancel(context.Background())
	rt.cancel = cancel
	for _, s := range rt.subs {
		rt.wg.Go(func() { s.run(ctx) })
	}
	return rt, nil
}

// registerIndexMetrics registers the index's and the subscribers' state, per prefiller.
func (rt *router) registerIndexMetrics(reg prometheus.Registerer) {
	perEngine := func(name, help string, gauge bool, v func(s *kvSubscriber) float64) {
		for e, inst := range rt.p.list {
			f := func() float64 {
				sum := 0.0
				for _, s := range rt.subs {
					if s.cfg.engine == e {
						sum += v(s)
					}
				}
				return sum
			}
			labels := prometheus.Labels{"instance": inst.String()}
			if gauge {
				reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels}, f))
			} else {
				reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels}, f))
			}
		}
	}
	u := func(f func(s *kvSubscriber) *atomic.Uint64) func(s *kvSubscriber) float64 {
		return func(s *kvSubscriber) float64 { return float64(f(s).Load()) }
	}
	perEngine("kvbridge:proxy_kv_index_blocks", "Block hashes the KV index holds for the prefiller (the sum over its data-parallel ranks).", true,
		func(s *kvSubscriber) float64 { return float64(rt.ix.len(s.src)) })
	perEngine("kvbridge:proxy_kv_index_stale", "Event sources of the prefiller whose index missed events it could not replay (1 each).", true,
		func(s *kvSubscriber) float64 { return b2f(rt.ix.isStale(s.src)) })
	perEngine("kvbridge:proxy_kv_events_connected", "Event sources of the prefiller the proxy is subscribed to now.", true,
		func(s *kvSubscriber) float64 { return b2f(s.connected.Load()) })
	perEngine("kvbridge:proxy_kv_event_batches_total", "KV event batches applied to the index.", false, u(func(s *kvSubscriber) *atomic.Uint64 { return &s.batches }))
	perEngine("kvbridge:proxy_kv_events_total", "KV events applied to the index.", false, u(func(s *kvSubscriber) *atomic.Uint64 { return &s.events }))
	perEngine("kvbridge:proxy_kv_event_gaps_total", "Sequence gaps seen (batches missed).", false, u(func(s *kvSubscriber) *atomic.Uint64 { return &s.gaps }))
	perEngine("kvbridge:proxy_kv_event_replays_total", "Sequence gaps filled from the engine's replay socket.", false, u(func(s *kvSubscriber) *atomic.Uint64 { return &s.replayed }))
	perEngine("kvbridge:proxy_kv_index_resets_total", "Resets of the prefiller's index entries: a new incarnation of the engine, AllBlocksCleared, or its /health recovering.", false,
		u(func(s *kvSubscriber) *atomic.Uint64 { return &s.resets }))
	perEngine("kvbridge:proxy_kv_event_malformed_total", "Messages or batches from the prefiller that did not decode.", false, u(func(s *kvSubscriber) *atomic.Uint64 { return &s.malformed }))
	perEngine("kvbridge:proxy_kv_index_evicted_total", "Block hashes dropped from the index because of its bound.", false,
		func(s *kvSubscriber) float64 { return float64(rt.ix.sources[s.src].evicted.Load()) })
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// close stops the subscribers and waits for them. It is idempotent.
func (rt *router) close() {
	rt.closeOnce.Do(func() {
		if rt.cancel != nil {
			rt.cancel()
		}
		rt.wg.Wait()
	})
}

// engineRestarted resets the index entries of prefiller inst (its /health failed, then
// recovered: a new incarnation, whose cache is empty).
func (rt *router) engineRestarted(inst Instance) {
	if rt.ix == nil {
		return
	}
	if e := rt.p.index(inst); e >= 0 {
		rt.ix.resetEngine(e)
		for _, s := range rt.subs {
			if s.cfg.engine == e {
				s.resets.Add(1)
			}
		}
	}
}

// pickPrefill chooses the prefiller of a request and counts it in flight until release.
func (rt *router) pickPrefill(ctx context.Context, l *legs, path, reqID string, hdr http.Header, b body) (Instance, func()) {
	var (
		i                 int
		reason            = reasonPolicy
		prefix, promptLen = 0, -1
	)
	switch rt.cfg.Policy {
	case RoundRobin:
		i = rt.p.roundRobin()
	case LeastLoaded:
		i = rt.p.leastLoaded()
	default:
		i, reason, prefix, promptLen = rt.kvChoice(ctx, l, path, reqID, hdr, b)
		if reason == reasonHit || reason == reasonMiss || reason == reasonStale {
			rt.prefixTokens.Observe(float64(prefix))
		}
	}
	rt.routed.WithLabelValues(rt.cfg.Policy, reason).Inc()
	inst, release := rt.p.take(i)
	if rt.log.Enabled(ctx, slog.LevelDebug) {
		rt.log.Debug("route", "request_id", reqID, "policy", rt.cfg.Policy, "reason", reason, "instance", inst.String(),
			"prefix_tokens", prefix, "prompt_tokens", promptLen, "in_flight", rt.p.inflight[i].Load())
	}
	return inst, release
}

// kvChoice is the kv-aware choice of a prefiller: its position, the reason, the tokens of the
// prefix it holds and the prompt's length (-1 when unknown).
func (rt *router) kvChoice(ctx context.Context, l *legs, path, reqID string, hdr http.Header, b body) (int, string, int, int) {
	bs := rt.ix.blockSize()
	if bs == 0 {
		return rt.p.leastLoaded(), reasonNoIndex, 0, -1
	}
	tokInst := rt.p.list[int((rt.tokRR.Add(1)-1)%uint64(len(rt.p.list)))]
	tokens, err := l.promptTokens(ctx, tokInst, path, reqID, hdr, b, rt.cfg.TokenizeTimeout)
	if err != nil {
		rt.log.Debug("route: no tokens; least-loaded", "request_id", reqID, "err", err)
		return rt.p.leastLoaded(), reasonNoTokens, 0, -1
	}
	hashes := rt.hasher.Chain(tokens, bs)
	chain := make([]uint64, len(hashes))
	for i, h := range hashes {
		chain[i] = h.External()
	}
	match := rt.ix.longestPrefix(chain)
	n := float64(len(chain))
	share := rt.p.shares()
	i := rt.p.best(func(i int) float64 {
		return prefillCost(n, float64(match[i].blocks), share[i], rt.p.inflight[i].Load())
	})
	rt.p.blocks[i].Add(int64(max(len(chain), 1)))
	reason := reasonMiss
	switch {
	case match[i].blocks > 0:
		reason = reasonHit
	case anyStale(match):
		reason = reasonStale
	}
	return i, reason, match[i].blocks * bs, len(tokens)
}

// prefillCost is the kv-aware cost of a prefiller (lower wins; the formula atop this file): n
// the prompt's full blocks, m those the engine holds, share its part of the work so far over an
// even part, inflight the proxy's prefill legs running there.
func prefillCost(n, m, share float64, inflight int64) float64 {
	return (n-m)*(1+shareWeight*min(max(share-1, -1), 1)) + loadWeight*max(n, 1)*float64(inflight)
}

func anyStale(m []prefixMatch) bool {
	for _, x := range m {
		if x.stale {
			return true
		}
	}
	return false
}

// pickDecode chooses the decoder: round-robin under RoundRobin, else the least loaded.
func (rt *router) pickDecode() (Instance, func()) {
	if rt.cfg.Policy == RoundRobin {
		return rt.d.take(rt.d.roundRobin())
	}
	return rt.d.take(rt.d.leastLoaded())
}

// takeDecode counts a leg on decoder inst (a conversation's own decoder) until release.
func (rt *router) takeDecode(inst Instance) (Instance, func()) {
	if i := rt.d.index(inst); i >= 0 {
		return rt.d.take(i)
	}
	return inst, func() {}
}

// offsetEndpoint returns the endpoint of data-parallel rank r, as vLLM's offset_endpoint_port:
// a tcp port + r, or an ipc path with "_dp<r>" appended. It checks the endpoint's form.
func offsetEndpoint(ep string, r int) (string, error) {
	if path, ok := strings.CutPrefix(ep, "ipc://"); ok && path != "" {
		if r == 0 {
			return ep, nil
		}
		return ep + "_dp" + strconv.Itoa(r), nil
	}
	hostport, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return "", fmt.Errorf("proxy: KV events endpoint %q: want tcp://HOST:PORT or ipc://PATH", ep)
	}
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return "", fmt.Errorf("proxy: KV events endpoint %q: %w", ep, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p <= 0 || p+r > 65535 || host == "" || host == "*" {
		return "", fmt.Errorf("proxy: KV events endpoint %q: want the engine's host and port (tcp://HOST:PORT)", ep)
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+r)), nil
}
