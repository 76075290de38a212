package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// MultiTurnConfig configures the multi-turn proxy.
type MultiTurnConfig struct {
	Config
	// CacheTTL is how long a conversation's D params stay usable (default 450 s, below the
	// decoder's 480 s decoder_kv_blocks_ttl).
	CacheTTL time.Duration
	// MaxConversations bounds the cache (default 10,000); the least recently stored go first.
	MaxConversations int
	// RequireConversationID answers 400 to requests without a conversation id instead of
	// routing them one-way.
	RequireConversationID bool
	// Now is the clock of the cache (default time.Now).
	Now func() time.Time
}

// Response headers saying what the multi-turn proxy did.
const (
	// HeaderCache is "hit" (P pulled the conversation's KV from D), "miss" or "off" (no id).
	HeaderCache = "X-KVBridge-Cache"
	// HeaderPromptTokens, HeaderPulledTokens and HeaderComputedTokens describe P's prefill: the
	// prompt length, the tokens pulled from D, and the tokens P computed itself.
	HeaderPromptTokens   = "X-KVBridge-Prefill-Prompt-Tokens"
	HeaderPulledTokens   = "X-KVBridge-Prefill-Pulled-Tokens"
	HeaderComputedTokens = "X-KVBridge-Prefill-Computed-Tokens"
)

// MultiTurn is the stateful multi-turn proxy (vLLM's disagg_proxy_multiturn, spec §5.5–5.6):
// it remembers the kv_transfer_params D returns at the end of each turn, keyed by conversation
// id, and sends them to P with the next turn so that P pulls the conversation's KV from D.
type MultiTurn struct {
	legs
	p, d    roundRobin
	cache   *ConversationCache
	require bool
	mux     *http.ServeMux
	reg     *prometheus.Registry
	m       proxyMetrics

	mu        sync.Mutex
	unhealthy map[Instance]time.Time
}

type proxyMetrics struct {
	hits, misses, rejections, uncachable prometheus.Counter
	leg                                  *prometheus.HistogramVec
	ttft                                 prometheus.Histogram
}

// NewMultiTurn returns the multi-turn proxy for cfg.
func NewMultiTurn(cfg MultiTurnConfig) (*MultiTurn, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if cfg.CacheTTL <= 0 {
		cfg.CacheTTL = 450 * time.Second
	}
	mt := &MultiTurn{
		legs:      legs{cfg: cfg.Config, client: &http.Client{Transport: cfg.Transport}},
		p:         roundRobin{list: cfg.Prefill},
		d:         roundRobin{list: cfg.Decode},
		cache:     NewConversationCache(cfg.CacheTTL, cfg.MaxConversations, cfg.Now),
		require:   cfg.RequireConversationID,
		mux:       http.NewServeMux(),
		reg:       prometheus.NewRegistry(),
		unhealthy: map[Instance]time.Time{},
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
	mt.m.leg = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvbridge:proxy_leg_seconds", Help: "Duration of each leg: prefill until P's answer, decode until the end of D's stream.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)}, []string{"leg"})
	mt.m.ttft = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvbridge:proxy_time_to_first_token_seconds", Help: "Time from the client's request to the first content the proxy relays.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)})
	mt.reg.MustRegister(mt.m.leg, mt.m.ttft, prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvbridge:proxy_cached_conversations", Help: "Conversations in the cache."},
		func() float64 { n, _ := mt.cache.Sweep(); return float64(n) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvbridge:proxy_conversation_cache_evictions_total", Help: "Conversations dropped because the cache was full."},
			func() float64 { return float64(mt.cache.Evicted()) }))
	mt.mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { mt.handle(w, r, "/v1/completions", false) })
	mt.mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { mt.handle(w, r, "/v1/chat/completions", true) })
	mt.mux.HandleFunc("GET /health", mt.health)
	mt.mux.HandleFunc("GET /healthcheck", mt.health)
	mt.mux.Handle("GET /metrics", promhttp.HandlerFor(mt.reg, promhttp.HandlerOpts{}))
	mt.mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) { relayGet(w, r, &mt.legs, mt.d.pick(), "/v1/models") })
	mt.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "NotFoundError", "not_found", fmt.Sprintf("%s %s is not a route of this proxy", r.Method, r.URL.Path))
	})
	return mt, nil
}

