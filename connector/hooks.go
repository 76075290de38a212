package connector

import (
	"crypto/rand"
	"errors"
	"fmt"
	"time"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/kvcache"
)

// The engine.Connector hooks. They run on the engine's step loop: they only update bookkeeping
// under c.mu and hand I/O to goroutines.

// state returns the bookkeeping of seq, parsing its kv_transfer_params on first sight. Invalid
// or refused params are logged and ignored: the request computes locally (spec §2.3).
func (c *Connector) state(seq *engine.Sequence) *reqState {
	st := c.reqs[seq.ID()]
	if st != nil {
		return st
	}
	st = &reqState{}
	if raw := seq.KVTransfer(); raw != nil {
		p, err := ParseParams(raw)
		if err == nil {
			err = c.checkParams(p)
		}
		if err != nil {
			c.refuseParams(seq.ID(), err)
		} else {
			st.params = p
		}
	}
	c.reqs[seq.ID()] = st
	return st
}

// errRefusedParams wraps the reasons pull params are refused before any connection.
var errRefusedParams = errors.New("refused kv_transfer_params")

// checkParams refuses params that would make this engine pull KV (or notify a producer) unless
// they name a lease (its token and slot), the producer's instance and block generations, carry a
// valid MAC when engines share an auth token, and name an allowed host. Params that pull
// nothing (a first-turn template) pass.
func (c *Connector) checkParams(p *Params) error {
	if pull, _ := c.consumer(p); !pull {
		return nil
	}
	switch {
	case !p.HasLease || p.LeaseSlot < 0:
		return fmt.Errorf("%w: they name no lease (%s, %s): only a kvbridge engine's params can be pulled from", errRefusedParams, KeyLease, KeyLeaseSlot)
	case p.Instance == "":
		return fmt.Errorf("%w: they name no producer instance (%s)", errRefusedParams, KeyInstance)
	case len(p.BlockGenerations) != len(p.Blocks()):
		return fmt.Errorf("%w: %d block generations for %d blocks", errRefusedParams, len(p.BlockGenerations), len(p.Blocks()))
	case c.paramsKey != nil && !verifyMAC(c.paramsKey, p):
		return fmt.Errorf("%w: no valid %s: with an auth token, only params an engine of this deployment issued are accepted", errRefusedParams, KeyMAC)
	case !c.peers.allows(p.RemoteHost):
		return fmt.Errorf("%w: remote_host %q is not in kv_connector_extra_config.allowed_peers", errRefusedParams, clip(p.RemoteHost))
	}
	return nil
}

// refuseParams counts refused params and logs it, at most once per interval: a client can send
// as many as it likes.
func (c *Connector) refuseParams(id string, err error) {
	c.refusals.params.Add(1)
	if ok, suppressed := c.quiet.allow("params", c.now()); ok {
		c.log.Warn("Got invalid KVTransferParams; this request will not utilize KVTransfer", "request_id", id, "error", err, "similar_suppressed", suppressed)
	}
}

// consumer reports whether params ask this engine to pull the prompt's KV from a producer: a
// decode request carrying P's params, or (bidirectional) a prefill request carrying D's.
func (c *Connector) consumer(p *Params) (pull bool, fromDecoder bool) {
	switch {
	case p == nil || !p.Complete():
		return false, false
	case p.DoRemotePrefill:
		return true, false
	case p.DoRemoteDecode && c.cfg.Bidirectional:
		return true, true
	}
	return false, false
}

// Arrived implements engine.ArrivalObserver: a decode request that will pull from a producer
// starts heartbeating the producer's lease now, while it may still wait in the queue, and the
// handshake starts (vLLM's proactive handshake).
func (c *Connector) Arrived(seq *engine.Sequence) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.state(seq)
	if pull, fromD := c.consumer(st.params); pull && !fromD {
		c.track(st)
	}
}

// track starts heartbeats for a consumer request. c.mu must be held.
func (c *Connector) track(st *reqState) {
	if st.tracked || st.params.TPSize <= 0 {
		return // vLLM tracks only requests whose params carry tp_size
	}
	c.heartbeats.Track(heartbeatKey(st.params), st.params.Lease.String())
	st.tracked = true
	_, _ = c.entry(st.params)
}

// heartbeatKey groups heartbeats by producer incarnation.
func heartbeatKey(p *Params) string { return p.RemoteEngineID + "\x00" + p.Instance }

