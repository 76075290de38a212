// Package proxy routes OpenAI requests between prefill (P) and decode (D) engines, as vLLM's toy
// proxy and multi-turn proxy do: P computes the prompt's KV cache with max_tokens=1 and returns
// kv_transfer_params, D receives the client's original request plus those params, pulls the KV
// and generates. It talks to engines over HTTP only. The map of the whole system is
// docs/architecture.md.
//
// Both proxies share one prefill leg (legs.go: P's body from payload.go's prefillRequest,
// replayable, P's 4xx relayed and anything else a 502 prefill_request_failed) and one decode
// relay (decode.go). They differ where vLLM's two proxies differ, on purpose:
//
//   - the one-way proxy (the toy proxy) forwards the client's body to D unchanged but for P's
//     params (conformance item 2): D streams only if the client asked;
//   - the multi-turn proxy asks D for a stream with usage when the client streams (vLLM's always
//     streams from D; an engine of kvbridge returns its params in JSON bodies too, so a client
//     that asked for no stream gets D's own JSON answer, every choice and logprob in it),
//     rewrites remote_host in P's params to P's HTTP host and in D's to D's (docs/architecture.md,
//     wire contract item 36), and
//     caches D's params per conversation.
//
// vLLM's multi-turn proxy removes max_completion_tokens from P's leg where the toy proxy sets it
// to 1; the two are the same request to P (max_tokens is 1 either way), and both proxies here
// set it to 1.
//
// kvbridge's engines refuse a leg their kv_role cannot serve, where vLLM's ignore kv_role with the
// NixlConnector: a proxy with P and D swapped gets the consumer's 400 on the prefill leg and
// relays it to the client, instead of a 200 with every prompt recomputed. Both proxies also
// count, by reason, the requests served without a KV transfer — P returned no params, or D's
// usage says it pulled nothing — in /healthcheck (and the multi-turn proxy's /metrics), and warn
// once per instance a minute with the likely cause (transferwatch.go); `kvbridge check` reads them.
//
// Both proxies also run vLLM's push mode (NixlPushConnector: D registers its blocks with P, P
// WRITEs the KV): transfermode.go picks the flow per prefill engine from its GET
// /v1/kv_transfer or Config.TransferMode, and push.go runs it — both legs at once, tied by a
// push_id the proxy draws (ai-dynamo/dynamo #13311's flow), or vLLM's toy push proxy's serial
// flow. The multi-turn proxy pushes only turns that pull nothing from D.
//
// Where the Python proxies fall short, this one does better: D's status reaches the client (not a
// 200 with a truncated body), a failed P leg is a 502 with a JSON error code, SSE is relayed event
// by event with flushes, a client that goes away cancels both legs — until the proxy writes
// [DONE], after which its bookkeeping no longer depends on the client — client-supplied
// kv_transfer_params are refused and the engines' never reach a client, and timeouts apply to the
// request body, the time to response headers and stream idleness, never to a request's total
// duration. Health is checked, not assumed (health.go): /healthcheck (and the multi-turn proxy's
// /health) keeps the toy proxy's 200 JSON and adds each engine's state from a probe of its
// /health and the store's from a Redis PING; /ready answers 503 when no prefiller, no decoder or
// the store answers.
//
// Engines are chosen as vLLM's toy proxy does, round-robin, or (route.go) by load, or by KV: with
// the prefillers' KV cache events (kvsub.go, decoded from vLLM's schema) the proxy keeps an index
// of the block hashes each holds (kvindex.go) and sends a prompt to the prefiller holding the
// longest prefix of its block-hash chain, weighted by load; it never fails a request for want of
// an index or of tokens.
package proxy
