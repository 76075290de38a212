package connector_test

import (
	"strings"
	"testing"
)

// TestRoleRefusesWrongLeg: an engine refuses, with a 400 naming its role and the fix, a leg its
// kv_role cannot serve — a kv_consumer asked to prefill for a remote decoder, a kv_producer
// handed params to pull (the proxy's P and D swapped) — instead of answering 200 with the KV
// recomputed. kv_both serves both legs.
func TestRoleRefusesWrongLeg(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg})
	p2 := startNode(t, "P2", nodeOptions{kvConfig: producerCfg})
	d := startNode(t, "D", nodeOptions{kvConfig: consumerCfg})
	prompt := tokens(40, 31)

	status, r := post(t, d.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": template()})
	if status != 400 || r.Error["param"] != "kv_transfer_params" || !strings.Contains(r.Raw, "kv_consumer") || !strings.Contains(r.Raw, "swapped") {
		t.Errorf("consumer asked to prefill: %d %s, want 400 naming kv_transfer_params, the role and the likely swap", status, r.Raw)
	}
	kv := prefill(t, p, prompt)
	status, r = decode(t, p2, prompt, kv, 4)
	if status != 400 || r.Error["param"] != "kv_transfer_params" || !strings.Contains(r.Raw, "kv_producer") || !strings.Contains(r.Raw, "swapped") {
		t.Errorf("producer handed params to pull: %d %s, want 400 naming kv_transfer_params, the role and the likely swap", status, r.Raw)
	}
	d.waitPoolFull(t)
	p2.waitPoolFull(t)

	both := startNode(t, "B", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`})
	both2 := startNode(t, "B2", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`})
	kv = prefill(t, both, prompt)
	if status, r := decode(t, both2, prompt, kv, 4); status != 200 || cachedTokens(r) == 0 {
		t.Errorf("kv_both to kv_both: %d %s, want 200 with the prompt pulled", status, r.Raw)
	}
}
