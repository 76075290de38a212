package connector_test

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/transfer"
	"github.com/vmihailenco/msgpack/v5"
	"maps"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

// pushCfg is a NixlPushConnector config of role with the transfer backends (nil: automatic).
func pushCfg(role string, backends ...string) string {
	extra := ""
	if len(backends) > 0 {
		extra = fmt.Sprintf(`,"kv_connector_extra_config":{"backends":["%s"]}`, strings.Join(backends, `","`))
	}
	return fmt.Sprintf(`{"kv_connector":"NixlPushConnector","kv_role":"%s"%s}`, role, extra)
}

// pushDecodeParams are what vLLM's toy push proxy sends D from P's answer: P's coordinates, no
// remote_block_ids.
func pushDecodeParams(pkv map[string]any) map[string]any {
	out := map[string]any{"do_remote_prefill": true, "do_remote_decode": false}
	for _, k := range []string{"remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"} {
		out[k] = pkv[k]
	}
	return out
}

// pushSerial runs the serial flow (vLLM's toy push proxy): P first, then D with P's coordinates.
func pushSerial(t *testing.T, p, d *node, prompt []int, maxTokens int) result {
	t.Helper()
	pkv := prefill(t, p, prompt)
	if pkv["transfer_mode"] != "push" {
		t.Fatalf("P's params carry transfer_mode %v, want push", pkv["transfer_mode"])
	}
	status, r := decode(t, d, prompt, pushDecodeParams(pkv), maxTokens)
	if status != 200 {
		t.Fatalf("decode: %d %s", status, r.Raw)
	}
	return r
}

// newPushID draws a rendezvous id as a proxy would.
func newPushID(t *testing.T) string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b[:])
}

// pushConcurrent runs both legs at once (pushBothLegs) for prompt: P's leg as a proxy sends it
// (max_tokens 1), D's greedy for maxTokens tokens.
func pushConcurrent(t *testing.T, p, d *node, prompt []int, maxTokens int) result {
	t.Helper()
	return pushBothLegs(t, p, d,
		map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1},
		map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": maxTokens, "temperature": 0})
}

// pushedBytes returns the bytes P wrote since the last call.
func pushedBytes(n *node) int64 {
	var b int64
	for _, s := range n.em.Nixl().TakeInterval().Transfers {
		b += s.Bytes
	}
	return b
}

// waitPushed returns the bytes P wrote since the last call, waiting until they are at least want:
// P records its write after the completion reached D, so D may answer first.
func waitPushed(t *testing.T, n *node, want int64) int64 {
	t.Helper()
	var got int64
	eventually(t, fmt.Sprintf("P to record %d bytes written", want), func() bool {
		got += pushedBytes(n)
		return got >= want
	})
	return got
}

// TestPushMatchesSingleEngine: push P/D answers exactly as a single engine, over SHM and TCP, in
// the serial flow (vLLM's toy push proxy) and with both legs at once (push_id); D registers only
// the blocks its prefix cache lacks and P writes only those (vllm#48758); every pool is full
// again afterwards.
func TestPushMatchesSingleEngine(t *testing.T) {
	for _, backend := range []string{"SHM", "TCP"} {
		t.Run(backend, func(t *testing.T) {
			p := startNode(t, "P", nodeOptions{kvConfig: pushCfg("kv_producer", backend)})
			d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer", backend), prefix: true})
			if info := d.conn.Info(); info.TransferMode != "push" || info.Connector != "NixlPushConnector" {
				t.Fatalf("D reports %+v", info)
			}
			bb := int64(d.pool.BlockBytes())
			for i, flow := range []struct {
				name string
				run  func(*testing.T, *node, *node, []int, int) result
			}{{"serial", pushSerial}, {"concurrent", pushConcurrent}} {
				for _, n := range []int{5, 70, 200} {
					prompt := tokens(n, 31*i+n)
					want := singleOutput(t, prompt, 6)
					pushedBytes(p)
					r := flow.run(t, p, d, prompt, 6)
					if r.Text != want {
						t.Errorf("%s, %d tokens: D answered %q, a single engine %q", flow.name, n, r.Text, want)
					}
					blocks := int64((n + 15) / 16)
					if got := waitPushed(t, p, blocks*bb); got != blocks*bb {
						t.Errorf("%s, %d tokens: P wrote %d bytes, want %d blocks (%d)", flow.name, n, got, blocks, blocks*bb)
					}
					if got := external(r); got != n-1 {
						t.Errorf("%s, %d tokens: %d tokens came from P, want %d (the last one is recomputed)", flow.name, n, got, n-1)
					}
					// The same prompt again: D's prefix cache holds its full blocks, so it
					// registers only the last, partial one, and P writes only that.
					r = flow.run(t, p, d, prompt, 6)
					if r.Text != want {
						t.Errorf("%s, %d tokens, again: D answered %q, want %q", flow.name, n, r.Text, want)
					}
					if wantB := int64(n%16+15) / 16 * bb; n <= 16 {
						waitPushed(t, p, blocks*bb)
					} else if got := waitPushed(t, p, wantB); got != wantB {
						t.Errorf("%s, %d tokens, again: P wrote %d bytes, want only the partial last block (%d)", flow.name, n, got, wantB)
					}
				}
			}
			p.waitPoolFull(t)
			d.waitPoolFull(t)
		})
	}
}

