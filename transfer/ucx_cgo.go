//go:build ucx && cgo

package transfer

/*
#cgo LDFLAGS: -lucp -luct -lucs
#include <stdlib.h>
#include "ucx_shim.h"
*/
import "C"

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ucxBuilt reports whether this binary has the UCX backend.
const ucxBuilt = true

// ucxProgressTick is how often a worker with operations in flight progresses even without
// events, so that UCX's timers (keep-alive among them) run.
const ucxProgressTick = 250 * time.Millisecond

// ucxCloseGrace bounds how long closing a healthy link waits for its operations in flight.
const ucxCloseGrace = time.Second

// ucxBusyRetries is how many times in a row a worker re-progresses when UCX reports work it
// cannot progress before it backs off for ucxBackoff.
const (
	ucxBusyRetries = 16
	ucxBackoff     = 100 * time.Microsecond
	ucxBackoffMax  = 5 * time.Millisecond
)

// maxUCXInbound bounds the peers remembered for answering over UCX (see ucxInbound).
const maxUCXInbound = 4096

// ucxEngine is an agent's UCX state: the context, the workers and their goroutines, the
// arenas registered with UCX, and the routes back to peers that connected to this agent.
//
// One more worker, the answer worker, is not published: started on first use, it only opens
// the answer routes to peers that connected to this agent (see sendInbound), and nobody opens
// an endpoint to it. UCX 1.13 pairs the endpoints two workers create towards each other: a
// worker's k-th ucp_ep_create to a remote worker is joined to the endpoint the remote worker
// created k-th towards it, if there is one (ucp_ep_create_api_to_worker_addr takes it from
// the "unexpected" queue of its connection matching, by sequence number), whether or not that
// endpoint is still open on the remote side: UCX does not tell the other side when an
// endpoint to a worker address is closed. An answer route opened from a link worker would be
// joined to an endpoint of one of the peer's links, perhaps one it closed long ago (a timeout
// tears links down), and its hello would go nowhere (TestUCXStalledPeerNotif). The answer
// worker has no such endpoints waiting, so its routes are always connections of their own.
type ucxEngine struct {
	a       *Agent
	ctx     C.ucp_context_h
	workers []*ucxWorker // the link workers, published in the metadata
	addrs   [][]byte     // their addresses
	nextID  atomic.Uint64

	ansMu sync.Mutex
	// guarded by ansMu
	answer  *ucxWorker // the answer worker, nil until first used
	stopped bool       // no answer worker may start any more

	mapMu sync.Mutex
	// guarded by mapMu
	maps   map[*ucxMapping]struct{}
	closed bool

	inMu    sync.Mutex
	inbound map[string]*ucxInbound // guarded by inMu

	closeOnce sync.Once
}

// ucxInbound is a peer that connected to this agent over UCX and said hello with its worker
// address, so that SendNotif can answer it without having loaded its metadata (as over an
// inbound TCP or Unix control connection).
type ucxInbound struct {
	inc  uint64
	addr []byte
	link *ucxLink // connected on first use
}

// newUCXEngine creates the UCX context (the environment's UCX_* variables, kvbridge's defaults
// and Config.UCX) and starts the workers.
func newUCXEngine(a *Agent) (*ucxEngine, error) {
	var maj, minr, rel C.uint
	C.kvb_version(&maj, &minr, &rel)
	if maj < C.KVB_MIN_MAJOR || (maj == C.KVB_MIN_MAJOR && minr < C.KVB_MIN_MINOR) {
		return nil, newErr("agent", "", ErrNotSupported, fmt.Sprintf("the loaded UCX library is %d.%d.%d; the UCX backend needs %s or newer", maj, minr, rel, ucxMinVersion), nil)
	}
	settings, err := ucxSettings(a.cfg.UCX, os.Getenv)
	if err != nil {
		return nil, err
	}
	kv := make([]C.kvb_kv, len(settings))
	for i, s := range settings {
		kv[i].key, kv[i].val = C.CString(s[0]), C.CString(s[1])
	}
	defer func() {
		for _, x := range kv {
			C.free(unsafe.Pointer(x.key))
			C.free(unsafe.Pointer(x.val))
		}
	}()
	var kvp *C.kvb_kv
	if len(kv) > 0 {
		kvp = &kv[0]
	}
	var errbuf [512]C.char
	e := &ucxEngine{a: a, maps: map[*ucxMapping]struct{}{}, inbound: map[string]*ucxInbound{}}
	if st := C.kvb_context_create(kvp, C.int(len(kv)), &e.ctx, &errbuf[0], C.size_t(len(errbuf))); st != C.UCS_OK {
		return nil, newErr("agent", "", ErrBackend, "UCX: "+C.GoString(&errbuf[0]), nil)
	}
	for i := range a.cfg.UCXWorkers {
		w := &ucxWorker{e: e, idx: i, links: map[uint64]*ucxLink{}, done: make(chan struct{})}
		ready := make(chan error, 1)
		go w.run(ready)
		if err := <-ready; err != nil {
			<-w.done
			e.close()
			return nil, err
		}
		e.workers = append(e.workers, w)
		e.addrs = append(e.addrs, w.addr)
	}
	return e, nil
}

