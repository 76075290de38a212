package transfer

import (
	"fmt"
	"os"
	"runtime"
	"sort"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// UCX backend, the parts every build shares: the request plan, its unit state machine, peer
// eligibility and configuration. The engine itself — UCX context, workers, endpoints, the
// progress goroutines — is in ucx_cgo.go (built with -tags ucx) or stubbed in ucx_off.go.
//
// Shape: the agent owns one UCX context and UCXWorkers workers. Every worker is driven by one
// goroutine locked to its OS thread, which is the only code that touches the worker and its
// endpoints: it runs commands handed to it (posts, connects, closes), calls
// ucp_worker_progress until there is nothing left to do, then arms the worker and sleeps in
// epoll_wait on the worker's event fd and an eventfd for new commands — no polling while
// idle. Each arena registered with the agent is registered with UCX (ucp_mem_map) and its
// packed remote key travels in the metadata with the worker addresses. Towards a peer, a link
// holds one endpoint per worker (error handling mode "peer", so a dead peer fails the
// endpoint) and the peer's remote keys unpacked on it. A request is cut into pieces (one
// ucp_get_nbx or ucp_put_nbx each) grouped into units, one per worker involved; a unit posts
// its pieces back to back without per-operation completions and then one endpoint flush,
// whose completion means every piece completed (for puts: remotely). The notification is an
// active message sent on worker 0 after every unit completed, so the peer sees it only after
// the data. Messages to one peer all leave on worker 0's endpoint and so arrive in order.
// One more worker, the answer worker, is not published and starts on first use: it carries the
// answers to peers that connected to this agent without this agent having loaded their
// metadata (SendNotif to an inbound peer), over a one-endpoint link to the address the peer's
// hello gave, so that UCX never joins such a route to an endpoint of the peer's own links (see
// ucxEngine in ucx_cgo.go).

// ucxMinVersion is the oldest UCX the backend builds against (checked at compile time by
// ucx_shim.h and at start-up against the loaded library).
const ucxMinVersion = "1.12"

// Plan sizing: a request of up to ucxSplitMin bytes is one unit on one worker; larger ones are
// spread over the workers in units of at least ucxSplitMin bytes. Pieces are at most
// ucxPieceMax bytes, so that one request keeps several operations in flight.
const (
	ucxSplitMin = 512 << 10
	ucxPieceMax = 1 << 20
)

// ucxMapping is an arena registered with UCX: its base address and packed remote key, as
// published in the metadata, and the registration handle (a ucp_mem_h).
type ucxMapping struct {
	base uint64
	rkey []byte
	//lint:ignore U1000 used by ucx_cgo.go, which only the ucx build tag compiles
	memh unsafe.Pointer
}

// ucxPiece is one RMA operation; its layout is the C kvb_piece's.
type ucxPiece struct {
	laddr uint64 // local address (arena memory, never the Go heap)
	raddr uint64 // remote address
	len   uint64
	rkey  uint32 // index into ucxPlan.arenas
	_     uint32
}

// ucxPlan is a UCX request's plan, computed once by MakeRequest.
type ucxPlan struct {
	arenas []uint32 // the peer arenas the pieces touch; ucxPiece.rkey indexes it
	units  []ucxUnit
}

// ucxUnit is the part of a request one worker moves: a run of pieces posted back to back and
// one flush.
type ucxUnit struct {
	r      *Request
	worker int
	pieces []ucxPiece
	state  atomic.Uint64 // gen<<2 | chunk state (chunkQueued, chunkBusy, chunkDone)
}

// planUCX cuts the runs into pieces and the pieces into one unit per worker involved.
func (r *Request) planUCX(workers int) {
	var pieces []ucxPiece
	slot := map[uint32]uint32{}
	p := &ucxPlan{}
	for i := range r.runs {
		rn := &r.runs[i]
		k, ok := slot[rn.rarena]
		if !ok {
			k = uint32(len(p.arenas))
			slot[rn.rarena] = k
			p.arenas = append(p.arenas, rn.rarena)
		}
		base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(rn.local))))
		for off := 0; off < len(rn.local); off += ucxPieceMax {
			n := min(ucxPieceMax, len(rn.local)-off)
			pieces = append(pieces, ucxPiece{laddr: base + uint64(off), raddr: rn.raddr + uint64(off), len: uint64(n), rkey: k})
		}
	}
	units := 1
	if workers > 1 && r.bytes > ucxSplitMin {
		units = int(min(int64(workers), (r.bytes+ucxSplitMin-1)/ucxSplitMin))
	}
	per := (r.bytes + int64(units) - 1) / int64(units)
	first := int(r.id % uint64(workers))
	p.units = make([]ucxUnit, 0, units)
	cur := make([]ucxPiece, 0, len(pieces)+units)
	var acc int64
	cut := func() {
		p.units = append(p.units, ucxUnit{r: r, worker: (first + len(p.units)) % workers, pieces: cur})
		cur, acc = cur[len(cur):], 0
	}
	for _, pc := range pieces {
		for pc.len > 0 {
			take := min(int64(pc.len), per-acc)
			cur = append(cur, ucxPiece{laddr: pc.laddr, raddr: pc.raddr, len: uint64(take), rkey: pc.rkey})
			pc.laddr += uint64(take)
			pc.raddr += uint64(take)
			pc.len -= uint64(take)
			if acc += take; acc == per && len(p.units) < units-1 {
				cut()
			}
		}
	}
	if len(cur) > 0 {
		cut()
	}
	r.ucx = p
}

