package connector

import (
	"context"
	"fmt"
	"strconv"
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

// handleNotif applies one notification: "HB:id,…" extends leases; "<id>:<n>" is one of n reads
// of a lease done.
func (c *Connector) handleNotif(n transfer.Notif) {
	msg := string(n.Msg)
	if ids, ok := ParseHeartbeat(msg); ok {
		c.mu.Lock()
		c.leases.Heartbeat(ids, c.now(), c.cfg.LeaseDuration*2/3)
		c.mu.Unlock()
		return
	}
	i := strings.LastIndexByte(msg, ':')
	expected, err := strconv.Atoi(msg[i+1:])
	if i <= 0 || err != nil || expected < 1 {
		c.log.Warn("ignoring a malformed KV notification", "peer", n.Peer, "message", truncateMsg(msg))
		return
	}
	id := msg[:i]
	c.mu.Lock()
	l, known := c.leases.Notify(id, expected)
	if l != nil {
		c.release(id)
	}
	c.mu.Unlock()
	if !known {
		c.log.Error(fmt.Sprintf("Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode worker. They may have expired.", id), "peer", n.Peer)
		if c.metrics != nil {
			c.metrics.CountNotificationAfterExpiry()
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
		c.release(l.RequestID)
	}
	type beat struct {
		peer string
		msg  []byte
	}
	var beats []beat
	for _, b := range c.heartbeats.Due(now) {
		r := c.remotes[b.Engine]
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
