package transfer

import (
	"net"
	"testing"
)

// TestOnPeerLostCurrentConnOnly: OnPeerLost reports the end of the peer's current control
// connection, not the end of one this agent no longer uses (after a teardown and reconnect),
// which would make the owner drop a live peer.
func TestOnPeerLostCurrentConnOnly(t *testing.T) {
	type loss struct {
		name string
		inc  uint64
	}
	lost := make(chan loss, 4)
	p := newPair(t, Config{}, Config{OnPeerLost: func(name string, inc uint64) { lost <- loss{name, inc} }}, 1<<16, PermRead)
	ll, rl := p.lists(t, 4096, nil)
	req, err := p.ini.MakeRequest(Read, ll, seq(1), rl, seq(1), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer req.Release()
	if err := postWait(t, req, []byte("n1")); err != nil { // dials the control connection
		t.Fatal(err)
	}
	recvNotif(t, p.tgt)
	pp := p.ini.lookupPeer(p.peer)
	current := func() *ctrlConn {
		pp.mu.Lock()
		defer pp.mu.Unlock()
		if pp.uconn != nil {
			return pp.uconn
		}
		return pp.tconn
	}
	cur := current()
	if cur == nil {
		t.Fatal("no control connection after a post with a notification")
	}

	// The end of a control connection that is not the current one (run synchronously: the
	// hook, if called, has been called when watch returns).
	stale, other := net.Pipe()
	other.Close()
	pp.watch(newCtrlConn(p.ini, stale, pp.name, pp.inc, false))
	select {
	case l := <-lost:
		t.Fatalf("OnPeerLost(%s, %016x) for a connection that was not the current one", l.name, l.inc)
	default:
	}
	if current() != cur {
		t.Fatal("the end of a stale connection tore the current link down")
	}
	if err := postWait(t, req, []byte("n2")); err != nil {
		t.Fatal(err)
	}
	recvNotif(t, p.tgt)

	// The peer closing its agent ends the current connection: reported, once.
	info, _ := p.ini.Peer(p.peer)
	p.tgt.Close()
	select {
	case l := <-lost:
		if l.name != p.peer || l.inc != info.Incarnation {
			t.Fatalf("OnPeerLost(%s, %016x), want (%s, %016x)", l.name, l.inc, p.peer, info.Incarnation)
		}
	case <-testCtx(t).Done():
		t.Fatal("OnPeerLost not called when the peer closed")
	}
}
