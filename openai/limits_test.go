package openai

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/engine"
)

// TestConcurrencyLimit: with MaxConcurrentRequests busy, one more request gets 429 in OpenAI's
// error shape at once, and rejections are counted in /metrics.
func TestConcurrencyLimit(t *testing.T) {
	// The busy request is parked in its load (it holds its slot until stop): a streamed one that
	// is merely read slowly may have finished, and freed its slot, before the second is sent.
	conn := newTestConnector()
	h := newEnv(t, func(c *Config) { c.MaxConcurrentRequests = 1 },
		envEngineOption(func(c *engine.Config) { c.Connector = conn }))
	stop := park(t, h, conn, `{"prompt":"x","max_tokens":2,"kv_transfer_params":{"test_park_load":true}}`)
	defer stop()
	resp2, err := http.Post(h.http.URL+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"y","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	var e struct {
		Error struct {
			Type string
			Code int
		}
	}
	_ = json.NewDecoder(resp2.Body).Decode(&e)
	resp2.Body.Close()
	if resp2.StatusCode != 429 || e.Error.Type != "RateLimitError" || e.Error.Code != 429 || resp2.Header.Get("Retry-After") == "" {
		t.Fatalf("second request: %d %+v", resp2.StatusCode, e)
	}
	m, err := http.Get(h.http.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Body.Close()
	var found bool
	sc := bufio.NewScanner(m.Body)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "kvbridge:requests_rejected_total{") && strings.Contains(sc.Text(), `reason="429"`) && strings.HasSuffix(sc.Text(), " 1") {
			found = true
		}
	}
	if !found {
		t.Error("the 429 was not counted in kvbridge:requests_rejected_total")
	}
}

// TestDefaultMaxTokensFromGenerationConfig: without max_tokens, a request generates at most the
// model's max_new_tokens (256 for the built-in models), not up to the context length.
func TestDefaultMaxTokensFromGenerationConfig(t *testing.T) {
	const maxLen = 1000 // within the test pool, above the built-in max_new_tokens
	e := newEnv(t, func(c *Config) { c.MaxModelLen = maxLen }, envEngineOption(func(c *engine.Config) { c.MaxModelLen = maxLen }))
	_, body := e.post(t, "/v1/completions", map[string]any{"prompt": "hi", "ignore_eos": true}, nil)
	u := decode(t, body)["usage"].(map[string]any)
	if got, want := int(u["completion_tokens"].(float64)), e.model.Generation().MaxNewTokens; got != want {
		t.Errorf("completion_tokens = %d, want the model's max_new_tokens %d", got, want)
	}
}

// TestConcurrencyLimitCountsSequences: MaxConcurrentRequests counts sequences, max(n, best_of)
// per request: a request with n=4 in flight fills a limit of 4 (one more n=1 request gets
// 429); with n=3 in flight an n=2 request gets 429 and an n=1 request is served; a request with
// more sequences than the whole limit is served when it is alone.
func TestConcurrencyLimitCountsSequences(t *testing.T) {
	conn := newTestConnector()
	e := newEnv(t, func(c *Config) { c.MaxConcurrentRequests = 4 },
		envEngineOption(func(c *engine.Config) { c.Connector = conn }))
	parkN := func(n int) (stop func()) {
		return park(t, e, conn, fmt.Sprintf(`{"prompt":"park","max_tokens":2,"n":%d,"kv_transfer_params":{"test_park_load":true}}`, n))
	}
	status := func(n int) int {
		resp, raw := e.post(t, "/v1/completions", map[string]any{"prompt": "hello", "max_tokens": 2, "n": n}, nil)
		if resp.StatusCode == http.StatusTooManyRequests {
			var body struct{ Error struct{ Type string } }
			if err := json.Unmarshal(raw, &body); err != nil || body.Error.Type != "RateLimitError" || resp.Header.Get("Retry-After") == "" {
				t.Errorf("429 %s (Retry-After %q)", raw, resp.Header.Get("Retry-After"))
			}
		}
		return resp.StatusCode
	}

	stop := parkN(4)
	if got := status(1); got != http.StatusTooManyRequests {
		t.Errorf("n=1 beside n=4 in flight: %d, want 429", got)
	}
	stop()
	waitHandlers(t, e, 2)

	stop = parkN(3)
	if got := status(2); got != http.StatusTooManyRequests {
		t.Errorf("n=2 beside n=3 in flight: %d, want 429", got)
	}
	if got := status(1); got != http.StatusOK {
		t.Errorf("n=1 beside n=3 in flight: %d, want 200", got)
	}
	stop()
	waitHandlers(t, e, 3)

	if got := status(6); got != http.StatusOK {
		t.Errorf("n=6 alone under a limit of 4: %d, want 200", got)
	}
}