// TestPushModeMismatchIsAHandshakeError: a pull prefiller and a push decoder refuse each other at
// the handshake, naming both transfer modes; the request fails (policy fail) and no block leaks.
func TestPushModeMismatchIsAHandshakeError(t *testing.T) {
	var log fixture.LogBuffer
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg})
	d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer"), logw: &log})
	prompt := tokens(40, 3)
	kv := prefill(t, p, prompt)
	status, r := decode(t, d, prompt, maps.Clone(kv), 4)
	if status != 500 {
		t.Fatalf("status %d, want 500: %s", status, r.Raw)
	}
	if !strings.Contains(log.String(), "runs transfer_mode pull, this engine push") {
		t.Errorf("the handshake error does not name both modes: %s", log.String())
	}
	d.waitPoolFull(t)
}

// pushConfigWith is pushCfg of role with a failure policy and a lease duration in seconds.
func pushConfigWith(role, policy string, lease int) string {
	return fmt.Sprintf(`{"kv_connector":"NixlPushConnector","kv_role":"%s","kv_load_failure_policy":"%s","kv_connector_extra_config":{"kv_lease_duration":%d}}`, role, policy, lease)
}

// decodeOnly sends D only its leg of a concurrent push (the proxy dropped P's), in the background.
func decodeOnly(t *testing.T, p, d *node, prompt []int, maxTokens int) <-chan result {
	info := p.conn.Info()
	dkv := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": info.EngineID,
		"remote_host": info.RemoteHost, "remote_port": info.RemotePort, "tp_size": 1, "push_id": newPushID(t)}
	out := make(chan result, 1)
	go func() {
		status, r := decode(t, d, prompt, dkv, maxTokens)
		if status != 200 {
			r.FinishReason = fmt.Sprintf("status %d", status)
		}
		out <- r
	}()
	eventually(t, "P to park D's registration", func() bool { return p.conn.Info().PushParked == 1 })
	return out
}

// TestPushOneLegDropped: D's registration for a push_id whose request never reaches P waits at P
// (parked) and at D (its destination lease); at D's lease expiry D frees and recomputes
// (policy recompute), counting an expired request; P drops the parked registration at its own
// expiry and tells D, which no longer waits: "Unrecognized request", counted on both sides as a
// notification after expiry. Pools are full again.
//
// D counts P's late refusal once per notification vLLM's ranks would have sent, one per pair of
// P rank and D rank that the push's mapping uses (docs/architecture.md, "Notifications per
// remote rank"); the tiny model has 2 KV heads:
//
//   - P TP 1 → D TP 1: 1.
//   - P TP 2 → D TP 1: P rank 0 writes head 0 and P rank 1 head 1 into D's one rank, and each
//     notifies it: 2.
//   - P TP 1 → D TP 4: P's one rank writes head 0 into D ranks 0 and 1 and head 1 into D ranks
//     2 and 3, notifying each: 4.
//
// P never handshook D (the registration waited for a request that did not come), so it counts
// its own late refusal once.
func TestPushOneLegDropped(t *testing.T) {
	for _, tc := range []struct{ pTP, dTP, want int }{{1, 1, 1}, {2, 1, 2}, {1, 4, 4}} {
		t.Run(fmt.Sprintf("P TP %d → D TP %d", tc.pTP, tc.dTP), func(t *testing.T) { pushOneLegDropped(t, tc.pTP, tc.dTP, tc.want) })
	}
}

func pushOneLegDropped(t *testing.T, pTP, dTP, wantD int) {
	var dlog fixture.LogBuffer
	pclock, dclock := newFakeClock(), newFakeClock()
	ptick, dtick := make(chan time.Time), make(chan time.Time)
	p := startNode(t, "P", nodeOptions{kvConfig: pushConfigWith("kv_producer", "fail", 30), now: pclock.Now, tick: ptick, tp: pTP})
	d := startNode(t, "D", nodeOptions{kvConfig: pushConfigWith("kv_consumer", "recompute", 30), now: dclock.Now, tick: dtick, logw: &dlog, tp: dTP})
	prompt := tokens(50, 9)
	want := singleOutput(t, prompt, 5)
	got := decodeOnly(t, p, d, prompt, 5)
	dclock.Advance(31 * time.Second)
	dtick <- time.Time{}
	if r := <-got; r.Text != want {
		t.Fatalf("D answered %q (%s), want the single engine's %q", r.Text, r.FinishReason, want)
	}
	d.waitPoolFull(t)
	pclock.Advance(31 * time.Second)
	ptick <- time.Time{}
	const afterExpiry = "vllm:nixl_num_notifications_after_expiry_total"
	eventually(t, "P to drop the parked registration", func() bool { return p.conn.Info().PushParked == 0 })
	eventually(t, "D to count P's late refusal", func() bool {
		return fixture.Scrape(t, http.DefaultClient, d.srv.URL).Sum(afterExpiry) == float64(wantD)
	})
	pm, dm := fixture.Scrape(t, http.DefaultClient, p.srv.URL), fixture.Scrape(t, http.DefaultClient, d.srv.URL)
	if pm.Sum(afterExpiry) != 1 || dm.Sum("vllm:nixl_num_kv_expired_reqs_total") != 1 {
		t.Errorf("P counted %v notifications after expiry, D %v expired requests; want 1 each",
			pm.Sum(afterExpiry), dm.Sum("vllm:nixl_num_kv_expired_reqs_total"))
	}
	if got := dm.Sum(afterExpiry); got != float64(wantD) {
		t.Errorf("D counted %v notifications after expiry, want %d", got, wantD)
	}
	if !strings.Contains(dlog.String(), "Unrecognized request") {
		t.Errorf("D logged no \"Unrecognized request\": %s", dlog.String())
	}
	p.waitPoolFull(t)
}

