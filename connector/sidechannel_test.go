package connector

import (
	"bytes"
	"context"
	"errors"
	"math"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

func testPayload(t testing.TB, engine string) handshakePayload {
	t.Helper()
	p, err := encodeMetadata("hash-1", agentMetadata{EngineID: engine, NumBlocks: 4, BlockLen: 64, BlockSize: 16, KVCacheLayout: "HND", Version: ConnectorVersion})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestSideChannelHandshake: a real listener on 127.0.0.1 answers handshakes; the hash, the
// engine id and garbage are checked.
func TestSideChannelHandshake(t *testing.T) {
	clock := func() float64 { return 100 }
	srv, err := listenSideChannel("127.0.0.1:0", testPayload(t, "E"), clock, testLogger(&bytes.Buffer{}), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	addr := srv.addr().String()
	local := func() float64 { return 40 }
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	res, err := handshake(ctx, addr, "E", "hash-1", true, 3, local, nil)
	if err != nil || res.meta.EngineID != "E" || res.offset != 60 {
		t.Fatalf("handshake: %+v %v", res, err)
	}
	if _, err := handshake(ctx, addr, "E", "hash-2", true, 1, local, nil); !errors.Is(err, ErrIncompatible) {
		t.Errorf("hash mismatch: %v", err)
	}
	if _, err := handshake(ctx, addr, "E", "hash-2", false, 1, local, nil); err != nil {
		t.Errorf("hash mismatch with the check off: %v", err)
	}
	if _, err := handshake(ctx, addr, "F", "hash-1", true, 1, local, nil); !errors.Is(err, ErrIncompatible) {
		t.Errorf("engine id mismatch: %v", err)
	}
	// A client that sends garbage gets an error payload, and the server keeps serving.
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := writeFrame(c, []any{"hello"}); err != nil {
		t.Fatal(err)
	}
	body, err := readFrame(c)
	c.Close()
	if _, _, derr := decodeResponse(body); err != nil || derr == nil {
		t.Errorf("garbage request: %v %v", err, derr)
	}
	if _, err := handshake(ctx, addr, "E", "hash-1", true, 1, local, nil); err != nil {
		t.Errorf("after garbage: %v", err)
	}
	if err := srv.close(); err != nil {
		t.Errorf("close: %v", err)
	}
	if err := srv.close(); err != nil {
		t.Errorf("second close: %v", err)
	}
	if _, err := handshake(ctx, addr, "E", "hash-1", true, 1, local, nil); !errors.Is(err, ErrHandshake) {
		t.Errorf("closed side channel: %v", err)
	}
}

// FuzzSideChannelFrames: arbitrary bytes as a request or a response never panic.
func FuzzSideChannelFrames(f *testing.F) {
	req, _ := msgpack.Marshal([]any{[]byte(handshakeMagic), 0, 0})
	f.Add(req)
	resp, _ := msgpack.Marshal([]any{handshakePayload{CompatibilityHash: "h", AgentMetadataBytes: []byte{0x80}}, 1.5})
	f.Add(resp)
	f.Add([]byte{0x92, 0xc0, 0xc0})
	hello, _ := msgpack.Marshal([]any{[]byte(authHelloTag), bytes.Repeat([]byte{1}, sideNonceBytes)})
	f.Add(hello)
	ch, _ := msgpack.Marshal([]any{[]byte(authChallengeTag), bytes.Repeat([]byte{2}, sideNonceBytes), bytes.Repeat([]byte{3}, 32)})
	f.Add(ch)
	refusal, _ := msgpack.Marshal([]any{handshakePayload{Error: "authentication required", ErrorCode: codeAuthRequired}, 1.0})
	f.Add(refusal)
	f.Fuzz(func(t *testing.T, body []byte) {
		_ = decodeRequest(body)
		_, _, _ = decodeTagged(body)
		if p, _, err := decodeResponse(body); err == nil {
			var m agentMetadata
			_ = msgpack.Unmarshal(p.AgentMetadataBytes, &m)
		}
		_, _ = readFrame(bytes.NewReader(body))
	})
}

// TestSideChannelAuth: with an auth token both sides prove it; a missing, unexpected or
// wrong token is refused at once with an error naming the setting, and counted by the side
// that refused.
func TestSideChannelAuth(t *testing.T) {
	clock := func() float64 { return 1 }
	var log fixture.LogBuffer
	srv, err := listenSideChannel("127.0.0.1:0", testPayload(t, "E"), clock, testLogger(&log), newSideAuth("tok"))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	open, err := listenSideChannel("127.0.0.1:0", testPayload(t, "E"), clock, testLogger(&bytes.Buffer{}), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer open.close()
	addr := srv.addr().String()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if res, err := handshake(ctx, addr, "E", "hash-1", true, 3, clock, newSideAuth("tok")); err != nil || res.meta.EngineID != "E" {
		t.Fatalf("matching token: %+v %v", res, err)
	}
	if n := srv.refusals.Load(); n != 0 {
		t.Fatalf("%d refusals with the right token", n)
	}
	cases := []struct {
		name     string
		srv      *sideChannelServer
		auth     *sideAuth
		msg      string
		refusals int64
		ours     bool // this side refused the server's proof
	}{
		{"missing", srv, nil, "requires authentication: set kv_connector_extra_config.auth_token", 1, false},
		{"wrong", srv, newSideAuth("other"), "failed to prove this engine's kv_connector_extra_config.auth_token", 2, true},
		{"unexpected", open, newSideAuth("tok"), "has no auth_token configured but this engine has one", 1, false},
	}
	for _, tc := range cases {
		_, err := handshake(ctx, tc.srv.addr().String(), "E", "hash-1", true, 3, clock, tc.auth)
		if !errors.Is(err, ErrHandshake) || !errors.Is(err, ErrAuth) || errors.Is(err, errServerProof) != tc.ours || !strings.Contains(err.Error(), tc.msg) {
			t.Fatalf("%s: %v", tc.name, err)
		}
		t.Logf("%s: %v", tc.name, err)
		if n := tc.srv.refusals.Load(); n != tc.refusals {
			t.Fatalf("%s: the server counted %d refusals, want %d", tc.name, n, tc.refusals)
		}
	}
	if !strings.Contains(log.String(), "error_code=auth_required") || !strings.Contains(log.String(), "error_code=auth_failed") {
		t.Errorf("refusals not logged: %s", log.String())
	}
}

// TestSideChannelAuthReplay: a client proof captured on one connection does not authenticate
// another, because the server's nonce changes.
func TestSideChannelAuthReplay(t *testing.T) {
	auth := newSideAuth("tok")
	srv, err := listenSideChannel("127.0.0.1:0", testPayload(t, "E"), func() float64 { return 1 }, testLogger(&bytes.Buffer{}), auth)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	clientNonce := bytes.Repeat([]byte{7}, sideNonceBytes)
	// challenge sends the hello and returns the connection and the server's nonce.
	challenge := func() (net.Conn, []byte) {
		c, err := net.Dial("tcp", srv.addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if err := writeFrame(c, []any{[]byte(authHelloTag), clientNonce}); err != nil {
			t.Fatal(err)
		}
		body, err := readFrame(c)
		if err != nil {
			t.Fatal(err)
		}
		tag, parts, err := decodeTagged(body)
		var nonce []byte
		if err != nil || tag != authChallengeTag || len(parts) != 2 || msgpack.Unmarshal(parts[0], &nonce) != nil {
			t.Fatalf("challenge %q %v", tag, err)
		}
		return c, nonce
	}
	// answer sends proof and a get_meta_msg and returns the decoded answer.
	answer := func(c net.Conn, proof []byte) (handshakePayload, error) {
		// One write: a refusing server closes after the proof.
		var out bytes.Buffer
		if err := writeFrame(&out, []any{[]byte(authProofTag), proof}); err != nil {
			t.Fatal(err)
		}
		if err := writeFrame(&out, []any{[]byte(handshakeMagic), 0, 0}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(out.Bytes()); err != nil {
			t.Fatal(err)
		}
		body, err := readFrame(c)
		if err != nil {
			t.Fatal(err)
		}
		p, _, err := decodeResponse(body)
		return p, err
	}
	c1, n1 := challenge()
	proof := auth.proof(sideClient, clientNonce, n1)
	if p, err := answer(c1, proof); err != nil || p.CompatibilityHash != "hash-1" {
		t.Fatalf("legitimate exchange: %+v %v", p, err)
	}
	c2, n2 := challenge()
	if bytes.Equal(n1, n2) {
		t.Fatal("the server reused its nonce")
	}
	if _, err := answer(c2, proof); !errors.Is(err, ErrAuth) {
		t.Fatalf("replayed proof: %v", err)
	}
	if n := srv.refusals.Load(); n != 1 {
		t.Fatalf("the server counted %d refusals, want 1", n)
	}
}

// TestHandshakeBoundsNumBlocks: num_blocks in a producer's handshake answer sizes the
// consumer's descriptor lists for that producer. A count beyond the bound — up to one whose
// descriptor count overflows — is refused with a clear error before anything is allocated (it
// used to exhaust memory or panic on the handshake goroutine), one beyond the regions the
// producer's transfer metadata advertises is refused by the region check, and the producer's
// true count is then accepted.
func TestHandshakeBoundsNumBlocks(t *testing.T) {
	p := startProducer(t, `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`, nil)
	d := startProducer(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`, nil)
	var meta agentMetadata
	if err := msgpack.Unmarshal(p.side.payload.AgentMetadataBytes, &meta); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	for _, tc := range []struct {
		n    int
		want string // in the error; "" for success
	}{
		{math.MaxInt, "at most 1048576 blocks are accepted from a peer"},
		{math.MaxInt/2 + 1, "at most 1048576 blocks are accepted from a peer"},
		{maxRemoteBlocks + 1, "at most 1048576 blocks are accepted from a peer"},
		{meta.NumBlocks * 1000, "outside peer region"},
		{meta.NumBlocks, ""},
	} {
		m := meta
		m.NumBlocks = tc.n
		payload, err := encodeMetadata(p.hash, m)
		if err != nil {
			t.Fatal(err)
		}
		srv, err := listenSideChannel("127.0.0.1:0", payload, p.clockSeconds, testLogger(&bytes.Buffer{}), nil)
		if err != nil {
			t.Fatal(err)
		}
		params := &Params{RemoteEngineID: m.EngineID, Instance: m.Instance, RemoteHost: "127.0.0.1", RemotePort: srv.addr().(*net.TCPAddr).Port}
		r, err := d.remote(ctx, params)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("num_blocks %d: %v", tc.n, err)
		case tc.want == "" && r.kv.Len() != tc.n:
			t.Errorf("num_blocks %d: %d descriptors prepared", tc.n, r.kv.Len())
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("num_blocks %d: %v, want an error with %q", tc.n, err, tc.want)
		}
		if err := srv.close(); err != nil {
			t.Error(err)
		}
	}
}
