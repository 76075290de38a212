package connector

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvbridge/kvbridge/transfer"
)

// The worker's side of push mode (push.go): sending a decoder's registration once the
// producer's handshake is done, and the producer's WRITE into the registered blocks with the
// completion attached. Both run on goroutines the connector owns, with deadlines.

// registerTimeout bounds a registration: the producer's handshake and the send.
const registerTimeout = 10 * time.Second

// runRegister sends a decoder's registration (or cancel) j to the producer named by its params,
// after the handshake f when not nil. A registration that cannot be sent ends the request's
// load at once.
func (c *Connector) runRegister(j registerJob, f *flight) {
	ctx, cancel := context.WithTimeout(c.ctx, registerTimeout)
	defer cancel()
	err := c.register(ctx, j, f)
	if err == nil {
		return
	}
	if j.cancel {
		c.log.Warn("telling a push producer to free its blocks failed; it frees them at lease expiry", "request_id", j.id,
			"remote_engine_id", j.params.RemoteEngineID, "err", err)
		if c.metrics != nil {
			c.metrics.CountFailedNotification()
		}
		return
	}
	c.event(func(k *core) {
		k.pushFailed(j.id, j.nonce, fmt.Errorf("push registration with engine %s: %w", j.params.RemoteEngineID, err), c.now())
	})
}

// register waits for the producer's handshake, checks that it can write into this engine's
// blocks, records the producer's agent with the core and sends j.
func (c *Connector) register(ctx context.Context, j registerJob, f *flight) error {
	if j.handshakeErr != nil {
		return j.handshakeErr
	}
	if f != nil {
		if _, err := f.wait(ctx); err != nil {
			return err
		}
	}
	r, err := c.remote(ctx, j.params)
	if err != nil {
		return err
	}
	if err := c.pushGeometry(r); err != nil {
		return err
	}
	if !j.cancel {
		waiting := false
		c.event(func(k *core) { waiting = k.pushRegistered(j.id, j.nonce, r.peer, r.peerInc) })
		if !waiting {
			return nil // expired or failed meanwhile: nobody waits for this registration
		}
	}
	return c.forgetOn(r, c.agent.SendNotif(ctx, r.peer, j.msg))
}

// pushGeometry refuses a push between engines whose blocks differ: a producer WRITEs its blocks
// byte for byte into the decoder's (regrouping and permuting are a reader's post-processing,
// pull only). Between different TP sizes it writes chunks of heads (pushPairs), which the
// handshake admitted only with equal block sizes and HND on both (rankGeometry).
func (c *Connector) pushGeometry(r *remoteLink) error {
	if r.ratio != 1 || r.meta.BlockSize != c.geo.BlockSize || r.layout != c.geo.Layout {
		return fmt.Errorf("%w: push needs the same block size and KV layout on both engines: engine %s has block size %d (%s), this engine %d (%s)",
			ErrIncompatible, r.id, r.meta.BlockSize, r.layout, c.geo.BlockSize, c.geo.Layout)
	}
	return nil
}

// runPush WRITEs a finished request's KV into the decoder's registered blocks and tells the core
// that the write ended (the request's lease ends). A write that cannot be posted or fails is
// reported to the decoder at once.
func (c *Connector) runPush(j pushJob) {
	ctx, cancel := context.WithTimeout(c.ctx, loadTimeout)
	defer cancel()
	r, err := c.push(ctx, j)
	if errors.Is(err, errWrongSender) {
		c.log.Warn("refusing a KV push registration naming blocks of an engine whose transfer agent did not send it; the blocks are kept",
			"request_id", j.id, "peer", j.peer, "named_engine", j.reg.EngineID, "err", err)
		c.sendPushNotice(pushNotice{peer: j.peer, msg: encodePush(pushDonePrefix, pushCompletion{RequestID: j.reg.RequestID, Nonce: j.reg.Nonce, Error: err.Error()})})
		c.event(func(k *core) { k.pushEnded(j.id, true) })
		return
	}
	if err != nil {
		c.log.Error("NIXL transfer failure: push_failed", "request_id", j.id, "remote_engine_id", j.reg.EngineID,
			"remote_request_id", j.reg.RequestID, "num_blocks", len(j.reg.BlockIDs), "err", err)
		if c.metrics != nil && !errors.Is(err, ErrExpired) {
			c.metrics.CountFailedTransfer()
		}
		if r != nil && peerGone(err) {
			c.forget(r)
		}
		c.sendPushNotice(pushNotice{peer: j.peer, msg: encodePush(pushDonePrefix, pushCompletion{RequestID: j.reg.RequestID, Nonce: j.reg.Nonce, Error: err.Error()})})
	}
	c.event(func(k *core) { k.pushEnded(j.id, false) })
}

