// Package openai is kvbridge's OpenAI-compatible HTTP API, shaped like vLLM's server:
// POST /v1/completions and /v1/chat/completions (JSON or SSE streaming, with the vLLM extension
// kv_transfer_params on requests and responses), GET /v1/models, /health, /metrics and /version.
//
// Errors use OpenAI's JSON shape {"error":{"message","type","param","code"}} with the HTTP status
// vLLM uses. A streaming request that fails after its headers went out gets one SSE event carrying
// that JSON, then "data: [DONE]". A client that goes away cancels its request context, which
// aborts the engine request and frees its KV blocks.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package openai
