package transfer

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"
	"golang.org/x/sys/unix"
)

// PeerInfo describes a loaded remote agent.
type PeerInfo struct {
	Name        string
	Incarnation uint64
	SameHost    bool   // same boot id as this agent
	UnixAddr    string // "" if the peer offers no SHM
	TCPAddrs    []string
	Regions     int
	Offers      []Backend // backends the peer's metadata offers
	Backends    []Backend // backends currently connected
	// UCXLanes lists the lanes UCX chose towards the peer ("transport/device: uses", e.g.
	// "tcp/eth0: am am_bw#0 rma_bw#0") while a UCX link is up: the way to see whether UCX
	// runs over RDMA, shared memory or TCP.
	UCXLanes []string
}

// peer is the state for one incarnation of a remote agent. A new incarnation gets a new peer;
// the old one is retired (its requests fail with ErrStaleIncarnation).
type peer struct {
	a    *Agent
	name string
	inc  uint64
	meta atomic.Pointer[remoteMeta]

	// dialMu serialises connection attempts: it is held while dialing, p.mu never is, so
	// requests in flight (which take p.mu) never wait for the network.
	dialMu sync.Mutex

	mu sync.Mutex
	// guarded by mu: the link (connections, mappings) and the requests in flight.
	gone     error  // sentinel once retired (stale, invalidated, closed)
	goneWhy  string // detail for gone
	uconn    *ctrlConn
	tconn    *ctrlConn
	data     []*dataConn
	ux       *ucxLink // UCX endpoints (one per worker), nil until connected
	procWait *os.File // pidfd of the peer process while watched (same host, UCX)
	budget   *semaphore.Weighted
	maps     map[uint32]*mapping // arena id → mapping of the peer's arena
	inflight map[*Request]uint64 // active requests and their post generation
	lists    int                 // live prepared lists bound to this peer
	unmapped bool
	rr       int // round-robin start for stripes
}

// mapping is a peer arena mapped into this process.
type mapping struct {
	mem      []byte
	writable bool
}

// LoadRemote loads (or replaces) a peer's metadata blob and returns the peer's name. It does
// not connect. Loading the same incarnation again replaces the region table in place.
// Loading a new incarnation retires the old one atomically: its requests in flight fail with
// ErrStaleIncarnation, as do later posts of requests made from lists prepared against it.
func (a *Agent) LoadRemote(blob []byte) (string, error) {
	m, err := decodeMetadata(blob)
	if err != nil {
		return "", err
	}
	if a.closed.Load() {
		return "", newErr("load", m.Name, ErrClosed, "agent closed", nil)
	}
	if old := a.installPeer(m); old != nil {
		old.retire(ErrStaleIncarnation, fmt.Sprintf("incarnation %016x replaced by %016x", old.inc, m.Incarnation))
	}
	return m.Name, nil
}

// installPeer makes m the metadata of the peer it names: in place for the incarnation
// already loaded, else as a new peer. It returns the peer that m replaced, for the caller
// to retire.
func (a *Agent) installPeer(m *remoteMeta) (replaced *peer) {
	a.peersMu.Lock()
	defer a.peersMu.Unlock()
	old := a.peers[m.Name]
	if old != nil && old.inc == m.Incarnation {
		old.meta.Store(m)
		return nil
	}
	p := &peer{a: a, name: m.Name, inc: m.Incarnation, maps: map[uint32]*mapping{}, inflight: map[*Request]uint64{}}
	p.meta.Store(m)
	a.peers[m.Name] = p
	return old
}

// InvalidateRemote forgets a peer: its connections close, its requests in flight fail with
// ErrNotFound, and lists prepared against it can no longer be posted.
func (a *Agent) InvalidateRemote(name string) error {
	return a.invalidate(name, 0)
}