// TestPushProducerGoneFailsAtOnce: P's transfer agent goes away while D waits for its push; D
// fails the request at once (policy fail: HTTP 500), without waiting for its lease (D's clock
// never moves), and frees its blocks.
func TestPushProducerGoneFailsAtOnce(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: pushConfigWith("kv_producer", "fail", 30)})
	clock := newFakeClock()
	d := startNode(t, "D", nodeOptions{kvConfig: pushConfigWith("kv_consumer", "fail", 30), now: clock.Now, tick: make(chan time.Time)})
	got := decodeOnly(t, p, d, tokens(40, 4), 4)
	if err := p.conn.Close(); err != nil {
		t.Fatal(err)
	}
	if r := <-got; r.FinishReason != "status 500" {
		t.Fatalf("D answered %q (%s), want a 500", r.Text, r.FinishReason)
	}
	d.waitPoolFull(t)
	if got := fixture.Scrape(t, http.DefaultClient, d.srv.URL).Sum("vllm:nixl_num_failed_transfers_total"); got != 1 {
		t.Errorf("D counted %v failed transfers, want 1", got)
	}
}

// TestPushRefusesAnotherPrompt: D's registration for P's request with another prompt (copied
// params) is refused by P, which tells D at once: D fails that request (policy fail, its clock
// never moves) and P keeps the blocks for the right reader, which then gets them — never KV of
// another prompt, and no block leaks.
func TestPushRefusesAnotherPrompt(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: pushConfigWith("kv_producer", "fail", 30)})
	clock := newFakeClock()
	d := startNode(t, "D", nodeOptions{kvConfig: pushConfigWith("kv_consumer", "fail", 30), now: clock.Now, tick: make(chan time.Time)})
	prompt, other := tokens(40, 5), tokens(40, 6)
	kv := pushDecodeParams(prefill(t, p, prompt))
	if status, r := decode(t, d, other, kv, 4); status != 500 {
		t.Fatalf("another prompt with P's params: %d %s, want 500", status, r.Raw)
	}
	if n := p.conn.AuthRefusals().Notifications; n != 1 {
		t.Errorf("P counted %d refused registrations, want 1", n)
	}
	status, r := decode(t, d, prompt, kv, 4)
	if want := singleOutput(t, prompt, 4); status != 200 || r.Text != want {
		t.Fatalf("the right reader: %d %q, want %q", status, r.Text, want)
	}
	p.waitPoolFull(t)
	d.waitPoolFull(t)
}

// TestPushWithoutRegistrationExpires: a push P whose decoder never registers (the proxy dropped
// D's leg) holds the blocks for kv_lease_duration, then frees them and counts an expired
// request.
func TestPushWithoutRegistrationExpires(t *testing.T) {
	clock := newFakeClock()
	tick := make(chan time.Time)
	p := startNode(t, "P", nodeOptions{kvConfig: pushConfigWith("kv_producer", "fail", 30), now: clock.Now, tick: tick})
	kv := template()
	kv["push_id"] = newPushID(t)
	if status, r := post(t, p.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": tokens(40, 2), "max_tokens": 1, "kv_transfer_params": kv}); status != 200 {
		t.Fatal(r.Raw)
	}
	if p.pool.NumFree() == p.pool.NumBlocks() {
		t.Fatal("P did not hold the blocks for the decoder")
	}
	clock.Advance(31 * time.Second)
	tick <- time.Time{}
	p.waitPoolFull(t)
	if got := fixture.Scrape(t, http.DefaultClient, p.srv.URL).Sum("vllm:nixl_num_kv_expired_reqs_total"); got != 1 {
		t.Errorf("vllm:nixl_num_kv_expired_reqs_total = %v, want 1", got)
	}
}

