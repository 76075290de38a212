package openai

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestCheckKVRefuses: params Config.CheckKV refuses are a 400 naming kv_transfer_params and
// the reason, on both routes, and are handed to DeclineKV (the producer frees at once); params
// it accepts are served. GET /v1/kv_transfer serves Config.KVInfo, or a null connector.
func TestCheckKVRefuses(t *testing.T) {
	var d declined
	e := newEnv(t, func(c *Config) {
		c.DeclineKV = d.record
		c.CheckKV = func(p map[string]any) error {
			if p["id"] == "wrong-leg" {
				return errors.New("this engine is a kv_consumer and was asked to prefill")
			}
			return nil
		}
		c.KVInfo = func() any { return map[string]any{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"} }
	})
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		body := map[string]any{"max_tokens": 2, "kv_transfer_params": map[string]any{"id": "wrong-leg"}}
		if strings.Contains(path, "chat") {
			body["messages"] = []map[string]any{{"role": "user", "content": "hello"}}
		} else {
			body["prompt"] = "hello"
		}
		resp, raw := e.post(t, path, body, nil)
		m := decode(t, raw)
		errObj, _ := m["error"].(map[string]any)
		if resp.StatusCode != http.StatusBadRequest || errObj["param"] != "kv_transfer_params" || !strings.Contains(fmt.Sprint(errObj["message"]), "kv_consumer") {
			t.Errorf("%s: %d %s, want 400 naming kv_transfer_params and the reason", path, resp.StatusCode, raw)
		}
		body["kv_transfer_params"] = map[string]any{"id": "fine"}
		if resp, raw := e.post(t, path, body, nil); resp.StatusCode != http.StatusOK {
			t.Errorf("%s with accepted params: %d %s", path, resp.StatusCode, raw)
		}
	}
	if got := fmt.Sprint(d.ids()); got != "[wrong-leg wrong-leg]" {
		t.Errorf("declined %s, want the two refused requests' params", got)
	}
	resp, raw := e.do(t, http.MethodGet, "/v1/kv_transfer", nil, nil)
	if resp.StatusCode != http.StatusOK || decode(t, raw)["kv_role"] != "kv_consumer" {
		t.Errorf("GET /v1/kv_transfer: %d %s", resp.StatusCode, raw)
	}
	bare := newEnv(t)
	if resp, raw := bare.do(t, http.MethodGet, "/v1/kv_transfer", nil, nil); resp.StatusCode != http.StatusOK || !strings.Contains(string(raw), `"kv_connector":null`) {
		t.Errorf("GET /v1/kv_transfer without a connector: %d %s, want {\"kv_connector\":null}", resp.StatusCode, raw)
	}
}
