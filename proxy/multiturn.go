package proxy

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvbridge/kvbridge/internal/httpdeadline"
)

// MultiTurnConfig configures the multi-turn proxy.
type MultiTurnConfig struct {
	Config
	// CacheTTL is how long a conversation's D params stay usable (default
	// DefaultConversationTTL).
	CacheTTL time.Duration
	// MaxConversations and MaxConversationBytes bound the cache (defaults
	// DefaultMaxConversations and DefaultMaxConversationBytes); the least recently stored go
	// first.
	MaxConversations     int
	MaxConversationBytes int64
	// RequireConversationID answers 400 to requests without a conversation id instead of
	// routing them one-way.
	RequireConversationID bool
	// Store is where conversations are kept between turns: "" or "memory" for the in-process
	// cache (the default), or a Redis URL (redis://[user:password@]host:port[/db]) that the
	// replicas of a proxy tier share. With Redis, CacheTTL is the keys' expiry, a turn is
	// claimed by exactly one replica (GETDEL), and the memory bound is Redis's maxmemory
	// policy; a Redis that cannot be reached makes turns misses, never errors.
	Store string
	// StoreKey is the secret D's params are sealed under in the store (AES-256-GCM, key derived
	// with HKDF-SHA256; seal.go). Replicas sharing a Redis store must share it, and Redis needs
	// one: NewMultiTurn refuses a Redis store without it. Empty with the in-memory store: a
	// random key of this process (its entries never leave it).
	StoreKey string
	// Now is the clock of the cache (default time.Now).
	Now func() time.Time
}

// ErrStoreKey is NewMultiTurn's refusal of a Redis conversation store without a StoreKey: the
// replicas sharing it need one shared key to seal D's params (a per-process key would make every
// turn another replica stored a miss, and params in clear text would hand lease tokens to
// whoever reads Redis).
var ErrStoreKey = errors.New("proxy: a Redis conversation store needs a key to seal D's kv_transfer_params (--conversation-store-key, KVBRIDGE_CONVERSATION_STORE_KEY or KVBRIDGE_KV_AUTH_TOKEN), the same on every replica")

// Response headers saying what the multi-turn proxy did.
const (
	// HeaderCache is "hit" (P pulled the conversation's KV from D), "miss" or "off" (no id).
	HeaderCache = "X-KVBridge-Cache"
	// HeaderPromptTokens, HeaderPulledTokens and HeaderComputedTokens describe P's prefill: the
	// prompt length, the tokens pulled from D, and the tokens P computed itself. The last two
	// come from P's usage.prompt_tokens_details and are left out when P does not report it (P
	// started without --enable-prompt-tokens-details): the split is then unknown, not zero.
	HeaderPromptTokens   = "X-KVBridge-Prefill-Prompt-Tokens"
	HeaderPulledTokens   = "X-KVBridge-Prefill-Pulled-Tokens"
	HeaderComputedTokens = "X-KVBridge-Prefill-Computed-Tokens"
)

// MultiTurn is the stateful multi-turn proxy (vLLM's disagg_proxy_multiturn; docs/architecture.md,
// "Bidirectional", wire contract items 36–38): it remembers the kv_transfer_params D returns at
// the end of each turn, keyed by conversation id, and sends them to P with the next turn so that P
// pulls the conversation's KV from D.
type MultiTurn struct {
	legs
	route   *router
	cache   *ConversationCache // the in-memory store, or nil
	redis   *redisStore        // the Redis store, or nil
	store   conversationStore
	sealer  *sealer
	require bool
	mux     *http.ServeMux
	handler http.Handler // mux, its writes bounded by WriteTimeout
	reg     *prometheus.Registry
	m       proxyMetrics
	health  healthProber

	mu        sync.Mutex
	unhealthy map[Instance]time.Time
	noParams  map[Instance]bool // decoders already warned about for returning no params

	closeOnce sync.Once
	closeErr  error
}

type proxyMetrics struct {
	hits, misses, rejections, uncachable, noParams, claimed prometheus.Counter
	unsealable                                              prometheus.Counter // stored turns that did not open
	leg, storeTime                                          *prometheus.HistogramVec
	storeErrors                                             *prometheus.CounterVec
	ttft                                                    prometheus.Histogram
}

