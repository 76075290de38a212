package transfer

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Config configures an Agent. The zero value is usable: every field has a default applied by
// NewAgent.
type Config struct {
	// ListenTCP is the TCP listen address for peers (data, control and metadata connections).
	// Default "127.0.0.1:0". "none" disables the TCP listener (peers cannot use TCP to reach
	// this agent).
	ListenTCP string
	// AdvertiseTCP overrides the address published in the metadata (e.g. a routable IP when
	// listening on 0.0.0.0).
	AdvertiseTCP string
	// UnixSocket is the address of the same-host control socket over which arena fds are
	// passed. Default: an abstract socket "@kvbridge-<name>-<incarnation>". A path creates a
	// socket file (removed by Close). "none" disables SHM towards this agent.
	UnixSocket string
	// Backends is the default ordered backend preference for PrepareRemote, by NIXL name
	// ("SHM", "TCP", "UCX"). Default: SHM when usable, else TCP. An explicit list is honoured
	// strictly: a backend not listed is never used, and only listed backends are offered to
	// peers (UCX is offered only when listed; it needs a binary built with -tags ucx).
	Backends []string
	// UCX configures the UCX backend: UCX settings as ucp_config_modify takes them, by name
	// without the UCX_ prefix (for example {"TLS": "tcp", "NET_DEVICES": "mlx5_0:1"}; a
	// transport's own settings by their name inside the transport, e.g. TCP's TX_SEG_SIZE).
	// The process environment's UCX_* variables (UCX_TLS, UCX_NET_DEVICES, …) are read by UCX
	// as usual; entries here win over them, and both win over kvbridge's defaults (larger TCP
	// segments, shared-memory error handling, a 1 s keep-alive; see ucxDefaults).
	UCX map[string]string
	// UCXWorkers is the number of UCX workers, each with a progress goroutine on its own
	// locked OS thread and an endpoint to every peer; large requests are spread over them.
	// Default GOMAXPROCS/2, from 1 to 4; at most 64. The first time the agent answers a peer
	// that connected to it over UCX (see SendNotif), it starts one more worker, for answers
	// only.
	UCXWorkers int
	// Workers is the number of SHM copy goroutines. Default GOMAXPROCS.
	Workers int
	// TCPStreams is the number of TCP data connections per peer. Default 4.
	TCPStreams int
	// StripeBytes is the largest piece of a request sent as one TCP frame; larger ranges are
	// split and the pieces spread over the connections. Default 1 MiB, at most 64 MiB.
	StripeBytes int
	// MaxInflightBytes bounds the bytes requested but not yet received (READ) or sent but not
	// yet acknowledged (WRITE) per peer over TCP. Default 64 MiB.
	MaxInflightBytes int64
	// RequestTimeout is the deadline of a request that sets none (and whose Post context has
	// none). Default 30 s.
	RequestTimeout time.Duration
	// DialTimeout bounds connection establishment and handshakes. Default 5 s.
	DialTimeout time.Duration
	// NotifQueue is the capacity of the notification queue; when full the oldest message is
	// dropped and counted. Default 65536.
	NotifQueue int
	// MaxNotifBytes is the largest notification accepted. Default 1 MiB.
	MaxNotifBytes int
	// Auth authenticates every connection this agent dials or accepts (TCP and Unix, every
	// role) with a mutual challenge-response; NewHMACAuth makes the shared-secret one. Nil: no
	// authentication (same-host Unix connections are still restricted to the same user id).
	// Both sides must agree: an agent with Auth refuses peers without it, and one without
	// Auth refuses peers that authenticate, at once and with a message saying so.
	Auth Authenticator
	// AuthorizeRead, if set, decides which bytes a peer may read over TCP. The target calls
	// it for every READ frame, after the ranges were checked against the registered regions,
	// with the peer's agent name, the tag the initiator attached to its request
	// (RequestOptions.Tag; only valid during the call) and the frame's ranges (a request's
	// ranges may arrive split over several frames). A non-nil error refuses the frame: the
	// initiator's request fails with ErrPermission and the error's text, and the target logs
	// and counts it (Stats.ReadsDenied, Stats.Refused.Permission). It runs on connection
	// goroutines and must be quick and safe for concurrent use; a panic in it refuses the
	// frame. SHM reads never reach it: the peer maps the arena (see the package doc, Trust).
	AuthorizeRead func(peer string, tag []byte, descs []Desc) error
	// AuthorizeWrite, if set, decides which bytes a peer may write over TCP into regions that
	// grant PermWrite, as AuthorizeRead does for READs (no tag: the peer's agent name and the
	// frame's ranges); a refused frame is dropped unwritten, the initiator's request fails with
	// ErrPermission, and the target counts it (Stats.WritesDenied, Stats.Refused.Permission).
	// SHM and UCX writes never reach it (the peer maps or registers the arena).
	AuthorizeWrite func(peer string, descs []Desc) error
	// OnComplete, if set, is called with the telemetry of every request when it completes or
	// fails. It runs on the engine's goroutines and must not block.
	OnComplete func(RequestTelemetry)
	// OnPeerLost, if set, is called when the control connection this agent dialed to a peer
	// ends (the peer's process exited, closed its agent, or the link broke), with the peer's
	// name and incarnation; not for a connection this agent had already closed or replaced
	// itself, nor for a peer already invalidated. The peer stays loaded; its owner decides
	// whether to forget it (InvalidateRemote and releasing its lists unmaps its arenas). It
	// runs on the connection's goroutine and must not block.
	OnPeerLost func(name string, incarnation uint64)
	// Logger receives connection-level events. Default: discard.
	Logger *slog.Logger
	// BootID overrides the host boot id used for same-host detection (tests simulate another
	// host with it). Default: /proc/sys/kernel/random/boot_id.
	BootID string
}