// arm resets the unit for post gen.
func (u *ucxUnit) arm(gen uint64) { u.state.Store(gen << 2) }

// start claims the unit of post gen for its worker; false if it was abandoned meanwhile.
//
//lint:ignore U1000 used by ucx_cgo.go, which only the ucx build tag compiles
func (u *ucxUnit) start(gen uint64) bool {
	return u.state.CompareAndSwap(gen<<2|chunkQueued, gen<<2|chunkBusy)
}

// resolve ends the unit of post gen once its operations can no longer touch local memory.
//
//lint:ignore U1000 used by ucx_cgo.go, which only the ucx build tag compiles
func (u *ucxUnit) resolve(gen uint64, err error) {
	if !u.state.CompareAndSwap(gen<<2|chunkBusy, gen<<2|chunkDone) {
		return
	}
	if err != nil {
		u.r.failErr(gen, err)
	}
	u.r.unitDone()
}

// abandon resolves the unit of a failed post gen at once if its worker has not started it;
// a unit in flight is interrupted by closing the link, which gives what is in flight
// ucxCloseGrace to complete and then cancels it.
func (u *ucxUnit) abandon(gen uint64, why string) {
	if u.state.CompareAndSwap(gen<<2|chunkQueued, gen<<2|chunkDone) {
		u.r.unitDone()
		return
	}
	if u.state.Load() == gen<<2|chunkBusy {
		if l := u.r.ucxLink.Load(); l != nil {
			// The unit resolves when its flush completes or the endpoint closes, so local
			// memory is not touched after Done; draining rather than aborting spares the
			// peer an endpoint failing under its emulated puts and gets (ucxLink.drain).
			l.drain("request abandoned in flight: " + why)
		}
	}
}

// ucxUsable explains why UCX cannot serve descs ("" if it can).
func (p *peer) ucxUsable(descs []Desc) string {
	if p.a.ucx == nil {
		return "UCX is not among this agent's backends"
	}
	m := p.meta.Load()
	if len(m.UCXWorkers) == 0 {
		return "peer offers no UCX worker (UCX is not among its backends, or it runs a build without -tags ucx)"
	}
	for i, d := range descs {
		r := m.region(d.Region)
		if r == nil {
			continue // PrepareRemote reports it
		}
		if r.Arena == 0 {
			return fmt.Sprintf("descriptor %d: region %d is not in a shared arena", i, d.Region)
		}
		if m.ucxArena[r.Arena] == nil {
			return fmt.Sprintf("descriptor %d: the peer published no UCX key for arena %d", i, r.Arena)
		}
	}
	return ""
}

// resolveUCX computes every descriptor's remote address in the peer's address space.
func (l *PreparedList) resolveUCX(m *remoteMeta) error {
	l.raddrs = make([]uint64, len(l.descs))
	l.rarenas = make([]uint32, len(l.descs))
	for i, d := range l.descs {
		r := m.region(d.Region)
		ua := m.ucxArena[r.Arena]
		if ua == nil {
			return descErr("prepare", l.peer.name, i, ErrNotFound, "no UCX key for arena %d of region %d", r.Arena, d.Region)
		}
		l.raddrs[i] = ua.Base + r.ArenaOff + uint64(d.Offset)
		l.rarenas[i] = r.Arena
	}
	return nil
}

