package proxy_test

import (
	"bufio"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/proxy"
)

// eventually polls cond every millisecond until it holds, failing after 30 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 30s waiting for %s", what)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("test ended while waiting for %s", what)
		case <-time.After(time.Millisecond):
		}
	}
}

// abortedOn returns vllm:request_success_total{finished_reason="abort"} of the engine at url.
func abortedOn(t *testing.T, url string) float64 {
	t.Helper()
	_, raw := do(t, http.MethodGet, url+"/metrics", nil)
	sum := 0.0
	sc := bufio.NewScanner(strings.NewReader(string(raw)))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "vllm:request_success_total{") && strings.Contains(line, `finished_reason="abort"`) {
			v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			sum += v
		}
	}
	return sum
}

// TestStalledClientFreesDecoder: a client asks either proxy for a long stream of D's whole
// concurrency limit and never reads. Once a write to it has waited the proxy's WriteTimeout,
// the proxy counts the stall (clients_stalled in its health) and cancels the decode leg: D
// aborts both sequences long before they would have finished, runs nothing, serves a request of
// its whole limit, and both pools are full.
func TestStalledClientFreesDecoder(t *testing.T) {
	const limit = 2
	for _, multiTurn := range []bool{false, true} {
		t.Run("multi-turn="+strconv.FormatBool(multiTurn), func(t *testing.T) {
			p := startEngine(t, "kv_producer", 4096)
			d := startEngine(t, "kv_consumer", 4096, func(c *instance.Config) { c.MaxConcurrentRequests = limit })
			cfg := proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, d.URL)},
				WriteTimeout: 200 * time.Millisecond}
			var h interface {
				http.Handler
				Close() error
			}
			var err error
			if multiTurn {
				h, err = proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: cfg})
			} else {
				h, err = proxy.NewOneWay(cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewUnstartedServer(h)
			fixture.ShrinkSendBuffers(srv.Config)
			srv.Start()
			t.Cleanup(func() { srv.Close(); h.Close() })

			fixture.NonReader(t, srv.Listener.Addr().String(), "/v1/completions",
				`{"model":"kvbridge/tiny","prompt":"a client that never reads","max_tokens":3000,"ignore_eos":true,"n":2,"stream":true}`)
			eventually(t, "the proxy to count the stalled client", func() bool {
				_, raw := do(t, http.MethodGet, srv.URL+"/healthcheck", nil)
				var hc struct {
					Stalled int `json:"clients_stalled"`
				}
				return json.Unmarshal(raw, &hc) == nil && hc.Stalled == 1
			})
			eventually(t, "D to abort the stalled client's sequences", func() bool { return abortedOn(t, d.URL) == limit })
			st, err := d.Stats()
			if err != nil || st.Running != 0 || st.Waiting != 0 {
				t.Errorf("D after the abort: %+v, %v; want nothing running or waiting", st, err)
			}
			if resp, raw := do(t, http.MethodPost, d.URL+"/v1/completions", map[string]any{"prompt": "a bystander", "max_tokens": 2, "n": limit}); resp.StatusCode != http.StatusOK {
				t.Errorf("a request of D's whole limit after the abort: %d %s", resp.StatusCode, raw)
			}
			eventually(t, "both pools to be full", func() bool {
				return d.Pool.NumFree() == d.Pool.NumBlocks() && p.Pool.NumFree() == p.Pool.NumBlocks()
			})
		})
	}
}
