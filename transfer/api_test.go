package transfer

import (
	"bytes"
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestWriteNotifAfterData: when the target sees a WRITE's notification, the data is there.
func TestWriteNotifAfterData(t *testing.T) {
	for _, be := range []string{"SHM", "TCP"} {
		t.Run(be, func(t *testing.T) {
			p := newPair(t, Config{}, Config{}, 4<<20, PermReadWrite)
			writeNotifAfterData(t, p, &PrepareOptions{Backends: []string{be}})
		})
	}
}

// writeNotifAfterData posts a WRITE of the whole arena five times, each time checking that
// the target's notification alone implies the data (no Wait before the check), and that the
// notifications carry the initiator's identity and sequence numbers in order.
func writeNotifAfterData(t *testing.T, p *pair, opts *PrepareOptions) *Request {
	t.Helper()
	ll, rl := p.lists(t, 64<<10, opts)
	req, err := p.ini.MakeRequest(Write, ll, seq(64), rl, seq(64), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(req.Release)
	var last uint64
	for i := range 5 {
		fillPattern(p.arI.Bytes(), uint64(i+10))
		if err := req.Post(testCtx(t), []byte("w")); err != nil {
			t.Fatal(err)
		}
		n := recvNotif(t, p.tgt)
		if n.Peer != "initiator" || n.Incarnation != p.ini.Incarnation() || n.Seq <= last {
			t.Fatalf("notification %+v after seq %d", n, last)
		}
		last = n.Seq
		if !bytes.Equal(p.arT.Bytes(), p.arI.Bytes()) {
			t.Fatalf("post %d: notification before the data", i)
		}
		if err := req.Wait(testCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	return req
}

// TestCancelAndRelease: a canceled context or Release ends an active post with ErrCanceled.
func TestCancelAndRelease(t *testing.T) {
	p := newPair(t, Config{}, Config{}, 4<<20, PermReadWrite)
	tcpAddr, _ := p.tgt.Addrs()
	px := newFaultProxy(t, tcpAddr)
	blob := rewriteMeta(t, p.tgt.LocalMetadata(), func(m *metaWire) { m.TCPAddrs = []string{px.addr()} })
	if _, err := p.ini.LoadRemote(blob); err != nil {
		t.Fatal(err)
	}
	ll, rl := p.lists(t, 1<<20, &PrepareOptions{Backends: []string{"TCP"}})
	req, err := p.ini.MakeRequest(Read, ll, seq(4), rl, seq(4), nil)
	if err != nil {
		t.Fatal(err)
	}
	px.stall()
	ctx, cancel := context.WithCancel(testCtx(t))
	if err := req.Post(ctx, nil); err != nil {
		t.Fatal(err)
	}
	cancel()
	wantKind(t, req.Wait(testCtx(t)), ErrCanceled)
	dctx, dcancel := context.WithTimeout(testCtx(t), 50*time.Millisecond)
	defer dcancel()
	if err := req.Post(dctx, nil); err != nil {
		t.Fatal(err)
	}
	wantKind(t, req.Wait(testCtx(t)), ErrTimeout)
	if err := req.Post(testCtx(t), nil); err != nil {
		t.Fatal(err)
	}
	req.Release()
	wantKind(t, req.Wait(testCtx(t)), ErrCanceled)
	wantKind(t, req.Post(testCtx(t), nil), ErrInvalidParam)
	req.Release() // idempotent
	if f := p.ini.Stats().Failures; f.Canceled != 2 || f.Timeout != 1 {
		t.Fatalf("failures %+v", f)
	}
	px.unstall()
}

// TestHeapRegionAndFetch: memory outside arenas is reachable over TCP only (the fallback is
// reported), metadata can be fetched by address, and the completion hook sees every post.
func TestHeapRegionAndFetch(t *testing.T) {
	var hooked atomic.Int64
	tgt := newTestAgent(t, "heap-target", Config{})
	ini := newTestAgent(t, "heap-initiator", Config{OnComplete: func(tel RequestTelemetry) {
		if tel.Bytes == 8192 && tel.Backend == BackendTCP {
			hooked.Add(1)
		}
	}})
	src := make([]byte, 8192)
	fillPattern(src, 5)
	rt, err := tgt.RegisterBytes(src, PermRead)
	if err != nil {
		t.Fatal(err)
	}
	defer tgt.Deregister(rt)
	dst := make([]byte, 8192)
	ri, err := ini.RegisterBytes(dst, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ini.Deregister(ri)
	tcpAddr, _ := tgt.Addrs()
	name, err := ini.FetchRemote(testCtx(t), tcpAddr)
	if err != nil || name != "heap-target" {
		t.Fatalf("FetchRemote: %q %v", name, err)
	}
	info, ok := ini.Peer(name)
	if !ok || !info.SameHost || info.Incarnation != tgt.Incarnation() || info.Regions != 1 {
		t.Fatalf("peer info %+v", info)
	}
	req, err := ini.CreateRequest(testCtx(t), Read, []Desc{ri.Desc(0, 8192)}, name, []Desc{rt.Desc(0, 8192)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer req.Release()
	if req.Backend() != BackendTCP || !strings.Contains(req.remote.FallbackReason(), "not in a shared arena") {
		t.Fatalf("backend %v (%q)", req.Backend(), req.remote.FallbackReason())
	}
	if err := postWait(t, req, nil); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, dst) {
		t.Fatal("data differs")
	}
	if tel := req.Telemetry(); tel.PostDuration <= 0 || tel.TransferDuration < tel.PostDuration {
		t.Fatalf("telemetry %+v", tel)
	}
	if hooked.Load() != 1 {
		t.Fatalf("hook saw %d posts", hooked.Load())
	}
	_, err = ini.PrepareRemote(testCtx(t), name, []Desc{rt.Desc(0, 8192)}, &PrepareOptions{Backends: []string{"SHM"}})
	wantKind(t, err, ErrNotSupported)
}