// teardownUCX closes link if it is still the peer's and fails the UCX requests in flight on
// it; SHM and TCP requests are not affected. The next UCX post reconnects. It is the second
// half of ucxLink.abort, which marks the link so that its endpoints close at once.
//
//lint:ignore U1000 used by ucx_cgo.go, which only the ucx build tag compiles
func (p *peer) teardownUCX(link *ucxLink, why string) {
	reqs, current := p.takeUCX(link)
	if !current {
		link.close()
		return
	}
	p.a.stats.disconnects.Add(1)
	p.a.log.Info("transfer UCX link lost", "peer", p.name, "err", why)
	link.close()
	for r, gen := range reqs {
		r.fail(gen, ErrRemoteDisconnect, why, nil)
	}
}

// takeUCX detaches link, if it is still the peer's, and the UCX requests in flight; current
// reports whether it was.
func (p *peer) takeUCX(link *ucxLink) (reqs map[*Request]uint64, current bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ux != link {
		return nil, false
	}
	p.ux = nil
	return p.takeInflightLocked(BackendUCX), true
}

// currentUCX returns the peer's UCX link, or nil.
func (p *peer) currentUCX() *ucxLink {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ux
}

// watchProcess watches the peer process (same host) so that its exit tears the UCX link down
// at once: UCX itself finds a dead peer on shared-memory transports only by keep-alive, which
// needs the peer to drain its queues and misses a peer killed while its queues are full. The
// process is named by its pid and start time in the metadata; a pid that is not visible here
// (another pid namespace) or names another process is not watched. The watch ends when the
// process exits or the peer is retired.
func (p *peer) watchProcess() {
	m := p.meta.Load()
	if m.PID <= 0 || m.ProcStart == 0 {
		return
	}
	fd, err := unix.PidfdOpen(int(m.PID), unix.PIDFD_NONBLOCK) // non-blocking: it waits in the network poller
	if err != nil {
		return
	}
	if st, err := procStart(int(m.PID)); err != nil || st != m.ProcStart {
		unix.Close(fd)
		return // pid reused, or not this process in our pid namespace
	}
	f := os.NewFile(uintptr(fd), "pidfd")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return
	}
	if err := p.whileLive("watch", func() error {
		if p.procWait != nil {
			return ErrInUse // watched already
		}
		p.procWait = f
		return nil
	}); err != nil {
		f.Close()
		return
	}
	if !p.a.goTracked(func() {
		err := rc.Read(func(fd uintptr) bool {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			n, _ := unix.Poll(pfd, 0)
			return n > 0 // readable once the process has exited
		})
		if err != nil {
			return // retired: the pidfd was closed
		}
		if l := p.currentUCX(); l != nil {
			l.abort(fmt.Sprintf("peer process %d exited", m.PID))
		}
	}) {
		f.Close()
	}
}

// ucxSettings returns the UCX configuration entries to apply over the environment: the
// agent's Config.UCX, plus kvbridge's defaults for settings neither sets (getenv reads the
// environment). Names carry no UCX_ prefix; the result is sorted by name.
func ucxSettings(cfg map[string]string, getenv func(string) string) ([][2]string, error) {
	set := map[string]string{}
	for k, v := range cfg {
		name := strings.TrimPrefix(strings.ToUpper(strings.TrimSpace(k)), "UCX_")
		if name == "" || strings.ContainsAny(name, "\x00= ") || strings.ContainsRune(v, 0) {
			return nil, newErr("config", "", ErrInvalidParam, fmt.Sprintf("UCX setting %q=%q", k, v), nil)
		}
		set[name] = v
	}
	tls, ok := set["TLS"]
	if !ok {
		tls = getenv("UCX_TLS")
	}
	for _, d := range ucxDefaults {
		if !d.applies(tls) {
			continue // UCX warns about settings of transports it does not use
		}
		explicit := false
		for _, n := range d.overrides {
			if _, ok := set[n]; ok || getenv("UCX_"+n) != "" {
				explicit = true
			}
		}
		if !explicit {
			set[d.name] = d.value
		}
	}
	out := make([][2]string, 0, len(set))
	for k, v := range set {
		out = append(out, [2]string{k, v})
	}
	sort.Slice(out, func(i, j int) bool { return out[i][0] < out[j][0] })
	return out, nil
}

