package transfer

import (
	"net"
	"sync"
	"testing"
)

// faultProxy is a loopback TCP proxy for fault tests: it forwards connections to a target
// and can stall them (stop forwarding in both directions without closing, so the sender
// fills the socket buffers and blocks) or cut them (close everything).
type faultProxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	stalled bool
	resume  chan struct{} // closed when the stall ends
	conns   []net.Conn
	closed  bool
	wg      sync.WaitGroup
}

// newFaultProxy starts a proxy to target; it is closed at test cleanup.
func newFaultProxy(t *testing.T, target string) *faultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &faultProxy{ln: ln, target: target, resume: make(chan struct{})}
	close(p.resume)
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// addr returns the proxy's listen address.
func (p *faultProxy) addr() string { return p.ln.Addr().String() }

// accept forwards every accepted connection.
func (p *faultProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		if !p.track(c, u) {
			c.Close()
			u.Close()
			return
		}
		go p.pipe(u, c)
		go p.pipe(c, u)
	}
}

// track records a proxied pair of connections and counts its two pipes in p.wg; false once
// the proxy is closed.
func (p *faultProxy) track(c, u net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns = append(p.conns, c, u)
	p.wg.Add(2)
	return true
}

// pipe copies src to dst, honouring stalls.
func (p *faultProxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.wait() {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// wait blocks while the proxy is stalled; false once it is closed.
func (p *faultProxy) wait() bool {
	ch, closed := p.state()
	if closed {
		return false
	}
	<-ch
	_, closed = p.state()
	return !closed
}

// state returns the channel closed when forwarding resumes, and whether the proxy is closed.
func (p *faultProxy) state() (resume chan struct{}, closed bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.resume, p.closed
}

// stall stops forwarding (data already read by the proxy is held back).
func (p *faultProxy) stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.stalled {
		p.stalled = true
		p.resume = make(chan struct{})
	}
}

// unstall resumes forwarding.
func (p *faultProxy) unstall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stalled {
		p.stalled = false
		close(p.resume)
	}
}

// cut closes every proxied connection (the proxy keeps accepting).
func (p *faultProxy) cut() {
	for _, c := range p.takeConns() {
		c.Close()
	}
}

// takeConns detaches the proxied connections.
func (p *faultProxy) takeConns() []net.Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	conns := p.conns
	p.conns = nil
	return conns
}

// markClosed closes the proxy to new connections and stalls, and returns the proxied
// connections; first is false if it was closed already.
func (p *faultProxy) markClosed() (conns []net.Conn, first bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, false
	}
	p.closed = true
	if p.stalled {
		close(p.resume)
		p.stalled = false
	}
	return p.conns, true
}

// close shuts the proxy down and waits for its goroutines.
func (p *faultProxy) close() {
	conns, first := p.markClosed()
	if !first {
		return
	}
	p.ln.Close()
	for _, c := range conns {
		c.Close()
	}
	p.wg.Wait()
}