// InvalidateIncarnation is InvalidateRemote for one incarnation of a peer: it does nothing (and
// returns an ErrNotFound error) when the peer now loaded under name is another incarnation, so
// that forgetting a dead incarnation never drops the one that replaced it.
func (a *Agent) InvalidateIncarnation(name string, inc uint64) error {
	if inc == 0 {
		// 0 would match any incarnation below; no peer is loaded with incarnation 0.
		return newErr("invalidate", name, ErrNotFound, fmt.Sprintf("incarnation %016x is not loaded", inc), nil)
	}
	return a.invalidate(name, inc)
}

// invalidate forgets the peer loaded under name if its incarnation is inc (0: any
// incarnation) and retires it.
func (a *Agent) invalidate(name string, inc uint64) error {
	p := a.removePeer(name, inc)
	switch {
	case p != nil:
		p.retire(ErrNotFound, "peer metadata invalidated")
		return nil
	case inc == 0:
		return newErr("invalidate", name, ErrNotFound, "no metadata loaded", nil)
	}
	return newErr("invalidate", name, ErrNotFound, fmt.Sprintf("incarnation %016x is not loaded", inc), nil)
}

// removePeer removes and returns the peer loaded under name if its incarnation is inc (0:
// any incarnation), or returns nil.
func (a *Agent) removePeer(name string, inc uint64) *peer {
	a.peersMu.Lock()
	defer a.peersMu.Unlock()
	p := a.peers[name]
	if p == nil || (inc != 0 && p.inc != inc) {
		return nil
	}
	delete(a.peers, name)
	return p
}

// Peer returns what is known about a loaded peer.
func (a *Agent) Peer(name string) (PeerInfo, bool) {
	p := a.lookupPeer(name)
	if p == nil {
		return PeerInfo{}, false
	}
	m := p.meta.Load()
	info := PeerInfo{Name: p.name, Incarnation: p.inc, SameHost: a.bootID != "" && m.BootID == a.bootID,
		UnixAddr: m.UnixAddr, TCPAddrs: append([]string(nil), m.TCPAddrs...), Regions: len(m.Regions)}
	if m.UnixAddr != "" {
		info.Offers = append(info.Offers, BackendSHM)
	}
	if len(m.TCPAddrs) > 0 {
		info.Offers = append(info.Offers, BackendTCP)
	}
	if len(m.UCXWorkers) > 0 {
		info.Offers = append(info.Offers, BackendUCX)
	}
	info.Backends, info.UCXLanes = p.connected()
	return info, true
}

// connected returns the backends whose connections are up, and the UCX link's lanes.
func (p *peer) connected() (backends []Backend, lanes []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.uconn != nil {
		backends = append(backends, BackendSHM)
	}
	if p.data != nil {
		backends = append(backends, BackendTCP)
	}
	if p.ux != nil {
		backends = append(backends, BackendUCX)
		lanes = p.ux.transports()
	}
	return backends, lanes
}

// Connect pre-establishes the connections to a loaded peer for the given backends (default:
// the agent's preference, first usable one), so the first transfer does not pay for them.
func (a *Agent) Connect(ctx context.Context, name string, backends ...string) (Backend, error) {
	p := a.lookupPeer(name)
	if p == nil {
		return 0, newErr("connect", name, ErrNotFound, "no metadata loaded", nil)
	}
	prefs, explicit := a.backends, a.explicit
	if len(backends) > 0 {
		bs, err := ParseBackends(backends)
		if err != nil {
			return 0, err
		}
		prefs, explicit = bs, true
	}
	b, _, err := p.choose(ctx, prefs, explicit, nil)
	return b, err
}

// lookupPeer returns the current peer named name, or nil.
func (a *Agent) lookupPeer(name string) *peer {
	a.peersMu.Lock()
	defer a.peersMu.Unlock()
	return a.peers[name]
}

// goneErr returns the error for using a retired peer (callers hold p.mu).
func (p *peer) goneErrLocked(op string) error {
	return newErr(op, p.name, p.gone, p.goneWhy, nil)
}

// whileLive runs fn under p.mu unless the peer is retired, and returns fn's error or the
// retired peer's (for operation op). fn must not block: it installs or inspects the link.
func (p *peer) whileLive(op string, fn func() error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.gone != nil {
		return p.goneErrLocked(op)
	}
	return fn()
}