// NewMultiTurn returns the multi-turn proxy for cfg.
func NewMultiTurn(cfg MultiTurnConfig) (*MultiTurn, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if cfg.CacheTTL <= 0 {
		cfg.CacheTTL = DefaultConversationTTL
	}
	mt := &MultiTurn{
		legs:      newLegs(cfg.Config),
		require:   cfg.RequireConversationID,
		mux:       http.NewServeMux(),
		reg:       prometheus.NewRegistry(),
		unhealthy: map[Instance]time.Time{},
		noParams:  map[Instance]bool{},
	}
	switch {
	case cfg.Store == "" || cfg.Store == "memory":
		mt.cache = NewConversationCache(cfg.CacheTTL, cfg.MaxConversations, cfg.MaxConversationBytes, cfg.Now)
		mt.store = mt.cache
	case strings.HasPrefix(cfg.Store, "redis://") || strings.HasPrefix(cfg.Store, "rediss://"):
		if cfg.StoreKey == "" {
			return nil, ErrStoreKey
		}
		rs, err := newRedisStore(cfg.Store, cfg.CacheTTL)
		if err != nil {
			return nil, err
		}
		mt.redis, mt.store = rs, rs
	default:
		return nil, fmt.Errorf("proxy: conversation store %q: want \"memory\" or a redis:// URL", cfg.Store)
	}
	var err error
	if mt.sealer, err = newSealer(cfg.StoreKey); err != nil {
		_ = mt.store.close()
		return nil, err
	}
	if mt.route, err = newRouter(cfg.Config, mt.reg); err != nil {
		_ = mt.store.close()
		return nil, err
	}
	counter := func(name, help string) prometheus.Counter {
		c := prometheus.NewCounter(prometheus.CounterOpts{Name: "kvbridge:proxy_" + name, Help: help})
		mt.reg.MustRegister(c)
		return c
	}
	mt.m.hits = counter("conversation_cache_hits_total", "Turns whose prefill pulled the conversation's KV from the decoder.")
	mt.m.misses = counter("conversation_cache_misses_total", "Turns with a conversation id but no usable cached params (first turn, expired, or edited history).")
	mt.m.rejections = counter("conversation_cache_rejections_total", "Cached turns refused because the new request does not continue the previous one exactly.")
	mt.m.uncachable = counter("conversation_cache_uncachable_total", "Turns not cached because the answer had reasoning or tool-call deltas or include_reasoning was false.")
	mt.m.noParams = counter("decode_without_params_total", "Turns with a conversation id whose decoder returned no kv_transfer_params, so nothing could be cached (a decoder without bidirectional_kv_xfer, or another engine).")
	mt.m.leg = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvbridge:proxy_leg_seconds", Help: "Duration of each leg: prefill until P's answer, decode until the end of D's stream.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)}, []string{"leg"})
	mt.m.ttft = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvbridge:proxy_time_to_first_token_seconds", Help: "Time from the client's request to the first content the proxy relays.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)})
	mt.m.unsealable = counter("conversation_store_unsealable_total", "Stored turns that did not open under this proxy's conversation store key (tampered with, or sealed under another key), each a miss.")
	mt.m.claimed = counter("conversations_claimed_total", "Conversations whose stored turn this replica took (single use: of concurrent takers, one).")
	mt.m.storeTime = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvbridge:proxy_conversation_store_seconds", Help: "Round trips to the conversation store, by operation.",
		Buckets: prometheus.ExponentialBuckets(0.00005, 2, 16)}, []string{"op"})
	mt.m.storeErrors = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvbridge:proxy_conversation_store_errors_total", Help: "Conversation store operations that failed (each a cache miss or a turn not stored), by operation."}, []string{"op"})
	mt.reg.MustRegister(mt.m.leg, mt.m.ttft, mt.m.storeTime, mt.m.storeErrors)
	for _, reason := range []string{ReasonPrefillNoParams, ReasonDecodePulledNothing} {
		mt.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvbridge:proxy_requests_without_kv_transfer_total",
			Help:        "P/D requests served without a KV transfer, by reason: P returned no kv_transfer_params (P and D swapped, P without a connector), or D pulled none of the prompt (auth tokens differ, a failed handshake).",
			ConstLabels: prometheus.Labels{"reason": reason}},
			func() float64 { return float64(mt.watch.counts()[reason]) }))
	}
	if mt.cache != nil {
		mt.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvbridge:proxy_cached_conversations", Help: "Conversations in the cache."},
			func() float64 { n, _ := mt.cache.Sweep(); return float64(n) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvbridge:proxy_conversation_cache_evictions_total", Help: "Conversations dropped because the cache was full."},
				func() float64 { return float64(mt.cache.Evicted()) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvbridge:proxy_conversations_expired_total", Help: "Conversations dropped because their TTL passed."},
				func() float64 { _, stale := mt.cache.Sweep(); return float64(stale) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvbridge:proxy_cached_conversation_bytes", Help: "Bytes the cached conversations take, as the cache's byte bound counts them."},
				func() float64 { return float64(mt.cache.Bytes()) }))
	}
	mt.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvbridge:proxy_conversation_store_up", Help: "1 when the conversation store's last round trip succeeded."},
		func() float64 {
			if mt.redis != nil && !mt.redis.up.Load() {
				return 0
			}
			return 1
		}))
	if mt.redis != nil {
		mt.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvbridge:proxy_conversations_expired_total", Help: "Keys the Redis server expired (INFO stats expired_keys; the whole server's count)."},
			func() float64 {
				ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
				defer cancel()
				return float64(max(mt.redis.expiredKeys(ctx), 0))
			}))
	}
	mt.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvbridge:proxy_http_client_stalled_total", Help: "Responses whose client took no write within the write timeout (--write-timeout); the request's legs were cancelled."},
		func() float64 { return float64(mt.stalled.Load()) }))
	mt.handler = httpdeadline.Bound(mt.mux, mt.legs.cfg.WriteTimeout, func() { mt.stalled.Add(1) })
	mt.mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { mt.handle(w, r, "/v1/completions", false) })
	mt.mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { mt.handle(w, r, "/v1/chat/completions", true) })
	mt.health = healthProber{client: mt.client, prefill: cfg.Prefill, decode: cfg.Decode, interval: cfg.HealthInterval, recovered: mt.route.engineRestarted}
	if mt.redis != nil {
		mt.health.ping = mt.redis.ping
	}
	mt.mux.HandleFunc("GET /health", mt.handleHealth)
	mt.mux.HandleFunc("GET /healthcheck", mt.handleHealth)
	mt.mux.HandleFunc("GET /ready", mt.handleReady)
	mt.mux.Handle("GET /metrics", promhttp.HandlerFor(mt.reg, promhttp.HandlerOpts{}))
	mt.mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		relayGet(w, r, &mt.legs, mt.route.d.list[mt.route.d.roundRobin()], "/v1/models")
	})
	mt.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "NotFoundError", "not_found", fmt.Sprintf("%s %s is not a route of this proxy", r.Method, r.URL.Path))
	})
	return mt, nil
}