// TestPushDecoderGone: D's transfer agent goes away after it registered for a push_id: D's
// request fails at once (its connector closed), and P, whose request then finishes prefill,
// cannot write: it frees the blocks at once (P's clock never moves) instead of at lease expiry.
func TestPushDecoderGone(t *testing.T) {
	clock := newFakeClock()
	p := startNode(t, "P", nodeOptions{kvConfig: pushConfigWith("kv_producer", "fail", 30), now: clock.Now, tick: make(chan time.Time)})
	d := startNode(t, "D", nodeOptions{kvConfig: pushConfigWith("kv_consumer", "fail", 30)})
	prompt := tokens(40, 8)
	info := p.conn.Info()
	id := newPushID(t)
	dkv := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": info.EngineID,
		"remote_host": info.RemoteHost, "remote_port": info.RemotePort, "tp_size": 1, "push_id": id}
	got := make(chan int, 1)
	go func() {
		status, _ := decode(t, d, prompt, dkv, 4)
		got <- status
	}()
	eventually(t, "P to park D's registration", func() bool { return p.conn.Info().PushParked == 1 })
	if err := d.conn.Close(); err != nil {
		t.Fatal(err)
	}
	if status := <-got; status != 500 {
		t.Fatalf("D's request: %d, want 500", status)
	}
	kv := template()
	kv["push_id"] = id
	if status, r := post(t, p.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv}); status != 200 {
		t.Fatal(r.Raw)
	}
	p.waitPoolFull(t)
	// The handshake with D and the push failed (each counted), and so did telling D.
	m := fixture.Scrape(t, http.DefaultClient, p.srv.URL)
	if got, notes := m.Sum("vllm:nixl_num_failed_transfers_total"), m.Sum("vllm:nixl_num_failed_notifications_total"); got != 3 || notes != 1 {
		t.Errorf("P counted %v failed transfers and %v failed notifications, want 3 and 1", got, notes)
	}
	d.waitPoolFull(t)
}

// TestPushRegistrationFromAnotherAgent: an agent that is not D sends P a registration naming D's
// engine and blocks, for P's request and its prompt. P handshakes D, sees that D's agent did not
// send it, writes nothing, keeps the blocks, and the real D then gets them.
func TestPushRegistrationFromAnotherAgent(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: pushConfigWith("kv_producer", "fail", 30)})
	d := startNode(t, "D", nodeOptions{kvConfig: pushConfigWith("kv_consumer", "fail", 30)})
	prompt := tokens(40, 10)
	pkv := prefill(t, p, prompt)
	attacker, err := transfer.NewAgent("kvbridge-attacker", transfer.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer attacker.Close()
	peer, err := attacker.LoadRemote(p.conn.Agent().LocalMetadata())
	if err != nil {
		t.Fatal(err)
	}
	digest := sha256.New()
	for _, tok := range prompt {
		_ = binary.Write(digest, binary.LittleEndian, int32(tok))
	}
	reg, _ := msgpack.Marshal(map[string]any{
		"engine_id": d.conn.EngineID(), "instance": "", "host": "127.0.0.1", "port": d.conn.Info().RemotePort,
		"request_id": "victim", "remote_request_id": pkv["remote_request_id"], "nonce": make([]byte, 16),
		"first_block": 0, "block_ids": []int32{0, 1, 2}, "num_tokens": len(prompt), "prompt_digest": digest.Sum(nil),
		"expiry": 1e9, "remote_block_size": 16, "transfer_mode": "push",
	})
	pushedBytes(p)
	if err := attacker.SendNotif(t.Context(), peer, append([]byte("PUSH_REG:"), reg...)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "P to refuse the registration", func() bool { return p.conn.AuthRefusals().Notifications == 1 })
	if got := pushedBytes(p); got != 0 {
		t.Fatalf("P wrote %d bytes for a registration D did not send", got)
	}
	status, r := decode(t, d, prompt, pushDecodeParams(pkv), 4)
	if want := singleOutput(t, prompt, 4); status != 200 || r.Text != want {
		t.Fatalf("the real decoder: %d %q, want %q", status, r.Text, want)
	}
	p.waitPoolFull(t)
	d.waitPoolFull(t)
}

// TestPushWriteRefusedNotifiesAtOnce: a write P must not post — the decoder's blocks end within
// the margin — is refused and reported to D at once: D fails the request (policy fail: 500)
// although its own clock never reaches its deadline, and P frees its blocks and counts an
// expired request. D's clock is set back after its handshake, so its registration's deadline
// is two seconds away on P's clock.
func TestPushWriteRefusedNotifiesAtOnce(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: pushConfigWith("kv_producer", "fail", 30)})
	clock := newFakeClock()
	d := startNode(t, "D", nodeOptions{kvConfig: pushConfigWith("kv_consumer", "fail", 30), now: clock.Now, tick: make(chan time.Time)})
	first, second := tokens(30, 1), tokens(30, 2)
	if r := pushSerial(t, p, d, first, 3); r.Text != singleOutput(t, first, 3) {
		t.Fatalf("the first push answered %q", r.Text)
	}
	clock.Advance(-28 * time.Second)
	if status, r := decode(t, d, second, pushDecodeParams(prefill(t, p, second)), 3); status != 500 {
		t.Fatalf("status %d, want 500: %s", status, r.Raw)
	}
	p.waitPoolFull(t)
	d.waitPoolFull(t)
	if got := fixture.Scrape(t, http.DefaultClient, p.srv.URL).Sum("vllm:nixl_num_kv_expired_reqs_total"); got != 1 {
		t.Errorf("P counted %v expired requests, want 1", got)
	}
}

