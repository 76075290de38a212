package transfer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"

	"golang.org/x/sync/semaphore"

	"github.com/kvbridge/kvbridge/transfer/internal/wire"
)

// TCP backend: per peer, TCPStreams data connections, each with a writer and a reader
// goroutine. A request's runs are cut into stripes (at most StripeBytes and 1024 ranges
// each) that are spread round-robin over the connections. For READ the writer sends one
// READ_REQ frame per stripe listing its remote ranges (and the request's tag, for the
// target's AuthorizeRead); the target streams the bytes from registered memory with writev
// and the reader places them straight into the destination slices with readv. For WRITE the writer sends WRITE_DATA (ranges + payload gathered with
// writev) and the reader waits for WRITE_ACK. The target answers the frames of one
// connection in order, so the reader matches responses to a FIFO of sent stripes. A
// per-peer semaphore bounds the bytes in flight. The plan (frames, iovecs) is computed once
// by MakeRequest and re-armed by each post.

// stripe states
const (
	stQueued uint8 = iota // waiting in a connection's queue
	stSent                // READ_REQ written, or WRITE_DATA fully written; response pending
	stBusy                // touching local memory: payload being read into it or written from it
	stDone                // resolved for its post
)

// stripe is one frame's worth of a request.
type stripe struct {
	r     *Request
	idx   int
	iov   [][]byte // local slices, in range order
	frame []byte   // encoded header + ranges
	bytes int64

	mu sync.Mutex
	// guarded by mu: the stripe's state in post gen.
	gen       uint64
	st        uint8
	abandoned bool // the request failed while the stripe was busy
	aborted   bool // ... and its connection was closed to interrupt it
	acked     bool // WRITE: the response arrived before the writer finished
	ackErr    error
	conn      *dataConn
}

// planStripes cuts the runs into stripes and encodes their frames.
func (r *Request) planStripes() {
	k := int64(r.a.cfg.TCPStreams)
	limit := int64(r.a.cfg.StripeBytes)
	per := limit
	if r.bytes/k < per {
		per = min(limit, max(128<<10, (r.bytes+k-1)/k))
	}
	type span struct{ first, n int }
	var spans []span
	pieces := make([]wire.Range, 0, len(r.runs)+int(r.bytes/per)+1)
	locals := make([][]byte, 0, cap(pieces))
	var acc int64
	cur := span{}
	for i := range r.runs {
		rn := &r.runs[i]
		for off := 0; off < len(rn.local); {
			take := min(int64(len(rn.local)-off), per-acc)
			pieces = append(pieces, wire.Range{Region: rn.region, Offset: uint64(rn.off) + uint64(off), Length: uint64(take)})
			locals = append(locals, rn.local[off:off+int(take)])
			off += int(take)
			acc += take
			cur.n++
			if acc == per || cur.n == maxRangesPerFrame {
				spans = append(spans, cur)
				cur = span{first: len(pieces)}
				acc = 0
			}
		}
	}
	if cur.n > 0 {
		spans = append(spans, cur)
	}
	tag := 0
	if r.op == Read {
		tag = len(r.tag)
	}
	size := 0
	for _, sp := range spans {
		size += wire.HeaderSize + sp.n*wire.RangeSize + tag
	}
	frames := make([]byte, size)
	r.stripes = make([]stripe, len(spans))
	pos := 0
	for i, sp := range spans {
		s := &r.stripes[i]
		s.r, s.idx = r, i
		s.iov = locals[sp.first : sp.first+sp.n : sp.first+sp.n]
		for _, b := range s.iov {
			s.bytes += int64(len(b))
		}
		n := wire.HeaderSize + sp.n*wire.RangeSize + tag
		s.frame = frames[pos : pos+n : pos+n]
		pos += n
		h := wire.Header{Op: wire.OpReadReq, Req: r.id, Seq: uint32(i), Count: uint32(sp.n), Length: uint64(tag)}
		if r.op == Write {
			h.Op, h.Length = wire.OpWriteData, uint64(s.bytes)
		}
		h.Encode(s.frame)
		for j := range sp.n {
			wire.PutRange(s.frame[wire.HeaderSize+j*wire.RangeSize:], pieces[sp.first+j])
		}
		copy(s.frame[wire.HeaderSize+sp.n*wire.RangeSize:], r.tag[:tag])
	}
}

