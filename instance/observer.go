package instance

import (
	"time"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/metrics"
)

// engineObserver records a rank's engine observations into its metrics: the engine reports
// values and imports no metrics library; this adapter is the one place that maps them to vLLM's
// series. The HTTP layer records the series it sees itself (time to first token, end-to-end
// latency, tokens, the n parameter).
type engineObserver struct{ m *metrics.EngineMetrics }

// FirstToken implements engine.Observer; the time to first token is the HTTP layer's.
func (engineObserver) FirstToken(string, time.Duration) {}

// Finished implements engine.Observer.
func (o engineObserver) Finished(r engine.RequestMetrics) {
	o.m.ObserveRequest(metrics.RequestSample{
		PromptTokens: r.PromptTokens, GenerationTokens: r.CompletionTokens, MaxTokens: r.MaxTokens,
		Scheduled: r.Scheduled, Queue: r.Queue, Prefill: r.Prefill, Decode: r.Decode, Inference: r.Inference,
	})
}

// Stepped implements engine.Observer.
func (o engineObserver) Stepped(s engine.StepMetrics) {
	o.m.ObserveStep(metrics.StepSample{Tokens: s.Tokens, Prompts: metrics.PromptSources{
		LocalCompute: s.LocalCompute, LocalCacheHit: s.LocalCacheHit, ExternalKVTransfer: s.ExternalKVTransfer,
	}})
}
