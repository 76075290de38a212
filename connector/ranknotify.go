package connector

import (
	"time"

	"github.com/kvbridge/kvbridge/internal/kvlease"
)

// Notifications per remote rank (docs/architecture.md, "Notifications per remote rank"). vLLM
// runs one worker per rank, and each rank notifies separately: a D worker notifies every P
// worker it read from, so the guide's per-notification counters
// (vllm:nixl_num_notifications_after_expiry, vllm:nixl_num_failed_notifications) count one late
// or failed request once per pair of D rank and P rank. kvbridge's ranks share one agent and
// send one message per request; the counters still count per pair (rankPairs): a release
// carries the reader's TP size (kvlease.Release.ReaderTP, for an owner that advertises
// release_reader_tp), and each side checks it against what it knows.

// peerTP returns the TP size in the handshake metadata of the engine whose transfer agent is
// peer, and 0 when this engine has not handshaken it (one-way pull: the producer serves the
// handshake and never makes one).
func (k *core) peerTP(peer string) int {
	for _, r := range k.remotes {
		if r.link != nil && r.peer == peer {
			return max(r.link.meta.TPSize, 1)
		}
	}
	return 0
}

// totalKVHeads returns the model's KV heads (every rank's).
func (k *core) totalKVHeads() int {
	if k.kvHeads > 0 {
		return k.kvHeads
	}
	return k.geo.NumKVHeads * k.pool.TensorParallelSize()
}

// rankNotifications returns how many notifications vLLM's ranks would have exchanged with the
// engine of agent peer for one request: rankPairs of the two TP sizes, peer the decoder when
// peerReads (P counting a release or a registration) and the producer otherwise (D counting a
// push completion). The peer's TP size is the one its handshake published; claimed (a
// release's ReaderTP, 0 when none) is used only when it agrees with that, or when there was no
// handshake and it maps onto this engine's TP size. Anything else counts once, as an engine
// that does not say.
func (k *core) rankNotifications(peer string, claimed int, peerReads bool, now time.Time) int {
	known := k.peerTP(peer)
	tp := claimed
	switch {
	case claimed == 0 && known == 0:
		return 1
	case claimed == 0:
		tp = known
	case known != 0 && claimed != known:
		if ok, suppressed := k.quiet.allow("claimedTP", now); ok {
			k.log.Warn("a KV notification claims another TP size than its engine's handshake published; counting it once",
				"peer", peer, "claimed_tp", claimed, "handshake_tp", known, "similar_suppressed", suppressed)
		}
		return 1
	}
	d, p := tp, k.pool.TensorParallelSize()
	if !peerReads {
		d, p = p, d
	}
	n, err := rankPairs(d, p, k.totalKVHeads())
	if err != nil {
		if ok, suppressed := k.quiet.allow("claimedTP", now); ok {
			k.log.Warn("a KV notification names a TP size that cannot map onto this engine's; counting it once",
				"peer", peer, "tp", tp, "err", err, "similar_suppressed", suppressed)
		}
		return 1
	}
	return n
}

// countAfterExpiry counts n notifications in vllm:nixl_num_notifications_after_expiry.
func (k *core) countAfterExpiry(n int) {
	if k.metrics == nil {
		return
	}
	for range n {
		k.metrics.CountNotificationAfterExpiry()
	}
}

// releaseFor returns the release notification msg as sent to the producer of r: with this
// engine's TP size appended (version 2) when the producer parses it.
func (c *Connector) releaseFor(msg []byte, r *remoteLink) []byte {
	if r == nil || !r.meta.ReleaseReaderTP || len(msg) == 0 {
		return msg
	}
	return kvlease.AppendReaderTP(msg, c.pool.TensorParallelSize())
}

// notificationPairs returns how many notifications vLLM's ranks would send to the producer of
// r for one request (1 when r is unknown): a failed notification counts that many times.
func (c *Connector) notificationPairs(r *remoteLink) int {
	if r == nil {
		return 1
	}
	n, err := rankPairs(c.pool.TensorParallelSize(), max(r.meta.TPSize, 1), c.totalKVHeads)
	if err != nil {
		return 1
	}
	return n
}