// workerAddrs returns the packed worker addresses published in the metadata.
func (e *ucxEngine) workerAddrs() [][]byte { return e.addrs }

// numWorkers returns the number of link workers, the workers that requests are spread over.
func (e *ucxEngine) numWorkers() int { return len(e.workers) }

// answerWorker returns the answer worker (see ucxEngine), starting it on first use. Its index
// follows the link workers'.
func (e *ucxEngine) answerWorker() (*ucxWorker, error) {
	e.ansMu.Lock()
	defer e.ansMu.Unlock()
	if e.stopped {
		return nil, newErr("notify", "", ErrClosed, "agent closed", nil)
	}
	if e.answer != nil {
		return e.answer, nil
	}
	w := &ucxWorker{e: e, idx: len(e.workers), links: map[uint64]*ucxLink{}, done: make(chan struct{})}
	ready := make(chan error, 1)
	go w.run(ready)
	if err := <-ready; err != nil {
		<-w.done
		return nil, err
	}
	e.answer = w
	return w, nil
}

// stopAnswer makes answerWorker fail from now on and returns the answer worker, if it started.
func (e *ucxEngine) stopAnswer() *ucxWorker {
	e.ansMu.Lock()
	defer e.ansMu.Unlock()
	e.stopped = true
	return e.answer
}

// close stops the workers, all at once (each closes every endpoint: flushed for at most
// ucxCloseGrace, then forcibly, canceling what is still in flight), unregisters the arenas and
// releases the context. Idempotent.
func (e *ucxEngine) close() {
	e.closeOnce.Do(func() {
		e.closeInbound()
		workers := e.workers
		if w := e.stopAnswer(); w != nil {
			workers = append(workers[:len(workers):len(workers)], w)
		}
		for _, w := range workers {
			w.beginStop()
		}
		for _, w := range workers {
			w.stop()
		}
		e.unmapAll()
		C.kvb_context_destroy(e.ctx)
	})
}

// closeInbound closes and forgets the links to the peers that said hello.
func (e *ucxEngine) closeInbound() {
	e.inMu.Lock()
	defer e.inMu.Unlock()
	for _, in := range e.inbound {
		if in.link != nil {
			in.link.close()
		}
	}
	e.inbound = map[string]*ucxInbound{}
}

// unmapAll unregisters every arena and refuses later registrations.
func (e *ucxEngine) unmapAll() {
	e.mapMu.Lock()
	defer e.mapMu.Unlock()
	e.closed = true
	for m := range e.maps {
		C.kvb_mem_unmap(e.ctx, C.ucp_mem_h(m.memh))
	}
	e.maps = nil
}

// mapArena registers an arena with UCX and packs its remote key.
func (e *ucxEngine) mapArena(ar *Arena) (*ucxMapping, error) {
	mem := ar.Bytes()
	base := unsafe.Pointer(unsafe.SliceData(mem)) // mmap'd memory, not the Go heap
	e.mapMu.Lock()
	defer e.mapMu.Unlock()
	if e.closed {
		return nil, newErr("register", "", ErrClosed, "agent closed", nil)
	}
	var memh C.ucp_mem_h
	var rk unsafe.Pointer
	var rklen C.size_t
	if st := C.kvb_mem_map(e.ctx, base, C.size_t(len(mem)), &memh, &rk, &rklen); st != C.UCS_OK {
		return nil, ucsErr("register", st, fmt.Sprintf("ucp_mem_map of arena %q", ar.Name()))
	}
	m := &ucxMapping{base: uint64(uintptr(base)), rkey: C.GoBytes(rk, C.int(rklen)), memh: unsafe.Pointer(memh)}
	C.kvb_rkey_buffer_release(rk)
	e.maps[m] = struct{}{}
	return m, nil
}

// unmapArena undoes mapArena.
func (e *ucxEngine) unmapArena(m *ucxMapping) {
	e.mapMu.Lock()
	defer e.mapMu.Unlock()
	if _, ok := e.maps[m]; !ok {
		return // the engine is closed: already unmapped
	}
	delete(e.maps, m)
	C.kvb_mem_unmap(e.ctx, C.ucp_mem_h(m.memh))
}

// newLink returns a link to agent name (p nil: an answer route to an inbound peer) with
// endpoints on the workers ws; notifications leave on ws[0].
func (e *ucxEngine) newLink(name string, p *peer, ws []*ucxWorker) *ucxLink {
	return &ucxLink{e: e, id: e.nextID.Add(1), peer: name, p: p, ws: ws, eps: make([]*ucxEP, len(e.workers)+1), acked: make(chan struct{}, len(ws))}
}

// connect opens an endpoint on every worker to the peer's workers and waits until UCX has
// wired them up (a flush of each completes), bounded by ctx and Config.DialTimeout. A dead or
// unreachable peer is ErrRemoteDisconnect.
func (e *ucxEngine) connect(ctx context.Context, p *peer) (*ucxLink, error) {
	m := p.meta.Load()
	l := e.newLink(p.name, p, e.workers)
	if err := e.open(ctx, l, func(i int) []byte { return m.UCXWorkers[i%len(m.UCXWorkers)] }); err != nil {
		return nil, err
	}
	return l, nil
}

