package metrics

import (
	"errors"
	"slices"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// TestRequestSeriesTypes: the new series have vLLM's types (their buckets: TestBuckets).
func TestRequestSeriesTypes(t *testing.T) {
	r := NewRegistry()
	if err := r.Engine("m", "0").Configure(EngineConfig{MaxModelLen: 100}); err != nil {
		t.Fatal(err)
	}
	mfs, err := r.Prometheus().Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]dto.MetricType{}
	for _, mf := range mfs {
		seen[mf.GetName()] = mf.GetType()
	}
	for name, want := range map[string]dto.MetricType{
		"vllm:num_preemptions_total":                 dto.MetricType_COUNTER,
		"vllm:prompt_tokens_by_source_total":         dto.MetricType_COUNTER,
		"kvbridge:decoder_holds_expired_total":       dto.MetricType_COUNTER,
		"vllm:cache_config_info":                     dto.MetricType_GAUGE,
		"vllm:iteration_tokens_total":                dto.MetricType_HISTOGRAM,
		"vllm:request_queue_time_seconds":            dto.MetricType_HISTOGRAM,
		"vllm:request_prefill_time_seconds":          dto.MetricType_HISTOGRAM,
		"vllm:request_decode_time_seconds":           dto.MetricType_HISTOGRAM,
		"vllm:request_inference_time_seconds":        dto.MetricType_HISTOGRAM,
		"vllm:request_time_per_output_token_seconds": dto.MetricType_HISTOGRAM,
		"vllm:request_prompt_tokens":                 dto.MetricType_HISTOGRAM,
		"vllm:request_generation_tokens":             dto.MetricType_HISTOGRAM,
		"vllm:request_max_num_generation_tokens":     dto.MetricType_HISTOGRAM,
		"vllm:request_params_n":                      dto.MetricType_HISTOGRAM,
		"vllm:request_params_max_tokens":             dto.MetricType_HISTOGRAM,
	} {
		if got, ok := seen[name]; !ok || got != want {
			t.Errorf("%s: %v (gathered %v), want %v", name, got, ok, want)
		}
	}
}

func TestBuckets125(t *testing.T) {
	for _, tc := range []struct {
		max  int
		want []float64
	}{
		{0, nil},
		{1, []float64{1}},
		{4, []float64{1, 2}},
		{100, []float64{1, 2, 5, 10, 20, 50, 100}},
		{32768, []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000}},
	} {
		if got := Buckets125(tc.max); !slices.Equal(got, tc.want) {
			t.Errorf("Buckets125(%d) = %v, want %v", tc.max, got, tc.want)
		}
	}
	if got := Buckets125(int(^uint(0) >> 1)); len(got) != 57 || got[56] != 5e18 {
		t.Errorf("Buckets125(MaxInt) ends %v after %d buckets", got[len(got)-1], len(got))
	}
}

// TestRequestSeriesRecord: what each observation moves, following vLLM's PrometheusStatLogger:
// a request that never ran has no phases, one without a token only its queue time, the mean
// time per output token needs two tokens; a step's tokens and prompt sources; the parent
// request's n and longest output.
func TestRequestSeriesRecord(t *testing.T) {
	r := NewRegistry()
	m := r.Engine("tiny", "0")
	m.SetStatsSource(func() SchedulerStats { return SchedulerStats{Preemptions: 3} })
	m.ObserveRequest(RequestSample{PromptTokens: 9, MaxTokens: 5}) // aborted before it ran: no phases
	if err := m.Configure(EngineConfig{MaxModelLen: 1000, Cache: CacheConfig{BlockSize: 16, NumGPUBlocks: 64,
		GPUMemoryUtilization: 0.9, EnablePrefixCaching: true}}); err != nil {
		t.Fatal(err)
	}
	if err := m.Configure(EngineConfig{MaxModelLen: 1000}); !errors.Is(err, errConfigured) {
		t.Errorf("second Configure: %v", err)
	}
	m.ObserveRequest(RequestSample{PromptTokens: 9, Scheduled: true, Queue: 200 * time.Millisecond}) // failed in prefill
	m.ObserveRequest(RequestSample{PromptTokens: 9, GenerationTokens: 1, MaxTokens: 1, Scheduled: true,
		Queue: time.Second, Prefill: 2 * time.Second, Inference: 2 * time.Second})
	m.ObserveRequest(RequestSample{PromptTokens: 9, GenerationTokens: 5, MaxTokens: 8, Scheduled: true,
		Queue: 0, Prefill: time.Second, Decode: 2 * time.Second, Inference: 3 * time.Second})
	m.ObserveStep(StepSample{Tokens: 20, Prompts: PromptSources{LocalCompute: 1, ExternalKVTransfer: 19}})
	m.ObserveStep(StepSample{Tokens: 3, Prompts: PromptSources{LocalCompute: 2, LocalCacheHit: 16}})
	m.ObserveParentRequest(2, 5)
	assertExposes(t, r, []string{
		`vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 3`,
		`vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 1.2`,
		`vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 2`,
		`vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 3`,
		`vllm:request_decode_time_seconds_sum{engine="0",model_name="tiny"} 2`,
		`vllm:request_inference_time_seconds_sum{engine="0",model_name="tiny"} 5`,
		`vllm:request_time_per_output_token_seconds_count{engine="0",model_name="tiny"} 1`,
		`vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="tiny"} 0.5`,
		`vllm:request_prompt_tokens_count{engine="0",model_name="tiny"} 3`, // not the one before Configure
		`vllm:request_generation_tokens_sum{engine="0",model_name="tiny"} 6`,
		`vllm:request_params_max_tokens_count{engine="0",model_name="tiny"} 2`,
		`vllm:request_params_n_bucket{engine="0",model_name="tiny",le="2"} 1`,
		`vllm:request_max_num_generation_tokens_sum{engine="0",model_name="tiny"} 5`,
		`vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 2`,
		`vllm:iteration_tokens_total_bucket{engine="0",model_name="tiny",le="8"} 1`,
		`vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 3`,
		`vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"} 16`,
		`vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 19`,
		`vllm:num_preemptions_total{engine="0",model_name="tiny"} 3`,
		`vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",kv_cache_memory_bytes="None",num_cpu_blocks="None",num_gpu_blocks="64"} 1`,
		`kvbridge:decoder_holds_expired_total{engine="0",model_name="tiny"} 0`,
	})
}
