package transfer

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/kvbridge/kvbridge/transfer/internal/wire"
)

// fuzzInc is the incarnation the fuzz target agent uses, so that checked-in seeds can carry
// a valid hello.
const fuzzInc = 0x1122334455667788

// FuzzDecodeMetadata: no input makes the metadata decoder panic or allocate beyond the
// input's size; whatever it accepts re-encodes to an equivalent blob.
func FuzzDecodeMetadata(f *testing.F) {
	for _, s := range metadataSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := decodeMetadata(in)
		if err != nil {
			return
		}
		b, err := m.metaWire.encode()
		if err != nil {
			t.Fatal(err)
		}
		m2, err := decodeMetadata(b)
		if err != nil {
			t.Fatalf("re-encoded metadata rejected: %v", err)
		}
		if m2.Name != m.Name || m2.Incarnation != m.Incarnation || len(m2.Regions) != len(m.Regions) {
			t.Fatal("round trip changed the metadata")
		}
	})
}

// FuzzServeConn feeds arbitrary bytes to the listening side of a connection (hello, then
// data or control frames): the target must never panic, must end the connection on garbage,
// and must keep its registered memory intact outside the writable region.
func FuzzServeConn(f *testing.F) {
	for _, s := range serveSeeds() {
		f.Add(s)
	}
	a, err := NewAgent("fuzz-target", Config{ListenTCP: "none", UnixSocket: "none", NotifQueue: 16,
		AuthorizeRead: func(_ string, tag []byte, _ []Desc) error {
			if string(tag) == "deny" {
				return errors.New("denied")
			}
			return nil
		}})
	if err != nil {
		f.Fatal(err)
	}
	a.inc = fuzzInc
	f.Cleanup(func() { a.Close() })
	ro, err := NewArena("fuzz-ro", 1<<16)
	if err != nil {
		f.Fatal(err)
	}
	fillPattern(ro.Bytes(), 3)
	want := bytes.Clone(ro.Bytes())
	rw, err := NewArena("fuzz-rw", 1<<16)
	if err != nil {
		f.Fatal(err)
	}
	rr, err := a.Register(ro, 0, ro.Size(), PermRead) // region 1
	if err != nil {
		f.Fatal(err)
	}
	wr, err := a.Register(rw, 0, rw.Size(), PermReadWrite) // region 2
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() {
		a.Deregister(rr)
		a.Deregister(wr)
		ro.Close()
		rw.Close()
	})
	f.Fuzz(func(t *testing.T, in []byte) {
		srv, cli := net.Pipe()
		done := make(chan struct{})
		go func() {
			a.serveConn(srv, false)
			srv.Close()
			close(done)
		}()
		go func() { _, _ = io.Copy(io.Discard, cli) }()
		go func() {
			_, _ = cli.Write(in)
			cli.Close()
		}()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Fatal("serveConn did not return")
		}
		cli.Close()
		if !bytes.Equal(ro.Bytes(), want) {
			t.Fatal("read-only region modified")
		}
		a.DrainNotifs(nil)
	})
}

// FuzzServeConnAuth feeds arbitrary bytes to the listening side of an agent that requires
// authentication: nothing makes it panic, and nothing gets past the challenge without the
// secret (no HELLO_ACK is ever sent, so no metadata, arena fd or data connection).
func FuzzServeConnAuth(f *testing.F) {
	for _, s := range authSeeds() {
		f.Add(s)
	}
	auth, err := NewHMACAuth([]byte("fuzz secret"))
	if err != nil {
		f.Fatal(err)
	}
	a, err := NewAgent("fuzz-target", Config{ListenTCP: "none", UnixSocket: "none", NotifQueue: 16, Auth: auth})
	if err != nil {
		f.Fatal(err)
	}
	a.inc = fuzzInc
	f.Cleanup(func() { a.Close() })
	f.Fuzz(func(t *testing.T, in []byte) {
		srv, cli := socketPair(t)
		done := make(chan struct{})
		go func() {
			a.serveConn(srv, false)
			srv.Close()
			close(done)
		}()
		out := make(chan []byte, 1)
		go func() {
			b, _ := io.ReadAll(cli)
			out <- b
		}()
		go func() {
			_, _ = cli.Write(in)
			_ = cli.CloseWrite()
		}()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Fatal("serveConn did not return")
		}
		cli.Close()
		b := <-out
		for len(b) >= wire.HeaderSize {
			h, err := wire.DecodeHeader(b)
			if err != nil {
				t.Fatalf("the target sent a malformed frame: %v", err)
			}
			if h.Op == wire.OpHelloAck {
				t.Fatal("the target acknowledged an unauthenticated hello")
			}
			b = b[min(uint64(len(b)), wire.HeaderSize+h.Length):]
		}
	})
}