// open opens the endpoints of l on its workers (worker i to addr(i)), then says hello on
// each — on the worker that carries its notifications first, before any notification — and
// waits for the peer's acknowledgements: the hello tells the peer how to answer, and an
// acknowledgement, sent after the peer's own wire-up messages on that endpoint, means none of
// them is still pending there (UCX 1.13 aborts a process whose endpoint fails with one
// pending, as when this agent closes the link abruptly).
func (e *ucxEngine) open(ctx context.Context, l *ucxLink, addr func(int) []byte) error {
	n := len(l.ws)
	results := make(chan error, n)
	for _, w := range l.ws {
		a := addr(w.idx)
		if !w.submit(func() { w.openEP(l, a, func(err error) { results <- err }) }) {
			results <- newErr("connect", l.peer, ErrClosed, "agent closed", nil)
		}
	}
	d := e.a.cfg.DialTimeout
	if dl, ok := ctx.Deadline(); ok {
		d = min(d, time.Until(dl))
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	var first error
	for range n {
		select {
		case err := <-results:
			if err != nil && first == nil {
				first = err
			}
		case <-ctx.Done():
			l.close()
			return newErr("connect", l.peer, ErrCanceled, "UCX connection", ctx.Err())
		case <-timer.C:
			l.close()
			return newErr("connect", l.peer, ErrRemoteDisconnect, fmt.Sprintf("UCX wire-up did not complete within %v", d), nil)
		}
	}
	if first != nil {
		l.close()
		return first
	}
	sent := make(chan error, n)
	for _, w := range l.ws {
		if !w.submit(func() { w.sendAM(l, C.KVB_AM_HELLO, e.addrs[0], func(err error) { sent <- err }) }) {
			sent <- newErr("connect", l.peer, ErrClosed, "agent closed", nil)
		}
	}
	for acked := 0; acked < n; {
		select {
		case err := <-sent:
			if err != nil {
				l.close()
				return err
			}
		case <-l.acked:
			acked++
		case <-ctx.Done():
			l.close()
			return newErr("connect", l.peer, ErrCanceled, "UCX connection", ctx.Err())
		case <-timer.C:
			l.close()
			return newErr("connect", l.peer, ErrRemoteDisconnect, fmt.Sprintf("the peer did not acknowledge the UCX hello within %v", d), nil)
		}
	}
	return nil
}

// dispatch hands the units of post gen of r to their workers.
func (e *ucxEngine) dispatch(l *ucxLink, r *Request, gen uint64) {
	for i := range r.ucx.units {
		u := &r.ucx.units[i]
		w := e.workers[u.worker]
		if !w.submit(func() { w.runUnit(u, gen, l) }) && u.start(gen) {
			u.resolve(gen, newErr(r.op.String(), l.peer, ErrClosed, "agent closed", nil))
		}
	}
}

// hello records an inbound peer's answer route.
func (e *ucxEngine) hello(name string, inc uint64, addr []byte) {
	e.inMu.Lock()
	defer e.inMu.Unlock()
	if old := e.inbound[name]; old != nil {
		if old.inc == inc && bytes.Equal(old.addr, addr) {
			return
		}
		if old.link != nil {
			old.link.close()
		}
	} else if len(e.inbound) >= maxUCXInbound {
		for k, in := range e.inbound { // forget an arbitrary one
			if in.link != nil {
				in.link.close()
			}
			delete(e.inbound, k)
			break
		}
	}
	e.inbound[name] = &ucxInbound{inc: inc, addr: bytes.Clone(addr)}
}

// sendInbound sends msg to a peer that said hello over UCX (false if none did).
func (e *ucxEngine) sendInbound(ctx context.Context, name string, msg []byte, deadline time.Time) (bool, error) {
	in, l := e.inboundLink(name)
	if in == nil {
		return false, nil
	}
	if l == nil {
		// Opening the link waits for UCX: no lock is held. The link leaves from the answer
		// worker, so that UCX makes it a connection of its own (see ucxEngine).
		aw, err := e.answerWorker()
		if err != nil {
			return true, err
		}
		nl := e.newLink(name, nil, []*ucxWorker{aw})
		if err := e.open(ctx, nl, func(int) []byte { return in.addr }); err != nil {
			return true, err
		}
		if l, err = e.installInbound(name, in, nl); err != nil {
			return true, err
		}
	}
	return true, l.send(msg, deadline)
}

// inboundLink returns the hello of the peer named name (nil if none) and its open link (nil
// if none).
func (e *ucxEngine) inboundLink(name string) (*ucxInbound, *ucxLink) {
	e.inMu.Lock()
	defer e.inMu.Unlock()
	in := e.inbound[name]
	if in != nil && in.link != nil && !in.link.closed.Load() {
		return in, in.link
	}
	return in, nil
}

// installInbound makes nl the link to the peer that said hello in, unless another link was
// opened meanwhile (then nl is closed and that one returned) or the peer restarted.
func (e *ucxEngine) installInbound(name string, in *ucxInbound, nl *ucxLink) (*ucxLink, error) {
	e.inMu.Lock()
	defer e.inMu.Unlock()
	switch cur := e.inbound[name]; {
	case cur != in:
		nl.close()
		return nil, newErr("notify", name, ErrStaleIncarnation, "the peer restarted", nil)
	case in.link != nil && !in.link.closed.Load():
		nl.close()
		return in.link, nil
	}
	in.link = nl
	return nl, nil
}

// dropInbound forgets the answer route over l.
func (e *ucxEngine) dropInbound(l *ucxLink) {
	e.inMu.Lock()
	defer e.inMu.Unlock()
	if in := e.inbound[l.peer]; in != nil && in.link == l {
		in.link = nil
	}
}

// ucxLink is a connection to one peer incarnation: one endpoint per worker.
type ucxLink struct {
	e      *ucxEngine
	id     uint64
	peer   string
	p      *peer         // nil for an answer route to an inbound peer
	ws     []*ucxWorker  // the link workers, or the answer worker; notifications leave on ws[0]
	eps    []*ucxEP      // eps[i] is touched only by the goroutine of the worker of index i
	seq    uint64        // notifications sent (ws[0]'s goroutine only)
	lanes  []string      // ws[0]'s endpoint's lanes, set before the link is in use
	acked  chan struct{} // one value per endpoint whose hello the peer acknowledged
	closed atomic.Bool
	// aborted: the link failed or a request was abandoned in flight: close its endpoints at
	// once, canceling what is in flight. Otherwise closing lets what is in flight finish first
	// (bounded by ucxCloseGrace), so that the peer never sees its endpoint fail under an
	// emulated put or get (UCX 1.13 aborts the process on some of those paths).
	aborted atomic.Bool
}

// transports returns the UCX lanes of the link (transport/device: use).
func (l *ucxLink) transports() []string { return l.lanes }

// ucxEP is one endpoint of a link.
type ucxEP struct {
	ep       *C.kvb_ep
	rkeys    map[uint32]C.ucp_rkey_h // peer arena id → remote key unpacked on this endpoint
	open     bool
	flushing bool // closing: flushed before it is closed
	acked    bool // the peer acknowledged the hello
}

// close closes every endpoint of the link. Unless the link was aborted, an endpoint is flushed
// first (the operations in flight complete) and closed forcibly when the flush completes or
// ucxCloseGrace passed (see closeEP); an aborted link's endpoints close at once, canceling
// what is in flight. Calling it again does nothing, except after an abort, when endpoints
// still being flushed are closed at once.
func (l *ucxLink) close() {
	if !l.closed.CompareAndSwap(false, true) && !l.aborted.Load() {
		return
	}
	// Again after an abort: endpoints still being flushed are closed at once.
	for _, w := range l.ws {
		w.submit(func() { w.closeEP(l) })
	}
}

// abort tears the link down after a failure: the peer's UCX requests in flight fail
// (ErrRemoteDisconnect), the endpoints close at once, canceling what is in flight, and the
// next UCX post reconnects.
func (l *ucxLink) abort(why string) {
	l.aborted.Store(true)
	l.drain(why)
}

// drain tears the link down like abort, but lets the operations in flight finish before the
// endpoints close (bounded by ucxCloseGrace): the peer then never has its endpoint fail under
// an emulated put, which UCX 1.13 answers by aborting the peer's process.
func (l *ucxLink) drain(why string) {
	if l.p != nil {
		l.p.teardownUCX(l, why)
		return
	}
	l.e.dropInbound(l)
	l.close()
}

// send sends a notification and waits until UCX has taken it (or the deadline passed, which
// tears the link down).
func (l *ucxLink) send(msg []byte, deadline time.Time) error {
	ch := make(chan error, 1)
	l.sendAsync(msg, deadline, func(err error) { ch <- err })
	return <-ch
}

// sendAsync sends a notification on the link's first worker and calls done once it completed
// or failed. A send still pending at the deadline tears the link down.
func (l *ucxLink) sendAsync(msg []byte, deadline time.Time, done func(error)) {
	msg = bytes.Clone(msg)
	var once sync.Once
	var timer *time.Timer
	var tmu sync.Mutex
	stopTimer := func() {
		tmu.Lock()
		defer tmu.Unlock()
		if timer != nil {
			timer.Stop()
		}
	}
	fin := func(err error) {
		once.Do(func() {
			stopTimer()
			done(err)
		})
	}
	func() {
		tmu.Lock()
		defer tmu.Unlock()
		timer = time.AfterFunc(time.Until(deadline), func() { l.abort("notification not sent before its deadline") })
	}()
	w := l.ws[0]
	if !w.submit(func() { w.sendAM(l, C.KVB_AM_MSG, msg, fin) }) {
		fin(newErr("notify", l.peer, ErrClosed, "agent closed", nil))
	}
}

// ucxPending is a UCX request the worker polls.
type ucxPending struct {
	req  unsafe.Pointer
	buf  unsafe.Pointer // malloc'd message buffer freed on completion, or nil
	done func(C.ucs_status_t)
}

// ucxWorker is one UCX worker and the goroutine that owns it.
type ucxWorker struct {
	e    *ucxEngine
	idx  int
	kw   *C.kvb_worker
	addr []byte
	wake int // eventfd: commands are waiting
	epfd int // epoll set of the worker's event fd and wake
	poll *os.File
	rc   syscall.RawConn
	done chan struct{}

	mu sync.Mutex
	// guarded by mu
	cmds     []func()
	signaled bool
	stopped  bool

	// Owned by the worker goroutine.
	pend     []ucxPending
	links    map[uint64]*ucxLink
	stopping bool
	rkbuf    []C.ucp_rkey_h
	events   [4]unix.EpollEvent
	idleBusy int           // arm said busy this many times in a row with nothing progressed
	pause    time.Duration // the last backoff's
	errbuf   [64]C.kvb_errev
}

// run is the worker goroutine: it creates the worker on its own, locked thread, reports
// readiness, then serves until stopped and destroys the worker. The thread is never unlocked:
// it exits with the goroutine, taking any thread-local UCX state with it.
func (w *ucxWorker) run(ready chan<- error) {
	runtime.LockOSThread()
	defer close(w.done)
	var efd C.int
	var addr unsafe.Pointer
	var alen C.size_t
	if st := C.kvb_worker_create(w.e.ctx, &w.kw, &efd, &addr, &alen); st != C.UCS_OK {
		ready <- ucsErr("agent", st, "creating a UCX worker")
		return
	}
	w.addr = C.GoBytes(addr, C.int(alen))
	C.kvb_address_release(w.kw, addr)
	defer C.kvb_worker_destroy(w.kw)
	var err error
	if w.wake, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		ready <- newErr("agent", "", ErrBackend, "eventfd", err)
		return
	}
	defer unix.Close(w.wake)
	// The worker's event fd and the command eventfd go into an epoll set of our own, which
	// waits in Go's network poller: a worker with nothing to do parks its goroutine and holds
	// neither a thread in a system call nor a P.
	if w.epfd, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		ready <- newErr("agent", "", ErrBackend, "epoll_create", err)
		return
	}
	for _, fd := range []int{int(efd), w.wake} {
		if err := unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			unix.Close(w.epfd)
			ready <- newErr("agent", "", ErrBackend, "epoll_ctl", err)
			return
		}
	}
	if err := unix.SetNonblock(w.epfd, true); err != nil {
		unix.Close(w.epfd)
		ready <- newErr("agent", "", ErrBackend, "epoll set", err)
		return
	}
	w.poll = os.NewFile(uintptr(w.epfd), "ucx-worker")
	defer w.poll.Close()
	if w.rc, err = w.poll.SyscallConn(); err != nil {
		ready <- newErr("agent", "", ErrBackend, "epoll set", err)
		return
	}
	ready <- nil
	w.loop()
}

