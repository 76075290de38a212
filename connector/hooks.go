package connector

import (
	"time"

	"github.com/kvbridge/kvbridge/engine"
)

// The engine.Connector hooks. They run on the engine's step loop: each hands the core its event
// (Connector.event) and then performs the actions the core returned, which never block
// (goroutines it owns do the I/O): a hook's event never emits the synchronous actions, beats and
// drops (see actions; the core's tests check it on every hook). The core keeps every lease
// decision on the connector's clock (Options.Now); the engine's clock, which Finished is given,
// is the same time.Now in production and is not mixed with it.

// Arrived implements engine.ArrivalObserver: a decode request that will pull from a producer
// starts heartbeating the producer's lease now, while it may still wait in the queue, and the
// handshake starts (vLLM's proactive handshake).
func (c *Connector) Arrived(seq *engine.Sequence) {
	c.event(func(k *core) { k.arrived(seq, c.now()) })
}

// MatchedExternal implements engine.Connector: the tokens after the local hit that a producer
// holds, loaded asynchronously.
func (c *Connector) MatchedExternal(seq *engine.Sequence, localHit int) (n int, async bool) {
	c.event(func(k *core) { n, async = k.matchedExternal(seq, localHit, c.now()) })
	return n, async
}

// AfterAlloc implements engine.Connector: start the load, or tell the producer to free when
// nothing is loaded.
func (c *Connector) AfterAlloc(seq *engine.Sequence, blocks []int32, numExternal int) {
	c.event(func(k *core) { k.afterAlloc(seq, blocks, numExternal, c.now()) })
}

// Finished implements engine.Connector. A producer that finished normally holds its blocks for
// the reader and returns the params that name them; a consumer whose load is still running
// keeps its blocks until the load ends; a consumer that never loaded tells its producer to free.
func (c *Connector) Finished(seq *engine.Sequence, status engine.Status, _ time.Time) (delay bool, params map[string]any) {
	c.event(func(k *core) { delay, params = k.finished(seq, status, c.now()) })
	return delay, params
}

// EvictHolds implements engine.HoldEvicter: a decoder's holds for next turns are a cache, not a
// reservation. It ends the oldest holds until they add up to blocks blocks (or none is left),
// withdrawing their tags so that a later pull of them fails verification and recomputes, and
// returns their request ids for the scheduler to free at once.
func (c *Connector) EvictHolds(blocks int) (ids []string) {
	c.event(func(k *core) { ids = k.evictHolds(blocks, c.now()) })
	return ids
}

// Decline is told of the kv_transfer_params of a request the HTTP layer refused before the
// scheduler saw it (a validation error, a prompt too long, no capacity). It tells the producer
// nothing: ending a lease takes a proof of the prompt it was issued for (kvlease.Proof), and
// this engine never saw the request's prompt, so the producer frees at lease expiry, as vLLM's
// does. Params that would be refused are counted.
func (c *Connector) Decline(raw map[string]any) {
	c.event(func(k *core) { k.decline(raw, c.now()) })
}

// VerificationRejections returns how many pulls were cut short because a decoder's hash hints
// did not match the prompt's tokens (an edited or stripped history). Reads whose blocks then
// fail verification against the owner's records are counted in AuthRefusals().Verification.
func (c *Connector) VerificationRejections() int64 { return c.counts.rejections.Load() }
