package engine

// FinishReason is why a request ended, as the OpenAI API's finish_reason reports it: the string
// values of vLLM's FinishReason (vllm/v1/engine/__init__.py, FINISH_REASON_STRINGS), so that
// a FinishReason marshals to the same JSON string. "stop" and "length" are OpenAI's own values;
// "abort" and "error" are vLLM's additions. A request that has not finished has none ("").
type FinishReason string

// The finish reasons of the four finished states (Status.FinishReason).
const (
	// FinishStop: the model sampled EOS or a stop token id, or the text reached a stop string
	// (OpenAI "stop", vLLM FinishReason.STOP; Status FINISHED_STOPPED).
	FinishStop FinishReason = "stop"
	// FinishLength: max_tokens was generated or the model length reached (OpenAI "length", vLLM
	// FinishReason.LENGTH; Status FINISHED_LENGTH_CAPPED).
	FinishLength FinishReason = "length"
	// FinishAbort: the request was aborted — the client went away or the engine closed (vLLM
	// FinishReason.ABORT; Status FINISHED_ABORTED).
	FinishAbort FinishReason = "abort"
	// FinishError: a request-level error ended it — a forward failure, or a KV load failure under
	// kv_load_failure_policy fail; vLLM answers it with HTTP 500 (vLLM FinishReason.ERROR; Status
	// FINISHED_ERROR).
	FinishError FinishReason = "error"
)
