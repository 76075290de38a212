package metrics

// Bucket lists are vLLM's (vllm/v1/metrics/loggers.py and the NIXL connector's stats). Each
// function returns a fresh slice.

// TTFTBuckets are the buckets of vllm:time_to_first_token_seconds.
func TTFTBuckets() []float64 {
	return []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
		0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
}

// InterTokenLatencyBuckets are the buckets of vllm:inter_token_latency_seconds (the same as
// vLLM's time-per-output-token buckets).
func InterTokenLatencyBuckets() []float64 {
	return []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
}

// RequestLatencyBuckets are the buckets of vllm:e2e_request_latency_seconds.
func RequestLatencyBuckets() []float64 {
	return []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
		40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
}

// NixlPostTimeBuckets are the buckets of vllm:nixl_post_time_seconds.
func NixlPostTimeBuckets() []float64 {
	return []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0}
}

// NixlXferTimeBuckets are the buckets of vllm:nixl_xfer_time_seconds: the post-time list
// without its first element.
func NixlXferTimeBuckets() []float64 { return NixlPostTimeBuckets()[1:] }

// NixlBytesBuckets are the buckets of vllm:nixl_bytes_transferred: 2^11, 2^13, …, 2^33.
func NixlBytesBuckets() []float64 {
	b := make([]float64, 0, 12)
	for e := 11; e <= 33; e += 2 {
		b = append(b, float64(uint64(1)<<e))
	}
	return b
}

// NixlDescriptorBuckets are the buckets of vllm:nixl_num_descriptors.
func NixlDescriptorBuckets() []float64 {
	return []float64{10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000}
}

// RequestPhaseBuckets are the buckets of vLLM's per-request phase histograms
// (vllm:request_queue_time_seconds, _prefill_time_seconds, _decode_time_seconds and
// _inference_time_seconds): vLLM's request_latency_buckets, the list of
// vllm:e2e_request_latency_seconds.
func RequestPhaseBuckets() []float64 { return RequestLatencyBuckets() }

// TimePerOutputTokenBuckets are the buckets of vllm:request_time_per_output_token_seconds: the
// inter-token latency list.
func TimePerOutputTokenBuckets() []float64 { return InterTokenLatencyBuckets() }

// IterationTokensBuckets are the buckets of vllm:iteration_tokens_total.
func IterationTokensBuckets() []float64 {
	return []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}
}

// RequestParamsNBuckets are the buckets of vllm:request_params_n.
func RequestParamsNBuckets() []float64 { return []float64{1, 2, 5, 10, 20} }

// Buckets125 is vLLM's build_1_2_5_buckets(max): 1, 2, 5, 10, 20, 50, … up to and including
// max. It gives the buckets of the token-count histograms (vllm:request_prompt_tokens,
// _generation_tokens, _max_num_generation_tokens, vllm:request_params_max_tokens), with max the
// engine's max_model_len.
func Buckets125(max int) []float64 {
	var b []float64
	for p := 1; ; p *= 10 {
		for _, m := range []int{1, 2, 5} {
			if p > max/m { // m*p > max
				return b
			}
			b = append(b, float64(m*p))
		}
		if p > max/10 { // the next power of ten is past max (and might overflow)
			return b
		}
	}
}