// retired reports whether the peer is retired.
func (p *peer) retired() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.gone != nil
}

// sameHost reports whether the peer runs on this host.
func (p *peer) sameHost() bool {
	return p.a.bootID != "" && p.meta.Load().BootID == p.a.bootID
}

// shmUsable explains why SHM cannot serve descs ("" if it can).
func (p *peer) shmUsable(descs []Desc) string {
	m := p.meta.Load()
	switch {
	case m.UnixAddr == "":
		return "peer offers no SHM socket"
	case !p.sameHost():
		return fmt.Sprintf("peer is on another host (boot id %q, ours %q)", m.BootID, p.a.bootID)
	}
	for i, d := range descs {
		if r := m.region(d.Region); r != nil && r.Arena == 0 {
			return fmt.Sprintf("descriptor %d: region %d is not in a shared arena", i, d.Region)
		}
	}
	return ""
}

// tcpUsable explains why TCP cannot be used ("" if it can).
func (p *peer) tcpUsable() string {
	if len(p.meta.Load().TCPAddrs) == 0 {
		return "peer offers no TCP address"
	}
	return ""
}

// choose picks the first usable backend in prefs for descs and connects it. With an
// explicit list, backends not in it are never used. A fallback past the first preference
// is returned as a reason string and counted, never silent.
func (p *peer) choose(ctx context.Context, prefs []Backend, explicit bool, descs []Desc) (Backend, string, error) {
	var reasons []string
	kind := ErrNotSupported
	for _, b := range prefs {
		var why string
		switch b {
		case BackendSHM:
			why = p.shmUsable(descs)
		case BackendTCP:
			why = p.tcpUsable()
		case BackendUCX:
			why = p.ucxUsable(descs)
		}
		if why == "" {
			err := p.ensure(ctx, b)
			if err == nil {
				fallback := ""
				if len(reasons) > 0 {
					fallback = joinReasons(reasons)
					p.a.stats.fallbacks.Add(1)
					p.a.log.Info("transfer backend fallback", "peer", p.name, "backend", b.String(), "err", fallback)
				}
				return b, fallback, nil
			}
			k := kindOf(err)
			if k == ErrStaleIncarnation || k == ErrNotFound || k == ErrClosed || k == ErrCanceled {
				return 0, "", err
			}
			kind = k // a real connection failure says more than "not supported"
			why = err.Error()
		}
		reasons = append(reasons, b.String()+": "+why)
	}
	detail := joinReasons(reasons)
	if explicit {
		detail = "none of the requested backends can be used: " + detail
	}
	return 0, "", newErr("select backend", p.name, kind, detail, nil)
}

// joinReasons joins fallback reasons.
func joinReasons(r []string) string {
	s := ""
	for i, x := range r {
		if i > 0 {
			s += "; "
		}
		s += x
	}
	return s
}

// ensure makes sure the connections backend b needs are up. Dialing happens under dialMu
// only, so requests in flight (which take p.mu) never wait for a connection attempt.
func (p *peer) ensure(ctx context.Context, b Backend) error {
	p.dialMu.Lock()
	defer p.dialMu.Unlock()
	var up bool
	if err := p.whileLive("connect", func() error {
		up = (b == BackendSHM && p.uconn != nil) || (b == BackendTCP && p.data != nil) || (b == BackendUCX && p.ux != nil)
		return nil
	}); err != nil || up {
		return err
	}
	switch b {
	case BackendSHM:
		return p.connectSHM(ctx)
	case BackendTCP:
		return p.connectTCP(ctx)
	case BackendUCX:
		return p.connectUCX(ctx)
	}
	return newErr("connect", p.name, ErrInvalidParam, "unknown backend", nil)
}

// notifRoute carries notifications to one peer: a control connection (Unix or TCP) or a UCX
// link.
type notifRoute interface {
	send(msg []byte, deadline time.Time) error
}

