package transfer

import (
	"bytes"
	"fmt"
	"os"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/vmihailenco/msgpack/v5"
)

// metadataVersion is the format version of the metadata blob. A blob of another version is
// refused with ErrNotSupported.
const metadataVersion = 1

// Limits on metadata accepted from peers.
const (
	maxMetadataBytes = 16 << 20
	maxNameLen       = 256
	maxAddrs         = 16
	maxArenas        = 4096
	maxRegions       = 1 << 20
)

// metaWire is the metadata blob: a msgpack array (compact, field order is the format).
// Regions are published, never blocks: peers compute block descriptors themselves.
type metaWire struct {
	_msgpack    struct{} `msgpack:",as_array"`
	Version     uint8
	Name        string
	Incarnation uint64
	BootID      string
	PID         int64
	UnixAddr    string   // SHM control socket ("@name" = abstract), "" if SHM is off
	TCPAddrs    []string // TCP listener addresses, empty if TCP is off
	TCPStreams  uint16   // data connections the agent suggests per peer
	Arenas      []metaArena
	Regions     []metaRegion
}

// metaArena describes one shareable arena.
type metaArena struct {
	_msgpack struct{} `msgpack:",as_array"`
	ID       uint32
	Size     uint64
}

// metaRegion describes one region peers may access.
type metaRegion struct {
	_msgpack struct{} `msgpack:",as_array"`
	ID       uint32
	Len      uint64
	Perm     uint8
	Arena    uint32 // 0: not in an arena (TCP only)
	ArenaOff uint64
}

// LocalMetadata returns the agent's metadata blob: format version, name, incarnation, host
// boot id, backend connection info, and the table of regions registered with a non-zero
// permission. Hand it to peers through any side channel; they pass it to LoadRemote.
func (a *Agent) LocalMetadata() []byte {
	m := metaWire{
		Version:     metadataVersion,
		Name:        a.name,
		Incarnation: a.inc,
		BootID:      a.bootID,
		PID:         int64(os.Getpid()),
		UnixAddr:    a.unixAddr,
		TCPStreams:  uint16(a.cfg.TCPStreams),
	}
	if a.tcpAddr != "" {
		m.TCPAddrs = []string{a.tcpAddr}
	}
	a.regMu.Lock()
	t := a.regions.Load()
	for _, r := range t.byID {
		if r == nil || r.perm == 0 {
			continue
		}
		m.Regions = append(m.Regions, metaRegion{ID: r.id, Len: uint64(len(r.mem)), Perm: uint8(r.perm), Arena: r.arenaID, ArenaOff: uint64(r.arenaOff)})
	}
	for _, ex := range a.arenaByID {
		if ex.readers+ex.writers > 0 {
			m.Arenas = append(m.Arenas, metaArena{ID: ex.id, Size: uint64(ex.a.Size())})
		}
	}
	a.regMu.Unlock()
	sort.Slice(m.Arenas, func(i, j int) bool { return m.Arenas[i].ID < m.Arenas[j].ID })
	b, err := msgpack.Marshal(&m)
	if err != nil {
		// Encoding plain structs of strings and integers cannot fail.
		panic(fmt.Sprintf("transfer: encoding metadata: %v", err))
	}
	return b
}

// remoteMeta is a validated metadata blob of a peer.
type remoteMeta struct {
	metaWire
	arenaSize map[uint32]uint64
}

// region returns the remote region with id (binary search; Regions are sorted), or nil.
func (m *remoteMeta) region(id uint32) *metaRegion {
	i := sort.Search(len(m.Regions), func(i int) bool { return m.Regions[i].ID >= id })
	if i < len(m.Regions) && m.Regions[i].ID == id {
		return &m.Regions[i]
	}
	return nil
}

