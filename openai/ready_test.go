package openai

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
)

// TestReady: GET /ready is 200 {"ready":true} without a Config.Ready and while it reports
// nothing, and 503 in the error JSON with its reason while it does; /health is not affected.
func TestReady(t *testing.T) {
	if resp, b := newEnv(t).do(t, http.MethodGet, "/ready", nil, nil); resp.StatusCode != http.StatusOK || decode(t, b)["ready"] != true {
		t.Errorf("/ready without Config.Ready: %d %s", resp.StatusCode, b)
	}
	var broken atomic.Bool
	e := newEnv(t, func(c *Config) {
		c.Ready = func(ctx context.Context) error {
			if _, ok := ctx.Deadline(); !ok {
				return errors.New("no deadline")
			}
			if broken.Load() {
				return errors.New("side channel closed")
			}
			return nil
		}
	})
	if resp, b := e.do(t, http.MethodGet, "/ready", nil, nil); resp.StatusCode != http.StatusOK {
		t.Errorf("/ready while Ready reports nothing: %d %s", resp.StatusCode, b)
	}
	broken.Store(true)
	resp, b := e.do(t, http.MethodGet, "/ready", nil, nil)
	msg, _ := decode(t, b)["error"].(map[string]any)["message"].(string)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(msg, "side channel closed") {
		t.Errorf("/ready while Ready fails: %d %s; want 503 with the reason", resp.StatusCode, b)
	}
	if resp, _ := e.do(t, http.MethodGet, "/health", nil, nil); resp.StatusCode != http.StatusOK {
		t.Errorf("/health while not ready: %d; want 200 (liveness)", resp.StatusCode)
	}
	if resp, _ := e.do(t, http.MethodPost, "/ready", nil, nil); resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /ready: %d; want 405", resp.StatusCode)
	}
}