// ServeHTTP implements http.Handler.
func (mt *MultiTurn) ServeHTTP(w http.ResponseWriter, r *http.Request) { mt.handler.ServeHTTP(w, r) }

// Close stops the KV event subscribers and releases idle connections to the engines and the
// store's connections. It is idempotent.
func (mt *MultiTurn) Close() error {
	mt.route.close()
	if t, ok := mt.cfg.Transport.(interface{ CloseIdleConnections() }); ok {
		t.CloseIdleConnections()
	}
	mt.closeOnce.Do(func() { mt.closeErr = mt.store.close() })
	return mt.closeErr
}

// Cache returns the in-memory conversation cache (for diagnostics), nil with another store.
func (mt *MultiTurn) Cache() *ConversationCache { return mt.cache }

// healthFields returns the health routes' body: the engines' and the store's state (Redis
// checked by a PING, not remembered from the last request).
func (mt *MultiTurn) healthFields(rep healthReport) map[string]any {
	h := mt.withTransferCounts(rep.fields())
	if mt.cache != nil {
		n, stale := mt.cache.Sweep()
		h["store"], h["cached_conversations"], h["evicted_stale"], h["evicted_capacity"] = "memory", n, stale, mt.cache.Evicted()
	} else {
		h["store"], h["store_up"] = "redis", rep.store == nil
	}
	return h
}

