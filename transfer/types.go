package transfer

import (
	"fmt"
	"strings"
)

// Op is the direction of a transfer, seen from the initiator.
type Op uint8

const (
	// Read pulls remote memory into local memory.
	Read Op = 1
	// Write pushes local memory into remote memory.
	Write Op = 2
)

// String returns "READ" or "WRITE".
func (o Op) String() string {
	switch o {
	case Read:
		return "READ"
	case Write:
		return "WRITE"
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Perm is the set of operations peers may perform on a registered region. The owning agent
// itself may always use its own regions as the local side of a request.
type Perm uint8

const (
	// PermRead lets peers READ from the region.
	PermRead Perm = 1 << iota
	// PermWrite lets peers WRITE into the region.
	PermWrite
	// PermReadWrite lets peers do both.
	PermReadWrite = PermRead | PermWrite
)

// String returns "", "r", "w" or "rw".
func (p Perm) String() string {
	s := ""
	if p&PermRead != 0 {
		s += "r"
	}
	if p&PermWrite != 0 {
		s += "w"
	}
	return s
}

// allows reports whether p grants op to peers.
func (p Perm) allows(op Op) bool {
	if op == Read {
		return p&PermRead != 0
	}
	return p&PermWrite != 0
}

// Backend is a data mover.
type Backend uint8

const (
	// BackendSHM copies through a shared mapping of the peer's arena (same host).
	BackendSHM Backend = 1
	// BackendTCP streams over several TCP connections (any host).
	BackendTCP Backend = 2
	// BackendUCX moves bytes with UCX one-sided gets and puts over whatever transport UCX
	// selects (RDMA verbs, TCP, shared memory). Only binaries built with -tags ucx have it.
	BackendUCX Backend = 3
)

// String returns the NIXL-style backend name ("SHM", "TCP", "UCX").
func (b Backend) String() string {
	switch b {
	case BackendSHM:
		return "SHM"
	case BackendTCP:
		return "TCP"
	case BackendUCX:
		return "UCX"
	case 0:
		return "NONE"
	}
	return fmt.Sprintf("Backend(%d)", uint8(b))
}

// ParseBackends turns an ordered list of backend names (as in NIXL's `backends`, case
// insensitive) into backends. "UCX" needs a binary built with -tags ucx (ErrNotSupported,
// naming the tag, otherwise); "LIBFABRIC" and the other NIXL plugins are not available
// (ErrNotSupported); unknown names are ErrInvalidParam.
func ParseBackends(names []string) ([]Backend, error) {
	out := make([]Backend, 0, len(names))
	for _, n := range names {
		var b Backend
		switch strings.ToUpper(strings.TrimSpace(n)) {
		case "SHM":
			b = BackendSHM
		case "TCP":
			b = BackendTCP
		case "UCX":
			if !ucxBuilt {
				return nil, newErr("backends", "", ErrNotSupported, fmt.Sprintf("backend %q is not available in this build: "+
					"it needs a binary built with `-tags ucx` (cgo and libucx-dev, UCX %s or newer) (available: %s)", n, ucxMinVersion, availableBackends()), nil)
			}
			b = BackendUCX
		case "LIBFABRIC", "UCCL", "GDS", "GDS_MT", "POSIX", "OBJ", "MOONCAKE", "GPUNETIO", "HF3FS", "AZURE_BLOB":
			return nil, newErr("backends", "", ErrNotSupported,
				fmt.Sprintf("backend %q is not available in this build (available: %s)", n, availableBackends()), nil)
		default:
			return nil, newErr("backends", "", ErrInvalidParam, fmt.Sprintf("unknown backend %q (available: %s)", n, availableBackends()), nil)
		}
		for _, o := range out {
			if o == b {
				return nil, newErr("backends", "", ErrInvalidParam, fmt.Sprintf("backend %q listed twice", n), nil)
			}
		}
		out = append(out, b)
	}
	return out, nil
}

// availableBackends lists the backend names this build accepts.
func availableBackends() string {
	if ucxBuilt {
		return "SHM, TCP, UCX"
	}
	return "SHM, TCP"
}

// Desc names Length bytes at Offset in a registered region. Local descriptors use the local
// agent's region ids (Region.ID), remote ones the ids published in the peer's metadata.
type Desc struct {
	Region uint32
	Offset int64
	Length int64
}

// BlockDescs returns n descriptors of blockBytes each, laid out back to back from base in
// region: the usual way a paged KV pool is described (block i at base + i*blockBytes).
func BlockDescs(region uint32, base, blockBytes int64, n int) []Desc {
	d := make([]Desc, n)
	for i := range d {
		d[i] = Desc{Region: region, Offset: base + int64(i)*blockBytes, Length: blockBytes}
	}
	return d
}