// loop runs commands and progresses the worker; when there is nothing to do it arms the
// worker and sleeps until UCX or a command needs it. Stopping, it drains what is in flight
// (bounded) before returning: endpoints still open after ucxCloseGrace are closed forcibly.
func (w *ucxWorker) loop() {
	var stopDeadline, graceEnd time.Time
	forced := false
	for {
		w.runCommands()
		busy := false
		for range 256 {
			if C.kvb_progress(w.kw) == 0 {
				break
			}
			busy = true
		}
		w.harvest()
		if w.stopping {
			now := time.Now()
			if stopDeadline.IsZero() {
				stopDeadline, graceEnd = now.Add(5*time.Second), now.Add(ucxCloseGrace)
			}
			if !forced && now.After(graceEnd) {
				forced = true
				w.forceCloseAll()
				continue // progress the closes
			}
			if (len(w.pend) == 0 && !w.hasCommands()) || now.After(stopDeadline) {
				if len(w.pend) > 0 {
					w.e.a.log.Warn("UCX worker stopped with operations still pending", "worker", w.idx, "pending", len(w.pend))
				}
				return
			}
		}
		if busy || w.hasCommands() {
			w.idleBusy, w.pause = 0, 0
			continue
		}
		var timeout time.Duration
		switch {
		case w.stopping:
			timeout = 10 * time.Millisecond
		case len(w.pend) > 0:
			// UCX runs its timers (keep-alive among them) only inside worker progress:
			// while operations are in flight, progress at least this often.
			timeout = ucxProgressTick
		}
		switch st := C.kvb_arm(w.kw); st {
		case C.UCS_OK:
			w.idleBusy, w.pause = 0, 0
		case C.UCS_ERR_BUSY:
			w.idleBusy++
			if w.idleBusy >= ucxBusyRetries {
				w.backoff()
			}
			continue
		default:
			timeout = time.Millisecond // cannot arm: poll gently rather than spin
		}
		w.wait(timeout)
	}
}

