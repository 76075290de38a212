package connector_test

import (
	"fmt"
	"maps"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/internal/fixture"
)

func bidiCfg(role, extra string) string {
	return fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":%q,"kv_connector_extra_config":{"bidirectional_kv_xfer":true%s}}`, role, extra)
}

// turnOne runs a first turn P → D and returns D's params (what the multi-turn proxy caches)
// and the token ids of the next prompt: the first prompt, the answer, then new tokens.
func turnOne(t *testing.T, p, d *node, prompt []int) (map[string]any, []int) {
	t.Helper()
	status, r := decode(t, d, prompt, prefill(t, p, prompt), 20)
	if status != 200 || r.KVParams == nil {
		t.Fatalf("turn 1: %d %s", status, r.Raw)
	}
	dp, err := connector.ParseParams(r.KVParams)
	if err != nil || !dp.DoRemoteDecode || dp.DoRemotePrefill || dp.RemoteBlocksExpiryTime == nil || dp.RemoteNumTokens <= 0 ||
		dp.RemoteNumTokens > len(dp.Blocks())*16 || len(dp.BlockHashes) == 0 {
		t.Fatalf("D's params after a turn (conformance item 31): %+v %v", dp, err)
	}
	answer := openModel(t, "kvbridge/tiny").Tokenizer().Encode(r.Text)
	next := append(append(append([]int(nil), prompt...), toInts(answer)...), tokens(10, 99)...)
	return r.KVParams, next
}

func toInts(ids []int32) []int {
	out := make([]int, len(ids))
	for i, id := range ids {
		out[i] = int(id)
	}
	return out
}

