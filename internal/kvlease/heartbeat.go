package kvlease

import (
	"sort"
	"time"
)

// HeartbeatTracker is the decoder's list of remote leases whose blocks it has yet to read (by
// their tokens, in hex), grouped by producer incarnation (heartbeatKey: engine id and
// instance); it says when a heartbeat batch is due (every lease/6, docs/architecture.md, wire
// contract item 24).
// A pure state machine: the caller passes the time and sends the batches. Not safe for
// concurrent use.
type HeartbeatTracker struct {
	// Interval is the time between two batches to one producer (kv_lease_duration // 6).
	Interval time.Duration
	engines  map[string]*heartbeatEngine // by heartbeatKey
}

type heartbeatEngine struct {
	ids      map[string]int // lease tokens (hex) → requests heart-beating them
	lastSent time.Time
}

// Track starts heartbeats for the lease token (hex) held by the producer incarnation key
// (heartbeatKey), from the request's arrival on. Several requests may carry the same token
// (copied params): the token is heart-beaten until each of them untracked it.
func (h *HeartbeatTracker) Track(key, token string) {
	if h.engines == nil {
		h.engines = make(map[string]*heartbeatEngine)
	}
	e := h.engines[key]
	if e == nil {
		e = &heartbeatEngine{ids: make(map[string]int)}
		h.engines[key] = e
	}
	e.ids[token]++
}

// Untrack stops one request's heartbeats for the lease token (its read finished, or the request
// ended); a producer incarnation with no lease left is forgotten.
func (h *HeartbeatTracker) Untrack(key, token string) {
	e := h.engines[key]
	if e == nil || e.ids[token] == 0 {
		return
	}
	if e.ids[token]--; e.ids[token] == 0 {
		delete(e.ids, token)
	}
	if len(e.ids) == 0 {
		delete(h.engines, key)
	}
}

// Len returns the number of tracked leases.
func (h *HeartbeatTracker) Len() int {
	n := 0
	for _, e := range h.engines {
		n += len(e.ids)
	}
	return n
}

// HeartbeatBatch is one heartbeat message due for one producer incarnation.
type HeartbeatBatch struct {
	Engine string   // the producer incarnation's key (heartbeatKey: engine id and instance)
	IDs    []string // the lease tokens (hex), sorted
}

// Due returns the batches due at now and marks them sent. A producer's first batch is due at
// once.
func (h *HeartbeatTracker) Due(now time.Time) []HeartbeatBatch {
	var out []HeartbeatBatch
	for name, e := range h.engines {
		if !e.lastSent.IsZero() && now.Sub(e.lastSent) < h.Interval {
			continue
		}
		e.lastSent = now
		ids := make([]string, 0, len(e.ids))
		for id := range e.ids {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		out = append(out, HeartbeatBatch{Engine: name, IDs: ids})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Engine < out[j].Engine })
	return out
}
