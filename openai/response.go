package openai

// JSON shapes of responses, following vLLM's pydantic models field for field (null fields
// included where vLLM emits them).

// usageInfo is the "usage" object.
type usageInfo struct {
	PromptTokens     int `json:"prompt_tokens"`
	TotalTokens      int `json:"total_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	// PromptTokensDetails is set only with Config.PromptTokensDetails.
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

// promptTokensDetails reports the prompt tokens not computed by this engine: cached_tokens
// (OpenAI's field) counts them all; external_cached_tokens (a kvbridge extension) the part
// pulled from a remote engine by the KV connector, so that transferred tokens can be told from
// local prefix-cache hits.
type promptTokensDetails struct {
	CachedTokens         int `json:"cached_tokens"`
	ExternalCachedTokens int `json:"external_cached_tokens"`
}

// completionResponse is a non-streaming /v1/completions response.
type completionResponse struct {
	ID               string             `json:"id"`
	Object           string             `json:"object"` // "text_completion"
	Created          int64              `json:"created"`
	Model            string             `json:"model"`
	Choices          []completionChoice `json:"choices"`
	Usage            *usageInfo         `json:"usage"`
	KVTransferParams map[string]any     `json:"kv_transfer_params"`
}

// completionChoice is one choice of a completion response.
type completionChoice struct {
	Index          int                 `json:"index"`
	Text           string              `json:"text"`
	Logprobs       *completionLogprobs `json:"logprobs"`
	FinishReason   *string             `json:"finish_reason"`
	StopReason     any                 `json:"stop_reason"`
	PromptLogprobs *promptLogprobs     `json:"prompt_logprobs"`
}

// completionChunkChoice is the choice of a completion chunk.
type completionChunkChoice struct {
	Index        int                 `json:"index"`
	Text         string              `json:"text"`
	Logprobs     *completionLogprobs `json:"logprobs"`
	FinishReason *string             `json:"finish_reason"`
	StopReason   any                 `json:"stop_reason"`
}

// completionChunk is one streamed /v1/completions event.
type completionChunk struct {
	ID               string                  `json:"id"`
	Object           string                  `json:"object"` // "text_completion"
	Created          int64                   `json:"created"`
	Model            string                  `json:"model"`
	Choices          []completionChunkChoice `json:"choices"`
	Usage            *usageInfo              `json:"usage,omitempty"`
	KVTransferParams map[string]any          `json:"kv_transfer_params,omitempty"`
}

// chatResponse is a non-streaming /v1/chat/completions response.
type chatResponse struct {
	ID               string          `json:"id"`
	Object           string          `json:"object"` // "chat.completion"
	Created          int64           `json:"created"`
	Model            string          `json:"model"`
	Choices          []chatChoice    `json:"choices"`
	Usage            *usageInfo      `json:"usage"`
	PromptLogprobs   *promptLogprobs `json:"prompt_logprobs"`
	KVTransferParams map[string]any  `json:"kv_transfer_params"`
}

// chatChoice is one choice of a chat response.
type chatChoice struct {
	Index        int           `json:"index"`
	Message      chatMessage   `json:"message"`
	Logprobs     *chatLogprobs `json:"logprobs"`
	FinishReason *string       `json:"finish_reason"`
	StopReason   any           `json:"stop_reason"`
}

// chatMessage is the assistant message of a chat response.
type chatMessage struct {
	Role      string `json:"role"`
	Content   string `json:"content"`
	ToolCalls []any  `json:"tool_calls"`
}

// chatChunk is one streamed /v1/chat/completions event.
type chatChunk struct {
	ID               string            `json:"id"`
	Object           string            `json:"object"` // "chat.completion.chunk"
	Created          int64             `json:"created"`
	Model            string            `json:"model"`
	Choices          []chatChunkChoice `json:"choices"`
	Usage            *usageInfo        `json:"usage,omitempty"`
	KVTransferParams map[string]any    `json:"kv_transfer_params,omitempty"`
}

// chatChunkChoice is the choice of a chat chunk.
type chatChunkChoice struct {
	Index        int           `json:"index"`
	Delta        chatDelta     `json:"delta"`
	Logprobs     *chatLogprobs `json:"logprobs"`
	FinishReason *string       `json:"finish_reason"`
	StopReason   any           `json:"stop_reason,omitempty"`
}

// chatDelta is the incremental message of a chat chunk.
type chatDelta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}