// arm resets the stripe for post gen.
func (s *stripe) arm(gen uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.gen, s.st, s.abandoned, s.aborted, s.acked, s.ackErr, s.conn = gen, stQueued, false, false, false, nil, nil
}

// queued reports whether the stripe is still waiting for post gen.
func (s *stripe) queued(gen uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gen == gen && s.st == stQueued
}

// claim moves a queued stripe to the writer of c.
func (s *stripe) claim(gen uint64, c *dataConn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gen != gen || s.st != stQueued {
		return false
	}
	s.conn = c
	if s.r.op == Read {
		s.st = stSent
	} else {
		s.st = stBusy
	}
	return true
}

// resolve ends the stripe's part in post gen: err, if not nil, fails the post, then the
// unit is done. Callers hold no lock of the stripe (the last unit finishes the request).
func (s *stripe) resolve(gen uint64, err error) {
	if err != nil {
		s.r.failErr(gen, err)
	}
	s.r.unitDone()
}

// afterWrite ends the writer's use of a WRITE stripe's memory.
func (s *stripe) afterWrite(gen uint64, err error) {
	if done, e := s.written(gen, err); done {
		s.resolve(gen, e)
	}
}

// written moves a busy WRITE stripe on once its payload was written (err: the write's
// error). It is done, with the error to report, when the write failed, the post was
// abandoned or the target's answer came already; otherwise it waits for that answer.
func (s *stripe) written(gen uint64, err error) (done bool, _ error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gen != gen || s.st != stBusy {
		return false, nil
	}
	switch {
	case err != nil || s.abandoned:
		s.st = stDone
		return true, err
	case s.acked:
		s.st = stDone
		return true, s.ackErr
	}
	s.st = stSent
	return false, nil
}

// response records the target's answer (WRITE_ACK, or ERROR for either op).
func (s *stripe) response(gen uint64, err error) {
	if s.answered(gen, err) {
		s.resolve(gen, err)
	}
}

// answered records the target's answer and reports whether the stripe is done; a WRITE
// stripe still being written keeps the answer for written.
func (s *stripe) answered(gen uint64, err error) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gen != gen || s.st == stDone || s.st == stQueued {
		return false
	}
	if s.st == stBusy {
		s.acked, s.ackErr = true, err
		return false
	}
	s.st = stDone
	return true
}

// startRead moves a sent READ stripe to busy before its payload is read into local memory.
func (s *stripe) startRead(gen uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gen != gen || s.st != stSent {
		return false
	}
	s.st = stBusy
	return true
}

// finishRead resolves a READ stripe after its payload was read (or the read failed).
func (s *stripe) finishRead(gen uint64, err error) {
	s.setDone()
	s.resolve(gen, err)
}

// setDone marks the stripe done.
func (s *stripe) setDone() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.st = stDone
}

// abandon resolves the stripe of a failed post gen: at once if it is not touching local
// memory; otherwise, when abort is set, by closing its connection so the I/O in progress ends
// promptly, and when it is not (the peer refused another stripe: this connection is healthy
// and the payload is flowing) when the payload has been read. Closing a healthy connection
// would fail every other request in flight on the link. A stripe left to finish may be
// abandoned again with abort (a later failure of the same post: see Request.fail); its
// connection is closed once, outside the stripe's lock.
func (s *stripe) abandon(gen uint64, abort bool) {
	done, closeConn := s.markAbandoned(gen, abort)
	if closeConn != nil {
		closeConn.abort()
	}
	if done {
		s.r.unitDone()
	}
}