// Default configuration values.
const (
	defaultTCPStreams  = 4
	defaultStripeBytes = 1 << 20
	maxStripeBytes     = 64 << 20
	defaultInflight    = 64 << 20
	defaultTimeout     = 30 * time.Second
	defaultDialTimeout = 5 * time.Second
	defaultNotifQueue  = 1 << 16
	defaultMaxNotif    = 1 << 20
	maxRangesPerFrame  = 1024
	maxTagBytes        = 1024 // RequestOptions.Tag
)

// withDefaults returns c with defaults applied, or an error for invalid values.
func (c Config) withDefaults() (Config, error) {
	if c.ListenTCP == "" {
		c.ListenTCP = "127.0.0.1:0"
	}
	if c.Workers <= 0 {
		c.Workers = runtime.GOMAXPROCS(0)
	}
	if c.TCPStreams <= 0 {
		c.TCPStreams = defaultTCPStreams
	}
	if c.UCXWorkers <= 0 {
		c.UCXWorkers = defaultUCXWorkers()
	}
	if c.UCXWorkers > maxUCXWorkers {
		return c, newErr("config", "", ErrInvalidParam, fmt.Sprintf("UCXWorkers %d > %d", c.UCXWorkers, maxUCXWorkers), nil)
	}
	if c.TCPStreams > 64 {
		return c, newErr("config", "", ErrInvalidParam, fmt.Sprintf("TCPStreams %d > 64", c.TCPStreams), nil)
	}
	if c.StripeBytes <= 0 {
		c.StripeBytes = defaultStripeBytes
	}
	if c.StripeBytes > maxStripeBytes {
		return c, newErr("config", "", ErrInvalidParam, fmt.Sprintf("StripeBytes %d > %d", c.StripeBytes, maxStripeBytes), nil)
	}
	if c.MaxInflightBytes <= 0 {
		c.MaxInflightBytes = defaultInflight
	}
	if c.MaxInflightBytes < int64(c.StripeBytes) {
		c.StripeBytes = int(c.MaxInflightBytes)
	}
	if c.RequestTimeout <= 0 {
		c.RequestTimeout = defaultTimeout
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = defaultDialTimeout
	}
	if c.NotifQueue <= 0 {
		c.NotifQueue = defaultNotifQueue
	}
	if c.MaxNotifBytes <= 0 {
		c.MaxNotifBytes = defaultMaxNotif
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.BootID == "" {
		c.BootID = readBootID()
	}
	return c, nil
}

// readBootID returns the kernel boot id, or "" if unavailable (then no peer is same-host).
func readBootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// Locks. Every mutex of this package is taken in a small function that defers its unlock
// (a wrapper that locks, and the work in a …Locked function that never unlocks), and struct
// fields are grouped under the lock that guards them. No lock is held across a dial, a
// read from the network, a UCX open or a channel send that can block: a caller takes a
// snapshot or detaches state under the lock (peer.takeLink, peer.attach, Request.stopClock)
// and acts after the unlock. Two exceptions are deliberate: a connection's write lock
// (ctrlConn.wmu) is held across the write of one frame, which has a deadline, so that frames
// never interleave; and Post sends work to the copy workers under postMu's read lock
// (handOver), which the workers never take, so that Close (write lock) cannot close the
// queue under a sender. Where two locks nest: Agent.peersMu before peer.mu, peer.dialMu
// before peer.mu, Agent.regMu before the UCX engine's mapMu.

// Agent is one process's transfer endpoint: it owns registered regions, loaded peer metadata,
// connections, the SHM copy workers and the notification queue. All methods are safe for
// concurrent use.
type Agent struct {
	// Set by NewAgent; read-only after.
	name     string
	inc      uint64
	bootID   string
	cfg      Config
	backends []Backend // default preference order
	explicit bool      // cfg.Backends was set
	log      *slog.Logger

	ucx *ucxEngine // nil unless UCX is among the backends

	tcpLn    net.Listener
	tcpAddr  string
	unixLn   *net.UnixListener
	unixAddr string
	unixPath string // socket file to remove on Close ("" for abstract)

	regMu sync.Mutex
	// guarded by regMu (regions is also read without it: a copy-on-write table).
	regions    atomic.Pointer[regionTable]
	nextRegion uint32
	arenas     map[*Arena]*arenaExport
	arenaByID  map[uint32]*arenaExport
	nextArena  uint32

	peersMu sync.Mutex
	peers   map[string]*peer // guarded by peersMu

	connMu sync.Mutex
	// guarded by connMu (closed is set under postMu and read under connMu, so that no
	// connection or goroutine is tracked after Close took its snapshot).
	conns  map[net.Conn]struct{} // live connections (accepted and dialed), closed by Close
	inCtrl map[string]*ctrlConn  // latest inbound control connection per peer name

	postMu sync.RWMutex // Post hands work over under R (handOver); Close sets closed and closes work under W
	closed atomic.Bool
	work   chan shmWork

	notifMu sync.Mutex
	notifs  chan Notif // sent on under notifMu (a full queue drops its oldest message)

	reqSeq atomic.Uint64
	stats  agentStats

	ctx       context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
}

// NewAgent starts an agent named name (unique among the agents that talk to each other). It
// draws a random 64-bit incarnation, opens the listeners and starts the copy workers.
func NewAgent(name string, cfg Config) (*Agent, error) {
	if name == "" || len(name) > maxNameLen || strings.ContainsAny(name, "\x00\n") {
		return nil, newErr("agent", "", ErrInvalidParam, fmt.Sprintf("invalid agent name %q", name), nil)
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	a := &Agent{
		name:      name,
		inc:       newIncarnation(),
		bootID:    cfg.BootID,
		cfg:       cfg,
		log:       cfg.Logger.With("agent", name),
		arenas:    make(map[*Arena]*arenaExport),
		arenaByID: make(map[uint32]*arenaExport),
		peers:     make(map[string]*peer),
		conns:     make(map[net.Conn]struct{}),
		inCtrl:    make(map[string]*ctrlConn),
		work:      make(chan shmWork, 1<<14),
		notifs:    make(chan Notif, cfg.NotifQueue),
	}
	a.regions.Store(&regionTable{})
	a.backends = []Backend{BackendSHM, BackendTCP}
	if cfg.Backends != nil {
		bs, err := ParseBackends(cfg.Backends)
		if err != nil {
			return nil, err
		}
		if len(bs) == 0 {
			return nil, newErr("agent", "", ErrInvalidParam, "empty backend list", nil)
		}
		a.backends, a.explicit = bs, true
	}
	if a.enabled(BackendUCX) {
		if cfg.Auth != nil {
			return nil, newErr("agent", "", ErrNotSupported, "backend UCX cannot be combined with authentication: "+
				"UCX's transports do not authenticate peers, and any process that can reach a UCX worker can read and write "+
				"registered memory (see the package doc, Trust); leave UCX out of the backends or run without a shared secret", nil)
		}
		if a.ucx, err = newUCXEngine(a); err != nil {
			return nil, err
		}
	}
	a.ctx, a.cancel = context.WithCancel(context.Background())
	if err := a.listen(); err != nil {
		a.cancel()
		a.closeListeners()
		if a.ucx != nil {
			a.ucx.close()
		}
		return nil, err
	}
	for range cfg.Workers {
		a.wg.Add(1)
		go a.worker()
	}
	return a, nil
}

// newIncarnation returns a random non-zero 64-bit id.
func newIncarnation() uint64 {
	var b [8]byte
	for {
		_, _ = rand.Read(b[:])
		if v := binary.LittleEndian.Uint64(b[:]); v != 0 {
			return v
		}
	}
}

// enabled reports whether b is in the agent's backend list.
func (a *Agent) enabled(b Backend) bool {
	for _, x := range a.backends {
		if x == b {
			return true
		}
	}
	return false
}

// listen opens the TCP and Unix listeners and starts their accept loops.
func (a *Agent) listen() error {
	if a.cfg.ListenTCP != "none" && a.enabled(BackendTCP) {
		ln, err := net.Listen("tcp", a.cfg.ListenTCP)
		if err != nil {
			return newErr("listen", "", ErrBackend, "tcp "+a.cfg.ListenTCP, err)
		}
		a.tcpLn = ln
		a.tcpAddr = ln.Addr().String()
		if a.cfg.AdvertiseTCP != "" {
			a.tcpAddr = a.cfg.AdvertiseTCP
		}
	}
	if a.cfg.UnixSocket != "none" && a.enabled(BackendSHM) {
		addr := a.cfg.UnixSocket
		if addr == "" {
			n := a.name
			if len(n) > 64 {
				n = n[:64]
			}
			addr = fmt.Sprintf("@kvbridge-%s-%016x", n, a.inc)
		} else if !strings.HasPrefix(addr, "@") {
			a.unixPath = addr
		}
		ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: addr, Net: "unix"})
		if err != nil {
			return newErr("listen", "", ErrBackend, "unix "+addr, err)
		}
		ln.SetUnlinkOnClose(a.unixPath != "")
		a.unixLn = ln
		a.unixAddr = addr
	}
	if a.tcpLn != nil {
		a.wg.Add(1)
		go a.acceptLoop(a.tcpLn, false)
	}
	if a.unixLn != nil {
		a.wg.Add(1)
		go a.acceptLoop(a.unixLn, true)
	}
	return nil
}