// ServeHTTP implements http.Handler.
func (mt *MultiTurn) ServeHTTP(w http.ResponseWriter, r *http.Request) { mt.mux.ServeHTTP(w, r) }

// Close releases idle connections to the engines. It is idempotent.
func (mt *MultiTurn) Close() error {
	if t, ok := mt.cfg.Transport.(interface{ CloseIdleConnections() }); ok {
		t.CloseIdleConnections()
	}
	return nil
}

// Cache returns the conversation cache (for diagnostics).
func (mt *MultiTurn) Cache() *ConversationCache { return mt.cache }

func (mt *MultiTurn) health(w http.ResponseWriter, _ *http.Request) {
	n, stale := mt.cache.Sweep()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"status": "ok", "cached_conversations": n, "evicted_stale": stale,
		"evicted_capacity": mt.cache.Evicted(), "prefill_instances": len(mt.cfg.Prefill), "decode_instances": len(mt.cfg.Decode)})
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

// conversationID takes the id out of the body (it is never forwarded) or the X-Session-ID header.
func conversationID(b body, r *http.Request) (string, error) {
	v, ok := b["conversation_id"]
	delete(b, "conversation_id")
	if ok && v != nil {
		s, isStr := v.(string)
		if !isStr {
			return "", errors.New("conversation_id must be a string")
		}
		if s != "" {
			return s, nil
		}
	}
	return r.Header.Get("X-Session-ID"), nil
}

