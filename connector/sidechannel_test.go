package connector

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

func testPayload(t testing.TB, engine string) handshakePayload {
	t.Helper()
	p, err := encodeMetadata("hash-1", AgentMetadata{EngineID: engine, NumBlocks: 4, BlockLen: 64, BlockSize: 16, KVCacheLayout: "HND", Version: ConnectorVersion})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestSideChannelHandshake: a real listener on 127.0.0.1 answers handshakes; the hash, the
// engine id and garbage are checked.
func TestSideChannelHandshake(t *testing.T) {
	clock := func() float64 { return 100 }
	srv, err := listenSideChannel("127.0.0.1:0", testPayload(t, "E"), clock, testLogger(&bytes.Buffer{}))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	addr := srv.addr().String()
	local := func() float64 { return 40 }
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	res, err := handshake(ctx, addr, "E", "hash-1", true, 3, local)
	if err != nil || res.meta.EngineID != "E" || res.offset != 60 {
		t.Fatalf("handshake: %+v %v", res, err)
	}
	if _, err := handshake(ctx, addr, "E", "hash-2", true, 1, local); !errors.Is(err, ErrIncompatible) {
		t.Errorf("hash mismatch: %v", err)
	}
	if _, err := handshake(ctx, addr, "E", "hash-2", false, 1, local); err != nil {
		t.Errorf("hash mismatch with the check off: %v", err)
	}
	if _, err := handshake(ctx, addr, "F", "hash-1", true, 1, local); !errors.Is(err, ErrIncompatible) {
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
	if _, err := handshake(ctx, addr, "E", "hash-1", true, 1, local); err != nil {
		t.Errorf("after garbage: %v", err)
	}
	if err := srv.close(); err != nil {
		t.Errorf("close: %v", err)
	}
	if err := srv.close(); err != nil {
		t.Errorf("second close: %v", err)
	}
	if _, err := handshake(ctx, addr, "E", "hash-1", true, 1, local); !errors.Is(err, ErrHandshake) {
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
	f.Fuzz(func(t *testing.T, body []byte) {
		_ = decodeRequest(body)
		if p, _, err := decodeResponse(body); err == nil {
			var m AgentMetadata
			_ = msgpack.Unmarshal(p.AgentMetadataBytes, &m)
		}
		_, _ = readFrame(bytes.NewReader(body))
	})
}
