package connector

import (
	"sort"
	"time"
)

// Lease is a finished request whose blocks are held for a remote reader: a prefill waiting for
// its decoder, or (bidirectional) a decode turn waiting for the next turn's prefill.
type Lease struct {
	// RequestID is the local request id the remote names in notifications and heartbeats.
	RequestID string
	// Blocks are the held block ids.
	Blocks []int32
	// Deadline is when the blocks are released if no reader has finished.
	Deadline time.Time
	// Renewable leases are extended by heartbeats (P's leases); decoder TTLs are not.
	Renewable bool
	// notified counts read notifications received so far.
	notified int
	// held indexes Blocks (built by LeaseTable.Add).
	held map[int32]struct{}
}

// Holds reports whether block is one of the lease's blocks.
func (l *Lease) Holds(block int32) bool {
	if l.held != nil {
		_, ok := l.held[block]
		return ok
	}
	for _, b := range l.Blocks {
		if b == block {
			return true
		}
	}
	return false
}

// LeaseTable holds leases and decides when they end. It is a pure state machine: the caller
// passes the time and frees the blocks of every lease it returns. Not safe for concurrent use.
type LeaseTable struct {
	leases map[string]*Lease
}

// Add starts holding blocks for id until deadline. A second Add for the same id replaces the first
// and returns the replaced lease so its blocks can be freed.
func (t *LeaseTable) Add(id string, blocks []int32, deadline time.Time, renewable bool) (replaced *Lease) {
	if t.leases == nil {
		t.leases = make(map[string]*Lease)
	}
	old := t.leases[id]
	held := make(map[int32]struct{}, len(blocks))
	for _, b := range blocks {
		held[b] = struct{}{}
	}
	t.leases[id] = &Lease{RequestID: id, Blocks: blocks, Deadline: deadline, Renewable: renewable, held: held}
	return old
}

// Len returns the number of held leases.
func (t *LeaseTable) Len() int { return len(t.leases) }

// Get returns the lease of id, or nil.
func (t *LeaseTable) Get(id string) *Lease { return t.leases[id] }

// Notify records one read notification "<id>:<expected>" and returns the lease once all expected
// readers have reported; the lease then leaves the table. known is false for an id the table does
// not hold (expired, aborted, or never issued): vLLM logs "Potentially invalid KV blocks" for it.
func (t *LeaseTable) Notify(id string, expected int) (done *Lease, known bool) {
	l := t.leases[id]
	if l == nil {
		return nil, false
	}
	l.notified++
	if l.notified < max(expected, 1) {
		return nil, true
	}
	delete(t.leases, id)
	return l, true
}

// Heartbeat extends the renewable leases of ids to at least now+extension; it never shortens one
// and ignores unknown ids (spec §4.4). It returns how many leases it extended.
func (t *LeaseTable) Heartbeat(ids []string, now time.Time, extension time.Duration) int {
	n := 0
	for _, id := range ids {
		l := t.leases[id]
		if l == nil || !l.Renewable {
			continue
		}
		if d := now.Add(extension); d.After(l.Deadline) {
			l.Deadline = d
		}
		n++
	}
	return n
}

// Release removes the lease of id (its request was aborted or its reader gave up) and returns it.
func (t *LeaseTable) Release(id string) *Lease {
	l := t.leases[id]
	delete(t.leases, id)
	return l
}

// Expire removes and returns every lease whose deadline is not after now. It sweeps every entry,
// not only the earliest (vllm#58222): heartbeats and long decoder TTLs reorder deadlines.
// The result is ordered by deadline, then id.
func (t *LeaseTable) Expire(now time.Time) []*Lease {
	var out []*Lease
	for id, l := range t.leases {
		if !l.Deadline.After(now) {
			out = append(out, l)
			delete(t.leases, id)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].Deadline.Equal(out[j].Deadline) {
			return out[i].Deadline.Before(out[j].Deadline)
		}
		return out[i].RequestID < out[j].RequestID
	})
	return out
}

// NextDeadline returns the earliest deadline, and false when the table is empty.
func (t *LeaseTable) NextDeadline() (time.Time, bool) {
	var next time.Time
	for _, l := range t.leases {
		if next.IsZero() || l.Deadline.Before(next) {
			next = l.Deadline
		}
	}
	return next, !next.IsZero()
}