// TestPushConfigNeedsALongEnoughLease: push mode refuses a kv_lease_duration shorter than its
// write margin allows, naming the key.
func TestPushConfigNeedsALongEnoughLease(t *testing.T) {
	_, err := connector.ParseConfig([]byte(pushConfigWith("kv_consumer", "fail", 10)), nil)
	if !errors.Is(err, connector.ErrConfig) || !strings.Contains(err.Error(), "kv_lease_duration") {
		t.Fatalf("got %v", err)
	}
	for _, name := range []string{"NixlPullConnector", "NixlConnector", "NixlPushConnector"} {
		cfg, err := connector.ParseConfig([]byte(`{"kv_connector":"`+name+`","kv_role":"kv_producer"}`), nil)
		if err != nil || cfg.Connector != name || cfg.Push() != (name == "NixlPushConnector") {
			t.Errorf("%s: %+v, %v", name, cfg, err)
		}
	}
}

// TestPushBidirectional: with bidirectional_kv_xfer, push carries each turn's prompt P → D while
// the earlier turns come back D → P by pull, as in pull mode: turn 2's P pulls the history from
// D's hold (verified), computes the rest and pushes; D registers only what its prefix cache
// lacks. Both answers equal a single engine's; after D's holds expire every pool is full.
func TestPushBidirectional(t *testing.T) {
	cfg := func(role string) string {
		return fmt.Sprintf(`{"kv_connector":"NixlPushConnector","kv_role":%q,"kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_recompute_threshold":0}}`, role)
	}
	dclock := newFakeClock()
	dtick := make(chan time.Time)
	p := startNode(t, "P", nodeOptions{kvConfig: cfg("kv_producer")})
	d := startNode(t, "D", nodeOptions{kvConfig: cfg("kv_consumer"), prefix: true, now: dclock.Now, tick: dtick})
	first := tokens(100, 40)
	r := pushSerial(t, p, d, first, 20)
	if r.Text != singleOutput(t, first, 20) || r.KVParams == nil || r.KVParams["transfer_mode"] != "pull" {
		t.Fatalf("turn 1: %q, D's params %v", r.Text, r.KVParams)
	}
	answer := openModel(t, "kvbridge/tiny").Tokenizer().Encode(r.Text)
	next := append(append(append([]int(nil), first...), toInts(answer)...), tokens(10, 41)...)
	status, pr := prefillFromD(t, p, next, r.KVParams)
	if status != 200 || pr.KVParams["transfer_mode"] != "push" {
		t.Fatalf("turn 2 prefill: %d %s", status, pr.Raw)
	}
	if got := external(pr); got < 96 {
		t.Errorf("turn 2's P pulled %d tokens from D, want at least the first prompt's 6 full blocks (96)", got)
	}
	pushedBytes(p)
	status, r2 := decode(t, d, next, pushDecodeParams(pr.KVParams), 6)
	if want := singleOutput(t, next, 6); status != 200 || r2.Text != want {
		t.Fatalf("turn 2: %d %q, want %q", status, r2.Text, want)
	}
	// D's prefix cache holds turn 1's prompt and answer: it registered only the blocks after.
	if got, all := waitPushed(t, p, 1), int64((len(next)+15)/16*d.pool.BlockBytes()); got >= all-int64(6*d.pool.BlockBytes()) {
		t.Errorf("P wrote %d bytes of turn 2's %d: D registered blocks its prefix cache holds", got, all)
	}
	p.waitPoolFull(t)
	dclock.Advance(481 * time.Second)
	dtick <- dclock.Now()
	d.waitPoolFull(t)
}

