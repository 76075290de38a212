package transfer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// postState is the state of a request's current post.
type postState int

const (
	// statusIdle: made, never posted.
	statusIdle postState = iota
	// statusInProgress: posted, not finished.
	statusInProgress
	// statusDone: the last post completed successfully (and its notification was sent).
	statusDone
	// statusFailed: the last post failed; Err tells why.
	statusFailed
)

// String returns the state name.
func (s postState) String() string {
	switch s {
	case statusIdle:
		return "IDLE"
	case statusInProgress:
		return "IN_PROGRESS"
	case statusDone:
		return "DONE"
	case statusFailed:
		return "FAILED"
	}
	return fmt.Sprintf("postState(%d)", int(s))
}

// RequestOptions tunes MakeRequest and CreateRequest.
type RequestOptions struct {
	// Timeout is the deadline of each post, measured from Post. Default: the agent's
	// RequestTimeout. A Post context with an earlier deadline wins.
	Timeout time.Duration
	// Backends restricts the backend of CreateRequest's remote list (see PrepareOptions).
	Backends []string
	// Tag is sent with every TCP READ frame of the request (at most 1024 bytes) for the
	// target's Config.AuthorizeRead to decide on; kvbridge's connector puts the id of the
	// producer's request whose blocks it reads there. It is not sent over SHM (the peer's
	// arena is mapped; see the package doc, Trust) and is not allowed on WRITE.
	Tag []byte
}

// run is one merged descriptor pair: len(local) bytes.
type run struct {
	local  []byte
	remote []byte // the peer's mapped memory (SHM); nil for TCP and UCX
	region uint32 // remote region (TCP)
	off    int64  // remote offset (TCP)
	raddr  uint64 // remote address (UCX)
	rarena uint32 // remote arena (UCX)
}

// Request is a transfer between local memory and one peer, made from prepared lists. It can
// be posted any number of times, one post at a time.
type Request struct {
	// Set by MakeRequest (owned by CreateRequest) before the request is shared; read-only after.
	a       *Agent
	id      uint64
	op      Op
	peer    *peer
	local   *PreparedList
	remote  *PreparedList
	owned   bool // the lists were created by CreateRequest and are released with the request
	backend Backend
	timeout time.Duration
	tag     []byte // sent with every TCP READ frame
	bytes   int64
	descs   int
	runs    []run
	chunks  []shmChunk // SHM plan
	stripes []stripe   // TCP plan
	ucx     *ucxPlan   // UCX plan

	// Atomic: read by the units of the current post without mu.
	ucxLink atomic.Pointer[ucxLink] // the UCX link of the current post
	pending atomic.Int64            // units of the current post not yet resolved
	failed  atomic.Bool             // the current post has failed (units skip work)

	mu sync.Mutex
	// guarded by mu: the current post (generation gen) and its outcome.
	state     postState
	gen       uint64
	finished  uint64 // last generation that finished
	err       error
	done      chan struct{}
	notif     []byte
	postStart time.Time
	postDur   time.Duration
	deadline  time.Time
	timer     *time.Timer
	stopCtx   func() bool
	tel       RequestTelemetry
	released  bool
}

// MakeRequest builds a request that moves local descriptor localIdx[k] to/from remote
// descriptor remoteIdx[k] for every k. Pairs must have equal lengths. Consecutive pairs that
// are contiguous on both sides are merged into one run (so N adjacent KV blocks cost one
// copy or one range). Validation happens here, once; Post does no per-descriptor checks.
func (a *Agent) MakeRequest(op Op, local *PreparedList, localIdx []int, remote *PreparedList, remoteIdx []int, opts *RequestOptions) (*Request, error) {
	if err := a.checkLists(op, local, remote); err != nil {
		return nil, err
	}
	peerName := remote.peer.name
	if len(localIdx) != len(remoteIdx) {
		return nil, newErr("make", peerName, ErrMismatch, fmt.Sprintf("%d local and %d remote indices", len(localIdx), len(remoteIdx)), nil)
	}
	if len(localIdx) == 0 {
		return nil, newErr("make", peerName, ErrInvalidParam, "no descriptors", nil)
	}
	r := &Request{a: a, id: a.reqSeq.Add(1), op: op, peer: remote.peer, local: local, remote: remote,
		backend: remote.backend, timeout: a.cfg.RequestTimeout, descs: len(localIdx), done: make(chan struct{})}
	close(r.done) // never posted: Done is already closed
	if err := r.setOptions(opts); err != nil {
		return nil, err
	}
	if err := r.pair(localIdx, remoteIdx); err != nil {
		return nil, err
	}
	if err := r.plan(); err != nil {
		return nil, err
	}
	return r, nil
}

