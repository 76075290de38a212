package reliability

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/proxy"
)

// Restarts: the multi-turn proxy loses its conversation cache; an engine comes back as a new
// incarnation with the same engine_id (and the same side-channel port, as a restarted
// `kvbridge serve` with a fixed VLLM_NIXL_SIDE_CHANNEL_PORT would).

// conversation drives one multi-turn chat through the proxy and checks every answer against the
// single engine given the same messages.
type conversation struct {
	id   string
	msgs []map[string]any
	seed int
}

// turn sends the next user message and returns the reply (the answer joins the history).
func (c *conversation) turn(t *testing.T, s *stack, text string, wantCache string) reply {
	t.Helper()
	c.msgs = append(c.msgs, user(text))
	body := chat(c.msgs, 12, append(sampled(c.seed+len(c.msgs)), "conversation_id", c.id)...)
	r := post(t, s.hc, s.px.URL+"/v1/chat/completions", "", body)
	want := s.ref.answer(t, "/v1/chat/completions", body)
	if r.status != 200 || r.text != want {
		t.Fatalf("conversation %s, turn %d: %d %q (%s); the single engine says %q", c.id, len(c.msgs)/2+1, r.status, r.text, r.raw, want)
	}
	if got := r.header.Get(proxy.HeaderCache); wantCache != "" && got != wantCache {
		t.Errorf("conversation %s, turn %d: %s = %q, want %q", c.id, len(c.msgs)/2+1, proxy.HeaderCache, got, wantCache)
	}
	c.msgs = append(c.msgs, assistant(r.text))
	return r
}

// TestProxyRestart: the multi-turn proxy restarts between two turns and forgets the
// conversation: the next turn is a cache miss, computed in full, and right. D's blocks held for
// the forgotten turn return when the decoder TTL passes.
func TestProxyRestart(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{bidirectional: true, dClock: true, policy: connector.PolicyFail})
	c := &conversation{id: "restart-proxy", seed: 60}
	c.turn(t, s, longPrompt(60), "miss")
	c.turn(t, s, "Tell me more about the blocks.", "hit")
	s.restartProxy(t)
	c.turn(t, s, "And after the restart?", "miss")
	s.p.waitPoolFull(t)
	s.d.clock.advance(t, 481*time.Second) // decoder_kv_blocks_ttl
	s.d.waitPoolFull(t)
	waitMetric(t, s.hc, s.d.URL, "kvbridge:decoder_holds_expired_total", 2)
	if got := metric(t, s.hc, s.d.URL, "vllm:nixl_num_kv_expired_reqs_total"); got != 0 {
		t.Errorf("D counted %v expired KV requests: holds that aged out are not P's lease expiries", got)
	}
}

// TestEngineRestartSameEngineID: P restarts with the same engine_id and side-channel port (a
// new incarnation of its transfer agent). The next request must handshake with the new
// incarnation and succeed, as the first request to any engine does (policy fail, so that a
// failed load shows). On both transfer backends.
func TestEngineRestartSameEngineID(t *testing.T) {
	t.Parallel()
	for _, backend := range []string{"SHM", "TCP"} {
		t.Run(backend, func(t *testing.T) {
			leakCheck(t)
			s := startStack(t, stackOptions{policy: connector.PolicyFail, pEngineID: "prefill-0", fixedPorts: true, backends: []string{backend}})
			s.askOK(t, longPrompt(61), 61)
			s.restartP(t)
			s.askOK(t, longPrompt(62), 62)
			s.askOK(t, longPrompt(63), 63)
			s.p.waitPoolFull(t)
			s.d.waitPoolFull(t)
		})
	}
}

