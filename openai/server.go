package openai

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/semaphore"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/buildinfo"
	"github.com/kvbridge/kvbridge/internal/httpdeadline"
	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// DefaultMaxBodyBytes is the request body limit when Config.MaxBodyBytes is zero.
const DefaultMaxBodyBytes = 32 << 20

// Engine is what the HTTP layer needs from the inference engine; *engine.Engine implements it.
type Engine interface {
	// Add queues a request; cancelling ctx aborts it and frees its blocks.
	Add(ctx context.Context, r *engine.Request) (*engine.Stream, error)
	// Stats returns a snapshot of the scheduler, for the /metrics gauges.
	Stats() engine.Stats
}

// Model is what the HTTP layer needs from the model; *model.Model implements it.
type Model interface {
	// Name is the name the model was opened with (the "root" in /v1/models).
	Name() string
	// Tokenizer encodes prompts and decodes token-id prompts for echo.
	Tokenizer() *tokenizer.Tokenizer
	// ChatTemplate renders chat messages into the prompt text.
	ChatTemplate() tokenizer.ChatTemplate
	// Generation supplies the default temperature, top_p and top_k.
	Generation() model.GenerationConfig
}

// Config configures a Server. Zero values get the defaults documented per field.
type Config struct {
	// ServedModelNames are the names accepted in the "model" field; the first is the one
	// reported in responses and in the model_name metrics label. Default: the model's Name().
	ServedModelNames []string
	// MaxModelLen is the maximum prompt + generated length (--max-model-len); it should equal
	// the engine's. Zero means the engine's (when it has a Config() engine.Config method, as
	// *engine.Engine does), else 2048.
	MaxModelLen int
	// Logger receives request errors and panics. Default: discard.
	Logger *slog.Logger
	// Metrics is the registry served at /metrics and recorded into. Default: a new registry.
	Metrics *metrics.Registry
	// EngineLabel is the value of the "engine" metrics label. Default "0".
	EngineLabel string
	// APIKey, if set, is required as "Authorization: Bearer <key>" on every /v1 route.
	APIKey string
	// MaxBodyBytes limits request bodies (413 beyond it). Default DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// Version is reported by GET /version. Default: the binary's module version and VCS
	// revision (buildinfo.Version).
	Version string
	// MaxConcurrentRequests bounds the engine sequences of the completions being served at
	// once: a request takes one slot per sequence it runs, max(n, best_of), so that n and
	// best_of cannot multiply the work the bound admits. A request that finds too few slots free
	// is answered at once with 429 (RateLimitError) instead of queueing without bound. A request
	// with more sequences than the whole limit takes all of it: it runs, alone. Zero means no
	// limit. A request takes its first slot only once its body has been read, the rest once
	// the body has been validated; it gives them back as soon as the engine has ended its
	// sequences, even if the client has not read the answer yet. /tokenize and /detokenize take
	// one slot each while they work.
	MaxConcurrentRequests int
	// BodyReadTimeout bounds the reading of a request body (408 beyond it), so that a client
	// trickling its body holds nothing for long. Default DefaultBodyReadTimeout.
	BodyReadTimeout time.Duration
	// WriteTimeout bounds each write (of at most 64 KiB: a larger body goes out in pieces) and
	// each flush of a response to the client (--write-timeout): a client that takes nothing for
	// that long fails the write, its request's sequences are aborted in the engine and the
	// stall is counted (kvbridge:http_client_stalled_total). Default DefaultWriteTimeout.
	WriteTimeout time.Duration
	// MaxLogprobs is --max-logprobs: the most logprobs (sampled or prompt) a request may ask
	// for per position; −1 allows the whole vocabulary. Zero means DefaultMaxLogprobs.
	MaxLogprobs int
	// PromptTokensDetails is --enable-prompt-tokens-details: usage carries
	// prompt_tokens_details (cached_tokens, external_cached_tokens) only when it is set, as in
	// vLLM.
	PromptTokensDetails bool
	// ForceIncludeUsage is --enable-force-include-usage: streams end with the usage chunk even
	// when the request has no stream_options.
	ForceIncludeUsage bool
	// DeclineKV, if set, is called with the kv_transfer_params of a request refused before the
	// engine took it (invalid, too long, over capacity), so that the connector can account for
	// them. (It cannot end the producer's lease: only a reader that proves it holds the
	// lease's prompt can, and a refused request was never tokenized for that; the producer
	// frees the blocks when the lease expires, as vLLM's does.)
	DeclineKV func(params map[string]any)
	// CheckKV, if set, sees a request's kv_transfer_params before the engine takes it; an
	// error (a leg this engine's kv_role cannot serve) is answered with 400 naming
	// kv_transfer_params and the error's text, and the params are then handed to DeclineKV.
	// (An engine without a connector only counts them here.)
	CheckKV func(params map[string]any) error
	// KVInfo, if set, is served as JSON at GET /v1/kv_transfer: what this engine's connector
	// is (kv_connector, kv_role, …), so that `kvbridge check` can tell a misconfigured
	// deployment. Without it the route answers {"kv_connector":null}.
	KVInfo func() any
	// Ready, if set, says whether the server can serve now beyond its own HTTP listener (the
	// KV connector: side channel, transfer agent); GET /ready answers 503 naming its error. Nil
	// means ready whenever /health answers.
	Ready func(ctx context.Context) error
	// ResetPrefixCache, if set, serves POST /reset_prefix_cache (vLLM's route in dev mode,
	// VLLM_SERVER_DEV_MODE=1): it drops the engine's prefix cache and reports whether it could
	// (not while a request holds blocks). Nil: no such route.
	ResetPrefixCache func(ctx context.Context) (bool, error)
}

