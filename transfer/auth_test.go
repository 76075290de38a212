package transfer

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbridge/kvbridge/transfer/internal/wire"
)

// hmacAuth returns the shared-secret authenticator of secret.
func hmacAuth(t *testing.T, secret string) Authenticator {
	t.Helper()
	a, err := NewHMACAuth([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// readAll reads the whole remote list into the initiator's arena over backend and compares.
func readAll(t *testing.T, p *pair, backend string, opts *RequestOptions) error {
	t.Helper()
	ll, err := p.ini.PrepareLocal(BlockDescs(p.rI.ID(), 0, 4096, 4))
	if err != nil {
		t.Fatal(err)
	}
	defer ll.Release()
	rl, err := p.ini.PrepareRemote(testCtx(t), p.peer, BlockDescs(p.rT.ID(), 0, 4096, 4), &PrepareOptions{Backends: []string{backend}})
	if err != nil {
		return err
	}
	defer rl.Release()
	req, err := p.ini.MakeRequest(Read, ll, seq(4), rl, seq(4), opts)
	if err != nil {
		return err
	}
	defer req.Release()
	if err := postWait(t, req, []byte("done")); err != nil {
		return err
	}
	if !bytes.Equal(p.arI.Bytes()[:4*4096], p.arT.Bytes()[:4*4096]) {
		t.Fatal("data differs")
	}
	if n := recvNotif(t, p.tgt); string(n.Msg) != "done" {
		t.Fatalf("notification %q", n.Msg)
	}
	return nil
}

// TestAuthSharedSecret: with the same secret on both sides every kind of connection (SHM
// control with arena fds, TCP data and control, metadata by address) authenticates, in
// both directions, and nothing is refused.
func TestAuthSharedSecret(t *testing.T) {
	p := newPair(t, Config{Auth: hmacAuth(t, "s3cret")}, Config{Auth: hmacAuth(t, "s3cret")}, 1<<16, PermRead)
	for _, be := range []string{"SHM", "TCP"} {
		if err := readAll(t, p, be, nil); err != nil {
			t.Fatalf("%s: %v", be, err)
		}
	}
	tcpAddr, _ := p.tgt.Addrs()
	if _, err := p.ini.FetchMetadata(testCtx(t), tcpAddr); err != nil {
		t.Fatalf("metadata by address: %v", err)
	}
	// The target notifies back over the connection the initiator dialed.
	if err := p.tgt.SendNotif(testCtx(t), "initiator", []byte("back")); err != nil {
		t.Fatal(err)
	}
	if n := recvNotif(t, p.ini); string(n.Msg) != "back" {
		t.Fatalf("notification %q", n.Msg)
	}
	if a, b := p.tgt.Stats(), p.ini.Stats(); a.AuthRefused != 0 || b.AuthRefused != 0 || a.Refused.Total() != 0 {
		t.Fatalf("refusals: target %d %+v, initiator %d", a.AuthRefused, a.Refused, b.AuthRefused)
	}
	// After authentication the usual checks still apply: metadata of another incarnation
	// is refused as stale, not as an authentication failure.
	stale := rewriteMeta(t, p.tgt.LocalMetadata(), func(m *metaWire) { m.Incarnation++ })
	if _, err := p.ini.LoadRemote(stale); err != nil {
		t.Fatal(err)
	}
	_, err := p.ini.PrepareRemote(testCtx(t), p.peer, BlockDescs(p.rT.ID(), 0, 4096, 1), &PrepareOptions{Backends: []string{"TCP"}})
	wantKind(t, err, ErrStaleIncarnation)
	if a := p.tgt.Stats(); a.AuthRefused != 0 || a.Refused.StaleIncarnation != 1 {
		t.Fatalf("stale peer: target counted %d auth refusals, %+v", a.AuthRefused, a.Refused)
	}
}

// TestAuthMismatch: a missing, unexpected or wrong secret is refused at once on both
// backends, with ErrPermission and a message saying what is wrong, and counted by the side
// that refused; nothing waits for a deadline (the dial timeout is far away).
func TestAuthMismatch(t *testing.T) {
	cases := []struct {
		name           string
		target, dialer Authenticator
		msg            string
		tgtRefuses     bool // the target (listener) refuses
		iniRefuses     bool // the initiator (dialer) refuses the listener's proof
	}{
		{"missing", hmacAuth(t, "s3cret"), nil, "authentication required", true, false},
		{"unexpected", nil, hmacAuth(t, "s3cret"), "no shared secret configured", true, false},
		{"wrong", hmacAuth(t, "s3cret"), hmacAuth(t, "other"), "secrets differ", true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t, Config{Auth: tc.target, DialTimeout: time.Minute}, Config{Auth: tc.dialer, DialTimeout: time.Minute}, 1<<16, PermRead)
			for i, be := range []string{"SHM", "TCP"} {
				err := readAll(t, p, be, nil)
				wantKind(t, err, ErrPermission)
				t.Logf("%s: %v", be, err)
				if !strings.Contains(err.Error(), tc.msg) {
					t.Fatalf("%s: error %q does not say %q", be, err, tc.msg)
				}
				tgt, ini := p.tgt.Stats(), p.ini.Stats()
				if want := int64(i + 1); tc.tgtRefuses && (tgt.AuthRefused != want || tgt.Refused.Permission != want) {
					t.Fatalf("%s: target counted %d auth refusals (%+v), want %d", be, tgt.AuthRefused, tgt.Refused, want)
				}
				if want := int64(i + 1); tc.iniRefuses && ini.AuthRefused != want {
					t.Fatalf("%s: initiator counted %d auth refusals, want %d", be, ini.AuthRefused, want)
				}
				if !tc.iniRefuses && ini.AuthRefused != 0 {
					t.Fatalf("%s: initiator counted %d auth refusals", be, ini.AuthRefused)
				}
			}
			tcpAddr, _ := p.tgt.Addrs()
			_, err := p.ini.FetchMetadata(testCtx(t), tcpAddr)
			wantKind(t, err, ErrPermission)
		})
	}
}

// rawDial speaks the handshake by hand: it sends hello (with nonce) on a new TCP connection
// and returns the connection and the listener's challenge.
func rawDial(t *testing.T, addr string, h hello) (net.Conn, challenge) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	b, err := msgpackHello(h)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	hdr, body := rawRead(t, c)
	if hdr.Op != wire.OpChallenge {
		t.Fatalf("got %v (%s), want CHALLENGE", hdr.Op, body)
	}
	var ch challenge
	if err := msgpack.Unmarshal(body, &ch); err != nil {
		t.Fatal(err)
	}
	return c, ch
}

