// Package pdbench measures disaggregated prefill/decode end to end, in one process on
// 127.0.0.1 or across hosts, and backs `kvbridge bench pd` and `kvbridge bench proxy`.
//
// RunPD starts a single engine, a prefiller P, a decoder D (NixlConnector on the SHM or TCP
// backend) and the one-way proxy on one opened model, and for each prompt length compares the
// time to the first token through the proxy with the single engine's, measures D's KV read
// against a single-goroutine memcpy of as many bytes in the same run, and breaks the P/D time
// down: the proxy's hops and legs (seen by a tracing transport under the proxy), each engine's
// own TTFT (from its vllm:time_to_first_token_seconds histogram), the read, and D's one-token
// recompute timed alone. With PDOptions.Hosts the single engine, P and D are kvbridge processes
// on hosts of their own (network namespaces joined by a bridge: package netns), read over HTTP
// (/metrics), with the proxy in this process on a client host; P and D use TCP, and the ceiling
// is the better of two raw TCP streams of the same bytes from P's host to D's (one connection,
// and four as the transfer engine opens), measured right after each request.
//
// RunProxy starts P, D and the proxy on kvbridge/tiny and runs closed loops of short requests
// at several concurrency levels, alternately through the proxy and straight to the engines
// (the benchmark making the P and D legs itself), and reports requests/s, the latency the proxy
// adds at p50 and p99, and the CPU time per request both ways.
//
// Neither asserts anything about speed; the figures are printed next to ceilings measured in
// the same run, as ratios. Both start their engines and proxy through package stack and read the
// engines through instance.Stats. See docs/architecture.md for where the package sits.
package pdbench