// backoff parks the worker briefly while UCX reports work it cannot progress, longer each time
// in a row (up to ucxBackoffMax): the shared-memory transports report busy while a peer's
// queue is full — for good if the peer died — and on a host with few cores spinning would
// starve that very peer.
func (w *ucxWorker) backoff() {
	w.pause = min(max(2*w.pause, ucxBackoff), ucxBackoffMax)
	w.wait(w.pause)
	w.idleBusy = 0
}

// wait parks the worker goroutine until its epoll set has an event (or timeout, if not zero,
// passed) and consumes the command eventfd's count.
func (w *ucxWorker) wait(timeout time.Duration) {
	if timeout > 0 {
		_ = w.poll.SetReadDeadline(time.Now().Add(timeout))
	} else {
		_ = w.poll.SetReadDeadline(time.Time{})
	}
	_ = w.rc.Read(func(uintptr) bool {
		n, err := unix.EpollWait(w.epfd, w.events[:], 0)
		if err != nil || n <= 0 {
			return false // not ready: park until the epoll set is readable
		}
		for i := range n {
			if int(w.events[i].Fd) == w.wake {
				var b [8]byte
				_, _ = unix.Read(w.wake, b[:])
			}
		}
		return true
	})
}

// submit queues fn for the worker goroutine; false once the worker is stopped.
func (w *ucxWorker) submit(fn func()) bool {
	wake, ok := w.queue(fn)
	if !ok {
		return false
	}
	if wake {
		var one = [8]byte{1}
		_, _ = unix.Write(w.wake, one[:])
	}
	return true
}