// TestOldIncarnationParamsFail: params P issued before its restart name blocks of the old
// incarnation. After the restart the new incarnation has reused the same block ids (with the
// same generations, which restart from zero) for another prompt. A decoder given the old params
// must fail the load with a clear error (500 under fail) — never read the new incarnation's
// blocks and answer with another prompt's KV. On both transfer backends.
func TestOldIncarnationParamsFail(t *testing.T) {
	t.Parallel()
	for _, backend := range []string{"SHM", "TCP"} {
		t.Run(backend, func(t *testing.T) {
			leakCheck(t)
			s := startStack(t, stackOptions{policy: connector.PolicyFail, pEngineID: "prefill-0", fixedPorts: true, pClock: true, backends: []string{backend}})
			prefill := func(prompt string) map[string]any {
				t.Helper()
				r := post(t, s.hc, s.p.URL+"/v1/completions", "", completion(prompt, 1, "kv_transfer_params", map[string]any{"do_remote_decode": true}))
				if r.status != 200 || r.kv == nil {
					t.Fatalf("prefill: %d %s", r.status, r.raw)
				}
				return r.kv
			}
			x, y := longPrompt(64), longPrompt(65)
			old := prefill(x)
			s.restartP(t)
			fresh := prefill(y)
			if fmt.Sprint(fresh["remote_block_ids"]) != fmt.Sprint(old["remote_block_ids"]) ||
				fmt.Sprint(fresh[connector.KeyBlockGenerations]) != fmt.Sprint(old[connector.KeyBlockGenerations]) {
				t.Fatalf("the setup needs the new incarnation to reuse the old blocks and generations: old %v %v, new %v %v",
					old["remote_block_ids"], old[connector.KeyBlockGenerations], fresh["remote_block_ids"], fresh[connector.KeyBlockGenerations])
			}
			body := completion(x, 12, sampled(64)...)
			r := post(t, s.hc, s.d.URL+"/v1/completions", "", withBody(body, "kv_transfer_params", old))
			if want := s.ref.answer(t, "/v1/completions", body); r.status == 200 && r.text != want {
				wrongKV := s.ref.answer(t, "/v1/completions", completion(y, 12, sampled(64)...))
				t.Fatalf("old-incarnation params answered 200 with the wrong text %q (the right one is %q; the other prompt's is %q): D read the new incarnation's blocks",
					r.text, want, wrongKV)
			}
			s.wantPolicyOutcome(t, r, body)
			waitMetric(t, s.hc, s.d.URL, "vllm:nixl_num_failed_transfers_total", 1)
			s.d.waitPoolFull(t)
			s.expireP(t)
		})
	}
}

// TestDecoderRestartBidirectional: D restarts (same engine_id and side-channel port) between
// two turns of a conversation whose KV the proxy believes D holds; meanwhile another
// conversation's first turn fills the new incarnation's blocks. The next turn's pull from D
// must not use the other conversation's KV: under recompute the answer is right. On both
// transfer backends.
func TestDecoderRestartBidirectional(t *testing.T) {
	t.Parallel()
	for _, backend := range []string{"SHM", "TCP"} {
		t.Run(backend, func(t *testing.T) {
			leakCheck(t)
			s := startStack(t, stackOptions{bidirectional: true, dClock: true, policy: connector.PolicyRecompute, dEngineID: "decode-0",
				fixedPorts: true, backends: []string{backend}})
			a := &conversation{id: "a", seed: 70}
			a.turn(t, s, longPrompt(70), "miss")
			s.restartD(t)
			b := &conversation{id: "b", seed: 80}
			b.turn(t, s, longPrompt(80)+" and a little more so that it is not shorter", "miss")
			a.turn(t, s, "Go on.", "hit")
			s.p.waitPoolFull(t)
			s.d.clock.advance(t, 481*time.Second)
			s.d.waitPoolFull(t)
		})
	}
}

// TestProducerRestartsReleaseMappings: over SHM a consumer maps its producer's KV arena. When
// the producer restarts, the consumer must let go of the dead incarnation's mapping — else every
// restart of P costs D the size of P's KV cache, for good. D is a child process, so that its
// memory map is its own; P restarts three times and D reads from each incarnation.
func TestProducerRestartsReleaseMappings(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	k := startKillStack(t, killOptions{policy: connector.PolicyRecompute, pRestartable: true})
	arenas := func() int {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", k.dc.cmd.Process.Pid))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, line := range strings.Split(string(data), "\n") {
			if strings.Contains(line, "memfd:") && strings.Contains(line, "kvcache") {
				n++
			}
		}
		return n
	}
	k.askOK(t, longPrompt(90), 90)
	base := arenas() // D's own arena and P's first one

	for i := range 3 {
		k.restartP(t)
		k.askOK(t, longPrompt(91+2*i), 91) // may recompute: D still knew the old incarnation
		k.askOK(t, longPrompt(92+2*i), 92) // reads from the new incarnation
	}
	eventually(t, "D to unmap the arenas of P's dead incarnations", func() bool { return arenas() <= base },
		func() string {
			return fmt.Sprintf("D maps %d kvcache arenas, %d before P restarted three times", arenas(), base)
		})
}
