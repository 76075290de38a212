package transfer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Status is the state of a request.
type Status int

const (
	// StatusIdle: made, never posted.
	StatusIdle Status = iota
	// StatusInProgress: posted, not finished.
	StatusInProgress
	// StatusDone: the last post completed successfully (and its notification was sent).
	StatusDone
	// StatusFailed: the last post failed; Err tells why.
	StatusFailed
)

// String returns the status name.
func (s Status) String() string {
	switch s {
	case StatusIdle:
		return "IDLE"
	case StatusInProgress:
		return "IN_PROGRESS"
	case StatusDone:
		return "DONE"
	case StatusFailed:
		return "FAILED"
	}
	return fmt.Sprintf("Status(%d)", int(s))
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

	ucxLink atomic.Pointer[ucxLink] // the UCX link of the current post

	pending atomic.Int64 // units of the current post not yet resolved
	failed  atomic.Bool  // the current post has failed (units skip work)

	mu        sync.Mutex
	state     Status
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
	if op != Read && op != Write {
		return nil, newErr("make", "", ErrInvalidParam, fmt.Sprintf("unknown op %d", op), nil)
	}
	if local == nil || local.peer != nil || local.a != a {
		return nil, newErr("make", "", ErrInvalidParam, "local list must be prepared with PrepareLocal on this agent", nil)
	}
	if remote == nil || remote.peer == nil || remote.a != a {
		return nil, newErr("make", "", ErrInvalidParam, "remote list must be prepared with PrepareRemote on this agent", nil)
	}
	peerName := remote.peer.name
	if local.released.Load() || remote.released.Load() {
		return nil, newErr("make", peerName, ErrInvalidParam, "prepared list released", nil)
	}
	if len(localIdx) != len(remoteIdx) {
		return nil, newErr("make", peerName, ErrMismatch, fmt.Sprintf("%d local and %d remote indices", len(localIdx), len(remoteIdx)), nil)
	}
	if len(localIdx) == 0 {
		return nil, newErr("make", peerName, ErrInvalidParam, "no descriptors", nil)
	}
	var meta *remoteMeta
	if !remote.allPerm.allows(op) {
		meta = remote.peer.meta.Load()
	}
	var regions *regionTable
	if remote.backend == BackendUCX {
		regions = a.regions.Load()
	}
	r := &Request{a: a, id: a.reqSeq.Add(1), op: op, peer: remote.peer, local: local, remote: remote,
		backend: remote.backend, timeout: a.cfg.RequestTimeout, descs: len(localIdx), done: make(chan struct{})}
	close(r.done) // never posted: Done is already closed
	if opts != nil && opts.Timeout > 0 {
		r.timeout = opts.Timeout
	}
	if opts != nil && len(opts.Tag) > 0 {
		if op != Read {
			return nil, newErr("make", peerName, ErrInvalidParam, "a tag is carried by READ requests only", nil)
		}
		if len(opts.Tag) > maxTagBytes {
			return nil, newErr("make", peerName, ErrInvalidParam, fmt.Sprintf("tag of %d bytes exceeds %d", len(opts.Tag), maxTagBytes), nil)
		}
		r.tag = append([]byte(nil), opts.Tag...)
	}
	runs := make([]run, 0, len(localIdx))
	var lReg, rReg uint32
	var lEnd, rEnd int64
	for k, li := range localIdx {
		ri := remoteIdx[k]
		if li < 0 || li >= len(local.descs) {
			return nil, descErr("make", peerName, k, ErrInvalidParam, "local index %d outside [0,%d)", li, len(local.descs))
		}
		if ri < 0 || ri >= len(remote.descs) {
			return nil, descErr("make", peerName, k, ErrInvalidParam, "remote index %d outside [0,%d)", ri, len(remote.descs))
		}
		ld, rd := local.descs[li], remote.descs[ri]
		if ld.Length != rd.Length {
			return nil, descErr("make", peerName, k, ErrMismatch, "local length %d, remote length %d", ld.Length, rd.Length)
		}
		if meta != nil {
			if reg := meta.region(rd.Region); reg == nil || !Perm(reg.Perm).allows(op) {
				return nil, descErr("make", peerName, k, ErrPermission, "peer region %d does not grant %v", rd.Region, op)
			}
		}
		if regions != nil {
			// UCX reads and writes local memory after Post returns: only arena memory (off
			// the Go heap) may be handed to it.
			if reg := regions.get(ld.Region); reg == nil || reg.arena == nil {
				return nil, descErr("make", peerName, k, ErrNotSupported, "local region %d is not in an arena: UCX moves arena memory only", ld.Region)
			}
		}
		r.bytes += ld.Length
		if len(runs) > 0 && ld.Region == lReg && ld.Offset == lEnd && rd.Region == rReg && rd.Offset == rEnd {
			last := &runs[len(runs)-1]
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
			runs = append(runs, rn)
		}
		lReg, lEnd, rReg, rEnd = ld.Region, ld.Offset+ld.Length, rd.Region, rd.Offset+rd.Length
	}
	r.runs = runs
	switch r.backend {
	case BackendSHM:
		if op == Write && !remote.shmWritable {
			return nil, descErr("make", peerName, -1, ErrPermission, "the peer shared its arena read-only")
		}
		r.planChunks()
	case BackendTCP:
		r.planStripes()
	case BackendUCX:
		r.planUCX(a.ucx.numWorkers())
	}
	return r, nil
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
	a := r.a
	r.mu.Lock()
	switch {
	case r.released:
		r.mu.Unlock()
		return r.errf("post", ErrInvalidParam, "request released")
	case r.state == StatusInProgress:
		r.mu.Unlock()
		return r.errf("post", ErrRepostActive, "")
	case a.closed.Load():
		r.mu.Unlock()
		return r.errf("post", ErrClosed, "agent closed")
	}
	if !r.local.acquire() {
		r.mu.Unlock()
		return r.errf("post", ErrInvalidParam, "local list released")
	}
	if !r.remote.acquire() {
		r.local.release()
		r.mu.Unlock()
		return r.errf("post", ErrInvalidParam, "remote list released")
	}
	start := time.Now()
	r.gen++
	gen := r.gen
	r.state = StatusInProgress
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
	r.mu.Unlock()

	p := r.peer
	var conns []*dataConn
	var link *ucxLink
	var rr int
	for attempt := 0; ; attempt++ {
		p.mu.Lock()
		if p.gone != nil {
			err := p.goneErrLocked("post")
			p.mu.Unlock()
			r.finishEarly(gen, err)
			return r.Err()
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
		if up && (r.notif == nil || r.backend == BackendUCX || p.routeLocked() != nil) {
			// Arm every unit before the request becomes visible to failure paths.
			r.arm(gen)
			conns = p.data
			link = p.ux
			if r.backend == BackendUCX {
				r.ucxLink.Store(link)
			}
			rr = p.rr
			p.rr++
			p.inflight[r] = gen
			p.mu.Unlock()
			break
		}
		p.mu.Unlock()
		if attempt > 0 {
			r.finishEarly(gen, newErr("post", p.name, ErrRemoteDisconnect, "connection lost while connecting", nil))
			return r.Err()
		}
		// A link broken since the last post (same incarnation) is re-established here,
		// bounded by the request's deadline; the only case where Post waits for the network.
		cctx, cancel := context.WithDeadline(ctx, r.deadline)
		err := p.ensure(cctx, r.backend)
		if err == nil && r.notif != nil && r.backend != BackendUCX {
			_, err = p.route(cctx, r.backend)
		}
		cancel()
		if err != nil {
			r.finishEarly(gen, err)
			return r.Err()
		}
	}

	r.mu.Lock()
	r.postDur = time.Since(start) // everything but handing the units over
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
	r.mu.Unlock()

	switch r.backend {
	case BackendSHM, BackendUCX:
		// Under postMu, Close waits until the work is handed over before stopping workers.
		a.postMu.RLock()
		switch {
		case a.closed.Load():
			a.postMu.RUnlock()
			r.fail(gen, ErrClosed, "agent closed", nil)
		case r.backend == BackendSHM:
			for i := range r.chunks {
				a.work <- shmWork{c: &r.chunks[i], gen: gen}
			}
			a.postMu.RUnlock()
		default:
			a.ucx.dispatch(link, r, gen)
			a.postMu.RUnlock()
		}
	default:
		// Stripe i goes to connection (rr+i) mod k: one lock and one wake-up per connection.
		for j := range min(len(conns), len(r.stripes)) {
			conns[(rr+j)%len(conns)].enqueue(r.stripes, j, len(conns), gen)
		}
	}
	return nil
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
	r.mu.Lock()
	gen, dl, active := r.gen, r.deadline, r.state == StatusInProgress
	r.mu.Unlock()
	if !active {
		return
	}
	if now := time.Now(); now.Before(dl) {
		r.mu.Lock()
		if r.gen == gen && r.timer != nil {
			r.timer.Reset(dl.Sub(now))
		}
		r.mu.Unlock()
		return
	}
	r.fail(gen, ErrTimeout, fmt.Sprintf("deadline of %v exceeded", r.timeout), nil)
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
	r.mu.Lock()
	if r.gen != gen || r.state != StatusInProgress {
		r.mu.Unlock()
		return
	}
	if r.err != nil {
		r.mu.Unlock()
		if abort && r.backend == BackendTCP {
			r.abortStripes(gen)
		}
		return
	}
	r.err = &Error{Op: r.op.String(), Peer: r.peer.name, Request: r.id, Desc: -1, Backend: r.backend, Kind: kind, Detail: detail, Cause: cause}
	r.mu.Unlock()
	r.failed.Store(true)
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
	r.mu.Lock()
	if r.gen == gen && r.err == nil {
		r.err = withRequest(err, r.op.String(), r.peer.name, r.id, r.backend)
	}
	r.mu.Unlock()
	r.finish()
}

// finish completes the current post: it sends the notification (if the data is complete),
// records telemetry and closes Done. A UCX notification is sent by worker 0 and the post
// completes when UCX has taken it.
func (r *Request) finish() {
	r.mu.Lock()
	if r.finished == r.gen {
		r.mu.Unlock()
		return // already finished (defensive: finish runs once per post)
	}
	r.finished = r.gen
	err, notif, dl := r.err, r.notif, r.deadline
	if r.timer != nil {
		r.timer.Stop()
	}
	if r.stopCtx != nil {
		r.stopCtx()
		r.stopCtx = nil
	}
	r.mu.Unlock()
	p := r.peer
	if err == nil && notif != nil {
		if r.backend == BackendUCX {
			// finish may run on a UCX worker's goroutine: it must not wait for worker 0.
			r.ucxLink.Load().sendAsync(notif, notifDeadline(dl), func(e error) {
				if e != nil {
					e = &Error{Op: r.op.String(), Peer: p.name, Request: r.id, Desc: -1, Backend: r.backend, Kind: ErrRemoteDisconnect, Detail: "sending the notification", Cause: e}
				}
				r.complete(e)
			})
			return
		}
		p.mu.Lock()
		rt := p.routeLocked()
		p.mu.Unlock()
		if rt == nil {
			err = r.errf(r.op.String(), ErrRemoteDisconnect, "control connection lost before the notification")
		} else if e := rt.send(notif, notifDeadline(dl)); e != nil {
			err = &Error{Op: r.op.String(), Peer: p.name, Request: r.id, Desc: -1, Backend: r.backend, Kind: ErrRemoteDisconnect, Detail: "sending the notification", Cause: e}
			if cc, ok := rt.(*ctrlConn); ok {
				p.teardownConn(cc, nil, "notification write failed")
			}
		}
	}
	r.complete(err)
}

// complete records the outcome of the current post, telemetry, and closes Done.
func (r *Request) complete(err error) {
	end := time.Now()
	p := r.peer
	r.mu.Lock()
	gen := r.gen
	r.mu.Unlock()
	p.mu.Lock()
	if p.inflight[r] == gen {
		delete(p.inflight, r)
	}
	p.mu.Unlock()
	r.local.release()
	r.remote.release()

	r.mu.Lock()
	r.err = err
	if err == nil {
		r.state = StatusDone
	} else {
		r.state = StatusFailed
	}
	r.tel = RequestTelemetry{Request: r.id, Peer: p.name, Op: r.op, Backend: r.backend, PostTime: r.postStart,
		PostDuration: r.postDur, TransferDuration: end.Sub(r.postStart), Bytes: r.bytes, Descs: r.descs,
		MergedDescs: len(r.runs), Err: err}
	tel := r.tel
	owned := r.owned && r.released
	done := r.done
	r.mu.Unlock()
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
	r.mu.Lock()
	done, gen, active := r.done, r.gen, r.state == StatusInProgress
	r.mu.Unlock()
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

// Status returns the state of the current post without blocking, and its error if failed.
func (r *Request) Status() (Status, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state == StatusFailed {
		return r.state, r.err
	}
	return r.state, nil
}

// Err returns the error of the last finished post (nil if it succeeded or is running).
func (r *Request) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state == StatusFailed {
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
	r.mu.Lock()
	if r.released {
		r.mu.Unlock()
		return
	}
	r.released = true
	active, gen := r.state == StatusInProgress, r.gen
	r.mu.Unlock()
	if active {
		r.fail(gen, ErrCanceled, "request released", nil)
		return // finish releases owned lists
	}
	if r.owned {
		r.local.Release()
		r.remote.Release()
	}
}