// rawRead reads one frame.
func rawRead(t *testing.T, c net.Conn) (wire.Header, []byte) {
	t.Helper()
	var hb [wire.HeaderSize]byte
	if _, err := io.ReadFull(c, hb[:]); err != nil {
		t.Fatal(err)
	}
	hdr, err := wire.DecodeHeader(hb[:])
	if err != nil {
		t.Fatal(err)
	}
	body := make([]byte, hdr.Length)
	if _, err := io.ReadFull(c, body); err != nil {
		t.Fatal(err)
	}
	return hdr, body
}

// rawAuth sends an AUTH frame carrying proof.
func rawAuth(t *testing.T, c net.Conn, proof []byte) {
	t.Helper()
	b, err := msgpack.Marshal(&authProof{Proof: proof})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(encodeFrame(wire.Header{Op: wire.OpAuth}, b)); err != nil {
		t.Fatal(err)
	}
}

// TestAuthReplay: a proof captured on one connection does not open another one, because the
// listener's nonce changes; neither does the whole captured dialer transcript replayed
// blind.
func TestAuthReplay(t *testing.T) {
	auth := hmacAuth(t, "s3cret")
	tgt := newTestAgent(t, "target", Config{Auth: auth})
	addr, _ := tgt.Addrs()
	h := hello{Version: 1, Role: roleMeta, From: "eavesdropped", FromInc: 7, Nonce: bytes.Repeat([]byte{1}, authNonceBytes)}

	// A legitimate exchange, as a peer with the secret would run it.
	c1, ch1 := rawDial(t, addr, h)
	proof, err := auth.proof(authDialer, transcript(&h, ch1.Name, ch1.Inc, ch1.Nonce))
	if err != nil {
		t.Fatal(err)
	}
	if !checkProof(auth, authListener, transcript(&h, ch1.Name, ch1.Inc, ch1.Nonce), ch1.Proof) {
		t.Fatal("the listener's proof does not verify")
	}
	rawAuth(t, c1, proof)
	if hdr, body := rawRead(t, c1); hdr.Op != wire.OpHelloAck {
		t.Fatalf("legitimate exchange answered %v: %s", hdr.Op, body)
	}

	// The same hello and the captured proof on a new connection.
	c2, ch2 := rawDial(t, addr, h)
	if bytes.Equal(ch1.Nonce, ch2.Nonce) {
		t.Fatal("the listener reused its nonce")
	}
	rawAuth(t, c2, proof)
	hdr, body := rawRead(t, c2)
	if hdr.Op != wire.OpError || !errors.Is(kindForCode(hdr.Count), ErrPermission) || !strings.Contains(string(body), "does not match") {
		t.Fatalf("replayed proof answered %v: %s", hdr.Op, body)
	}

	// Everything the dialer sent on the first connection, replayed blind.
	c3, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	_ = c3.SetDeadline(time.Now().Add(30 * time.Second))
	hb, _ := msgpackHello(h)
	pb, _ := msgpack.Marshal(&authProof{Proof: proof})
	if _, err := c3.Write(append(hb, encodeFrame(wire.Header{Op: wire.OpAuth}, pb)...)); err != nil {
		t.Fatal(err)
	}
	if hdr, _ := rawRead(t, c3); hdr.Op != wire.OpChallenge {
		t.Fatalf("got %v, want CHALLENGE", hdr.Op)
	}
	if hdr, body := rawRead(t, c3); hdr.Op != wire.OpError {
		t.Fatalf("blind replay answered %v: %s", hdr.Op, body)
	}
	if st := tgt.Stats(); st.AuthRefused != 2 || st.Refused.Permission != 2 {
		t.Fatalf("target counted %d auth refusals (%+v), want 2", st.AuthRefused, st.Refused)
	}
}

