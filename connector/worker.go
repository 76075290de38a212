package connector

import (
	"context"
	"fmt"
	"time"

	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/transfer"
)

// The worker side: the goroutine that feeds the core notifications and ticks, and the loop every
// event goes through — apply hands the core the event under c.mu and takes what it asked for,
// perform carries that out once c.mu is released. Every goroutine started here is counted in
// c.wg and ends with c.ctx (Close).

// worker hands the core the notifications from readers and the clock's ticks (lease expiry,
// heartbeats, idle remote engines).
func (c *Connector) worker() {
	defer c.wg.Done()
	notifs := c.agent.Notifications()
	for {
		select {
		case <-c.ctx.Done():
			return
		case n, ok := <-notifs:
			if !ok {
				return
			}
			c.event(func(k *core) {
				if !k.pushMessage(n.Peer, n.Incarnation, string(n.Msg), c.now()) {
					k.notification(n.Peer, string(n.Msg), c.now())
				}
			})
		case <-c.tick:
			c.event(func(k *core) { k.tick(c.now()) })
		}
	}
}

// batch is what one event asked for, taken under c.mu and performed after it is released.
type batch struct {
	actions
	closed bool      // the connector is closing: start no goroutine
	sched  Scheduler // nil before Start
	waits  []*flight // the handshake each of loads waits for before reading, or nil
	// regWaits: the handshake each of registers waits for before sending, or nil
	regWaits []*flight
}

// event hands the core one event (f, which may also touch what c.mu guards) and performs the
// actions it emitted.
func (c *Connector) event(f func(k *core)) { c.perform(c.apply(f)) }

// apply runs f on the core under c.mu and takes the actions it emitted.
func (c *Connector) apply(f func(k *core)) batch {
	c.mu.Lock()
	defer c.mu.Unlock()
	f(c.core)
	return c.takeLocked()
}

// takeLocked takes the core's actions. The goroutines they start are counted in c.wg before
// c.mu is released: Close sets c.closed under c.mu and then waits on c.wg, so a goroutine is
// either counted before Close waits or never started (its instead runs, see spawn). A load that
// waits for a handshake gets that handshake's flight now, while the handshake is known to be in
// progress.
func (c *Connector) takeLocked() batch {
	b := batch{actions: c.core.take(), closed: c.closed, sched: c.sched}
	if n := len(b.handshakes) + len(b.loads) + len(b.notifies) + len(b.registers) + len(b.pushes) + len(b.pushNotices); !b.closed && n > 0 {
		c.wg.Add(n)
	}
	for _, j := range b.loads {
		var f *flight
		if j.awaiting {
			f = c.flightLocked(j.handshake)
		}
		b.waits = append(b.waits, f)
	}
	for _, j := range b.registers {
		var f *flight
		if j.awaiting {
			f = c.flightLocked(j.handshake)
		}
		b.regWaits = append(b.regWaits, f)
	}
	return b
}

// perform carries out b, in the order the fields of actions document; c.mu is not held.
func (c *Connector) perform(b batch) {
	for _, l := range b.drops {
		_ = c.agent.InvalidateIncarnation(l.peer, l.peerInc)
		l.releaseLists()
	}
	for _, h := range b.handshakes {
		c.spawn(b.closed, func() { c.runHandshake(h) }, func() { c.endHandshake(h, nil, transfer.ErrClosed) })
	}
	for i, j := range b.loads {
		f := b.waits[i]
		c.spawn(b.closed, func() { c.runLoad(j, f) }, func() {
			c.event(func(k *core) { k.loadFinished(j, j.localHit/c.geo.BlockSize, transfer.ErrClosed, true, c.now()) })
		})
	}
	for _, n := range b.notifies {
		c.spawn(b.closed, func() { c.notify(n) }, nil)
	}
	for i, j := range b.registers {
		f := b.regWaits[i]
		c.spawn(b.closed, func() { c.runRegister(j, f) }, func() {
			c.event(func(k *core) { k.pushFailed(j.id, j.nonce, transfer.ErrClosed, c.now()) })
		})
	}
	for _, j := range b.pushes {
		c.spawn(b.closed, func() {
			if !c.handOverPush(j) {
				c.runPush(j)
			}
		}, func() { c.event(func(k *core) { k.pushEnded(j.id, false) }) })
	}
	for _, n := range b.pushNotices {
		c.spawn(b.closed, func() { c.sendPushNotice(n) }, nil)
	}
	if b.holdsExpired > 0 {
		since := "since the engine started"
		if b.holdsSince > 0 {
			since = "in the last " + b.holdsSince.Round(time.Second).String()
		}
		c.log.Info(fmt.Sprintf("%d decoder hold(s) of bidirectional turns expired unclaimed %s (decoder_kv_blocks_ttl): their next turns, if they come, are computed at P", b.holdsExpired, since),
			"holds", b.holdsExpired)
	}
	for _, bt := range b.beats {
		c.sendBeat(bt)
	}
	if b.sched == nil {
		return
	}
	for _, id := range b.release {
		b.sched.ReleaseDelayed(id)
	}
	if len(b.loaded) > 0 || len(b.failed) > 0 {
		b.sched.LoadsDone(b.loaded, b.first, b.failed)
	}
	if len(b.missed) > 0 {
		b.sched.LoadsMissed(b.missed)
	}
}

