package connector_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

// TestLateReleaseCountsEveryRankPair: a decoder reads after the producer's lease expired, and
// the producer counts the late release in vllm:nixl_num_notifications_after_expiry once per
// notification vLLM's ranks would have sent, not once per request (the guide: "each remote rank
// notifies separately, so with TP > 1 or heterogeneous TP one late request counts several
// times"). The tiny model has 2 KV heads. vLLM's D worker r reads its heads from the P
// worker(s) holding them and notifies each of those P workers ("<id>:<consumers>"); each P
// worker that receives a notification for a request it no longer tracks counts one:
//
//   - P TP 1 ← D TP 1: D rank 0 reads P rank 0: 1 notification.
//   - P TP 2 ← D TP 1: D rank 0 holds heads 0 and 1, reads head 0 from P rank 0 and head 1
//     from P rank 1, and notifies both: 2.
//   - P TP 1 ← D TP 2: D rank 0 (head 0) and D rank 1 (head 1) each read from P rank 0 and
//     each notify it: 2.
//   - P TP 2 ↔ D TP 2: D rank r reads P rank r, each notifies its own: 2.
//   - P TP 4 ← D TP 1: P replicates the 2 heads (ranks 0, 1 hold head 0; 2, 3 head 1); D rank
//     0 reads head 0 from P rank 0 and head 1 from P rank 2 (one replica each) and notifies
//     those two: 2, not 4.
//   - P TP 1 ← D TP 4: D ranks 0 … 3 (heads 0, 0, 1, 1) each read from P rank 0 and notify
//     it: 4.
//
// D's answer is still the right one (policy recompute: the records no longer match), and every
// pool is full again.
func TestLateReleaseCountsEveryRankPair(t *testing.T) {
	prompt := tokens(40, 61)
	single := startNode(t, "single", nodeOptions{})
	_, want := post(t, single.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})
	for _, tc := range []struct{ pTP, dTP, want int }{
		{1, 1, 1}, {2, 1, 2}, {1, 2, 2}, {2, 2, 2}, {4, 1, 2}, {1, 4, 4},
	} {
		t.Run(fmt.Sprintf("P TP %d ← D TP %d", tc.pTP, tc.dTP), func(t *testing.T) {
			clock := newFakeClock()
			tick := make(chan time.Time)
			var plog fixture.LogBuffer
			p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, now: clock.Now, tick: tick, tp: tc.pTP, logw: &plog})
			d := startNode(t, "D", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"recompute"}`, tp: tc.dTP})
			kv := prefill(t, p, prompt)
			clock.Advance(31 * time.Second)
			tick <- clock.Now()
			p.waitPoolFull(t)
			status, r := decode(t, d, prompt, kv, 4)
			if status != 200 || r.Text != want.Text {
				t.Fatalf("late read: %d %q, want 200 %q", status, r.Text, want.Text)
			}
			eventually(t, "P to log the late release", func() bool {
				return strings.Contains(plog.String(), "Potentially invalid KV blocks for unrecognized request")
			})
			m := fixture.Scrape(t, http.DefaultClient, p.srv.URL)
			if got := m.Sum("vllm:nixl_num_notifications_after_expiry_total"); got != float64(tc.want) {
				t.Errorf("P counted %v notifications after expiry for one late request, want %d", got, tc.want)
			}
			if got := m.Sum("vllm:nixl_num_kv_expired_reqs_total"); got != 1 {
				t.Errorf("P counted %v expired requests, want 1 (per request)", got)
			}
			d.waitPoolFull(t)
		})
	}
}