// DefaultBodyReadTimeout is Config.BodyReadTimeout's default.
const DefaultBodyReadTimeout = 30 * time.Second

// DefaultWriteTimeout is Config.WriteTimeout's default. A client that reads takes a write
// within a round trip whatever the pace of generation, so the bound never touches it even on a
// slow link or a loaded machine; 30 s, as long as the body read timeout, bounds what a client
// that stopped reading keeps busy: the engine work of its sequences, their blocks and a
// connection. (Its concurrency slots do not wait for it: they are free as soon as the engine has
// finished the sequences.)
const DefaultWriteTimeout = 30 * time.Second

// DefaultMaxConcurrentRequests is the concurrency bound `kvbridge serve` applies unless
// --max-concurrent-requests says otherwise: room for every sequence of a full batch many times
// over, yet a bound. (Config.MaxConcurrentRequests itself means no limit when zero.)
const DefaultMaxConcurrentRequests = 4096

// Server serves the OpenAI-compatible API. Create it with NewServer; it is an http.Handler.
type Server struct {
	cfg     Config
	engine  Engine
	model   Model
	log     *slog.Logger
	metrics *metrics.EngineMetrics
	reg     *metrics.Registry
	mux     *http.ServeMux
	created int64
	handler http.Handler
	slots   *semaphore.Weighted // MaxConcurrentRequests sequence slots, nil without a limit
	// promptBytes is the longest text that may encode to MaxModelLen tokens (maxPromptBytes).
	promptBytes int
	unknown     *unknownFields // request fields present but ignored
}