// Name returns the agent name.
func (a *Agent) Name() string { return a.name }

// Incarnation returns the random id drawn when the agent started.
func (a *Agent) Incarnation() uint64 { return a.inc }

// Addrs returns the listen addresses: the TCP address ("" if disabled) and the Unix socket
// address ("" if SHM is disabled; "@…" is an abstract socket).
func (a *Agent) Addrs() (tcp, unix string) { return a.tcpAddr, a.unixAddr }

// Close cancels every request in flight (ErrClosed), closes all connections and listeners,
// stops the workers, unmaps peers' arenas and waits until every goroutine the agent started
// has exited. The notification channel is closed last. Local arenas are not unmapped (the
// caller owns them). Close is idempotent and always returns nil.
func (a *Agent) Close() error {
	a.closeOnce.Do(func() {
		a.underPostLock(func() { a.closed.Store(true) })
		a.cancel()
		a.closeListeners()

		peers := a.takePeers()
		var failed []*Request
		for _, p := range peers {
			failed = append(failed, p.retire(ErrClosed, "agent closed")...)
		}

		a.closeConns()

		if a.ucx != nil {
			// Stops the UCX workers once they have closed every endpoint and resolved the
			// operations in flight (canceled).
			a.ucx.close()
		}
		a.underPostLock(func() { close(a.work) })
		a.wg.Wait()
		// A goroutine in Request.Wait may still be copying a chunk from a peer's mapping;
		// the failed requests complete as soon as their chunks in progress are done.
		for _, r := range failed {
			<-r.Done()
		}
		for _, p := range peers {
			p.unmapAll()
		}
		close(a.notifs)
	})
	return nil
}

