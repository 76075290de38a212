package connector_test

import (
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
)

// The params an HTTP client hands an engine are untrusted: these tests forge them, the way
// anyone who reaches an engine's port can, and check that no other request's answer changes.
// reliability/adversarial_test.go repeats the attacks against real processes and the proxies.

// The answers compared here are sampled at temperature 1 with a fixed seed: the tiny random
// model's greedy output hardly depends on its context, a sampled one depends on every logit, so
// wrong KV shows.

// ask sends prompt to n (with params unless nil) with seeded sampling.
func ask(t *testing.T, n *node, prompt []int, params map[string]any) (int, result) {
	t.Helper()
	body := map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 7}
	if params != nil {
		body["kv_transfer_params"] = params
	}
	return post(t, n.srv.URL+"/v1/completions", body)
}

// reference is the single engine's sampled answer to prompt.
func reference(t *testing.T, prompt []int) string {
	t.Helper()
	status, r := ask(t, startNode(t, "single", nodeOptions{}), prompt, nil)
	if status != 200 {
		t.Fatal(r.Raw)
	}
	return r.Text
}

// policyCfg returns a consumer (or producer) config with a load-failure policy and extra keys.
func policyCfg(role, policy, extra string) string {
	return fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":%q,"kv_load_failure_policy":%q,"kv_connector_extra_config":{%s}}`, role, policy, extra)
}

// TestForgedParamsNeverPoisonD: D is sent prompt X with the params P issued for another prompt
// Y, over both backends. D reads Y's blocks, sees that their records are not X's, and uses
// nothing: policy fail answers 500, recompute the right text; either way D's prefix cache never
// holds Y's KV under X's hashes — a later plain request for X gets the single engine's answer.
// Params with a block id twice are refused before any read.
func TestForgedParamsNeverPoisonD(t *testing.T) {
	for _, backend := range []string{"SHM", "TCP"} {
		for _, policy := range []string{"fail", "recompute"} {
			t.Run(backend+"/"+policy, func(t *testing.T) {
				extra := `"backends":["` + backend + `"]`
				p := startNode(t, "P", nodeOptions{kvConfig: policyCfg("kv_producer", policy, extra)})
				d := startNode(t, "D", nodeOptions{kvConfig: policyCfg("kv_consumer", policy, extra), prefix: true})
				x, y := tokens(40, 31), tokens(40, 32)
				status, r := ask(t, d, x, prefill(t, p, y))
				want := reference(t, x)
				switch {
				case policy == "fail" && status != 500:
					t.Fatalf("X with Y's params under fail: %d %s, want 500", status, r.Raw)
				case policy == "recompute" && (status != 200 || r.Text != want):
					t.Fatalf("X with Y's params under recompute: %d %q, want %q", status, r.Text, want)
				}
				if got := d.conn.AuthRefusals().Verification; got != 1 {
					t.Errorf("D counted %d verification refusals, want 1", got)
				}
				if status, r := ask(t, d, x, nil); status != 200 || r.Text != want {
					t.Fatalf("X afterwards on D: %d %q, want %q (D's prefix cache was poisoned)", status, r.Text, want)
				}
				// The same block named eight times: refused at parse, computed locally.
				kv := prefill(t, p, x)
				ids := kv["remote_block_ids"].([]any)[0].([]any)
				kv["remote_block_ids"] = []any{[]any{ids[0], ids[0], ids[0], ids[0], ids[0], ids[0], ids[0], ids[0]}}
				if status, r := ask(t, d, x, kv); status != 200 || r.Text != want || cachedTokens(r) != 32 {
					t.Fatalf("duplicated block ids: %d %q (cached %d), want %q from D's own cache", status, r.Text, cachedTokens(r), want)
				}
				if got := d.conn.AuthRefusals().Params; got != 1 {
					t.Errorf("D counted %d refused params, want 1", got)
				}
				d.waitPoolFull(t)
			})
		}
	}
}

// TestForgedLeaseToken: params whose lease token was made up — the right blocks, generations
// and slot of another request, but not its token — read nothing usable: over TCP the producer
// refuses the READ, over SHM the slot's tag does not match. The victim's own read is untouched.
func TestForgedLeaseToken(t *testing.T) {
	for _, backend := range []string{"SHM", "TCP"} {
		t.Run(backend, func(t *testing.T) {
			extra := `"backends":["` + backend + `"]`
			p := startNode(t, "P", nodeOptions{kvConfig: policyCfg("kv_producer", "fail", extra)})
			d := startNode(t, "D", nodeOptions{kvConfig: policyCfg("kv_consumer", "fail", extra)})
			prompt := tokens(40, 33)
			victim := prefill(t, p, prompt)
			forged := maps.Clone(victim)
			forged[connector.KeyLease] = strings.Repeat("ab", 16)
			if status, r := ask(t, d, prompt, forged); status != 500 {
				t.Fatalf("a forged token: %d %s, want 500", status, r.Raw)
			}
			if status, r := ask(t, d, prompt, victim); status != 200 || r.Text != reference(t, prompt) || cachedTokens(r) == 0 {
				t.Fatalf("the victim's read after the forgery: %d %s", status, r.Raw)
			}
			p.waitPoolFull(t)
		})
	}
}

