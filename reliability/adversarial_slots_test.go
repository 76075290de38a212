package reliability

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/internal/fixture"
)

// TestAttackSlowReadersHoldSlots: the attack that held every sequence slot of D. Clients ask
// for streams of many sequences, each far larger than the socket buffers between them and
// the server (chat with 20 logprobs a token: about 5 MB), and never read: one straight at D,
// one through the one-way proxy; together they ask for all of D's slots. Each stalled writer
// is counted (D's kvbridge:http_client_stalled_total, the proxy's clients_stalled) once a write
// to it has waited the write timeout, and its sequences are aborted; from then on D serves a
// request of its whole limit, straight and through the proxy, within slack, while the attackers'
// connections are still open. D runs nothing afterwards and both pools are full.
func TestAttackSlowReadersHoldSlots(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	const (
		slots        = 8
		writeTimeout = time.Second
	)
	s := startStack(t, stackOptions{policy: connector.PolicyFail, dSlots: slots, dNumBlocks: 512, writeTimeout: writeTimeout})
	attack, err := json.Marshal(chat([]map[string]any{user("a client that never reads")}, 800,
		"n", slots/2, "ignore_eos", true, "logprobs", true, "top_logprobs", 20, "stream", true))
	if err != nil {
		t.Fatal(err)
	}
	fixture.NonReader(t, hostPort(s.d.URL), "/v1/chat/completions", string(attack))
	fixture.NonReader(t, hostPort(s.px.URL), "/v1/chat/completions", string(attack))

	// The attackers stall once their socket buffers are full and a write has waited the write
	// timeout: after the engine has generated some megabytes, so the wait is the request
	// deadline, not waitFor.
	eventuallyWithin(t, requestDeadline, "D to count the client that stalled it", func() bool {
		return metric(t, s.hc, s.d.URL, "kvbridge:http_client_stalled_total") >= 1
	})
	eventuallyWithin(t, requestDeadline, "the proxy to count the client that stalled it", func() bool {
		return proxyStalled(t, s.hc, s.px.URL) >= 1
	})
	bystander := completion("a bystander", 2, "n", slots)
	for _, url := range []string{s.d.URL, s.px.URL} {
		var last reply
		eventuallyWithin(t, slack, "a request of D's whole limit to be served at "+url, func() bool {
			last = post(t, s.hc, url+"/v1/completions", "", bystander)
			if last.status != http.StatusOK && last.status != http.StatusTooManyRequests {
				t.Fatalf("bystander at %s: %d %s", url, last.status, last.raw)
			}
			return last.status == http.StatusOK
		}, func() string { return last.raw })
	}
	if st := s.d.Engine.Stats(); st.Running != 0 || st.Waiting != 0 {
		t.Errorf("D runs %d and queues %d requests after the attack was cut off", st.Running, st.Waiting)
	}
	s.p.waitPoolFull(t)
	s.d.waitPoolFull(t)
}

// proxyStalled returns the clients_stalled count of the proxy's health.
func proxyStalled(t *testing.T, hc *http.Client, url string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), requestDeadline)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+"/healthcheck", nil)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("proxy health: %v", err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var h struct {
		Stalled int `json:"clients_stalled"`
	}
	if err := json.Unmarshal(raw, &h); err != nil {
		t.Fatalf("proxy health %s: %v", raw, err)
	}
	return h.Stalled
}