// decodeMetadata parses and validates a peer's metadata blob. Any defect is ErrProtocol
// (or ErrNotSupported for another format version); it never panics on any input.
func decodeMetadata(b []byte) (*remoteMeta, error) {
	bad := func(format string, args ...any) (*remoteMeta, error) {
		return nil, newErr("load", "", ErrProtocol, "metadata: "+fmt.Sprintf(format, args...), nil)
	}
	if len(b) == 0 {
		return bad("empty")
	}
	if len(b) > maxMetadataBytes {
		return bad("%d bytes exceed the limit of %d", len(b), maxMetadataBytes)
	}
	n, err := checkMsgpack(b, 4)
	if err != nil {
		return nil, newErr("load", "", ErrProtocol, "metadata", err)
	}
	if n != len(b) {
		return bad("%d trailing bytes", len(b)-n)
	}
	// The version is the first array element; read it before the rest so a future format
	// is reported as such rather than as garbage.
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	alen, err := dec.DecodeArrayLen()
	if err != nil || alen < 1 {
		return bad("not an array")
	}
	v, err := dec.DecodeUint64()
	if err != nil {
		return bad("version: %v", err)
	}
	if v != metadataVersion {
		return nil, newErr("load", "", ErrNotSupported, fmt.Sprintf("metadata format version %d (this build reads %d)", v, metadataVersion), nil)
	}
	m := &remoteMeta{}
	if err := msgpack.Unmarshal(b, &m.metaWire); err != nil {
		return bad("%v", err)
	}
	if m.Name == "" || len(m.Name) > maxNameLen || !utf8.ValidString(m.Name) || strings.ContainsAny(m.Name, "\x00\n") {
		return bad("invalid agent name %q", m.Name)
	}
	if m.Incarnation == 0 {
		return bad("zero incarnation")
	}
	if len(m.BootID) > 64 {
		return bad("boot id too long")
	}
	if len(m.UnixAddr) > 108 {
		return bad("unix address too long")
	}
	if len(m.TCPAddrs) > maxAddrs {
		return bad("%d TCP addresses", len(m.TCPAddrs))
	}
	for _, s := range m.TCPAddrs {
		if s == "" || len(s) > 256 {
			return bad("invalid TCP address %q", s)
		}
	}
	if len(m.Arenas) > maxArenas || len(m.Regions) > maxRegions {
		return bad("%d arenas, %d regions", len(m.Arenas), len(m.Regions))
	}
	m.arenaSize = make(map[uint32]uint64, len(m.Arenas))
	for _, ar := range m.Arenas {
		if ar.ID == 0 || ar.Size == 0 || ar.Size > 1<<46 {
			return bad("invalid arena %d of %d bytes", ar.ID, ar.Size)
		}
		if _, dup := m.arenaSize[ar.ID]; dup {
			return bad("arena %d listed twice", ar.ID)
		}
		m.arenaSize[ar.ID] = ar.Size
	}
	for i, r := range m.Regions {
		if r.ID == 0 || r.Len == 0 || r.Len > 1<<46 {
			return bad("invalid region %d of %d bytes", r.ID, r.Len)
		}
		if i > 0 && m.Regions[i-1].ID >= r.ID {
			return bad("regions not sorted by unique id at %d", r.ID)
		}
		if r.Perm == 0 || Perm(r.Perm)&^PermReadWrite != 0 {
			return bad("region %d has invalid permission %#x", r.ID, r.Perm)
		}
		if r.Arena != 0 {
			sz, ok := m.arenaSize[r.Arena]
			if !ok {
				return bad("region %d refers to unknown arena %d", r.ID, r.Arena)
			}
			if r.ArenaOff > sz || r.Len > sz-r.ArenaOff {
				return bad("region %d [%d,+%d) outside arena %d of %d bytes", r.ID, r.ArenaOff, r.Len, r.Arena, sz)
			}
		} else if r.ArenaOff != 0 {
			return bad("region %d has an arena offset but no arena", r.ID)
		}
	}
	return m, nil
}
