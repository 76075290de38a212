package metrics

import (
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Label names shared by every vLLM series.
const (
	LabelModelName      = "model_name"
	LabelEngine         = "engine"
	LabelFinishedReason = "finished_reason"
)

// Registry owns a Prometheus registry and all of kvbridge's collectors. Create one per process
// (or per test) with NewRegistry; it is safe for concurrent use.
type Registry struct {
	prom  *prometheus.Registry
	sched *schedulerCollector

	promptTokens     *prometheus.CounterVec
	generationTokens *prometheus.CounterVec
	requestSuccess   *prometheus.CounterVec
	rejected         *prometheus.CounterVec
	unknownFields    *prometheus.CounterVec
	stalled          *prometheus.CounterVec
	ttft             *prometheus.HistogramVec
	e2e              *prometheus.HistogramVec
	itl              *prometheus.HistogramVec

	nixl nixlVecs
	req  requestVecs

	mu      sync.Mutex
	engines map[engineKey]*EngineMetrics
}

type engineKey struct{ model, engine string }

// NewRegistry creates a registry with vLLM's request, token, latency, step, scheduler and NIXL
// series registered, plus the standard Go runtime and process collectors. The series that
// depend on an engine's configuration are added by EngineMetrics.Configure.
func NewRegistry() *Registry {
	labels := []string{LabelModelName, LabelEngine}
	r := &Registry{
		prom:    prometheus.NewRegistry(),
		sched:   newSchedulerCollector(),
		engines: make(map[engineKey]*EngineMetrics),
		promptTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:prompt_tokens_total",
			Help: "Number of prefill tokens processed.",
		}, labels),
		generationTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:generation_tokens_total",
			Help: "Number of generation tokens processed.",
		}, labels),
		requestSuccess: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:request_success_total",
			Help: "Count of successfully processed requests.",
		}, append(labels[:2:2], LabelFinishedReason)),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbridge:requests_rejected_total",
			Help: "Requests refused before reaching the engine, by reason (body_too_large, too_many_requests, prompt_too_long, invalid, unauthorized).",
		}, append(labels[:2:2], "reason")),
		unknownFields: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbridge:request_unknown_fields_total",
			Help: "Request fields present but ignored (unknown to the API), by field name; the first few distinct names get their own label, later ones field=\"other\".",
		}, append(labels[:2:2], "field")),
		stalled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbridge:http_client_stalled_total",
			Help: "Responses whose client took no write (or flush) within the write timeout (--write-timeout); the request's sequences were aborted.",
		}, labels),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vllm:time_to_first_token_seconds",
			Help:    "Histogram of time to first token in seconds.",
			Buckets: TTFTBuckets(),
		}, labels),
		e2e: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vllm:e2e_request_latency_seconds",
			Help:    "Histogram of e2e request latency in seconds.",
			Buckets: RequestLatencyBuckets(),
		}, labels),
		itl: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vllm:inter_token_latency_seconds",
			Help:    "Histogram of inter-token latency in seconds.",
			Buckets: InterTokenLatencyBuckets(),
		}, labels),
		nixl: newNixlVecs(labels),
		req:  newRequestVecs(labels),
	}
	r.prom.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		r.sched,
		r.promptTokens, r.generationTokens, r.requestSuccess, r.rejected, r.unknownFields, r.stalled,
		r.ttft, r.e2e, r.itl,
	)
	r.nixl.register(r.prom)
	r.req.register(r.prom)
	return r
}

// Prometheus returns the underlying registry, for registering further collectors or gathering.
func (r *Registry) Prometheus() *prometheus.Registry { return r.prom }

// Handler serves the registry in the Prometheus text exposition format (GET /metrics).
func (r *Registry) Handler() http.Handler {
	return promhttp.HandlerFor(r.prom, promhttp.HandlerOpts{Registry: r.prom})
}

// Engine returns the metrics of one engine, labelled model_name=modelName and engine=engine
// (vLLM uses the engine index, "0" for a single engine). Calling it again with the same labels
// returns the same *EngineMetrics. Every series of the engine is created at zero right away, so
// a scrape shows them before the first request.
func (r *Registry) Engine(modelName, engine string) *EngineMetrics {
	key := engineKey{modelName, engine}
	r.mu.Lock()
	defer r.mu.Unlock()
	if m, ok := r.engines[key]; ok {
		return m
	}
	m := newEngineMetrics(r, modelName, engine)
	r.engines[key] = m
	r.sched.add(m)
	return m
}

// TimeToFirstTokenTotal returns the sum of every observation of vllm:time_to_first_token_seconds
// (all engines of the registry): benchmarks that send one request at a time read it before and
// after a request to get that request's engine-side TTFT. It is zero before the first token.
func (r *Registry) TimeToFirstTokenTotal() (time.Duration, error) {
	mfs, err := r.prom.Gather()
	if err != nil {
		return 0, fmt.Errorf("metrics: gather: %w", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "vllm:time_to_first_token_seconds" {
			continue
		}
		var sum float64
		for _, m := range mf.GetMetric() {
			sum += m.GetHistogram().GetSampleSum()
		}
		return time.Duration(sum * float64(time.Second)), nil
	}
	return 0, nil
}
