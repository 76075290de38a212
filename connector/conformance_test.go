package connector_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/internal/fixture"
)

const (
	producerCfg = `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`
	consumerCfg = `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`
)

// template is what the proxy sends P (docs/architecture.md, wire contract item 1).
func template() map[string]any {
	return map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
}

func tokens(n, seed int) []int {
	ids := make([]int, n)
	for i := range ids {
		ids[i] = 300 + (seed*7919+i*104729)%3000
	}
	return ids
}

// prefill asks P for a prompt's KV as the proxy would and returns P's params.
func prefill(t *testing.T, p *node, prompt []int) map[string]any {
	t.Helper()
	status, r := post(t, p.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": template()})
	if status != 200 || r.KVParams == nil {
		t.Fatalf("prefill: status %d, params %v: %s", status, r.KVParams, r.Raw)
	}
	return r.KVParams
}

func decode(t *testing.T, d *node, prompt []int, params map[string]any, maxTokens int) (int, result) {
	t.Helper()
	return post(t, d.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": maxTokens, "temperature": 0, "kv_transfer_params": params})
}

// TestProducerHoldsBlocksUntilRead covers conformance items 5, 6 and 21: P returns complete
// params after a normal finish, holds the blocks, and frees them on D's notification.
func TestProducerHoldsBlocksUntilRead(t *testing.T) {
	clock := newFakeClock()
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, now: clock.Now, tick: make(chan time.Time)})
	d := startNode(t, "D", nodeOptions{kvConfig: consumerCfg})
	prompt := tokens(40, 1)
	kv := prefill(t, p, prompt)
	params, err := connector.ParseParams(kv)
	if err != nil {
		t.Fatal(err)
	}
	if !params.DoRemotePrefill || params.DoRemoteDecode || !params.Complete() || params.RemoteEngineID != p.conn.EngineID() ||
		params.TPSize != 1 || params.RemoteNumTokens != 40 || len(params.Blocks()) != 3 || len(params.BlockGenerations) != 3 {
		t.Fatalf("P's params = %+v", params)
	}
	if got := p.pool.NumBlocks() - p.pool.NumFree(); got != 3 {
		t.Fatalf("P holds %d blocks after the prefill, want 3", got)
	}
	status, r := decode(t, d, prompt, kv, 5)
	if status != 200 || cachedTokens(r) == 0 {
		t.Fatalf("decode: %d %s", status, r.Raw)
	}
	if r.KVParams != nil {
		t.Errorf("D without bidirectional transfer returned params (item 32): %v", r.KVParams)
	}
	d.waitPoolFull(t) // and freed its blocks at once
	p.waitPoolFull(t) // freed by the notification: the fake clock never moved
}

// TestProducerAbortFreesAtOnce covers item 7: an aborted P request holds nothing.
func TestProducerAbortFreesAtOnce(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, now: newFakeClock().Now, tick: make(chan time.Time)})
	ctx, cancel := context.WithCancel(t.Context())
	body, _ := json.Marshal(map[string]any{"model": "kvbridge/tiny", "prompt": tokens(20, 2), "max_tokens": 1900, "ignore_eos": true, "stream": true, "kv_transfer_params": template()})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p.srv.URL+"/v1/completions", bytes.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	p.waitPoolFull(t)
}