// TestAuthImpostorListener: a listener that does not know the secret cannot pass as a peer:
// the dialer checks the listener's proof and refuses (mutual authentication).
func TestAuthImpostorListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		var hb [wire.HeaderSize]byte
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			served <- err
			return
		}
		hdr, _ := wire.DecodeHeader(hb[:])
		if _, err := io.CopyN(io.Discard, c, int64(hdr.Length)); err != nil {
			served <- err
			return
		}
		b, _ := msgpack.Marshal(&challenge{Name: "target", Inc: 1, Nonce: make([]byte, authNonceBytes), Proof: make([]byte, 32)})
		if _, err := c.Write(encodeFrame(wire.Header{Op: wire.OpChallenge}, b)); err != nil {
			served <- err
			return
		}
		// Whatever the dialer says next, answer with an ack that would hand over metadata.
		ack, _ := msgpack.Marshal(&helloAck{Name: "target", Inc: 1, Meta: []byte("stolen trust")})
		_, _ = c.Write(encodeFrame(wire.Header{Op: wire.OpHelloAck}, ack))
		_, _ = io.Copy(io.Discard, c)
		served <- nil
	}()
	ini := newTestAgent(t, "initiator", Config{Auth: hmacAuth(t, "s3cret")})
	_, err = ini.FetchMetadata(testCtx(t), ln.Addr().String())
	wantKind(t, err, ErrPermission)
	if !strings.Contains(err.Error(), "failed to prove the shared secret") {
		t.Fatalf("error %v", err)
	}
	if st := ini.Stats(); st.AuthRefused != 1 {
		t.Fatalf("initiator counted %d auth refusals", st.AuthRefused)
	}
	if err := <-served; err != nil {
		t.Fatal(err)
	}
}

