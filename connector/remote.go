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

// The worker's side of remote engines: the links its handshakes build, the goroutines that wait
// for a handshake, and making way for a new incarnation. The core owns the records (core.entry,
// core.handshakeEnded, core.forget); it is told how a handshake ended as a value.

// remoteLink is a handshaken producer incarnation: what the worker's handshake built and a load
// reads through. It is not changed once built; the core keeps it in its record, opaque.
type remoteLink struct {
	key      remoteKey
	id       string // engine id, for messages
	addr     string // where the handshake went
	meta     agentMetadata
	offset   float64 // producer clock − our clock, seconds
	peer     string  // transfer agent name
	peerInc  uint64  // transfer agent incarnation
	ratio    int     // local block size ÷ remote block size
	layout   kvcache.Layout
	kv, recs *transfer.PreparedList // the producer's blocks; its records then slots
	local    *transfer.PreparedList
}

// releaseLists releases l's descriptor lists (idempotent). Loads still using them fail, as they
// would against a dead peer.
func (l *remoteLink) releaseLists() {
	l.kv.Release()
	l.recs.Release()
}

// flight is one handshake in progress as the goroutines waiting for it see it (singleflight):
// done is closed when it ends, after link or err is set. The Connector keeps one per record
// being handshaken that somebody waits for (Connector.flights).
type flight struct {
	addr string
	done chan struct{}
	link *remoteLink
	err  error
}

// wait waits for f's handshake to end and returns its link or its error.
func (f *flight) wait(ctx context.Context) (*remoteLink, error) {
	select {
	case <-f.done:
		return f.link, f.err
	case <-ctx.Done():
		return nil, fmt.Errorf("%w: waiting for the handshake with %s: %w", ErrHandshake, f.addr, ctx.Err())
	}
}

// flightLocked returns the flight of the handshake h, which is in progress, creating it for the
// first waiter. c.mu is held.
func (c *Connector) flightLocked(h handshakeJob) *flight {
	f := c.flights[h.key]
	if f == nil {
		f = &flight{addr: h.addr, done: make(chan struct{})}
		c.flights[h.key] = f
	}
	return f
}

// joinHostPort renders a dial address.
func joinHostPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }

// remote returns the handshaken producer named by p, asking the core for its record (one
// handshake per engine incarnation; later callers wait for the same one).
func (c *Connector) remote(ctx context.Context, p *Params) (*remoteLink, error) {
	var link *remoteLink
	var f *flight
	var err error
	c.event(func(k *core) {
		var r *remoteRecord
		if r, err = k.entry(p, c.now()); err == nil {
			if link = r.link; link == nil {
				f = c.flightLocked(handshakeJob{r.key, r.addr})
			}
		}
	})
	if err != nil || link != nil {
		return link, err
	}
	return f.wait(ctx)
}

// runHandshake runs h and tells the core how it ended.
func (c *Connector) runHandshake(h handshakeJob) {
	link, err := c.handshakeWith(h)
	c.endHandshake(h, link, err)
}

// endHandshake tells the core how h ended (a failed record is forgotten, so that the next
// request tries again) and then, still under c.mu, releases h's waiters.
func (c *Connector) endHandshake(h handshakeJob, link *remoteLink, err error) {
	c.event(func(k *core) {
		k.handshakeEnded(h.key, link, err)
		if f := c.flights[h.key]; f != nil {
			delete(c.flights, h.key)
			f.link, f.err = link, err
			close(f.done)
		}
	})
}

// handshakeWith runs the side-channel handshake with h and prepares the descriptor lists; a
// failure is logged and counted.
func (c *Connector) handshakeWith(h handshakeJob) (*remoteLink, error) {
	ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
	defer cancel()
	link, err := c.link(ctx, h)
	if err != nil {
		c.log.Error("NIXL transfer failure: handshake_setup_failed", "remote_engine_id", h.key.engine, "peer_addr", h.addr, "err", err)
		if c.metrics != nil {
			c.metrics.CountFailedTransfer()
		}
		return nil, err
	}
	c.log.Info("NIXL handshake done", "remote_engine_id", link.id, "peer_addr", link.addr, "backend", link.kv.Backend().String(),
		"remote_block_size", link.meta.BlockSize, "layout", link.meta.KVCacheLayout, "clock_offset_s", link.offset)
	return link, nil
}

