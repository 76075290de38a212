package transfer

import (
	"bytes"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/vmihailenco/msgpack/v5"
)

// Format versions of the metadata blob. An agent that offers UCX publishes version 3 (version
// 1 plus UCX worker addresses and arena keys); any other agent publishes version 1, which
// every kvbridge reads. A blob of another version is refused with ErrNotSupported.
//
// The UCX version names the UCX wire protocol as well as the blob's layout: version 2 had the
// same layout, but its agents do not answer the HELLO that opens every UCX link, so a peer of
// the two could load each other and then fail every connect by timeout. Version 2 is refused
// at LoadRemote, with an error that says so.
const (
	metadataVersion       = 1
	metadataVersionUCX    = 3
	metadataVersionUCXOld = 2 // UCX without the HELLO/HELLO_ACK wire-up; refused
)

// Limits on metadata accepted from peers.
const (
	maxMetadataBytes = 16 << 20
	maxNameLen       = 256
	maxAddrs         = 16
	maxArenas        = 4096
	maxRegions       = 1 << 20
	maxUCXWorkers    = 64
	maxUCXBlob       = 64 << 10 // one UCX worker address or packed remote key
)

// metaWire is the metadata blob: a msgpack array (compact, field order is the format).
// Format 1 is metaCore alone; format 3 (metadataVersionUCX) appends the UCX fields.
type metaWire struct {
	//lint:ignore U1000 msgpack reads its tag (as_array)
	_msgpack struct{} `msgpack:",as_array"`
	metaCore
	UCXWorkers [][]byte       // packed UCX worker addresses, one per worker
	UCXArenas  []metaUCXArena // UCX keys of the shared arenas
	ProcStart  uint64         // process start time (clock ticks after boot), with BootID and PID naming the process
}

// metaCore is format 1 of the metadata blob. Regions are published, never blocks: peers
// compute block descriptors themselves.
type metaCore struct {
	//lint:ignore U1000 msgpack reads its tag (as_array)
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
	//lint:ignore U1000 msgpack reads its tag (as_array)
	_msgpack struct{} `msgpack:",as_array"`
	ID       uint32
	Size     uint64
}

// metaUCXArena is what a UCX peer needs to reach an arena: its address in the owner's address
// space and the packed remote key of its registration (ucp_mem_map).
type metaUCXArena struct {
	//lint:ignore U1000 msgpack reads its tag (as_array)
	_msgpack struct{} `msgpack:",as_array"`
	ID       uint32
	Base     uint64
	Rkey     []byte
}

// metaRegion describes one region peers may access.
type metaRegion struct {
	//lint:ignore U1000 msgpack reads its tag (as_array)
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
	m := metaWire{metaCore: metaCore{
		Version:     metadataVersion,
		Name:        a.name,
		Incarnation: a.inc,
		BootID:      a.bootID,
		PID:         int64(os.Getpid()),
		UnixAddr:    a.unixAddr,
		TCPStreams:  uint16(a.cfg.TCPStreams),
	}}
	if a.tcpAddr != "" {
		m.TCPAddrs = []string{a.tcpAddr}
	}
	if a.ucx != nil {
		m.Version = metadataVersionUCX
		m.UCXWorkers = a.ucx.workerAddrs()
		m.ProcStart, _ = procStart(os.Getpid())
	}
	a.publishRegions(&m)
	sort.Slice(m.Arenas, func(i, j int) bool { return m.Arenas[i].ID < m.Arenas[j].ID })
	sort.Slice(m.UCXArenas, func(i, j int) bool { return m.UCXArenas[i].ID < m.UCXArenas[j].ID })
	b, err := m.encode()
	if err != nil {
		// Encoding plain structs of strings, integers and bytes cannot fail.
		panic(fmt.Sprintf("transfer: encoding metadata: %v", err))
	}
	return b
}

