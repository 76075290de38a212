package instance

import (
	"fmt"
	"time"
)

// Stats is a snapshot of a running engine: what it holds now and what it has counted since it
// started. It is the narrow view the benchmarks and the demo read (differences of two snapshots
// taken around a request), instead of reaching into the pool, the engine or the metrics
// registry. The counters are the ones /metrics serves, plus PulledTokens, which vLLM's metrics
// lack.
type Stats struct {
	// Running and Waiting count requests being computed and queued (Waiting includes those
	// waiting for a KV load); Held counts finished requests whose blocks the connector still
	// holds for a peer.
	Running, Waiting, Held int
	// FreeBlocks of the pool's NumBlocks KV blocks are free: all of them once the engine is idle
	// and holds nothing.
	FreeBlocks, NumBlocks int
	// PromptTokens counts the prompt tokens of requests that produced a first token
	// (vllm:prompt_tokens_total); PrefixHitTokens those found in the engine's own prefix cache
	// (vllm:prefix_cache_hits_total); PulledTokens those the connector loaded from a peer.
	PromptTokens, PrefixHitTokens, PulledTokens int64
	// TTFT is the sum of the engine's times to first token, each from the request's arrival at
	// the engine (vllm:time_to_first_token_seconds).
	TTFT time.Duration
	// StepTokens counts the tokens the engine's forward steps computed (the sum of
	// vllm:iteration_tokens_total): none for a push decoder's request that started from its
	// producer's first token and ended there.
	StepTokens int64
	// Transfers, TransferBytes and TransferTime describe the KV reads this engine made: how many,
	// their bytes and their summed durations (vllm:nixl_bytes_transferred,
	// vllm:nixl_xfer_time_seconds).
	Transfers, TransferBytes int64
	TransferTime             time.Duration
	// The connector's failure counters: vllm:nixl_num_failed_transfers_total,
	// vllm:nixl_num_failed_notifications_total, vllm:nixl_num_kv_expired_reqs_total and
	// vllm:nixl_num_notifications_after_expiry_total.
	FailedTransfers, FailedNotifications, ExpiredRequests, NotificationsAfterExpiry int64
}

// Stats returns a snapshot of the engine, summed over its data-parallel ranks. It may be called
// after Close (the counters then stay as they were, and every block is free).
func (in *Instance) Stats() (Stats, error) {
	var st Stats
	for _, rk := range in.Ranks {
		es := rk.Engine.Stats()
		st.Running += es.Running
		st.Waiting += es.Waiting
		st.Held += es.Delayed
		st.FreeBlocks += es.FreeBlocks
		st.NumBlocks += es.NumBlocks
		st.PromptTokens += es.PromptTokens
		st.PrefixHitTokens += es.PrefixHits
		st.PulledTokens += es.ExternalHits
	}
	families, err := in.Registry.Prometheus().Gather()
	if err != nil {
		return st, fmt.Errorf("instance: gather metrics: %w", err)
	}
	seconds := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	for _, f := range families {
		for _, m := range f.GetMetric() {
			h, c := m.GetHistogram(), int64(m.GetCounter().GetValue())
			switch f.GetName() {
			case "vllm:time_to_first_token_seconds":
				st.TTFT += seconds(h.GetSampleSum())
			case "vllm:iteration_tokens_total":
				st.StepTokens += int64(h.GetSampleSum())
			case "vllm:nixl_xfer_time_seconds":
				st.Transfers += int64(h.GetSampleCount())
				st.TransferTime += seconds(h.GetSampleSum())
			case "vllm:nixl_bytes_transferred":
				st.TransferBytes += int64(h.GetSampleSum())
			case "vllm:nixl_num_failed_transfers_total":
				st.FailedTransfers += c
			case "vllm:nixl_num_failed_notifications_total":
				st.FailedNotifications += c
			case "vllm:nixl_num_kv_expired_reqs_total":
				st.ExpiredRequests += c
			case "vllm:nixl_num_notifications_after_expiry_total":
				st.NotificationsAfterExpiry += c
			}
		}
	}
	return st, nil
}
