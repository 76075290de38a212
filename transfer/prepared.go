package transfer

import (
	"context"
	"fmt"
	"sync/atomic"
)

// PrepareOptions tunes PrepareRemote.
type PrepareOptions struct {
	// Backends restricts and orders the backends for this list (NIXL `backends` names). Nil
	// uses the agent's configuration. A backend not listed is never used.
	Backends []string
}

// PreparedList is a validated descriptor list, resolved once so that requests can be made
// from index lists cheaply. It is immutable and safe for concurrent use. A local list pins
// its regions (Deregister is refused) until Release; a remote list is bound to one peer
// incarnation and one backend.
type PreparedList struct {
	a           *Agent
	peer        *peer // nil for a local list
	backend     Backend
	fallback    string
	descs       []Desc
	bufs        [][]byte  // local memory, or the peer's mapped memory for SHM; nil for TCP and UCX
	raddrs      []uint64  // UCX: each descriptor's address in the peer's address space
	rarenas     []uint32  // UCX: each descriptor's peer arena
	regions     []*Region // local: distinct regions pinned
	allPerm     Perm      // remote: permissions every descriptor's region grants
	shmWritable bool      // remote SHM: every mapping used is writable
	refs        atomic.Int64
	released    atomic.Bool
}

// PrepareLocal validates descs against this agent's registered regions and returns a local
// list. Permissions do not apply to the local side.
func (a *Agent) PrepareLocal(descs []Desc) (*PreparedList, error) {
	if a.closed.Load() {
		return nil, newErr("prepare", "", ErrClosed, "agent closed", nil)
	}
	l := &PreparedList{a: a, descs: append([]Desc(nil), descs...), bufs: make([][]byte, len(descs))}
	t := a.regions.Load()
	seen := map[*Region]bool{}
	fail := func(err error) (*PreparedList, error) {
		for _, r := range l.regions {
			r.lists.Add(-1)
		}
		return nil, err
	}
	for i, d := range descs {
		r := t.get(d.Region)
		if r == nil {
			return fail(descErr("prepare", "", i, ErrNotFound, "region %d is not registered", d.Region))
		}
		if d.Offset < 0 || d.Length <= 0 || d.Offset > r.Len() || d.Length > r.Len()-d.Offset {
			return fail(descErr("prepare", "", i, ErrInvalidDescriptor, "[%d,+%d) outside region %d of %d bytes", d.Offset, d.Length, d.Region, r.Len()))
		}
		if !seen[r] {
			seen[r] = true
			r.lists.Add(1)
			l.regions = append(l.regions, r)
			if r.dead.Load() {
				return fail(descErr("prepare", "", i, ErrNotFound, "region %d is being deregistered", d.Region))
			}
		}
		// The capacity runs to the end of the region so that merged runs can extend the slice.
		l.bufs[i] = r.mem[d.Offset : d.Offset+d.Length]
	}
	l.refs.Store(1)
	return l, nil
}

// PrepareRemote validates descs against the loaded metadata of peer, chooses the backend
// (SHM when the peer is on this host and its arenas could be mapped, else TCP, unless
// restricted by opts or the agent config; UCX only when listed) and establishes the
// connections it needs. The
// choice is final for the list and reported by Backend (and FallbackReason).
func (a *Agent) PrepareRemote(ctx context.Context, peerName string, descs []Desc, opts *PrepareOptions) (*PreparedList, error) {
	if a.closed.Load() {
		return nil, newErr("prepare", peerName, ErrClosed, "agent closed", nil)
	}
	p := a.lookupPeer(peerName)
	if p == nil {
		return nil, newErr("prepare", peerName, ErrNotFound, "no metadata loaded for this peer", nil)
	}
	prefs, explicit := a.backends, a.explicit
	if opts != nil && opts.Backends != nil {
		bs, err := ParseBackends(opts.Backends)
		if err != nil {
			return nil, err
		}
		if len(bs) == 0 {
			return nil, newErr("prepare", peerName, ErrInvalidParam, "empty backend list", nil)
		}
		prefs, explicit = bs, true
	}
	m := p.meta.Load()
	allPerm := PermReadWrite
	for i, d := range descs {
		r := m.region(d.Region)
		if r == nil {
			return nil, descErr("prepare", peerName, i, ErrNotFound, "peer has no region %d", d.Region)
		}
		if d.Offset < 0 || d.Length <= 0 || uint64(d.Offset) > r.Len || uint64(d.Length) > r.Len-uint64(d.Offset) {
			return nil, descErr("prepare", peerName, i, ErrInvalidDescriptor, "[%d,+%d) outside peer region %d of %d bytes", d.Offset, d.Length, d.Region, r.Len)
		}
		allPerm &= Perm(r.Perm)
	}
	b, fallback, err := p.choose(ctx, prefs, explicit, descs)
	if err != nil {
		return nil, err
	}
	l := &PreparedList{a: a, peer: p, backend: b, fallback: fallback, descs: append([]Desc(nil), descs...), allPerm: allPerm}
	switch b {
	case BackendSHM:
		if err := l.resolveSHM(ctx, m); err != nil {
			return nil, err
		}
	case BackendUCX:
		if err := l.resolveUCX(m); err != nil {
			return nil, err
		}
	}
	if err := p.whileLive("prepare", func() error {
		p.lists++
		return nil
	}); err != nil {
		return nil, err
	}
	l.refs.Store(1)
	return l, nil
}