// socketPair returns the two ends of a connected Unix stream socket pair (unlike net.Pipe,
// an end can close its writing half).
func socketPair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// authSeeds returns transcripts against an authenticating listener.
func authSeeds() [][]byte {
	h := hello{Version: 1, Role: roleData, From: "fuzzer", FromInc: 9, To: "fuzz-target", ToInc: fuzzInc, Nonce: bytes.Repeat([]byte{5}, authNonceBytes)}
	withNonce, _ := msgpackHello(h)
	h.Nonce = nil
	without, _ := msgpackHello(h)
	h.Nonce = []byte{1, 2, 3}
	short, _ := msgpackHello(h)
	proof, _ := msgpack.Marshal(&authProof{Proof: bytes.Repeat([]byte{9}, 32)})
	auth := encodeFrame(wire.Header{Op: wire.OpAuth}, proof)
	var rr [wire.HeaderSize + wire.RangeSize]byte
	(&wire.Header{Op: wire.OpReadReq, Req: 1, Count: 1}).Encode(rr[:])
	wire.PutRange(rr[wire.HeaderSize:], wire.Range{Region: 1, Length: 16})
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	return [][]byte{
		cat(withNonce, auth, rr[:]),
		cat(withNonce, rr[:]),
		cat(withNonce, encodeFrame(wire.Header{Op: wire.OpAuth}, []byte{0x91, 0xc0})),
		cat(withNonce, auth[:len(auth)-4]),
		cat(without, rr[:]),
		short,
	}
}

// metadataSeeds returns valid and damaged metadata blobs.
func metadataSeeds(tb testing.TB) [][]byte {
	a, err := NewAgent("seed-agent", Config{})
	if err != nil {
		tb.Fatal(err)
	}
	defer a.Close()
	ar, err := NewArena("seed", 1<<16)
	if err != nil {
		tb.Fatal(err)
	}
	defer ar.Close()
	r1, _ := a.Register(ar, 0, 4096, PermRead)
	r2, _ := a.Register(ar, 4096, 8192, PermReadWrite)
	heap, _ := a.RegisterBytes(make([]byte, 100), PermRead)
	blob := a.LocalMetadata()
	a.Deregister(r1)
	a.Deregister(r2)
	a.Deregister(heap)
	v2 := bytes.Clone(blob)
	v2[1] = metadataVersionUCX // the version is the first array element (a positive fixint); format 1's fields under the UCX format
	m, err := decodeMetadata(blob)
	if err != nil {
		tb.Fatal(err)
	}
	m.Version = metadataVersionUCX // the UCX format, as an agent offering UCX publishes it
	m.UCXWorkers = [][]byte{bytes.Repeat([]byte{7}, 40)}
	m.UCXArenas = []metaUCXArena{{ID: m.Arenas[0].ID, Base: 1 << 40, Rkey: []byte{1, 2, 3, 4}}}
	m.ProcStart = 12345
	ucx, err := m.metaWire.encode()
	if err != nil {
		tb.Fatal(err)
	}
	return [][]byte{blob, blob[:len(blob)/2], v2, ucx, ucx[:len(ucx)-3], {0x90}, {0xdd, 0xff, 0xff, 0xff, 0xff}, {0xdb, 0x7f, 0xff, 0xff, 0xff}}
}

