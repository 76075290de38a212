package metrics

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// SchedulerStats is a snapshot of an engine's scheduler, read at scrape time.
type SchedulerStats struct {
	Running, Waiting int     // requests running / waiting
	KVCacheUsage     float64 // fraction of KV blocks in use, 0..1
	// PrefixCacheQueries and PrefixCacheHits are cumulative counts of queried and hit prompt
	// tokens (vLLM counts tokens, not blocks).
	PrefixCacheQueries, PrefixCacheHits int64
	// Preemptions is the cumulative count of preemptions (vllm:num_preemptions_total).
	Preemptions int64
}

// EngineMetrics records one engine's series (labels model_name and engine). Obtain it from
// Registry.Engine. All methods are safe for concurrent use.
type EngineMetrics struct {
	modelName, engine string

	promptTokens     prometheus.Counter
	generationTokens prometheus.Counter
	success          map[string]prometheus.Counter
	successVec       *prometheus.CounterVec
	rejected         *prometheus.CounterVec
	unknownFields    *prometheus.CounterVec
	stalled          prometheus.Counter
	ttft, e2e, itl   prometheus.Observer
	nixl             *NixlMetrics
	req              requestMetrics
	reg              *prometheus.Registry
	cacheInfo        *prometheus.GaugeVec

	mu      sync.Mutex
	stats   func() SchedulerStats
	lengths *lengthHistograms // set by Configure
}

func newEngineMetrics(r *Registry, modelName, engine string) *EngineMetrics {
	m := &EngineMetrics{
		modelName:        modelName,
		engine:           engine,
		promptTokens:     r.promptTokens.WithLabelValues(modelName, engine),
		generationTokens: r.generationTokens.WithLabelValues(modelName, engine),
		success:          make(map[string]prometheus.Counter, 4),
		successVec:       r.requestSuccess,
		rejected:         r.rejected,
		unknownFields:    r.unknownFields,
		stalled:          r.stalled.WithLabelValues(modelName, engine),
		ttft:             r.ttft.WithLabelValues(modelName, engine),
		e2e:              r.e2e.WithLabelValues(modelName, engine),
		itl:              r.itl.WithLabelValues(modelName, engine),
		nixl:             r.nixl.forEngine(modelName, engine),
		req:              r.req.forEngine(modelName, engine),
		reg:              r.prom,
		cacheInfo:        r.req.cacheInfo,
	}
	// Pre-create vllm:request_success_total for vLLM's FinishReason values.
	for _, reason := range []string{"stop", "length", "abort", "error"} {
		m.success[reason] = r.requestSuccess.WithLabelValues(modelName, engine, reason)
	}
	return m
}

// CountRejected counts a request refused before it reached the engine
// (kvbridge:requests_rejected_total{reason}).
func (m *EngineMetrics) CountRejected(reason string) {
	m.rejected.WithLabelValues(m.modelName, m.engine, reason).Inc()
}

// CountUnknownField counts a request field that was present but ignored
// (kvbridge:request_unknown_fields_total{field}). Field names come from clients: the caller
// bounds the distinct values it passes.
func (m *EngineMetrics) CountUnknownField(field string) {
	m.unknownFields.WithLabelValues(m.modelName, m.engine, field).Inc()
}

// CountClientStalled counts a response whose client took no write within the write timeout
// (kvbridge:http_client_stalled_total).
func (m *EngineMetrics) CountClientStalled() { m.stalled.Inc() }

// ModelName returns the model_name label value.
func (m *EngineMetrics) ModelName() string { return m.modelName }

// SetStatsSource installs the function read at every scrape for vllm:num_requests_running,
// vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:prefix_cache_queries_total,
// vllm:prefix_cache_hits_total and vllm:num_preemptions_total. Until it is set those series
// read zero. fn must be cheap and safe for concurrent use.
func (m *EngineMetrics) SetStatsSource(fn func() SchedulerStats) {
	m.mu.Lock()
	m.stats = fn
	m.mu.Unlock()
}

func (m *EngineMetrics) snapshot() SchedulerStats {
	m.mu.Lock()
	fn := m.stats
	m.mu.Unlock()
	if fn == nil {
		return SchedulerStats{}
	}
	return fn()
}