// checkLists checks MakeRequest's op and lists.
func (a *Agent) checkLists(op Op, local, remote *PreparedList) error {
	if op != Read && op != Write {
		return newErr("make", "", ErrInvalidParam, fmt.Sprintf("unknown op %d", op), nil)
	}
	if local == nil || local.peer != nil || local.a != a {
		return newErr("make", "", ErrInvalidParam, "local list must be prepared with PrepareLocal on this agent", nil)
	}
	if remote == nil || remote.peer == nil || remote.a != a {
		return newErr("make", "", ErrInvalidParam, "remote list must be prepared with PrepareRemote on this agent", nil)
	}
	if local.released.Load() || remote.released.Load() {
		return newErr("make", remote.peer.name, ErrInvalidParam, "prepared list released", nil)
	}
	return nil
}

// setOptions applies MakeRequest's options.
func (r *Request) setOptions(opts *RequestOptions) error {
	if opts == nil {
		return nil
	}
	if opts.Timeout > 0 {
		r.timeout = opts.Timeout
	}
	if len(opts.Tag) == 0 {
		return nil
	}
	if r.op != Read {
		return newErr("make", r.peer.name, ErrInvalidParam, "a tag is carried by READ requests only", nil)
	}
	if len(opts.Tag) > maxTagBytes {
		return newErr("make", r.peer.name, ErrInvalidParam, fmt.Sprintf("tag of %d bytes exceeds %d", len(opts.Tag), maxTagBytes), nil)
	}
	r.tag = append([]byte(nil), opts.Tag...)
	return nil
}

// pairCheck is what every descriptor pair of a request is checked against.
type pairCheck struct {
	meta    *remoteMeta  // the peer's regions, when the remote list's permissions do not cover op
	regions *regionTable // the local regions, for UCX (arena memory only)
}

// pair checks the descriptor pairs and merges them into runs.
func (r *Request) pair(localIdx, remoteIdx []int) error {
	var pc pairCheck
	if !r.remote.allPerm.allows(r.op) {
		pc.meta = r.peer.meta.Load()
	}
	if r.backend == BackendUCX {
		pc.regions = r.a.regions.Load()
	}
	b := runBuilder{runs: make([]run, 0, len(localIdx))}
	for k, li := range localIdx {
		ri := remoteIdx[k]
		if err := r.checkPair(&pc, k, li, ri); err != nil {
			return err
		}
		r.bytes += r.local.descs[li].Length
		b.add(r.local, li, r.remote, ri)
	}
	r.runs = b.runs
	return nil
}

// checkPair checks pair k: local descriptor li and remote descriptor ri.
func (r *Request) checkPair(pc *pairCheck, k, li, ri int) error {
	local, remote, peerName := r.local, r.remote, r.peer.name
	if li < 0 || li >= len(local.descs) {
		return descErr("make", peerName, k, ErrInvalidParam, "local index %d outside [0,%d)", li, len(local.descs))
	}
	if ri < 0 || ri >= len(remote.descs) {
		return descErr("make", peerName, k, ErrInvalidParam, "remote index %d outside [0,%d)", ri, len(remote.descs))
	}
	ld, rd := local.descs[li], remote.descs[ri]
	if ld.Length != rd.Length {
		return descErr("make", peerName, k, ErrMismatch, "local length %d, remote length %d", ld.Length, rd.Length)
	}
	if pc.meta != nil {
		if reg := pc.meta.region(rd.Region); reg == nil || !Perm(reg.Perm).allows(r.op) {
			return descErr("make", peerName, k, ErrPermission, "peer region %d does not grant %v", rd.Region, r.op)
		}
	}
	if pc.regions != nil {
		// UCX reads and writes local memory after Post returns: only arena memory (off
		// the Go heap) may be handed to it.
		if reg := pc.regions.get(ld.Region); reg == nil || reg.arena == nil {
			return descErr("make", peerName, k, ErrNotSupported, "local region %d is not in an arena: UCX moves arena memory only", ld.Region)
		}
	}
	return nil
}