func (mt *MultiTurn) handleHealth(w http.ResponseWriter, r *http.Request) {
	writeHealth(w, mt.healthFields(mt.health.report(r.Context())))
}

func (mt *MultiTurn) handleReady(w http.ResponseWriter, r *http.Request) {
	rep := mt.health.report(r.Context())
	writeReady(w, rep, mt.healthFields(rep))
}

// takeTurn claims conv's stored turn; a store that fails is a miss.
func (mt *MultiTurn) takeTurn(ctx context.Context, conv string) (turn, bool) {
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	start := time.Now()
	t, ok, err := mt.store.take(ctx, conv)
	mt.m.storeTime.WithLabelValues("take").Observe(time.Since(start).Seconds())
	if err != nil {
		mt.m.storeErrors.WithLabelValues("take").Inc()
		mt.cfg.Logger.Warn("conversation store: take failed; the turn is a miss", "err", err)
		return turn{}, false
	}
	if !ok {
		return turn{}, false
	}
	mt.m.claimed.Inc()
	if t, err = mt.sealer.open(conv, t); err != nil {
		mt.m.unsealable.Inc()
		mt.cfg.Logger.Warn("conversation store: a stored turn does not open; the turn is a miss (replicas sharing a store need the same --conversation-store-key)", "error", err)
		return turn{}, false
	}
	return t, true
}

// putTurn stores conv's turn; a store that fails loses it (the next turn misses).
func (mt *MultiTurn) putTurn(ctx context.Context, conv string, t turn) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
	defer cancel()
	t, err := mt.sealer.seal(conv, t)
	if err != nil {
		mt.cfg.Logger.Warn("conversation store: sealing a turn failed; the next turn will miss", "error", err)
		return
	}
	start := time.Now()
	err = mt.store.put(ctx, conv, t)
	mt.m.storeTime.WithLabelValues("put").Observe(time.Since(start).Seconds())
	if err != nil {
		mt.m.storeErrors.WithLabelValues("put").Inc()
		mt.cfg.Logger.Warn("conversation store: put failed; the next turn will miss", "err", err)
	}
}

// healthy reports whether inst answered its last leg (a transport failure makes it unhealthy for
// 30 s, during which its conversations go to other decoders).
func (mt *MultiTurn) healthy(inst Instance) bool {
	mt.mu.Lock()
	defer mt.mu.Unlock()
	t, ok := mt.unhealthy[inst]
	return !ok || time.Since(t) > 30*time.Second
}

func (mt *MultiTurn) markUnhealthy(inst Instance) {
	mt.mu.Lock()
	mt.unhealthy[inst] = time.Now()
	mt.mu.Unlock()
}

// MaxConversationIDBytes is the longest conversation id the multi-turn proxy accepts.
const MaxConversationIDBytes = 256

// conversationID takes the id out of the body (it is never forwarded) or the X-Session-ID header.
func conversationID(b body, r *http.Request) (string, error) {
	v, ok := b["conversation_id"]
	delete(b, "conversation_id")
	id := r.Header.Get("X-Session-ID")
	if ok && v != nil {
		s, isStr := v.(string)
		if !isStr {
			return "", errors.New("conversation_id must be a string")
		}
		if s != "" {
			id = s
		}
	}
	if len(id) > MaxConversationIDBytes {
		return "", fmt.Errorf("conversation_id is %d bytes long; at most %d are accepted", len(id), MaxConversationIDBytes)
	}
	return id, nil
}

// refuseClientParams answers 400 when a client sends kv_transfer_params: they name engines'
// blocks, and only the proxy, which talks to the engines, may fill them in.
func refuseClientParams(w http.ResponseWriter, b body) bool {
	if _, ok := b["kv_transfer_params"]; !ok {
		return false
	}
	writeError(w, http.StatusBadRequest, "BadRequestError", codeBadRequest,
		"kv_transfer_params are set by this proxy for its engines; a client may not send them")
	return true
}

