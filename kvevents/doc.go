// Package kvevents publishes an engine's KV cache events as vLLM does (--kv-events-config,
// vllm/distributed/kv_events.py): every step's prefix-cache changes (kvcache.Event: blocks
// stored, removed, all cleared) become one EventBatch, encoded with msgpack in the layout vLLM's
// msgspec structs give it and sent on a ZeroMQ PUB socket as the multipart message [topic,
// sequence number (8 bytes big-endian), payload], with a ROUTER replay socket that resends the
// last buffer_steps batches from a sequence number a subscriber asks for. A router (llm-d's
// KV-cache-aware scheduler, or a later kvbridge proxy) follows which instance holds which
// prefix.
//
// The pool records events without I/O; the engine drains them once per step into a Publisher,
// which queues them (bounded: the oldest batch is dropped and counted when the queue is full) for
// its own goroutine, so the step loop never waits on the network. ZeroMQ is spoken in pure Go
// (github.com/go-zeromq/zmq4). See docs/kv-events.md for what matches vLLM and what differs.
package kvevents
