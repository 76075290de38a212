package metrics

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Values of the source label of vllm:prompt_tokens_by_source_total (vLLM's
// PromptTokenStats.ALL_SOURCES).
const (
	SourceLocalCompute       = "local_compute"
	SourceLocalCacheHit      = "local_cache_hit"
	SourceExternalKVTransfer = "external_kv_transfer"
)

// PromptSources splits the prompt tokens of requests that finished their prefill by where their
// KV came from (vllm:prompt_tokens_by_source_total). As in vLLM, a prompt whose KV was wholly
// supplied by the connector still has its last token computed here for its logits: that token
// counts in both LocalCompute and ExternalKVTransfer, so the three add up to the prompt plus
// such recomputed tokens.
type PromptSources struct {
	LocalCompute       int // tokens computed by this engine's forward passes
	LocalCacheHit      int // tokens found in this engine's prefix cache
	ExternalKVTransfer int // tokens whose KV the connector pulled from another engine
}

// StepSample is one engine step (vLLM's IterationStats, as far as kvbridge's engine has it).
type StepSample struct {
	// Tokens is the number of tokens the step's forward pass computed
	// (vllm:iteration_tokens_total). vLLM observes the prompts of the requests that finished
	// their prefill in the step plus the tokens sampled; kvbridge observes the work done, so a
	// decoder's step over a pulled prompt counts its one recomputed token, not the prompt.
	Tokens int
	// Prompts sums the prompt sources of the requests that sampled their first token in the
	// step.
	Prompts PromptSources
}

// RequestSample is one finished engine request (vLLM's FinishedRequestStats). The phases are
// vLLM's: queue from arrival at the engine to the first time it was scheduled to run (for a
// request that pulls KV, the pull is part of its queue time, as in vLLM), prefill from then to
// its first token, decode from the first token to the last, inference from scheduled to the last
// token.
type RequestSample struct {
	PromptTokens, GenerationTokens int
	// MaxTokens is the request's max_tokens (0: none; not observed).
	MaxTokens int
	// Scheduled reports whether the request ever ran (else it has no phases at all).
	Scheduled bool
	// Queue, Prefill, Decode and Inference are the phases; Prefill, Decode and Inference are
	// observed only for a request that generated a token.
	Queue, Prefill, Decode, Inference time.Duration
}

// CacheConfig is the engine's KV cache configuration, exposed as the labels of
// vllm:cache_config_info (vLLM's CacheConfig.metrics_info: field name = str(value)). Only the
// fields kvbridge has are exposed.
type CacheConfig struct {
	BlockSize            int
	CacheDType           string  // --kv-cache-dtype ("auto" when empty)
	EnablePrefixCaching  bool    // --enable-prefix-caching
	GPUMemoryUtilization float64 // --gpu-memory-utilization (0: not set, the pool was sized otherwise)
	NumGPUBlocks         int     // blocks of the KV pool
	KVCacheMemoryBytes   int64   // --kv-cache-memory-bytes (0: not set)
}

// cacheConfigLabels are the label names of vllm:cache_config_info, in order.
var cacheConfigLabels = []string{"block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
	"kv_cache_memory_bytes", "num_cpu_blocks", "num_gpu_blocks", LabelEngine}

// values renders c as vLLM's metrics_info does (Python's str of each field) for engine.
func (c CacheConfig) values(engine string) []string {
	dtype := c.CacheDType
	if dtype == "" {
		dtype = "auto"
	}
	util, mem := "None", "None"
	if c.GPUMemoryUtilization > 0 {
		util = strconv.FormatFloat(c.GPUMemoryUtilization, 'f', -1, 64)
		if _, err := strconv.Atoi(util); err == nil {
			util += ".0" // Python prints 1.0, not 1
		}
	}
	if c.KVCacheMemoryBytes > 0 {
		mem = strconv.FormatInt(c.KVCacheMemoryBytes, 10)
	}
	caching := "False"
	if c.EnablePrefixCaching {
		caching = "True"
	}
	return []string{strconv.Itoa(c.BlockSize), dtype, caching, util, mem, "None", strconv.Itoa(c.NumGPUBlocks), engine}
}

// EngineConfig is what the per-engine series need to know about the engine, once it is built.
type EngineConfig struct {
	// MaxModelLen bounds the token-count histograms' buckets (Buckets125).
	MaxModelLen int
	// Cache is exposed as vllm:cache_config_info.
	Cache CacheConfig
}

// requestVecs holds the labelled request and step collectors of a Registry.
type requestVecs struct {
	bySource                          *prometheus.CounterVec
	iterationTokens, paramsN          *prometheus.HistogramVec
	queue, prefill, decode, inference *prometheus.HistogramVec
	tpot                              *prometheus.HistogramVec
	cacheInfo                         *prometheus.GaugeVec
}

func newRequestVecs(labels []string) requestVecs {
	hist := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, labels)
	}
	return requestVecs{
		bySource: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:prompt_tokens_by_source_total",
			Help: "Number of prompt tokens by source.",
		}, append(labels[:len(labels):len(labels)], "source")),
		iterationTokens: hist("vllm:iteration_tokens_total",
			"Histogram of number of tokens per engine_step.", IterationTokensBuckets()),
		paramsN: hist("vllm:request_params_n",
			"Histogram of the n request parameter.", RequestParamsNBuckets()),
		queue: hist("vllm:request_queue_time_seconds",
			"Histogram of time spent in WAITING phase for request.", RequestPhaseBuckets()),
		prefill: hist("vllm:request_prefill_time_seconds",
			"Histogram of time spent in PREFILL phase for request.", RequestPhaseBuckets()),
		decode: hist("vllm:request_decode_time_seconds",
			"Histogram of time spent in DECODE phase for request.", RequestPhaseBuckets()),
		inference: hist("vllm:request_inference_time_seconds",
			"Histogram of time spent in RUNNING phase for request.", RequestPhaseBuckets()),
		tpot: hist("vllm:request_time_per_output_token_seconds",
			"Histogram of time_per_output_token_seconds per request.", TimePerOutputTokenBuckets()),
		cacheInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vllm:cache_config_info",
			Help: "Information of the LLMEngine CacheConfig",
		}, cacheConfigLabels),
	}
}

