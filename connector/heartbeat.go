package connector

import (
	"sort"
	"time"
)

// HeartbeatTracker is the decoder's list of remote leases whose blocks it has yet to read (by
// their tokens, in hex), grouped by remote engine; it says when a heartbeat batch is due (every
// lease/6, spec §4.4).
// A pure state machine: the caller passes the time and sends the batches. Not safe for
// concurrent use.
type HeartbeatTracker struct {
	// Interval is the time between two batches to one engine (kv_lease_duration // 6).
	Interval time.Duration
	engines  map[string]*heartbeatEngine
}

type heartbeatEngine struct {
	ids      map[string]struct{}
	lastSent time.Time
}

// Track starts heartbeats for remote request id on engine, from the request's arrival on.
func (h *HeartbeatTracker) Track(engine, id string) {
	if h.engines == nil {
		h.engines = make(map[string]*heartbeatEngine)
	}
	e := h.engines[engine]
	if e == nil {
		e = &heartbeatEngine{ids: make(map[string]struct{})}
		h.engines[engine] = e
	}
	e.ids[id] = struct{}{}
}

// Untrack stops heartbeats for id (its read finished, or the request ended); an engine with no
// request left is forgotten.
func (h *HeartbeatTracker) Untrack(engine, id string) {
	e := h.engines[engine]
	if e == nil {
		return
	}
	delete(e.ids, id)
	if len(e.ids) == 0 {
		delete(h.engines, engine)
	}
}

// Len returns the number of tracked requests.
func (h *HeartbeatTracker) Len() int {
	n := 0
	for _, e := range h.engines {
		n += len(e.ids)
	}
	return n
}

// HeartbeatBatch is one heartbeat message due for one remote engine.
type HeartbeatBatch struct {
	Engine string
	IDs    []string
}

// Due returns the batches due at now and marks them sent. An engine's first batch is due at once.
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
