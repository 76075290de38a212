package instance

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/connector"
)

// getReady returns GET /ready's status and body.
func getReady(t *testing.T, in *Instance) (int, string) {
	t.Helper()
	resp, err := http.Get(in.URL + "/ready")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw)
}

// TestReadyFollowsTheConnector: /ready is 200 while every rank's connector answers its side
// channel, and 503 naming the connector once one is closed, while /health (liveness) stays 200;
// an engine without a connector is ready. The side channel requires an auth token, which the
// check presents.
func TestReadyFollowsTheConnector(t *testing.T) {
	plain, _, err := start(t, Config{NumBlocks: 64})
	if err != nil {
		t.Fatal(err)
	}
	if status, body := getReady(t, plain); status != 200 {
		t.Errorf("an engine without a connector: /ready %d %s; want 200", status, body)
	}

	// With an auth token, so the loopback handshake authenticates as a peer's does.
	kv, err := connector.ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"auth_token":"s3cret"}}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	in, _, err := start(t, Config{NumBlocks: 64, KVTransfer: kv, SideChannelPort: -1, DataParallelSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	status, body := getReady(t, in)
	var ok struct{ Ready bool }
	if status != 200 || json.Unmarshal([]byte(body), &ok) != nil || !ok.Ready {
		t.Fatalf("/ready with the connectors up: %d %s; want 200 {\"ready\":true}", status, body)
	}
	// Rank 1's connector goes; rank 0 serves /ready and still reports it.
	if err := in.Ranks[1].Connector.Close(); err != nil {
		t.Fatal(err)
	}
	status, body = getReady(t, in)
	if status != http.StatusServiceUnavailable || !strings.Contains(body, in.Ranks[1].Connector.EngineID()) {
		t.Errorf("/ready with rank 1's connector closed: %d %s; want 503 naming %s", status, body, in.Ranks[1].Connector.EngineID())
	}
	resp, err := http.Get(in.URL + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("/health (liveness) with a connector closed: %d; want 200", resp.StatusCode)
	}
}
