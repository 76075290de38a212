// Package faultproxy is a loopback TCP proxy for fault tests: it listens on 127.0.0.1, forwards
// every connection to a target and injects faults that can be switched at run time — added
// latency, stalls, a close after a number of bytes, corrupted bytes, refused connections and
// cuts. Tests place it between two components (a proxy and an engine's HTTP server, a consumer
// and a producer's side channel or transfer listener) and watch the components cope.
//
// Each accepted connection is a link: two directions (Up: client → target, Down: target →
// client), each with a reader goroutine that reads from one side into a bounded queue and a
// writer goroutine that applies the faults and writes to the other side. Faults act on whole
// reads ("chunks"); an end of stream travels in order behind the data, so a stall holds the end
// of a stream too, as a silent network would.
//
// A Proxy is owned by its creator: Close (idempotent) closes the listener and every link and
// waits for every goroutine the proxy started.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package faultproxy

import (
	"errors"
	"fmt"
	"net"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Direction is one direction of a link.
type Direction uint8

// The directions. Fault setters accept Both.
const (
	// Up is client → target (requests).
	Up Direction = 1 << iota
	// Down is target → client (responses).
	Down
	// Both is Up and Down.
	Both = Up | Down
)

// String returns "up", "down" or "both".
func (d Direction) String() string {
	switch d {
	case Up:
		return "up"
	case Down:
		return "down"
	case Both:
		return "both"
	}
	return "direction(" + strconv.Itoa(int(d)) + ")"
}

// index returns 0 for Up and 1 for Down.
func (d Direction) index() int {
	if d == Down {
		return 1
	}
	return 0
}

// chunkSize is the largest read a reader makes; queueLen chunks may wait per direction, after
// which the reader stops reading and the sender feels TCP back-pressure.
const (
	chunkSize = 32 << 10
	queueLen  = 16
)

// dirFaults are the faults of one direction.
type dirFaults struct {
	latency    time.Duration
	stalled    bool
	stallOn    *regexp.Regexp // stall the link about to forward bytes that match
	closeAfter int64          // bytes left before the link that forwards them is cut; < 0 = off
	stallAfter int64          // bytes left before the direction stalls; < 0 = off
	corrupt    int64          // flip every corrupt-th byte forwarded (per link); 0 = off
	skip       int64          // corrupt only after this many bytes of each link
	// stallFired and cutFired tell the test that armed a stall or a cut when it has acted.
	stallFired, cutFired *Signal
}

// Signal is closed once, when the fault that returned it has acted: a stall holds bytes, a
// cut closed a link. Tests wait on it instead of guessing from counters that also move for
// bytes merely passing through.
type Signal struct {
	once sync.Once
	ch   chan struct{}
}

func newSignal() *Signal { return &Signal{ch: make(chan struct{})} }

// fire closes the signal (once); a nil signal does nothing.
func (s *Signal) fire() {
	if s != nil {
		s.once.Do(func() { close(s.ch) })
	}
}

// Done returns a channel closed when the fault has acted.
func (s *Signal) Done() <-chan struct{} { return s.ch }

// Wait blocks until the fault has acted, or for at most d; it reports whether it acted.
func (s *Signal) Wait(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-s.ch:
		return true
	case <-t.C:
		return false
	}
}

// Stats are a Proxy's counters.
type Stats struct {
	// Accepted counts connections forwarded to the target; Refused those closed at once
	// (Refuse, no target, or a target that did not answer); Cut the links closed by a fault
	// (Cut, CloseAfter); Open the links currently open.
	Accepted, Refused, Cut, Open int64
	// Forwarded is the bytes written to the receiving side, and Held the bytes of open links
	// read but not yet written (queued behind a stall or latency), indexed by direction:
	// [0] Up, [1] Down.
	Forwarded, Held [2]int64
	// Corrupted counts bytes flipped.
	Corrupted int64
}

// Proxy is a fault-injecting TCP proxy. All methods are safe for concurrent use.
type Proxy struct {
	ln net.Listener

	mu      sync.Mutex
	target  string
	refuse  bool
	faults  [2]dirFaults
	changed chan struct{} // closed and replaced whenever a fault changes
	links   map[*link]struct{}
	closed  bool
	done    chan struct{} // closed by Close

	wg        sync.WaitGroup
	accepted  atomic.Int64
	refused   atomic.Int64
	cut       atomic.Int64
	forwarded [2]atomic.Int64
	corrupted atomic.Int64
}

