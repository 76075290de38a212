package connector_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvcache"
)

// singleOutput is the reference: the same greedy request on an engine without a connector.
func singleOutput(t *testing.T, prompt []int, maxTokens int) string {
	t.Helper()
	s := startNode(t, "single", nodeOptions{})
	status, r := post(t, s.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": maxTokens, "temperature": 0})
	if status != 200 {
		t.Fatal(r.Raw)
	}
	return r.Text
}

// TestConsumerIgnoresIncompleteParams covers item 8: params without a remote host are logged
// and ignored; D computes the prompt itself.
func TestConsumerIgnoresIncompleteParams(t *testing.T) {
	var log fixture.LogBuffer
	d := startNode(t, "D", nodeOptions{kvConfig: consumerCfg, logw: &log})
	prompt := tokens(20, 7)
	kv := map[string]any{"do_remote_prefill": true, "remote_block_ids": []int{1, 2}, "remote_engine_id": "e", "remote_request_id": "r"}
	status, r := decode(t, d, prompt, kv, 5)
	if status != 200 || r.Text != singleOutput(t, prompt, 5) {
		t.Fatalf("status %d, %q", status, r.Raw)
	}
	if d.eng.Stats().ExternalHits != 0 {
		t.Error("D loaded external tokens from incomplete params")
	}
	// Wrongly typed params are logged and ignored too (never a crash).
	kv["remote_block_ids"] = "1,2"
	if status, r := decode(t, d, prompt, kv, 5); status != 200 {
		t.Fatalf("mistyped params: %d %s", status, r.Raw)
	}
	if !strings.Contains(log.String(), "invalid KVTransferParams") {
		t.Errorf("no warning logged: %s", log.String())
	}
}

// TestConsumerPullsOnlyWhatItLacks covers items 10, 12 and 13: a repeated prompt is pulled
// only for the blocks D's prefix cache lacks, the last prompt token is recomputed, and a prompt
// shorter than one block is still pulled.
func TestConsumerPullsOnlyWhatItLacks(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, prefix: true})
	d := startNode(t, "D", nodeOptions{kvConfig: consumerCfg, prefix: true})
	run := func(prompt []int) (int64, int) {
		kv := prefill(t, p, prompt)
		d.em.Nixl().TakeInterval()
		status, r := decode(t, d, prompt, kv, 4)
		if status != 200 {
			t.Fatal(r.Raw)
		}
		var bytes int64
		for _, s := range d.em.Nixl().TakeInterval().Transfers {
			bytes += s.Bytes
		}
		return bytes, cachedTokens(r)
	}
	bb := int64(d.pool.BlockBytes())
	prompt := tokens(70, 8) // 4 full blocks and 6 tokens
	if got, cached := run(prompt); got != 5*bb || cached != 69 {
		t.Errorf("first pull moved %d bytes (%d cached tokens), want 5 blocks = %d (69: the last token is recomputed)", got, cached, 5*bb)
	}
	if got, _ := run(prompt); got != bb {
		t.Errorf("repeated prompt moved %d bytes, want only the partial last block (%d)", got, bb)
	}
	if got, cached := run(tokens(5, 9)); got != bb || cached != 4 {
		t.Errorf("5-token prompt moved %d bytes with %d cached tokens, want one block and 4", got, cached)
	}
	p.waitPoolFull(t)
}

