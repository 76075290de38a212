package engine

import "time"

// Stats is a snapshot of the engine for metrics (vLLM's gauges and counters; see the metrics
// package for the Prometheus names). Counters only grow.
type Stats struct {
	// Running and Waiting count requests (vllm:num_requests_running / _waiting); Waiting
	// includes WaitingForRemote, the requests parked for their connector's KV load. Delayed
	// counts finished requests whose blocks the connector still holds.
	Running, Waiting, WaitingForRemote, Delayed int
	// KVUsage is the fraction of KV blocks in use (vllm:kv_cache_usage_perc, 0..1).
	KVUsage float64
	// NumBlocks and FreeBlocks describe the pool.
	NumBlocks, FreeBlocks int
	// PrefixQueries and PrefixHits are prompt tokens looked up in and found in the prefix cache
	// (vllm:prefix_cache_queries / _hits), counted at each request's first admission.
	PrefixQueries, PrefixHits int64
	// ExternalHits is the prompt tokens supplied by the connector.
	ExternalHits int64
	// PromptTokens and GenerationTokens count prompt tokens of requests that produced a first
	// token and sampled tokens (vllm:prompt_tokens_total / generation_tokens_total).
	PromptTokens, GenerationTokens int64
	// Preemptions counts preemptions (vllm:num_preemptions_total).
	Preemptions int64
	// LoadFailures counts failed asynchronous KV loads; RecomputedTokens the tokens recomputed
	// because of them (policy recompute).
	LoadFailures, RecomputedTokens int64
	// Steps counts model forward steps.
	Steps int64
}

// RequestMetrics describes one finished request.
type RequestMetrics struct {
	// ID is the request id.
	ID string
	// FinishReason is FinishStop, FinishLength, FinishAbort or FinishError.
	FinishReason FinishReason
	// PromptTokens, CachedTokens and CompletionTokens are the request's usage counts.
	PromptTokens, CachedTokens, CompletionTokens int
	// TTFT is the time from arrival to the first token (0 if there was none).
	TTFT time.Duration
	// E2E is the time from arrival to finish (vllm:e2e_request_latency_seconds).
	E2E time.Duration
	// Preemptions is how many times the request was preempted.
	Preemptions int
	// MaxTokens is the request's max_tokens.
	MaxTokens int
	// Scheduled reports whether the request ever ran. Queue is the time from its arrival to the
	// first time it was scheduled (a request waiting for its connector's KV load is scheduled
	// once the load is done, as in vLLM); Prefill from then to its first token; Decode from its
	// first token to its last; Inference from scheduled to its last token. Prefill, Decode and
	// Inference are zero without a token.
	Scheduled                         bool
	Queue, Prefill, Decode, Inference time.Duration
}

// StepMetrics describes one engine step (a forward pass).
type StepMetrics struct {
	// Tokens is the number of tokens the step computed.
	Tokens int
	// LocalCompute, LocalCacheHit and ExternalKVTransfer sum Sequence.PromptSources over the
	// requests that sampled their first token in the step.
	LocalCompute, LocalCacheHit, ExternalKVTransfer int
}

// Observer receives per-request and per-step observations (the instance records them into its
// metrics; the engine
// imports no metrics library). Methods are called on the engine's step loop: they must be quick
// and must not call back into the engine.
type Observer interface {
	// FirstToken is called when a request samples its first token, with its time to first
	// token (vllm:time_to_first_token_seconds).
	FirstToken(id string, ttft time.Duration)
	// Finished is called once per request when it finishes, in any way.
	Finished(m RequestMetrics)
	// Stepped is called after every step whose forward pass succeeded.
	Stepped(s StepMetrics)
}

// noObserver discards observations.
type noObserver struct{}

func (noObserver) FirstToken(string, time.Duration) {}
func (noObserver) Finished(RequestMetrics)          {}
func (noObserver) Stepped(StepMetrics)              {}
