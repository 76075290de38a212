package connector_test

import (
	"bufio"
	"net/http"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/internal/fixture"
)

// kvConfig returns a --kv-transfer-config for role with the given extra keys (JSON, may be
// empty).
func kvConfig(role, extra string) string {
	return `{"kv_connector":"NixlConnector","kv_role":"` + role + `","kv_connector_extra_config":{` + extra + `}}`
}

// metricsText returns n's /metrics page.
func metricsText(t *testing.T, n *node) string {
	t.Helper()
	resp, err := http.Get(n.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		b.WriteString(sc.Text() + "\n")
	}
	return b.String()
}

// TestAuthTokenMismatch: engines whose auth tokens disagree never exchange KV, and say why. A D
// without a token dials P, whose side channel refuses it: D's read fails at once (500 under
// policy fail) with an error naming the setting, and P logs and counts it. A D with a token
// refuses P's params before any connection — they carry no MAC it can verify — computes the
// prompt itself (200) and logs and counts the refusal (kvbridge:kv_auth_refusals_total, and
// Info's params_auth_mismatch), the log naming the cause: P has no token, or another one.
func TestAuthTokenMismatch(t *testing.T) {
	cases := []struct {
		name           string
		pExtra, dExtra string
		dMsg           string
		dStatus        int
	}{
		{"P has a token, D none", `"auth_token":"tok-0123456789abcdef"`, ``,
			"requires authentication: set kv_connector_extra_config.auth_token", 500},
		{"D has a token, P none", ``, `"auth_token":"tok-0123456789abcdef"`,
			"the engine that issued them has no auth token while this engine has one", 200},
		{"different tokens", `"auth_token":"tok-0123456789abcdef"`, `"auth_token":"tok-fedcba9876543210"`,
			"the auth token of the engine that issued these params differs from this engine's", 200},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var plog, dlog fixture.LogBuffer
			p := startNode(t, "P", nodeOptions{kvConfig: kvConfig("kv_producer", tc.pExtra), logw: &plog})
			d := startNode(t, "D", nodeOptions{kvConfig: kvConfig("kv_consumer", tc.dExtra), logw: &dlog})
			prompt := tokens(40, 21)
			status, r := decode(t, d, prompt, prefill(t, p, prompt), 4)
			if status != tc.dStatus || (status == 200 && cachedTokens(r) != 0) {
				t.Fatalf("decode with mismatched tokens: %d %s, want %d and nothing pulled", status, r.Raw, tc.dStatus)
			}
			if !strings.Contains(dlog.String(), tc.dMsg) {
				t.Errorf("D's log does not say %q:\n%s", tc.dMsg, dlog.String())
			}
			if tc.dStatus == 500 {
				if !strings.Contains(plog.String(), "NIXL side channel: connection refused") {
					t.Errorf("P did not log the refusal:\n%s", plog.String())
				}
				if got := p.conn.AuthRefusals(); got.SideChannel != 1 || got.Total() != 1 {
					t.Errorf("P counted %+v, want one side-channel refusal", got)
				}
				if m := metricsText(t, p); !strings.Contains(m, `kvbridge:kv_auth_refusals_total{engine="0",kind="side_channel",model_name="kvbridge/tiny"} 1`) {
					t.Errorf("P's /metrics:\n%s", grep(m, "kv_auth_refusals"))
				}
				return
			}
			if got := d.conn.AuthRefusals(); got.Params != 1 || got.Total() != 1 {
				t.Errorf("D counted %+v, want one refused params", got)
			}
			if got := d.conn.Info().ParamsAuthMismatch; got != 1 {
				t.Errorf("D counted %d params refused for an auth token mismatch, want 1", got)
			}
			if got := p.conn.AuthRefusals(); got.Total() != 0 {
				t.Errorf("P counted %+v: D should not have connected", got)
			}
			if m := metricsText(t, d); !strings.Contains(m, `kvbridge:kv_auth_refusals_total{engine="0",kind="params",model_name="kvbridge/tiny"} 1`) {
				t.Errorf("D's /metrics:\n%s", grep(m, "kv_auth_refusals"))
			}
		})
	}
}

// TestAuthTokenFromEnvironmentPD: KVBRIDGE_KV_AUTH_TOKEN stands in for a missing auth_token key,
// so P (environment) and D (config key) with the same token exchange KV.
func TestAuthTokenFromEnvironmentPD(t *testing.T) {
	t.Setenv(connector.EnvAuthToken, "tok-from-the-environment")
	var plog fixture.LogBuffer
	p := startNode(t, "P", nodeOptions{kvConfig: kvConfig("kv_producer", `"backends":["TCP"]`), logw: &plog})
	d := startNode(t, "D", nodeOptions{kvConfig: kvConfig("kv_consumer", `"backends":["TCP"],"auth_token":"tok-from-the-environment"`)})
	prompt := tokens(40, 22)
	if status, r := decode(t, d, prompt, prefill(t, p, prompt), 4); status != 200 || cachedTokens(r) == 0 {
		t.Fatalf("decode: %d %s", status, r.Raw)
	}
	if !strings.Contains(plog.String(), "source="+connector.EnvAuthToken) || strings.Contains(plog.String(), "tok-from-the-environment") {
		t.Errorf("P's log should name the token's source and never the token:\n%s", plog.String())
	}
	p.waitPoolFull(t)
}

// TestReadAfterTheLeaseIsRefused: once D read P's blocks and P released the lease, another
// reader naming the same request is refused over TCP (the blocks are free, possibly reused),
// and P counts it; the normal read before was untouched.
func TestReadAfterTheLeaseIsRefused(t *testing.T) {
	for _, extra := range []string{`"backends":["TCP"]`, `"backends":["TCP"],"auth_token":"tok-0123456789abcdef"`} {
		t.Run(extra, func(t *testing.T) {
			p := startNode(t, "P", nodeOptions{kvConfig: kvConfig("kv_producer", extra)})
			d1 := startNode(t, "D1", nodeOptions{kvConfig: kvConfig("kv_consumer", extra)})
			var dlog fixture.LogBuffer
			d2 := startNode(t, "D2", nodeOptions{kvConfig: kvConfig("kv_consumer", extra), logw: &dlog})
			prompt := tokens(40, 23)
			kv := prefill(t, p, prompt)
			if status, r := decode(t, d1, prompt, kv, 4); status != 200 || cachedTokens(r) == 0 {
				t.Fatalf("first read: %d %s", status, r.Raw)
			}
			p.waitPoolFull(t) // D1's notification ended the lease
			if status, r := decode(t, d2, prompt, kv, 4); status != 500 {
				t.Fatalf("read after the lease ended: %d %s", status, r.Raw)
			}
			if !strings.Contains(dlog.String(), "read not authorized") || !strings.Contains(dlog.String(), "no KV blocks are leased under the presented token") {
				t.Errorf("D2's log:\n%s", dlog.String())
			}
			if got := p.conn.AuthRefusals(); got.Reads < 1 || got.SideChannel != 0 || got.Transfer != 0 {
				t.Errorf("P counted %+v", got)
			}
			if m := metricsText(t, p); !strings.Contains(m, `kvbridge:kv_auth_refusals_total{engine="0",kind="read",model_name="kvbridge/tiny"}`) {
				t.Errorf("P's /metrics:\n%s", grep(m, "kv_auth_refusals"))
			}
		})
	}
}
