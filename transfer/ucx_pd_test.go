//go:build ucx && cgo

package transfer_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/proxy"
)

// TestUCXAccuracyPD is the accuracy test of disaggregation with UCX forced: through the
// one-way proxy, P prefills, D pulls the KV over UCX and decodes, and the greedy output is
// token for token a single engine's; D's handshake reports backend=UCX, D loaded external
// tokens, and every block returns to both pools.
func TestUCXAccuracyPD(t *testing.T) {
	prompts := []any{"Hi", []int{5, 6, 7},
		"The KV cache of this prompt is computed by one engine and read by another over UCX.",
		strings.Repeat("many words make many blocks ", 30), strings.Repeat("x", 47)}
	single := startEngine(t, nil, nil)
	want := complete(t, single.URL, prompts)
	for _, tls := range []string{"tcp", "sm"} {
		t.Run(tls, func(t *testing.T) {
			dlog, err := os.Create(filepath.Join(t.TempDir(), "d.log"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { dlog.Close() }) // after the engines (cleanups run last first)
			p := startEngine(t, kvConfig(t, "kv_producer"), map[string]string{"TLS": tls})
			d := startEngine(t, kvConfig(t, "kv_consumer"), map[string]string{"TLS": tls}, dlog)
			got := complete(t, oneWayProxy(t, p, d), prompts)
			logged, err := os.ReadFile(dlog.Name())
			if err != nil {
				t.Fatal(err)
			}
			for i := range prompts {
				if got[i] != want[i] {
					t.Errorf("prompt %d: P/D %q, single %q", i, got[i], want[i])
				}
			}
			for _, l := range strings.Split(string(logged), "\n") {
				if strings.Contains(l, "UCX link up") {
					t.Log(l)
				}
			}
			if !strings.Contains(string(logged), "backend=UCX") {
				t.Errorf("D's handshake did not report UCX:\n%s", logged)
			}
			if st := d.Engine.Stats(); st.ExternalHits == 0 {
				t.Errorf("D loaded no external tokens: %+v", st)
			}
			for name, in := range map[string]*instance.Instance{"P": p, "D": d} {
				waitPoolFull(t, name, in)
			}
		})
	}
}

// TestUCXBackendMismatch: a decoder restricted to UCX and a prefiller without it cannot pair:
// the request fails (policy fail), D's log says which backends P offers, and both pools end
// full (P's once its 2 s lease expires: with no backend in common, D cannot notify it).
func TestUCXBackendMismatch(t *testing.T) {
	dlog, err := os.Create(filepath.Join(t.TempDir(), "d.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dlog.Close() })
	pcfg, err := connector.ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"backends":["TCP"],"kv_lease_duration":2}}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	p := startEngine(t, pcfg, nil)
	d := startEngine(t, kvConfig(t, "kv_consumer"), nil, dlog)
	url := oneWayProxy(t, p, d)
	body, _ := json.Marshal(map[string]any{"model": "kvbridge/tiny", "prompt": strings.Repeat("blocks ", 40), "max_tokens": 4, "temperature": 0})
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("UCX-only D with a TCP-only P: %d %s; want 500", resp.StatusCode, raw)
	}
	if logged, _ := os.ReadFile(dlog.Name()); !strings.Contains(string(logged), "offers the transfer backends [TCP], none of which kv_connector_extra_config.backends [UCX] allows") {
		t.Errorf("D's log does not name the backends:\n%s", logged)
	}
	for name, in := range map[string]*instance.Instance{"P": p, "D": d} {
		waitPoolFull(t, name, in)
	}
}