// runBuilder merges consecutive descriptor pairs that are contiguous on both sides into runs.
type runBuilder struct {
	runs       []run
	lReg, rReg uint32 // regions of the last pair
	lEnd, rEnd int64  // ends of the last pair
}

// add appends pair (local descriptor li, remote descriptor ri), extending the last run when
// the pair continues it on both sides.
func (b *runBuilder) add(local *PreparedList, li int, remote *PreparedList, ri int) {
	ld, rd := local.descs[li], remote.descs[ri]
	if len(b.runs) > 0 && ld.Region == b.lReg && ld.Offset == b.lEnd && rd.Region == b.rReg && rd.Offset == b.rEnd {
		last := &b.runs[len(b.runs)-1]
		last.local = last.local[:len(last.local)+int(ld.Length)]
		if last.remote != nil {
			last.remote = last.remote[:len(last.remote)+int(rd.Length)]
		}
	} else {
		rn := run{local: local.bufs[li], region: rd.Region, off: rd.Offset}
		if remote.bufs != nil {
			rn.remote = remote.bufs[ri]
		}
		if remote.raddrs != nil {
			rn.raddr, rn.rarena = remote.raddrs[ri], remote.rarenas[ri]
		}
		b.runs = append(b.runs, rn)
	}
	b.lReg, b.lEnd, b.rReg, b.rEnd = ld.Region, ld.Offset+ld.Length, rd.Region, rd.Offset+rd.Length
}

// plan cuts the runs into the units of the request's backend.
func (r *Request) plan() error {
	switch r.backend {
	case BackendSHM:
		if r.op == Write && !r.remote.shmWritable {
			return descErr("make", r.peer.name, -1, ErrPermission, "the peer shared its arena read-only")
		}
		r.planChunks()
	case BackendTCP:
		r.planStripes()
	case BackendUCX:
		r.planUCX(r.a.ucx.numWorkers())
	}
	return nil
}

// CreateRequest is the one-shot form: it prepares local and remote (identity indices) and
// makes a request that owns both lists (released with the request).
func (a *Agent) CreateRequest(ctx context.Context, op Op, local []Desc, peer string, remote []Desc, opts *RequestOptions) (*Request, error) {
	ll, err := a.PrepareLocal(local)
	if err != nil {
		return nil, err
	}
	var popts *PrepareOptions
	if opts != nil && opts.Backends != nil {
		popts = &PrepareOptions{Backends: opts.Backends}
	}
	rl, err := a.PrepareRemote(ctx, peer, remote, popts)
	if err != nil {
		ll.Release()
		return nil, err
	}
	idx := make([]int, len(local))
	for i := range idx {
		idx[i] = i
	}
	r, err := a.MakeRequest(op, ll, idx, rl, idx, opts)
	if err != nil {
		ll.Release()
		rl.Release()
		return nil, err
	}
	r.owned = true
	return r, nil
}

// ID returns the request id (unique within the agent).
func (r *Request) ID() uint64 { return r.id }

// Op returns READ or WRITE.
func (r *Request) Op() Op { return r.op }

// Peer returns the remote agent name.
func (r *Request) Peer() string { return r.peer.name }

// Backend returns the backend that moves the data.
func (r *Request) Backend() Backend { return r.backend }

// Bytes returns the bytes moved by one post.
func (r *Request) Bytes() int64 { return r.bytes }

// Descs returns the descriptor count before and after merging contiguous runs.
func (r *Request) Descs() (before, after int) { return r.descs, len(r.runs) }

// Post starts the transfer and returns without waiting for data movement. notif, if not
// nil, is delivered to the peer by the engine itself as soon as the data is complete (READ:
// after it landed locally; WRITE: after the peer acknowledged placement). Cancelling ctx
// cancels the transfer (ErrCanceled); the transfer's deadline is the request timeout or
// ctx's deadline, whichever is earlier (ErrTimeout). Post fails at once with
// ErrRepostActive while a previous post is in progress, ErrStaleIncarnation if the peer was
// replaced, and with a connection error if a broken link cannot be re-established.
func (r *Request) Post(ctx context.Context, notif []byte) error {
	pp, err := r.begin(ctx, notif)
	if err != nil {
		return err
	}
	dst, err := r.attach(ctx, &pp)
	if err != nil {
		r.finishEarly(pp.gen, err)
		return r.Err()
	}
	r.startClock(ctx, &pp)
	r.dispatch(pp.gen, dst)
	return nil
}

