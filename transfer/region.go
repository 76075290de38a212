package transfer

import (
	"fmt"
	"sync/atomic"
)

// Region is a registered range of memory. Descriptors name bytes in a region by (ID, offset,
// length); peers only ever see the id, the length and the permission.
type Region struct {
	id       uint32
	perm     Perm
	mem      []byte
	arena    *Arena // nil for heap memory registered with RegisterBytes
	arenaID  uint32 // the agent-local id of arena (0 if none)
	arenaOff int64

	lists atomic.Int64 // prepared lists that reference the region
	dead  atomic.Bool  // deregistered (or being deregistered)
}

// ID returns the region id used in descriptors.
func (r *Region) ID() uint32 { return r.id }

// Perm returns the permission granted to peers.
func (r *Region) Perm() Perm { return r.perm }

// Len returns the region length in bytes.
func (r *Region) Len() int64 { return int64(len(r.mem)) }

// Bytes returns the registered memory.
func (r *Region) Bytes() []byte { return r.mem }

// Desc returns the descriptor of length bytes at off in r (not validated until prepared).
func (r *Region) Desc(off, length int64) Desc { return Desc{Region: r.id, Offset: off, Length: length} }

// regionTable is an immutable id → region index, replaced on every (de)registration so the
// data path can read it without locks.
type regionTable struct {
	byID []*Region // index is the id; nil for ids never used or deregistered
}

// get returns the live region with id, or nil.
func (t *regionTable) get(id uint32) *Region {
	if t == nil || uint64(id) >= uint64(len(t.byID)) {
		return nil
	}
	return t.byID[id]
}

// arenaExport tracks an arena that has regions registered with this agent.
type arenaExport struct {
	a       *Arena
	id      uint32
	regions int         // regions registered in it
	readers int         // regions granting PermRead
	writers int         // regions granting PermWrite
	ucx     *ucxMapping // the arena's UCX registration (agents with the UCX backend)
}

// Register registers length bytes at off in arena with the permission perm granted to peers.
// The region is published in the agent's metadata (if perm is not zero) and can be shared
// over SHM as well as TCP.
func (a *Agent) Register(ar *Arena, off, length int64, perm Perm) (*Region, error) {
	if ar == nil {
		return nil, newErr("register", "", ErrInvalidParam, "nil arena", nil)
	}
	if err := ar.pin(); err != nil {
		return nil, err
	}
	if off < 0 || length <= 0 || off > ar.Size() || length > ar.Size()-off {
		ar.unpin()
		return nil, newErr("register", "", ErrInvalidDescriptor,
			fmt.Sprintf("range [%d,+%d) outside arena %q of %d bytes", off, length, ar.Name(), ar.Size()), nil)
	}
	r, err := a.register(ar.Bytes()[off:off+length], ar, off, perm)
	if err != nil {
		ar.unpin()
	}
	return r, err
}

// RegisterBytes registers caller-owned memory (for example a heap slice) that is not in an
// arena. It can be the local side of any request, and peers can reach it over TCP, but not
// over SHM. The caller must keep b alive and unchanged in size until Deregister.
func (a *Agent) RegisterBytes(b []byte, perm Perm) (*Region, error) {
	if len(b) == 0 {
		return nil, newErr("register", "", ErrInvalidParam, "empty memory", nil)
	}
	return a.register(b, nil, 0, perm)
}

