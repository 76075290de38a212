package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"
)

// Config configures a proxy. Prefill and Decode must not be empty.
type Config struct {
	// Prefill and Decode are the engines, chosen as Routing says (default round-robin with
	// independent cursors).
	Prefill, Decode []Instance
	// Routing is the choice of engines (route.go).
	Routing RoutingConfig
	// APIKey, when set, is sent as "Authorization: Bearer <key>" to engines when the client sent no
	// Authorization header of its own (the Python proxies read $OPENAI_API_KEY).
	APIKey string
	// Logger receives one line per failed leg; nil discards.
	Logger *slog.Logger
	// HeaderTimeout bounds the wait for an engine's response headers; P answers only after its
	// prefill, so this must cover the longest prefill. Default 5 minutes.
	HeaderTimeout time.Duration
	// IdleTimeout bounds the silence between two reads of a response body. Default 2 minutes.
	IdleTimeout time.Duration
	// MaxBodyBytes limits a client's request body. Default 32 MiB.
	MaxBodyBytes int64
	// BodyReadTimeout bounds the reading of a client's request body (408 beyond it). Default
	// 30 s.
	BodyReadTimeout time.Duration
	// WriteTimeout bounds each write (of at most 64 KiB: a larger body goes out in pieces) and
	// each flush of a response to the client: a client that takes nothing for that long fails
	// the write, the request's legs are cancelled (D aborts it and frees its slots and blocks)
	// and the stall is counted. Default DefaultWriteTimeout.
	WriteTimeout time.Duration
	// Transport carries the engine legs; nil uses a dedicated http.Transport.
	Transport http.RoundTripper
	// TransferMode is how the KV moves from P to D (transfermode.go): TransferAuto (""), the
	// default, decides per prefill engine from its GET /v1/kv_transfer; TransferPull,
	// TransferPush (both legs at once) and TransferPushSerial (vLLM's toy push proxy) force a
	// flow. The multi-turn proxy pushes only the turns that pull nothing from D.
	TransferMode TransferMode
	// HealthInterval is how long one probe of the engines' /health (and the store) answers the
	// health and readiness routes before the next request probes again. Default
	// DefaultHealthInterval.
	HealthInterval time.Duration
}

// Defaults of Config, applied where a field is zero.
const (
	// DefaultHeaderTimeout bounds the wait for an engine's response headers.
	DefaultHeaderTimeout = 5 * time.Minute
	// DefaultIdleTimeout bounds the silence between two reads of a response body.
	DefaultIdleTimeout = 2 * time.Minute
	// DefaultMaxBodyBytes limits a client's request body.
	DefaultMaxBodyBytes = 32 << 20
	// DefaultBodyReadTimeout bounds the reading of a client's request body.
	DefaultBodyReadTimeout = 30 * time.Second
	// DefaultWriteTimeout bounds each write to a client. A client that reads takes a write
	// within a round trip, so the bound never touches it; 30 s, as long as the body read
	// timeout (and the engines' own write timeout), bounds how long a client that stopped
	// reading keeps D's sequences, and their blocks, waiting on it.
	DefaultWriteTimeout = 30 * time.Second
)

func (c *Config) defaults() error {
	if len(c.Prefill) == 0 || len(c.Decode) == 0 {
		return errors.New("proxy: at least one prefill and one decode instance are needed")
	}
	if c.HeaderTimeout <= 0 {
		c.HeaderTimeout = DefaultHeaderTimeout
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = DefaultIdleTimeout
	}
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.BodyReadTimeout <= 0 {
		c.BodyReadTimeout = DefaultBodyReadTimeout
	}
	if c.HealthInterval <= 0 {
		c.HealthInterval = DefaultHealthInterval
	}
	if c.WriteTimeout <= 0 {
		c.WriteTimeout = DefaultWriteTimeout
	}
	mode, err := ParseTransferMode(string(c.TransferMode))
	if err != nil {
		return fmt.Errorf("proxy: %w", err)
	}
	c.TransferMode = mode
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Transport == nil {
		c.Transport = &http.Transport{
			DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:          1024,
			MaxIdleConnsPerHost:   256,
			IdleConnTimeout:       90 * time.Second,
			ResponseHeaderTimeout: c.HeaderTimeout,
		}
	}
	return nil
}

// legs sends requests to engines; it is shared by the one-way and multi-turn proxies.
type legs struct {
	cfg    Config
	client *http.Client
	watch  *transferWatch // requests that ended without a KV transfer
	infos  *engineInfos   // prefill engines' GET /v1/kv_transfer, for the push flows
	// stalled counts the responses whose client took no write within cfg.WriteTimeout.
	stalled atomic.Int64
}

// newLegs returns the legs of a proxy for cfg (its defaults applied).
func newLegs(cfg Config) legs {
	client := &http.Client{Transport: cfg.Transport}
	return legs{cfg: cfg, client: client, watch: newTransferWatch(cfg.Logger), infos: newEngineInfos(client, cfg.APIKey)}
}