func (v requestVecs) register(r *prometheus.Registry) {
	r.MustRegister(v.bySource, v.iterationTokens, v.paramsN, v.queue, v.prefill, v.decode, v.inference,
		v.tpot, v.cacheInfo)
}

// requestMetrics are one engine's request and step series.
type requestMetrics struct {
	bySource                          [3]prometheus.Counter // local_compute, local_cache_hit, external_kv_transfer
	iterationTokens, paramsN          prometheus.Observer
	queue, prefill, decode, inference prometheus.Observer
	tpot                              prometheus.Observer
}

func (v requestVecs) forEngine(modelName, engine string) requestMetrics {
	m := requestMetrics{
		iterationTokens: v.iterationTokens.WithLabelValues(modelName, engine),
		paramsN:         v.paramsN.WithLabelValues(modelName, engine),
		queue:           v.queue.WithLabelValues(modelName, engine),
		prefill:         v.prefill.WithLabelValues(modelName, engine),
		decode:          v.decode.WithLabelValues(modelName, engine),
		inference:       v.inference.WithLabelValues(modelName, engine),
		tpot:            v.tpot.WithLabelValues(modelName, engine),
	}
	for i, s := range []string{SourceLocalCompute, SourceLocalCacheHit, SourceExternalKVTransfer} {
		m.bySource[i] = v.bySource.WithLabelValues(modelName, engine, s)
	}
	return m
}

// lengthHistograms are one engine's token-count histograms, whose buckets depend on its
// max_model_len. Each engine's are collectors of their own (the labels are constant), so engines
// of one registry may differ.
type lengthHistograms struct {
	prompt, generation, maxGeneration, maxTokens prometheus.Histogram
}

// errConfigured reports a second Configure of an engine.
var errConfigured = errors.New("metrics: engine already configured")

