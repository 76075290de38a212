package promtext

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// TestParseWhatClientGolangServes: a page that Prometheus' own client library serves (its
// encoder, not ours, writes it) reads back as the samples that were recorded: counters and
// gauges by label set, a histogram as cumulative buckets with +Inf once, _sum and _count.
func TestParseWhatClientGolangServes(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "vllm:prompt_tokens_by_source_total", Help: "h"}, []string{"source", "engine"})
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "vllm:num_requests_running", Help: "h"})
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "vllm:request_params_n", Help: "h", Buckets: []float64{1, 2, 5}})
	reg.MustRegister(c, g, h)
	c.WithLabelValues("external_kv_transfer", "0").Add(19)
	c.WithLabelValues("local_compute", "0").Add(1)
	c.WithLabelValues("local_compute", "1").Add(2)
	g.Set(3)
	for _, v := range []float64{1, 2, 2, 7} {
		h.Observe(v)
	}
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	s, err := Parse(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"vllm:prompt_tokens_by_source_total", []string{`source="external_kv_transfer"`}, 19},
		{"vllm:prompt_tokens_by_source_total", []string{`source="local_compute"`}, 3},
		{"vllm:prompt_tokens_by_source_total", []string{`engine="1"`, `source="local_compute"`}, 2},
		{"vllm:num_requests_running", nil, 3},
		{"vllm:request_params_n_bucket", []string{`le="1"`}, 1},
		{"vllm:request_params_n_bucket", []string{`le="2"`}, 3},
		{"vllm:request_params_n_bucket", []string{`le="5"`}, 3},
		{"vllm:request_params_n_bucket", []string{`le="+Inf"`}, 4},
		{"vllm:request_params_n_sum", nil, 12},
		{"vllm:request_params_n_count", nil, 4},
	} {
		if got, ok := s.Sum(tc.name, tc.labels...), s.Has(tc.name, tc.labels...); !ok || got != tc.want {
			t.Errorf("%s%v = %v (found %v), want %v", tc.name, tc.labels, got, ok, tc.want)
		}
	}
	if n := len(s["vllm:request_params_n_bucket"]); n != 4 {
		t.Errorf("%d buckets, want 4 (1, 2, 5, +Inf)", n)
	}
	if got, ok := s.Sum("vllm:absent"), s.Has("vllm:absent"); ok || got != 0 {
		t.Errorf("an absent series: %v %v", got, ok)
	}
	if _, err := Parse(http.NoBody); err != nil {
		t.Errorf("an empty page: %v", err)
	}
}