// prefillFromD runs turn 2's prefill on P with D's params, as the multi-turn proxy does.
func prefillFromD(t *testing.T, p *node, prompt []int, dparams map[string]any) (int, result) {
	t.Helper()
	kv := maps.Clone(dparams)
	kv["do_remote_decode"], kv["do_remote_prefill"] = true, false
	return post(t, p.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": kv})
}

func external(r result) int {
	d, _ := r.Usage["prompt_tokens_details"].(map[string]any)
	f, _ := d["external_cached_tokens"].(float64)
	return int(f)
}

// TestBidirectionalPullIsVerified: on turn 2, P pulls from D only the blocks whose token hashes
// match its own prompt (items 31, 33). An edited history pulls less — never wrong KV — and the
// rejection is counted. D frees a turn's hold on the notification of the next turn's P, but not
// on P's notification for an edited history, which does not prove the prompt the hold was
// issued for: that hold lasts until decoder_kv_blocks_ttl.
func TestBidirectionalPullIsVerified(t *testing.T) {
	dclock := newFakeClock()
	dtick := make(chan time.Time)
	p := startNode(t, "P", nodeOptions{kvConfig: bidiCfg("kv_producer", `,"kv_recompute_threshold":0`)})
	d := startNode(t, "D", nodeOptions{kvConfig: bidiCfg("kv_consumer", ""), prefix: true, now: dclock.Now, tick: dtick})
	single := startNode(t, "single", nodeOptions{})
	first := tokens(100, 20)
	dparams, next := turnOne(t, p, d, first)

	want := func(prompt []int) string {
		_, r := post(t, single.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
		return r.Text
	}
	status, r := prefillFromD(t, p, next, dparams)
	if status != 200 || r.Text != want(next) {
		t.Fatalf("turn 2 prefill: %d %s", status, r.Raw)
	}
	if got := external(r); got < 96 {
		t.Errorf("turn 2 pulled %d tokens from D; the first prompt alone holds 6 verified blocks (96)", got)
	}
	d.waitPoolFull(t) // D freed turn 1's hold on P's notification; D's clock never moved

	// A second conversation whose history was edited at token 40.
	dparams2, next2 := turnOne(t, p, d, tokens(100, 21))
	next2[40]++
	before := p.conn.VerificationRejections()
	status, r = prefillFromD(t, p, next2, dparams2)
	if status != 200 || r.Text != want(next2) {
		t.Fatalf("edited history: %d %s", status, r.Raw)
	}
	if got := external(r); got != 32 {
		t.Errorf("edited history pulled %d tokens, want the 2 blocks before the edit (32)", got)
	}
	if p.conn.VerificationRejections() != before+1 {
		t.Error("the rejection was not counted")
	}
	eventually(t, "D to refuse P's notification for the edited history", func() bool { return d.conn.AuthRefusals().Notifications == 1 })
	if d.pool.NumFree() == d.pool.NumBlocks() {
		t.Fatal("D freed the hold on a notification for another prompt")
	}
	dclock.Advance(481 * time.Second) // decoder_kv_blocks_ttl
	dtick <- dclock.Now()
	d.waitPoolFull(t)
}

// TestBidirectionalDeclinesExpiredBlocks: P declines a read of D's blocks within 5 s of their
// TTL, measured on D's clock through the handshake's offset (item 35): policy fail fails the
// prefill, recompute answers correctly.
func TestBidirectionalDeclinesExpiredBlocks(t *testing.T) {
	for _, policy := range []string{"fail", "recompute"} {
		t.Run(policy, func(t *testing.T) {
			dclock := newFakeClock()
			p := startNode(t, "P", nodeOptions{kvConfig: fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_load_failure_policy":%q,"kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`, policy)})
			d := startNode(t, "D", nodeOptions{kvConfig: bidiCfg("kv_consumer", ""), now: dclock.Now, tick: make(chan time.Time)})
			single := startNode(t, "single", nodeOptions{})
			dparams, next := turnOne(t, p, d, tokens(100, 22))
			dclock.Advance(477 * time.Second) // D's 480 s TTL ends in 3 s on D's clock
			status, r := prefillFromD(t, p, next, dparams)
			switch policy {
			case "fail":
				if status != 500 {
					t.Fatalf("expired D blocks under fail: %d %s", status, r.Raw)
				}
			case "recompute":
				_, w := post(t, single.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": next, "max_tokens": 1, "temperature": 0})
				if status != 200 || r.Text != w.Text || external(r) != 0 {
					t.Fatalf("expired D blocks under recompute: %d %s", status, r.Raw)
				}
			}
			iv := p.em.Nixl().TakeInterval()
			if iv.ExpiredRequests != 1 {
				t.Errorf("P counted %d expired requests, want 1", iv.ExpiredRequests)
			}
		})
	}
}

// TestBidirectionalHoldsExpireQuietly: the turns D holds for a next turn that never comes expire
// at decoder_kv_blocks_ttl as a cache ages out: counted in kvbridge:decoder_holds_expired_total,
// summed in one INFO line, and neither counted nor logged per request as an expired KV request
// (P's lease signal).
func TestBidirectionalHoldsExpireQuietly(t *testing.T) {
	dclock := newFakeClock()
	tick := make(chan time.Time)
	var dlog fixture.LogBuffer
	p := startNode(t, "P", nodeOptions{kvConfig: bidiCfg("kv_producer", "")})
	d := startNode(t, "D", nodeOptions{kvConfig: bidiCfg("kv_consumer", ""), now: dclock.Now, tick: tick, logw: &dlog})
	for i := range 3 {
		turnOne(t, p, d, tokens(100, 30+i))
	}
	if held := d.eng.Stats().Delayed; held != 3 {
		t.Fatalf("D holds %d turns, want 3", held)
	}
	dclock.Advance(481 * time.Second) // past the 480 s decoder_kv_blocks_ttl
	tick <- dclock.Now()
	d.waitPoolFull(t)
	m := fixture.Scrape(t, http.DefaultClient, d.srv.URL)
	if got := m.Sum("kvbridge:decoder_holds_expired_total"); got != 3 {
		t.Errorf("kvbridge:decoder_holds_expired_total = %v, want 3", got)
	}
	if got := m.Sum("vllm:nixl_num_kv_expired_reqs_total"); got != 0 {
		t.Errorf("vllm:nixl_num_kv_expired_reqs_total = %v on D: its holds are not expired requests", got)
	}
	logs := dlog.String()
	if n := strings.Count(logs, "expired unclaimed"); n != 1 || !strings.Contains(logs, "3 decoder hold(s)") ||
		strings.Contains(logs, "Releasing expired KV blocks") {
		t.Errorf("D's log, want one summary of 3 holds and no per-request expiry:\n%s", logs)
	}
	p.waitPoolFull(t)
}