// register adds a region to the table.
func (a *Agent) register(mem []byte, ar *Arena, off int64, perm Perm) (*Region, error) {
	if perm&^PermReadWrite != 0 {
		return nil, newErr("register", "", ErrInvalidParam, fmt.Sprintf("unknown permission bits %#x", uint8(perm)), nil)
	}
	a.regMu.Lock()
	defer a.regMu.Unlock()
	if a.closed.Load() {
		return nil, newErr("register", "", ErrClosed, "agent closed", nil)
	}
	a.nextRegion++
	r := &Region{id: a.nextRegion, perm: perm, mem: mem, arena: ar, arenaOff: off}
	if ar != nil {
		ex := a.arenas[ar]
		if ex == nil {
			var um *ucxMapping
			if a.ucx != nil {
				// Registering the whole arena once lets UCX peers reach any region in it.
				var err error
				if um, err = a.ucx.mapArena(ar); err != nil {
					a.nextRegion--
					return nil, err
				}
			}
			a.nextArena++
			ex = &arenaExport{a: ar, id: a.nextArena, ucx: um}
			a.arenas[ar] = ex
			a.arenaByID[ex.id] = ex
		}
		ex.regions++
		if perm&PermRead != 0 {
			ex.readers++
		}
		if perm&PermWrite != 0 {
			ex.writers++
		}
		r.arenaID = ex.id
	}
	old := a.regions.Load()
	t := &regionTable{byID: make([]*Region, r.id+1)}
	copy(t.byID, old.byID)
	t.byID[r.id] = r
	a.regions.Store(t)
	a.stats.registeredBytes.Add(int64(len(mem)))
	return r, nil
}

// Deregister removes a region. It is refused with ErrInUse while a prepared list (or a
// request made from one) references the region. Peers lose access at once over TCP; over SHM
// a peer that already mapped the arena keeps its mapping (see the package documentation).
func (a *Agent) Deregister(r *Region) error {
	if r == nil {
		return newErr("deregister", "", ErrInvalidParam, "nil region", nil)
	}
	a.regMu.Lock()
	defer a.regMu.Unlock()
	cur := a.regions.Load()
	if cur.get(r.id) != r {
		return newErr("deregister", "", ErrNotFound, fmt.Sprintf("region %d is not registered", r.id), nil)
	}
	// Mark dead first, then look for users; prepareLocal increments first, then checks dead,
	// so at least one of the two sees the other.
	r.dead.Store(true)
	if n := r.lists.Load(); n > 0 {
		r.dead.Store(false)
		return &Error{Op: "deregister", Desc: -1, Kind: ErrInUse,
			Detail: fmt.Sprintf("region %d is used by %d prepared lists", r.id, n)}
	}
	t := &regionTable{byID: make([]*Region, len(cur.byID))}
	copy(t.byID, cur.byID)
	t.byID[r.id] = nil
	a.regions.Store(t)
	if r.arena != nil {
		ex := a.arenas[r.arena]
		ex.regions--
		if r.perm&PermRead != 0 {
			ex.readers--
		}
		if r.perm&PermWrite != 0 {
			ex.writers--
		}
		if ex.regions == 0 {
			delete(a.arenas, r.arena)
			delete(a.arenaByID, ex.id)
			if ex.ucx != nil {
				a.ucx.unmapArena(ex.ucx)
			}
		}
		r.arena.unpin()
	}
	a.stats.registeredBytes.Add(-int64(len(r.mem)))
	return nil
}

// lookupRange resolves (region, off, length) against the current table for a peer request
// and checks the permission. On refusal it returns a detail and the sentinel kind.
func (t *regionTable) lookupRange(id uint32, off, length uint64, op Op) ([]byte, string, error) {
	r := t.get(id)
	if r == nil || r.perm == 0 {
		return nil, fmt.Sprintf("region %d is not registered for peers", id), ErrNotFound
	}
	if !r.perm.allows(op) {
		return nil, fmt.Sprintf("region %d grants %q, %v needs %q", id, r.perm.String(), op, needPerm(op)), ErrPermission
	}
	n := uint64(len(r.mem))
	if off > n || length > n-off || length == 0 {
		return nil, fmt.Sprintf("range [%d,+%d) outside region %d of %d bytes", off, length, id, n), ErrInvalidDescriptor
	}
	return r.mem[off : off+length], "", nil
}

// needPerm returns the permission string op needs.
func needPerm(op Op) string {
	if op == Read {
		return "r"
	}
	return "w"
}