// TestAllowedPeers: with allowed_peers, params naming another host are refused before any
// connection (D computes the prompt itself and counts the refusal); a listed host is pulled from.
func TestAllowedPeers(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg})
	prompt := tokens(40, 34)
	for _, tc := range []struct {
		allowed string
		pulled  bool
	}{
		{`"10.0.0.0/8","p.example"`, false},
		{`"127.0.0.0/8"`, true},
		{`"127.0.0.1"`, true},
	} {
		d := startNode(t, "D", nodeOptions{kvConfig: kvConfig("kv_consumer", `"allowed_peers":[`+tc.allowed+`]`)})
		status, r := ask(t, d, prompt, prefill(t, p, prompt))
		if status != 200 || r.Text != reference(t, prompt) || (cachedTokens(r) > 0) != tc.pulled {
			t.Fatalf("allowed_peers [%s]: %d cached %d %s", tc.allowed, status, cachedTokens(r), r.Raw)
		}
		if refused := d.conn.AuthRefusals().Params; (refused == 1) == tc.pulled {
			t.Errorf("allowed_peers [%s]: %d refused params", tc.allowed, refused)
		}
		if _, known := d.conn.Agent().Peer("kvbridge-" + p.conn.EngineID()); known != tc.pulled {
			t.Errorf("allowed_peers [%s]: D knows P's transfer agent: %v", tc.allowed, known)
		}
	}
	if _, err := connector.ParseConfig([]byte(kvConfig("kv_consumer", `"allowed_peers":["10.0.0.0/33"]`)), nil); err == nil || !strings.Contains(err.Error(), "allowed_peers") {
		t.Errorf("a bad prefix: %v", err)
	}
}

// TestDecoderHoldsEvictedUnderPressure: D's holds for next turns fill its pool; a new request
// does not wait for their 480 s TTL — the oldest holds are evicted (counted), and a later turn
// that would have pulled an evicted hold recomputes and answers right, even under policy fail.
func TestDecoderHoldsEvictedUnderPressure(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: bidiCfg("kv_producer", `,"kv_recompute_threshold":0`)})
	d := startNode(t, "D", nodeOptions{kvConfig: bidiCfg("kv_consumer", ""), numBlocks: 24})
	var convs [][]int
	var holds []map[string]any
	for i := 0; d.pool.NumFree() > 2; i++ { // each turn holds its 40-token prompt and answer
		if i == 24 {
			t.Fatalf("24 turns left %d of D's %d blocks free", d.pool.NumFree(), d.pool.NumBlocks())
		}
		dparams, next := turnOne(t, p, d, tokens(40, 40+i))
		holds, convs = append(holds, dparams), append(convs, next)
	}
	prompt := tokens(100, 50)
	if status, r := ask(t, d, prompt, nil); status != 200 || r.Text != reference(t, prompt) {
		t.Fatalf("a new request on a full D: %d %s", status, r.Raw)
	}
	if got := evicted(t, d); got == 0 {
		t.Fatal("no hold was counted as evicted")
	}
	// The oldest conversation's next turn: its hold was evicted; P recomputes (P's policy is fail).
	kv := maps.Clone(holds[0])
	kv["do_remote_decode"], kv["do_remote_prefill"] = true, false
	status, r := ask(t, p, convs[0], kv)
	if want := reference(t, convs[0]); status != 200 || r.Text != want || external(r) != 0 {
		t.Fatalf("turn 2 after its hold was evicted: %d %s, want %q computed by P", status, r.Raw, want)
	}
	// An evicted hold is a miss by design: not a verification refusal on P.
	if got := p.conn.AuthRefusals().Verification; got != 0 {
		t.Errorf("P counted %d verification refusals for an evicted hold, want 0", got)
	}
}

// evicted returns D's kvbridge:kv_decoder_holds_evicted_total.
func evicted(t *testing.T, n *node) int {
	t.Helper()
	for _, line := range strings.Split(metricsText(t, n), "\n") {
		if strings.HasPrefix(line, "kvbridge:kv_decoder_holds_evicted_total{") {
			var v float64
			fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v)
			return int(v)
		}
	}
	t.Fatal("no kvbridge:kv_decoder_holds_evicted_total in /metrics")
	return 0
}

// TestProducerGoneUnmapsItsArena: when P's transfer agent goes away, D forgets it at once —
// the mapping of P's arena is released when its death is observed, not when engine_ttl passes.
func TestProducerGoneUnmapsItsArena(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg})
	d := startNode(t, "D", nodeOptions{kvConfig: consumerCfg})
	prompt := tokens(40, 35)
	if status, r := decode(t, d, prompt, prefill(t, p, prompt), 4); status != 200 || cachedTokens(r) == 0 {
		t.Fatalf("decode: %d %s", status, r.Raw)
	}
	if st := d.conn.Agent().Stats(); st.MappedBytes <= 0 {
		t.Fatalf("D maps %d bytes of P's arena after an SHM read", st.MappedBytes)
	}
	if err := p.conn.Close(); err != nil { // P's transfer agent goes away
		t.Fatal(err)
	}
	eventually(t, "D to unmap the arena of a P that is gone", func() bool { return d.conn.Agent().Stats().MappedBytes == 0 })
}