// markAbandoned marks the stripe of failed post gen abandoned. It reports whether the stripe
// is done now, and the connection to close (nil: none).
func (s *stripe) markAbandoned(gen uint64, abort bool) (done bool, closeConn *dataConn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gen != gen || s.st == stDone {
		return false, nil
	}
	if s.st != stBusy {
		s.st = stDone
		return true, nil
	}
	s.abandoned = true
	if abort && !s.aborted && s.conn != nil {
		s.aborted = true
		return false, s.conn
	}
	return false, nil
}

// failErr fails post gen with err (an *Error keeps its kind; anything else is a broken
// connection).
func (r *Request) failErr(gen uint64, err error) {
	var e *Error
	if errors.As(err, &e) {
		r.fail(gen, e.Kind, e.Detail, e.Cause)
		return
	}
	r.fail(gen, ErrRemoteDisconnect, "connection lost", err)
}

// unit is a stripe queued for post gen.
type unit struct {
	s   *stripe
	gen uint64
}

// dataConn is one outbound TCP data connection.
type dataConn struct {
	p      *peer
	c      net.Conn
	rc     syscall.RawConn
	budget *semaphore.Weighted
	ctx    context.Context
	cancel context.CancelFunc

	qmu sync.Mutex
	// guarded by qmu
	queue []unit
	head  int

	wake chan struct{}
	fifo chan unit // stripes sent, in order, awaiting their response

	closeOnce sync.Once
}

// newDataConn wraps a handshaken connection.
func newDataConn(p *peer, c net.Conn, budget *semaphore.Weighted) *dataConn {
	dc := &dataConn{p: p, c: c, budget: budget, wake: make(chan struct{}, 1), fifo: make(chan unit, 4096)}
	if sc, ok := c.(syscall.Conn); ok {
		dc.rc, _ = sc.SyscallConn()
	}
	dc.ctx, dc.cancel = context.WithCancel(p.a.ctx)
	return dc
}

// start launches the writer and reader goroutines.
func (c *dataConn) start() bool {
	if !c.p.a.goTracked(c.writeLoop) {
		return false
	}
	return c.p.a.goTracked(c.readLoop)
}

// abort closes the connection (idempotent); both goroutines then exit.
func (c *dataConn) abort() {
	c.closeOnce.Do(func() {
		c.cancel()
		c.c.Close()
		c.p.a.untrack(c.c)
	})
}

// fail aborts the connection after an I/O error and tears down the peer's link, failing
// its requests in flight.
func (c *dataConn) fail(err error) {
	closing := c.ctx.Err() != nil
	c.abort()
	if c.p.a.closed.Load() {
		return
	}
	why := fmt.Sprintf("data connection lost: %v", err)
	if closing {
		why = "data connection closed"
	}
	c.p.teardownConn(nil, c, why)
}

