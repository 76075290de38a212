package connector_test

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvcache"
)

// TestFP8BlocksAndLayouts: with an FP8 KV cache on both sides, D reads P's one-byte blocks —
// regrouped from smaller ones, and permuted from HND into an NHD pool — and answers what a
// single fp8 engine answers, having moved half the bytes a bfloat16 KV cache moves for the
// same prompt (vllm:nixl_bytes_transferred).
func TestFP8BlocksAndLayouts(t *testing.T) {
	prompt := tokens(75, 14)
	moved := map[string]float64{}
	for _, kv := range []string{"bfloat16", "fp8"} {
		single := startNode(t, "single", nodeOptions{kvCacheDType: kv})
		status, r := post(t, single.srv.URL+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0})
		if status != 200 {
			t.Fatal(r.Raw)
		}
		want := r.Text
		for _, tc := range []struct {
			name           string
			pBlock, dBlock int
			dLayout        kvcache.Layout
		}{
			{"P 16 → D 16", 16, 16, kvcache.HND},
			{"P 8 → D 16", 8, 16, kvcache.HND},
			{"P 8 HND → D 16 NHD with permute", 8, 16, kvcache.NHD},
		} {
			t.Run(kv+"/"+tc.name, func(t *testing.T) {
				p := startNode(t, "P", nodeOptions{kvConfig: producerCfg, blockSize: tc.pBlock, numBlocks: 1024, kvCacheDType: kv})
				dcfg := fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":"kv_consumer","enable_permute_local_kv":%v}`, tc.dLayout == kvcache.NHD)
				d := startNode(t, "D", nodeOptions{kvConfig: dcfg, blockSize: tc.dBlock, layout: tc.dLayout, kvCacheDType: kv})
				if g := d.pool.Geometry(); g.DType.String() != map[string]string{"bfloat16": "bfloat16", "fp8": "fp8_e4m3"}[kv] {
					t.Fatalf("D's pool holds %v", g.DType)
				}
				status, r := decode(t, d, prompt, prefill(t, p, prompt), 6)
				if status != 200 || r.Text != want || cachedTokens(r) == 0 {
					t.Fatalf("%d %q (cached %d), want 200 %q", status, r.Text, cachedTokens(r), want)
				}
				if tc.pBlock == 16 {
					moved[kv] = fixture.Scrape(t, http.DefaultClient, d.srv.URL).Sum("vllm:nixl_bytes_transferred_sum")
				}
			})
		}
	}
	if moved["bfloat16"] == 0 || moved["fp8"]*2 != moved["bfloat16"] {
		t.Errorf("bytes moved for one prompt: fp8 %v, bfloat16 %v; want half", moved["fp8"], moved["bfloat16"])
	}
}