// NewServer returns a Server over eng and mdl. It installs eng.Stats as the source of the
// scheduler gauges of cfg.Metrics.
func NewServer(cfg Config, eng Engine, mdl Model) *Server {
	if len(cfg.ServedModelNames) == 0 {
		cfg.ServedModelNames = []string{mdl.Name()}
	}
	if cfg.MaxModelLen <= 0 {
		if ec, ok := eng.(interface{ Config() engine.Config }); ok {
			cfg.MaxModelLen = ec.Config().MaxModelLen
		}
		if cfg.MaxModelLen <= 0 {
			cfg.MaxModelLen = 2048
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Metrics == nil {
		cfg.Metrics = metrics.NewRegistry()
	}
	if cfg.EngineLabel == "" {
		cfg.EngineLabel = "0"
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.Version == "" {
		cfg.Version = buildinfo.Version()
	}
	if cfg.MaxLogprobs == 0 {
		cfg.MaxLogprobs = DefaultMaxLogprobs
	}
	if cfg.BodyReadTimeout <= 0 {
		cfg.BodyReadTimeout = DefaultBodyReadTimeout
	}
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = DefaultWriteTimeout
	}
	s := &Server{
		cfg:     cfg,
		engine:  eng,
		model:   mdl,
		log:     cfg.Logger,
		reg:     cfg.Metrics,
		metrics: cfg.Metrics.Engine(cfg.ServedModelNames[0], cfg.EngineLabel),
		mux:     http.NewServeMux(),
		created: time.Now().Unix(),
	}
	s.promptBytes = maxPromptBytes(mdl.Tokenizer(), cfg.MaxModelLen)
	s.unknown = newUnknownFields(s.log, s.metrics)
	s.metrics.SetStatsSource(func() metrics.SchedulerStats {
		st := eng.Stats()
		return metrics.SchedulerStats{
			Running: st.Running, Waiting: st.Waiting, KVCacheUsage: st.KVUsage,
			PrefixCacheQueries: st.PrefixQueries, PrefixCacheHits: st.PrefixHits, Preemptions: st.Preemptions,
		}
	})
	if cfg.MaxConcurrentRequests > 0 {
		s.slots = semaphore.NewWeighted(int64(cfg.MaxConcurrentRequests))
	}
	s.route("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { s.generate(w, r, s.completionJob) })
	s.route("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.generate(w, r, s.chatJob) })
	s.route("GET /v1/models", s.handleModels)
	s.route("GET /health", s.handleHealth)
	s.route("GET /ready", s.handleReady)
	s.route("GET /version", s.handleVersion)
	s.route("GET /v1/kv_transfer", s.handleKVTransfer)
	s.route("POST /tokenize", s.handleTokenize)
	s.route("POST /detokenize", s.handleDetokenize)
	if cfg.ResetPrefixCache != nil {
		s.route("POST /reset_prefix_cache", s.handleResetPrefixCache)
	}
	s.mux.HandleFunc("GET /ping", s.handleHealth)
	s.mux.HandleFunc("POST /ping", s.handleHealth)
	s.mux.Handle("/ping", methodNotAllowed("GET, HEAD, POST"))
	s.mux.Handle("GET /metrics", s.reg.Handler())
	s.mux.Handle("/metrics", methodNotAllowed("GET, HEAD"))
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &APIError{Status: http.StatusNotFound, Type: "NotFoundError",
			Message: fmt.Sprintf("No route for %s %s.", r.Method, r.URL.Path)})
	})
	s.handler = httpdeadline.Bound(s.countRejections(s.recoverPanics(s.requestID(s.authorize(s.mux)))), cfg.WriteTimeout,
		s.metrics.CountClientStalled)
	return s
}

// route registers h for pattern ("METHOD /path") and a JSON 405 for the path's other methods.
func (s *Server) route(pattern string, h http.HandlerFunc) {
	s.mux.HandleFunc(pattern, h)
	method, path, _ := strings.Cut(pattern, " ")
	allow := method
	if method == http.MethodGet {
		allow = "GET, HEAD"
	}
	s.mux.Handle(path, methodNotAllowed(allow))
}

// methodNotAllowed answers 405 in OpenAI's error shape.
func methodNotAllowed(allow string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", allow)
		writeError(w, &APIError{Status: http.StatusMethodNotAllowed, Type: "MethodNotAllowedError",
			Message: fmt.Sprintf("Method %s is not allowed on %s (allowed: %s).", r.Method, r.URL.Path, allow)})
	})
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// Metrics returns the registry the server records into and serves at /metrics.
func (s *Server) Metrics() *metrics.Registry { return s.reg }

// requestIDKey is the context key of the request's base id.
type requestIDKey struct{}

// requestID takes X-Request-Id (or generates a UUID), echoes it in the response and stores it
// in the request context.
func (s *Server) requestID(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("X-Request-Id")
		if id == "" {
			id = uuid.NewString()
		}
		w.Header().Set("X-Request-Id", id)
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), requestIDKey{}, id)))
	})
}

// baseRequestID returns the request's id: the X-Request-Id header, else the body's request_id,
// else the generated UUID; it sets the X-Request-Id response header to it.
func baseRequestID(w http.ResponseWriter, r *http.Request, bodyID *string) string {
	if r.Header.Get("X-Request-Id") == "" && bodyID != nil && *bodyID != "" {
		w.Header().Set("X-Request-Id", *bodyID)
		return *bodyID
	}
	id, _ := r.Context().Value(requestIDKey{}).(string)
	if id == "" {
		id = uuid.NewString()
	}
	return id
}

// generate serves a completions route: it reads the body (bounded in size and time), takes a
// concurrency slot (429 when none is free), builds the job, takes a slot for each of its other
// sequences (429 when too few are free) and serves it. A request refused on the way has its
// params handed to Config.DeclineKV. The slots are given back when the engine has ended
// every sequence, whether or not the client has taken the response yet, or else when the
// handler returns.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, build func(http.ResponseWriter, *http.Request, []byte) (*job, *APIError)) {
	body, apiErr := s.readBody(w, r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	taken := false
	defer func() {
		if !taken {
			s.decline(body)
		}
	}()
	slots := &slotHold{sem: s.slots}
	defer slots.release()
	if apiErr := s.acquire(slots, 1); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	j, apiErr := build(w, r, body)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	// One slot per sequence, at most the whole limit: a request larger than the limit is not
	// refused (n and best_of are valid up to maxChoices whatever the limit) but runs alone.
	if more := min(len(j.reqs), s.cfg.MaxConcurrentRequests) - 1; s.slots != nil && more > 0 {
		if apiErr := s.acquire(slots, more); apiErr != nil {
			writeError(w, apiErr)
			return
		}
	}
	taken = s.serve(w, r, j, slots.release)
}

