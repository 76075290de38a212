package openai

import (
	"bufio"
	"bytes"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

func TestMetricsEndpoint(t *testing.T) {
	e := newEnv(t)
	before := e.scrape(t)
	for _, name := range []string{
		"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
		"vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
		"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
		"vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
		"vllm:inter_token_latency_seconds_count", "vllm:nixl_xfer_time_seconds_count",
		"vllm:nixl_num_failed_transfers_total",
	} {
		if _, ok := before[name]; !ok {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	resp, b := e.post(t, "/v1/completions", map[string]any{"prompt": "count me", "max_tokens": 3, "ignore_eos": true}, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	after := e.scrape(t)
	for name, delta := range map[string]float64{
		"vllm:generation_tokens_total":           3,
		"vllm:request_success_total":             1,
		"vllm:time_to_first_token_seconds_count": 1,
		"vllm:e2e_request_latency_seconds_count": 1,
		"vllm:inter_token_latency_seconds_count": 2,
	} {
		if got := after[name] - before[name]; got != delta {
			t.Errorf("%s grew by %v, want %v", name, got, delta)
		}
	}
	for _, name := range []string{"vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total"} {
		if after[name] <= before[name] {
			t.Errorf("%s did not grow: %v → %v", name, before[name], after[name])
		}
	}
}

// scrape reads /metrics and sums every vllm: sample by metric name (over label sets).
func (e *env) scrape(t testing.TB) map[string]float64 {
	t.Helper()
	resp, b := e.do(t, http.MethodGet, "/metrics", nil, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics status %d", resp.StatusCode)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "vllm:") {
			continue
		}
		name, rest, _ := strings.Cut(line, " ")
		if i := strings.IndexByte(line, '{'); i >= 0 {
			name = line[:i]
			_, rest, _ = strings.Cut(line[strings.LastIndexByte(line, '}'):], " ")
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
		if err != nil {
			t.Fatalf("bad sample line %q", line)
		}
		out[name] += v
	}
	return out
}
