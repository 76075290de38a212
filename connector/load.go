package connector

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/transfer"
)

// ErrStaleBlocks reports a read of blocks that the producer freed and reused before the read
// finished (its lease expired): the KV read is not the prompt's and must not be used.
var ErrStaleBlocks = errors.New("KV blocks were reused by the producer before they were read")

// ErrStaleProducer reports params that name a producer instance which has since restarted: the
// blocks they name belong to someone else now.
var ErrStaleProducer = errors.New("the producer restarted since these kv_transfer_params were issued")

// ErrExpired reports a bidirectional read declined because the decoder's blocks expire too soon.
var ErrExpired = errors.New("remote KV blocks expire too soon to be read")

// loadTimeout bounds one load: handshake, READ and verification.
const loadTimeout = 60 * time.Second

// expiryMargin is how close to a decoder's TTL a bidirectional read is still attempted.
const expiryMargin = 5 * time.Second

// maxHandshakes bounds the handshakes in progress: params may name any engine at any address,
// and each new one costs a connection attempt.
const maxHandshakes = 64

// loadJob is one request's pull of remote KV into its own blocks.
type loadJob struct {
	id       string
	params   *Params
	blocks   []int32 // the request's whole block table
	prompt   []int32 // the request's prompt: what the remote blocks must hold
	localHit int     // tokens already in the leading blocks (a multiple of the block size)
	count    int     // tokens to load after them
	fromD    bool    // a bidirectional turn: the producer is a decoder with a TTL
}

// remoteKey names one incarnation of a remote engine: its engine id and its instance (random per
// start). Records are keyed by both, so params naming a new address or a new instance of a
// known engine never replace a healthy record by themselves.
type remoteKey struct{ engine, instance string }

// remoteEngine is a producer this engine has handshaken with (or is handshaking with).
type remoteEngine struct {
	key   remoteKey
	id    string        // engine id, for messages
	addr  string        // where the handshake went
	ready chan struct{} // closed when the handshake ended; then err or the rest is set
	err   error

	meta     AgentMetadata
	offset   float64 // producer clock − our clock, seconds
	peer     string  // transfer agent name
	peerInc  uint64  // transfer agent incarnation
	ratio    int     // local block size ÷ remote block size
	layout   kvcache.Layout
	kv, recs *transfer.PreparedList // the producer's blocks; its records then slots
	local    *transfer.PreparedList
	lastUsed time.Time
}

// releaseLists releases r's descriptor lists (idempotent), once its handshake has succeeded.
// Loads still using them fail, as they would against a dead peer.
func (r *remoteEngine) releaseLists() {
	select {
	case <-r.ready:
	default:
		return
	}
	if r.err == nil && r.kv != nil {
		r.kv.Release()
		r.recs.Release()
	}
}

// startLoad runs j on a goroutine the connector owns. c.mu must be held.
func (c *Connector) startLoad(j loadJob) {
	if c.closed {
		c.finishLoad(j, j.localHit/c.geo.BlockSize, transfer.ErrClosed, true)
		return
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		ctx, cancel := context.WithTimeout(c.ctx, loadTimeout)
		defer cancel()
		bad, err := c.load(ctx, j)
		c.mu.Lock()
		defer c.mu.Unlock()
		c.finishLoad(j, bad, err, false)
	}()
}

// finishLoad reports a load to the engine. c.mu must be held.
func (c *Connector) finishLoad(j loadJob, firstBad int, err error, quiet bool) {
	st := c.reqs[j.id]
	finished := st == nil || st.finished
	if st != nil {
		st.loading = false
		c.untrack(st)
		if st.finished {
			delete(c.reqs, j.id)
		}
	}
	if err != nil && !quiet {
		c.log.Error("NIXL transfer failure: transfer_failed", "request_id", j.id, "remote_engine_id", j.params.RemoteEngineID,
			"remote_request_id", j.params.RemoteRequestID, "remote_host", j.params.RemoteHost, "remote_port", j.params.RemotePort,
			"num_local_blocks", len(j.blocks), "num_remote_blocks", len(j.params.Blocks()), "error", err)
		if errors.Is(err, ErrVerification) {
			c.refusals.verification.Add(1)
		}
		if c.metrics != nil && !errors.Is(err, ErrExpired) {
			c.metrics.CountFailedTransfer()
		}
	}
	if c.sched == nil {
		return
	}
	switch {
	case finished:
		c.sched.ReleaseDelayed(j.id)
	case err != nil && j.fromD && (errors.Is(err, errLeaseGone) || errors.Is(err, transfer.ErrPermission)):
		// A decoder's hold is a cache: one that expired or was evicted was not there to pull.
		// Nothing was used; the prompt is computed here, whatever the failure policy.
		c.sched.LoadsMissed([]string{j.id})
	case err != nil:
		c.sched.LoadsDone(nil, map[string]int{j.id: firstBad})
	default:
		c.sched.LoadsDone([]string{j.id}, nil)
	}
}