// resolveSHM points every descriptor at the peer's mapped arena, mapping arenas that
// appeared since the connection was made.
func (l *PreparedList) resolveSHM(ctx context.Context, m *remoteMeta) error {
	p := l.peer
	ids := make([]uint32, 0, len(l.descs))
	for _, d := range l.descs {
		ids = append(ids, m.region(d.Region).Arena)
	}
	if missing := p.notMapped(ids); len(missing) > 0 {
		if err := p.fetchArenas(ctx, dedup(missing)); err != nil {
			return err
		}
	}
	l.bufs = make([][]byte, len(l.descs))
	l.shmWritable = true
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, d := range l.descs {
		r := m.region(d.Region)
		mp := p.maps[r.Arena]
		if mp == nil {
			return descErr("prepare", p.name, i, ErrNotFound, "arena %d of region %d was not passed by the peer", r.Arena, d.Region)
		}
		start := r.ArenaOff + uint64(d.Offset)
		end := start + uint64(d.Length)
		if end > uint64(len(mp.mem)) {
			return descErr("prepare", p.name, i, ErrInvalidDescriptor, "beyond the mapped arena %d", r.Arena)
		}
		l.bufs[i] = mp.mem[start:end] // capacity to the end of the arena, for merged runs
		l.shmWritable = l.shmWritable && mp.writable
	}
	return nil
}

// dedup returns ids without repeats.
func dedup(ids []uint32) []uint32 {
	seen := map[uint32]bool{}
	out := ids[:0]
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out
}

// Len returns the number of descriptors.
func (l *PreparedList) Len() int { return len(l.descs) }

// Desc returns descriptor i.
func (l *PreparedList) Desc(i int) Desc { return l.descs[i] }

// Backend returns the backend chosen for a remote list (0 for a local list).
func (l *PreparedList) Backend() Backend { return l.backend }

// FallbackReason explains why the first preferred backend was not used ("" if it was).
func (l *PreparedList) FallbackReason() string { return l.fallback }

// Peer returns the peer name of a remote list ("" for a local list).
func (l *PreparedList) Peer() string {
	if l.peer == nil {
		return ""
	}
	return l.peer.name
}

// Release gives the list up. Requests made from it can no longer be posted; one in flight
// keeps the list's resources until it completes. Release is idempotent.
func (l *PreparedList) Release() {
	if l.released.CompareAndSwap(false, true) {
		l.release()
	}
}

// acquire takes a reference for an active request; it fails once the list is released.
func (l *PreparedList) acquire() bool {
	for {
		n := l.refs.Load()
		if n <= 0 || l.released.Load() {
			return false
		}
		if l.refs.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// release drops a reference; the last one unpins the regions or the peer.
func (l *PreparedList) release() {
	if l.refs.Add(-1) != 0 {
		return
	}
	for _, r := range l.regions {
		r.lists.Add(-1)
	}
	if l.peer != nil {
		l.peer.dropList()
	}
}

// String describes the list.
func (l *PreparedList) String() string {
	if l.peer == nil {
		return fmt.Sprintf("local list of %d descriptors", len(l.descs))
	}
	return fmt.Sprintf("list of %d descriptors at %s via %s", len(l.descs), l.peer.name, l.backend)
}