// post is what Post carries from one step to the next: the post's generation and the facts
// about it that the later steps need without taking r.mu again.
type post struct {
	gen       uint64
	start     time.Time
	deadline  time.Time
	needRoute bool // a notification is attached and travels on a control route (not UCX)
}

// begin starts a new post: it checks the request can be posted, pins both lists and resets
// the post's state.
func (r *Request) begin(ctx context.Context, notif []byte) (post, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.beginLocked(ctx, notif)
}

// beginLocked is begin under r.mu.
func (r *Request) beginLocked(ctx context.Context, notif []byte) (post, error) {
	switch {
	case r.released:
		return post{}, r.errf("post", ErrInvalidParam, "request released")
	case r.state == statusInProgress:
		return post{}, r.errf("post", ErrRepostActive, "")
	case r.a.closed.Load():
		return post{}, r.errf("post", ErrClosed, "agent closed")
	}
	if !r.local.acquire() {
		return post{}, r.errf("post", ErrInvalidParam, "local list released")
	}
	if !r.remote.acquire() {
		r.local.release()
		return post{}, r.errf("post", ErrInvalidParam, "remote list released")
	}
	start := time.Now()
	r.gen++
	r.state = statusInProgress
	r.err = nil
	r.failed.Store(false)
	r.done = make(chan struct{})
	r.notif = nil
	if notif != nil {
		r.notif = append(make([]byte, 0, len(notif)), notif...)
	}
	r.postStart = start
	r.deadline = start.Add(r.timeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(r.deadline) {
		r.deadline = cd
	}
	r.tel = RequestTelemetry{}
	return post{gen: r.gen, start: start, deadline: r.deadline, needRoute: notif != nil && r.backend != BackendUCX}, nil
}

// destination is where the units of a post go: the peer's TCP data connections (starting
// with connection rr) or its UCX link; SHM units go to the agent's copy workers.
type destination struct {
	conns []*dataConn
	rr    int
	link  *ucxLink
}

// attach makes the post visible to the peer's failure paths once the connections it needs
// are up. A link broken since the last post (same incarnation) is re-established once,
// bounded by the post's deadline: the only case where Post waits for the network, and it
// does so holding no lock.
func (r *Request) attach(ctx context.Context, pp *post) (destination, error) {
	p := r.peer
	for attempt := 0; ; attempt++ {
		dst, up, err := p.attach(r, pp)
		if err != nil || up {
			return dst, err
		}
		if attempt > 0 {
			return dst, newErr("post", p.name, ErrRemoteDisconnect, "connection lost while connecting", nil)
		}
		if err := r.reconnect(ctx, pp); err != nil {
			return dst, err
		}
	}
}

// reconnect re-establishes the connections the post needs (see attach).
func (r *Request) reconnect(ctx context.Context, pp *post) error {
	cctx, cancel := context.WithDeadline(ctx, pp.deadline)
	defer cancel()
	if err := r.peer.ensure(cctx, r.backend); err != nil {
		return err
	}
	if pp.needRoute {
		_, err := r.peer.route(cctx, r.backend)
		return err
	}
	return nil
}

// attach registers post pp of r as in flight on the peer if the connections its backend
// needs (and its notification's route) are up, and reports whether they were. The post's
// units are armed before the request becomes visible to failure paths.
func (p *peer) attach(r *Request, pp *post) (destination, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.attachLocked(r, pp)
}

// attachLocked is attach under p.mu.
func (p *peer) attachLocked(r *Request, pp *post) (destination, bool, error) {
	if p.gone != nil {
		return destination{}, false, p.goneErrLocked("post")
	}
	var up bool
	switch r.backend {
	case BackendSHM:
		up = p.uconn != nil
	case BackendTCP:
		up = p.data != nil
	case BackendUCX:
		up = p.ux != nil // which also carries the notification
	}
	if !up || (pp.needRoute && p.routeLocked() == nil) {
		return destination{}, false, nil
	}
	r.arm(pp.gen)
	if r.backend == BackendUCX {
		r.ucxLink.Store(p.ux)
	}
	dst := destination{conns: p.data, rr: p.rr, link: p.ux}
	p.rr++
	p.inflight[r] = pp.gen
	return dst, true, nil
}

// startClock arms the post's deadline timer and its context's cancellation.
func (r *Request) startClock(ctx context.Context, pp *post) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.startClockLocked(ctx, pp)
}

