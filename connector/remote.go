package connector

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/transfer"
)

// The worker's side of remote engines: waiting for a record, running its handshake, and making
// way for a new incarnation. The core owns the records (core.entry, core.forget).

// joinHostPort renders a dial address.
func joinHostPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }

// remote returns the handshaken producer named by p, asking the core for its record (one
// handshake per engine incarnation; later callers wait for the same one).
func (c *Connector) remote(ctx context.Context, p *Params) (*remoteEngine, error) {
	c.mu.Lock()
	r, err := c.core.entry(p, c.now())
	c.performLocked()
	if err != nil {
		return nil, err
	}
	if err := r.wait(ctx); err != nil {
		return nil, err
	}
	return r, nil
}

// wait waits for r's handshake to end and returns its error.
func (r *remoteEngine) wait(ctx context.Context) error {
	select {
	case <-r.ready:
		return r.err
	case <-ctx.Done():
		return fmt.Errorf("%w: waiting for the handshake with %s: %w", ErrHandshake, r.addr, ctx.Err())
	}
}

// runHandshake runs r's handshake and tells the core it ended.
func (c *Connector) runHandshake(r *remoteEngine) {
	c.handshakeWith(r)
	c.endHandshake(r)
}

// abandonHandshake ends r's handshake unrun (the connector is closing).
func (c *Connector) abandonHandshake(r *remoteEngine) {
	r.err = transfer.ErrClosed
	c.endHandshake(r)
}

// endHandshake tells the core r's handshake ended (a failed record is forgotten, so that the
// next request tries again) and then, still under c.mu, releases r's waiters.
func (c *Connector) endHandshake(r *remoteEngine) {
	c.mu.Lock()
	c.core.handshakeEnded(r)
	close(r.ready)
	c.performLocked()
}

// handshakeWith runs the side-channel handshake and prepares the descriptor lists; it sets r.err
// or the rest of r.
func (c *Connector) handshakeWith(r *remoteEngine) {
	ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
	defer cancel()
	fail := func(err error) {
		r.err = err
		c.log.Error("NIXL transfer failure: handshake_setup_failed", "remote_engine_id", r.id, "peer_addr", r.addr, "err", err)
		if c.metrics != nil {
			c.metrics.CountFailedTransfer()
		}
	}
	res, err := handshake(ctx, r.addr, r.id, c.hash, c.cfg.EnforceHandshakeCompat, 3, c.clockSeconds, c.auth)
	err = c.kvDTypeMismatch(r.id, res.kvCacheDType, err)
	if err != nil {
		if errors.Is(err, errServerProof) {
			c.sideRefusals.Add(1)
		}
		fail(err)
		return
	}
	m := res.meta
	if r.key.instance != "" && m.Instance != r.key.instance {
		fail(fmt.Errorf("%w: the params name instance %s of engine %s, which now runs instance %s at %s: its KV is gone",
			ErrStaleProducer, r.key.instance, r.id, m.Instance, r.addr))
		return
	}
	layout, err := kvcache.ParseLayout(m.KVCacheLayout)
	if err != nil {
		fail(fmt.Errorf("%w: %w", ErrIncompatible, err))
		return
	}
	// The KV dtype is part of the compatibility hash, and compared above: the producer's is ours.
	remoteGeo := kvcache.Geometry{NumLayers: m.NumLayers, NumKVHeads: m.NumKVHeads, HeadDim: m.HeadDim, BlockSize: m.BlockSize, Layout: layout, DType: c.geo.DType}
	ratio, err := kvcache.BlockRatio(c.geo, remoteGeo, c.cfg.EnablePermuteLocalKV)
	if err != nil {
		fail(fmt.Errorf("%w with engine %s: %w", ErrIncompatible, r.id, err))
		return
	}
	if ratio > maxBlockRatio || m.BlockLen <= 0 || m.BlockLen != remoteGeo.BlockBytes() || m.NumBlocks <= 0 {
		fail(fmt.Errorf("%w: engine %s publishes %d blocks of %d bytes for block size %d (ratio %d, at most %d)",
			ErrIncompatible, r.id, m.NumBlocks, m.BlockLen, m.BlockSize, ratio, maxBlockRatio))
		return
	}
	// NumBlocks comes from the peer and sizes the descriptor lists below (NumBlocks and
	// 2·NumBlocks descriptors): bound it before anything is allocated. Whether the blocks lie
	// within the regions the peer's transfer metadata advertises is checked by PrepareRemote.
	if m.NumBlocks > maxRemoteBlocks || int64(m.NumBlocks) > math.MaxInt64/int64(m.BlockLen) {
		fail(fmt.Errorf("%w: engine %s publishes %d blocks of %d bytes; at most %d blocks are accepted from a peer",
			ErrIncompatible, r.id, m.NumBlocks, m.BlockLen, maxRemoteBlocks))
		return
	}
	if err := c.replaceOlder(ctx, r); err != nil {
		fail(err)
		return
	}
	peer, err := c.agent.LoadRemote(m.AgentMetadata)
	if err != nil {
		fail(err)
		return
	}
	info, _ := c.agent.Peer(peer)
	if !offersAllowed(info.Offers, c.cfg.Backends) {
		fail(fmt.Errorf("%w: engine %s offers the transfer backends %v, none of which kv_connector_extra_config.backends %v allows",
			ErrIncompatible, r.id, info.Offers, c.cfg.Backends))
		return
	}
	kv, err := c.agent.PrepareRemote(ctx, peer, transfer.BlockDescs(m.KVRegion, 0, int64(m.BlockLen), m.NumBlocks), nil)
	if err != nil {
		fail(c.transferAuthHint(r, err))
		return
	}
	recs, err := c.agent.PrepareRemote(ctx, peer, transfer.BlockDescs(m.MetaRegion, 0, kvcache.RecordBytes, 2*m.NumBlocks), nil)
	if err != nil {
		kv.Release()
		fail(err)
		return
	}
	local, err := c.localList(ratio)
	if err != nil {
		kv.Release()
		recs.Release()
		fail(err)
		return
	}
	r.meta, r.offset, r.peer, r.peerInc, r.ratio, r.layout, r.kv, r.recs, r.local = m, res.offset, peer, info.Incarnation, ratio, layout, kv, recs, local
	c.log.Info("NIXL handshake done", "remote_engine_id", r.id, "peer_addr", r.addr, "backend", kv.Backend().String(),
		"remote_block_size", m.BlockSize, "layout", m.KVCacheLayout, "clock_offset_s", res.offset)
}

