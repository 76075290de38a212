package connector

import (
	"time"

	"github.com/kvbridge/kvbridge/engine"
)

// The engine.Connector hooks. They run on the engine's step loop: each hands the core its event
// under c.mu and then performs the actions the core returned, which never block (goroutines it
// owns do the I/O). The core keeps every lease decision on the connector's clock
// (Options.Now); the engine's clock, which Finished is given, is the same time.Now in
// production and is not mixed with it.

// Arrived implements engine.ArrivalObserver: a decode request that will pull from a producer
// starts heartbeating the producer's lease now, while it may still wait in the queue, and the
// handshake starts (vLLM's proactive handshake).
func (c *Connector) Arrived(seq *engine.Sequence) {
	c.mu.Lock()
	c.core.arrived(seq, c.now())
	c.performLocked()
}

// MatchedExternal implements engine.Connector: the tokens after the local hit that a producer
// holds, loaded asynchronously.
func (c *Connector) MatchedExternal(seq *engine.Sequence, localHit int) (int, bool) {
	c.mu.Lock()
	n, async := c.core.matchedExternal(seq, localHit, c.now())
	c.performLocked()
	return n, async
}

// AfterAlloc implements engine.Connector: start the load, or tell the producer to free when
// nothing is loaded.
func (c *Connector) AfterAlloc(seq *engine.Sequence, blocks []int32, numExternal int) {
	c.mu.Lock()
	c.core.afterAlloc(seq, blocks, numExternal, c.now())
	c.performLocked()
}

// Finished implements engine.Connector. A producer that finished normally holds its blocks for
// the reader and returns the params that name them; a consumer whose load is still running
// keeps its blocks until the load ends; a consumer that never loaded tells its producer to free.
func (c *Connector) Finished(seq *engine.Sequence, status engine.Status, _ time.Time) (bool, map[string]any) {
	c.mu.Lock()
	delay, params := c.core.finished(seq, status, c.now())
	c.performLocked()
	return delay, params
}

// EvictHolds implements engine.HoldEvicter: a decoder's holds for next turns are a cache, not a
// reservation. It ends the oldest holds until they add up to blocks blocks (or none is left),
// withdrawing their tags so that a later pull of them fails verification and recomputes, and
// returns their request ids for the scheduler to free at once.
func (c *Connector) EvictHolds(blocks int) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.core.evictHolds(blocks, c.now())
}

// Decline is told of the kv_transfer_params of a request the HTTP layer refused before the
// scheduler saw it (a validation error, a prompt too long, no capacity). It tells the producer
// nothing: ending a lease takes a proof of the prompt it was issued for (ReleaseProof), and
// this engine never saw the request's prompt, so the producer frees at lease expiry, as vLLM's
// does. Params that would be refused are counted.
func (c *Connector) Decline(raw map[string]any) {
	c.mu.Lock()
	c.core.decline(raw, c.now())
	c.performLocked()
}

// VerificationRejections returns how many pulls were cut short because a decoder's hash hints
// did not match the prompt's tokens (an edited or stripped history). Reads whose blocks then
// fail verification against the owner's records are counted in AuthRefusals().Verification.
func (c *Connector) VerificationRejections() int64 { return c.counts.rejections.Load() }
