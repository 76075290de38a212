package transfer

import (
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbridge/kvbridge/transfer/internal/wire"
)

// fillPattern writes a deterministic pattern derived from seed and the byte offset.
func fillPattern(b []byte, seed uint64) {
	var w [8]byte
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(w[:], seed^(uint64(i)*0x9e3779b97f4a7c15))
		copy(b[i:], w[:])
	}
}

// blockSums returns the CRC32 of every block of size bs in b.
func blockSums(b []byte, bs int) []uint32 {
	out := make([]uint32, len(b)/bs)
	for i := range out {
		out[i] = crc32.ChecksumIEEE(b[i*bs : (i+1)*bs])
	}
	return out
}

// testCtx returns a context bounded by the test deadline (or 30 s).
func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx := t.Context()
	d := 30 * time.Second
	if dl, ok := t.Deadline(); ok {
		d = min(d, time.Until(dl)-time.Second)
	}
	ctx, cancel := context.WithTimeout(ctx, d)
	t.Cleanup(cancel)
	return ctx
}

// newTestAgent starts an agent closed at cleanup.
func newTestAgent(t *testing.T, name string, cfg Config) *Agent {
	t.Helper()
	a, err := NewAgent(name, cfg)
	if err != nil {
		t.Fatalf("NewAgent(%s): %v", name, err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

// newTestArena allocates an arena closed at cleanup (after agents, which are registered later).
func newTestArena(t *testing.T, size int64) *Arena {
	t.Helper()
	ar, err := NewArena(t.Name(), size)
	if err != nil {
		t.Fatalf("NewArena: %v", err)
	}
	t.Cleanup(func() {
		if err := ar.Close(); err != nil {
			t.Errorf("arena close: %v", err)
		}
	})
	return ar
}

// mustRegister registers the whole arena.
func mustRegister(t *testing.T, a *Agent, ar *Arena, perm Perm) *Region {
	t.Helper()
	r, err := a.Register(ar, 0, ar.Size(), perm)
	if err != nil {
		t.Fatalf("Register: %v", err)
	}
	t.Cleanup(func() { a.Deregister(r) })
	return r
}

// wantKind fails the test unless err wraps kind.
func wantKind(t *testing.T, err, kind error) {
	t.Helper()
	if !errors.Is(err, kind) {
		t.Fatalf("error %v, want %v", err, kind)
	}
}

// transferGoroutines returns the stacks of goroutines running code of this package
// (excluding tests).
func transferGoroutines() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "kvbridge/transfer.") && !strings.Contains(g, "_test.go") && !strings.Contains(g, "testing.tRunner") {
			out = append(out, g)
		}
	}
	return out
}

// assertNoGoroutines waits (bounded, yielding, no sleeps) until no goroutine of the package
// survives, and fails with their stacks otherwise.
func assertNoGoroutines(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		left := transferGoroutines()
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines survived Close:\n%s", len(left), strings.Join(left, "\n\n"))
		}
		runtime.Gosched()
	}
}

// pair is a target agent with a filled arena and an initiator agent that loaded its metadata.
type pair struct {
	tgt, ini *Agent
	arT, arI *Arena
	rT, rI   *Region
	peer     string
}

// newPair builds a pair with arenas of size bytes; the target grants tperm.
func newPair(t *testing.T, tcfg, icfg Config, size int64, tperm Perm) *pair {
	t.Helper()
	p := &pair{arT: newTestArena(t, size), arI: newTestArena(t, size)}
	p.tgt = newTestAgent(t, "target", tcfg)
	p.ini = newTestAgent(t, "initiator", icfg)
	fillPattern(p.arT.Bytes(), 0x7a)
	fillPattern(p.arI.Bytes(), 0x1c)
	p.rT = mustRegister(t, p.tgt, p.arT, tperm)
	p.rI = mustRegister(t, p.ini, p.arI, 0)
	name, err := p.ini.LoadRemote(p.tgt.LocalMetadata())
	if err != nil {
		t.Fatal(err)
	}
	p.peer = name
	return p
}

// lists prepares whole-arena block lists on both sides.
func (p *pair) lists(t *testing.T, block int64, opts *PrepareOptions) (local, remote *PreparedList) {
	t.Helper()
	n := int(p.arT.Size() / block)
	ll, err := p.ini.PrepareLocal(BlockDescs(p.rI.ID(), 0, block, n))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ll.Release)
	rl, err := p.ini.PrepareRemote(testCtx(t), p.peer, BlockDescs(p.rT.ID(), 0, block, n), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rl.Release)
	return ll, rl
}

// rewriteMeta decodes a metadata blob, lets fn change it and re-encodes it.
func rewriteMeta(t *testing.T, blob []byte, fn func(*metaWire)) []byte {
	t.Helper()
	m, err := decodeMetadata(blob)
	if err != nil {
		t.Fatal(err)
	}
	fn(&m.metaWire)
	b, err := m.metaWire.encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// seq returns [0, n).
func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

// postWait posts r and waits for it.
func postWait(t *testing.T, r *Request, notif []byte) error {
	t.Helper()
	ctx := testCtx(t)
	if err := r.Post(ctx, notif); err != nil {
		return err
	}
	return r.Wait(ctx)
}

// recvNotif waits (bounded) for the next notification.
func recvNotif(t *testing.T, a *Agent) Notif {
	t.Helper()
	select {
	case n := <-a.Notifications():
		return n
	case <-testCtx(t).Done():
		t.Fatal("no notification")
	}
	return Notif{}
}

// msgpackHello encodes a hello frame as a dialer would.
func msgpackHello(h hello) ([]byte, error) {
	b, err := msgpack.Marshal(&h)
	if err != nil {
		return nil, err
	}
	return encodeFrame(wire.Header{Op: wire.OpHello}, b), nil
}