// route returns the route notifications to this peer travel on, connecting one if needed:
// the UCX link when one is up, else the Unix socket when SHM is up, else a TCP control
// connection. With no route yet, prefer decides which one is made (SHM or UCX only if
// usable; 0 = the agent's preference).
func (p *peer) route(ctx context.Context, prefer Backend) (notifRoute, error) {
	if rt, err := p.liveRoute(); rt != nil || err != nil {
		return rt, err
	}
	p.dialMu.Lock()
	defer p.dialMu.Unlock()
	if rt, err := p.liveRoute(); rt != nil || err != nil {
		return rt, err
	}
	if err := p.connectRoute(ctx, prefer); err != nil {
		return nil, err
	}
	return p.liveRoute()
}

// liveRoute returns the current notification route (nil if none), or the retired peer's
// error.
func (p *peer) liveRoute() (rt notifRoute, err error) {
	err = p.whileLive("notify", func() error {
		rt = p.routeLocked()
		return nil
	})
	return rt, err
}

// connectRoute connects a notification route (see route). Callers hold dialMu.
func (p *peer) connectRoute(ctx context.Context, prefer Backend) error {
	if prefer == 0 {
		prefer = p.a.backends[0]
	}
	var firstErr error
	if prefer == BackendUCX && p.ucxUsable(nil) == "" {
		if firstErr = p.connectUCX(ctx); firstErr == nil {
			return nil
		}
	}
	if prefer == BackendSHM && p.a.enabled(BackendSHM) && p.shmUsable(nil) == "" {
		if firstErr = p.connectSHM(ctx); firstErr == nil {
			return nil
		}
	}
	if p.tcpUsable() == "" {
		return p.connectTCPCtrl(ctx)
	}
	if prefer != BackendUCX && p.ucxUsable(nil) == "" {
		err := p.connectUCX(ctx)
		if err == nil {
			return nil
		}
		if firstErr == nil {
			firstErr = err
		}
	}
	if firstErr != nil {
		return firstErr
	}
	return newErr("notify", p.name, ErrNotSupported, "peer offers no usable control connection", nil)
}

// currentRoute returns the current notification route, or nil.
func (p *peer) currentRoute() notifRoute {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.routeLocked()
}

// detach forgets request r as in flight if it still is for post gen.
func (p *peer) detach(r *Request, gen uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.inflight[r] == gen {
		delete(p.inflight, r)
	}
}

// routeLocked returns the current notification route, or nil (callers hold p.mu). All
// notifications to a peer take the same route, so they arrive in the order they were sent.
func (p *peer) routeLocked() notifRoute {
	switch {
	case p.ux != nil:
		return p.ux
	case p.uconn != nil:
		return p.uconn
	case p.tconn != nil:
		return p.tconn
	}
	return nil
}

// connectUCX connects the UCX link. Callers hold dialMu.
func (p *peer) connectUCX(ctx context.Context) error {
	l, err := p.a.ucx.connect(ctx, p)
	if err != nil {
		return err
	}
	var watch bool
	if err := p.whileLive("connect", func() error {
		p.ux = l
		watch = p.procWait == nil && p.sameHost()
		return nil
	}); err != nil {
		l.close()
		return err
	}
	p.a.stats.connects.Add(1)
	lanes := l.transports()
	p.a.log.Info("transfer UCX link up", "peer", p.name, "lanes", strings.Join(lanes, "; "))
	if !ucxHasRMALane(lanes) {
		p.a.log.Warn("UCX emulates gets and puts to this peer with active messages (no RMA lane): slower than the SHM and TCP backends, "+
			"and UCX 1.13 can abort or stall the agent answering them when the other side dies mid-transfer; UCX is meant for RDMA networks",
			"peer", p.name, "lanes", strings.Join(lanes, "; "))
	}
	if watch {
		p.watchProcess()
	}
	return nil
}