// ucxDefault is a UCX setting kvbridge applies unless the user set one of the settings in
// overrides (by UCX_ environment variable or Config.UCX) and the transport it tunes may be
// in use. name is as ucp_config_modify takes it: transport settings by their name inside the
// transport's table (TCP's UCX_TCP_TX_SEG_SIZE is TX_SEG_SIZE).
type ucxDefault struct {
	name, value string
	overrides   []string
	transports  []string // UCX_TLS entries that select the transport ("all" and unset do too); nil: any
}

// applies reports whether d tunes a transport that UCX_TLS=tls may select.
func (d ucxDefault) applies(tls string) bool {
	tls = strings.ToLower(strings.TrimSpace(tls))
	if len(d.transports) == 0 || tls == "" || tls == "all" || strings.HasPrefix(tls, "^") {
		return true
	}
	for _, t := range strings.Split(tls, ",") {
		t = strings.TrimSuffix(strings.TrimSpace(t), ":aux")
		for _, x := range d.transports {
			if t == x {
				return true
			}
		}
	}
	return false
}

// ucxDefaults are the UCX settings kvbridge applies unless the environment or Config.UCX sets
// them (as NIXL overrides some UCX defaults):
//   - UCX emulates RMA over TCP with active messages whose fragments are one TCP segment:
//     UCX's 8 KiB default costs a 1 MiB READ 128 fragments through both workers. 520 KiB
//     carries a 512 KiB piece (ucxSplitMin) and its headers in one fragment.
//   - The shared-memory transports (posix, sysv) are only eligible for endpoints with
//     peer-failure detection, which this backend requires, when their error handling is on.
//
// UCX's keep-alive interval stays UCX's (20 s): a shorter one declares peers whose workers are
// merely parked or slow dead; a peer on this host is watched through a pidfd instead.
var ucxDefaults = []ucxDefault{
	{name: "TX_SEG_SIZE", value: "520K", overrides: []string{"TCP_TX_SEG_SIZE", "TX_SEG_SIZE"}, transports: []string{"tcp"}},
	{name: "RX_SEG_SIZE", value: "520K", overrides: []string{"TCP_RX_SEG_SIZE", "RX_SEG_SIZE"}, transports: []string{"tcp"}},
	{name: "MM_ERROR_HANDLING", value: "y", overrides: []string{"MM_ERROR_HANDLING", "POSIX_ERROR_HANDLING", "SYSV_ERROR_HANDLING"},
		transports: []string{"sm", "shm", "mm", "posix", "sysv"}},
}

// parseUCXLanes extracts the lanes from ucp_ep_print_info's report, as "transport/device:
// uses" (for example "tcp/lo.0: am am_bw#0 rma_bw#0 keepalive wireup").
func parseUCXLanes(info string) []string {
	var out []string
	for _, line := range strings.Split(info, "\n") {
		_, rest, ok := strings.Cut(line, "lane[")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		// f: "0]:", "0:tcp/lo.0", "md[0]", "->", "md[0]/tcp/sysdev[255]", uses…
		if len(f) < 2 {
			continue
		}
		_, tl, _ := strings.Cut(f[1], ":")
		var uses []string
		for i, x := range f {
			if x == "->" && i+2 <= len(f) {
				uses = f[i+2:]
				break
			}
		}
		out = append(out, strings.TrimSpace(tl+": "+strings.Join(uses, " ")))
	}
	return out
}

// ucxHasRMALane reports whether UCX chose a lane for remote memory access (rma_bw), so that
// gets and puts are one-sided rather than emulated with active messages.
func ucxHasRMALane(lanes []string) bool {
	for _, l := range lanes {
		if strings.Contains(l, "rma_bw") {
			return true
		}
	}
	return false
}

// defaultUCXWorkers is the UCX worker count when Config.UCXWorkers is zero: half the
// processors, from 1 to 4. Where UCX emulates gets and puts (TCP, shared memory) every byte
// costs CPU on both sides, and more workers than that only make them compete; on RDMA the
// NIC moves the bytes and a few workers keep it busy.
func defaultUCXWorkers() int { return min(max(runtime.GOMAXPROCS(0)/2, 1), 4) }