// startClockLocked is startClock under r.mu. The callbacks it arms run on goroutines of their
// own and take r.mu there.
func (r *Request) startClockLocked(ctx context.Context, pp *post) {
	gen := pp.gen
	r.postDur = time.Since(pp.start) // everything but handing the units over
	d := time.Until(r.deadline)
	if r.timer == nil {
		r.timer = time.AfterFunc(d, r.onDeadline)
	} else {
		r.timer.Reset(d)
	}
	if ctx.Done() != nil {
		r.stopCtx = context.AfterFunc(ctx, func() {
			if ctx.Err() == context.DeadlineExceeded {
				r.fail(gen, ErrTimeout, "context deadline exceeded", nil)
			} else {
				r.fail(gen, ErrCanceled, "context canceled", ctx.Err())
			}
		})
	}
}

// dispatch hands the armed units of post gen to whoever moves them. It holds no lock of the
// request or the peer: the sends below may block on full queues.
func (r *Request) dispatch(gen uint64, dst destination) {
	switch r.backend {
	case BackendSHM:
		if !r.a.handOver(func() {
			for i := range r.chunks {
				r.a.work <- shmWork{c: &r.chunks[i], gen: gen}
			}
		}) {
			r.fail(gen, ErrClosed, "agent closed", nil)
		}
	case BackendUCX:
		if !r.a.handOver(func() { r.a.ucx.dispatch(dst.link, r, gen) }) {
			r.fail(gen, ErrClosed, "agent closed", nil)
		}
	default:
		// Stripe i goes to connection (rr+i) mod k: one lock and one wake-up per connection.
		conns := dst.conns
		for j := range min(len(conns), len(r.stripes)) {
			conns[(dst.rr+j)%len(conns)].enqueue(r.stripes, j, len(conns), gen)
		}
	}
}

// arm resets the units of the plan for post gen.
func (r *Request) arm(gen uint64) {
	switch r.backend {
	case BackendSHM:
		for i := range r.chunks {
			r.chunks[i].state.Store(gen << 2)
		}
		r.pending.Store(int64(len(r.chunks)))
		return
	case BackendUCX:
		for i := range r.ucx.units {
			r.ucx.units[i].arm(gen)
		}
		r.pending.Store(int64(len(r.ucx.units)))
		return
	}
	for i := range r.stripes {
		r.stripes[i].arm(gen)
	}
	r.pending.Store(int64(len(r.stripes)))
}

// errf builds an *Error about this request.
func (r *Request) errf(op string, kind error, detail string) error {
	return &Error{Op: op, Peer: r.peer.name, Request: r.id, Desc: -1, Backend: r.backend, Kind: kind, Detail: detail}
}

// onDeadline is the timer callback: it fails the current post if its deadline has passed
// (a late callback of an earlier post finds a later deadline and does nothing).
func (r *Request) onDeadline() {
	if gen, passed := r.deadlinePassed(); passed {
		r.fail(gen, ErrTimeout, fmt.Sprintf("deadline of %v exceeded", r.timeout), nil)
	}
}

// deadlinePassed reports whether the deadline of the active post has passed, and that post's
// generation; when it has not, it sets the timer again for the time left.
func (r *Request) deadlinePassed() (uint64, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state != statusInProgress {
		return 0, false
	}
	if now := time.Now(); now.Before(r.deadline) {
		if r.timer != nil {
			r.timer.Reset(r.deadline.Sub(now))
		}
		return 0, false
	}
	return r.gen, true
}