// connectSHM dials the peer's Unix socket, receives the fds of the shared arenas not mapped
// yet and maps them, then starts watching the socket for the peer's exit. Callers hold
// dialMu.
func (p *peer) connectSHM(ctx context.Context) error {
	m := p.meta.Load()
	ids := make([]uint32, 0, len(m.Arenas))
	for _, ar := range m.Arenas {
		ids = append(ids, ar.ID)
	}
	res, err := p.a.dial(ctx, "unix", m.UnixAddr, hello{Role: roleControl, To: p.name, ToInc: p.inc, Arenas: p.notMapped(ids)})
	if err != nil {
		return err
	}
	cc := newCtrlConn(p.a, res.conn, p.name, p.inc, true)
	if err := p.mapGrants(res, func() { p.uconn = cc }); err != nil {
		res.conn.Close()
		return err
	}
	return p.startWatch(cc)
}

// notMapped returns the arena ids in ids that are not mapped yet.
func (p *peer) notMapped(ids []uint32) []uint32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var want []uint32
	for _, id := range ids {
		if p.maps[id] == nil {
			want = append(want, id)
		}
	}
	return want
}

// mapGrants maps the arena fds res received unless the peer is retired, closing them either
// way, then, if mapping succeeded, runs install (may be nil) under p.mu.
func (p *peer) mapGrants(res *dialResult, install func()) error {
	fds := res.fds
	res.fds = nil
	err := p.whileLive("connect", func() error {
		err := p.mapGrantsLocked(res.ack.Grants, fds)
		fds = nil
		if err == nil && install != nil {
			install()
		}
		return err
	})
	for _, fd := range fds { // the peer was retired: mapGrantsLocked did not run
		unix.Close(fd)
	}
	return err
}

// startWatch tracks an installed control connection and starts its reader.
func (p *peer) startWatch(cc *ctrlConn) error {
	if !p.a.trackOutbound(cc.c) || !p.a.goTracked(func() { p.watch(cc) }) {
		p.teardownConn(cc, nil, "agent closed")
		return newErr("connect", p.name, ErrClosed, "agent closed", nil)
	}
	p.a.stats.connects.Add(1)
	return nil
}

