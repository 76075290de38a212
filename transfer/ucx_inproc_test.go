//go:build ucx && cgo

package transfer

import (
	"bytes"
	"context"
	"net"
	"runtime"
	"strings"
	"testing"
)

// TestUCXWriteNotifAfterData: when the target sees a UCX WRITE's notification, the data is
// there (the notification leaves after the flush that completes the puts remotely).
func TestUCXWriteNotifAfterData(t *testing.T) {
	for _, tls := range ucxTransports {
		t.Run(tls, func(t *testing.T) {
			p := newPair(t, ucxConfig(tls), ucxConfig(tls), 4<<20, PermReadWrite)
			req := writeNotifAfterData(t, p, nil)
			if tel := req.Telemetry(); tel.Backend != BackendUCX || tel.Bytes != 4<<20 || tel.Err != nil {
				t.Fatalf("telemetry %+v", tel)
			}
		})
	}
}

// TestUCXNewArenaAfterConnect: a region in an arena registered after the link was made is
// readable once the peer's metadata is reloaded (its remote key is unpacked on first use).
func TestUCXNewArenaAfterConnect(t *testing.T) {
	p := newPair(t, ucxConfig("tcp"), ucxConfig("tcp"), 1<<20, PermRead)
	ll, rl := p.lists(t, 64<<10, nil)
	first, err := p.ini.MakeRequest(Read, ll, seq(16), rl, seq(16), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Release()
	if err := postWait(t, first, nil); err != nil {
		t.Fatal(err)
	}
	ar2 := newTestArena(t, 1<<20)
	fillPattern(ar2.Bytes(), 0x55)
	r2 := mustRegister(t, p.tgt, ar2, PermRead)
	if _, err := p.ini.LoadRemote(p.tgt.LocalMetadata()); err != nil {
		t.Fatal(err)
	}
	req, err := p.ini.CreateRequest(testCtx(t), Read, []Desc{p.rI.Desc(0, 1<<20)}, p.peer, []Desc{r2.Desc(0, 1<<20)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer req.Release()
	if err := postWait(t, req, nil); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p.arI.Bytes(), ar2.Bytes()) {
		t.Fatal("READ from the new arena brought other bytes")
	}
	if st := p.ini.Stats(); st.Connects != 1 {
		t.Fatalf("%d connects: the link should have been reused", st.Connects)
	}
}

// TestUCXRefusals: what UCX cannot or must not do is refused with a clear error.
func TestUCXRefusals(t *testing.T) {
	p := newPair(t, ucxConfig("tcp"), ucxConfig("tcp"), 1<<20, PermRead)
	_, rl := p.lists(t, 64<<10, nil)

	// Heap memory is never handed to UCX (it keeps using it after Post returns).
	heap := make([]byte, 1<<20)
	hr, err := p.ini.RegisterBytes(heap, 0)
	if err != nil {
		t.Fatal(err)
	}
	hl, err := p.ini.PrepareLocal(BlockDescs(hr.ID(), 0, 64<<10, 16))
	if err != nil {
		t.Fatal(err)
	}
	defer hl.Release()
	_, err = p.ini.MakeRequest(Read, hl, seq(16), rl, seq(16), nil)
	wantKind(t, err, ErrNotSupported)
	if !strings.Contains(err.Error(), "not in an arena") {
		t.Fatalf("error %q", err)
	}

	// The target grants READ only: a WRITE is refused before anything moves.
	ll, err := p.ini.PrepareLocal(BlockDescs(p.rI.ID(), 0, 64<<10, 16))
	if err != nil {
		t.Fatal(err)
	}
	defer ll.Release()
	_, err = p.ini.MakeRequest(Write, ll, seq(16), rl, seq(16), nil)
	wantKind(t, err, ErrPermission)

	// UCX's transports do not authenticate: no agent combines them with a shared secret.
	auth, err := NewHMACAuth([]byte("secret"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := ucxConfig("tcp")
	cfg.Auth = auth
	_, err = NewAgent("authed", cfg)
	wantKind(t, err, ErrNotSupported)

	for _, bad := range []Config{
		{Backends: []string{"UCX"}, UCXWorkers: 65},
		{Backends: []string{"UCX"}, UCX: map[string]string{"A=B": "c"}},
		{Backends: []string{"UCX"}, UCX: map[string]string{"TLS": "no-such-transport"}},
	} {
		if a, err := NewAgent("bad", bad); err == nil {
			a.Close()
			t.Fatalf("%+v accepted", bad)
		}
	}
}

// TestUCXFallback: an initiator that prefers UCX falls back to TCP, and says why, when the
// peer does not offer UCX; a peer without UCX keeps publishing metadata format 1.
func TestUCXFallback(t *testing.T) {
	p := newPair(t, Config{}, Config{Backends: []string{"UCX", "TCP"}}, 1<<20, PermRead)
	if m, err := decodeMetadata(p.tgt.LocalMetadata()); err != nil || m.Version != metadataVersion {
		t.Fatalf("target metadata version %v (%v)", m, err)
	}
	_, rl := p.lists(t, 64<<10, nil)
	if rl.Backend() != BackendTCP || !strings.Contains(rl.FallbackReason(), "peer offers no UCX worker") {
		t.Fatalf("backend %v, fallback %q", rl.Backend(), rl.FallbackReason())
	}
	info, _ := p.ini.Peer(p.peer)
	if len(info.Offers) != 2 || info.Offers[0] != BackendSHM || info.Offers[1] != BackendTCP {
		t.Fatalf("offers %v", info.Offers)
	}
}

// TestUCXCloseInFlight: closing the agents while UCX transfers are in flight ends them, every
// goroutine of the package exits (the target's answer worker's too), and Close stays
// idempotent.
func TestUCXCloseInFlight(t *testing.T) {
	cfg := ucxConfig("tcp")
	cfg.UCXWorkers = 3
	p := newPair(t, cfg, cfg, 16<<20, PermReadWrite)
	ll, rl := p.lists(t, 1<<20, nil)
	// The target answers the initiator, whose metadata it has not loaded, from its answer
	// worker, which starts now.
	if err := p.tgt.SendNotif(testCtx(t), "initiator", []byte("back")); err != nil {
		t.Fatal(err)
	}
	if nt := recvNotif(t, p.ini); string(nt.Msg) != "back" {
		t.Fatalf("notification %q", nt.Msg)
	}
	e := p.tgt.ucx
	e.ansMu.Lock()
	started := e.answer != nil
	e.ansMu.Unlock()
	if !started {
		t.Fatal("the target's answer worker did not start")
	}
	var reqs []*Request
	for _, op := range []Op{Read, Write} {
		r, err := p.ini.MakeRequest(op, ll, seq(8), rl, seq(8), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Post(context.Background(), []byte("n")); err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	p.ini.Close()
	for _, r := range reqs {
		select {
		case <-r.Done():
		case <-testCtx(t).Done():
			t.Fatal("a request in flight did not end with Close")
		}
		if err := r.Err(); err != nil {
			wantKind(t, err, ErrClosed)
		}
	}
	p.ini.Close()
	p.tgt.Close()
	assertNoGoroutines(t)
}

// TestUCXGoPanicsRecover: UCX's error signal handlers do not take over the process: a nil
// dereference in Go code is still a recoverable panic with UCX running.
func TestUCXGoPanicsRecover(t *testing.T) {
	newTestAgent(t, "signals", ucxConfig("tcp"))
	recovered := func() (r any) {
		defer func() { r = recover() }()
		var p *Request
		runtime.KeepAlive(p.id)
		return nil
	}()
	if recovered == nil {
		t.Fatal("no panic")
	}
}

// TestUCXEnvironment: UCX_TLS and UCX_NET_DEVICES reach UCX (as with NIXL): forcing TCP on a
// non-loopback interface puts every lane there.
func TestUCXEnvironment(t *testing.T) {
	dev := ""
	ifs, _ := net.Interfaces()
	for _, ifc := range ifs {
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() && ifc.Flags&net.FlagUp != 0 && dev == "" {
				dev = ifc.Name
			}
		}
	}
	if dev == "" {
		t.Skip("no interface with an IPv4 address besides loopback")
	}
	t.Setenv("UCX_TLS", "tcp")
	t.Setenv("UCX_NET_DEVICES", dev)
	cfg := Config{Backends: []string{"UCX"}}
	p := newPair(t, cfg, cfg, 1<<20, PermRead)
	p.lists(t, 64<<10, nil)
	info, _ := p.ini.Peer(p.peer)
	if len(info.UCXLanes) == 0 {
		t.Fatal("no lanes")
	}
	for _, l := range info.UCXLanes {
		if !strings.HasPrefix(l, "tcp/"+dev) {
			t.Fatalf("lanes %q with UCX_TLS=tcp UCX_NET_DEVICES=%s", info.UCXLanes, dev)
		}
	}
}
