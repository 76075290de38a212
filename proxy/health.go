package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// DefaultHealthInterval is Config.HealthInterval's default: how long one probe of the engines
// and the store answers health and readiness requests before the next request probes again.
const DefaultHealthInterval = 2 * time.Second

// healthProbeTimeout bounds one probe: an engine's GET /health, or the store's PING.
const healthProbeTimeout = time.Second

// backendState is one engine's state as the health routes report it.
type backendState struct {
	Instance string `json:"instance"`
	Up       bool   `json:"up"`
	Error    string `json:"error,omitempty"`
}

// healthReport is what one probe found.
type healthReport struct {
	prefill, decode []backendState
	store           error // the store's PING failed; nil when up or when there is none to ping
}

// healthProber probes every engine's /health and the store (concurrently, each under
// healthProbeTimeout) when a health or readiness request finds its last probe older than the
// interval, so that health stays cheap however often it is asked and says what is true now,
// not what the last client request saw. It starts no goroutine that outlives a probe.
type healthProber struct {
	client          *http.Client
	prefill, decode []Instance
	ping            func(context.Context) error // the store's check; nil without one
	interval        time.Duration
	// recovered, when set, hears of a prefiller whose /health failed at one probe and answers at
	// the next: it restarted (or was unreachable for a while), so its cache is not what it was.
	recovered func(Instance)

	mu   sync.Mutex // held across a probe: concurrent requests share one
	at   time.Time
	last healthReport
}

// report returns the last probe's result, probing first when it is older than the interval.
// The probe does not end with ctx (a client that goes away must not record engines as down),
// only with its own deadline.
func (h *healthProber) report(ctx context.Context) healthReport {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.at.IsZero() && time.Since(h.at) < h.interval {
		return h.last
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), healthProbeTimeout)
	defer cancel()
	rep := healthReport{prefill: make([]backendState, len(h.prefill)), decode: make([]backendState, len(h.decode))}
	var wg sync.WaitGroup
	for i, inst := range h.prefill {
		wg.Go(func() { rep.prefill[i] = h.probe(ctx, inst) })
	}
	for i, inst := range h.decode {
		wg.Go(func() { rep.decode[i] = h.probe(ctx, inst) })
	}
	if h.ping != nil {
		wg.Go(func() { rep.store = h.ping(ctx) })
	}
	wg.Wait()
	if h.recovered != nil && len(h.last.prefill) == len(rep.prefill) {
		for i, st := range rep.prefill {
			if st.Up && !h.last.prefill[i].Up {
				h.recovered(h.prefill[i])
			}
		}
	}
	h.last, h.at = rep, time.Now()
	return rep
}

// probe asks inst's GET /health.
func (h *healthProber) probe(ctx context.Context, inst Instance) backendState {
	st := backendState{Instance: inst.String()}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, inst.URL("/health"), nil)
	if err != nil {
		st.Error = err.Error()
		return st
	}
	resp, err := h.client.Do(req)
	if err != nil {
		st.Error = err.Error()
		return st
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10)) // so that the connection is reused
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		st.Error = fmt.Sprintf("GET /health: %s", resp.Status)
		return st
	}
	st.Up = true
	return st
}

// fields returns the report as the health routes' JSON fields: vLLM's toy proxy's (status,
// prefill_instances, decode_instances), each engine's state, and the status "ok" when every
// engine and the store are up, else "degraded".
func (rep healthReport) fields() map[string]any {
	status := "ok"
	for _, st := range append(append([]backendState(nil), rep.prefill...), rep.decode...) {
		if !st.Up {
			status = "degraded"
		}
	}
	if rep.store != nil {
		status = "degraded"
	}
	return map[string]any{"status": status, "prefill_instances": len(rep.prefill), "decode_instances": len(rep.decode),
		"prefill": rep.prefill, "decode": rep.decode}
}

// notReady returns why the proxy cannot serve a request: no prefill or no decode engine
// answers, or the store is down; "" when it can.
func (rep healthReport) notReady() string {
	var why []string
	for _, r := range []struct {
		role   string
		states []backendState
	}{{"prefill", rep.prefill}, {"decode", rep.decode}} {
		var down []string
		for _, st := range r.states {
			if st.Up {
				down = nil
				break
			}
			down = append(down, st.Instance+" ("+st.Error+")")
		}
		if len(down) > 0 {
			why = append(why, fmt.Sprintf("no %s engine answers: %s", r.role, strings.Join(down, ", ")))
		}
	}
	if rep.store != nil {
		why = append(why, "the conversation store is down: "+rep.store.Error())
	}
	return strings.Join(why, "; ")
}

// writeHealth answers a liveness request (/healthcheck, /health): 200 whatever the engines'
// state, which the body reports, so that an orchestrator does not restart a proxy for an engine
// that is down.
func writeHealth(w http.ResponseWriter, fields map[string]any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(fields)
}

// writeReady answers a readiness request (/ready): the health body with "ready", and 503 with
// the reason when no prefill or no decode engine answers or the store is down.
func writeReady(w http.ResponseWriter, rep healthReport, fields map[string]any) {
	why := rep.notReady()
	fields["ready"] = why == ""
	if why != "" {
		fields["reason"] = why
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_ = json.NewEncoder(w).Encode(fields)
		return
	}
	writeHealth(w, fields)
}