// TestBelowThresholdNotifiesProducer covers item 11: when D computes locally (here below
// kv_recompute_threshold) it still tells P at once, so P frees without waiting for the lease.
func TestBelowThresholdNotifiesProducer(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, now: newFakeClock().Now, tick: make(chan time.Time)})
	d := startNode(t, "D", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"kv_recompute_threshold":1000}}`})
	prompt := tokens(50, 10)
	status, r := decode(t, d, prompt, prefill(t, p, prompt), 4)
	if status != 200 || cachedTokens(r) != 0 {
		t.Fatalf("%d %s", status, r.Raw)
	}
	p.waitPoolFull(t)
}

// TestAbortBeforeReadNotifiesProducer covers item 15: a D request that ends before its read
// (the client left while it was queued) tells P to free.
func TestAbortBeforeReadNotifiesProducer(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, now: newFakeClock().Now, tick: make(chan time.Time)})
	d := startNode(t, "D", nodeOptions{kvConfig: consumerCfg, maxSeqs: 1})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	stream := func(ctx context.Context, body map[string]any) *http.Response {
		data, _ := json.Marshal(body)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, d.srv.URL+"/v1/completions", bytes.NewReader(data))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	busy := stream(ctx, map[string]any{"model": "kvbridge/tiny", "prompt": tokens(8, 11), "max_tokens": 1900, "ignore_eos": true, "stream": true})
	defer busy.Body.Close()
	if _, err := bufio.NewReader(busy.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	prompt := tokens(40, 12)
	kv := prefill(t, p, prompt)
	qctx, qcancel := context.WithCancel(t.Context())
	queued := make(chan struct{})
	go func() {
		defer close(queued)
		data, _ := json.Marshal(map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": kv})
		req, _ := http.NewRequestWithContext(qctx, http.MethodPost, d.srv.URL+"/v1/completions", bytes.NewReader(data))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	eventually(t, "D to queue the request", func() bool { return d.eng.Stats().Waiting > 0 })
	qcancel()
	<-queued
	p.waitPoolFull(t) // P's fake clock never moves: only D's notification frees
	cancel()
}

// TestHandshakeRefusals covers item 17: an incompatible producer (hash mismatch) or the wrong
// engine id fails the load (500 under policy fail); enforce_handshake_compat=false skips the
// hash check.
func TestHandshakeRefusals(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, compat: func(f *connector.CompatFactors) { f.Model = "another-model" }})
	prompt := tokens(30, 13)
	t.Run("hash mismatch", func(t *testing.T) {
		var log fixture.LogBuffer
		d := startNode(t, "D", nodeOptions{kvConfig: consumerCfg, logw: &log})
		status, r := decode(t, d, prompt, prefill(t, p, prompt), 4)
		if status != 500 || r.Error == nil {
			t.Fatalf("incompatible producer: %d %s, want 500", status, r.Raw)
		}
		if !strings.Contains(log.String(), "NIXL compatibility hash mismatch") {
			t.Errorf("log lacks the mismatch message: %s", log.String())
		}
	})
	t.Run("compat check off", func(t *testing.T) {
		d := startNode(t, "D", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"enforce_handshake_compat":false}}`})
		status, r := decode(t, d, prompt, prefill(t, p, prompt), 4)
		if status != 200 || r.Text != singleOutput(t, prompt, 4) {
			t.Fatalf("%d %s", status, r.Raw)
		}
	})
	t.Run("engine id mismatch", func(t *testing.T) {
		var log fixture.LogBuffer
		d := startNode(t, "D", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"enforce_handshake_compat":false}}`, logw: &log})
		kv := maps.Clone(prefill(t, p, prompt))
		kv["remote_engine_id"] = "not-" + p.conn.EngineID()
		if status, r := decode(t, d, prompt, kv, 4); status != 500 {
			t.Fatalf("wrong engine id: %d %s", status, r.Raw)
		}
		if !strings.Contains(log.String(), "engine ID mismatch") {
			t.Errorf("log lacks the engine id mismatch: %s", log.String())
		}
	})
	t.Run("block id out of range", func(t *testing.T) {
		d := startNode(t, "D", nodeOptions{kvConfig: `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"enforce_handshake_compat":false}}`})
		kv := maps.Clone(prefill(t, p, prompt))
		kv["remote_block_ids"] = [][]int{{1 << 30, 1}}
		if status, r := decode(t, d, prompt, kv, 4); status != 500 {
			t.Fatalf("block id out of range: %d %s", status, r.Raw)
		}
	})
}

// TestHeterogeneousBlocksAndLayouts covers items 43 and 44 (docs/architecture.md,
// "Heterogeneous KV geometry"): P's blocks smaller than D's are
// regrouped, an HND producer feeds an NHD consumer with enable_permute_local_kv, and the output
// is still the single engine's; without the permutation the layouts are refused.
func TestHeterogeneousBlocksAndLayouts(t *testing.T) {
	prompt := tokens(75, 14)
	want := singleOutput(t, prompt, 6)
	for _, tc := range []struct {
		name           string
		pBlock, dBlock int
		dLayout        kvcache.Layout
		permute        bool
		ok             bool
	}{
		{"P 8 → D 16", 8, 16, kvcache.HND, false, true},
		{"P 4 → D 16", 4, 16, kvcache.HND, false, true},
		{"HND → NHD with permute", 16, 16, kvcache.NHD, true, true},
		{"P 8 HND → D 16 NHD with permute", 8, 16, kvcache.NHD, true, true},
		{"HND → NHD without permute", 16, 16, kvcache.NHD, false, false},
		{"P 32 → D 16", 32, 16, kvcache.HND, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, blockSize: tc.pBlock, numBlocks: 1024})
			dcfg := fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_permute_local_kv":%v}`, tc.permute)
			d := startNode(t, "D", nodeOptions{kvConfig: dcfg, blockSize: tc.dBlock, layout: tc.dLayout})
			status, r := decode(t, d, prompt, prefill(t, p, prompt), 6)
			if tc.ok && (status != 200 || r.Text != want || cachedTokens(r) == 0) {
				t.Fatalf("%d %q (cached %d), want 200 %q", status, r.Text, cachedTokens(r), want)
			}
			if !tc.ok && status != 500 {
				t.Fatalf("incompatible layouts: %d %s, want 500", status, r.Raw)
			}
		})
	}
}

// TestTransferMetrics covers items 40–42: the log line and the Prometheus series.
func TestTransferMetrics(t *testing.T) {
	p := startNode(t, "P", nodeOptions{kvConfig: producerCfg})
	d := startNode(t, "D", nodeOptions{kvConfig: consumerCfg})
	prompt := tokens(33, 15)
	if status, r := decode(t, d, prompt, prefill(t, p, prompt), 3); status != 200 {
		t.Fatal(r.Raw)
	}
	resp, err := http.Get(d.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		body.WriteString(sc.Text() + "\n")
	}
	for _, name := range []string{
		"vllm:nixl_xfer_time_seconds_bucket", "vllm:nixl_post_time_seconds_bucket", "vllm:nixl_bytes_transferred_bucket",
		"vllm:nixl_num_descriptors_bucket", "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total",
		"vllm:nixl_num_kv_expired_reqs_total", "vllm:nixl_num_notifications_after_expiry_total",
	} {
		if !strings.Contains(body.String(), name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	if !strings.Contains(body.String(), `vllm:nixl_xfer_time_seconds_count{engine="0",model_name="kvbridge/tiny"} 1`) {
		t.Errorf("one transfer not counted:\n%s", grep(body.String(), "nixl_xfer_time_seconds_count"))
	}
	p.waitPoolFull(t)
}

func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