// enqueue hands stripes[first], stripes[first+step], … to the writer.
func (c *dataConn) enqueue(stripes []stripe, first, step int, gen uint64) {
	c.push(stripes, first, step, gen)
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// push appends the units to the queue.
func (c *dataConn) push(stripes []stripe, first, step int, gen uint64) {
	c.qmu.Lock()
	defer c.qmu.Unlock()
	for i := first; i < len(stripes); i += step {
		c.queue = append(c.queue, unit{s: &stripes[i], gen: gen})
	}
}

// pop takes the next unit off the queue, if there is one.
func (c *dataConn) pop() (unit, bool) {
	c.qmu.Lock()
	defer c.qmu.Unlock()
	if c.head == len(c.queue) {
		return unit{}, false
	}
	u := c.queue[c.head]
	c.queue[c.head] = unit{}
	c.head++
	if c.head == len(c.queue) {
		c.queue, c.head = c.queue[:0], 0
	}
	return u, true
}

// next returns the next queued unit, or false once the connection is closed.
func (c *dataConn) next() (unit, bool) {
	for {
		if u, ok := c.pop(); ok {
			return u, true
		}
		select {
		case <-c.wake:
		case <-c.ctx.Done():
			return unit{}, false
		}
	}
}

// writeLoop sends queued stripes: budget first, then the frame (and payload for WRITE).
func (c *dataConn) writeLoop() {
	var backing [][]byte
	for {
		u, ok := c.next()
		if !ok {
			return
		}
		s := u.s
		if !s.queued(u.gen) {
			continue
		}
		if err := c.budget.Acquire(c.ctx, s.bytes); err != nil {
			return // closing; the request is failed by the teardown
		}
		if !s.claim(u.gen, c) {
			c.budget.Release(s.bytes)
			continue
		}
		select {
		case c.fifo <- u:
		case <-c.ctx.Done():
			if s.r.op == Write {
				s.afterWrite(u.gen, net.ErrClosed)
			}
			return
		}
		var err error
		if s.r.op == Read {
			_, err = c.c.Write(s.frame)
		} else {
			backing = append(backing[:0], s.frame)
			backing = append(backing, s.iov...)
			bufs := net.Buffers(backing)
			_, err = bufs.WriteTo(c.c)
			if err != nil {
				// Tear the link down before the stripe resolves, so that when the request's
				// Done fires the broken connection is already gone and a repost reconnects.
				c.fail(err)
			}
			s.afterWrite(u.gen, err)
		}
		if err != nil {
			c.fail(err)
			return
		}
	}
}

// readLoop matches responses to sent stripes and places READ payloads.
func (c *dataConn) readLoop() {
	lim := wire.Limits{MaxRanges: maxRangesPerFrame, MaxPayload: maxStripeBytes, MaxControl: maxErrorBytes}
	var hb [wire.HeaderSize]byte
	var scratch [][]byte
	protocol := func(format string, args ...any) {
		c.p.a.refuse(ErrProtocol)
		c.fail(fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, args...)))
	}
	for {
		h, err := readHeader(c.c, hb[:], lim)
		if err != nil {
			c.fail(err)
			return
		}
		var u unit
		select {
		case u = <-c.fifo:
		default:
			protocol("unsolicited %v", h.Op)
			return
		}
		s := u.s
		if h.Req != s.r.id || h.Seq != uint32(s.idx) {
			protocol("%v for request %d stripe %d, expected request %d stripe %d", h.Op, h.Req, h.Seq, s.r.id, s.idx)
			return
		}
		switch h.Op {
		case wire.OpReadData:
			if s.r.op != Read || h.Length != uint64(s.bytes) {
				protocol("READ_DATA of %d bytes for a stripe of %d", h.Length, s.bytes)
				return
			}
			if s.startRead(u.gen) {
				scratch = append(scratch[:0], s.iov...)
				err := readvFull(c.c, c.rc, scratch)
				if err != nil {
					c.fail(err) // before resolving: see writeLoop
				}
				s.finishRead(u.gen, err)
				if err != nil {
					return
				}
				c.p.a.stats.bytesIn.Add(s.bytes)
			} else if err := discard(c.c, h.Length); err != nil {
				c.fail(err)
				return
			}
			c.budget.Release(s.bytes)
		case wire.OpWriteAck:
			if s.r.op != Write {
				protocol("WRITE_ACK for a READ")
				return
			}
			c.budget.Release(s.bytes)
			c.p.a.stats.bytesOut.Add(s.bytes)
			s.response(u.gen, nil)
		case wire.OpError:
			msg, err := readPayload(c.c, h.Length)
			if err != nil {
				c.fail(err)
				return
			}
			c.budget.Release(s.bytes)
			s.response(u.gen, &Error{Op: s.r.op.String(), Peer: c.p.name, Request: s.r.id, Desc: -1, Backend: BackendTCP,
				Kind: kindForCode(h.Count), Detail: "refused by the peer: " + string(msg)})
		default:
			protocol("unexpected %v on a data connection", h.Op)
			return
		}
	}
}
