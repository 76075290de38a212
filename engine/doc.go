// Package engine is kvbridge's inference engine: the request lifecycle and its states, a
// deterministic scheduler (continuous batching, chunked prefill, prefix caching, preemption) and
// the step loop that runs the model.
//
// # Layers
//
// The Scheduler is a state machine without I/O, in the manner of etcd-io/raft's Ready/Advance: it
// starts no goroutines, reads no clock (every method that needs the time takes it as an argument)
// and is driven by one owner:
//
//	plan := s.Schedule(now)          // which requests compute which tokens, with their blocks
//	... run the model over plan.Work, sample one token per Work with Sample set ...
//	events := s.Update(now, sampled) // advance, append tokens, finish on EOS/stop ids/length
//
// Between steps the owner feeds other events: Add, Finish (abort, error, a stop string found by
// the detokenizer), LoadsDone (asynchronous KV loads of the connector completed or failed) and
// ReleaseDelayed (a finished request's held blocks may go).
//
// The Engine owns one Scheduler and one step-loop goroutine. Add queues a request and returns a
// Stream; the loop schedules, runs model.Forward, samples, detokenizes (stop strings included) and
// delivers Outputs without ever blocking on a slow client.
//
// # Connector hooks
//
// A Connector (the scheduler side of a KV connector, after vLLM's KVConnectorBase_V1) is asked at
// admission how many prompt tokens beyond the local prefix-cache hit it can load
// (MatchedExternal), is told the blocks allocated for them (AfterAlloc), and at finish may keep
// the request's blocks allocated (Finished returns delayFree) until the engine's owner calls
// ReleaseDelayed. Without a connector, NoConnector is used.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package engine