// MatchedExternal implements engine.Connector: the tokens after the local hit that a producer
// holds, loaded asynchronously.
func (c *Connector) MatchedExternal(seq *engine.Sequence, localHit int) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.state(seq)
	pull, fromD := c.consumer(st.params)
	if !pull || st.processed {
		return 0, false
	}
	prompt := seq.NumPromptTokens()
	avail := prompt
	if fromD {
		st.pullFromD = true
		avail = c.verifiedTokens(st.params, seq.Prompt())
	} else {
		c.track(st) // normally done on arrival; heartbeats never go towards a decoder
	}
	count := avail - localHit
	if count <= 0 {
		return 0, false
	}
	if t := c.cfg.Threshold(); count < t {
		return 0, false // cheaper to recompute than to pull (kv_recompute_threshold)
	}
	return count, true
}

// verifiedTokens returns how many leading tokens of prompt a decoder's blocks hold, as far as
// their hash chain proves: min(remote_num_tokens, prompt), cut at the first full block whose
// hash differs from the prompt's own chain. Without hashes (a peer that sends none) nothing is
// trusted beyond what vLLM trusts.
func (c *Connector) verifiedTokens(p *Params, prompt []int32) int {
	n := min(p.RemoteNumTokens, len(prompt))
	if p.BlockHashes == nil {
		return n
	}
	bs := c.geo.BlockSize
	own := kvcache.ChainHashes(prompt[:n], bs)
	ok := 0
	for ok < len(own) && ok < len(p.BlockHashes) && own[ok].String() == p.BlockHashes[ok] {
		ok++
	}
	if ok < len(own) {
		c.countRejection()
		return ok * bs
	}
	// Every full block matched; the trailing partial block cannot be verified.
	return min(n, ok*bs)
}

// AfterAlloc implements engine.Connector: start the load, or tell the producer to free when
// nothing is loaded.
func (c *Connector) AfterAlloc(seq *engine.Sequence, blocks []int32, numExternal int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.state(seq)
	pull, _ := c.consumer(st.params)
	if !pull || st.processed {
		return
	}
	st.processed = true
	localHit := seq.NumLocalHitTokens()
	if numExternal == 0 {
		c.untrack(st)
		c.startNotify(st.params)
		return
	}
	st.loading = true
	c.startLoad(loadJob{
		id:       seq.ID(),
		params:   st.params,
		blocks:   append([]int32(nil), blocks...),
		prompt:   append([]int32(nil), seq.Prompt()...),
		localHit: localHit,
		count:    numExternal,
		fromD:    st.pullFromD,
	})
}

// Finished implements engine.Connector. A producer that finished normally holds its blocks for
// the reader and returns the params that name them; a consumer whose load is still running
// keeps its blocks until the load ends; a consumer that never loaded tells its producer to free.
func (c *Connector) Finished(seq *engine.Sequence, status engine.Status, _ time.Time) (bool, map[string]any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.reqs[seq.ID()]
	if st == nil {
		return false, nil
	}
	c.untrack(st)
	p := st.params
	pull, _ := c.consumer(p)
	if pull && !st.processed {
		c.startNotify(p) // aborted before its read: the producer must not wait for the lease
	}
	if st.loading {
		// The load goroutine still writes into the blocks; it releases them when it ends.
		st.finished = true
		return true, nil
	}
	delete(c.reqs, seq.ID())
	if p == nil || (status != engine.StatusFinishedStopped && status != engine.StatusFinishedLengthCapped) {
		return false, nil // aborted or failed: free at once, no params (conformance item 7)
	}
	var params map[string]any
	switch {
	case p.DoRemoteDecode:
		params = c.holdForReader(seq, c.cfg.LeaseDuration, true)
	case p.DoRemotePrefill && c.cfg.Bidirectional:
		params = c.holdForReader(seq, c.cfg.DecoderBlocksTTL, false)
	}
	return params != nil, params
}