// publishRegions adds the regions peers may access and their shared arenas to m.
func (a *Agent) publishRegions(m *metaWire) {
	a.regMu.Lock()
	defer a.regMu.Unlock()
	for _, r := range a.regions.Load().byID {
		if r == nil || r.perm == 0 {
			continue
		}
		m.Regions = append(m.Regions, metaRegion{ID: r.id, Len: uint64(len(r.mem)), Perm: uint8(r.perm), Arena: r.arenaID, ArenaOff: uint64(r.arenaOff)})
	}
	for _, ex := range a.arenaByID {
		if ex.readers+ex.writers > 0 {
			m.Arenas = append(m.Arenas, metaArena{ID: ex.id, Size: uint64(ex.a.Size())})
			if ex.ucx != nil {
				m.UCXArenas = append(m.UCXArenas, metaUCXArena{ID: ex.id, Base: ex.ucx.base, Rkey: ex.ucx.rkey})
			}
		}
	}
}

// encode returns the blob in m's format version: format 1 carries metaCore alone.
func (m *metaWire) encode() ([]byte, error) {
	if m.Version == metadataVersion {
		return msgpack.Marshal(&m.metaCore)
	}
	return msgpack.Marshal(m)
}

// remoteMeta is a validated metadata blob of a peer.
type remoteMeta struct {
	metaWire
	arenaSize map[uint32]uint64
	ucxArena  map[uint32]*metaUCXArena
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
	m, err := parseMetadata(b)
	if err != nil {
		return nil, err
	}
	for _, check := range [...]func() error{m.checkIdentity, m.checkArenas, m.checkRegions, m.checkUCX} {
		if err := check(); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// badMetadata is the error for a defective metadata blob.
func badMetadata(format string, args ...any) error {
	return newErr("load", "", ErrProtocol, "metadata: "+fmt.Sprintf(format, args...), nil)
}

// parseMetadata decodes a metadata blob of a format this build reads.
func parseMetadata(b []byte) (*remoteMeta, error) {
	if len(b) == 0 {
		return nil, badMetadata("empty")
	}
	if len(b) > maxMetadataBytes {
		return nil, badMetadata("%d bytes exceed the limit of %d", len(b), maxMetadataBytes)
	}
	n, err := checkMsgpack(b, 4)
	if err != nil {
		return nil, newErr("load", "", ErrProtocol, "metadata", err)
	}
	if n != len(b) {
		return nil, badMetadata("%d trailing bytes", len(b)-n)
	}
	// The version is the first array element; read it before the rest so a future format
	// is reported as such rather than as garbage.
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	alen, err := dec.DecodeArrayLen()
	if err != nil || alen < 1 {
		return nil, badMetadata("not an array")
	}
	v, err := dec.DecodeUint64()
	if err != nil {
		return nil, badMetadata("version: %v", err)
	}
	m := &remoteMeta{}
	switch v {
	case metadataVersion:
		err = msgpack.Unmarshal(b, &m.metaCore)
	case metadataVersionUCX:
		err = msgpack.Unmarshal(b, &m.metaWire)
	case metadataVersionUCXOld:
		return nil, newErr("load", "", ErrNotSupported, fmt.Sprintf("metadata format version %d: the peer is an older kvbridge whose UCX wire-up (without HELLO) this build does not speak; upgrade it (this build reads %d and %d)", v, metadataVersion, metadataVersionUCX), nil)
	default:
		return nil, newErr("load", "", ErrNotSupported, fmt.Sprintf("metadata format version %d (this build reads %d and %d)", v, metadataVersion, metadataVersionUCX), nil)
	}
	if err != nil {
		return nil, badMetadata("%v", err)
	}
	return m, nil
}

// checkIdentity checks the agent's name, incarnation and addresses.
func (m *remoteMeta) checkIdentity() error {
	if m.Name == "" || len(m.Name) > maxNameLen || !utf8.ValidString(m.Name) || strings.ContainsAny(m.Name, "\x00\n") {
		return badMetadata("invalid agent name %q", m.Name)
	}
	if m.Incarnation == 0 {
		return badMetadata("zero incarnation")
	}
	if len(m.BootID) > 64 {
		return badMetadata("boot id too long")
	}
	if len(m.UnixAddr) > 108 {
		return badMetadata("unix address too long")
	}
	if len(m.TCPAddrs) > maxAddrs {
		return badMetadata("%d TCP addresses", len(m.TCPAddrs))
	}
	for _, s := range m.TCPAddrs {
		if s == "" || len(s) > 256 {
			return badMetadata("invalid TCP address %q", s)
		}
	}
	return nil
}

// checkArenas checks the arena table and indexes it (arenaSize).
func (m *remoteMeta) checkArenas() error {
	if len(m.Arenas) > maxArenas || len(m.Regions) > maxRegions {
		return badMetadata("%d arenas, %d regions", len(m.Arenas), len(m.Regions))
	}
	m.arenaSize = make(map[uint32]uint64, len(m.Arenas))
	for _, ar := range m.Arenas {
		if ar.ID == 0 || ar.Size == 0 || ar.Size > 1<<46 {
			return badMetadata("invalid arena %d of %d bytes", ar.ID, ar.Size)
		}
		if _, dup := m.arenaSize[ar.ID]; dup {
			return badMetadata("arena %d listed twice", ar.ID)
		}
		m.arenaSize[ar.ID] = ar.Size
	}
	return nil
}

// checkRegions checks the region table: sorted unique ids, valid permissions, each region
// inside its arena.
func (m *remoteMeta) checkRegions() error {
	for i, r := range m.Regions {
		if r.ID == 0 || r.Len == 0 || r.Len > 1<<46 {
			return badMetadata("invalid region %d of %d bytes", r.ID, r.Len)
		}
		if i > 0 && m.Regions[i-1].ID >= r.ID {
			return badMetadata("regions not sorted by unique id at %d", r.ID)
		}
		if r.Perm == 0 || Perm(r.Perm)&^PermReadWrite != 0 {
			return badMetadata("region %d has invalid permission %#x", r.ID, r.Perm)
		}
		if err := m.checkPlacement(&r); err != nil {
			return err
		}
	}
	return nil
}

// checkPlacement checks that region r lies inside its arena (if it has one).
func (m *remoteMeta) checkPlacement(r *metaRegion) error {
	if r.Arena == 0 {
		if r.ArenaOff != 0 {
			return badMetadata("region %d has an arena offset but no arena", r.ID)
		}
		return nil
	}
	sz, ok := m.arenaSize[r.Arena]
	if !ok {
		return badMetadata("region %d refers to unknown arena %d", r.ID, r.Arena)
	}
	if r.ArenaOff > sz || r.Len > sz-r.ArenaOff {
		return badMetadata("region %d [%d,+%d) outside arena %d of %d bytes", r.ID, r.ArenaOff, r.Len, r.Arena, sz)
	}
	return nil
}

// checkUCX checks the UCX worker addresses and arena keys and indexes the keys (ucxArena).
func (m *remoteMeta) checkUCX() error {
	if len(m.UCXWorkers) > maxUCXWorkers {
		return badMetadata("%d UCX workers", len(m.UCXWorkers))
	}
	for i, w := range m.UCXWorkers {
		if len(w) == 0 || len(w) > maxUCXBlob {
			return badMetadata("UCX worker address %d of %d bytes", i, len(w))
		}
	}
	if len(m.UCXArenas) > 0 && len(m.UCXWorkers) == 0 {
		return badMetadata("UCX arena keys without a UCX worker")
	}
	m.ucxArena = make(map[uint32]*metaUCXArena, len(m.UCXArenas))
	for i := range m.UCXArenas {
		ua := &m.UCXArenas[i]
		if _, ok := m.arenaSize[ua.ID]; !ok {
			return badMetadata("UCX key for unknown arena %d", ua.ID)
		}
		if m.ucxArena[ua.ID] != nil {
			return badMetadata("UCX key for arena %d listed twice", ua.ID)
		}
		if len(ua.Rkey) == 0 || len(ua.Rkey) > maxUCXBlob {
			return badMetadata("UCX key of arena %d has %d bytes", ua.ID, len(ua.Rkey))
		}
		if ua.Base > 1<<63-1-m.arenaSize[ua.ID] {
			return badMetadata("UCX arena %d at %#x overflows", ua.ID, ua.Base)
		}
		m.ucxArena[ua.ID] = ua
	}
	return nil
}

// procStart returns the start time of process pid (field 22 of /proc/PID/stat, clock ticks
// after boot): with the boot id and the pid it names one process for the life of the host.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is parenthesised and may contain spaces: count after it.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	return strconv.ParseUint(f[19], 10, 64) // field 22 is the 20th after the name
}
