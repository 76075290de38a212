package faultproxy_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"regexp"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/faultproxy"
)

// server is a loopback target: it echoes what it receives, or first sends greeting.
type server struct {
	ln       net.Listener
	greeting []byte
	received atomic.Int64
	accepted atomic.Int64
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

func startServer(t *testing.T, greeting []byte) *server {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &server{ln: ln, greeting: greeting}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.accepted.Add(1)
			s.mu.Lock()
			s.conns = append(s.conns, c)
			s.mu.Unlock()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer c.Close()
				if s.greeting != nil {
					if _, err := c.Write(s.greeting); err != nil {
						return
					}
				}
				buf := make([]byte, 4096)
				for {
					n, err := c.Read(buf)
					s.received.Add(int64(n))
					if n > 0 {
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		s.mu.Lock()
		for _, c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *server) addr() string { return s.ln.Addr().String() }

func newProxy(t *testing.T, target string) *faultproxy.Proxy {
	t.Helper()
	p, err := faultproxy.New(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func dial(t *testing.T, p *faultproxy.Proxy) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", p.Addr(), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	t.Cleanup(func() { c.Close() })
	return c
}

// eventually waits (at most 10 s) until cond holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func readN(t *testing.T, c net.Conn, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatalf("reading %d bytes: %v", n, err)
	}
	return b
}

func TestForwardsBothWaysAndHalfCloses(t *testing.T) {
	s := startServer(t, nil)
	p := newProxy(t, s.addr())
	c := dial(t, p)
	msg := bytes.Repeat([]byte("kvbridge "), 20000) // several chunks
	go func() { _, _ = c.Write(msg) }()
	if got := readN(t, c, len(msg)); !bytes.Equal(got, msg) {
		t.Fatal("echo differs")
	}
	// The client's half close reaches the server, whose close comes back as EOF.
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if n, err := c.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("after a half close: %d, %v; want EOF", n, err)
	}
	st := p.Stats()
	if st.Accepted != 1 || st.Forwarded[0] != int64(len(msg)) || st.Forwarded[1] != int64(len(msg)) {
		t.Errorf("stats %+v", st)
	}
	eventually(t, "the link to close", func() bool { return p.Stats().Open == 0 })
}

func TestStallHoldsBytesUntilResume(t *testing.T) {
	s := startServer(t, nil)
	p := newProxy(t, s.addr())
	c := dial(t, p)
	if _, err := c.Write([]byte("a")); err != nil {
		t.Fatal(err)
	}
	readN(t, c, 1)
	p.Stall(faultproxy.Up)
	if _, err := c.Write([]byte("held")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the bytes to be held", func() bool { return p.Stats().Held[0] == 4 })
	if got := s.received.Load(); got != 1 {
		t.Fatalf("the server received %d bytes during the stall, want 1", got)
	}
	p.Resume(faultproxy.Up)
	if got := readN(t, c, 4); string(got) != "held" {
		t.Fatalf("after resume: %q", got)
	}
}

func TestLatencyAppliesToWaitingChunks(t *testing.T) {
	s := startServer(t, nil)
	p := newProxy(t, s.addr())
	p.SetLatency(faultproxy.Down, time.Hour)
	c := dial(t, p)
	if _, err := c.Write([]byte("slow")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the echo to wait in the proxy", func() bool { return p.Stats().Held[1] == 4 })
	p.SetLatency(faultproxy.Down, 0)
	if got := readN(t, c, 4); string(got) != "slow" {
		t.Fatalf("got %q", got)
	}
}

func TestCloseAfterCutsMidStream(t *testing.T) {
	greeting := bytes.Repeat([]byte{7}, 100)
	s := startServer(t, greeting)
	p := newProxy(t, s.addr())
	p.CloseAfter(faultproxy.Down, 10)
	c := dial(t, p)
	got, err := io.ReadAll(c)
	if len(got) != 10 {
		t.Fatalf("read %d bytes (%v), want exactly 10 before the cut", len(got), err)
	}
	eventually(t, "the cut to be counted", func() bool { return p.Stats().Cut == 1 })
	// One-shot: the next connection is whole.
	c2 := dial(t, p)
	if got := readN(t, c2, 100); !bytes.Equal(got, greeting) {
		t.Fatal("second connection was not whole")
	}
}

func TestCorruptFlipsChosenBytes(t *testing.T) {
	greeting := make([]byte, 16)
	s := startServer(t, greeting)
	p := newProxy(t, s.addr())
	p.Corrupt(faultproxy.Down, 4, 2)
	c := dial(t, p)
	got := readN(t, c, len(greeting))
	for i, b := range got {
		flipped := i >= 2 && (i-2)%4 == 3
		if (b == 0xff) != flipped {
			t.Errorf("byte %d = %#x (flipped: %v)", i, b, flipped)
		}
	}
	if n := p.Stats().Corrupted; n != 3 {
		t.Errorf("counted %d corrupted bytes, want 3", n)
	}
}

func TestRefuseAndNoTarget(t *testing.T) {
	s := startServer(t, []byte("hi"))
	p := newProxy(t, "")
	// The reset may already fail the dial, or the first read.
	closedAtOnce := func(what string) {
		c, err := net.DialTimeout("tcp", p.Addr(), 10*time.Second)
		if err != nil {
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
			t.Fatalf("%s: %d, %v; want the connection closed", what, n, err)
		}
	}
	closedAtOnce("without a target")
	p.SetTarget(s.addr())
	if p.Target() != s.addr() {
		t.Fatal("target not set")
	}
	p.Refuse(true)
	closedAtOnce("refusing")
	if s.accepted.Load() != 0 {
		t.Fatal("a refused connection reached the target")
	}
	if got := p.Stats().Refused; got != 2 {
		t.Errorf("refused %d, want 2", got)
	}
	p.Reset()
	c := dial(t, p)
	if got := readN(t, c, 2); string(got) != "hi" {
		t.Fatalf("after Reset: %q", got)
	}
}

func TestStallOnPattern(t *testing.T) {
	s := startServer(t, nil)
	p := newProxy(t, s.addr())
	p.StallOn(faultproxy.Up, []byte("NOTIF"))
	c := dial(t, p)
	if _, err := c.Write([]byte("first")); err != nil {
		t.Fatal(err)
	}
	readN(t, c, 5)
	// The pattern straddles two writes.
	if _, err := c.Write([]byte("xxNO")); err != nil {
		t.Fatal(err)
	}
	readN(t, c, 4)
	if _, err := c.Write([]byte("TIFyy")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the pattern to be held", func() bool { return p.Stats().Held[0] == 5 })
	if _, err := c.Write([]byte("after")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "later bytes to be held too", func() bool { return p.Stats().Held[0] == 10 })
	// Other links keep flowing.
	c2 := dial(t, p)
	if _, err := c2.Write([]byte("NOTIF")); err != nil {
		t.Fatal(err)
	}
	if got := readN(t, c2, 5); string(got) != "NOTIF" {
		t.Fatalf("another link: %q", got)
	}
	p.Resume(faultproxy.Up)
	if got := readN(t, c, 10); string(got) != "TIFyyafter" {
		t.Fatalf("after resume: %q", got)
	}
}

func TestStallAfterSplitsAChunk(t *testing.T) {
	greeting := []byte("0123456789")
	s := startServer(t, greeting)
	p := newProxy(t, s.addr())
	p.StallAfter(faultproxy.Down, 4)
	c := dial(t, p)
	if got := readN(t, c, 4); string(got) != "0123" {
		t.Fatalf("before the stall: %q", got)
	}
	eventually(t, "the rest to be held", func() bool { return p.Stats().Held[1] == 6 })
	p.Resume(faultproxy.Down)
	if got := readN(t, c, 6); string(got) != "456789" {
		t.Fatalf("after resume: %q", got)
	}
}

func TestStallOnMatchAcrossChunks(t *testing.T) {
	s := startServer(t, nil)
	p := newProxy(t, s.addr())
	p.StallOnMatch(faultproxy.Up, regexp.MustCompile(`req-7[^,]*:1`))
	c := dial(t, p)
	for _, part := range []string{"HB:req-7-abc", ",x", "req-7-ab", "c:1"} {
		if _, err := c.Write([]byte(part)); err != nil {
			t.Fatal(err)
		}
		if part == "c:1" {
			break
		}
		readN(t, c, len(part))
	}
	eventually(t, "the notification to be held", func() bool { return p.Stats().Held[0] == 3 })
	p.Resume(faultproxy.Up)
	if got := readN(t, c, 3); string(got) != "c:1" {
		t.Fatalf("after resume: %q", got)
	}
}

func TestCutKeepsAccepting(t *testing.T) {
	s := startServer(t, nil)
	p := newProxy(t, s.addr())
	c := dial(t, p)
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	readN(t, c, 1)
	if n := p.Cut(); n != 1 {
		t.Fatalf("cut %d links", n)
	}
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("read after a cut succeeded")
	}
	c2 := dial(t, p)
	if _, err := c2.Write([]byte("y")); err != nil {
		t.Fatal(err)
	}
	if got := readN(t, c2, 1); string(got) != "y" {
		t.Fatal(string(got))
	}
}

func TestCloseIsIdempotentAndEndsEveryGoroutine(t *testing.T) {
	s := startServer(t, nil)
	before := runtime.NumGoroutine()
	p, err := faultproxy.New(s.addr())
	if err != nil {
		t.Fatal(err)
	}
	p.Stall(faultproxy.Both)
	p.SetLatency(faultproxy.Down, time.Hour)
	var conns []net.Conn
	for range 3 {
		c, err := net.DialTimeout("tcp", p.Addr(), 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		if _, err := c.Write([]byte("stuck")); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "three links", func() bool { return p.Stats().Open == 3 })
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for _, c := range conns {
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		var ne net.Error
		if _, err := c.Read(make([]byte, 1)); err == nil || (errors.As(err, &ne) && ne.Timeout()) {
			t.Fatalf("a client of a closed proxy read: %v", err)
		}
		c.Close()
	}
	if _, err := net.DialTimeout("tcp", p.Addr(), time.Second); err == nil {
		t.Error("a closed proxy accepted a connection")
	}
	// The server side ends once the proxy's target connections closed.
	eventually(t, "goroutines to return to their count before the proxy", func() bool { return runtime.NumGoroutine() <= before })
}

// TestSignalsFireWhenFaultsAct: the signal a stall or a cut returns fires when the fault acts —
// not while bytes merely pass through — so tests know the link is stalled or cut now.
func TestSignalsFireWhenFaultsAct(t *testing.T) {
	open := func(sig *faultproxy.Signal) bool {
		select {
		case <-sig.Done():
			return false
		default:
			return true
		}
	}
	t.Run("StallOn", func(t *testing.T) {
		s := startServer(t, nil)
		p := newProxy(t, s.addr())
		sig := p.StallOn(faultproxy.Up, []byte("NOTIF"))
		c := dial(t, p)
		for range 20 { // bytes flowing through (and held in flight for a moment) do not fire it
			if _, err := c.Write([]byte("data")); err != nil {
				t.Fatal(err)
			}
			readN(t, c, 4)
		}
		if !open(sig) {
			t.Fatal("the signal fired before the pattern passed")
		}
		if _, err := c.Write([]byte("NOTIF")); err != nil {
			t.Fatal(err)
		}
		if !sig.Wait(10 * time.Second) {
			t.Fatal("the signal did not fire when the pattern was held")
		}
		if got := p.Stats().Held[0]; got != 5 {
			t.Errorf("%d bytes held when the signal fired, want 5", got)
		}
	})
	t.Run("Stall", func(t *testing.T) {
		s := startServer(t, nil)
		p := newProxy(t, s.addr())
		c := dial(t, p)
		sig := p.Stall(faultproxy.Up)
		if !open(sig) {
			t.Fatal("the signal fired with nothing held")
		}
		if _, err := c.Write([]byte("held")); err != nil {
			t.Fatal(err)
		}
		if !sig.Wait(10 * time.Second) {
			t.Fatal("the signal did not fire when bytes were held")
		}
	})
	t.Run("StallAfter", func(t *testing.T) {
		s := startServer(t, []byte("0123456789"))
		p := newProxy(t, s.addr())
		sig := p.StallAfter(faultproxy.Down, 4)
		c := dial(t, p)
		if !sig.Wait(10 * time.Second) {
			t.Fatal("the signal did not fire at the stall point")
		}
		if got := readN(t, c, 4); string(got) != "0123" {
			t.Fatalf("before the stall: %q", got)
		}
	})
	t.Run("CloseAfter", func(t *testing.T) {
		s := startServer(t, bytes.Repeat([]byte{7}, 100))
		p := newProxy(t, s.addr())
		sig := p.CloseAfter(faultproxy.Down, 10)
		c := dial(t, p)
		if !sig.Wait(10 * time.Second) {
			t.Fatal("the signal did not fire at the cut")
		}
		if got, _ := io.ReadAll(c); len(got) != 10 {
			t.Fatalf("read %d bytes, want 10", len(got))
		}
		if p.Stats().Cut != 1 {
			t.Errorf("cut %d, want 1", p.Stats().Cut)
		}
	})
}

// TestStallOnSplitsAChunk: the bytes before a StallOn match go through even when they arrive in
// the same read as the match (an HTTP response's headers and its first event); the match and
// what follows are held.
func TestStallOnSplitsAChunk(t *testing.T) {
	s := startServer(t, []byte("HTTP/1.1 200 OK\r\n\r\ndata: one\n\n"))
	p := newProxy(t, s.addr())
	sig := p.StallOn(faultproxy.Down, []byte("data: "))
	c := dial(t, p)
	if got := readN(t, c, 19); string(got) != "HTTP/1.1 200 OK\r\n\r\n" {
		t.Fatalf("before the match: %q", got)
	}
	if !sig.Wait(10 * time.Second) {
		t.Fatal("the stall did not fire")
	}
	if got := p.Stats().Held[1]; got != 11 {
		t.Fatalf("%d bytes held, want the 11 from the match on", got)
	}
	p.Resume(faultproxy.Down)
	if got := readN(t, c, 11); string(got) != "data: one\n\n" {
		t.Fatalf("after resume: %q", got)
	}
}