// legError is a failed leg, with what the client should be told.
type legError struct {
	status int    // HTTP status for the client
	body   []byte // an engine's own error body to relay, or nil
	code   string // proxy error code when body is nil
	msg    string
}

func (e *legError) Error() string { return fmt.Sprintf("%d %s: %s", e.status, e.code, e.message()) }

// message is what went wrong: the proxy's words, or the engine's error body.
func (e *legError) message() string {
	if e.body != nil {
		return fmt.Sprintf("the engine answered %d: %s", e.status, truncate(e.body, 300))
	}
	return e.msg
}

// write answers the client with the error.
func (e *legError) write(w http.ResponseWriter) {
	if e.body != nil {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(e.status)
		_, _ = w.Write(e.body)
		return
	}
	writeError(w, e.status, "BadGatewayError", e.code, e.msg)
}

// post sends b to inst's path with the request id and credentials. A replayable leg (P's: a
// prefill sent twice costs a lease that expires) is marked so with X-Idempotency-Key.
func (l *legs) post(ctx context.Context, inst Instance, path, reqID string, hdr http.Header, b body, replayable bool) (*http.Response, error) {
	data, err := json.Marshal(b)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, inst.URL(path), bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", reqID)
	switch {
	case hdr.Get("Authorization") != "":
		req.Header.Set("Authorization", hdr.Get("Authorization"))
	case l.cfg.APIKey != "":
		req.Header.Set("Authorization", "Bearer "+l.cfg.APIKey)
	}
	if replayable {
		// The transport may then send the request again on a new connection when a pooled one
		// turns out to have been closed by the engine (it restarted), instead of failing it.
		req.Header.Set("X-Idempotency-Key", reqID+"-"+inst.String())
	}
	return l.client.Do(req)
}

// prefillResult is what P answered.
type prefillResult struct {
	params map[string]any // kv_transfer_params, nil when P returned none
	usage  map[string]any // P's usage, nil when absent
}

// prefill runs the P leg to completion. A 4xx from P is the client's fault and is relayed as is;
// a 5xx, a transport failure or an unreadable answer is a 502 prefill_request_failed. replay
// lets the transport send the leg again on a fresh connection (see post); a push's leg, whose
// push_id must reach P once, is not replayed.
func (l *legs) prefill(ctx context.Context, inst Instance, path, reqID string, hdr http.Header, b body, replay bool) (prefillResult, *legError) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	resp, err := l.post(ctx, inst, path, reqID, hdr, b, replay)
	if err != nil {
		return prefillResult{}, l.failPrefill(ctx, inst, reqID, &legError{status: http.StatusBadGateway, code: codePrefillFailed, msg: fmt.Sprintf("prefill instance %s: %v", inst, err)})
	}
	defer resp.Body.Close()
	data, err := readAllIdle(resp.Body, l.cfg.IdleTimeout, cancel)
	if err != nil {
		err = legCause(ctx, err)
		return prefillResult{}, l.failPrefill(ctx, inst, reqID, &legError{status: http.StatusBadGateway, code: codePrefillFailed, msg: fmt.Sprintf("prefill instance %s: reading the response: %v", inst, err)})
	}
	if resp.StatusCode >= 400 && resp.StatusCode < 500 {
		return prefillResult{}, &legError{status: resp.StatusCode, body: data}
	}
	if resp.StatusCode/100 != 2 {
		return prefillResult{}, l.failPrefill(ctx, inst, reqID, &legError{status: http.StatusBadGateway, code: codePrefillFailed, msg: fmt.Sprintf("prefill instance %s answered %d: %s", inst, resp.StatusCode, truncate(data, 300))})
	}
	var out struct {
		KV    map[string]any `json:"kv_transfer_params"`
		Usage map[string]any `json:"usage"`
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(&out); err != nil {
		return prefillResult{}, l.failPrefill(ctx, inst, reqID, &legError{status: http.StatusBadGateway, code: codePrefillFailed, msg: fmt.Sprintf("prefill instance %s: response is not JSON: %v", inst, err)})
	}
	return prefillResult{params: out.KV, usage: out.Usage}, nil
}

// failPrefill logs a failed P leg, unless the push flow cancelled it because D's leg failed
// (not a failure of P's).
func (l *legs) failPrefill(ctx context.Context, inst Instance, reqID string, e *legError) *legError {
	if errors.Is(context.Cause(ctx), errDecodeEnded) {
		return e
	}
	return l.fail("prefill", inst, reqID, e)
}

func (l *legs) fail(leg string, inst Instance, reqID string, e *legError) *legError {
	l.cfg.Logger.Warn("proxy leg failed", "leg", leg, "instance", inst.String(), "request_id", reqID, "status", e.status, "err", e.msg)
	return e
}

func truncate(b []byte, n int) string {
	if len(b) > n {
		return string(b[:n]) + "…"
	}
	return string(b)
}