// link runs the side-channel handshake with h, checks what the producer publishes and prepares
// the descriptor lists a load reads through.
func (c *Connector) link(ctx context.Context, h handshakeJob) (*remoteLink, error) {
	r := &remoteLink{key: h.key, id: h.key.engine, addr: h.addr}
	res, err := handshake(ctx, r.addr, r.id, c.hash, c.cfg.EnforceHandshakeCompat, 3, c.clockSeconds, c.auth)
	err = c.kvDTypeMismatch(r.id, res.kvCacheDType, err)
	err = c.transferModeMismatch(r.id, res.transferMode, err)
	if err != nil {
		if errors.Is(err, errServerProof) {
			c.sideRefusals.Add(1)
		}
		return nil, err
	}
	m := res.meta
	if r.key.instance != "" && m.Instance != r.key.instance {
		return nil, fmt.Errorf("%w: the params name instance %s of engine %s, which now runs instance %s at %s: its KV is gone",
			ErrStaleProducer, r.key.instance, r.id, m.Instance, r.addr)
	}
	layout, err := kvcache.ParseLayout(m.KVCacheLayout)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrIncompatible, err)
	}
	// The KV dtype is part of the compatibility hash, and compared above: the producer's is ours.
	remoteGeo := kvcache.Geometry{NumLayers: m.NumLayers, NumKVHeads: m.NumKVHeads, HeadDim: m.HeadDim, BlockSize: m.BlockSize, Layout: layout, DType: c.geo.DType}
	ratio, err := kvcache.BlockRatio(c.geo, remoteGeo, c.cfg.EnablePermuteLocalKV)
	if err != nil {
		return nil, fmt.Errorf("%w with engine %s: %w", ErrIncompatible, r.id, err)
	}
	if ratio > maxBlockRatio || m.BlockLen <= 0 || m.BlockLen != remoteGeo.BlockBytes() || m.NumBlocks <= 0 {
		return nil, fmt.Errorf("%w: engine %s publishes %d blocks of %d bytes for block size %d (ratio %d, at most %d)",
			ErrIncompatible, r.id, m.NumBlocks, m.BlockLen, m.BlockSize, ratio, maxBlockRatio)
	}
	// NumBlocks comes from the peer and sizes the descriptor lists below (NumBlocks and
	// 2·NumBlocks descriptors): bound it before anything is allocated. Whether the blocks lie
	// within the regions the peer's transfer metadata advertises is checked by PrepareRemote.
	if m.NumBlocks > maxRemoteBlocks || int64(m.NumBlocks) > math.MaxInt64/int64(m.BlockLen) {
		return nil, fmt.Errorf("%w: engine %s publishes %d blocks of %d bytes; at most %d blocks are accepted from a peer",
			ErrIncompatible, r.id, m.NumBlocks, m.BlockLen, maxRemoteBlocks)
	}
	if err := c.replaceOlder(ctx, r); err != nil {
		return nil, err
	}
	peer, err := c.agent.LoadRemote(m.AgentMetadata)
	if err != nil {
		return nil, err
	}
	info, _ := c.agent.Peer(peer)
	if !offersAllowed(info.Offers, c.cfg.Backends) {
		return nil, fmt.Errorf("%w: engine %s offers the transfer backends %v, none of which kv_connector_extra_config.backends %v allows",
			ErrIncompatible, r.id, info.Offers, c.cfg.Backends)
	}
	kv, err := c.agent.PrepareRemote(ctx, peer, transfer.BlockDescs(m.KVRegion, 0, int64(m.BlockLen), m.NumBlocks), nil)
	if err != nil {
		return nil, c.transferAuthHint(r, err)
	}
	recs, err := c.agent.PrepareRemote(ctx, peer, transfer.BlockDescs(m.MetaRegion, 0, kvcache.RecordBytes, 2*m.NumBlocks), nil)
	if err != nil {
		kv.Release()
		return nil, err
	}
	local, err := c.localList(ratio)
	if err != nil {
		kv.Release()
		recs.Release()
		return nil, err
	}
	r.meta, r.offset, r.peer, r.peerInc, r.ratio, r.layout, r.kv, r.recs, r.local = m, res.offset, peer, info.Incarnation, ratio, layout, kv, recs, local
	return r, nil
}

// replaceOlder makes way for r, a new incarnation of an engine: a record of another incarnation
// of the same engine is dropped only once it is shown dead — its side channel no longer
// answers as that incarnation. While it does, r is refused: params cannot make this engine drop
// a healthy producer by naming its engine id with another instance or address.
func (c *Connector) replaceOlder(ctx context.Context, r *remoteLink) error {
	var older []*remoteLink
	c.event(func(k *core) { older = k.older(r.key) })
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