// TestLeaseExpiryAndReuseDetected: D reads after P's lease expired and P reused the blocks.
// vLLM would use the wrong KV and answer 200; kvbridge's generation check makes it a load
// failure: 500 under policy fail, the correct output under recompute.
//
// It runs with TP 1 on both sides, and with TP 2 on P and on D (the fault suite's lease tests
// with TP 2 on each side, issue 25): every rank's blocks expire and are reused together.
func TestLeaseExpiryAndReuseDetected(t *testing.T) {
	for _, c := range []struct {
		policy string
		p, d   int
	}{{"fail", 1, 1}, {"recompute", 1, 1}, {"fail", 2, 1}, {"recompute", 1, 2}, {"fail", 2, 2}} {
		t.Run(fmt.Sprintf("%s/P%d-D%d", c.policy, c.p, c.d), func(t *testing.T) {
			policy := c.policy
			clock := newFakeClock()
			tick := make(chan time.Time)
			var plog fixture.LogBuffer
			p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, now: clock.Now, tick: tick, numBlocks: 8, logw: &plog, tp: c.p})
			d := startNode(t, "D", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"` + policy + `"}`, tp: c.d})
			single := startNode(t, "single", nodeOptions{})
			prompt := tokens(40, 3)
			kv := prefill(t, p, prompt)
			clock.Advance(31 * time.Second)
			tick <- clock.Now()
			p.waitPoolFull(t)
			if !strings.Contains(plog.String(), "Releasing expired KV blocks") {
				t.Errorf("P did not log the expiry: %s", plog.String())
			}
			// Another prompt reuses the freed blocks (lowest ids first); P holds it too.
			other := prefill(t, p, tokens(60, 4))
			_ = other
			status, r := decode(t, d, prompt, kv, 6)
			_, want := post(t, single.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0})
			switch policy {
			case "fail":
				if status != 500 || r.Error == nil || r.Error["message"] != "Internal server error" {
					t.Fatalf("stale read: status %d %s, want 500 with OpenAI's error JSON", status, r.Raw)
				}
			case "recompute":
				if status != 200 || r.Text != want.Text {
					t.Fatalf("stale read under recompute: %d %q, want 200 %q", status, r.Text, want.Text)
				}
			}
			// D's late notification is for a lease P no longer holds (item 22).
			eventually(t, "P to log the late notification", func() bool {
				return strings.Contains(plog.String(), "Potentially invalid KV blocks for unrecognized request")
			})
			clock.Advance(31 * time.Second)
			tick <- clock.Now()
			p.waitPoolFull(t)
			d.waitPoolFull(t)
		})
	}
}

// TestHeartbeatsKeepTheLease: a D request queued behind another keeps heartbeating P, so P's
// lease outlives kv_lease_duration; without heartbeats it would expire. It runs with TP 1 on
// both sides and with TP 2 on P and on D (issue 25).
func TestHeartbeatsKeepTheLease(t *testing.T) {
	for _, c := range []struct{ p, d int }{{1, 1}, {2, 1}, {1, 2}} {
		t.Run(fmt.Sprintf("P%d-D%d", c.p, c.d), func(t *testing.T) { heartbeatsKeepTheLease(t, c.p, c.d) })
	}
}

func heartbeatsKeepTheLease(t *testing.T, ptp, dtp int) {
	pclock, dclock := newFakeClock(), newFakeClock()
	ptick, dtick := make(chan time.Time), make(chan time.Time)
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, now: pclock.Now, tick: ptick, tp: ptp})
	var dlog fixture.LogBuffer
	d := startNode(t, "D", nodeOptions{kvConfig: consumerCfg, now: dclock.Now, tick: dtick, maxSeqs: 1, logw: &dlog, tp: dtp})
	defer func() {
		if t.Failed() {
			t.Log(dlog.String())
		}
	}()
	// Occupy D's only sequence slot with a long stream.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	body, _ := json.Marshal(map[string]any{"model": "kvbridge/tiny", "prompt": tokens(8, 5), "max_tokens": 1900, "ignore_eos": true, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, d.srv.URL+"/v1/completions", bytes.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	prompt := tokens(30, 6)
	kv := prefill(t, p, prompt)
	id := kv["remote_request_id"].(string)
	first, _ := p.conn.LeaseDeadline(id)
	done := make(chan result, 1)
	go func() {
		_, r := decode(t, d, prompt, kv, 4)
		done <- r
	}()
	eventually(t, "D to queue the request", func() bool { return d.eng.Stats().Waiting > 0 })
	pclock.Advance(25 * time.Second)
	eventually(t, "P to extend the lease", func() bool {
		// Each tick past the heartbeat interval makes D send "HB:<id>" to P (a tick that comes
		// before D's handshake with P finished is skipped, as in vLLM).
		dclock.Advance(5 * time.Second)
		dtick <- dclock.Now()
		dl, ok := p.conn.LeaseDeadline(id)
		return ok && dl.After(first)
	})
	pclock.Advance(10 * time.Second) // 35 s after the prefill: past the original lease
	ptick <- pclock.Now()
	if _, ok := p.conn.LeaseDeadline(id); !ok {
		t.Fatal("the lease expired although D heartbeated")
	}
	cancel() // free D's slot: the queued request reads and P frees
	r := <-done
	if r.FinishReason != "length" {
		t.Fatalf("queued request: %s", r.Raw)
	}
	p.waitPoolFull(t)
}