// fail records the first error of post gen and abandons its units: queued work is dropped at
// once; work touching local memory is interrupted (its connection closed) and resolves
// promptly. Done closes when every unit has resolved.
//
// A TCP peer's refusal of one stripe (ErrPermission, ErrInvalidDescriptor) leaves the busy
// stripes on other connections to finish reading; any later failure of the same post (its
// deadline, a canceled context, Release, a broken connection) still aborts them, though the
// first error is the one reported, so the deadline holds even if the peer stalls then.
func (r *Request) fail(gen uint64, kind error, detail string, cause error) {
	abort := !errors.Is(kind, ErrPermission) && !errors.Is(kind, ErrInvalidDescriptor)
	first, active := r.recordFailure(gen, kind, detail, cause)
	switch {
	case !active:
	case !first:
		if abort && r.backend == BackendTCP {
			r.abortStripes(gen)
		}
	default:
		r.failed.Store(true)
		r.abandon(gen, detail, abort)
	}
}

// recordFailure records the error of post gen unless it has one already. It reports whether
// this was the post's first error and whether post gen is still in progress.
func (r *Request) recordFailure(gen uint64, kind error, detail string, cause error) (first, active bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.gen != gen || r.state != statusInProgress {
		return false, false
	}
	if r.err != nil {
		return false, true
	}
	r.err = &Error{Op: r.op.String(), Peer: r.peer.name, Request: r.id, Desc: -1, Backend: r.backend, Kind: kind, Detail: detail, Cause: cause}
	return true, true
}

// abandon abandons the units of failed post gen (abort: TCP stripes busy reading are cut).
func (r *Request) abandon(gen uint64, detail string, abort bool) {
	switch r.backend {
	case BackendSHM:
		for i := range r.chunks {
			r.chunks[i].abandon(gen)
		}
	case BackendUCX:
		for i := range r.ucx.units {
			r.ucx.units[i].abandon(gen, detail)
		}
	default:
		// A peer's refusal of one stripe says nothing against the connections carrying the
		// others: their payloads are read to the end rather than cut.
		for i := range r.stripes {
			r.stripes[i].abandon(gen, abort)
		}
	}
}

// abortStripes aborts the stripes of failed post gen still touching local memory (closing
// their connections), after a refusal had let them run on.
func (r *Request) abortStripes(gen uint64) {
	for i := range r.stripes {
		r.stripes[i].abandon(gen, true)
	}
}

// unitDone resolves one unit of the current post; the last one finishes the post.
func (r *Request) unitDone() {
	if r.pending.Add(-1) == 0 {
		r.finish()
	}
}

// finishEarly ends post gen before any unit was dispatched.
func (r *Request) finishEarly(gen uint64, err error) {
	r.setEarlyErr(gen, err)
	r.finish()
}

// setEarlyErr records err as the error of post gen unless it has one.
func (r *Request) setEarlyErr(gen uint64, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.gen == gen && r.err == nil {
		r.err = withRequest(err, r.op.String(), r.peer.name, r.id, r.backend)
	}
}

// finish completes the current post: it sends the notification (if the data is complete),
// records telemetry and closes Done. A UCX notification is sent by worker 0 and the post
// completes when UCX has taken it. The notification is sent holding no lock.
func (r *Request) finish() {
	o, ok := r.stopClock()
	if !ok {
		return // already finished (defensive: finish runs once per post)
	}
	if o.err != nil || o.notif == nil {
		r.complete(o.err)
		return
	}
	if r.backend == BackendUCX {
		// finish may run on a UCX worker's goroutine: it must not wait for worker 0.
		r.ucxLink.Load().sendAsync(o.notif, notifDeadline(o.deadline), func(e error) {
			if e != nil {
				e = r.notifErr(e)
			}
			r.complete(e)
		})
		return
	}
	r.complete(r.sendNotif(o.notif, o.deadline))
}

// outcome is what a finished post leaves for its completion: its error, and the
// notification to send if it succeeded, with the post's deadline.
type outcome struct {
	err      error
	notif    []byte
	deadline time.Time
}

// stopClock marks the current post finished and stops its timer and context callback, and
// returns the post's outcome; ok is false if the post had already finished.
func (r *Request) stopClock() (o outcome, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.finished == r.gen {
		return outcome{}, false
	}
	r.finished = r.gen
	if r.timer != nil {
		r.timer.Stop()
	}
	if r.stopCtx != nil {
		r.stopCtx()
		r.stopCtx = nil
	}
	return outcome{err: r.err, notif: r.notif, deadline: r.deadline}, true
}