// sendBeat sends one heartbeat batch, waiting at most a second for it.
func (c *Connector) sendBeat(b beat) {
	ctx, cancel := context.WithTimeout(c.ctx, time.Second)
	defer cancel()
	if err := c.agent.SendNotif(ctx, b.peer, b.msg); err != nil {
		c.log.Warn("sending a heartbeat failed", "peer", b.peer, "err", err)
		if c.metrics != nil {
			for range max(b.ranks, 1) {
				c.metrics.CountFailedNotification()
			}
		}
	}
}

// spawn runs fn on a goroutine the connector owns, or, once the connector is closing, runs
// instead (when not nil) on the caller's goroutine. When not closed, the goroutine was already
// counted in c.wg under c.mu (see takeLocked).
func (c *Connector) spawn(closed bool, fn, instead func()) {
	if closed {
		if instead != nil {
			instead()
		}
		return
	}
	go func() {
		defer c.wg.Done()
		fn()
	}()
}

// runLoad performs one load (after the handshake f, when not nil) and reports it to the core.
func (c *Connector) runLoad(j loadJob, f *flight) {
	ctx, cancel := context.WithTimeout(c.ctx, loadTimeout)
	defer cancel()
	bad, err := c.load(ctx, j, f)
	c.event(func(k *core) { k.loadFinished(j, bad, err, false, c.now()) })
}

// notify tells a producer that this engine will not read its blocks, retrying once over a new
// handshake when the producer's agent went away.
func (c *Connector) notify(n notice) {
	p := n.params
	ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
	defer cancel()
	var err error
	var r *remoteLink
	for attempt := 0; attempt < 2; attempt++ {
		if r, err = c.remote(ctx, p); err != nil {
			break
		}
		if err = c.agent.SendNotif(ctx, r.peer, c.releaseFor(n.msg, r)); err == nil || !peerGone(err) {
			break
		}
		c.forget(r)
	}
	if err != nil {
		// vLLM's every D rank would have failed to notify every P rank it reads from.
		c.log.Error("NIXL transfer failure: notification_failed", "remote_engine_id", p.RemoteEngineID, "remote_request_id", p.RemoteRequestID, "err", err)
		if c.metrics != nil {
			for range c.notificationPairs(r) {
				c.metrics.CountFailedNotification()
			}
		}
	}
}

// peerLost is the transfer agent's OnPeerLost hook: the control connection to a producer's
// agent ended (see core.peerLost).
func (c *Connector) peerLost(name string, inc uint64) {
	c.event(func(k *core) { k.peerLost(name, inc, c.now()) })
}

// forget drops the record of l's engine incarnation if l is still its link, invalidating its
// transfer peer and releasing its descriptor lists (a dead incarnation's arena is unmapped).
func (c *Connector) forget(l *remoteLink) {
	c.event(func(k *core) { k.forget(l) })
}

// authorizeRead is the transfer agent's AuthorizeRead hook (see core.authorizeRead).
func (c *Connector) authorizeRead(_ string, tag []byte, descs []transfer.Desc) (err error) {
	c.event(func(k *core) { err = k.authorizeRead(tag, descs) })
	return err
}

// authorizeWrite is the transfer agent's AuthorizeWrite hook in push mode (see
// core.authorizeWrite).
func (c *Connector) authorizeWrite(peer string, descs []transfer.Desc) (err error) {
	c.event(func(k *core) { err = k.authorizeWrite(peer, descs) })
	return err
}

func metricsSample(t transfer.RequestTelemetry) metrics.TransferSample {
	return metrics.TransferSample{Duration: t.TransferDuration, PostDuration: t.PostDuration, Bytes: t.Bytes, Descriptors: t.MergedDescs}
}