// Configure registers the engine's series that depend on its configuration:
// vllm:request_prompt_tokens, vllm:request_generation_tokens,
// vllm:request_max_num_generation_tokens and vllm:request_params_max_tokens (buckets
// Buckets125(c.MaxModelLen)), and vllm:cache_config_info. Call it once, when the engine is built;
// until then those series are absent and requests are not counted in them.
func (m *EngineMetrics) Configure(c EngineConfig) error {
	if c.MaxModelLen < 1 {
		return fmt.Errorf("metrics: max model length %d: must be at least 1", c.MaxModelLen)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.lengths != nil {
		return errConfigured
	}
	buckets := Buckets125(c.MaxModelLen)
	hist := func(name, help string) prometheus.Histogram {
		return prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets,
			ConstLabels: prometheus.Labels{LabelModelName: m.modelName, LabelEngine: m.engine}})
	}
	l := &lengthHistograms{
		prompt:        hist("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
		generation:    hist("vllm:request_generation_tokens", "Number of generation tokens processed."),
		maxGeneration: hist("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens."),
		maxTokens:     hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."),
	}
	for _, h := range []prometheus.Collector{l.prompt, l.generation, l.maxGeneration, l.maxTokens} {
		if err := m.reg.Register(h); err != nil {
			return fmt.Errorf("metrics: register the token-count histograms of engine %s: %w", m.engine, err)
		}
	}
	m.cacheInfo.WithLabelValues(c.Cache.values(m.engine)...).Set(1)
	m.lengths = l
	return nil
}

func (m *EngineMetrics) lengthHistograms() *lengthHistograms {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lengths
}

// ObserveStep records one engine step: vllm:iteration_tokens_total and the prompt sources of
// the requests that finished their prefill in it (vllm:prompt_tokens_by_source_total).
func (m *EngineMetrics) ObserveStep(s StepSample) {
	if s.Tokens > 0 {
		m.req.iterationTokens.Observe(float64(s.Tokens))
	}
	for i, n := range []int{s.Prompts.LocalCompute, s.Prompts.LocalCacheHit, s.Prompts.ExternalKVTransfer} {
		if n > 0 {
			m.req.bySource[i].Add(float64(n))
		}
	}
}

// ObserveRequest records one finished engine request: its phases
// (vllm:request_queue_time_seconds, _prefill_time_seconds, _decode_time_seconds,
// _inference_time_seconds), its mean time per output token after the first
// (vllm:request_time_per_output_token_seconds, when it generated two tokens or more) and, once
// Configure ran, its token counts (vllm:request_prompt_tokens, _generation_tokens,
// vllm:request_params_max_tokens).
func (m *EngineMetrics) ObserveRequest(r RequestSample) {
	if r.Scheduled {
		m.req.queue.Observe(r.Queue.Seconds())
		if r.GenerationTokens > 0 {
			m.req.prefill.Observe(r.Prefill.Seconds())
			m.req.decode.Observe(r.Decode.Seconds())
			m.req.inference.Observe(r.Inference.Seconds())
			if r.GenerationTokens > 1 {
				m.req.tpot.Observe(r.Decode.Seconds() / float64(r.GenerationTokens-1))
			}
		}
	}
	if l := m.lengthHistograms(); l != nil {
		l.prompt.Observe(float64(r.PromptTokens))
		l.generation.Observe(float64(r.GenerationTokens))
		if r.MaxTokens > 0 {
			l.maxTokens.Observe(float64(r.MaxTokens))
		}
	}
}

// ObserveParentRequest records a finished client request of n sequences (the n parameter) whose
// longest sequence generated maxGenerationTokens tokens: vllm:request_params_n and, once Configure
// ran, vllm:request_max_num_generation_tokens.
func (m *EngineMetrics) ObserveParentRequest(n, maxGenerationTokens int) {
	m.req.paramsN.Observe(float64(n))
	if l := m.lengthHistograms(); l != nil {
		l.maxGeneration.Observe(float64(maxGenerationTokens))
	}
}
