package multiturn

// RequestStats is the record of one successful request; its JSON keys are those of vLLM's
// --stats-json-output.
type RequestStats struct {
	// TTFTMs is the time to the first content chunk; when that chunk holds k > 1 tokens it is
	// corrected to (chunk TTFT − (k−1)·TPOT), at least 0.1 ms.
	TTFTMs float64 `json:"ttft_ms"`
	// TPOTMs is (latency − chunk TTFT) ÷ (output tokens − first-chunk tokens); 0 when the output
	// came in one chunk.
	TPOTMs float64 `json:"tpot_ms"`
	// LatencyMs is the time to [DONE] (to the end of the body without streaming).
	LatencyMs float64 `json:"latency_ms"`
	// StartTimeMs is when the request was sent, in ms since the start of the benchmark.
	StartTimeMs float64 `json:"start_time_ms"`
	// InputNumTurns is the number of messages sent (1, 3, 5, … for user turns 1, 2, 3, …).
	InputNumTurns int `json:"input_num_turns"`
	// InputNumTokens is the tokens of all message contents sent (no chat template).
	InputNumTokens int `json:"input_num_tokens"`
	// OutputNumTokens is the tokens of the answer.
	OutputNumTokens int `json:"output_num_tokens"`
	// OutputNumChunks counts the answer's content chunks after the first (vLLM's definition).
	OutputNumChunks int `json:"output_num_chunks"`
	// OutputNumFirstChunkTokens is the tokens of the first content chunk.
	OutputNumFirstChunkTokens int `json:"output_num_first_chunk_tokens"`
	// ApproxCachedPercent is 100 × history tokens ÷ input tokens: the share of the prompt a
	// prefix cache could serve.
	ApproxCachedPercent float64 `json:"approx_cached_percent"`
	ConversationID      string  `json:"conversation_id"`
	ClientID            int     `json:"client_id"`
}

// Turn returns the user turn the request was (1 for the first user message).
func (s RequestStats) Turn() int { return (s.InputNumTurns + 1) / 2 }
