package connector_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

// TestIdleRemoteEngineEvicted covers item 45: a remote engine idle longer than engine_ttl is
// forgotten (its transfer peer invalidated) and the next request handshakes again.
func TestIdleRemoteEngineEvicted(t *testing.T) {
	clock := newFakeClock()
	tick := make(chan time.Time)
	var log fixture.LogBuffer
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg})
	d := startNode(t, "D", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"engine_ttl":60}}`,
		now: clock.Now, tick: tick, logw: &log})
	prompt := tokens(40, 30)
	for range 2 {
		if status, r := decode(t, d, prompt, prefill(t, p, prompt), 3); status != 200 {
			t.Fatal(r.Raw)
		}
	}
	if n := strings.Count(log.String(), "NIXL handshake done"); n != 1 {
		t.Fatalf("%d handshakes for two requests, want 1 (one per remote engine)", n)
	}
	clock.Advance(61 * time.Second)
	tick <- clock.Now()
	eventually(t, "D to forget P", func() bool { return strings.Contains(log.String(), "forgetting an idle remote engine") })
	if status, r := decode(t, d, prompt, prefill(t, p, prompt), 3); status != 200 {
		t.Fatal(r.Raw)
	}
	if n := strings.Count(log.String(), "NIXL handshake done"); n != 2 {
		t.Errorf("%d handshakes, want a second one after the eviction", n)
	}
	p.waitPoolFull(t)
}