// pushTarget returns the handshaken decoder that sent reg (from the agent peer, incarnation inc)
// for request id, and how long its blocks still wait, once it is shown to be the engine reg
// names, with blocks like this engine's, waiting long enough for a write to be posted.
func (c *Connector) pushTarget(ctx context.Context, id string, reg pushRegistration, peer string, inc uint64) (*remoteLink, time.Duration, error) {
	dp := &Params{RemoteEngineID: reg.EngineID, Instance: reg.Instance, RemoteHost: reg.Host, RemotePort: reg.Port}
	r, err := c.remote(ctx, dp)
	if err != nil {
		return nil, 0, err
	}
	if r.peer != peer || r.peerInc != inc {
		// Only the engine that owns the blocks may name them: a registration sent by another
		// agent (or another incarnation), naming another engine's blocks, is refused.
		return nil, 0, fmt.Errorf("%w: it came from transfer agent %s (incarnation %x), engine %s's agent is %s (incarnation %x)",
			errWrongSender, peer, inc, r.id, r.peer, r.peerInc)
	}
	if err := c.pushGeometry(r); err != nil {
		return nil, 0, err
	}
	// The decoder frees its blocks at its deadline: never post a write that could land later.
	left := time.Duration((reg.Expiry - r.offset - c.clockSeconds()) * float64(time.Second))
	if left < expiryMargin {
		if c.metrics != nil {
			c.metrics.CountExpiredRequest()
		}
		return r, 0, fmt.Errorf("%w: request %s: the decoder's blocks expire in %s", ErrExpired, id, left.Round(time.Millisecond))
	}
	return r, left, nil
}

// errWrongSender: a registration named an engine whose transfer agent did not send it.
var errWrongSender = errors.New("the registration did not come from the engine it names")

// push handshakes the decoder that registered (its side channel), checks that the registration
// came from that engine's own transfer agent, and writes.
func (c *Connector) push(ctx context.Context, j pushJob) (*remoteLink, error) {
	r, left, err := c.pushTarget(ctx, j.id, j.reg, j.peer, j.peerInc)
	if err != nil {
		return r, err
	}
	local, remote := pushTail(j, c.geo.BlockSize)
	for _, b := range remote {
		if b >= r.meta.NumBlocks {
			return r, fmt.Errorf("%w: the registration names block %d, engine %s has %d", ErrParams, b, r.id, r.meta.NumBlocks)
		}
	}
	done := j.completion()
	if len(local) == 0 {
		return r, c.forgetOn(r, c.agent.SendNotif(ctx, r.peer, done))
	}
	opts := &transfer.RequestOptions{Timeout: min(loadTimeout, left-expiryMargin/2)}
	// One WRITE per pair of this engine's rank and the decoder's (pushPairs), in order; the
	// last carries the completion, once all the others landed.
	writes := c.pushPairs(r, local, remote, -1)
	for i, w := range writes {
		var notif []byte
		if i == len(writes)-1 {
			notif = done
		}
		if err := c.write(ctx, w.local, w.li, w.remote, w.ri, opts, notif); err != nil {
			return r, err
		}
	}
	return r, nil
}

// rankWrite is one WRITE of a push: descriptors li of this engine's list local into ri of the
// decoder's list remote.
type rankWrite struct {
	local, remote *transfer.PreparedList
	li, ri        []int
}

