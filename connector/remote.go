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
	kv, recs *transfer.PreparedList // the producer's blocks (rank 0's); its records then slots
	local    *transfer.PreparedList // this engine's blocks (rank 0's), split into ratio sub-blocks
	// kvs and locals are kv and local for every tensor-parallel rank of the producer and of
	// this engine (kvs[0] is kv, locals[0] local). With tp set (the TP sizes differ) they
	// describe chunks of heads (tpMap, chunkDescs) instead of blocks.
	kvs, locals []*transfer.PreparedList
	tp          *tpMap
}

// releaseLists releases l's descriptor lists (idempotent). Loads still using them fail, as they
// would against a dead peer.
func (l *remoteLink) releaseLists() {
	for _, kv := range l.kvs {
		kv.Release()
	}
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
	ratio, tm, err := c.rankGeometry(r.id, m, remoteGeo)
	if err != nil {
		return nil, err
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
	if tm != nil && m.NumBlocks*m.NumLayers*2*(m.NumKVHeads/tm.unit) > maxTPDescs {
		return nil, fmt.Errorf("%w: engine %s publishes %d blocks of %d layers; at most %d head chunks are accepted from a producer rank with another TP size",
			ErrIncompatible, r.id, m.NumBlocks, m.NumLayers, maxTPDescs)
	}
	for _, region := range append([]uint32{m.KVRegion}, m.RankKVRegions...) {
		descs := transfer.BlockDescs(region, 0, int64(m.BlockLen), m.NumBlocks)
		if tm != nil {
			descs = chunkDescs(region, remoteGeo, m.NumBlocks, tm.unit)
		}
		kv, err := c.agent.PrepareRemote(ctx, peer, descs, nil)
		if err != nil {
			r.releaseKV()
			return nil, c.transferAuthHint(r, err)
		}
		r.kvs = append(r.kvs, kv)
	}
	recs, err := c.agent.PrepareRemote(ctx, peer, transfer.BlockDescs(m.MetaRegion, 0, kvcache.RecordBytes, 2*m.NumBlocks), nil)
	if err != nil {
		r.releaseKV()
		return nil, err
	}
	for rank := range c.pool.TensorParallelSize() {
		key := localListKey{rank: rank, ratio: ratio}
		if tm != nil {
			key.unit = tm.unit
		}
		local, err := c.localList(key)
		if err != nil {
			r.releaseKV()
			recs.Release()
			return nil, err
		}
		r.locals = append(r.locals, local)
	}
	r.meta, r.offset, r.peer, r.peerInc, r.ratio, r.layout, r.recs, r.tp = m, res.offset, peer, info.Incarnation, ratio, layout, recs, tm
	r.kv, r.local = r.kvs[0], r.locals[0]
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

// releaseKV releases the producer block lists prepared so far (a handshake that fails).
func (l *remoteLink) releaseKV() {
	for _, kv := range l.kvs {
		kv.Release()
	}
	l.kvs = nil
}

// localListKey names a local descriptor list: a tensor-parallel rank's blocks split into ratio
// sub-blocks, or, with unit > 0, into chunks of unit heads (chunkDescs).
type localListKey struct{ rank, ratio, unit int }

// localList returns the local descriptor list named by key, and (once) the scratch list for
// records and slots.
func (c *Connector) localList(key localListKey) (*transfer.PreparedList, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.scrList == nil {
		l, err := c.agent.PrepareLocal(transfer.BlockDescs(c.scrReg.ID(), 0, kvcache.RecordBytes, c.layout.scratchEntries()))
		if err != nil {
			return nil, err
		}
		c.scrList = l
	}
	if l := c.localLists[key]; l != nil {
		return l, nil
	}
	region := c.kvReg.ID()
	if key.rank > 0 {
		region = c.rankReg[key.rank-1].ID()
	}
	sub := int64(c.pool.BlockBytes() / key.ratio)
	descs := transfer.BlockDescs(region, 0, sub, c.pool.NumBlocks()*key.ratio)
	if key.unit > 0 {
		descs = chunkDescs(region, c.geo, c.pool.NumBlocks(), key.unit)
	}
	l, err := c.agent.PrepareLocal(descs)
	if err != nil {
		return nil, err
	}
	c.localLists[key] = l
	return l, nil
}

// rankGeometry checks the producer's per-rank geometry g (metadata m) against this engine's and
// returns the block ratio, and the rank mapping when the TP sizes differ (nil when they are
// equal: rank r reads rank r's blocks).
func (c *Connector) rankGeometry(id string, m agentMetadata, g kvcache.Geometry) (int, *tpMap, error) {
	localTP, remoteTP := c.pool.TensorParallelSize(), max(m.TPSize, 1)
	if remoteTP > maxRemoteTP || len(m.RankKVRegions) != remoteTP-1 {
		return 0, nil, fmt.Errorf("%w: engine %s runs TP %d and names %d rank KV regions (want %d, TP at most %d)",
			ErrIncompatible, id, remoteTP, len(m.RankKVRegions), remoteTP-1, maxRemoteTP)
	}
	if remoteTP == localTP {
		ratio, err := kvcache.BlockRatio(c.geo, g, c.cfg.EnablePermuteLocalKV)
		if err != nil {
			return 0, nil, fmt.Errorf("%w with engine %s: %w", ErrIncompatible, id, err)
		}
		return ratio, nil, nil
	}
	tm, err := newTPMap(localTP, c.geo.NumKVHeads, remoteTP, g.NumKVHeads, c.totalKVHeads)
	if err != nil {
		return 0, nil, fmt.Errorf("handshake with engine %s: %w", id, err)
	}
	same := g
	same.NumKVHeads = c.geo.NumKVHeads // the heads per rank differ by design; the rest must match
	ratio, err := kvcache.BlockRatio(c.geo, same, c.cfg.EnablePermuteLocalKV)
	if err != nil {
		return 0, nil, fmt.Errorf("%w with engine %s: %w", ErrIncompatible, id, err)
	}
	if ratio != 1 || g.Layout != kvcache.HND || c.geo.Layout != kvcache.HND {
		return 0, nil, fmt.Errorf("%w: engine %s runs TP %d (block size %d, %v), this engine TP %d (block size %d, %v): heterogeneous TP needs equal block sizes and the HND layout on both engines",
			ErrIncompatible, id, remoteTP, g.BlockSize, g.Layout, localTP, c.geo.BlockSize, c.geo.Layout)
	}
	return 1, &tm, nil
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