// New starts a proxy on 127.0.0.1 with a free port that forwards to target (host:port). The
// target may be empty: connections are then refused until SetTarget names one.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: listen: %w", err)
	}
	p := &Proxy{ln: ln, target: target, changed: make(chan struct{}), links: map[*link]struct{}{}, done: make(chan struct{})}
	for i := range p.faults {
		p.faults[i].closeAfter, p.faults[i].stallAfter = -1, -1
	}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr returns the listen address (127.0.0.1:port).
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port returns the listen port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// URL returns "http://" + Addr(), for placing the proxy in front of an HTTP server.
func (p *Proxy) URL() string { return "http://" + p.Addr() }

// SetTarget changes where new connections go; open links keep their target. A proxy never
// forwards to itself: connections are refused while the target is its own address.
func (p *Proxy) SetTarget(addr string) {
	p.mu.Lock()
	p.target = addr
	p.mu.Unlock()
}

// Target returns the current target.
func (p *Proxy) Target() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.target
}

// update applies f to the faults of the directions in dir and wakes every waiting writer.
func (p *Proxy) update(dir Direction, f func(*dirFaults)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range []Direction{Up, Down} {
		if dir&d != 0 {
			f(&p.faults[d.index()])
		}
	}
	close(p.changed)
	p.changed = make(chan struct{})
}

// SetLatency delays every chunk in dir by d from the moment it was read (0 turns it off). A
// change applies to chunks already waiting.
func (p *Proxy) SetLatency(dir Direction, d time.Duration) {
	p.update(dir, func(f *dirFaults) { f.latency = max(d, 0) })
}

// Stall stops forwarding in dir without closing anything: bytes (and ends of stream) are held,
// the senders fill the socket buffers and block. The signal fires when a chunk is first held.
func (p *Proxy) Stall(dir Direction) *Signal {
	sig := newSignal()
	p.update(dir, func(f *dirFaults) { f.stalled, f.stallFired = true, sig })
	return sig
}

// StallOn stalls, in dir, the first link that is about to forward pattern: the bytes before the
// match still go through (within the same read too), the match and everything after it are
// held; other links keep flowing. The pattern (at most 256 bytes) is matched across the chunk
// boundaries of a link (a match that began in forwarded bytes holds from the current chunk on).
// It fires once; the signal fires with it.
func (p *Proxy) StallOn(dir Direction, pattern []byte) *Signal {
	return p.StallOnMatch(dir, regexp.MustCompile(regexp.QuoteMeta(string(pattern))))
}

// StallOnMatch is StallOn with a regular expression. A match counts when it ends in the chunk
// about to be forwarded; it may start in the link's last 256 forwarded bytes.
func (p *Proxy) StallOnMatch(dir Direction, re *regexp.Regexp) *Signal {
	sig := newSignal()
	p.update(dir, func(f *dirFaults) { f.stallOn, f.stallFired = re, sig })
	return sig
}

// Resume ends the stalls in dir (Stall, and the link stalled by StallOn, which is disarmed):
// held bytes flow again.
func (p *Proxy) Resume(dir Direction) {
	p.mu.Lock()
	for l := range p.links {
		for _, d := range []Direction{Up, Down} {
			if dir&d != 0 {
				l.held[d.index()] = false
			}
		}
	}
	p.mu.Unlock()
	p.update(dir, func(f *dirFaults) { f.stalled, f.stallOn = false, nil })
}

// CloseAfter cuts, once, the link that forwards the n-th byte in dir from now (counting every
// link): exactly n more bytes are forwarded, then that link is closed on both sides. n ≤ 0
// cuts the next link that has anything to forward in dir. The signal fires when the link is cut.
func (p *Proxy) CloseAfter(dir Direction, n int64) *Signal {
	sig := newSignal()
	p.update(dir, func(f *dirFaults) { f.closeAfter, f.cutFired = max(n, 0), sig })
	return sig
}

