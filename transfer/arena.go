package transfer

import (
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Arena is off-heap memory that can be shared with a peer on the same host: a memfd, sealed
// against shrinking and growing (so an importer can never take SIGBUS from truncation),
// mapped MAP_SHARED and pre-faulted. Register slices of it with an Agent to expose them.
//
// The caller owns an Arena: it stays mapped until Close, which is refused while any agent
// still has a region registered in it. Bytes may be handed to other packages (the KV block
// pool lives in one arena).
type Arena struct {
	name string
	fd   int
	mem  []byte
	size int64

	mu sync.Mutex
	// guarded by mu
	regs   int // regions registered (all agents)
	closed bool
}

// NewArena creates an arena of at least size bytes (rounded up to the page size). name is a
// label visible in /proc/<pid>/fd and /proc/<pid>/maps.
func NewArena(name string, size int64) (*Arena, error) {
	if size <= 0 || size > 1<<46 {
		return nil, newErr("arena", "", ErrInvalidParam, fmt.Sprintf("size %d", size), nil)
	}
	page := int64(os.Getpagesize())
	size = (size + page - 1) / page * page
	fd, err := unix.MemfdCreate("kvbridge:"+name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, newErr("arena", "", ErrBackend, "memfd_create", err)
	}
	fail := func(what string, err error) (*Arena, error) {
		unix.Close(fd)
		return nil, newErr("arena", "", ErrBackend, what, err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		return fail("ftruncate", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fail("seal", err)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fail("mmap", err)
	}
	return &Arena{name: name, fd: fd, mem: mem, size: size}, nil
}

// Bytes returns the whole arena. The slice is valid until Close.
func (a *Arena) Bytes() []byte { return a.mem }

// Size returns the arena size in bytes.
func (a *Arena) Size() int64 { return a.size }

// Name returns the label given to NewArena.
func (a *Arena) Name() string { return a.name }

// Close unmaps the arena and closes its memfd. It fails with ErrInUse while regions are
// registered in it. Peers that mapped the arena keep their mapping (the memory lives until
// the last mapping goes). Close is idempotent.
func (a *Arena) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	if a.regs > 0 {
		return newErr("arena close", "", ErrInUse, fmt.Sprintf("%d regions still registered in arena %q", a.regs, a.name), nil)
	}
	a.closed = true
	err := unix.Munmap(a.mem)
	a.mem = nil
	unix.Close(a.fd)
	if err != nil {
		return newErr("arena close", "", ErrBackend, "munmap", err)
	}
	return nil
}

// pin records one more registered region; it fails if the arena is closed.
func (a *Arena) pin() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return newErr("register", "", ErrClosed, fmt.Sprintf("arena %q is closed", a.name), nil)
	}
	a.regs++
	return nil
}

// unpin drops one registered region.
func (a *Arena) unpin() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.regs--
}

// exportFD returns a new descriptor for the arena's memfd to pass to a peer, read-only
// unless writable. The caller closes it.
func (a *Arena) exportFD(writable bool) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return -1, newErr("export", "", ErrClosed, "arena closed", nil)
	}
	mode := unix.O_RDONLY
	if writable {
		mode = unix.O_RDWR
	}
	// Re-opening through /proc yields a new open file description with the requested access
	// mode, so a read-only grant cannot be upgraded by the importer.
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", a.fd), mode|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, newErr("export", "", ErrBackend, "reopen memfd", err)
	}
	return fd, nil
}
