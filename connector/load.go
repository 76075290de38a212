package connector

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/transfer"
)

// loadTimeout bounds one load: handshake, READ and verification.
const loadTimeout = 60 * time.Second

// expiryMargin is how close to a decoder's TTL a bidirectional read is still attempted.
const expiryMargin = 5 * time.Second

// maxHandshakes bounds the handshakes in progress: params may name any engine at any address,
// and each new one costs a connection attempt.
const maxHandshakes = 64

// load reads the producer's KV for positions [localHit, localHit+count) into j's blocks and
// verifies it against what the producer published. It returns the index (in j.blocks) of the
// first block that could not be loaded. f, when not nil, is the handshake the request's arrival
// found in progress (loadJob.awaiting), which the load waits for.
func (c *Connector) load(ctx context.Context, j loadJob, f *flight) (int, error) {
	first := j.localHit / c.geo.BlockSize
	// The request fails with the handshake its arrival started (as in vLLM), not with a second
	// one: a failed record is forgotten at once, so asking anew would start another handshake
	// whose outcome depends on when this load began. A handshake that succeeded is not used
	// directly: remote returns the current record.
	if j.handshakeErr != nil {
		return first, j.handshakeErr
	}
	if f != nil {
		if _, err := f.wait(ctx); err != nil {
			return first, err
		}
	}
	for attempt := 0; ; attempt++ {
		r, err := c.remote(ctx, j.params)
		if err != nil {
			return first, err
		}
		bad, err := c.read(ctx, j, r)
		if err != nil && attempt == 0 && peerGone(err) {
			// The connection died since our handshake (or the producer's agent restarted):
			// count the failed attempt and try once more over a new handshake.
			c.log.Warn("NIXL transfer failure: transfer_failed; retrying after a new handshake", "request_id", j.id, "remote_engine_id", r.id, "err", err)
			if c.metrics != nil {
				c.metrics.CountFailedTransfer()
			}
			c.forget(r)
			continue
		}
		return bad, err
	}
}

// read pulls j's KV from the handshaken producer r, then the producer's records of those blocks
// and the lease's slot (the notification rides on that second read, which comes last), and
// verifies them.
func (c *Connector) read(ctx context.Context, j loadJob, r *remoteLink) (int, error) {
	first := j.localHit / c.geo.BlockSize
	if j.fromD && c.core.expiredHold(j.params, r.offset, c.now()) {
		c.log.Warn(fmt.Sprintf("Declining expired remote read for %s from engine %s", j.id, r.id))
		if c.metrics != nil {
			c.metrics.CountExpiredRequest()
		}
		return first, fmt.Errorf("%w: request %s, engine %s", ErrExpired, j.id, r.id)
	}
	plan, err := c.plan(j, r)
	if err != nil {
		return first, err
	}
	// Every READ presents the lease token (see auth.go).
	ropts := &transfer.RequestOptions{Timeout: loadTimeout, Tag: j.params.Lease[:]}
	if err := c.readKV(ctx, r, plan, ropts); err != nil {
		return first, c.forgetOn(r, err)
	}
	slotEntry := c.layout.NumBlocks*maxBlockRatio + int(j.blocks[plan.firstLocal])
	local := append(append([]int(nil), plan.scratch...), slotEntry)
	remote := make([]int, 0, len(plan.remote)+1)
	for _, rj := range plan.remoteIndex {
		remote = append(remote, int(j.params.Blocks()[rj])) // record i describes block i
	}
	remote = append(remote, r.meta.NumBlocks+j.params.LeaseSlot)
	meta, err := c.agent.MakeRequest(transfer.Read, c.scrList, local, r.recs, remote, ropts)
	if err != nil {
		return first, c.forgetOn(r, err)
	}
	defer meta.Release()
	if err := meta.Post(ctx, c.releaseFor(j.release, r)); err != nil {
		return first, c.forgetOn(r, err)
	}
	if err := meta.Wait(ctx); err != nil {
		return first, c.forgetOn(r, err)
	}
	records := make([][]byte, len(plan.scratch))
	for k, entry := range plan.scratch {
		records[k] = c.scratchEntry(entry)
	}
	if bad, err := verifyRead(j, r.id, r.meta.BlockSize, plan, records, c.scratchEntry(slotEntry)); err != nil {
		return bad, err
	}
	if err := c.postprocess(j, r, plan); err != nil {
		return first, err
	}
	return 0, nil
}

