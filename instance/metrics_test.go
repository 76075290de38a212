package instance

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
)

// complete sends a completion to in and fails t unless it succeeds.
func complete(t *testing.T, hc *http.Client, in *Instance, body map[string]any) apiclient.Reply {
	t.Helper()
	body["model"] = model.Tiny
	r, err := apiclient.Post(t.Context(), hc, in.URL+"/v1/completions", body, nil)
	if err != nil || r.Check(in.URL) != nil {
		t.Fatalf("completion: %v %v", err, r.Check(in.URL))
	}
	return r
}

// TestPrefixHitShowsInPromptSources: a prompt sent again is found in the prefix cache, and
// vllm:prompt_tokens_by_source_total says so: its local_cache_hit moves by the prefix-cache hit
// (vllm:prefix_cache_hits_total) and local_compute by the rest of the prompt.
func TestPrefixHitShowsInPromptSources(t *testing.T) {
	in, _, err := start(t, Config{NumBlocks: 64, PrefixCaching: true})
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{}
	defer hc.CloseIdleConnections()
	body := func() map[string]any {
		return map[string]any{"prompt": "A prompt sent twice is computed once and then found in the prefix cache, block by block.",
			"max_tokens": 2, "temperature": 0}
	}
	const src = "vllm:prompt_tokens_by_source_total"
	first := complete(t, hc, in, body())
	m0 := fixture.Scrape(t, hc, in.URL)
	if got := m0.Sum(src, `source="local_compute"`); got != float64(first.PromptTokens) {
		t.Fatalf("first request: local_compute %v, want its %d prompt tokens", got, first.PromptTokens)
	}
	second := complete(t, hc, in, body())
	m1 := fixture.Scrape(t, hc, in.URL)
	hits := m1.Sum("vllm:prefix_cache_hits_total") - m0.Sum("vllm:prefix_cache_hits_total")
	cached := m1.Sum(src, `source="local_cache_hit"`) - m0.Sum(src, `source="local_cache_hit"`)
	computed := m1.Sum(src, `source="local_compute"`) - m0.Sum(src, `source="local_compute"`)
	if hits < 16 || cached != hits || computed != float64(second.PromptTokens)-hits {
		t.Fatalf("second request of %d prompt tokens: prefix-cache hit %v, local_cache_hit %v, local_compute %v",
			second.PromptTokens, hits, cached, computed)
	}
	if pulled := m1.Sum(src, `source="external_kv_transfer"`); pulled != 0 {
		t.Errorf("external_kv_transfer %v without a connector", pulled)
	}
}

// TestPreemptionsCounted: requests that outgrow the KV pool together are preempted, and
// vllm:num_preemptions_total counts every preemption the engine made.
func TestPreemptionsCounted(t *testing.T) {
	// 64 blocks of 4 tokens: three sequences of 200 tokens and more cannot all fit.
	in, _, err := start(t, Config{NumBlocks: 64, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{}
	defer hc.CloseIdleConnections()
	// The three sequences of n=3 are queued together (no prefix caching to wait for), so they
	// grow together and outgrow the pool; a machine so loaded that the first ran to its end
	// before the others were queued gets another try.
	for try := 0; try < 5 && in.Engine.Stats().Preemptions == 0; try++ {
		r := complete(t, hc, in, map[string]any{"prompt": "Grow until the pool is short.", "max_tokens": 200,
			"ignore_eos": true, "n": 3, "temperature": 1, "seed": 7})
		if r.CompletionTokens != 600 {
			t.Fatalf("%d completion tokens, want 3 × 200", r.CompletionTokens)
		}
	}
	st := in.Engine.Stats()
	if st.Preemptions == 0 {
		t.Fatal("no preemption: the pool is too large for this test")
	}
	if got := fixture.Scrape(t, hc, in.URL).Sum("vllm:num_preemptions_total"); got != float64(st.Preemptions) {
		t.Fatalf("vllm:num_preemptions_total %v, the engine preempted %d times", got, st.Preemptions)
	}
}

// TestCacheConfigAndTokenHistograms: vllm:cache_config_info describes the KV cache with the
// labels vLLM's CacheConfig.metrics_info gives them, and the token-count histograms have vLLM's
// build_1_2_5_buckets(max_model_len) buckets.
func TestCacheConfigAndTokenHistograms(t *testing.T) {
	in, _, err := start(t, Config{NumBlocks: 100, PrefixCaching: true}) // max_model_len 1600
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{}
	defer hc.CloseIdleConnections()
	r := complete(t, hc, in, map[string]any{"prompt": "Count my tokens.", "max_tokens": 3, "ignore_eos": true, "temperature": 0})
	m := fixture.Scrape(t, hc, in.URL)
	info := m["vllm:cache_config_info"]
	if len(info) != 1 || info[0].Value != 1 {
		t.Fatalf("vllm:cache_config_info: %+v", info)
	}
	for _, l := range []string{`block_size="16"`, `cache_dtype="auto"`, `enable_prefix_caching="True"`, `num_gpu_blocks="100"`,
		`num_cpu_blocks="None"`, `engine="0"`} {
		if !strings.Contains(info[0].Labels, l) {
			t.Errorf("vllm:cache_config_info%s lacks %s", info[0].Labels, l)
		}
	}
	// vLLM's build_1_2_5_buckets(1600).
	want := []string{"1", "2", "5", "10", "20", "50", "100", "200", "500", "1000", "+Inf"}
	for _, name := range []string{"vllm:request_prompt_tokens", "vllm:request_generation_tokens",
		"vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens"} {
		var les []string
		for _, s := range m[name+"_bucket"] {
			_, le, _ := strings.Cut(s.Labels, `le="`)
			les = append(les, le[:strings.IndexByte(le, '"')])
		}
		if !slices.Equal(les, want) {
			t.Errorf("%s buckets %v, want %v", name, les, want)
		}
	}
	for name, v := range map[string]int{"vllm:request_prompt_tokens_sum": r.PromptTokens, "vllm:request_generation_tokens_sum": 3,
		"vllm:request_max_num_generation_tokens_sum": 3, "vllm:request_params_max_tokens_sum": 3} {
		if got := m.Sum(name); got != float64(v) {
			t.Errorf("%s = %v, want %s", name, got, strconv.Itoa(v))
		}
	}
}