// AddPromptTokens counts n prompt tokens (vllm:prompt_tokens_total).
func (m *EngineMetrics) AddPromptTokens(n int) {
	if n > 0 {
		m.promptTokens.Add(float64(n))
	}
}

// AddGenerationTokens counts n generated tokens (vllm:generation_tokens_total).
func (m *EngineMetrics) AddGenerationTokens(n int) {
	if n > 0 {
		m.generationTokens.Add(float64(n))
	}
}

// ObserveTimeToFirstToken records one request's time to first token.
func (m *EngineMetrics) ObserveTimeToFirstToken(d time.Duration) { m.ttft.Observe(d.Seconds()) }

// ObserveInterTokenLatency records the time between two consecutive outputs of one request.
func (m *EngineMetrics) ObserveInterTokenLatency(d time.Duration) { m.itl.Observe(d.Seconds()) }

// ObserveFinished records a finished request: vllm:request_success_total{finished_reason}
// and vllm:e2e_request_latency_seconds.
func (m *EngineMetrics) ObserveFinished(finishReason string, e2e time.Duration) {
	c, ok := m.success[finishReason]
	if !ok {
		c = m.successVec.WithLabelValues(m.modelName, m.engine, finishReason)
	}
	c.Inc()
	m.e2e.Observe(e2e.Seconds())
}

// Nixl returns the engine's NIXL connector metrics.
func (m *EngineMetrics) Nixl() *NixlMetrics { return m.nixl }

// schedulerCollector exposes the scheduler gauges, prefix-cache counters and preemption count of
// every engine by calling its stats source at scrape time.
type schedulerCollector struct {
	running, waiting, usage, queries, hits, preemptions *prometheus.Desc

	mu      sync.Mutex
	engines []*EngineMetrics
}

func newSchedulerCollector() *schedulerCollector {
	labels := []string{LabelModelName, LabelEngine}
	return &schedulerCollector{
		running: prometheus.NewDesc("vllm:num_requests_running",
			"Number of requests in model execution batches.", labels, nil),
		waiting: prometheus.NewDesc("vllm:num_requests_waiting",
			"Number of requests waiting to be processed.", labels, nil),
		usage: prometheus.NewDesc("vllm:kv_cache_usage_perc",
			"KV-cache usage. 1 means 100 percent usage.", labels, nil),
		queries: prometheus.NewDesc("vllm:prefix_cache_queries_total",
			"Prefix cache queries, in terms of number of queried tokens.", labels, nil),
		hits: prometheus.NewDesc("vllm:prefix_cache_hits_total",
			"Prefix cache hits, in terms of number of cached tokens.", labels, nil),
		preemptions: prometheus.NewDesc("vllm:num_preemptions_total",
			"Cumulative number of preemption from the engine.", labels, nil),
	}
}

func (c *schedulerCollector) add(m *EngineMetrics) {
	c.mu.Lock()
	c.engines = append(c.engines, m)
	c.mu.Unlock()
}

// Describe implements prometheus.Collector.
func (c *schedulerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.running
	ch <- c.waiting
	ch <- c.usage
	ch <- c.queries
	ch <- c.hits
	ch <- c.preemptions
}

// Collect implements prometheus.Collector.
func (c *schedulerCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	engines := append([]*EngineMetrics(nil), c.engines...)
	c.mu.Unlock()
	for _, m := range engines {
		s := m.snapshot()
		lv := []string{m.modelName, m.engine}
		ch <- prometheus.MustNewConstMetric(c.running, prometheus.GaugeValue, float64(s.Running), lv...)
		ch <- prometheus.MustNewConstMetric(c.waiting, prometheus.GaugeValue, float64(s.Waiting), lv...)
		ch <- prometheus.MustNewConstMetric(c.usage, prometheus.GaugeValue, s.KVCacheUsage, lv...)
		ch <- prometheus.MustNewConstMetric(c.queries, prometheus.CounterValue, float64(s.PrefixCacheQueries), lv...)
		ch <- prometheus.MustNewConstMetric(c.hits, prometheus.CounterValue, float64(s.PrefixCacheHits), lv...)
		ch <- prometheus.MustNewConstMetric(c.preemptions, prometheus.CounterValue, float64(s.Preemptions), lv...)
	}
}
