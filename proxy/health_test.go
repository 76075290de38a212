package proxy_test

import (
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/proxy"
)

// health is the body of the proxies' health and readiness routes.
type health struct {
	Status           string
	PrefillInstances int `json:"prefill_instances"`
	DecodeInstances  int `json:"decode_instances"`
	Prefill, Decode  []struct {
		Instance string
		Up       bool
	}
	Ready   *bool
	Reason  string
	StoreUp *bool `json:"store_up"`
}

// getHealth GETs path on srv and decodes the body.
func getHealth(t *testing.T, srv *httptest.Server, path string) (int, health) {
	t.Helper()
	resp, raw := do(t, "GET", srv.URL+path, nil)
	var h health
	if err := json.Unmarshal(raw, &h); err != nil {
		t.Fatalf("GET %s: %d %s: %v", path, resp.StatusCode, raw, err)
	}
	return resp.StatusCode, h
}

// TestOneWayHealthProbesEngines: the one-way proxy's /healthcheck reports each engine's state
// (probed, not assumed) and stays 200 (liveness), in vLLM's shape; /ready is 503 naming the
// decoder once no decoder answers.
func TestOneWayHealthProbesEngines(t *testing.T) {
	p, d := startEngine(t, "kv_producer", 512), startEngine(t, "kv_consumer", 512)
	pi, di := instanceOf(t, p.URL), instanceOf(t, d.URL)
	// A probe answers for 1 ns: every request below probes again.
	srv := startProxy(t, proxy.Config{Prefill: []proxy.Instance{pi}, Decode: []proxy.Instance{di}, HealthInterval: time.Nanosecond})

	status, h := getHealth(t, srv, "/ready")
	if status != 200 || h.Ready == nil || !*h.Ready || h.Status != "ok" || len(h.Decode) != 1 || !h.Decode[0].Up || !h.Prefill[0].Up {
		t.Fatalf("/ready with P and D up: %d %+v", status, h)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	status, h = getHealth(t, srv, "/healthcheck")
	if status != 200 || h.Status != "degraded" || h.PrefillInstances != 1 || h.DecodeInstances != 1 || h.Decode[0].Up || !h.Prefill[0].Up || h.Decode[0].Instance != di.String() {
		t.Errorf("/healthcheck with D dead: %d %+v; want 200, degraded, D down, P up", status, h)
	}
	status, h = getHealth(t, srv, "/ready")
	if status != 503 || h.Ready == nil || *h.Ready || !strings.Contains(h.Reason, "decode") || !strings.Contains(h.Reason, di.String()) {
		t.Errorf("/ready with D dead: %d %+v; want 503 naming the decoder %s", status, h, di)
	}
}

// TestMultiTurnHealthPingsTheStore: the multi-turn proxy's health checks Redis when asked:
// store_up turns false once Redis stops, before any request went through the proxy, and
// /ready is then 503 naming the store.
func TestMultiTurnHealthPingsTheStore(t *testing.T) {
	r := startRedis(t, 0)
	p, d := startBidirectional(t, "kv_producer", true), startBidirectional(t, "kv_consumer", true)
	srv, _ := serveMultiTurn(t, proxy.MultiTurnConfig{Config: proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)},
		Decode: []proxy.Instance{instanceOf(t, d.URL)}, HealthInterval: time.Nanosecond}, Store: r.url(), StoreKey: "health-test-key"})
	status, h := getHealth(t, srv, "/health")
	if status != 200 || h.StoreUp == nil || !*h.StoreUp || h.Status != "ok" {
		t.Fatalf("/health with Redis up: %d %+v", status, h)
	}
	if status, h = getHealth(t, srv, "/ready"); status != 200 {
		t.Fatalf("/ready with Redis up: %d %+v", status, h)
	}
	r.stop()
	status, h = getHealth(t, srv, "/health")
	if status != 200 || h.StoreUp == nil || *h.StoreUp || h.Status != "degraded" {
		t.Errorf("/health with Redis stopped: %d %+v; want 200, store_up false, degraded", status, h)
	}
	status, h = getHealth(t, srv, "/ready")
	if status != 503 || !strings.Contains(h.Reason, "store") {
		t.Errorf("/ready with Redis stopped: %d %+v; want 503 naming the store", status, h)
	}
}