// underPostLock runs fn under postMu's write lock: no post is handing work over meanwhile.
func (a *Agent) underPostLock(fn func()) {
	a.postMu.Lock()
	defer a.postMu.Unlock()
	fn()
}

// takePeers removes and returns every loaded peer.
func (a *Agent) takePeers() []*peer {
	a.peersMu.Lock()
	defer a.peersMu.Unlock()
	peers := make([]*peer, 0, len(a.peers))
	for _, p := range a.peers {
		peers = append(peers, p)
	}
	a.peers = map[string]*peer{}
	return peers
}

// closeConns closes every tracked connection (a close does not block).
func (a *Agent) closeConns() {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	for c := range a.conns {
		c.Close()
	}
}

// handOver runs fn, which hands a post's units to the SHM copy workers or the UCX workers,
// under postMu's read lock unless the agent is closed, and reports whether it ran. Close
// takes the write lock before it closes the work queue and stops the workers, so work handed
// over is never lost. fn may block on a full work queue while holding the read lock: the
// workers that drain the queue never take postMu, and Close waits for it.
func (a *Agent) handOver(fn func()) bool {
	a.postMu.RLock()
	defer a.postMu.RUnlock()
	if a.closed.Load() {
		return false
	}
	fn()
	return true
}

// closeListeners closes the listeners (idempotent).
func (a *Agent) closeListeners() {
	if a.tcpLn != nil {
		a.tcpLn.Close()
	}
	if a.unixLn != nil {
		a.unixLn.Close()
	}
}

