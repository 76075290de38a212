package connector

import (
	"time"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/kvcache"
)

// The engine.Connector hooks. They run on the engine's step loop: they only update bookkeeping
// under c.mu and hand I/O to goroutines.

// state returns the bookkeeping of seq, parsing its kv_transfer_params on first sight. Invalid
// params are logged and ignored: the request computes locally (spec §2.3).
func (c *Connector) state(seq *engine.Sequence) *reqState {
	st := c.reqs[seq.ID()]
	if st != nil {
		return st
	}
	st = &reqState{}
	if raw := seq.KVTransfer(); raw != nil {
		p, err := ParseParams(raw)
		if err != nil {
			c.log.Warn("Got invalid KVTransferParams; this request will not utilize KVTransfer", "request_id", seq.ID(), "error", err)
		} else {
			st.params = p
		}
	}
	c.reqs[seq.ID()] = st
	return st
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
	c.heartbeats.Track(st.params.RemoteEngineID, st.params.RemoteRequestID)
	st.tracked = true
	_, _ = c.entry(st.params)
}

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
	switch {
	case p.DoRemoteDecode:
		return true, c.holdForReader(seq, c.cfg.LeaseDuration, true)
	case p.DoRemotePrefill && c.cfg.Bidirectional:
		return true, c.holdForReader(seq, c.cfg.DecoderBlocksTTL, false)
	}
	return false, nil
}

// holdForReader leases seq's blocks for ttl and returns the params that let a reader pull them.
// c.mu must be held.
func (c *Connector) holdForReader(seq *engine.Sequence, ttl time.Duration, renewable bool) map[string]any {
	blocks := append([]int32(nil), seq.Blocks()...)
	now := c.now()
	deadline := now.Add(ttl)
	c.leases.Add(seq.ID(), blocks, deadline, renewable) // the engine keeps a held id reserved
	computed := seq.NumComputed()
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
		BlockGenerations: c.pool.Generations(blocks),
		Instance:         c.instance,
	}
	if !renewable {
		exp := deadline.Sub(c.epoch).Seconds()
		p.RemoteBlocksExpiryTime = &exp
		hashes := kvcache.ChainHashes(seq.Tokens()[:computed], c.geo.BlockSize)
		p.BlockHashes = make([]string, len(hashes))
		for i, h := range hashes {
			p.BlockHashes[i] = h.String()
		}
	}
	return p.Map()
}

// untrack stops heartbeats for a consumer request. c.mu must be held.
func (c *Connector) untrack(st *reqState) {
	if st.tracked {
		c.heartbeats.Untrack(st.params.RemoteEngineID, st.params.RemoteRequestID)
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

// VerificationRejections returns how many pulls were cut short because a decoder's blocks did
// not hold the prompt's tokens (an edited or stripped history).
func (c *Connector) VerificationRejections() int64 { return c.rejections.Load() }