// sendNotif sends the completion notification on the peer's control route; a write failure
// tears the control connection down.
func (r *Request) sendNotif(notif []byte, dl time.Time) error {
	p := r.peer
	rt := p.currentRoute()
	if rt == nil {
		return r.errf(r.op.String(), ErrRemoteDisconnect, "control connection lost before the notification")
	}
	if e := rt.send(notif, notifDeadline(dl)); e != nil {
		if cc, ok := rt.(*ctrlConn); ok {
			p.teardownConn(cc, nil, "notification write failed")
		}
		return r.notifErr(e)
	}
	return nil
}

// notifErr is the error of a post whose notification could not be sent.
func (r *Request) notifErr(cause error) error {
	return &Error{Op: r.op.String(), Peer: r.peer.name, Request: r.id, Desc: -1, Backend: r.backend, Kind: ErrRemoteDisconnect, Detail: "sending the notification", Cause: cause}
}

// complete records the outcome of the current post, telemetry, and closes Done.
func (r *Request) complete(err error) {
	end := time.Now()
	r.peer.detach(r, r.currentGen())
	r.local.release()
	r.remote.release()
	tel, owned, done := r.record(err, end)
	// Counters and the hook see the post before any waiter wakes up.
	r.a.stats.record(&tel)
	if h := r.a.cfg.OnComplete; h != nil {
		h(tel)
	}
	close(done)
	if owned {
		r.local.Release()
		r.remote.Release()
	}
}

// currentGen returns the generation of the current post.
func (r *Request) currentGen() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.gen
}

// record sets the outcome and telemetry of the current post. It returns the telemetry,
// whether the request's own lists are to be released now, and the post's Done channel.
func (r *Request) record(err error, end time.Time) (RequestTelemetry, bool, chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.err = err
	if err == nil {
		r.state = statusDone
	} else {
		r.state = statusFailed
	}
	r.tel = RequestTelemetry{Request: r.id, Peer: r.peer.name, Op: r.op, Backend: r.backend, PostTime: r.postStart,
		PostDuration: r.postDur, TransferDuration: end.Sub(r.postStart), Bytes: r.bytes, Descs: r.descs,
		MergedDescs: len(r.runs), Err: err}
	return r.tel, r.owned && r.released, r.done
}

// Done returns a channel closed when the current post completes or fails (already closed
// if the request was never posted).
func (r *Request) Done() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.done
}

// Wait blocks until the current post completes and returns its error, or returns ctx's
// error if ctx ends first (the transfer keeps going; it has its own deadline). On SHM the
// waiting goroutine lends a hand: it copies chunks no worker has started yet, which saves
// the wake-up latency of small transfers.
func (r *Request) Wait(ctx context.Context) error {
	done, gen, active := r.current()
	if active && r.backend == BackendSHM && ctx.Err() == nil {
		r.help(gen)
	}
	select {
	case <-done:
		return r.Err()
	case <-ctx.Done():
		return ctx.Err()
	}
}

// current returns the current post's Done channel and generation, and whether it is in
// progress.
func (r *Request) current() (done chan struct{}, gen uint64, active bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.done, r.gen, r.state == statusInProgress
}

// status returns the state of the current post without blocking, and its error if failed.
func (r *Request) status() (postState, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state == statusFailed {
		return r.state, r.err
	}
	return r.state, nil
}

// Err returns the error of the last finished post (nil if it succeeded or is running).
func (r *Request) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state == statusFailed {
		return r.err
	}
	return nil
}

// Telemetry returns the figures of the last finished post.
func (r *Request) Telemetry() RequestTelemetry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.tel
}

// Release cancels the current post if it is active (ErrCanceled) and gives the request up;
// it cannot be posted again. Lists created by CreateRequest are released once the request
// is idle. Release does not wait; use Done to know when the memory is no longer touched.
func (r *Request) Release() {
	first, active, gen := r.markReleased()
	switch {
	case !first:
	case active:
		r.fail(gen, ErrCanceled, "request released", nil) // finish releases owned lists
	case r.owned:
		r.local.Release()
		r.remote.Release()
	}
}

// markReleased marks the request released. It reports whether it was not already, and
// whether a post (generation gen) is in progress.
func (r *Request) markReleased() (first, active bool, gen uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.released {
		return false, false, 0
	}
	r.released = true
	return true, r.state == statusInProgress, r.gen
}
