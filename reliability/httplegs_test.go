package reliability

import (
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/faultproxy"
)

// Faults on the proxy's HTTP legs: a fault proxy between the P/D proxy and P's or D's HTTP
// server.

// TestPrefillLegLatency: 200 ms each way between the proxy and P slows the answer down and
// changes nothing else.
func TestPrefillLegLatency(t *testing.T) {
	leakCheck(t)
	s := startStack(t, stackOptions{})
	s.httpP.SetLatency(faultproxy.Both, 200*time.Millisecond)
	s.askOK(t, longPrompt(1), 1)
	s.p.waitPoolFull(t)
	s.d.waitPoolFull(t)
}

// TestPrefillLegStall: P's answer never reaches the proxy. The proxy gives up after its header
// timeout with 502 prefill_request_failed; P, which finished the prefill and holds the blocks
// for a reader that never comes, frees them when the lease expires (counted as expired).
func TestPrefillLegStall(t *testing.T) {
	leakCheck(t)
	s := startStack(t, stackOptions{pClock: true, headerTimeout: 2 * time.Second})
	s.httpP.Stall(faultproxy.Down)
	r := post(t, s.hc, s.px.URL+"/v1/completions", "", completion(longPrompt(2), 12, sampled(2)...))
	wantError(t, r, 502, "prefill_request_failed")
	eventually(t, "P to hold the finished prefill's blocks", func() bool { return s.p.Engine.Stats().Delayed == 1 })
	s.expireP(t)
	waitMetric(t, s.hc, s.p.URL, "vllm:nixl_num_kv_expired_reqs_total", 1)
	s.httpP.Reset()
	s.askOK(t, longPrompt(3), 3)
	s.d.waitPoolFull(t)
}

// TestPrefillLegMidStreamClose: the connection from P is cut 20 bytes into P's answer: 502
// prefill_request_failed, and P's lease frees the blocks.
func TestPrefillLegMidStreamClose(t *testing.T) {
	leakCheck(t)
	s := startStack(t, stackOptions{pClock: true})
	s.httpP.CloseAfter(faultproxy.Down, 20)
	r := post(t, s.hc, s.px.URL+"/v1/completions", "", completion(longPrompt(4), 12, sampled(4)...))
	wantError(t, r, 502, "prefill_request_failed")
	eventually(t, "P to hold the finished prefill's blocks", func() bool { return s.p.Engine.Stats().Delayed == 1 })
	s.expireP(t)
	waitMetric(t, s.hc, s.p.URL, "vllm:nixl_num_kv_expired_reqs_total", 1)
	s.askOK(t, longPrompt(5), 5)
}

// TestPrefillLegCorrupt: every other byte of P's answer is flipped: the proxy cannot parse it
// and answers 502 prefill_request_failed. (Bytes flipped inside a body that still parses are
// not detected: HTTP has no integrity check of its own; see docs/reliability.md.)
func TestPrefillLegCorrupt(t *testing.T) {
	leakCheck(t)
	s := startStack(t, stackOptions{pClock: true, headerTimeout: 5 * time.Second})
	s.httpP.Corrupt(faultproxy.Down, 2, 0)
	r := post(t, s.hc, s.px.URL+"/v1/completions", "", completion(longPrompt(6), 12, sampled(6)...))
	wantError(t, r, 502, "prefill_request_failed")
	eventually(t, "P to hold the finished prefill's blocks", func() bool { return s.p.Engine.Stats().Delayed == 1 })
	s.expireP(t)
	s.httpP.Reset()
	s.httpP.Cut() // the corrupted keep-alive connection
	s.askOK(t, longPrompt(7), 7)
}

// TestPrefillLegRefused: P's port refuses connections: 502 prefill_request_failed at once, and
// nothing is held anywhere.
func TestPrefillLegRefused(t *testing.T) {
	leakCheck(t)
	s := startStack(t, stackOptions{})
	s.httpP.Refuse(true)
	r := post(t, s.hc, s.px.URL+"/v1/completions", "", completion(longPrompt(8), 12, sampled(8)...))
	wantError(t, r, 502, "prefill_request_failed")
	s.p.waitPoolFull(t)
	s.httpP.Refuse(false)
	s.askOK(t, longPrompt(9), 9)
}

// TestDecodeLegLatency: 200 ms each way between the proxy and D: a slower, correct answer.
func TestDecodeLegLatency(t *testing.T) {
	leakCheck(t)
	s := startStack(t, stackOptions{})
	s.httpD.SetLatency(faultproxy.Both, 200*time.Millisecond)
	s.askOK(t, longPrompt(10), 10)
	s.p.waitPoolFull(t)
	s.d.waitPoolFull(t)
}