// serveSeeds returns connection transcripts: valid hellos followed by valid and invalid
// frames.
func serveSeeds() [][]byte {
	frame := func(h wire.Header, ranges []wire.Range, payload []byte) []byte {
		b := make([]byte, wire.HeaderSize+len(ranges)*wire.RangeSize)
		h.Count = uint32(len(ranges))
		if h.Op != wire.OpReadReq {
			h.Length = uint64(len(payload))
		}
		h.Encode(b)
		for i, r := range ranges {
			wire.PutRange(b[wire.HeaderSize+i*wire.RangeSize:], r)
		}
		return append(b, payload...)
	}
	nonceHello, _ := msgpackHello(hello{Version: 1, Role: roleData, From: "fuzzer", FromInc: 9, To: "fuzz-target", ToInc: fuzzInc, Nonce: make([]byte, authNonceBytes)})
	hello := func(role uint8) []byte {
		b, _ := msgpackHello(hello{Version: 1, Role: role, From: "fuzzer", FromInc: 9, To: "fuzz-target", ToInc: fuzzInc})
		return b
	}
	// tagged encodes a READ_REQ of one range carrying tag.
	tagged := func(h wire.Header, r wire.Range, tag string) []byte {
		b := frame(h, []wire.Range{r}, nil)
		(&wire.Header{Op: h.Op, Req: h.Req, Count: 1, Length: uint64(len(tag))}).Encode(b)
		return append(b, tag...)
	}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	data := hello(roleData)
	return [][]byte{
		cat(data, frame(wire.Header{Op: wire.OpReadReq, Req: 1}, []wire.Range{{Region: 1, Offset: 0, Length: 4096}, {Region: 2, Offset: 64, Length: 64}}, nil)),
		cat(data, frame(wire.Header{Op: wire.OpWriteData, Req: 2}, []wire.Range{{Region: 2, Offset: 8, Length: 16}}, bytes.Repeat([]byte{7}, 16))),
		cat(data, frame(wire.Header{Op: wire.OpWriteData, Req: 3}, []wire.Range{{Region: 1, Offset: 0, Length: 16}}, bytes.Repeat([]byte{7}, 16))),
		cat(data, frame(wire.Header{Op: wire.OpReadReq, Req: 4}, []wire.Range{{Region: 9, Offset: 0, Length: 1}}, nil)),
		cat(data, frame(wire.Header{Op: wire.OpReadReq, Req: 5}, []wire.Range{{Region: 1, Offset: 1 << 16, Length: 1}}, nil)),
		cat(data, frame(wire.Header{Op: wire.OpNotif}, nil, []byte("x"))),
		cat(data, tagged(wire.Header{Op: wire.OpReadReq, Req: 6}, wire.Range{Region: 1, Offset: 64, Length: 64}, "ok"),
			tagged(wire.Header{Op: wire.OpReadReq, Req: 7}, wire.Range{Region: 1, Offset: 0, Length: 64}, "deny")),
		cat(data, frame(wire.Header{Op: wire.OpAuth}, nil, []byte{0x91, 0xc0})),
		nonceHello,
		cat(hello(roleControl), frame(wire.Header{Op: wire.OpNotif, Req: 1}, nil, []byte("HB:1,2"))),
		hello(roleMeta),
		data[:len(data)-1],
		[]byte("not a frame at all"),
	}
}

// TestWriteFuzzSeeds regenerates the checked-in seed corpora when
// KVBRIDGE_WRITE_FUZZ_SEEDS=1 (run once after changing the formats).
func TestWriteFuzzSeeds(t *testing.T) {
	if os.Getenv("KVBRIDGE_WRITE_FUZZ_SEEDS") == "" {
		t.Skip("set KVBRIDGE_WRITE_FUZZ_SEEDS=1 to regenerate testdata/fuzz")
	}
	write := func(dir string, seeds [][]byte) {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for i, s := range seeds {
			body := "go test fuzz v1\n[]byte(" + goQuote(s) + ")\n"
			if err := os.WriteFile(filepath.Join(dir, "seed-"+itoa(i)), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	write("testdata/fuzz/FuzzDecodeMetadata", metadataSeeds(t))
	write("testdata/fuzz/FuzzServeConn", serveSeeds())
	write("testdata/fuzz/FuzzServeConnAuth", authSeeds())
	var hb [wire.HeaderSize]byte
	var hdrs [][]byte
	for _, h := range []wire.Header{
		{Op: wire.OpReadReq, Req: 1, Count: 2},
		{Op: wire.OpWriteData, Req: 2, Count: 1, Length: 4096},
		{Op: wire.OpNotif, Req: 3, Length: 5},
		{Op: wire.OpError, Req: 4, Count: 2, Length: 10},
		{Op: wire.OpReadReq, Req: 5, Count: 1, Length: 12},
		{Op: wire.OpChallenge, Length: 80},
		{Op: wire.OpAuth, Length: 35},
	} {
		h.Encode(hb[:])
		hdrs = append(hdrs, bytes.Clone(hb[:]))
	}
	hdrs = append(hdrs, hb[:20], []byte("KVBX"))
	write("internal/wire/testdata/fuzz/FuzzDecodeHeader", hdrs)
	rb := make([]byte, 2*wire.RangeSize)
	wire.PutRange(rb, wire.Range{Region: 1, Offset: 0, Length: 4096})
	wire.PutRange(rb[wire.RangeSize:], wire.Range{Region: 2, Offset: 1 << 33, Length: 1})
	write("internal/wire/testdata/fuzz/FuzzAppendRanges", [][]byte{rb, rb[:30], make([]byte, wire.RangeSize)})
}

// goQuote renders b as a Go string literal (as the fuzz corpus format expects).
func goQuote(b []byte) string {
	const hex = "0123456789abcdef"
	out := []byte{'"'}
	for _, c := range b {
		switch {
		case c == '"' || c == '\\':
			out = append(out, '\\', c)
		case c >= 0x20 && c < 0x7f:
			out = append(out, c)
		default:
			out = append(out, '\\', 'x', hex[c>>4], hex[c&15])
		}
	}
	return string(append(out, '"'))
}

// itoa formats a small non-negative int.
func itoa(i int) string {
	if i < 10 {
		return string(rune('0' + i))
	}
	return itoa(i/10) + string(rune('0'+i%10))
}
