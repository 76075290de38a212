package engine

import (
	"fmt"
	"time"
)

// Connector is the scheduler side of a KV connector, shaped after vLLM's KVConnectorBase_V1
// (get_num_new_matched_tokens, update_state_after_alloc, request_finished). The scheduler calls
// it on its owner's goroutine (the engine's step loop): methods must not block or do I/O, and
// must not call Scheduler methods; they record what to do and let the connector's own workers
// act. Results of asynchronous loads come back through Engine.LoadsDone (Scheduler.LoadsDone),
// (or Engine.LoadsMissed when a load found nothing to load), and delayed frees end with
// Engine.ReleaseDelayed (Scheduler.ReleaseDelayed); those Engine
// methods only queue, so they may be called from anywhere, hooks included. A connector is
// responsible for eventually reporting every load it accepted (a dead peer is a failed load)
// and releasing every free it delayed (a lease expiry is a release).
type Connector interface {
	// MatchedExternal returns how many tokens after the first localHitTokens (the local
	// prefix-cache hit, a multiple of the block size) the connector can supply, and whether it
	// supplies them asynchronously. It is asked whenever a request that holds no blocks is
	// considered for admission: possibly several times for one admission (when allocation then
	// fails, admission is retried at a later step) and again after a preemption, so it must be
	// idempotent and return 0 once there is nothing left to load.
	//
	// With async, the request gets blocks for localHitTokens+n tokens, AfterAlloc is called and
	// the request parks in WAITING_FOR_REMOTE_KVS until LoadsDone reports it. Without async, the
	// n tokens count as computed at once: the connector must have written their KV before the
	// step's forward runs. n is clamped to the prompt (and the last prompt token is computed
	// locally: at most NumTokens-1 tokens count as computed, unless an asynchronous load of the
	// whole prompt ends with the first token another engine sampled from it — FirstToken in
	// LoadsDone).
	MatchedExternal(seq *Sequence, localHitTokens int) (n int, async bool)
	// AfterAlloc is called once per successful admission, after the blocks are allocated, with
	// the request's whole block table: blocks[:localHit/BlockSize] are prefix-cache hits and
	// positions [localHit, localHit+numExternal) are the connector's to fill. numExternal is 0
	// when nothing is loaded (a producer request, or a full local hit on a consumer that must
	// still tell its peer to free).
	AfterAlloc(seq *Sequence, blocks []int32, numExternal int)
	// Finished is called once when a request finishes, in any state, with its final status and
	// the owner's clock. With delayFree, the request's blocks stay allocated until the owner
	// calls ReleaseDelayed(seq.ID()): a producer holding its KV for a remote reader, or a
	// consumer whose load is still writing into its blocks. params, if non-nil, is returned to
	// the client as kv_transfer_params on the final output.
	Finished(seq *Sequence, status Status, now time.Time) (delayFree bool, params map[string]any)
}

// ArrivalObserver is implemented by connectors that act on a request as soon as it arrives,
// before it is considered for admission (vLLM's on_new_request): a decoder starts heartbeats
// for the producer's lease from the moment a request is queued, however long the queue is.
// Arrived runs under the same rules as the Connector hooks.
type ArrivalObserver interface {
	Arrived(seq *Sequence)
}

// HoldEvicter is implemented by connectors whose delayed frees include holds that are only a
// cache — a decoder's blocks kept for a conversation's next turn (decoder_kv_blocks_ttl) —
// rather than a reservation a reader is counting on. Before a request waits for blocks or a
// running one is preempted, the scheduler asks it to end some; their blocks are freed at once
// (their ids appear in Plan.Released). EvictHolds runs under the same rules as the Connector
// hooks.
type HoldEvicter interface {
	// EvictHolds ends holds that together hold at least blocks blocks, if it has that many,
	// least recently made first, and returns the ids of their finished requests. It returns
	// nothing when it holds no evictable hold.
	EvictHolds(blocks int) []string
}

// LayerStreamer is implemented by connectors that send a prefill's KV layer by layer while it
// is computed (push mode with push_layerwise). Before each forward step the engine, on its step
// loop, calls StreamStep with the step's work and the requests its plan preempted; a non-nil
// result is called on the step loop after each layer of that step (model.LayerObserver) and must
// not block: it may only hand the layer's blocks to the connector's own goroutines.
type LayerStreamer interface {
	StreamStep(work []Work, preempted []*Sequence) func(layer int)
}

// NoConnector is the Connector of an engine without KV transfer: nothing external, nothing held.
type NoConnector struct{}

// MatchedExternal returns 0: nothing to load.
func (NoConnector) MatchedExternal(*Sequence, int) (int, bool) { return 0, false }

// AfterAlloc does nothing.
func (NoConnector) AfterAlloc(*Sequence, []int32, int) {}

// Finished frees at once and returns no params.
func (NoConnector) Finished(*Sequence, Status, time.Time) (bool, map[string]any) { return false, nil }

// FailurePolicy is kv_load_failure_policy: what the scheduler does with a request whose
// asynchronous KV load failed (docs/architecture.md, wire contract items 29 and 30;
// docs/reliability.md, "How the suite works").
type FailurePolicy uint8

const (
	// FailurePolicyFail (the default, like current vLLM) finishes the request with
	// FINISHED_ERROR and evicts the bad blocks from the prefix cache.
	FailurePolicyFail FailurePolicy = iota
	// FailurePolicyRecompute truncates the computed tokens at the first bad block and computes
	// the rest locally; the client sees a normal response.
	FailurePolicyRecompute
)

// String returns "fail" or "recompute".
func (p FailurePolicy) String() string {
	switch p {
	case FailurePolicyFail:
		return "fail"
	case FailurePolicyRecompute:
		return "recompute"
	}
	return fmt.Sprintf("FailurePolicy(%d)", uint8(p))
}

// ParseFailurePolicy parses "fail" or "recompute" ("" is fail).
func ParseFailurePolicy(s string) (FailurePolicy, error) {
	switch s {
	case "", "fail":
		return FailurePolicyFail, nil
	case "recompute":
		return FailurePolicyRecompute, nil
	}
	return 0, fmt.Errorf("engine: kv_load_failure_policy %q: want \"fail\" or \"recompute\": %w", s, ErrConfig)
}
