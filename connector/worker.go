package connector

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/transfer"
)

// worker handles notifications from readers, lease expiry, heartbeats and idle remote engines.
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
			c.handleNotif(n)
		case <-c.tick:
			c.sweep()
		}
	}
}

// handleNotif applies one notification: "HB:token,…" extends leases; "<id>:<n>:<token>" is one
// of n reads of a lease done. A notification that presents no valid token changes nothing; it
// is counted, and logged at most once per interval.
func (c *Connector) handleNotif(n transfer.Notif) {
	msg := string(n.Msg)
	if hexTokens, ok := ParseHeartbeat(msg); ok {
		tokens := make([]LeaseToken, 0, len(hexTokens))
		for _, h := range hexTokens {
			if t, err := ParseLeaseToken(h); err == nil {
				tokens = append(tokens, t)
			}
		}
		c.mu.Lock()
		c.leases.Heartbeat(tokens, c.now(), c.cfg.LeaseDuration*2/3)
		c.mu.Unlock()
		return
	}
	id, readers, token, err := ParseRelease(msg)
	if err != nil {
		if ok, suppressed := c.quiet.allow("malformed", c.now()); ok {
			c.log.Warn("ignoring a malformed KV notification", "peer", n.Peer, "message", truncateMsg(msg), "error", err, "similar_suppressed", suppressed)
		}
		return
	}
	c.mu.Lock()
	l, res := c.leases.Notify(id, token, readers)
	if l != nil {
		c.endLease(l)
	}
	c.mu.Unlock()
	switch res {
	case NotifyUnknown:
		if c.metrics != nil {
			c.metrics.CountNotificationAfterExpiry()
		}
		if ok, suppressed := c.quiet.allow("unknown", c.now()); ok {
			c.log.Error(fmt.Sprintf("Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode worker. They may have expired.", truncateMsg(id)),
				"peer", n.Peer, "similar_suppressed", suppressed)
		}
	case NotifyRefused:
		c.refusals.notifications.Add(1)
		if ok, suppressed := c.quiet.allow("refused", c.now()); ok {
			c.log.Warn("refusing a KV notification that presents another lease's token", "request_id", truncateMsg(id), "peer", n.Peer, "similar_suppressed", suppressed)
		}
	}
}

func truncateMsg(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}

// sweep releases expired leases (every entry, not only the earliest: vllm#58222), sends due
// heartbeats and forgets remote engines idle longer than engine_ttl.
func (c *Connector) sweep() {
	now := c.now()
	c.mu.Lock()
	expired := c.leases.Expire(now)
	for _, l := range expired {
		c.endLease(l)
	}
	type beat struct {
		peer string
		msg  []byte
	}
	var beats []beat
	for _, b := range c.heartbeats.Due(now) {
		engineID, instance, _ := strings.Cut(b.Engine, "\x00")
		r := c.remotes[remoteKey{engineID, instance}]
		if r == nil {
			continue
		}
		select {
		case <-r.ready:
			if r.err == nil {
				beats = append(beats, beat{r.peer, []byte(FormatHeartbeat(b.IDs))})
			}
		default: // still handshaking: this beat is skipped, the next one goes through
		}
	}
	for _, r := range c.remotes {
		if now.Sub(r.lastUsed) > c.cfg.EngineTTL {
			select {
			case <-r.ready:
				c.log.Info("forgetting an idle remote engine", "remote_engine_id", r.id, "idle", now.Sub(r.lastUsed).String())
				c.dropRemote(r)
			default:
			}
		}
	}
	c.mu.Unlock()
	for _, l := range expired {
		c.log.Warn(fmt.Sprintf("Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) before lease expired.", l.RequestID, l.notified))
		if c.metrics != nil {
			c.metrics.CountExpiredRequest()
		}
	}
	for _, b := range beats {
		ctx, cancel := context.WithTimeout(c.ctx, time.Second)
		if err := c.agent.SendNotif(ctx, b.peer, b.msg); err != nil {
			c.log.Warn("sending a heartbeat failed", "peer", b.peer, "error", err)
			if c.metrics != nil {
				c.metrics.CountFailedNotification()
			}
		}
		cancel()
	}
}

func metricsSample(t transfer.RequestTelemetry) metrics.TransferSample {
	return metrics.TransferSample{Duration: t.TransferDuration, PostDuration: t.PostDuration, Bytes: t.Bytes, Descriptors: t.MergedDescs}
}
