package kvlease

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"sort"
	"time"
)

// Token is a lease's capability: 128 random bits the owner of the blocks issues with the
// kv_transfer_params that name them. Every READ of the blocks (as the transfer request's tag),
// every completion notification and every heartbeat must present it; the owner checks it, and
// publishes a tag derived from it (Tag) for readers that map its memory. A completion
// notification must also prove the lease's prompt (Proof): the token alone, copied into
// a request for another prompt, cannot end the lease.
type Token [16]byte

// String returns the token in hex, as kv_transfer_params carry it.
func (t Token) String() string { return hex.EncodeToString(t[:]) }

// ParseToken parses the 32 hex digits of a token.
func ParseToken(s string) (Token, error) {
	var t Token
	if len(s) != 2*len(t) {
		return t, fmt.Errorf("a lease token has %d hex digits, got %d characters", 2*len(t), len(s))
	}
	if _, err := hex.Decode(t[:], []byte(s)); err != nil {
		return t, fmt.Errorf("a lease token is hex: %v", err)
	}
	return t, nil
}

// Tag is what the owner of a lease publishes in the lease's slot while it lasts: the first
// 16 bytes of SHA-256 over the token, the number of tokens the blocks hold, and the block ids and
// generations. A reader that holds the params computes the same tag: a match proves that the
// params are exactly those of a lease alive when the slot was read — which holds its blocks
// unchanged since before the reader read them.
func Tag(token Token, numTokens int, blocks []int32, gens []uint64) [16]byte {
	h := sha256.New()
	h.Write([]byte("kvbridge lease v1"))
	h.Write(token[:])
	var b [8]byte
	binary.LittleEndian.PutUint32(b[:4], uint32(numTokens))
	binary.LittleEndian.PutUint32(b[4:], uint32(len(blocks)))
	h.Write(b[:])
	for _, id := range blocks {
		binary.LittleEndian.PutUint32(b[:4], uint32(id))
		h.Write(b[:4])
	}
	for _, g := range gens {
		binary.LittleEndian.PutUint64(b[:], g)
		h.Write(b[:])
	}
	var tag [16]byte
	copy(tag[:], h.Sum(nil))
	return tag
}

// Lease is a finished request whose blocks are held for a remote reader: a prefill waiting for
// its decoder, or (bidirectional) a decode turn waiting for the next turn's prefill.
type Lease struct {
	// RequestID is the local request id the remote names in notifications.
	RequestID string
	// Token is the lease's capability; Slot the index of the slot its tag is published in.
	Token Token
	Slot  int
	// Blocks are the held block ids.
	Blocks []int32
	// Deadline is when the blocks are released if no reader has finished.
	Deadline time.Time
	// Renewable leases are extended by heartbeats (P's leases); decoder TTLs are not, and they
	// are a cache: under pool pressure the oldest are evicted first (EvictOldestHold).
	Renewable bool
	// Created is when the lease began.
	Created time.Time
	// Proofs are the release proofs (Proof) the lease accepts, by the number of leading
	// tokens of its prompt they prove: a notification ends the lease only from a reader that
	// holds the prompt it was issued for. Nil accepts none: the lease then ends only by expiry,
	// eviction or release.
	Proofs map[int][ProofBytes]byte
	// notified counts read notifications received so far.
	notified int
	// held indexes Blocks (built by Table.Add).
	held map[int32]struct{}
}

// Notified returns how many read notifications the lease received.
func (l *Lease) Notified() int { return l.notified }

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

// NotifyResult says what a read notification did.
type NotifyResult uint8

const (
	// NotifyCounted: the notification was one of the lease's expected readers.
	NotifyCounted NotifyResult = iota
	// NotifyUnknown: no lease has that request id (expired, aborted, or never issued).
	NotifyUnknown
	// NotifyRefused: a lease has that id but the notification presented another token.
	NotifyRefused
	// NotifyUnproven: the notification presented the lease's token but no proof that its
	// sender holds the lease's prompt (another prompt, or copied params).
	NotifyUnproven
)

// Table holds leases and decides when they end. It is a pure state machine: the caller
// passes the time, publishes and clears the slots, and frees the blocks of every lease it
// returns. Slots are handed out lowest first and reused once their lease has left the table.
// Not safe for concurrent use.
type Table struct {
	leases  map[string]*Lease
	byToken map[Token]*Lease
	free    []int // released slots
	next    int   // slots below next have been handed out
}

