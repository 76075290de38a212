package reliability

import (
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/faultproxy"
)

// Faults on the transfer path: P publishes a fault proxy as its transfer address and both
// engines use the TCP backend, so D's READs, its heartbeats and its notifications go through
// the fault proxy. Each case first serves one request, so that the handshake and the transfer
// connections exist when the fault is switched on.

// loadDeadline is the connector's bound on one KV load (handshake, READ, generation check).
const loadDeadline = 60 * time.Second

// TestTransferLatency: 20 ms on every chunk each way: correct answers, nothing held.
func TestTransferLatency(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{transferProxy: true})
	s.xfer.SetLatency(faultproxy.Both, 20*time.Millisecond)
	s.askOK(t, longPrompt(30), 30)
	s.askOK(t, longPrompt(31), 31)
	if st := s.xfer.Stats(); st.Forwarded[1] == 0 {
		t.Fatalf("no READ data went through the fault proxy: %+v", st)
	}
	s.p.waitPoolFull(t)
	s.d.waitPoolFull(t)
}

// TestTransferStallTransient: the READ data is held for a while and then flows: the request
// waits and answers correctly.
func TestTransferStallTransient(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{transferProxy: true})
	s.askOK(t, longPrompt(32), 32)
	held := s.xfer.Stall(faultproxy.Down)
	done := make(chan reply, 1)
	body := completion(longPrompt(33), 12, sampled(33)...)
	go func() {
		r, _ := tryPost(t.Context(), s.hc, s.px.URL+"/v1/completions", "", body)
		done <- r
	}()
	fired(t, "P's READ data to be held", held)
	s.xfer.Resume(faultproxy.Down)
	var r reply
	select {
	case r = <-done:
	case <-time.After(requestDeadline):
		t.Fatal("no answer after the stall ended")
	}
	if want := s.ref.answer(t, "/v1/completions", body); r.status != 200 || r.text != want {
		t.Fatalf("after a transient stall: %d %q %s; want %q", r.status, r.text, r.raw, want)
	}
	s.p.waitPoolFull(t)
	s.d.waitPoolFull(t)
}

// TestTransferStall: P's READ data stops in the middle of a frame (the connections stay open).
// D gives up after the connector's 60 s load deadline and recomputes (policy recompute): the
// right answer; the failure is counted; D's heartbeats kept P's lease alive meanwhile, and it
// expires once they stop. When the held bytes are then released, none of them may land in D's
// blocks: the same prompt, answered from D's prefix cache, is still right.
func TestTransferStall(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for the connector's 60 s load deadline")
	}
	t.Parallel()
	leakCheck(t)
	// The proxy's header timeout (default 5 minutes) is longer than the load deadline.
	s := startStack(t, stackOptions{transferProxy: true, pClock: true, policy: connector.PolicyRecompute, headerTimeout: 2 * loadDeadline})
	s.askOK(t, longPrompt(34), 34)
	s.xfer.StallAfter(faultproxy.Down, 1000) // a frame header and the start of its payload
	body := completion(longPrompt(35), 12, sampled(35)...)
	r := postWithin(t, s.hc, loadDeadline+slack, s.px.URL+"/v1/completions", body)
	s.wantPolicyOutcome(t, r, body)
	waitMetric(t, s.hc, s.d.URL, "vllm:nixl_num_failed_transfers_total", 1)
	s.d.waitPoolFull(t)
	s.expireP(t)
	s.xfer.Resume(faultproxy.Down)
	eventually(t, "the held READ data to be gone", func() bool { return s.xfer.Stats().Held[1] == 0 })
	again := post(t, s.hc, s.d.URL+"/v1/completions", "", body)
	if want := s.ref.answer(t, "/v1/completions", body); again.status != 200 || again.text != want {
		t.Fatalf("the same prompt on D after the late bytes: %d %q, want %q", again.status, again.text, want)
	}
	s.askOK(t, longPrompt(36), 36)
}

// TestTransferFaults: the READ's data connection is cut after 1000 bytes, or its frames are
// corrupted. A cut connection is a dead peer to the transfer engine: D handshakes again and
// retries the read once over a new connection, so the client gets the right answer under
// either policy. Corruption persists on the new connection: the load fails at once — policy
// fail answers 500, recompute the right answer. Either way the failed attempt is counted, the
// blocks return to both pools, and the next request succeeds.
func TestTransferFaults(t *testing.T) {
	t.Parallel()
	faults := map[string]func(*faultproxy.Proxy){
		"mid-stream-close": func(fp *faultproxy.Proxy) { fp.CloseAfter(faultproxy.Down, 1000) },
		"corrupt":          func(fp *faultproxy.Proxy) { fp.Corrupt(faultproxy.Down, 1, 0) },
	}
	for _, name := range []string{"mid-stream-close", "corrupt"} {
		t.Run(name, func(t *testing.T) {
			policies(t, func(t *testing.T, policy connector.FailurePolicy) {
				leakCheck(t)
				s := startStack(t, stackOptions{transferProxy: true, pClock: true, policy: policy})
				s.askOK(t, longPrompt(37), 37)
				faults[name](s.xfer)
				body := completion(longPrompt(38), 12, sampled(38)...)
				r := post(t, s.hc, s.px.URL+"/v1/completions", "", body)
				if name == "mid-stream-close" {
					if want := s.ref.answer(t, "/v1/completions", body); r.status != 200 || r.text != want {
						t.Fatalf("after a cut transfer connection: %d %s, want the right answer from the retried read %q", r.status, r.raw, want)
					}
				} else {
					s.wantPolicyOutcome(t, r, body)
				}
				waitMetric(t, s.hc, s.d.URL, "vllm:nixl_num_failed_transfers_total", 1)
				s.d.waitPoolFull(t)
				s.expireP(t)
				s.xfer.Reset()
				s.askOK(t, longPrompt(39), 39)
				s.d.waitPoolFull(t)
				s.p.waitPoolFull(t)
			})
		})
	}
}