// TestPushWritesOnlyIntoRegisteredBlocks: a push decoder's KV region accepts WRITEs, but over TCP
// only into blocks a waiting request registered with the writing agent: another agent's WRITE
// into D's blocks is refused (ErrPermission) and counted, and D's answers stay right.
func TestPushWritesOnlyIntoRegisteredBlocks(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: pushCfg("kv_producer", "TCP")})
	d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer", "TCP")})
	attacker, err := transfer.NewAgent("kvbridge-attacker", transfer.Config{Backends: []string{"TCP"}})
	if err != nil {
		t.Fatal(err)
	}
	defer attacker.Close()
	peer, err := attacker.LoadRemote(d.conn.Agent().LocalMetadata())
	if err != nil {
		t.Fatal(err)
	}
	junk := make([]byte, d.pool.BlockBytes())
	for i := range junk {
		junk[i] = 0x7f
	}
	src, err := attacker.RegisterBytes(junk, transfer.PermRead)
	if err != nil {
		t.Fatal(err)
	}
	refused := 0
	for region := uint32(0); region < 4; region++ {
		req, err := attacker.CreateRequest(t.Context(), transfer.Write, []transfer.Desc{src.Desc(0, int64(len(junk)))}, peer,
			[]transfer.Desc{{Region: region, Offset: 0, Length: int64(len(junk))}}, &transfer.RequestOptions{Backends: []string{"TCP"}})
		if err != nil {
			continue // no such region, or not writable
		}
		if err = req.Post(t.Context(), nil); err == nil {
			err = req.Wait(t.Context())
		}
		req.Release()
		if err == nil {
			t.Fatalf("a WRITE into D's region %d succeeded over %s", region, req.Backend())
		}
		if errors.Is(err, transfer.ErrPermission) {
			refused++
		}
	}
	if st := d.conn.Agent().Stats(); refused != 1 || st.WritesDenied != 1 {
		t.Fatalf("%d WRITEs refused for their permission, D denied %d; want the KV region's one", refused, st.WritesDenied)
	}
	prompt := tokens(40, 12)
	if r := pushSerial(t, p, d, prompt, 4); r.Text != singleOutput(t, prompt, 4) {
		t.Fatalf("D answered %q after the attack", r.Text)
	}
	p.waitPoolFull(t)
	d.waitPoolFull(t)
}

// TestPushLayerwise: over SHM and TCP, with push_layerwise on P and D's registration parked
// before P's prefill starts, P writes each layer of each prefill chunk as soon as it is computed (three chunks of
// 256 tokens: three writes per layer, no whole write at the end), and D's answer is a single
// engine's. Every pool is full at the end. Into a decoder at TP 2 or 4, each layer's write is
// one per D rank, of the heads that rank holds (at TP 4 the 2 KV heads are replicated: twice
// the bytes).
func TestPushLayerwise(t *testing.T) {
	for _, backend := range []string{"SHM", "TCP"} {
		for _, dTP := range []int{1, 2, 4} {
			t.Run(fmt.Sprintf("%s D TP %d", backend, dTP), func(t *testing.T) { pushLayerwise(t, backend, dTP) })
		}
	}
}

func pushLayerwise(t *testing.T, backend string, dTP int) {
	p := startNode(t, "P", nodeOptions{kvConfig: `{"kv_connector":"NixlPushConnector","kv_role":"kv_producer","kv_connector_extra_config":{"push_layerwise":true,"backends":["` + backend + `"]}}`})
	d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer", backend), tp: dTP})
	prompt := tokens(700, 50)
	// Seeded sampling at temperature 1 with logprobs: any wrong KV shows in the answer.
	ask := func(url string, kv map[string]any) (int, result) {
		return post(t, url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 8, "temperature": 1, "seed": 3,
			"logprobs": 2, "kv_transfer_params": kv})
	}
	single := startNode(t, "single", nodeOptions{})
	_, ref := ask(single.srv.URL, nil)
	want := ref.Raw[strings.Index(ref.Raw, `"choices"`):strings.Index(ref.Raw, `"usage"`)]
	info := p.conn.Info()
	id := newPushID(t)
	dkv := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": info.EngineID,
		"remote_host": info.RemoteHost, "remote_port": info.RemotePort, "tp_size": 1, "push_id": id}
	got := make(chan result, 1)
	go func() {
		status, r := ask(d.srv.URL, dkv)
		if status != 200 {
			r.Raw = fmt.Sprintf("status %d: %s", status, r.Raw)
		}
		got <- r
	}()
	eventually(t, "P to park D's registration", func() bool { return p.conn.Info().PushParked == 1 })
	p.em.Nixl().TakeInterval()
	kv := template()
	kv["push_id"] = id
	if status, r := post(t, p.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv}); status != 200 {
		t.Fatal(r.Raw)
	}
	if r := <-got; !strings.Contains(r.Raw, want) {
		t.Fatalf("D answered %s\na single engine %s", r.Raw, want)
	}
	layers := p.pool.Geometry().NumLayers
	var writes int
	var bytes int64
	blocks := int64(700+15) / 16
	// P (TP 1) holds every KV head; D's ranks hold dTP × their heads per rank in all.
	copies := int64(dTP * d.pool.Geometry().NumKVHeads / p.pool.Geometry().NumKVHeads)
	eventually(t, "P to record its writes", func() bool {
		for _, s := range p.em.Nixl().TakeInterval().Transfers {
			writes, bytes = writes+1, bytes+s.Bytes
		}
		return bytes >= copies*blocks*int64(p.pool.BlockBytes())
	})
	// Into D at TP 1, each chunk's layers go in one WRITE or several (layers queued behind a
	// busy writer are written together), never more than one per layer; into another TP size,
	// one per layer and D rank.
	minWrites, maxWrites := 3, 3*layers
	if dTP > 1 {
		minWrites, maxWrites = 3*layers*dTP, 3*layers*dTP
	}
	if writes < minWrites || writes > maxWrites || bytes != copies*blocks*int64(p.pool.BlockBytes()) {
		t.Errorf("P made %d writes of %d bytes; want %d to %d (3 chunks × %d layers × %d D ranks) of %d blocks × %d in all", writes, bytes, minWrites, maxWrites, layers, dTP, blocks, copies)
	}
	p.waitPoolFull(t)
	d.waitPoolFull(t)
}