// TestUCXRefusesAuthToken: UCX cannot authenticate peers, so an engine given both UCX and an
// auth token does not start, and says why.
func TestUCXRefusesAuthToken(t *testing.T) {
	cfg, err := connector.ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"backends":["UCX"],"auth_token":"0123456789abcdef0123"}}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = instance.Start(t.Context(), instance.Config{Model: "kvbridge/tiny", Host: "127.0.0.1", NumBlocks: 64, KVTransfer: cfg, SideChannelPort: -1})
	if !errors.Is(err, connector.ErrConfig) || !strings.Contains(err.Error(), "do not authenticate peers") {
		t.Fatalf("UCX with an auth token: %v; want connector.ErrConfig saying UCX does not authenticate", err)
	}
}

// oneWayProxy serves the one-way proxy in front of p and d for the test and returns its URL.
func oneWayProxy(t *testing.T, p, d *instance.Instance) string {
	t.Helper()
	pi, _ := proxy.NewInstance("127.0.0.1", p.Addr.Port)
	di, _ := proxy.NewInstance("127.0.0.1", d.Addr.Port)
	h, err := proxy.NewOneWay(proxy.Config{Prefill: []proxy.Instance{pi}, Decode: []proxy.Instance{di}})
	if err != nil {
		t.Fatal(err)
	}
	px := httptest.NewServer(h)
	t.Cleanup(func() { px.Close(); h.Close() })
	return px.URL
}

// kvConfig parses a NixlConnector configuration for role that forces UCX.
func kvConfig(t *testing.T, role string) *connector.Config {
	t.Helper()
	cfg, err := connector.ParseConfig([]byte(fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":%q,"kv_connector_extra_config":{"backends":["UCX"]}}`, role)), nil)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// startEngine starts the tiny model with kv (nil: no connector), UCX settings ucx for its
// transfer agent, and its log written to logw (if any).
func startEngine(t *testing.T, kv *connector.Config, ucx map[string]string, logw ...io.Writer) *instance.Instance {
	t.Helper()
	w := io.Discard
	if len(logw) > 0 {
		w = logw[0]
	}
	in, err := instance.Start(t.Context(), instance.Config{
		Model: "kvbridge/tiny", Host: "127.0.0.1", NumBlocks: 512, MaxModelLen: 4096,
		KVTransfer: kv, SideChannelHost: "127.0.0.1", SideChannelPort: -1,
		Logger:         slog.New(slog.NewTextHandler(w, nil)),
		ConnectorHooks: func(o *connector.Options) { o.Transfer.UCX = ucx },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	return in
}

// complete sends each prompt as a greedy completion (streaming every other one) and returns
// the texts.
func complete(t *testing.T, base string, prompts []any) []string {
	t.Helper()
	out := make([]string, len(prompts))
	for i, p := range prompts {
		body, _ := json.Marshal(map[string]any{"model": "kvbridge/tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "stream": i%2 == 1})
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			cancel()
			t.Fatal(err)
		}
		raw, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		cancel()
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("prompt %d: %d %s %v", i, resp.StatusCode, raw, err)
		}
		out[i] = completionText(t, raw, i%2 == 1)
	}
	return out
}

// completionText extracts the text of a completion, assembling an SSE stream.
func completionText(t *testing.T, raw []byte, sse bool) string {
	t.Helper()
	type chunk struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	var text strings.Builder
	add := func(b []byte) {
		var c chunk
		if err := json.Unmarshal(b, &c); err != nil {
			t.Fatalf("decoding %q: %v", b, err)
		}
		for _, ch := range c.Choices {
			text.WriteString(ch.Text)
		}
	}
	if !sse {
		add(raw)
		return text.String()
	}
	for _, line := range strings.Split(string(raw), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if ok && data != "[DONE]" {
			add([]byte(data))
		}
	}
	return text.String()
}

// waitPoolFull waits (bounded) until every KV block of in is free again.
func waitPoolFull(t *testing.T, name string, in *instance.Instance) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for in.Pool.NumFree() != in.Pool.NumBlocks() {
		if time.Now().After(deadline) {
			t.Fatalf("%s's pool holds %d of %d blocks", name, in.Pool.NumBlocks()-in.Pool.NumFree(), in.Pool.NumBlocks())
		}
		<-tick.C
	}
}