// queue appends fn to the commands unless the worker is stopped (ok false); wake reports
// whether the worker needs a wake-up (written by the caller, outside w.mu).
func (w *ucxWorker) queue(fn func()) (wake, ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		return false, false
	}
	w.cmds = append(w.cmds, fn)
	wake = !w.signaled
	w.signaled = true
	return wake, true
}

// hasCommands reports whether commands are waiting.
func (w *ucxWorker) hasCommands() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.cmds) > 0
}

// runCommands runs the queued commands in order.
func (w *ucxWorker) runCommands() {
	cmds := w.takeCommands()
	for i, fn := range cmds {
		fn()
		cmds[i] = nil
	}
}

// takeCommands takes the queued commands.
func (w *ucxWorker) takeCommands() []func() {
	w.mu.Lock()
	defer w.mu.Unlock()
	cmds := w.cmds
	w.cmds = nil
	w.signaled = false
	return cmds
}

// stop makes the worker close every endpoint, drain and exit (beginStop), and waits for it.
func (w *ucxWorker) stop() {
	w.beginStop()
	<-w.done
}

// beginStop makes the worker close every endpoint, drain and exit, without waiting. No
// command is accepted afterwards. Endpoints are flushed for at most ucxCloseGrace and then
// closed forcibly by the stopping loop itself (closeEP's timer cannot submit to a stopped
// worker), so a stalled or dead peer never leaves an endpoint open when the worker is
// destroyed.
func (w *ucxWorker) beginStop() {
	if w.isStopped() {
		return
	}
	w.submit(func() {
		w.stopping = true
		for _, l := range w.links {
			l.closed.Store(true)
			w.closeEP(l)
		}
	})
	w.setStopped()
}

// isStopped reports whether the worker takes no more commands.
func (w *ucxWorker) isStopped() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stopped
}

// setStopped makes the worker take no more commands.
func (w *ucxWorker) setStopped() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
}

// forceCloseAll closes every endpoint of the worker still open, canceling what is in flight.
func (w *ucxWorker) forceCloseAll() {
	for _, l := range w.links {
		if ue := l.eps[w.idx]; ue != nil {
			w.forceClose(l, ue)
		}
	}
}

// harvest handles what the last progress produced: endpoint errors, received messages and
// completed requests.
func (w *ucxWorker) harvest() {
	for {
		var lost C.uint32_t
		n := int(C.kvb_errs_take(w.kw, &w.errbuf[0], C.uint32_t(len(w.errbuf)), &lost))
		for _, ev := range w.errbuf[:n] {
			if l := w.links[uint64(ev.link)]; l != nil {
				l.abort("UCX endpoint error: " + statusString(C.ucs_status_t(ev.status)))
			}
		}
		if lost > 0 {
			for _, l := range w.links {
				l.abort("UCX endpoint errors overflowed")
			}
		}
		if n < len(w.errbuf) {
			break
		}
	}
	for {
		m := C.kvb_msg_pop(w.kw)
		if m == nil {
			break
		}
		w.receive(m)
		C.kvb_msg_free(m)
	}
	if len(w.pend) == 0 {
		return
	}
	pend := w.pend
	w.pend = nil
	for i, pd := range pend {
		st := C.kvb_request_status(pd.req)
		if st == C.UCS_INPROGRESS {
			w.pend = append(w.pend, pd)
			continue
		}
		C.kvb_request_free(pd.req)
		if pd.buf != nil {
			C.free(pd.buf)
		}
		pend[i] = ucxPending{}
		pd.done(st)
	}
}

// watch polls req (a request, NULL or an error pointer) and calls done with its status.
func (w *ucxWorker) watch(req unsafe.Pointer, buf unsafe.Pointer, done func(C.ucs_status_t)) {
	switch {
	case req == nil:
		done(C.UCS_OK)
	case C.kvb_is_err(req) != 0:
		done(C.kvb_ptr_status(req))
	default:
		w.pend = append(w.pend, ucxPending{req: req, buf: buf, done: done})
	}
}