// decline hands the kv_transfer_params of a refused request body, if it has any, to DeclineKV.
func (s *Server) decline(body []byte) {
	if s.cfg.DeclineKV == nil || !bytes.Contains(body, []byte(`"kv_transfer_params"`)) {
		return
	}
	var b struct {
		KV map[string]any `json:"kv_transfer_params"`
	}
	if json.Unmarshal(body, &b) == nil && b.KV != nil {
		s.cfg.DeclineKV(b.KV)
	}
}

// countRejections counts every request answered with a 4xx status before or instead of
// generation (kvbridge:requests_rejected_total{reason="<status>"}).
func (s *Server) countRejections(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w}
		next.ServeHTTP(sw, r)
		if sw.status >= 400 && sw.status < 500 {
			s.metrics.CountRejected(strconv.Itoa(sw.status))
		}
	})
}

// statusWriter records the response status.
type statusWriter struct {
	http.ResponseWriter
	status int
}

// WriteHeader implements http.ResponseWriter.
func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write implements http.ResponseWriter.
func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap returns the wrapped writer (for http.ResponseController).
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// authorize requires the API key on /v1 routes when one is configured.
func (s *Server) authorize(next http.Handler) http.Handler {
	if s.cfg.APIKey == "" {
		return next
	}
	want := []byte("Bearer " + s.cfg.APIKey)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1" || strings.HasPrefix(r.URL.Path, "/v1/") {
			got := []byte(r.Header.Get("Authorization"))
			if subtle.ConstantTimeCompare(got, want) != 1 {
				w.Header().Set("WWW-Authenticate", "Bearer")
				writeError(w, &APIError{Status: http.StatusUnauthorized, Type: "AuthenticationError",
					Message: "Unauthorized: a valid API key is required as 'Authorization: Bearer <key>'."})
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

// recoverPanics turns a handler panic into a 500 JSON response (or, mid-stream, an SSE error
// event and [DONE]) instead of a dropped connection.
func (s *Server) recoverPanics(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tw := &trackingWriter{ResponseWriter: w}
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			if v == http.ErrAbortHandler {
				panic(v)
			}
			s.log.Error("panic serving request", "method", r.Method, "path", r.URL.Path, "panic", v,
				"stack", string(debug.Stack()))
			switch {
			case !tw.wroteHeader:
				writeError(tw, internalError())
			case strings.HasPrefix(tw.Header().Get("Content-Type"), "text/event-stream"):
				sse := newSSEWriter(tw)
				sse.raw(internalError().JSON())
				sse.done()
			}
		}()
		next.ServeHTTP(tw, r)
	})
}

// trackingWriter records whether the header was written; Unwrap lets http.ResponseController
// reach the underlying writer's Flush.
type trackingWriter struct {
	http.ResponseWriter
	wroteHeader bool
}

// WriteHeader implements http.ResponseWriter.
func (t *trackingWriter) WriteHeader(code int) {
	t.wroteHeader = true
	t.ResponseWriter.WriteHeader(code)
}

// Write implements http.ResponseWriter.
func (t *trackingWriter) Write(b []byte) (int, error) {
	t.wroteHeader = true
	return t.ResponseWriter.Write(b)
}

// Unwrap returns the wrapped writer (for http.ResponseController).
func (t *trackingWriter) Unwrap() http.ResponseWriter { return t.ResponseWriter }

// readBody reads the request body under the size limit and the read deadline.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, *APIError) {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(s.cfg.BodyReadTimeout))
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		// The deadline stays: the server must not wait for the rest of a body that is not
		// coming before it answers; the connection is not reused.
		w.Header().Set("Connection", "close")
		var mbe *http.MaxBytesError
		switch {
		case errors.As(err, &mbe):
			return nil, &APIError{Status: http.StatusRequestEntityTooLarge, Type: "RequestEntityTooLargeError",
				Message: fmt.Sprintf("The request body is larger than the limit of %d bytes.", mbe.Limit)}
		case errors.Is(err, os.ErrDeadlineExceeded):
			return nil, &APIError{Status: http.StatusRequestTimeout, Type: "RequestTimeoutError",
				Message: fmt.Sprintf("The request body was not received within %v.", s.cfg.BodyReadTimeout)}
		}
		return nil, badRequest("", "Could not read the request body: %v", err)
	}
	_ = rc.SetReadDeadline(time.Time{})
	return body, nil
}

// checkModel resolves the request's model name: empty means the first served name; an unknown
// name is a 404.
func (s *Server) checkModel(name *string) *APIError {
	if name == nil || *name == "" {
		return nil
	}
	for _, n := range s.cfg.ServedModelNames {
		if n == *name {
			return nil
		}
	}
	return modelNotFound(*name)
}

// responseModel is the model name reported in responses (vLLM reports the first served name).
func (s *Server) responseModel() string { return s.cfg.ServedModelNames[0] }