// Add starts holding blocks for id until deadline under token, and returns the new lease with
// its slot. A second Add for the same id replaces the first and returns the replaced lease so
// its blocks can be freed (its slot is reused).
func (t *Table) Add(id string, token Token, blocks []int32, now, deadline time.Time, renewable bool) (l, replaced *Lease) {
	if t.leases == nil {
		t.leases = make(map[string]*Lease)
		t.byToken = make(map[Token]*Lease)
	}
	if old := t.leases[id]; old != nil {
		t.remove(old)
		replaced = old
	}
	held := make(map[int32]struct{}, len(blocks))
	for _, b := range blocks {
		held[b] = struct{}{}
	}
	slot := t.next
	if n := len(t.free); n > 0 {
		slot, t.free = t.free[n-1], t.free[:n-1]
	} else {
		t.next++
	}
	l = &Lease{RequestID: id, Token: token, Slot: slot, Blocks: blocks, Deadline: deadline, Renewable: renewable, Created: now, held: held}
	t.leases[id] = l
	t.byToken[token] = l
	return l, replaced
}

// remove takes l out of the table and frees its slot.
func (t *Table) remove(l *Lease) {
	delete(t.leases, l.RequestID)
	delete(t.byToken, l.Token)
	t.free = append(t.free, l.Slot)
}

// Len returns the number of held leases.
func (t *Table) Len() int { return len(t.leases) }

// Get returns the lease of id, or nil.
func (t *Table) Get(id string) *Lease { return t.leases[id] }

// Leases returns the held leases, ordered by request id.
func (t *Table) Leases() []*Lease {
	out := make([]*Lease, 0, len(t.leases))
	for _, l := range t.leases {
		out = append(out, l)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].RequestID < out[j].RequestID })
	return out
}

// ByToken returns the lease whose token is token, or nil.
func (t *Table) ByToken(token Token) *Lease { return t.byToken[token] }

// Notify records one release notification (see ParseRelease; r.Readers is the number of
// readers expected) and returns the lease once all of them have reported; the lease then leaves
// the table. A notification whose token is not the lease's is refused, one whose proof is not
// one of the lease's Proofs is unproven; neither changes anything.
func (t *Table) Notify(r Release) (*Lease, NotifyResult) {
	l := t.leases[r.ID]
	switch {
	case l == nil:
		return nil, NotifyUnknown
	case l.Token != r.Token:
		return nil, NotifyRefused
	}
	want, ok := l.Proofs[r.Proven]
	if !ok || !hmac.Equal(want[:], r.Proof[:]) {
		return nil, NotifyUnproven
	}
	l.notified++
	if l.notified < max(r.Readers, 1) {
		return nil, NotifyCounted
	}
	t.remove(l)
	return l, NotifyCounted
}

// Heartbeat extends the renewable leases of tokens to at least now+extension; it never shortens
// one and ignores unknown tokens (docs/architecture.md, wire contract item 26). It returns how
// many leases it extended.
func (t *Table) Heartbeat(tokens []Token, now time.Time, extension time.Duration) int {
	n := 0
	for _, tok := range tokens {
		l := t.byToken[tok]
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
func (t *Table) Release(id string) *Lease {
	l := t.leases[id]
	if l != nil {
		t.remove(l)
	}
	return l
}

// Expire removes and returns every lease whose deadline is not after now. It sweeps every entry,
// not only the earliest (vllm#58222): heartbeats and long decoder TTLs reorder deadlines.
// The result is ordered by deadline, then id.
func (t *Table) Expire(now time.Time) []*Lease {
	var out []*Lease
	for _, l := range t.leases {
		if !l.Deadline.After(now) {
			out = append(out, l)
		}
	}
	for _, l := range out {
		t.remove(l)
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].Deadline.Equal(out[j].Deadline) {
			return out[i].Deadline.Before(out[j].Deadline)
		}
		return out[i].RequestID < out[j].RequestID
	})
	return out
}

// EvictOldestHold removes and returns the oldest non-renewable lease (a decoder's hold for a
// next turn, which is a cache), or nil when there is none. Ties go to the smaller id.
func (t *Table) EvictOldestHold() *Lease {
	var oldest *Lease
	for _, l := range t.leases {
		if l.Renewable {
			continue
		}
		if oldest == nil || l.Created.Before(oldest.Created) || (l.Created.Equal(oldest.Created) && l.RequestID < oldest.RequestID) {
			oldest = l
		}
	}
	if oldest != nil {
		t.remove(oldest)
	}
	return oldest
}

// NextDeadline returns the earliest deadline, and false when the table is empty.
func (t *Table) NextDeadline() (time.Time, bool) {
	var next time.Time
	for _, l := range t.leases {
		if next.IsZero() || l.Deadline.Before(next) {
			next = l.Deadline
		}
	}
	return next, !next.IsZero()
}