// StallAfter forwards n more bytes in dir (counting every link) and then stalls dir, as Stall
// does: a stall in the middle of a stream, whose first part was delivered. The signal fires
// when the n-th byte has been forwarded and the stall begins.
func (p *Proxy) StallAfter(dir Direction, n int64) *Signal {
	sig := newSignal()
	p.update(dir, func(f *dirFaults) { f.stallAfter, f.stallFired = max(n, 0), sig })
	return sig
}

// Corrupt flips all bits of every every-th byte forwarded in dir on each link, after the
// link's first skip bytes in that direction (every ≤ 0 turns it off).
func (p *Proxy) Corrupt(dir Direction, every, skip int64) {
	p.update(dir, func(f *dirFaults) { f.corrupt, f.skip = max(every, 0), max(skip, 0) })
}

// Refuse makes the proxy close new connections at once (with a reset) while on is true; open
// links are not affected.
func (p *Proxy) Refuse(on bool) {
	p.mu.Lock()
	p.refuse = on
	p.mu.Unlock()
}

// Reset turns every fault off: held bytes flow, latency ends, corruption and pending cuts are
// disarmed, new connections are accepted.
func (p *Proxy) Reset() {
	p.Refuse(false)
	p.Resume(Both)
	p.update(Both, func(f *dirFaults) { *f = dirFaults{closeAfter: -1, stallAfter: -1} })
}

// Cut closes every open link now (the proxy keeps accepting). It returns how many it closed.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	for _, l := range links {
		if l.close() {
			p.cut.Add(1)
		}
	}
	return len(links)
}

// Stats returns a snapshot of the counters.
func (p *Proxy) Stats() Stats {
	s := Stats{Accepted: p.accepted.Load(), Refused: p.refused.Load(), Cut: p.cut.Load(), Corrupted: p.corrupted.Load()}
	p.mu.Lock()
	s.Open = int64(len(p.links))
	for l := range p.links {
		for i := range 2 {
			s.Held[i] += l.read[i].Load() - l.fwd[i].Load()
		}
	}
	p.mu.Unlock()
	for i := range 2 {
		s.Forwarded[i] = p.forwarded[i].Load()
	}
	return s
}

// Close closes the listener and every link and waits for every goroutine of the proxy. It is
// idempotent.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.done)
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	err := p.ln.Close()
	for _, l := range links {
		l.close()
	}
	p.wg.Wait()
	return err
}

// accept forwards connections until the listener closes.
func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// A transient failure (out of file descriptors, an aborted handshake): retry soon.
			select {
			case <-p.done:
				return
			case <-time.After(5 * time.Millisecond):
			}
			continue
		}
		p.mu.Lock()
		target, refuse, closed := p.target, p.refuse, p.closed
		p.mu.Unlock()
		if closed {
			c.Close()
			return
		}
		if refuse || target == "" || target == p.Addr() {
			p.reset(c)
			continue
		}
		// Dial on a goroutine so that a slow target never holds up other clients.
		p.wg.Add(1)
		go p.dial(c, target)
	}
}

// reset closes c with an RST.
func (p *Proxy) reset(c net.Conn) {
	p.refused.Add(1)
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
}

func (p *Proxy) dial(c net.Conn, target string) {
	defer p.wg.Done()
	d := net.Dialer{Timeout: 5 * time.Second}
	u, err := d.Dial("tcp", target)
	if err != nil {
		p.reset(c)
		return
	}
	l := &link{p: p, conns: [2]net.Conn{c, u}, done: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.Close()
		u.Close()
		return
	}
	p.links[l] = struct{}{}
	p.wg.Add(4)
	p.mu.Unlock()
	p.accepted.Add(1)
	for _, dir := range []Direction{Up, Down} {
		q := make(chan chunk, queueLen)
		go l.reader(dir, q)
		go l.writer(dir, q)
	}
}

// link is one proxied connection: conns[0] is the client's, conns[1] the target's.
type link struct {
	p       *Proxy
	conns   [2]net.Conn
	done    chan struct{}
	once    sync.Once
	ended   atomic.Int32 // directions whose stream ended in order
	removed atomic.Bool
	held    [2]bool         // stalled by StallOn, per direction (guarded by p.mu)
	read    [2]atomic.Int64 // bytes read per direction (less bytes dropped by a cut)
	fwd     [2]atomic.Int64 // bytes forwarded per direction
}

