package proxy_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/proxy"
)

// startWatched starts an engine with usage details; role "" has no connector, token is its
// auth token.
func startWatched(t *testing.T, role connector.Role, token string) *instance.Instance {
	t.Helper()
	cfg := instance.Config{OpenedModel: openTiny(t), Host: "127.0.0.1", NumBlocks: 256, MaxModelLen: 1024, SideChannelPort: -1, PromptTokensDetails: true}
	if role != "" {
		cfg.KVTransfer = connector.DefaultConfig(role)
		cfg.KVTransfer.AuthToken = token
	}
	return startInstance(t, cfg)
}

// TestProxiesCountRequestsWithoutTransfer: a P/D request that the engines serve without moving
// any KV — P returns no params (P has no connector), or D pulls nothing (its auth token differs
// from P's) — still answers 200, but both proxies count it by reason in /healthcheck (and the
// multi-turn proxy in /metrics) and warn once, naming the likely cause. A healthy pair counts
// nothing.
func TestProxiesCountRequestsWithoutTransfer(t *testing.T) {
	const tokA, tokB = "tok-0123456789abcdef", "tok-fedcba9876543210"
	cases := []struct {
		name         string
		pRole, dRole connector.Role
		pTok, dTok   string
		reason, says string
	}{
		{"healthy", connector.RoleProducer, connector.RoleConsumer, tokA, tokA, "", ""},
		{"P without a connector", "", connector.RoleConsumer, "", "", proxy.ReasonPrefillNoParams, "are P and D swapped?"},
		{"auth tokens differ", connector.RoleProducer, connector.RoleConsumer, tokA, tokB, proxy.ReasonDecodePulledNothing, "different auth tokens"},
	}
	for _, tc := range cases {
		p, d := startWatched(t, tc.pRole, tc.pTok), startWatched(t, tc.dRole, tc.dTok)
		for _, multi := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/multi-turn=%v", tc.name, multi), func(t *testing.T) {
				logs := &logRecorder{}
				cfg := proxy.Config{Prefill: []proxy.Instance{instanceOf(t, p.URL)}, Decode: []proxy.Instance{instanceOf(t, d.URL)}, Logger: slog.New(logs)}
				var h http.Handler
				if multi {
					mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: cfg})
					if err != nil {
						t.Fatal(err)
					}
					defer mt.Close()
					h = mt
				} else {
					ow, err := proxy.NewOneWay(cfg)
					if err != nil {
						t.Fatal(err)
					}
					defer ow.Close()
					h = ow
				}
				srv := httptest.NewServer(h)
				defer srv.Close()
				const n = 3
				for i := range n {
					prompt := strings.Repeat(fmt.Sprintf("request %d of a prompt long enough to fill blocks. ", i), 6)
					resp, body := do(t, "POST", srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0})
					if resp.StatusCode != 200 {
						t.Fatalf("%d %s", resp.StatusCode, body)
					}
				}
				_, body := do(t, "GET", srv.URL+"/healthcheck", nil)
				var health struct {
					Without map[string]int `json:"requests_without_kv_transfer"`
				}
				if err := json.Unmarshal(body, &health); err != nil {
					t.Fatal(err)
				}
				for _, reason := range []string{proxy.ReasonPrefillNoParams, proxy.ReasonDecodePulledNothing} {
					want := 0
					if reason == tc.reason {
						want = n
					}
					if health.Without[reason] != want {
						t.Errorf("/healthcheck counts %d requests without a transfer for %s, want %d: %s", health.Without[reason], reason, want, body)
					}
				}
				warned := logs.count("P/D request served without a KV transfer")
				if tc.reason == "" {
					if warned != 0 {
						t.Errorf("a healthy pair was warned about %d times", warned)
					}
					return
				}
				if warned != 1 || logs.count(tc.says) != 1 {
					t.Errorf("warned %d times (want once per instance and interval), saying %q %d times", warned, tc.says, logs.count(tc.says))
				}
				if multi {
					_, m := do(t, "GET", srv.URL+"/metrics", nil)
					if want := fmt.Sprintf(`kvbridge:proxy_requests_without_kv_transfer_total{reason=%q} %d`, tc.reason, n); !strings.Contains(string(m), want) {
						t.Errorf("/metrics lacks %s", want)
					}
				}
			})
		}
	}
}