func (mt *MultiTurn) handle(w http.ResponseWriter, r *http.Request, path string, chat bool) {
	start := time.Now()
	b, ok := mt.readBody(w, r)
	if !ok || refuseClientParams(w, b) {
		return
	}
	conv, err := conversationID(b, r)
	if err != nil {
		writeError(w, http.StatusBadRequest, "BadRequestError", codeBadRequest, err.Error())
		return
	}
	if conv == "" && mt.require {
		writeError(w, http.StatusBadRequest, "proxy_error", "missing_conversation_id", "conversation_id is required by this proxy")
		return
	}
	reqID := requestID(r)
	if conv == "" {
		mt.cfg.Logger.Warn("No conversation_id provided — KV cache reuse disabled for this request", "request_id", reqID)
	}
	var dInst Instance
	pparams, cacheState := prefillTemplate(), "off"
	if conv != "" {
		cacheState = "miss"
		// A turn is reused only when the history continues and its decoder is one of ours: an
		// entry from a shared store (Redis) naming another host is not trusted with the
		// client's request (nor with its Authorization header), whoever wrote it.
		if t, found := mt.takeTurn(r.Context(), conv); found && t.continues(b) && mt.route.d.has(t.decoder) {
			cacheState = "hit"
			pparams = maps.Clone(t.params)
			pparams["do_remote_decode"] = true
			pparams["do_remote_prefill"] = false
			if mt.healthy(t.decoder) {
				dInst = t.decoder // the decoder that holds the conversation decodes again; else by load
			}
			mt.m.hits.Inc()
		} else {
			if found {
				mt.m.rejections.Inc()
			}
			mt.m.misses.Inc()
		}
	}
	pInst, pDone := mt.route.pickPrefill(r.Context(), &mt.legs, path, reqID, r.Header, b)
	defer pDone() // at the end of a push; after the prefill leg in the pull flow
	var dDone func()
	if dInst == (Instance{}) {
		dInst, dDone = mt.route.pickDecode()
	} else {
		dInst, dDone = mt.route.takeDecode(dInst)
	}
	defer dDone()
	// A turn that pulls nothing from D may push P's KV to D (docs/architecture.md, "Push"); a
	// hit pulls the conversation's earlier turns from D and stays the pull flow.
	fl, info := flowPull, engineInfo{}
	if cacheState != "hit" {
		fl, info = mt.chooseFlow(r.Context(), pInst, r.Header)
	}
	// A streaming client's D leg carries usage (its params ride on D's last chunk, and the usage
	// chunk goes to the client only if it asked for it: as in vLLM, stream_options {} asks for
	// usage). A client that asked for no stream gets D's JSON answer, params taken out.
	wantUsage := false
	if so, ok := b["stream_options"].(map[string]any); ok {
		v, set := so["include_usage"]
		wantUsage = !set || v == true
	}
	opts := decodeOptions{
		usage:       wantUsage,
		first:       func() { mt.m.ttft.Observe(time.Since(start).Seconds()) },
		unreachable: func() { mt.markUnhealthy(dInst) },
		// The turn is stored when D's stream ends, before the client sees [DONE].
		done: func(ans *answer) {
			if conv != "" {
				mt.remember(r.Context(), conv, chat, b, dInst, ans)
			}
		},
	}
	if fl == flowPush {
		w.Header().Set(HeaderCache, cacheState)
		id := pushID()
		opts.sawUsage = mt.watchDecode(dInst, reqID)
		dstart := time.Now()
		// D reaches P's side channel at P's HTTP host, as in the pull flow's params.
		out := mt.push(w, r, pInst, dInst, path, reqID, prefillRequest(b, pushPrefillParams(pparams, id)),
			turnDecodeBody(b, pushDecodeParams(info, pInst.Host, id), wantUsage), opts,
			func(h http.Header, pre prefillResult) { setUsageHeaders(h, pre.usage) })
		end := time.Now()
		if !out.prefilled.IsZero() {
			mt.m.leg.WithLabelValues("prefill").Observe(out.prefilled.Sub(start).Seconds())
		}
		mt.m.leg.WithLabelValues("decode").Observe(end.Sub(dstart).Seconds())
		switch {
		case out.prefillOK && out.pre.params == nil:
			mt.watch.prefillWithoutParams(pInst, reqID)
		case out.prefillErr != nil && out.prefillErr.body == nil:
			mt.markUnhealthy(pInst)
		}
		return
	}
	pre, lerr := mt.prefill(r.Context(), pInst, path, reqID, r.Header, prefillRequest(b, pparams), true)
	pDone()
	mt.m.leg.WithLabelValues("prefill").Observe(time.Since(start).Seconds())
	if lerr != nil {
		if lerr.body == nil {
			mt.markUnhealthy(pInst)
		}
		lerr.write(w)
		return
	}
	dparams := pre.params
	if fl == flowPushSerial {
		dparams = serialPushParams(dparams)
	}
	if dparams != nil {
		dparams["remote_host"] = pInst.Host // D reaches P's side channel at P's HTTP host
	}
	w.Header().Set(HeaderCache, cacheState)
	setUsageHeaders(w.Header(), pre.usage)
	opts.sawUsage = mt.watchTransfer(pInst, dInst, reqID, pre)
	dstart := time.Now()
	_ = mt.decode(w, r, dInst, path, reqID, turnDecodeBody(b, dparams, wantUsage), opts)
	mt.m.leg.WithLabelValues("decode").Observe(time.Since(dstart).Seconds())
}

