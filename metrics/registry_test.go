package metrics

import (
	"io"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
)

func TestRegistryExposesVLLMNames(t *testing.T) {
	r := NewRegistry()
	m := r.Engine("tiny", "0")
	if r.Engine("tiny", "0") != m {
		t.Fatal("Engine with the same labels returned a different value")
	}
	m.SetStatsSource(func() SchedulerStats {
		return SchedulerStats{Running: 2, Waiting: 3, KVCacheUsage: 0.25, PrefixCacheQueries: 64, PrefixCacheHits: 32}
	})
	m.AddPromptTokens(10)
	m.AddGenerationTokens(4)
	m.ObserveTimeToFirstToken(30 * time.Millisecond)
	m.ObserveInterTokenLatency(5 * time.Millisecond)
	m.ObserveFinished("length", time.Second)
	m.Nixl().ObserveTransfer(TransferSample{Duration: time.Millisecond, PostDuration: time.Microsecond, Bytes: 4096, Descriptors: 3})
	m.Nixl().CountFailedTransfer()
	m.Nixl().CountFailedNotification()
	m.Nixl().CountExpiredRequest()
	m.Nixl().CountNotificationAfterExpiry()

	assertExposes(t, r, []string{
		`vllm:num_requests_running{engine="0",model_name="tiny"} 2`,
		`vllm:num_requests_waiting{engine="0",model_name="tiny"} 3`,
		`vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25`,
		`vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 64`,
		`vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 32`,
		`vllm:prompt_tokens_total{engine="0",model_name="tiny"} 10`,
		`vllm:generation_tokens_total{engine="0",model_name="tiny"} 4`,
		`vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1`,
		`vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0`,
		`vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 1`,
		`vllm:inter_token_latency_seconds_count{engine="0",model_name="tiny"} 1`,
		`vllm:e2e_request_latency_seconds_bucket{engine="0",model_name="tiny",le="1"} 1`,
		`vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 1`,
		`vllm:nixl_post_time_seconds_count{engine="0",model_name="tiny"} 1`,
		`vllm:nixl_bytes_transferred_bucket{engine="0",model_name="tiny",le="8192"} 1`,
		`vllm:nixl_num_descriptors_bucket{engine="0",model_name="tiny",le="10"} 1`,
		// One failed transfer and one failed notification: the guide's counter holds both.
		`vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 2`,
		`vllm:nixl_num_failed_notifications_total{engine="0",model_name="tiny"} 1`,
		`vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="tiny"} 1`,
		`vllm:nixl_num_notifications_after_expiry_total{engine="0",model_name="tiny"} 1`,
		`# TYPE vllm:num_requests_running gauge`,
		`# TYPE vllm:prefix_cache_hits_total counter`,
		`# TYPE vllm:nixl_bytes_transferred histogram`,
	})

	iv := m.Nixl().TakeInterval()
	if len(iv.Transfers) != 1 || iv.FailedTransfers != 1 || iv.FailedNotifications != 1 || iv.ExpiredRequests != 1 {
		t.Errorf("interval = %+v", iv)
	}
	if !m.Nixl().TakeInterval().Empty() {
		t.Error("TakeInterval did not reset the interval")
	}
}

// TestBuckets: every histogram has vLLM's buckets, as vllm/v1/metrics/loggers.py
// (PrometheusStatLogger) and the NIXL connector's stats write them.
func TestBuckets(t *testing.T) {
	r := NewRegistry()
	if err := r.Engine("m", "0").Configure(EngineConfig{MaxModelLen: 100}); err != nil {
		t.Fatal(err)
	}
	requestLatency := []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
		40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
	oneTwoFive := []float64{1, 2, 5, 10, 20, 50, 100} // build_1_2_5_buckets(100), from its docstring
	mfs, err := r.Prometheus().Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]float64{
		"vllm:nixl_xfer_time_seconds":         {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0},
		"vllm:nixl_post_time_seconds":         {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0},
		"vllm:nixl_bytes_transferred":         {1 << 11, 1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21, 1 << 23, 1 << 25, 1 << 27, 1 << 29, 1 << 31, 1 << 33},
		"vllm:nixl_num_descriptors":           {10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000},
		"vllm:time_to_first_token_seconds":    TTFTBuckets(),
		"vllm:e2e_request_latency_seconds":    RequestLatencyBuckets(),
		"vllm:inter_token_latency_seconds":    InterTokenLatencyBuckets(),
		"vllm:request_queue_time_seconds":     requestLatency,
		"vllm:request_prefill_time_seconds":   requestLatency,
		"vllm:request_decode_time_seconds":    requestLatency,
		"vllm:request_inference_time_seconds": requestLatency,
		"vllm:request_time_per_output_token_seconds": {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
			0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0},
		"vllm:iteration_tokens_total":            {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384},
		"vllm:request_params_n":                  {1, 2, 5, 10, 20},
		"vllm:request_prompt_tokens":             oneTwoFive,
		"vllm:request_generation_tokens":         oneTwoFive,
		"vllm:request_max_num_generation_tokens": oneTwoFive,
		"vllm:request_params_max_tokens":         oneTwoFive,
	}
	seen := map[string]bool{}
	for _, mf := range mfs {
		w, ok := want[mf.GetName()]
		if !ok {
			continue
		}
		seen[mf.GetName()] = true
		if mf.GetType() != dto.MetricType_HISTOGRAM {
			t.Errorf("%s: type %v", mf.GetName(), mf.GetType())
			continue
		}
		var got []float64
		for _, b := range mf.GetMetric()[0].GetHistogram().GetBucket() {
			got = append(got, b.GetUpperBound())
		}
		if !slices.Equal(got, w) {
			t.Errorf("%s buckets = %v, want %v", mf.GetName(), got, w)
		}
	}
	for name := range want {
		if !seen[name] {
			t.Errorf("%s not gathered", name)
		}
	}
}

// assertExposes checks that GET /metrics of r serves every one of lines.
func assertExposes(t *testing.T, r *Registry, lines []string) {
	t.Helper()
	rec := httptest.NewRecorder()
	r.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, err := io.ReadAll(rec.Body)
	if err != nil {
		t.Fatal(err)
	}
	text := string(body)
	for _, line := range lines {
		if !strings.Contains(text, line+"\n") {
			t.Errorf("exposition lacks %q", line)
		}
	}
	if t.Failed() {
		t.Log(text)
	}
}