// TestAuthorizeRead: the target consults AuthorizeRead for every TCP READ frame with the
// request's tag and ranges; refusals fail the request with ErrPermission, are counted, and
// leave the target serving. SHM reads are not checked (the peer maps the arena).
func TestAuthorizeRead(t *testing.T) {
	var calls atomic.Int64
	var lastPeer atomic.Value
	var tags sync.Map // every tag the hook saw
	authorize := func(peer string, tag []byte, descs []Desc) error {
		calls.Add(1)
		lastPeer.Store(peer)
		tags.Store(string(tag), true)
		switch string(tag) {
		case "panic":
			panic("hook bug")
		case "lease-1":
		default:
			return fmt.Errorf("no lease %q", tag)
		}
		for _, d := range descs {
			if d.Offset < 0 || d.Offset+d.Length > 2*4096 {
				return fmt.Errorf("range [%d,+%d) outside the lease", d.Offset, d.Length)
			}
		}
		return nil
	}
	// Small stripes: a request is several READ frames, each carrying the tag.
	p := newPair(t, Config{AuthorizeRead: authorize}, Config{StripeBytes: 4096}, 1<<16, PermRead)
	ll, err := p.ini.PrepareLocal(BlockDescs(p.rI.ID(), 0, 4096, 4))
	if err != nil {
		t.Fatal(err)
	}
	defer ll.Release()
	tcp, err := p.ini.PrepareRemote(testCtx(t), p.peer, BlockDescs(p.rT.ID(), 0, 4096, 4), &PrepareOptions{Backends: []string{"TCP"}})
	if err != nil {
		t.Fatal(err)
	}
	defer tcp.Release()
	read := func(list *PreparedList, n int, tag string) error {
		t.Helper()
		var opts *RequestOptions
		if tag != "" {
			opts = &RequestOptions{Tag: []byte(tag)}
		}
		req, err := p.ini.MakeRequest(Read, ll, seq(n), list, seq(n), opts)
		if err != nil {
			t.Fatal(err)
		}
		defer req.Release()
		return postWait(t, req, nil)
	}
	if err := read(tcp, 2, "lease-1"); err != nil {
		t.Fatalf("leased read: %v", err)
	}
	if c := calls.Load(); c != 2 {
		t.Fatalf("AuthorizeRead called %d times for 2 frames", c)
	}
	if peer := lastPeer.Load(); peer != "initiator" {
		t.Fatalf("AuthorizeRead saw peer %v", peer)
	}
	denied := []struct{ tag, msg string }{
		{"lease-2", `no lease "lease-2"`},
		{"", `no lease ""`},
		{"panic", "authorization failed"},
	}
	for _, d := range denied {
		err := read(tcp, 2, d.tag)
		wantKind(t, err, ErrPermission)
		if !strings.Contains(err.Error(), d.msg) {
			t.Fatalf("tag %q: error %v", d.tag, err)
		}
	}
	err = read(tcp, 4, "lease-1") // blocks 2 and 3 are outside the lease
	wantKind(t, err, ErrPermission)
	// The other stripes of a refused request may still be refused on other connections after
	// the initiator saw the first refusal: wait (bounded) for the target to settle. The target
	// counts a refusal after the hook returns and signals nothing then, so this polls, with a
	// short sleep between checks rather than spinning a core.
	deadline := time.Now().Add(10 * time.Second)
	for st := p.tgt.Stats(); st.ReadsDenied < 4 || st.Refused.Permission != st.ReadsDenied; st = p.tgt.Stats() {
		if time.Now().After(deadline) {
			t.Fatalf("target counted %d denied reads (%+v)", st.ReadsDenied, st.Refused)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := read(tcp, 2, "lease-1"); err != nil {
		t.Fatalf("the target stopped serving after refusals: %v", err)
	}
	// SHM: the peer maps the arena; the tag is not checked.
	shm, err := p.ini.PrepareRemote(testCtx(t), p.peer, BlockDescs(p.rT.ID(), 0, 4096, 4), &PrepareOptions{Backends: []string{"SHM"}})
	if err != nil {
		t.Fatal(err)
	}
	defer shm.Release()
	// (Late stripes of the refused TCP requests may still reach the hook: look for this tag.)
	if err := read(shm, 4, "lease-shm"); err != nil {
		t.Fatalf("SHM read: %v", err)
	}
	if _, seen := tags.Load("lease-shm"); seen {
		t.Fatal("AuthorizeRead called for an SHM read")
	}
	// Tags are for READ, and bounded.
	wll, err := p.ini.PrepareLocal(BlockDescs(p.rI.ID(), 0, 4096, 1))
	if err != nil {
		t.Fatal(err)
	}
	defer wll.Release()
	_, err = p.ini.MakeRequest(Write, wll, seq(1), tcp, seq(1), &RequestOptions{Tag: []byte("x")})
	wantKind(t, err, ErrInvalidParam)
	_, err = p.ini.MakeRequest(Read, wll, seq(1), tcp, seq(1), &RequestOptions{Tag: make([]byte, maxTagBytes+1)})
	wantKind(t, err, ErrInvalidParam)
}
