package reliability

import (
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/faultproxy"
)

// Faults on the side channel: a fault proxy in front of P's side channel, which D dials for
// the handshake (the proxy's legs rewrite remote_port to it).

// handshakeDeadline is the connector's bound on one handshake.
const handshakeDeadline = 10 * time.Second

// TestSideChannelLatency: 100 ms each way on the handshake: correct answers.
func TestSideChannelLatency(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{sideProxy: true})
	s.side.SetLatency(faultproxy.Both, 100*time.Millisecond)
	s.askOK(t, longPrompt(20), 20)
	if s.side.Stats().Accepted == 0 {
		t.Fatal("the handshake did not go through the fault proxy")
	}
	s.p.waitPoolFull(t)
	s.d.waitPoolFull(t)
}

// TestSideChannelStall: the handshake answer never comes. D gives up after its 10 s handshake
// deadline and applies its policy; the failure is counted; P's lease frees the blocks.
func TestSideChannelStall(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{sideProxy: true, pClock: true, policy: connector.PolicyFail})
	s.side.Stall(faultproxy.Down)
	body := completion(longPrompt(21), 12, sampled(21)...)
	r := postWithin(t, s.hc, handshakeDeadline+slack, s.px.URL+"/v1/completions", body)
	s.wantPolicyOutcome(t, r, body)
	waitMetric(t, s.hc, s.d.URL, "vllm:nixl_num_failed_transfers_total", 1)
	s.d.waitPoolFull(t)
	s.expireP(t)
	s.side.Reset()
	s.side.Cut()
	s.askOK(t, longPrompt(22), 22)
}

// TestSideChannelFaults: a handshake cut mid-answer, corrupted, or refused fails the load at
// once: policy fail answers 500, recompute the right answer; counted on D; P's lease frees.
func TestSideChannelFaults(t *testing.T) {
	t.Parallel()
	faults := map[string]func(*faultproxy.Proxy){
		"mid-stream-close": func(fp *faultproxy.Proxy) { fp.CloseAfter(faultproxy.Down, 10) },
		"corrupt":          func(fp *faultproxy.Proxy) { fp.Corrupt(faultproxy.Down, 3, 4) },
		"refused":          func(fp *faultproxy.Proxy) { fp.Refuse(true) },
	}
	for _, name := range []string{"mid-stream-close", "corrupt", "refused"} {
		t.Run(name, func(t *testing.T) {
			policies(t, func(t *testing.T, policy connector.FailurePolicy) {
				leakCheck(t)
				s := startStack(t, stackOptions{sideProxy: true, pClock: true, policy: policy})
				faults[name](s.side)
				body := completion(longPrompt(23), 12, sampled(23)...)
				r := post(t, s.hc, s.px.URL+"/v1/completions", "", body)
				s.wantPolicyOutcome(t, r, body)
				waitMetric(t, s.hc, s.d.URL, "vllm:nixl_num_failed_transfers_total", 1)
				s.d.waitPoolFull(t)
				s.expireP(t)
				s.side.Reset()
				s.askOK(t, longPrompt(24), 24)
			})
		})
	}
}