// turnDecodeBody is D's body for a turn: a copy of the client's with D's params and, for a streaming
// client, the client's stream_options (continuous_usage_stats, …) with include_usage on —
// per-chunk usage only if the client asked for usage, as vLLM gives it only with include_usage.
func turnDecodeBody(b body, params map[string]any, wantUsage bool) body {
	dbody := decodeRequest(b, params) // a copy: never the client's own body
	if b.streaming() {
		so := map[string]any{}
		if c, ok := b["stream_options"].(map[string]any); ok {
			so = maps.Clone(c)
		}
		so["include_usage"] = true
		if !wantUsage {
			delete(so, "continuous_usage_stats")
		}
		dbody["stream_options"] = so
	}
	return dbody
}

// remember stores the turn a finished answer completes, when it can be reused.
func (mt *MultiTurn) remember(ctx context.Context, conv string, chat bool, b body, dInst Instance, ans *answer) {
	switch {
	case ans.failed:
		return
	case ans.params == nil:
		mt.warnNoParams(dInst)
		return
	case ans.uncachable || b["include_reasoning"] == false:
		mt.m.uncachable.Inc()
		return
	}
	ans.params["remote_host"] = dInst.Host
	var t turn
	if chat {
		msgs, ok := canonicalMessages(b)
		if !ok {
			return
		}
		t = newChatTurn(ans.params, dInst, msgs, ans.text.String())
	} else if p, ok := b["prompt"].(string); ok {
		t = newCompletionTurn(ans.params, dInst, p, ans.text.String())
	} else {
		return // token-id prompts cannot be checked for continuation
	}
	mt.putTurn(ctx, conv, t)
}

// warnNoParams counts a turn whose decoder returned no kv_transfer_params, and says why once
// per decoder: nothing of its conversations can be cached.
func (mt *MultiTurn) warnNoParams(d Instance) {
	mt.m.noParams.Inc()
	mt.mu.Lock()
	warned := mt.noParams[d]
	mt.noParams[d] = true
	mt.mu.Unlock()
	if !warned {
		mt.cfg.Logger.Warn("decode instance returned no kv_transfer_params, so its conversations are never cached and every turn is a miss: start it with kv_connector_extra_config.bidirectional_kv_xfer=true (a kvbridge or vLLM engine with the NixlConnector)",
			"instance", d.String())
	}
}

// setUsageHeaders reports P's prefill accounting.
func setUsageHeaders(h http.Header, usage map[string]any) {
	num := func(m map[string]any, k string) int {
		n, _ := jsonInt(m[k])
		return int(n)
	}
	if usage == nil {
		return
	}
	prompt := num(usage, "prompt_tokens")
	h.Set(HeaderPromptTokens, strconv.Itoa(prompt))
	details, ok := usage["prompt_tokens_details"].(map[string]any)
	if !ok {
		return
	}
	cached := num(details, "cached_tokens")
	h.Set(HeaderPulledTokens, strconv.Itoa(num(details, "external_cached_tokens")))
	h.Set(HeaderComputedTokens, strconv.Itoa(prompt-cached))
}
