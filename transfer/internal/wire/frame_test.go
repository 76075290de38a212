package wire

import (
	"bytes"
	"errors"
	"testing"
)

func TestHeaderRoundTrip(t *testing.T) {
	h := Header{Op: OpWriteData, Req: 7, Seq: 3, Count: 2, Length: 8192, Aux: 9}
	var b [HeaderSize]byte
	h.Encode(b[:])
	got, err := DecodeHeader(b[:])
	if err != nil || got != h {
		t.Fatalf("got %+v, %v", got, err)
	}
	for i := range HeaderSize {
		if _, err := DecodeHeader(b[:i]); !errors.Is(err, ErrMalformed) {
			t.Fatalf("truncated header of %d bytes: %v", i, err)
		}
	}
	bad := b
	bad[0]++
	if _, err := DecodeHeader(bad[:]); !errors.Is(err, ErrMalformed) {
		t.Fatal("bad magic accepted")
	}
	for _, h := range []Header{
		{Op: OpReadReq},             // no ranges
		{Op: OpChallenge, Count: 1}, // ranges on a challenge
		{Op: OpWriteData, Count: 1}, // no payload
		{Op: OpNotif, Count: 1},     // ranges on a notification
		{Op: OpError},               // no code
		{Op: 0},
		{Op: 200},
		{Op: OpNotif, Flags: 1},
	} {
		h.Encode(b[:])
		if _, err := DecodeHeader(b[:]); !errors.Is(err, ErrMalformed) {
			t.Fatalf("%+v accepted", h)
		}
	}
	lim := Limits{MaxRanges: 4, MaxPayload: 1 << 20, MaxControl: 100}
	if err := lim.Check(Header{Op: OpReadReq, Count: 5}); err == nil {
		t.Fatal("too many ranges accepted")
	}
	if err := lim.Check(Header{Op: OpWriteData, Count: 1, Length: 1<<20 + 1}); err == nil {
		t.Fatal("oversized payload accepted")
	}
	if err := lim.Check(Header{Op: OpNotif, Length: 101}); err == nil {
		t.Fatal("oversized notification accepted")
	}
	if err := lim.Check(Header{Op: OpReadReq, Count: 1, Length: 1}); err == nil {
		t.Fatal("a READ_REQ tag accepted by a receiver that takes none")
	}
	lim.MaxTag = 16
	if err := lim.Check(Header{Op: OpReadReq, Count: 1, Length: 16}); err != nil {
		t.Fatalf("READ_REQ tag within the limit: %v", err)
	}
	if err := lim.Check(Header{Op: OpReadReq, Count: 1, Length: 17}); err == nil {
		t.Fatal("oversized READ_REQ tag accepted")
	}
}

func TestRanges(t *testing.T) {
	in := []Range{{Region: 1, Offset: 0, Length: 4096}, {Region: 2, Offset: 1 << 40, Length: 1}}
	b := make([]byte, len(in)*RangeSize)
	for i, r := range in {
		PutRange(b[i*RangeSize:], r)
	}
	out, err := AppendRanges(nil, b)
	if err != nil || len(out) != 2 || out[0] != in[0] || out[1] != in[1] {
		t.Fatalf("%v %v", out, err)
	}
	if _, err := AppendRanges(nil, b[:RangeSize+1]); err == nil {
		t.Fatal("ragged list accepted")
	}
	b[4] = 1
	if _, err := AppendRanges(nil, b); err == nil {
		t.Fatal("reserved word accepted")
	}
}

// FuzzDecodeHeader: decoding never panics, and whatever decodes re-encodes to the same bytes.
func FuzzDecodeHeader(f *testing.F) {
	var b [HeaderSize]byte
	(&Header{Op: OpReadReq, Req: 1, Count: 3}).Encode(b[:])
	f.Add(b[:])
	f.Fuzz(func(t *testing.T, in []byte) {
		h, err := DecodeHeader(in)
		if err != nil {
			return
		}
		var out [HeaderSize]byte
		h.Encode(out[:])
		if !bytes.Equal(out[:], in[:HeaderSize]) {
			t.Fatalf("round trip: %x → %+v → %x", in[:HeaderSize], h, out)
		}
		_ = Limits{MaxRanges: 1024, MaxPayload: 1 << 26, MaxControl: 1 << 20}.Check(h)
	})
}

// FuzzAppendRanges: decoding never panics; decoded ranges re-encode to the input.
func FuzzAppendRanges(f *testing.F) {
	b := make([]byte, RangeSize)
	PutRange(b, Range{Region: 1, Offset: 64, Length: 4096})
	f.Add(b)
	f.Fuzz(func(t *testing.T, in []byte) {
		rs, err := AppendRanges(nil, in)
		if err != nil {
			return
		}
		out := make([]byte, len(rs)*RangeSize)
		for i, r := range rs {
			PutRange(out[i*RangeSize:], r)
		}
		if !bytes.Equal(out, in) {
			t.Fatal("round trip mismatch")
		}
	})
}