func (mt *MultiTurn) handle(w http.ResponseWriter, r *http.Request, path string, chat bool) {
	start := time.Now()
	b, ok := mt.readBody(w, r)
	if !ok {
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
	pInst, dInst := mt.p.pick(), mt.d.pick()
	pparams, cacheState := prefillTemplate(), "off"
	if conv != "" {
		cacheState = "miss"
		if t, found := mt.cache.take(conv); found && t.continues(b) {
			cacheState = "hit"
			pparams = maps.Clone(t.params)
			pparams["do_remote_decode"] = true
			pparams["do_remote_prefill"] = false
			if mt.healthy(t.decoder) {
				dInst = t.decoder // the decoder that holds the conversation decodes again
			}
			mt.m.hits.Inc()
		} else {
			if found {
				mt.m.rejections.Inc()
			}
			mt.m.misses.Inc()
		}
	}
	pbody := prefillRequest(b, pparams)
	delete(pbody, "max_completion_tokens")
	pre, lerr := mt.prefill(r.Context(), pInst, path, reqID, r.Header, pbody)
	mt.m.leg.WithLabelValues("prefill").Observe(time.Since(start).Seconds())
	if lerr != nil {
		if lerr.body == nil {
			mt.markUnhealthy(pInst)
		}
		lerr.write(w)
		return
	}
	dparams := pre.params
	if dparams != nil {
		dparams["remote_host"] = pInst.Host // D reaches P's side channel at P's HTTP host
	}
	h := w.Header()
	h.Set(HeaderCache, cacheState)
	setUsageHeaders(h, pre.usage)

	dbody := decodeRequest(b, dparams)
	dbody["stream"] = true
	dbody["stream_options"] = map[string]any{"include_usage": true}
	dstart := time.Now()
	ans, err := mt.decodeStream(w, r, dInst, path, reqID, dbody, b, start)
	mt.m.leg.WithLabelValues("decode").Observe(time.Since(dstart).Seconds())
	if err != nil {
		return
	}
	if conv == "" || ans.params == nil || ans.err != nil {
		return
	}
	if ans.uncachable || b["include_reasoning"] == false {
		mt.m.uncachable.Inc()
		return
	}
	t := turn{params: ans.params, decoder: dInst, chat: chat, text: ans.text}
	t.params["remote_host"] = dInst.Host
	if chat {
		t.messages, _ = canonicalMessages(b)
	} else if p, ok := b["prompt"].(string); ok {
		t.prompt = p
	} else {
		return // token-id prompts cannot be checked for continuation
	}
	mt.cache.put(conv, t)
}

// setUsageHeaders reports P's prefill accounting.
func setUsageHeaders(h http.Header, usage map[string]any) {
	num := func(m map[string]any, k string) int {
		switch v := m[k].(type) {
		case json.Number:
			n, _ := v.Int64()
			return int(n)
		case float64:
			return int(v)
		}
		return 0
	}
	if usage == nil {
		return
	}
	prompt := num(usage, "prompt_tokens")
	details, _ := usage["prompt_tokens_details"].(map[string]any)
	cached := num(details, "cached_tokens")
	h.Set(HeaderPromptTokens, strconv.Itoa(prompt))
	h.Set(HeaderPulledTokens, strconv.Itoa(num(details, "external_cached_tokens")))
	h.Set(HeaderComputedTokens, strconv.Itoa(prompt-cached))
}

// answer is what D's stream said.
type answer struct {
	text       string
	finish     string
	params     map[string]any
	usage      map[string]any
	id, model  string
	created    any
	err        map[string]any
	uncachable bool
}

// decodeStream calls D with stream=true and either relays the events to a streaming client
// (leaving out the chunk that only carries D's kv_transfer_params, and the usage chunk unless
// the client asked for it) or assembles one response for a non-streaming client.
func (mt *MultiTurn) decodeStream(w http.ResponseWriter, r *http.Request, inst Instance, path, reqID string, dbody, client body, start time.Time) (answer, error) {
	var ans answer
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	resp, err := mt.post(ctx, inst, path, reqID, r.Header, dbody)
	if err != nil {
		if r.Context().Err() == nil {
			mt.markUnhealthy(inst)
			mt.fail("decode", inst, reqID, &legError{status: http.StatusBadGateway, code: codeDecodeFailed, msg: err.Error()}).write(w)
		}
		return ans, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		data, _ := readAllIdle(resp.Body, mt.cfg.IdleTimeout, cancel)
		(&legError{status: resp.StatusCode, body: data}).write(w)
		return ans, fmt.Errorf("decode answered %d", resp.StatusCode)
	}
	streaming := client.streaming()
	wantUsage := false
	if so, ok := client["stream_options"].(map[string]any); ok {
		wantUsage, _ = so["include_usage"].(bool)
	}
	rc := http.NewResponseController(w)
	if streaming {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-cache")
		w.Header().Set("X-Request-Id", reqID)
		w.WriteHeader(http.StatusOK)
		_ = rc.Flush()
	}
	ir := newIdleReader(resp.Body, mt.cfg.IdleTimeout, cancel)
	defer ir.close()
	br := bufio.NewReaderSize(ir, 64<<10)
	first := true
	for {
		line, err := br.ReadBytes('\n')
		data, isData := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data: "))
		if isData {
			forward := ans.event(data)
			if streaming && (forward || (wantUsage && isUsageChunk(data))) {
				if first && !bytes.Equal(data, []byte("[DONE]")) {
					mt.m.ttft.Observe(time.Since(start).Seconds())
					first = false
				}
				if _, werr := fmt.Fprintf(w, "data: %s\n\n", data); werr != nil {
					return ans, werr
				}
				if ferr := rc.Flush(); ferr != nil {
					return ans, ferr
				}
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			err = legCause(ctx, err)
			mt.cfg.Logger.Warn("proxy decode stream ended early", "instance", inst.String(), "request_id", reqID, "error", err)
			if streaming {
				writeSSEError(w, "decode stream ended early: "+err.Error())
				_ = rc.Flush()
			} else {
				mt.fail("decode", inst, reqID, &legError{status: http.StatusBadGateway, code: codeDecodeFailed, msg: err.Error()}).write(w)
			}
			return ans, err
		}
	}
	if !streaming {
		mt.m.ttft.Observe(time.Since(start).Seconds())
		writeAssembled(w, reqID, client, ans)
	}
	return ans, nil
}

// isUsageChunk reports whether an SSE payload is the usage-only chunk.
func isUsageChunk(data []byte) bool {
	var m struct {
		Choices []any `json:"choices"`
		Usage   any   `json:"usage"`
	}
	return json.Unmarshal(data, &m) == nil && len(m.Choices) == 0 && m.Usage != nil
}

// event records one SSE payload of D's stream and reports whether a streaming client should
// see it.
func (a *answer) event(data []byte) bool {
	if bytes.Equal(data, []byte("[DONE]")) {
		return true
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var m map[string]any
	if dec.Decode(&m) != nil {
		return true // not ours to judge
	}
	if e, ok := m["error"].(map[string]any); ok {
		a.err = e
		return true
	}
	if id, ok := m["id"].(string); ok {
		a.id = id
	}
	if s, ok := m["model"].(string); ok {
		a.model = s
	}
	if c, ok := m["created"]; ok {
		a.created = c
	}
	choices, _ := m["choices"].([]any)
	for _, c := range choices {
		ch, _ := c.(map[string]any)
		if s, ok := ch["text"].(string); ok {
			a.text += s
		}
		if d, ok := ch["delta"].(map[string]any); ok {
			if s, ok := d["content"].(string); ok {
				a.text += s
			}
			for _, k := range []string{"reasoning", "reasoning_content", "tool_calls", "function_call"} {
				if v, ok := d[k]; ok && v != nil && !isEmptyList(v) {
					a.uncachable = true
				}
			}
		}
		if f, ok := ch["finish_reason"].(string); ok {
			a.finish = f
		}
	}
	if u, ok := m["usage"].(map[string]any); ok {
		a.usage = u
	}
	if kv, ok := m["kv_transfer_params"].(map[string]any); ok {
		a.params = kv
		return len(choices) > 0 // a chunk that only carries D's params stays with the proxy
	}
	return !(len(choices) == 0 && a.usage != nil && m["usage"] != nil)
}

func isEmptyList(v any) bool {
	l, ok := v.([]any)
	return ok && len(l) == 0
}

// writeSSEError ends a stream with an error event and [DONE], as vLLM's engine does.
func writeSSEError(w io.Writer, msg string) {
	data, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "BadGatewayError", "param": nil, "code": http.StatusBadGateway}})
	fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", data)
}

// writeAssembled answers a non-streaming client with the body D's stream amounts to.
func writeAssembled(w http.ResponseWriter, reqID string, client body, a answer) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Request-Id", reqID)
	if a.err != nil {
		status := http.StatusInternalServerError
		if c, ok := a.err["code"].(json.Number); ok {
			if n, err := c.Int64(); err == nil && n >= 400 && n < 600 {
				status = int(n)
			}
		}
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(map[string]any{"error": a.err})
		return
	}
	var finish any
	if a.finish != "" {
		finish = a.finish
	}
	model := a.model
	if model == "" {
		model, _ = client["model"].(string)
	}
	out := map[string]any{"id": a.id, "created": a.created, "model": model, "usage": a.usage}
	if _, chat := client["messages"]; chat {
		out["object"] = "chat.completion"
		out["choices"] = []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": a.text}, "finish_reason": finish, "logprobs": nil}}
	} else {
		out["object"] = "text_completion"
		out["choices"] = []any{map[string]any{"index": 0, "text": a.text, "finish_reason": finish, "logprobs": nil}}
	}
	_ = json.NewEncoder(w).Encode(out)
}