// load reads the producer's KV for positions [localHit, localHit+count) into j's blocks and
// verifies it against what the producer published. It returns the index (in j.blocks) of the
// first block that could not be loaded.
func (c *Connector) load(ctx context.Context, j loadJob) (int, error) {
	first := j.localHit / c.geo.BlockSize
	for attempt := 0; ; attempt++ {
		r, err := c.remote(ctx, j.params)
		if err != nil {
			return first, err
		}
		bad, err := c.read(ctx, j, r)
		if err != nil && attempt == 0 && peerGone(err) {
			// The connection died since our handshake (or the producer's agent restarted):
			// count the failed attempt and try once more over a new handshake.
			c.log.Warn("NIXL transfer failure: transfer_failed; retrying after a new handshake", "request_id", j.id, "remote_engine_id", r.id, "error", err)
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
func (c *Connector) read(ctx context.Context, j loadJob, r *remoteEngine) (int, error) {
	first := j.localHit / c.geo.BlockSize
	if j.fromD && j.params.RemoteBlocksExpiryTime != nil {
		deadline := *j.params.RemoteBlocksExpiryTime - r.offset // on our clock
		if c.clockSeconds()+expiryMargin.Seconds() >= deadline {
			c.log.Warn(fmt.Sprintf("Declining expired remote read for %s from engine %s", j.id, r.id))
			if c.metrics != nil {
				c.metrics.CountExpiredRequest()
			}
			return first, fmt.Errorf("%w: request %s, engine %s", ErrExpired, j.id, r.id)
		}
	}
	plan, err := c.plan(j, r)
	if err != nil {
		return first, err
	}
	// Every READ presents the lease token (see auth.go).
	ropts := &transfer.RequestOptions{Timeout: loadTimeout, Tag: j.params.Lease[:]}
	data, err := c.agent.MakeRequest(transfer.Read, r.local, plan.local, r.kv, plan.remote, ropts)
	if err != nil {
		return first, c.forgetOn(r, err)
	}
	defer data.Release()
	if err := data.Post(ctx, nil); err != nil {
		return first, c.forgetOn(r, err)
	}
	if err := data.Wait(ctx); err != nil {
		return first, c.forgetOn(r, err)
	}
	if c.metrics != nil {
		c.metrics.ObserveTransfer(metricsSample(data.Telemetry()))
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
	notif := []byte(FormatRelease(j.params.RemoteRequestID, 1, j.params.Lease))
	if err := meta.Post(ctx, notif); err != nil {
		return first, c.forgetOn(r, err)
	}
	if err := meta.Wait(ctx); err != nil {
		return first, c.forgetOn(r, err)
	}
	if bad, err := c.verifyRead(j, r, plan, slotEntry); err != nil {
		return bad, err
	}
	if err := c.postprocess(j, r, plan); err != nil {
		return first, err
	}
	return 0, nil
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
func (c *Connector) plan(j loadJob, r *remoteEngine) (readPlan, error) {
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
func (c *Connector) postprocess(j loadJob, r *remoteEngine, p readPlan) error {
	if r.ratio == 1 && r.layout == c.geo.Layout {
		return nil
	}
	remoteGeo := c.geo
	remoteGeo.BlockSize = r.meta.BlockSize
	remoteGeo.Layout = r.layout
	for i := p.firstLocal; i <= p.lastLocal; i++ {
		b := c.pool.Bytes(j.blocks[i])
		var err error
		if r.ratio > 1 {
			err = kvcache.RegroupBlocks(b, b, c.geo, remoteGeo)
		} else {
			err = kvcache.ConvertLayout(b, b, c.geo, r.layout, c.geo.Layout)
		}
		if err != nil {
			return fmt.Errorf("request %s: post-process block %d: %w", j.id, j.blocks[i], err)
		}
	}
	return nil
}

// forgetOn drops a remote engine whose agent restarted or disconnected, so that the next
// request handshakes again; it returns err.
func (c *Connector) forgetOn(r *remoteEngine, err error) error {
	if peerGone(err) {
		c.forget(r)
	}
	return err
}

// peerGone reports a transfer error that means the producer's agent restarted or went away.
func peerGone(err error) bool {
	return errors.Is(err, transfer.ErrStaleIncarnation) || errors.Is(err, transfer.ErrRemoteDisconnect) || errors.Is(err, transfer.ErrNotFound)
}

// forget drops r (invalidating its transfer peer and releasing its descriptor lists, so a dead
// incarnation's arena is unmapped) if it is still the current record of its engine.
func (c *Connector) forget(r *remoteEngine) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.remotes[r.key] == r {
		c.dropRemote(r)
	}
}

// peerLost is the transfer agent's OnPeerLost hook: the control connection to a producer's
// agent ended. Its death is observed: its records are dropped now, which unmaps its arena,
// instead of when engine_ttl passes. The next request for it handshakes again.
func (c *Connector) peerLost(name string, inc uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range c.remotes {
		select {
		case <-r.ready:
			if r.err == nil && r.peer == name && r.peerInc == inc {
				c.log.Info("a remote engine's transfer agent went away; forgetting it", "remote_engine_id", r.id, "addr", r.addr)
				c.dropRemote(r)
			}
		default:
		}
	}
}

// startNotify tells a producer that this engine will not read its blocks (a full local hit, a
// request that ended before its read, or one refused before it reached the scheduler) so that
// it frees them now. c.mu must be held.
func (c *Connector) startNotify(p *Params) {
	if c.closed {
		return
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
		defer cancel()
		var err error
		for attempt := 0; attempt < 2; attempt++ {
			var r *remoteEngine
			if r, err = c.remote(ctx, p); err != nil {
				break
			}
			if err = c.agent.SendNotif(ctx, r.peer, []byte(FormatRelease(p.RemoteRequestID, 1, p.Lease))); err == nil || !peerGone(err) {
				break
			}
			c.forget(r)
		}
		if err != nil {
			c.log.Error("NIXL transfer failure: notification_failed", "remote_engine_id", p.RemoteEngineID, "remote_request_id", p.RemoteRequestID, "error", err)
			if c.metrics != nil {
				c.metrics.CountFailedNotification()
			}
		}
	}()
}

// remote returns the handshaken producer named by p, starting one handshake per engine
// incarnation (later callers wait for the same one).
func (c *Connector) remote(ctx context.Context, p *Params) (*remoteEngine, error) {
	c.mu.Lock()
	r, err := c.entry(p)
	c.mu.Unlock()
	if err != nil {
		return nil, err
	}
	select {
	case <-r.ready:
	case <-ctx.Done():
		return nil, fmt.Errorf("%w: waiting for the handshake with %s: %w", ErrHandshake, r.addr, ctx.Err())
	}
	if r.err != nil {
		c.mu.Lock()
		if c.remotes[r.key] == r {
			delete(c.remotes, r.key) // the next request tries again
		}
		c.mu.Unlock()
		return nil, r.err
	}
	return r, nil
}

// entry returns the record of the producer incarnation named by p, starting its handshake if
// there is none. A known incarnation is used whatever address the params give (proxies rewrite
// remote_host); a new one is handshaken at the address given. c.mu must be held.
func (c *Connector) entry(p *Params) (*remoteEngine, error) {
	key := remoteKey{p.RemoteEngineID, p.Instance}
	r := c.remotes[key]
	if r == nil {
		if c.closed {
			return nil, transfer.ErrClosed
		}
		if c.handshaking >= maxHandshakes {
			return nil, fmt.Errorf("%w: %d handshakes already in progress", ErrHandshake, c.handshaking)
		}
		addr := net.JoinHostPort(p.RemoteHost, strconv.Itoa(p.RemotePort))
		r = &remoteEngine{key: key, id: p.RemoteEngineID, addr: addr, ready: make(chan struct{})}
		c.remotes[key] = r
		c.handshaking++
		c.wg.Add(1)
		go func() {
			defer c.wg.Done()
			c.handshakeWith(r)
			c.mu.Lock()
			c.handshaking--
			c.mu.Unlock()
		}()
	}
	r.lastUsed = c.now()
	return r, nil
}

// dropRemote forgets r and, if it is still the loaded incarnation, its transfer peer. c.mu must
// be held.
func (c *Connector) dropRemote(r *remoteEngine) {
	if c.remotes[r.key] == r {
		delete(c.remotes, r.key)
	}
	select {
	case <-r.ready:
		if r.err == nil && r.peer != "" {
			_ = c.agent.InvalidateIncarnation(r.peer, r.peerInc)
			r.releaseLists()
		}
	default:
	}
}

// handshakeWith runs the side-channel handshake and prepares the descriptor lists, then closes
// r.ready.
func (c *Connector) handshakeWith(r *remoteEngine) {
	defer close(r.ready)
	ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
	defer cancel()
	fail := func(err error) {
		r.err = err
		c.log.Error("NIXL transfer failure: handshake_setup_failed", "remote_engine_id", r.id, "remote_addr", r.addr, "error", err)
		if c.metrics != nil {
			c.metrics.CountFailedTransfer()
		}
	}
	res, err := handshake(ctx, r.addr, r.id, c.hash, c.cfg.EnforceHandshakeCompat, 3, c.clockSeconds, c.auth)
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
	remoteGeo := kvcache.Geometry{NumLayers: m.NumLayers, NumKVHeads: m.NumKVHeads, HeadDim: m.HeadDim, BlockSize: m.BlockSize, Layout: layout}
	ratio, err := kvcache.BlockRatio(c.geo, remoteGeo, c.cfg.EnablePermuteLocalKV)
	if err != nil {
		fail(fmt.Errorf("%w with engine %s: %w", ErrIncompatible, r.id, err))
		return
	}
	if ratio > maxBlockRatio || m.BlockLen != remoteGeo.BlockBytes() || m.NumBlocks <= 0 {
		fail(fmt.Errorf("%w: engine %s publishes %d blocks of %d bytes for block size %d (ratio %d, at most %d)",
			ErrIncompatible, r.id, m.NumBlocks, m.BlockLen, m.BlockSize, ratio, maxBlockRatio))
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
	c.log.Info("NIXL handshake done", "remote_engine_id", r.id, "addr", r.addr, "backend", kv.Backend().String(),
		"remote_block_size", m.BlockSize, "layout", m.KVCacheLayout, "clock_offset_s", res.offset)
}

// replaceOlder makes way for r, a new incarnation of an engine: a record of another incarnation
// of the same engine is dropped only once it is shown dead — its side channel no longer
// answers as that incarnation. While it does, r is refused: params cannot make this engine drop
// a healthy producer by naming its engine id with another instance or address.
func (c *Connector) replaceOlder(ctx context.Context, r *remoteEngine) error {
	c.mu.Lock()
	var older []*remoteEngine
	for k, o := range c.remotes {
		if o != r && k.engine == r.key.engine {
			select {
			case <-o.ready:
				if o.err == nil {
					older = append(older, o)
				}
			default:
			}
		}
	}
	c.mu.Unlock()
	for _, o := range older {
		res, err := handshake(ctx, o.addr, o.id, c.hash, c.cfg.EnforceHandshakeCompat, 1, c.clockSeconds, c.auth)
		if err == nil && res.meta.Instance == o.key.instance {
			return fmt.Errorf("%w: engine %s still runs instance %s at %s; refusing another instance claiming its id at %s",
				ErrIncompatible, o.id, o.key.instance, o.addr, r.addr)
		}
		c.log.Info("a remote engine restarted; forgetting its previous instance", "remote_engine_id", o.id, "instance", o.key.instance, "addr", o.addr)
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