// holdForReader leases seq's blocks for ttl under a fresh token, publishes what a reader
// checks (the blocks' records and the lease's tag in its slot) and returns the params that let a
// reader pull them. It returns nil, and holds nothing, when the blocks cannot be published.
// c.mu must be held.
func (c *Connector) holdForReader(seq *engine.Sequence, ttl time.Duration, renewable bool) map[string]any {
	blocks := append([]int32(nil), seq.Blocks()...)
	computed := seq.NumComputed()
	var token LeaseToken
	if _, err := rand.Read(token[:]); err != nil {
		c.log.Error("drawing a lease token failed; the blocks are freed", "request_id", seq.ID(), "error", err)
		return nil
	}
	now := c.now()
	deadline := now.Add(ttl)
	l, replaced := c.leases.Add(seq.ID(), token, blocks, now, deadline, renewable) // the engine keeps a held id reserved
	if replaced != nil {
		c.clearSlot(replaced)
	}
	gens := c.pool.Generations(blocks)
	if l.Slot >= c.layout.NumBlocks {
		c.leases.Release(seq.ID())
		c.log.Error("no lease slot left; the blocks are freed", "request_id", seq.ID(), "leases", c.leases.Len())
		return nil
	}
	if err := c.pool.PublishChain(blocks, seq.Tokens()[:computed]); err != nil {
		c.leases.Release(seq.ID())
		c.log.Error("publishing the held blocks' records failed; the blocks are freed", "request_id", seq.ID(), "error", err)
		return nil
	}
	tag := LeaseTag(token, computed, blocks, gens)
	copy(c.slots[l.Slot*slotBytes:], tag[:])
	p := Params{
		DoRemotePrefill:  renewable, // P's params send D to pull; D's send the next P to pull
		DoRemoteDecode:   !renewable,
		RemoteBlockIDs:   [][]int32{blocks},
		RemoteEngineID:   c.cfg.EngineID,
		RemoteRequestID:  seq.ID(),
		RemoteHost:       c.host,
		RemotePort:       c.port,
		TPSize:           1,
		DCPSize:          1,
		PPSize:           1,
		RemoteNumTokens:  computed,
		TransferMode:     "pull",
		BlockGenerations: gens,
		Instance:         c.instance,
		Lease:            token,
		HasLease:         true,
		LeaseSlot:        l.Slot,
	}
	if !renewable {
		exp := deadline.Sub(c.epoch).Seconds()
		p.RemoteBlocksExpiryTime = &exp
		// Hints for the next turn's prefiller, which sizes its pull with them before reading;
		// what it reads is checked against the records published above, not against these.
		hashes := kvcache.ChainHashes(seq.Tokens()[:computed], c.geo.BlockSize)
		p.BlockHashes = make([]string, len(hashes))
		for i, h := range hashes {
			p.BlockHashes[i] = h.String()
		}
	}
	if c.paramsKey != nil {
		p.MAC = paramsMAC(c.paramsKey, &p)
	}
	return p.Map()
}

// clearSlot withdraws l's tag: from now on no reader accepts what it reads under l. c.mu must
// be held, and the lease's blocks not yet freed.
func (c *Connector) clearSlot(l *Lease) {
	if l.Slot < c.layout.NumBlocks {
		clear(c.slots[l.Slot*slotBytes : (l.Slot+1)*slotBytes])
	}
}

// endLease withdraws l's tag and lets the engine free its blocks. c.mu must be held.
func (c *Connector) endLease(l *Lease) {
	c.clearSlot(l)
	c.release(l.RequestID)
}

// EvictHolds implements engine.HoldEvicter: a decoder's holds for next turns are a cache, not a
// reservation. It ends the oldest holds until they add up to blocks blocks (or none is left),
// withdrawing their tags so that a later pull of them fails verification and recomputes, and
// returns their request ids for the scheduler to free at once.
func (c *Connector) EvictHolds(blocks int) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var ids []string
	for freed := 0; freed < blocks; {
		l := c.leases.EvictOldestHold()
		if l == nil {
			break
		}
		c.clearSlot(l)
		ids = append(ids, l.RequestID)
		freed += len(l.Blocks)
	}
	if len(ids) > 0 {
		c.refusals.evictedHolds.Add(int64(len(ids)))
		if ok, suppressed := c.quiet.allow("evict", c.now()); ok {
			c.log.Warn("KV pool full: evicting decoder holds kept for next turns (decoder_kv_blocks_ttl); those turns will recompute", "holds", len(ids), "blocks_wanted", blocks, "similar_suppressed", suppressed)
		}
	}
	return ids
}

// Decline tells the producer named by a request's kv_transfer_params that this engine will not
// read its blocks, so that it frees them now instead of when its lease expires. The HTTP layer
// calls it for a request it refuses before the scheduler sees it (a validation error, a prompt
// too long, no capacity); params that would not be pulled from, or are refused, are ignored.
func (c *Connector) Decline(raw map[string]any) {
	p, err := ParseParams(raw)
	if err != nil || p == nil {
		return
	}
	if pull, _ := c.consumer(p); !pull {
		return
	}
	if err := c.checkParams(p); err != nil {
		c.refuseParams(p.RemoteRequestID, err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.startNotify(p)
}

// untrack stops heartbeats for a consumer request. c.mu must be held.
func (c *Connector) untrack(st *reqState) {
	if st.tracked {
		c.heartbeats.Untrack(heartbeatKey(st.params), st.params.Lease.String())
		st.tracked = false
	}
}

// release tells the engine a delayed free may happen; safe under c.mu (the engine only queues).
func (c *Connector) release(id string) {
	if c.sched != nil {
		c.sched.ReleaseDelayed(id)
	}
}

func (c *Connector) countRejection() { c.rejections.Add(1) }

// VerificationRejections returns how many pulls were cut short because a decoder's hash hints
// did not match the prompt's tokens (an edited or stripped history). Reads whose blocks then
// fail verification against the owner's records are counted in AuthRefusals().Verification.
func (c *Connector) VerificationRejections() int64 { return c.rejections.Load() }