// TestDecodeLegStall: D's stream stops reaching the proxy. The multi-turn proxy gives up after
// its idle timeout: 502 decode_request_failed for a non-streaming client, an SSE error event and
// [DONE] for a streaming one. D sees its client leave and frees; P was notified by D's read.
func TestDecodeLegStall(t *testing.T) {
	leakCheck(t)
	s := startStack(t, stackOptions{multiTurn: true, idleTimeout: time.Second, headerTimeout: 2 * time.Second})
	body := completion(longPrompt(11), 400, "ignore_eos", true)
	s.httpD.Stall(faultproxy.Down)
	r := post(t, s.hc, s.px.URL+"/v1/completions", "", body)
	wantError(t, r, 502, "decode_request_failed")
	s.httpD.Reset()
	s.httpD.Cut()
	eventually(t, "the stalled link to close", func() bool { return s.httpD.Stats().Open == 0 })
	s.d.waitPoolFull(t)
	s.p.waitPoolFull(t)

	// Streaming: the headers and the first events arrive, then the stream stalls.
	s.httpD.StallOn(faultproxy.Down, []byte("data: "))
	r = post(t, s.hc, s.px.URL+"/v1/completions", "", withBody(body, "stream", true))
	if r.status != 200 || r.err == nil || !strings.Contains(r.raw, "decode stream ended early") || !strings.HasSuffix(strings.TrimSpace(r.raw), "data: [DONE]") {
		t.Fatalf("stalled stream: %d %s; want 200 ending with an SSE error event and [DONE]", r.status, r.raw)
	}
	s.httpD.Reset()
	s.d.waitPoolFull(t)
	s.p.waitPoolFull(t)
}

// TestDecodeLegMidStreamClose: the connection from D is cut in the middle of its answer. A
// non-streaming client (whose body D sends at the end) gets 502 decode_request_failed; a
// streaming client, whose 200 and first events already left, must be able to tell that its
// stream is incomplete: the multi-turn proxy ends it with an SSE error event and [DONE]. D sees
// its client leave and frees; P was notified by D's read.
func TestDecodeLegMidStreamClose(t *testing.T) {
	for _, multiTurn := range []bool{false, true} {
		name := "one-way"
		if multiTurn {
			name = "multi-turn"
		}
		t.Run(name, func(t *testing.T) {
			leakCheck(t)
			s := startStack(t, stackOptions{multiTurn: multiTurn})
			body := completion(longPrompt(12), 400, "ignore_eos", true)
			s.httpD.CloseAfter(faultproxy.Down, 10)
			r := post(t, s.hc, s.px.URL+"/v1/completions", "", body)
			wantError(t, r, 502, "decode_request_failed")
			s.d.waitPoolFull(t)
			s.p.waitPoolFull(t)

			s.httpD.CloseAfter(faultproxy.Down, 2000) // past the headers, inside the event stream
			r, err := tryPost(t.Context(), s.hc, s.px.URL+"/v1/completions", "", withBody(body, "stream", true))
			complete := err == nil && strings.HasSuffix(strings.TrimSpace(r.raw), "data: [DONE]")
			switch {
			case err != nil:
				// The client saw the stream break: acceptable.
			case r.status != 200:
				t.Errorf("cut stream: status %d %s", r.status, r.raw)
			case r.err == nil && complete:
				t.Errorf("a stream cut in the middle reached the client complete and without an error: %d bytes", len(r.raw))
			case r.err == nil:
				t.Errorf("a stream cut in the middle reached the client as a 200 that ended cleanly, without [DONE] or an error event (vLLM's truncated-200 problem): %d bytes, ends %q",
					len(r.raw), tail(r.raw, 60))
			}
			s.d.waitPoolFull(t)
			s.p.waitPoolFull(t)
		})
	}
}

// TestDecodeLegCorrupt: every other byte of D's answer is flipped: 502 decode_request_failed.
func TestDecodeLegCorrupt(t *testing.T) {
	leakCheck(t)
	s := startStack(t, stackOptions{headerTimeout: 5 * time.Second})
	s.httpD.Corrupt(faultproxy.Down, 2, 0)
	r := post(t, s.hc, s.px.URL+"/v1/completions", "", completion(longPrompt(13), 12, sampled(13)...))
	wantError(t, r, 502, "decode_request_failed")
	s.httpD.Reset()
	s.httpD.Cut()
	s.d.waitPoolFull(t)
	s.p.waitPoolFull(t)
	s.askOK(t, longPrompt(14), 14)
}

// TestDecodeLegRefused: D's port refuses connections: 502 decode_request_failed; P's blocks,
// prefilled for a decoder that never reads them, return when the lease expires.
func TestDecodeLegRefused(t *testing.T) {
	leakCheck(t)
	s := startStack(t, stackOptions{pClock: true})
	s.httpD.Refuse(true)
	r := post(t, s.hc, s.px.URL+"/v1/completions", "", completion(longPrompt(15), 12, sampled(15)...))
	wantError(t, r, 502, "decode_request_failed")
	eventually(t, "P to hold the finished prefill's blocks", func() bool { return s.p.Engine.Stats().Delayed == 1 })
	s.expireP(t)
	waitMetric(t, s.hc, s.p.URL, "vllm:nixl_num_kv_expired_reqs_total", 1)
	s.httpD.Refuse(false)
	s.askOK(t, longPrompt(16), 16)
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