// acceptLoop accepts connections until the listener closes.
func (a *Agent) acceptLoop(ln net.Listener, isUnix bool) {
	defer a.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			if a.closed.Load() {
				return
			}
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			a.log.Warn("accept failed", "err", err)
			return
		}
		if !a.trackAccepted(c) {
			c.Close()
			return
		}
		go func() {
			defer a.wg.Done()
			a.serveConn(c, isUnix)
			c.Close()
			a.untrack(c)
		}()
	}
}

// trackAccepted registers an accepted connection so Close can reach it, and counts the
// goroutine that will serve it in a.wg; it returns false if the agent is closing.
func (a *Agent) trackAccepted(c net.Conn) bool {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	if a.closed.Load() {
		return false
	}
	a.conns[c] = struct{}{}
	a.wg.Add(1)
	return true
}

// trackOutbound registers a dialed connection so Close can reach it; it returns false (and
// closes c) if the agent is closing.
func (a *Agent) trackOutbound(c net.Conn) bool {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	if a.closed.Load() {
		c.Close()
		return false
	}
	a.conns[c] = struct{}{}
	return true
}

// untrack removes a connection registered with trackOutbound or acceptLoop.
func (a *Agent) untrack(c net.Conn) {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	delete(a.conns, c)
}

// goTracked starts fn on a goroutine owned by the agent, unless the agent is closing.
func (a *Agent) goTracked(fn func()) bool {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	if a.closed.Load() {
		return false
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		fn()
	}()
	return true
}