// TestPushLayerwiseCatchesUp: a stream that starts after part of the registered KV was computed
// first writes that part. P's prefix cache holds most of the prompt (an earlier request), so its
// prefill starts past D's first registered block: P writes the cached blocks in one catch-up
// WRITE, then the computed chunk layer by layer — each block once — and D's answer is still a
// single engine's.
func TestPushLayerwiseCatchesUp(t *testing.T) {
	p := startNode(t, "P", nodeOptions{prefix: true, kvConfig: `{"kv_connector":"NixlPushConnector","kv_role":"kv_producer","kv_connector_extra_config":{"push_layerwise":true}}`})
	d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer")})
	prompt := tokens(300, 51)
	want := singleOutput(t, prompt, 5)
	if r := pushSerial(t, p, d, prompt, 5); r.Text != want {
		t.Fatalf("first request: %q, want %q", r.Text, want)
	}
	p.waitPoolFull(t) // its blocks are in P's prefix cache now
	p.em.Nixl().TakeInterval()
	info := p.conn.Info()
	id := newPushID(t)
	got := postAsync(t, d.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
		"kv_transfer_params": map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": info.EngineID,
			"remote_host": info.RemoteHost, "remote_port": info.RemotePort, "tp_size": 1, "push_id": id}})
	eventually(t, "P to park D's registration", func() bool { return p.conn.Info().PushParked == 1 })
	kv := template()
	kv["push_id"] = id
	if status, r := post(t, p.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv}); status != 200 {
		t.Fatal(r.Raw)
	}
	if r := <-got; r.Text != want {
		t.Fatalf("D answered %q, want %q", r.Text, want)
	}
	blocks := int64(300+15) / 16
	writes, bytes := waitWrites(t, p, blocks*int64(p.pool.BlockBytes()))
	// Whole, the request would be one WRITE: the catch-up and the chunk's layers are two or more.
	if writes < 2 || bytes != blocks*int64(p.pool.BlockBytes()) {
		t.Errorf("P made %d writes of %d bytes; want at least 2 (the cached blocks, then the computed chunk) of %d blocks", writes, bytes, blocks)
	}
	d.waitPoolFull(t)
}

// TestPushLayerwiseLateRegistration: with both legs sent at once, D's registration usually
// reaches P after P's prefill started. P then streams from the next layer on, first writing what
// it computed before (the chunk's finished layers, and the blocks of earlier chunks). P's step is
// held after its first layer until D's registration is parked here: in the prompt's first chunk,
// and in its second (the first chunk then went unstreamed). P writes every block once, in more
// WRITEs than the one a request written whole at its end takes, and D answers as a single engine.
func TestPushLayerwiseLateRegistration(t *testing.T) {
	for _, step := range []int{1, 2} {
		t.Run(fmt.Sprintf("registered during chunk %d", step), func(t *testing.T) {
			held, registered := make(chan struct{}), make(chan struct{})
			release := sync.OnceFunc(func() { close(registered) })
			hook := func(s, layer int) {
				if s == step && layer == 0 {
					close(held)
					select {
					case <-registered:
					case <-time.After(time.Minute): // the test has failed; let the engine go on
					}
				}
			}
			p := startNode(t, "P", nodeOptions{model: model.Small, layerHook: hook, kvConfig: `{"kv_connector":"NixlPushConnector","kv_role":"kv_producer","kv_connector_extra_config":{"push_layerwise":true}}`})
			d := startNode(t, "D", nodeOptions{model: model.Small, kvConfig: pushCfg("kv_consumer")})
			single := startNode(t, "single", nodeOptions{model: model.Small})
			t.Cleanup(release)        // before the nodes close: a held step loop would keep P from closing
			prompt := tokens(300, 53) // chunks of 256 and 44 tokens
			body := func(maxTokens int) map[string]any {
				return map[string]any{"model": "kvbridge/small", "prompt": prompt, "max_tokens": maxTokens, "temperature": 1, "seed": 8}
			}
			_, want := post(t, single.srv.URL+"/v1/completions", body(6))
			p.em.Nixl().TakeInterval()
			info := p.conn.Info()
			id := newPushID(t)
			pbody, dbody := body(1), body(6)
			pkv := template()
			pkv["push_id"] = id
			pbody["kv_transfer_params"] = pkv
			dbody["kv_transfer_params"] = map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": info.EngineID,
				"remote_host": info.RemoteHost, "remote_port": info.RemotePort, "tp_size": 1, "push_id": id}
			pleg := postAsync(t, p.srv.URL+"/v1/completions", pbody)
			select {
			case <-held:
			case <-time.After(time.Minute):
				t.Fatal("P's prefill did not start streaming steps")
			}
			got := postAsync(t, d.srv.URL+"/v1/completions", dbody)
			eventually(t, "P to park D's registration", func() bool { return p.conn.Info().PushParked == 1 })
			release()
			if a := <-pleg; a.status != 200 {
				t.Fatalf("prefill leg: %s", a.Text)
			}
			if r := <-got; r.Text != want.Text {
				t.Fatalf("D answered %q, a single engine %q", r.Text, want.Text)
			}
			blocks := int64(300+15) / 16
			writes, bytes := waitWrites(t, p, blocks*int64(p.pool.BlockBytes()))
			if writes < 2 || bytes != blocks*int64(p.pool.BlockBytes()) {
				t.Errorf("P made %d writes of %d bytes; want at least 2 (streamed) of %d blocks once each", writes, bytes, blocks)
			}
			p.waitPoolFull(t)
			d.waitPoolFull(t)
		})
	}
}

