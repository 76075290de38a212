package transfer

import (
	"bytes"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

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
		b, err := msgpack.Marshal(&m.metaWire)
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
	a, err := NewAgent("fuzz-target", Config{ListenTCP: "none", UnixSocket: "none", NotifQueue: 16})
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
	v2[1] = 2 // the version is the first array element (a positive fixint)
	return [][]byte{blob, blob[:len(blob)/2], v2, {0x90}, {0xdd, 0xff, 0xff, 0xff, 0xff}, {0xdb, 0x7f, 0xff, 0xff, 0xff}}
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
	hello := func(role uint8) []byte {
		b, _ := msgpackHello(hello{Version: 1, Role: role, From: "fuzzer", FromInc: 9, To: "fuzz-target", ToInc: fuzzInc})
		return b
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
	var hb [wire.HeaderSize]byte
	var hdrs [][]byte
	for _, h := range []wire.Header{
		{Op: wire.OpReadReq, Req: 1, Count: 2},
		{Op: wire.OpWriteData, Req: 2, Count: 1, Length: 4096},
		{Op: wire.OpNotif, Req: 3, Length: 5},
		{Op: wire.OpError, Req: 4, Count: 2, Length: 10},
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
