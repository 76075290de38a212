// Package proxy routes OpenAI requests between prefill (P) and decode (D) engines, as vLLM's toy
// proxy and multi-turn proxy do: P computes the prompt's KV cache with max_tokens=1 and returns
// kv_transfer_params, D receives the client's original request plus those params, pulls the KV
// and generates. It talks to engines over HTTP only.
//
// Where the Python proxies fall short, this one does better: D's status reaches the client (not a
// 200 with a truncated body), a failed P leg is a 502 with a JSON error code, SSE is relayed event
// by event with flushes, a client that goes away cancels both legs, and timeouts apply to the time
// to response headers and to stream idleness, never to a request's total duration.
package proxy