// readKV reads the KV of plan into every tensor-parallel rank of this engine, one READ per pair
// of local rank and producer rank (ranks r and r when the TP sizes are equal, tpMap.plan's
// pairs when they differ), all posted at once; it returns when all are done.
func (c *Connector) readKV(ctx context.Context, r *remoteLink, plan readPlan, ropts *transfer.RequestOptions) (err error) {
	type read struct {
		local, remote *transfer.PreparedList
		li, ri        []int
	}
	var reads []read
	if r.tp == nil {
		for rank, local := range r.locals {
			reads = append(reads, read{local, r.kvs[rank], plan.local, plan.remote})
		}
	} else {
		rg := c.geo
		rg.NumKVHeads = r.meta.NumKVHeads
		pairs := r.tp.plan(plan, c.geo, rg)
		for lr := range r.tp.localTP {
			for rr := range r.tp.remoteTP {
				if p := pairs[rankPair{lr, rr}]; p != nil {
					reads = append(reads, read{r.locals[lr], r.kvs[rr], p.local, p.remote})
				}
			}
		}
	}
	var posted []*transfer.Request
	defer func() {
		// After a failure the other ranks' READs are cancelled, and waited for until the
		// transfer engine no longer touches this engine's blocks (they return to the pool).
		for _, h := range posted {
			h.Release()
			if err != nil {
				select {
				case <-h.Done():
				case <-c.ctx.Done():
				}
			}
		}
	}()
	for _, rd := range reads {
		h, err := c.agent.MakeRequest(transfer.Read, rd.local, rd.li, rd.remote, rd.ri, ropts)
		if err != nil {
			return err
		}
		posted = append(posted, h)
		if err := h.Post(ctx, nil); err != nil {
			return err
		}
	}
	for _, h := range posted {
		if err := h.Wait(ctx); err != nil {
			return err
		}
		if c.metrics != nil {
			c.metrics.ObserveTransfer(metricsSample(h.Telemetry()))
		}
	}
	return nil
}

// readPlan pairs local sub-blocks with remote blocks, by token position.
type readPlan struct {
	local, remote, scratch []int // descriptor indices in r.local, r.kv, c.scrList
	localIndex             []int // index in j.blocks of each pair's local block
	remoteIndex            []int // index in the producer's block list of each pair
	firstLocal, lastLocal  int   // range of j.blocks indices filled
}

// plan aligns blocks by position: remote block k of the producer's list holds positions
// [k×b, (k+1)×b) and local block i holds [i×B, (i+1)×B) with B = ratio×b, so local block i is
// filled from remote blocks i×ratio … i×ratio+ratio−1. Only blocks that hold positions in
// [localHit, localHit+count) are read.
func (c *Connector) plan(j loadJob, r *remoteLink) (readPlan, error) {
	bs := c.geo.BlockSize
	rbs := r.meta.BlockSize
	remote := j.params.Blocks()
	end := j.localHit + j.count
	p := readPlan{firstLocal: j.localHit / bs, lastLocal: (end+bs-1)/bs - 1}
	if p.lastLocal >= len(j.blocks) {
		return p, fmt.Errorf("request %s: %d tokens need %d blocks, it holds %d", j.id, end, p.lastLocal+1, len(j.blocks))
	}
	if len(j.params.BlockGenerations) != len(remote) || j.params.LeaseSlot < 0 || j.params.LeaseSlot >= r.meta.NumBlocks {
		return p, fmt.Errorf("%w: request %s: the params name no lease of engine %s", ErrVerification, j.id, r.id)
	}
	for i := p.firstLocal; i <= p.lastLocal; i++ {
		for k := range r.ratio {
			rj := i*r.ratio + k
			if rj*rbs >= end {
				break
			}
			if rj >= len(remote) {
				return p, fmt.Errorf("request %s: the producer named %d blocks of %d tokens, %d tokens are needed", j.id, len(remote), rbs, end)
			}
			rid := int(remote[rj])
			if rid < 0 || rid >= r.meta.NumBlocks {
				return p, fmt.Errorf("request %s: remote block id %d out of range [0,%d)", j.id, rid, r.meta.NumBlocks)
			}
			lb := int(j.blocks[i])
			p.local = append(p.local, lb*r.ratio+k)
			p.remote = append(p.remote, rid)
			p.scratch = append(p.scratch, lb*maxBlockRatio+k)
			p.localIndex = append(p.localIndex, i)
			p.remoteIndex = append(p.remoteIndex, rj)
		}
	}
	return p, nil
}

// postprocess turns raw remote-geometry bytes into local blocks: regrouping smaller remote
// blocks, or permuting HND into NHD (enable_permute_local_kv).
func (c *Connector) postprocess(j loadJob, r *remoteLink, p readPlan) error {
	if r.ratio == 1 && r.layout == c.geo.Layout {
		return nil
	}
	remoteGeo := c.geo
	remoteGeo.BlockSize = r.meta.BlockSize
	remoteGeo.Layout = r.layout
	for rank := range c.pool.TensorParallelSize() {
		shard := c.pool.Shard(rank)
		for i := p.firstLocal; i <= p.lastLocal; i++ {
			b := shard.Bytes(j.blocks[i])
			var err error
			if r.ratio > 1 {
				err = kvcache.RegroupBlocks(b, b, c.geo, remoteGeo)
			} else {
				err = kvcache.ConvertLayout(b, b, c.geo, r.layout, c.geo.Layout)
			}
			if err != nil {
				return fmt.Errorf("request %s: post-process block %d of rank %d: %w", j.id, j.blocks[i], rank, err)
			}
		}
	}
	return nil
}

// forgetOn drops a remote engine whose agent restarted or disconnected, so that the next
// request handshakes again; it returns err.
func (c *Connector) forgetOn(r *remoteLink, err error) error {
	if peerGone(err) {
		c.forget(r)
	}
	return err
}

// peerGone reports a transfer error that means the producer's agent restarted or went away.
func peerGone(err error) bool {
	return errors.Is(err, transfer.ErrStaleIncarnation) || errors.Is(err, transfer.ErrRemoteDisconnect) || errors.Is(err, transfer.ErrNotFound)
}