// receive handles one received active message: a hello records an answer route, a
// notification is delivered.
func (w *ucxWorker) receive(m *C.kvb_msg) {
	a := w.e.a
	var hdr C.kvb_am_hdr
	base := unsafe.Pointer(C.kvb_msg_data(m))
	if m.status != C.UCS_OK || uintptr(m.hlen) != unsafe.Sizeof(hdr) {
		a.refuse(ErrProtocol)
		return
	}
	hdr = *(*C.kvb_am_hdr)(base)
	if hdr.kind == C.KVB_AM_HELLO_ACK {
		if l := w.links[uint64(hdr.seq)]; l != nil && m.dlen == 0 {
			if ue := l.eps[w.idx]; ue != nil && !ue.acked {
				ue.acked = true
				l.acked <- struct{}{} // room for one per endpoint
			}
		}
		return
	}
	data := unsafe.Slice((*byte)(unsafe.Add(base, uintptr(m.hlen))), int(m.dlen))
	nl := int(hdr.namelen)
	if nl == 0 || nl > maxNameLen || nl > len(data) || hdr.inc == 0 {
		a.refuse(ErrProtocol)
		return
	}
	name, payload := string(data[:nl]), data[nl:]
	switch hdr.kind {
	case C.KVB_AM_HELLO:
		if len(payload) == 0 || len(payload) > maxUCXBlob {
			a.refuse(ErrProtocol)
			return
		}
		w.e.hello(name, uint64(hdr.inc), payload)
	case C.KVB_AM_MSG:
		if len(payload) > a.cfg.MaxNotifBytes {
			a.refuse(ErrProtocol)
			return
		}
		a.deliver(Notif{Peer: name, Incarnation: uint64(hdr.inc), Seq: uint64(hdr.seq), Msg: bytes.Clone(payload)})
	default:
		a.refuse(ErrProtocol)
	}
}

// openEP creates the worker's endpoint of l to addr and flushes it, which completes once UCX
// has wired the endpoint up (or failed to).
func (w *ucxWorker) openEP(l *ucxLink, addr []byte, done func(error)) {
	if l.closed.Load() || w.stopping {
		done(newErr("connect", l.peer, ErrCanceled, "link closed", nil))
		return
	}
	var ep *C.kvb_ep
	if st := C.kvb_ep_create(w.kw, unsafe.Pointer(unsafe.SliceData(addr)), C.uint64_t(l.id), &ep); st != C.UCS_OK {
		done(ucsErr("connect", st, "creating a UCX endpoint").withPeer(l.peer))
		return
	}
	l.eps[w.idx] = &ucxEP{ep: ep, rkeys: map[uint32]C.ucp_rkey_h{}, open: true}
	w.links[l.id] = l
	w.watch(C.kvb_flush(ep), nil, func(st C.ucs_status_t) {
		if st != C.UCS_OK {
			done(ucsErr("connect", st, "UCX wire-up").withPeer(l.peer))
			return
		}
		if w == l.ws[0] {
			if info := C.kvb_ep_info(ep); info != nil {
				l.lanes = parseUCXLanes(C.GoString(info))
				C.free(unsafe.Pointer(info))
			}
		}
		done(nil)
	})
}

// closeEP closes the worker's endpoint of l. An aborted link's endpoint is closed at once;
// otherwise it is flushed first (the operations in flight complete), and closed when the flush
// completes or ucxCloseGrace passed, whichever is first (on a stopping worker the loop enforces
// the grace: see beginStop). Its remote keys are destroyed once the close completed (the
// operations using them have then completed too).
func (w *ucxWorker) closeEP(l *ucxLink) {
	ue := l.eps[w.idx]
	if ue == nil || !ue.open {
		return
	}
	if l.aborted.Load() {
		w.forceClose(l, ue)
		return
	}
	if ue.flushing {
		return
	}
	ue.flushing = true
	w.watch(C.kvb_flush(ue.ep), nil, func(C.ucs_status_t) { w.forceClose(l, ue) })
	time.AfterFunc(ucxCloseGrace, func() { w.submit(func() { w.forceClose(l, ue) }) })
}

// forceClose closes ue (once), canceling what is still in flight on it.
func (w *ucxWorker) forceClose(l *ucxLink, ue *ucxEP) {
	if !ue.open {
		return
	}
	ue.open = false
	w.watch(C.kvb_ep_close(ue.ep, 1), nil, func(C.ucs_status_t) {
		for _, rk := range ue.rkeys {
			C.kvb_rkey_destroy(rk)
		}
		ue.rkeys = nil
		C.kvb_ep_free(ue.ep)
		delete(w.links, l.id)
	})
}

// rkey returns the remote key of peer arena id on this endpoint, unpacking it on first use.
func (ue *ucxEP) rkey(l *ucxLink, id uint32) (C.ucp_rkey_h, error) {
	if h, ok := ue.rkeys[id]; ok {
		return h, nil
	}
	ua := l.p.meta.Load().ucxArena[id]
	if ua == nil {
		return nil, newErr("post", l.peer, ErrNotFound, fmt.Sprintf("no UCX key for arena %d", id), nil)
	}
	var h C.ucp_rkey_h
	if st := C.kvb_rkey_unpack(ue.ep, unsafe.Pointer(unsafe.SliceData(ua.Rkey)), &h); st != C.UCS_OK {
		return nil, ucsErr("post", st, fmt.Sprintf("unpacking the UCX key of arena %d", id)).withPeer(l.peer)
	}
	ue.rkeys[id] = h
	return h, nil
}