// pushPairs returns the WRITEs that push this engine's blocks local into the decoder's blocks
// remote (pairs by index), the inverse of a pull's reads (docs/architecture.md, "KV between
// tensor-parallel ranks"). Equal TP sizes: rank r's blocks into the decoder's rank r, ranks
// N−1 … 0. Different TP sizes: every chunk of heads of every decoder rank is written once, from
// the rank of this engine that holds it (tpMap.source from the decoder's side: a head this
// engine replicates is written from one replica), one WRITE per pair of decoder rank and rank
// of this engine, decoder ranks and then this engine's ranks descending; there, with layer ≥ 0
// (a layer-by-layer push), only that layer's chunks.
func (c *Connector) pushPairs(r *remoteLink, local, remote []int, layer int) []rankWrite {
	var out []rankWrite
	if r.tp == nil {
		for rank := len(r.locals) - 1; rank >= 0; rank-- {
			out = append(out, rankWrite{r.locals[rank], r.kvs[rank], local, remote})
		}
		return out
	}
	inv := r.tp.inverse()
	dg := c.geo
	dg.NumKVHeads = r.meta.NumKVHeads
	pairs := inv.plan(readPlan{local: remote, remote: local}, dg, c.geo) // keys: decoder rank, this engine's rank
	for dr := inv.localTP - 1; dr >= 0; dr-- {
		for pr := inv.remoteTP - 1; pr >= 0; pr-- {
			q := pairs[rankPair{dr, pr}]
			if q == nil {
				continue
			}
			li, ri := q.remote, q.local
			if layer >= 0 {
				li, ri = nil, nil
				for k, idx := range q.local {
					if chunkLayer(dg, inv.unit, idx) == layer {
						li, ri = append(li, q.remote[k]), append(ri, idx)
					}
				}
			}
			out = append(out, rankWrite{r.locals[pr], r.kvs[dr], li, ri})
		}
	}
	return out
}

// write WRITEs the local descriptors li of list local into ri of the decoder's list remote,
// with notif delivered after the data (nil: none), and waits for it (waitWrite).
func (c *Connector) write(ctx context.Context, local *transfer.PreparedList, li []int, remote *transfer.PreparedList, ri []int, opts *transfer.RequestOptions, notif []byte) error {
	w, err := c.agent.MakeRequest(transfer.Write, local, li, remote, ri, opts)
	if err != nil {
		return err
	}
	return c.runWrite(ctx, w, notif)
}

// runWrite posts the WRITE w with notif (nil: none), waits for it (waitWrite), counts it in the
// transfer metrics, and releases it.
func (c *Connector) runWrite(ctx context.Context, w *transfer.Request, notif []byte) error {
	defer w.Release()
	if err := w.Post(ctx, notif); err != nil {
		return err
	}
	if err := c.waitWrite(ctx, w); err != nil {
		return err
	}
	if c.metrics != nil {
		c.metrics.ObserveTransfer(metricsSample(w.Telemetry()))
	}
	return nil
}

// waitWrite waits for a WRITE; when it failed, or ctx ended first, it waits on until the
// transfer engine no longer touches the decoder's memory (the request's own deadline bounds it),
// so that a failure reported to the decoder is never followed by bytes of this write.
func (c *Connector) waitWrite(ctx context.Context, w *transfer.Request) error {
	err := w.Wait(ctx)
	if err != nil {
		w.Release() // cancels a post still in progress
		select {
		case <-w.Done():
		case <-c.ctx.Done():
		}
	}
	return err
}

// sendPushNotice sends a failure completion to a decoder's agent, waiting at most a second.
func (c *Connector) sendPushNotice(n pushNotice) {
	ctx, cancel := context.WithTimeout(c.ctx, time.Second)
	defer cancel()
	if err := c.agent.SendNotif(ctx, n.peer, n.msg); err != nil {
		c.log.Warn("telling a push decoder that its KV will not come failed; it gives up at its lease", "peer", n.peer, "err", err)
		if c.metrics != nil {
			c.metrics.CountFailedNotification()
		}
	}
}

// streamChunks writes one layer of one step's blocks (pairs of this engine's block and the
// decoder's) into a decoder of another TP size: that layer's chunks of heads, by pushPairs.
func (c *Connector) streamChunks(ctx context.Context, link *remoteLink, left time.Duration, j streamJob) error {
	local := make([]int, 0, len(j.pairs))
	remote := make([]int, 0, len(j.pairs))
	for _, p := range j.pairs {
		if int(p[1]) >= link.meta.NumBlocks {
			return fmt.Errorf("%w: the registration names block %d, engine %s has %d", ErrParams, p[1], link.id, link.meta.NumBlocks)
		}
		local, remote = append(local, int(p[0])), append(remote, int(p[1]))
	}
	opts := &transfer.RequestOptions{Timeout: min(loadTimeout, left-expiryMargin/2)}
	for _, w := range c.pushPairs(link, local, remote, j.layer) {
		if err := c.write(ctx, w.local, w.li, w.remote, w.ri, opts, nil); err != nil {
			return err
		}
	}
	return nil
}