// mapGrantsLocked maps received arena fds (closing them) after checking them against the
// metadata.
func (p *peer) mapGrantsLocked(grants []arenaGrant, fds []int) error {
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	m := p.meta.Load()
	for i, g := range grants {
		size, ok := m.arenaSize[g.ID]
		if !ok || size != g.Size {
			continue // not in the metadata we hold (or resized): ignore
		}
		if p.maps[g.ID] != nil {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstat(fds[i], &st); err != nil || uint64(st.Size) < g.Size {
			return newErr("connect", p.name, ErrProtocol, fmt.Sprintf("arena %d fd does not match its size", g.ID), err)
		}
		prot := unix.PROT_READ
		if g.Writable {
			prot |= unix.PROT_WRITE
		}
		mem, err := unix.Mmap(fds[i], 0, int(g.Size), prot, unix.MAP_SHARED|unix.MAP_POPULATE)
		if err != nil {
			return newErr("connect", p.name, ErrBackend, fmt.Sprintf("mapping arena %d", g.ID), err)
		}
		p.maps[g.ID] = &mapping{mem: mem, writable: g.Writable}
		p.a.stats.mappedBytes.Add(int64(len(mem)))
	}
	return nil
}

// fetchArenas maps arenas that appeared in reloaded metadata after the SHM connection was
// made, over a short-lived Unix connection.
func (p *peer) fetchArenas(ctx context.Context, ids []uint32) error {
	p.dialMu.Lock()
	defer p.dialMu.Unlock()
	want := p.notMapped(ids)
	if len(want) == 0 {
		return nil
	}
	res, err := p.a.dial(ctx, "unix", p.meta.Load().UnixAddr, hello{Role: roleArenas, To: p.name, ToInc: p.inc, Arenas: want})
	if err != nil {
		return err
	}
	defer res.conn.Close()
	return p.mapGrants(res, nil)
}

// connectTCP dials the TCP data connections. Callers hold dialMu.
func (p *peer) connectTCP(ctx context.Context) error {
	m := p.meta.Load()
	addr := m.TCPAddrs[0]
	k := p.a.cfg.TCPStreams
	budget := semaphore.NewWeighted(p.a.cfg.MaxInflightBytes)
	conns := make([]*dataConn, 0, k)
	abort := func() {
		for _, c := range conns {
			c.abort()
		}
	}
	for range k {
		res, err := p.a.dial(ctx, "tcp", addr, hello{Role: roleData, To: p.name, ToInc: p.inc})
		if err != nil {
			abort()
			return err
		}
		if !p.a.trackOutbound(res.conn) {
			abort()
			return newErr("connect", p.name, ErrClosed, "agent closed", nil)
		}
		conns = append(conns, newDataConn(p, res.conn, budget))
	}
	if err := p.whileLive("connect", func() error {
		p.data, p.budget = conns, budget
		return nil
	}); err != nil {
		abort()
		return err
	}
	for _, c := range conns {
		if !c.start() {
			p.teardownConn(nil, c, "agent closed")
			return newErr("connect", p.name, ErrClosed, "agent closed", nil)
		}
	}
	p.a.stats.connects.Add(1)
	return nil
}

// connectTCPCtrl dials a TCP control connection (notifications without SHM). Callers hold
// dialMu.
func (p *peer) connectTCPCtrl(ctx context.Context) error {
	res, err := p.a.dial(ctx, "tcp", p.meta.Load().TCPAddrs[0], hello{Role: roleControl, To: p.name, ToInc: p.inc})
	if err != nil {
		return err
	}
	cc := newCtrlConn(p.a, res.conn, p.name, p.inc, false)
	if err := p.whileLive("connect", func() error {
		p.tconn = cc
		return nil
	}); err != nil {
		res.conn.Close()
		return err
	}
	return p.startWatch(cc)
}

// watch reads a control connection we dialed: notifications from the peer are delivered,
// and its end (EOF when the peer process exits) tears the link down at once. OnPeerLost is
// called only when the connection that ended was still the peer's current one: the end of a
// connection this agent had already replaced or closed itself (a teardown followed by a
// reconnect, a retired peer) says nothing about the peer, and reporting it would make the
// owner drop a live, reconnected peer.
func (p *peer) watch(cc *ctrlConn) {
	err := cc.readLoop()
	p.a.untrack(cc.c)
	if p.a.closed.Load() {
		return
	}
	if !p.teardownConn(cc, nil, fmt.Sprintf("control connection lost: %v", err)) {
		return
	}
	if f := p.a.cfg.OnPeerLost; f != nil && !p.retired() {
		f(p.name, p.inc)
	}
}

// teardownConn tears the link down if cc (or dc) is still part of it, and reports whether it
// was; a connection no longer part of the link is just closed.
func (p *peer) teardownConn(cc *ctrlConn, dc *dataConn, why string) bool {
	current := p.isCurrent(cc, dc)
	switch {
	case current && dc != nil:
		p.teardownData(why)
	case current:
		p.teardown(ErrRemoteDisconnect, why)
	case cc != nil:
		cc.close()
	}
	return current
}

// isCurrent reports whether cc (or dc) is part of the link.
func (p *peer) isCurrent(cc *ctrlConn, dc *dataConn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if cc != nil && (p.uconn == cc || p.tconn == cc) {
		return true
	}
	return dc != nil && slices.Contains(p.data, dc)
}

// teardownData closes the TCP data connections and fails the TCP requests in flight; SHM
// requests and the control connection are not affected. The next TCP post reconnects.
func (p *peer) teardownData(why string) {
	data, reqs := p.takeData()
	if len(data) > 0 {
		p.a.stats.disconnects.Add(1)
		p.a.log.Info("transfer data connections lost", "peer", p.name, "err", why)
	}
	for _, c := range data {
		c.abort()
	}
	for r, gen := range reqs {
		r.fail(gen, ErrRemoteDisconnect, why, nil)
	}
}

// takeData detaches the TCP data connections and the TCP requests in flight.
func (p *peer) takeData() ([]*dataConn, map[*Request]uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	data := p.data
	p.data, p.budget = nil, nil
	return data, p.takeInflightLocked(BackendTCP)
}

// teardown closes every connection to the peer and fails its requests in flight with kind.
// The peer stays loaded: the next request reconnects.
func (p *peer) teardown(kind error, why string) {
	conns, reqs := p.takeLink()
	if len(conns.data) > 0 || conns.u != nil || conns.t != nil || conns.ux != nil {
		p.a.stats.disconnects.Add(1)
		p.a.log.Info("transfer peer disconnected", "peer", p.name, "err", why)
	}
	conns.close()
	for r, gen := range reqs {
		r.fail(gen, kind, why, nil)
	}
}

// takeLink detaches every connection and every request in flight.
func (p *peer) takeLink() (linkConns, map[*Request]uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.takeConnsLocked(), p.takeInflightLocked(0)
}

// retire marks the peer gone (stale incarnation, invalidated, agent closed), closes its
// connections and fails its requests with kind. It returns the requests it failed.
func (p *peer) retire(kind error, why string) []*Request {
	conns, reqs, unmap, ok := p.markGone(kind, why)
	if !ok {
		return nil
	}
	conns.close()
	failed := make([]*Request, 0, len(reqs))
	for r, gen := range reqs {
		r.fail(gen, kind, why, nil)
		failed = append(failed, r)
	}
	if unmap && kind != ErrClosed {
		// With no prepared list left nothing can copy from the mappings any more.
		p.unmapAll()
	}
	return failed
}

// markGone retires the peer under p.mu, unless it already is (ok false): it detaches the
// link and the requests in flight, and reports whether no prepared list is left.
func (p *peer) markGone(kind error, why string) (conns linkConns, reqs map[*Request]uint64, unmap, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.gone != nil {
		return linkConns{}, nil, false, false
	}
	p.gone, p.goneWhy = kind, why
	if p.procWait != nil {
		p.procWait.Close() // ends watchProcess
	}
	conns, reqs = p.takeConnsLocked(), p.takeInflightLocked(0)
	return conns, reqs, p.lists == 0, true
}

// linkConns is a snapshot of a peer's connections.
type linkConns struct {
	u, t *ctrlConn
	data []*dataConn
	ux   *ucxLink
}

// close closes all of them.
func (l linkConns) close() {
	if l.ux != nil {
		l.ux.close()
	}
	if l.u != nil {
		l.u.close()
	}
	if l.t != nil {
		l.t.close()
	}
	for _, c := range l.data {
		c.abort()
	}
}

// takeConnsLocked detaches the connections from the peer.
func (p *peer) takeConnsLocked() linkConns {
	l := linkConns{u: p.uconn, t: p.tconn, data: p.data, ux: p.ux}
	p.uconn, p.tconn, p.data, p.budget, p.ux = nil, nil, nil, nil, nil
	return l
}

// takeInflightLocked detaches the active requests on backend b (0: all of them).
func (p *peer) takeInflightLocked(b Backend) map[*Request]uint64 {
	if b == 0 {
		reqs := p.inflight
		p.inflight = map[*Request]uint64{}
		return reqs
	}
	reqs := map[*Request]uint64{}
	for r, gen := range p.inflight {
		if r.backend == b {
			reqs[r] = gen
			delete(p.inflight, r)
		}
	}
	return reqs
}

// dropList forgets a prepared list; the last one of a retired peer unmaps its arenas.
func (p *peer) dropList() {
	if p.listDropped() {
		p.unmapAll()
	}
}

// listDropped counts a prepared list less and reports whether the mappings are to be
// unmapped now.
func (p *peer) listDropped() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lists--
	return p.lists == 0 && p.gone != nil && p.gone != ErrClosed
}

// unmapAll unmaps the peer's arenas (once). Callers guarantee nothing copies any more.
func (p *peer) unmapAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.unmapped {
		return
	}
	p.unmapped = true
	for id, m := range p.maps {
		_ = unix.Munmap(m.mem)
		p.a.stats.mappedBytes.Add(-int64(len(m.mem)))
		delete(p.maps, id)
	}
}

// notifDeadline bounds a completion notification.
func notifDeadline(dl time.Time) time.Time {
	if dl.IsZero() {
		return time.Now().Add(defaultTimeout)
	}
	return dl
}