// posted is an HTTP status and the result read from its body.
type posted struct {
	status int
	result
}

// postAsync posts body to url from a goroutine of its own and delivers the answer; an answer
// other than 200 comes with its Text set to "status N: " and the raw body, so that comparing
// texts shows it.
func postAsync(t *testing.T, url string, body map[string]any) <-chan posted {
	got := make(chan posted, 1)
	go func() {
		status, r := post(t, url, body)
		if status != 200 {
			r.Text = fmt.Sprintf("status %d: %s", status, r.Raw)
		}
		got <- posted{status, r}
	}()
	return got
}

// waitWrites returns how many writes P recorded since the last interval was taken and their
// bytes, waiting until the bytes reach want.
func waitWrites(t *testing.T, p *node, want int64) (writes int, bytes int64) {
	t.Helper()
	eventually(t, "P to record its writes", func() bool {
		for _, s := range p.em.Nixl().TakeInterval().Transfers {
			writes, bytes = writes+1, bytes+s.Bytes
		}
		return bytes >= want
	})
	return writes, bytes
}

// TestPushLayerwiseGroupsLayers: with a model of 8 layers, a layer-by-layer push writes each
// prefill chunk that another chunk follows in groups of layers (at most streamWrites WRITEs per
// such chunk) and the prompt's last chunk layer by layer; the bytes are the prompt's blocks once
// each, and D answers as a single engine.
func TestPushLayerwiseGroupsLayers(t *testing.T) {
	p := startNode(t, "P", nodeOptions{model: model.Small, kvConfig: `{"kv_connector":"NixlPushConnector","kv_role":"kv_producer","kv_connector_extra_config":{"push_layerwise":true}}`})
	d := startNode(t, "D", nodeOptions{model: model.Small, kvConfig: pushCfg("kv_consumer")})
	single := startNode(t, "single", nodeOptions{model: model.Small})
	prompt := tokens(300, 52) // chunks of 256 and 44 tokens
	body := func(maxTokens int) map[string]any {
		return map[string]any{"model": "kvbridge/small", "prompt": prompt, "max_tokens": maxTokens, "temperature": 1, "seed": 8}
	}
	_, want := post(t, single.srv.URL+"/v1/completions", body(6))
	info := p.conn.Info()
	id := newPushID(t)
	dbody := body(6)
	dbody["kv_transfer_params"] = map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": info.EngineID,
		"remote_host": info.RemoteHost, "remote_port": info.RemotePort, "tp_size": 1, "push_id": id}
	got := postAsync(t, d.srv.URL+"/v1/completions", dbody)
	eventually(t, "P to park D's registration", func() bool { return p.conn.Info().PushParked == 1 })
	p.em.Nixl().TakeInterval()
	pbody := body(1)
	kv := template()
	kv["push_id"] = id
	pbody["kv_transfer_params"] = kv
	if status, r := post(t, p.srv.URL+"/v1/completions", pbody); status != 200 {
		t.Fatal(r.Raw)
	}
	if r := <-got; r.Text != want.Text {
		t.Fatalf("D answered %q, a single engine %q", r.Text, want.Text)
	}
	layers := p.pool.Geometry().NumLayers
	blocks := int64(300+15) / 16
	var writes int
	var bytes int64
	eventually(t, "P to record its writes", func() bool {
		for _, s := range p.em.Nixl().TakeInterval().Transfers {
			writes, bytes = writes+1, bytes+s.Bytes
		}
		return bytes >= blocks*int64(p.pool.BlockBytes())
	})
	if maxWrites := 2 + layers; writes < 2 || writes > maxWrites || bytes != blocks*int64(p.pool.BlockBytes()) {
		t.Errorf("P made %d writes of %d bytes; want 2 to %d (the first chunk in 2 groups of layers, the last layer by layer) of %d blocks", writes, bytes, maxWrites, blocks)
	}
	p.waitPoolFull(t)
	d.waitPoolFull(t)
}
