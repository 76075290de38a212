package connector

import (
	"context"
	"fmt"
	"time"

	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/transfer"
)

// The worker side: the goroutine that feeds the core notifications and ticks, and perform, which
// carries out the core's actions. Every goroutine started here is counted in c.wg and ends with
// c.ctx (Close).

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
			c.mu.Lock()
			c.core.notification(n.Peer, string(n.Msg), c.now())
			c.performLocked()
		case <-c.tick:
			c.mu.Lock()
			c.core.tick(c.now())
			c.performLocked()
		}
	}
}

// performLocked takes the core's actions, unlocks c.mu (held by the caller) and performs them.
// The goroutines it starts are counted in c.wg before c.mu is released: Close sets c.closed under
// c.mu and then waits on c.wg, so a goroutine is either counted before Close waits or never
// started (its instead runs).
func (c *Connector) performLocked() {
	a := c.core.take()
	closed := c.closed
	sched := c.sched
	if n := len(a.handshakes) + len(a.loads) + len(a.notifies); !closed && n > 0 {
		c.wg.Add(n)
	}
	c.mu.Unlock()
	for _, r := range a.drops {
		_ = c.agent.InvalidateIncarnation(r.peer, r.peerInc)
		r.releaseLists()
	}
	for _, r := range a.handshakes {
		c.spawn(closed, func() { c.runHandshake(r) }, func() { c.abandonHandshake(r) })
	}
	for _, j := range a.loads {
		c.spawn(closed, func() { c.runLoad(j) }, func() {
			c.event(func(k *core) { k.loadFinished(j, j.localHit/c.geo.BlockSize, transfer.ErrClosed, true, c.now()) })
		})
	}
	for _, n := range a.notifies {
		c.spawn(closed, func() { c.notify(n) }, nil)
	}
	if a.holdsExpired > 0 {
		since := "since the engine started"
		if a.holdsSince > 0 {
			since = "in the last " + a.holdsSince.Round(time.Second).String()
		}
		c.log.Info(fmt.Sprintf("%d decoder hold(s) of bidirectional turns expired unclaimed %s (decoder_kv_blocks_ttl): their next turns, if they come, are computed at P", a.holdsExpired, since),
			"holds", a.holdsExpired)
	}
	for _, b := range a.beats {
		ctx, cancel := context.WithTimeout(c.ctx, time.Second)
		if err := c.agent.SendNotif(ctx, b.peer, b.msg); err != nil {
			c.log.Warn("sending a heartbeat failed", "peer", b.peer, "err", err)
			if c.metrics != nil {
				c.metrics.CountFailedNotification()
			}
		}
		cancel()
	}
	if sched == nil {
		return
	}
	for _, id := range a.release {
		sched.ReleaseDelayed(id)
	}
	if len(a.loaded) > 0 || len(a.failed) > 0 {
		sched.LoadsDone(a.loaded, a.failed)
	}
	if len(a.missed) > 0 {
		sched.LoadsMissed(a.missed)
	}
}

// event hands the core one event under c.mu and performs what it asks for.
func (c *Connector) event(f func(*core)) {
	c.mu.Lock()
	f(c.core)
	c.performLocked()
}

// spawn runs fn on a goroutine the connector owns, or, once the connector is closing, runs
// instead (when not nil) on the caller's goroutine. When not closed, the caller has already
// counted the goroutine in c.wg while holding c.mu (see performLocked).
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

// runLoad performs one load and reports it to the core.
func (c *Connector) runLoad(j loadJob) {
	ctx, cancel := context.WithTimeout(c.ctx, loadTimeout)
	defer cancel()
	bad, err := c.load(ctx, j)
	c.event(func(k *core) { k.loadFinished(j, bad, err, false, c.now()) })
}

// notify tells a producer that this engine will not read its blocks, retrying once over a new
// handshake when the producer's agent went away.
func (c *Connector) notify(n notice) {
	p := n.params
	ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
	defer cancel()
	var err error
	for attempt := 0; attempt < 2; attempt++ {
		var r *remoteEngine
		if r, err = c.remote(ctx, p); err != nil {
			break
		}
		if err = c.agent.SendNotif(ctx, r.peer, n.msg); err == nil || !peerGone(err) {
			break
		}
		c.forget(r)
	}
	if err != nil {
		c.log.Error("NIXL transfer failure: notification_failed", "remote_engine_id", p.RemoteEngineID, "remote_request_id", p.RemoteRequestID, "err", err)
		if c.metrics != nil {
			c.metrics.CountFailedNotification()
		}
	}
}

// peerLost is the transfer agent's OnPeerLost hook: the control connection to a producer's
// agent ended (see core.peerLost).
func (c *Connector) peerLost(name string, inc uint64) {
	c.event(func(k *core) { k.peerLost(name, inc) })
}

// forget drops r if it is still the current record of its engine incarnation, invalidating its
// transfer peer and releasing its descriptor lists (a dead incarnation's arena is unmapped).
func (c *Connector) forget(r *remoteEngine) {
	c.event(func(k *core) { k.forget(r) })
}

// authorizeRead is the transfer agent's AuthorizeRead hook (see core.authorizeRead).
func (c *Connector) authorizeRead(_ string, tag []byte, descs []transfer.Desc) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.core.authorizeRead(tag, descs)
}

func metricsSample(t transfer.RequestTelemetry) metrics.TransferSample {
	return metrics.TransferSample{Duration: t.TransferDuration, PostDuration: t.PostDuration, Bytes: t.Bytes, Descriptors: t.MergedDescs}
}