// TestParamsMAC: with a shared auth token, P MACs the params it issues and D acts only on params
// whose MAC verifies: unchanged params are pulled from (a proxy's rewrite of remote_host does not
// matter), while a changed block list, token count or lease is refused before any connection.
func TestParamsMAC(t *testing.T) {
	const tok = `"auth_token":"tok-0123456789abcdef"`
	p := startNode(t, "P", nodeOptions{kvConfig: kvConfig("kv_producer", tok)})
	d := startNode(t, "D", nodeOptions{kvConfig: kvConfig("kv_consumer", tok)})
	prompt := tokens(40, 36)
	want := reference(t, prompt)
	kv := prefill(t, p, prompt)
	if kv[connector.KeyMAC] == nil {
		t.Fatalf("P's params carry no MAC: %v", kv)
	}
	for name, change := range map[string]func(map[string]any){
		"blocks": func(m map[string]any) {
			ids := m["remote_block_ids"].([]any)[0].([]any)
			m["remote_block_ids"] = []any{append([]any{ids[1], ids[0]}, ids[2:]...)}
		},
		"tokens": func(m map[string]any) { m["remote_num_tokens"] = 16.0 },
		"lease":  func(m map[string]any) { m[connector.KeyLease] = strings.Repeat("cd", 16) },
		"no MAC": func(m map[string]any) { delete(m, connector.KeyMAC) },
	} {
		forged := maps.Clone(kv)
		change(forged)
		if status, r := ask(t, d, prompt, forged); status != 200 || r.Text != want || cachedTokens(r) != 0 {
			t.Fatalf("params with a changed %s: %d cached %d %s", name, status, cachedTokens(r), r.Raw)
		}
	}
	if got := d.conn.AuthRefusals().Params; got != 4 {
		t.Errorf("D refused %d params, want 4", got)
	}
	rewritten := maps.Clone(kv)
	rewritten["remote_host"] = "localhost" // as the multi-turn proxy rewrites it
	if status, r := ask(t, d, prompt, rewritten); status != 200 || r.Text != want || cachedTokens(r) == 0 {
		t.Fatalf("the issued params with remote_host rewritten: %d %s", status, r.Raw)
	}
	p.waitPoolFull(t)
}

// TestStolenLeaseToken: an attacker who copies a victim's kv_transfer_params (lease token
// included) into a request for another prompt — sent to the victim's D, to another D, or
// refused by D before the engine — cannot end the victim's lease: the notification that ends
// a lease must prove the prompt it was issued for. The victim's read afterwards pulls the KV
// (nothing recomputed) and answers as a single engine does; P's clock never moves, so only the
// victim's own notification frees P's blocks.
func TestStolenLeaseToken(t *testing.T) {
	for _, backend := range []string{"SHM", "TCP"} {
		for _, where := range []string{"same D", "another D", "refused by D"} {
			t.Run(backend+"/"+where, func(t *testing.T) {
				extra := `"backends":["` + backend + `"]`
				p := startNode(t, "P", nodeOptions{kvConfig: policyCfg("kv_producer", "fail", extra), now: newFakeClock().Now, tick: make(chan time.Time)})
				d := startNode(t, "D", nodeOptions{kvConfig: policyCfg("kv_consumer", "fail", extra)})
				attacker := d
				if where == "another D" {
					attacker = startNode(t, "D2", nodeOptions{kvConfig: policyCfg("kv_consumer", "fail", extra)})
				}
				prompt, other := tokens(40, 37), tokens(40, 38)
				victim := prefill(t, p, prompt)
				body := map[string]any{"model": "kvbridge/tiny", "prompt": other, "max_tokens": 4, "kv_transfer_params": maps.Clone(victim)}
				want := 500 // D reads, sees that the blocks are not its prompt's, uses nothing
				if where == "refused by D" {
					body["temperature"] = -1
					want = 400
				}
				if status, r := post(t, attacker.srv.URL+"/v1/completions", body); status != want {
					t.Fatalf("another prompt with the victim's params: %d %s, want %d", status, r.Raw, want)
				}
				if where != "refused by D" { // a refused request's params send nothing (no prompt to prove)
					// The attacker's notification reaches P asynchronously: wait until P ended
					// the lease (as it did before the fix) or refused the notification.
					eventually(t, "P to act on the attacker's notification", func() bool {
						return p.pool.NumFree() == p.pool.NumBlocks() || p.conn.AuthRefusals().Notifications == 1
					})
				}
				status, r := ask(t, d, prompt, victim)
				if status != 200 || r.Text != reference(t, prompt) || cachedTokens(r) != 39 {
					t.Fatalf("the victim's read after the attack: %d, cached %d, %s", status, cachedTokens(r), r.Raw)
				}
				p.waitPoolFull(t)
			})
		}
	}
}
