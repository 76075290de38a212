package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvbridge/kvbridge/internal/httpdeadline"
)

// OneWay is the toy proxy's flow (docs/architecture.md, "One-way", wire contract items 1–4):
// every request is prefilled on P and decoded on D.
type OneWay struct {
	legs
	route   *router
	reg     *prometheus.Registry
	mux     *http.ServeMux
	handler http.Handler // mux, its writes bounded by WriteTimeout
	health  healthProber
}

// NewOneWay returns the one-way proxy for cfg.
func NewOneWay(cfg Config) (*OneWay, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	o := &OneWay{
		legs: newLegs(cfg),
		reg:  prometheus.NewRegistry(),
		mux:  http.NewServeMux(),
	}
	var err error
	if o.route, err = newRouter(cfg, o.reg); err != nil {
		return nil, err
	}
	o.mux.Handle("GET /metrics", promhttp.HandlerFor(o.reg, promhttp.HandlerOpts{}))
	o.handler = httpdeadline.Bound(o.mux, o.legs.cfg.WriteTimeout, func() { o.stalled.Add(1) })
	o.mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { o.handle(w, r, "/v1/completions") })
	o.mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { o.handle(w, r, "/v1/chat/completions") })
	o.health = healthProber{client: o.client, prefill: cfg.Prefill, decode: cfg.Decode, interval: cfg.HealthInterval, recovered: o.route.engineRestarted}
	o.mux.HandleFunc("GET /healthcheck", func(w http.ResponseWriter, r *http.Request) {
		writeHealth(w, o.withTransferCounts(o.health.report(r.Context()).fields()))
	})
	o.mux.HandleFunc("GET /ready", func(w http.ResponseWriter, r *http.Request) {
		rep := o.health.report(r.Context())
		writeReady(w, rep, o.withTransferCounts(rep.fields()))
	})
	o.mux.HandleFunc("GET /v1/models", o.models)
	o.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "NotFoundError", "not_found", fmt.Sprintf("%s %s is not a route of this proxy", r.Method, r.URL.Path))
	})
	return o, nil
}

// ServeHTTP implements http.Handler.
func (o *OneWay) ServeHTTP(w http.ResponseWriter, r *http.Request) { o.handler.ServeHTTP(w, r) }

// Close stops the KV event subscribers and releases idle connections to the engines. It is
// idempotent.
func (o *OneWay) Close() error {
	o.route.close()
	if t, ok := o.cfg.Transport.(interface{ CloseIdleConnections() }); ok {
		t.CloseIdleConnections()
	}
	return nil
}

// models relays a decoder's /v1/models (the benchmark asks for it; the toy proxy lacks it).
func (o *OneWay) models(w http.ResponseWriter, r *http.Request) {
	relayGet(w, r, &o.legs, o.route.d.list[o.route.d.roundRobin()], "/v1/models")
}

func relayGet(w http.ResponseWriter, r *http.Request, l *legs, inst Instance, path string) {
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, inst.URL(path), nil)
	if err == nil {
		if a := r.Header.Get("Authorization"); a != "" {
			req.Header.Set("Authorization", a)
		} else if l.cfg.APIKey != "" {
			req.Header.Set("Authorization", "Bearer "+l.cfg.APIKey)
		}
	}
	var resp *http.Response
	if err == nil {
		resp, err = l.client.Do(req)
	}
	if err != nil {
		writeError(w, http.StatusBadGateway, "BadGatewayError", codeDecodeFailed, fmt.Sprintf("decode instance %s: %v", inst, err))
		return
	}
	defer resp.Body.Close()
	_ = relay(w, resp, r.Header.Get("X-Request-Id"), l.cfg.IdleTimeout, cancel)
}

// readBody reads and decodes the client's JSON body (bounded in size and time), answering the
// client itself on failure.
func (l *legs) readBody(w http.ResponseWriter, r *http.Request) (body, bool) {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(l.cfg.BodyReadTimeout))
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, l.cfg.MaxBodyBytes))
	if err != nil {
		// The deadline stays: the answer must not wait for the rest of the body.
		w.Header().Set("Connection", "close")
		var tooBig *http.MaxBytesError
		switch {
		case errors.As(err, &tooBig):
			writeError(w, http.StatusRequestEntityTooLarge, "BadRequestError", "request_too_large", fmt.Sprintf("the request body exceeds %d bytes", tooBig.Limit))
		case errors.Is(err, os.ErrDeadlineExceeded):
			writeError(w, http.StatusRequestTimeout, "RequestTimeoutError", "request_timeout", fmt.Sprintf("the request body was not received within %v", l.cfg.BodyReadTimeout))
		default:
			writeError(w, http.StatusBadRequest, "BadRequestError", codeBadRequest, "reading the request body: "+err.Error())
		}
		return nil, false
	}
	_ = rc.SetReadDeadline(time.Time{})
	b, err := decodeBody(data)
	if err != nil {
		writeError(w, http.StatusBadRequest, "BadRequestError", codeBadRequest, err.Error())
		return nil, false
	}
	return b, true
}

// requestID is the client's X-Request-Id, or a new UUID; both legs carry the same one.
func requestID(r *http.Request) string {
	if id := r.Header.Get("X-Request-Id"); id != "" {
		return id
	}
	return uuid.NewString()
}

func (o *OneWay) handle(w http.ResponseWriter, r *http.Request, path string) {
	b, ok := o.readBody(w, r)
	if !ok || refuseClientParams(w, b) {
		return
	}
	reqID := requestID(r)
	pInst, pDone := o.route.pickPrefill(r.Context(), &o.legs, path, reqID, r.Header, b)
	defer pDone() // at the end of a push; after the prefill leg in the pull flow
	dInst, dDone := o.route.pickDecode()
	defer dDone()
	fl, info := o.chooseFlow(r.Context(), pInst, r.Header)
	if fl == flowPush {
		// Both legs at once; the client's body goes to D unchanged but for the params.
		id := pushID()
		host := info.host
		if host == "" {
			host = pInst.Host
		}
		out := o.push(w, r, pInst, dInst, path, reqID, prefillRequest(b, pushPrefillParams(prefillTemplate(), id)),
			decodeRequest(b, pushDecodeParams(info, host, id)), decodeOptions{usage: true, sawUsage: o.watchDecode(dInst, reqID)}, nil)
		if out.prefillOK && out.pre.params == nil {
			o.watch.prefillWithoutParams(pInst, reqID)
		}
		return
	}
	pre, lerr := o.prefill(r.Context(), pInst, path, reqID, r.Header, prefillRequest(b, prefillTemplate()), true)
	pDone()
	if lerr != nil {
		lerr.write(w)
		return
	}
	params := pre.params
	if fl == flowPushSerial {
		params = serialPushParams(params)
	}
	// The client's body goes to D unchanged (conformance item 2): D streams only if the client
	// asked, and its usage chunk is the client's.
	_ = o.decode(w, r, dInst, path, reqID, decodeRequest(b, params), decodeOptions{usage: true, sawUsage: o.watchTransfer(pInst, dInst, reqID, pre)})
}