// replaceOlder makes way for r, a new incarnation of an engine: a record of another incarnation
// of the same engine is dropped only once it is shown dead — its side channel no longer
// answers as that incarnation. While it does, r is refused: params cannot make this engine drop
// a healthy producer by naming its engine id with another instance or address.
func (c *Connector) replaceOlder(ctx context.Context, r *remoteEngine) error {
	c.mu.Lock()
	older := c.core.older(r)
	c.mu.Unlock()
	for _, o := range older {
		res, err := handshake(ctx, o.addr, o.id, c.hash, c.cfg.EnforceHandshakeCompat, 1, c.clockSeconds, c.auth)
		if err == nil && res.meta.Instance == o.key.instance {
			return fmt.Errorf("%w: engine %s still runs instance %s at %s; refusing another instance claiming its id at %s",
				ErrIncompatible, o.id, o.key.instance, o.addr, r.addr)
		}
		c.log.Info("a remote engine restarted; forgetting its previous instance", "remote_engine_id", o.id, "remote_instance", o.key.instance, "peer_addr", o.addr)
		c.forget(o)
	}
	return nil
}

// localList returns the local descriptor list that splits each block into ratio sub-blocks,
// and (once) the scratch list for records and slots.
func (c *Connector) localList(ratio int) (*transfer.PreparedList, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.scrList == nil {
		l, err := c.agent.PrepareLocal(transfer.BlockDescs(c.scrReg.ID(), 0, kvcache.RecordBytes, c.layout.scratchEntries()))
		if err != nil {
			return nil, err
		}
		c.scrList = l
	}
	if l := c.localLists[ratio]; l != nil {
		return l, nil
	}
	sub := int64(c.pool.BlockBytes() / ratio)
	l, err := c.agent.PrepareLocal(transfer.BlockDescs(c.kvReg.ID(), 0, sub, c.pool.NumBlocks()*ratio))
	if err != nil {
		return nil, err
	}
	c.localLists[ratio] = l
	return l, nil
}

// offersAllowed reports whether a peer offering offers has a backend the configured list
// allows (any, when the list is empty).
func offersAllowed(offers []transfer.Backend, allowed []string) bool {
	if len(allowed) == 0 {
		return true
	}
	for _, o := range offers {
		if slices.ContainsFunc(allowed, func(a string) bool { return strings.EqualFold(a, o.String()) }) {
			return true
		}
	}
	return false
}