// src and dst return the connections a direction reads from and writes to.
func (l *link) src(dir Direction) net.Conn { return l.conns[dir.index()] }
func (l *link) dst(dir Direction) net.Conn { return l.conns[1-dir.index()] }

// close closes both connections; it reports whether this call closed them.
func (l *link) close() bool {
	first := false
	l.once.Do(func() {
		first = true
		close(l.done)
		l.conns[0].Close()
		l.conns[1].Close()
		l.remove()
	})
	return first
}

func (l *link) remove() {
	if l.removed.CompareAndSwap(false, true) {
		l.p.mu.Lock()
		delete(l.p.links, l)
		l.p.mu.Unlock()
	}
}

// chunk is one read, with the time it was read (latency counts from there).
type chunk struct {
	b  []byte
	at time.Time
}

// reader reads dir's source into q; it closes q at the end of the stream (or on error).
func (l *link) reader(dir Direction, q chan<- chunk) {
	defer l.p.wg.Done()
	defer close(q)
	src := l.src(dir)
	for {
		buf := make([]byte, chunkSize)
		n, err := src.Read(buf)
		if n > 0 {
			l.read[dir.index()].Add(int64(n))
			select {
			case q <- chunk{buf[:n], time.Now()}:
			case <-l.done:
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// writer forwards q to dir's destination, applying the faults.
func (l *link) writer(dir Direction, q <-chan chunk) {
	defer l.p.wg.Done()
	var sent int64  // bytes forwarded on this link in dir
	var tail []byte // the end of what was forwarded, for patterns across chunks
	for {
		var c chunk
		select {
		case b, ok := <-q:
			if !ok {
				l.endStream(dir)
				return
			}
			c = b
		case <-l.done:
			return
		}
		ok, split := l.waitTurn(dir, c, tail)
		if !ok {
			return
		}
		if split > 0 {
			// The bytes before a StallOn match go through; the rest waits as a chunk of its own.
			if !l.forward(dir, chunk{c.b[:split], c.at}, &sent, &tail) {
				return
			}
			c.b = c.b[split:]
			if ok, _ = l.waitTurn(dir, c, tail); !ok {
				return
			}
		}
		if !l.forward(dir, c, &sent, &tail) {
			return
		}
	}
}

// forward applies CloseAfter, StallAfter and Corrupt to chunk c, whose turn has come, and writes
// it to dir's destination (a stall StallAfter sets inside it holds the rest of it). sent and
// tail track what the link forwarded. It returns false when the link is gone.
func (l *link) forward(dir Direction, c chunk, sent *int64, tail *[]byte) bool {
	dst := l.dst(dir)
	b, rest, cut, cutSig := l.p.take(dir, c.b, *sent)
	l.read[dir.index()].Add(int64(len(b) + len(rest) - len(c.b))) // a cut drops the rest of the chunk
	*tail = keepTail(*tail, b)
	if len(b) > 0 {
		_, err := dst.Write(b)
		l.fwd[dir.index()].Add(int64(len(b)))
		l.p.forwarded[dir.index()].Add(int64(len(b)))
		if err != nil {
			l.close()
			cutSig.fire() // the link is gone either way
			return false
		}
		*sent += int64(len(b))
	}
	if cut {
		if l.close() {
			l.p.cut.Add(1)
		}
		cutSig.fire()
		return false
	}
	if len(rest) > 0 { // StallAfter split the chunk: the rest waits for the stall to end
		if ok, _ := l.waitTurn(dir, chunk{rest, c.at}, *tail); !ok {
			return false
		}
		_, err := dst.Write(rest)
		l.fwd[dir.index()].Add(int64(len(rest)))
		l.p.forwarded[dir.index()].Add(int64(len(rest)))
		if err != nil {
			l.close()
			return false
		}
		*sent += int64(len(rest))
		*tail = keepTail(*tail, rest)
	}
	return true
}

// keepTail remembers the last bytes forwarded, enough to match a pattern of up to 256 bytes
// that straddles two chunks.
func keepTail(tail, b []byte) []byte {
	const keep = 256
	tail = append(tail, b...)
	if len(tail) > keep {
		tail = append(tail[:0], tail[len(tail)-keep:]...)
	}
	return tail
}

// waitTurn blocks until chunk c may be forwarded in dir: its latency has passed and dir is not
// stalled. It returns false when the link or the proxy closes. When a StallOn pattern matches
// inside c, it returns at once with split > 0: the caller forwards c.b[:split] and waits again
// with the rest, which is held.
func (l *link) waitTurn(dir Direction, c chunk, tail []byte) (ok bool, split int) {
	for {
		l.p.mu.Lock()
		f := &l.p.faults[dir.index()]
		if f.stallOn != nil {
			if at, match := matchAcross(tail, c.b, f.stallOn); match {
				f.stallOn, l.held[dir.index()] = nil, true
				if at > 0 {
					l.p.mu.Unlock()
					return true, at
				}
			}
		}
		stalled, latency, changed := f.stalled || l.held[dir.index()], f.latency, l.p.changed
		if stalled {
			f.stallFired.fire() // this chunk is held now
		}
		l.p.mu.Unlock()
		var tm *time.Timer
		var wait <-chan time.Time
		switch left := latency - time.Since(c.at); {
		case stalled:
		case left > 0:
			tm = time.NewTimer(left)
			wait = tm.C
		default:
			return true, 0
		}
		select {
		case <-changed:
		case <-wait:
		case <-l.done:
			if tm != nil {
				tm.Stop()
			}
			return false, 0
		}
		if tm != nil {
			tm.Stop()
		}
	}
}

// matchAcross reports whether re matches tail followed by b with a match that ends in b, and
// where in b the first such match starts (0 when it starts in tail).
func matchAcross(tail, b []byte, re *regexp.Regexp) (at int, ok bool) {
	joined := append(append([]byte(nil), tail...), b...)
	for _, m := range re.FindAllIndex(joined, -1) {
		if m[1] > len(tail) {
			return max(m[0]-len(tail), 0), true
		}
	}
	return 0, false
}

// take applies CloseAfter, StallAfter and Corrupt to chunk b, of which sent bytes of the link
// precede it in dir. It returns the bytes to forward now, the bytes to forward once a stall set
// by StallAfter ends, and whether the link is cut after the first ones (then the CloseAfter
// signal to fire once it is).
func (p *Proxy) take(dir Direction, b []byte, sent int64) (now, rest []byte, cut bool, cutSig *Signal) {
	p.mu.Lock()
	f := &p.faults[dir.index()]
	if f.closeAfter >= 0 {
		if int64(len(b)) >= f.closeAfter {
			b, cut = b[:f.closeAfter], true
			f.closeAfter = -1
			cutSig = f.cutFired
		} else {
			f.closeAfter -= int64(len(b))
		}
	}
	if f.stallAfter >= 0 && !cut {
		if int64(len(b)) >= f.stallAfter {
			b, rest = b[:f.stallAfter], b[f.stallAfter:]
			f.stallAfter, f.stalled = -1, true
			f.stallFired.fire()
			close(p.changed)
			p.changed = make(chan struct{})
		} else {
			f.stallAfter -= int64(len(b))
		}
	}
	every, skip := f.corrupt, f.skip
	p.mu.Unlock()
	if every > 0 {
		for i := range b {
			pos := sent + int64(i) // position in this link's stream
			if pos >= skip && (pos-skip)%every == every-1 {
				b[i] ^= 0xff
				p.corrupted.Add(1)
			}
		}
		for i := range rest {
			pos := sent + int64(len(b)+i)
			if pos >= skip && (pos-skip)%every == every-1 {
				rest[i] ^= 0xff
				p.corrupted.Add(1)
			}
		}
	}
	return b, rest, cut, cutSig
}

// endStream passes the end of dir's stream on (a half close); when both directions have
// ended, the link is closed.
func (l *link) endStream(dir Direction) {
	if tc, ok := l.dst(dir).(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	}
	if l.ended.Add(1) == 2 {
		l.close()
	}
}