// runUnit posts the unit's pieces on l's endpoint of this worker, then one flush.
func (w *ucxWorker) runUnit(u *ucxUnit, gen uint64, l *ucxLink) {
	if !u.start(gen) {
		return
	}
	r := u.r
	ue := l.eps[w.idx]
	if ue == nil || !ue.open {
		u.resolve(gen, newErr(r.op.String(), l.peer, ErrRemoteDisconnect, "UCX link closed", nil))
		return
	}
	rk := w.rkbuf[:0]
	for _, id := range r.ucx.arenas {
		h, err := ue.rkey(l, id)
		if err != nil {
			u.resolve(gen, err)
			return
		}
		rk = append(rk, h)
	}
	w.rkbuf = rk
	var first C.ucs_status_t
	write := C.int(0)
	if r.op == Write {
		write = 1
	}
	req := C.kvb_post(ue.ep, write, (*C.kvb_piece)(unsafe.Pointer(unsafe.SliceData(u.pieces))), C.size_t(len(u.pieces)), unsafe.SliceData(rk), &first)
	w.watch(req, nil, func(st C.ucs_status_t) {
		if first != C.UCS_OK {
			st = first
		}
		var err error
		if st != C.UCS_OK {
			err = ucsErr(r.op.String(), st, "").withPeer(l.peer)
		}
		u.resolve(gen, err)
	})
}

// sendAM sends a hello or notification on l's endpoint of this worker.
func (w *ucxWorker) sendAM(l *ucxLink, kind C.uint32_t, data []byte, done func(error)) {
	ue := l.eps[w.idx]
	if ue == nil || !ue.open {
		done(newErr("notify", l.peer, ErrRemoteDisconnect, "UCX link closed", nil))
		return
	}
	a := w.e.a
	hdr := C.kvb_am_hdr{inc: C.uint64_t(a.inc), kind: kind, namelen: C.uint32_t(len(a.name))}
	reply := C.int(0)
	if kind == C.KVB_AM_MSG {
		l.seq++
		hdr.seq = C.uint64_t(l.seq)
	} else {
		hdr.seq, reply = C.uint64_t(l.id), 1 // acknowledged with the link id, on the reply endpoint
	}
	var buf unsafe.Pointer
	req := C.kvb_am_send(ue.ep, &hdr, (*C.char)(unsafe.Pointer(unsafe.StringData(a.name))),
		unsafe.Pointer(unsafe.SliceData(data)), C.size_t(len(data)), reply, &buf)
	w.watch(req, buf, func(st C.ucs_status_t) {
		if st != C.UCS_OK {
			done(ucsErr("notify", st, "sending a UCX active message").withPeer(l.peer))
			return
		}
		if kind == C.KVB_AM_MSG {
			a.stats.notifsSent.Add(1)
		}
		done(nil)
	})
}

// statusString returns UCX's name for st.
func statusString(st C.ucs_status_t) string { return C.GoString(C.kvb_status_string(st)) }

// ucsErr maps a UCX status onto the package's sentinel errors. A shared-memory segment error
// means the peer's segment could not be attached: the peer process is gone.
func ucsErr(op string, st C.ucs_status_t, detail string) *Error {
	kind := ErrBackend
	switch s := int(st); {
	case st == C.UCS_ERR_CANCELED, st == C.UCS_ERR_CONNECTION_RESET, st == C.UCS_ERR_UNREACHABLE,
		st == C.UCS_ERR_NOT_CONNECTED, st == C.UCS_ERR_REJECTED, st == C.UCS_ERR_TIMED_OUT,
		st == C.UCS_ERR_IO_ERROR, st == C.UCS_ERR_ENDPOINT_TIMEOUT, st == C.UCS_ERR_SHMEM_SEGMENT,
		s <= int(C.UCS_ERR_FIRST_LINK_FAILURE) && s >= int(C.UCS_ERR_LAST_ENDPOINT_FAILURE):
		kind = ErrRemoteDisconnect
	case st == C.UCS_ERR_INVALID_ADDR, st == C.UCS_ERR_OUT_OF_RANGE:
		kind = ErrInvalidDescriptor
	case st == C.UCS_ERR_INVALID_PARAM:
		kind = ErrInvalidParam
	case st == C.UCS_ERR_UNSUPPORTED, st == C.UCS_ERR_NOT_IMPLEMENTED:
		kind = ErrNotSupported
	}
	d := "UCX: " + statusString(st)
	if detail != "" {
		d = detail + ": " + d
	}
	return &Error{Op: op, Desc: -1, Backend: BackendUCX, Kind: kind, Detail: d}
}

// withPeer sets the peer of e.
func (e *Error) withPeer(peer string) *Error {
	e.Peer = peer
	return e
}
