// Package wire defines the fixed little-endian frame format spoken on kvbridge transfer
// connections (TCP data and control connections and the same-host Unix control socket).
//
// Every frame starts with a HeaderSize-byte header. Depending on the opcode it is followed by a
// range list (Count entries of RangeSize bytes) and/or Length payload bytes. No msgpack or other
// self-describing encoding is used on the data path; the control-plane payloads (hello,
// challenge, proof, metadata) are opaque bytes to this package.
//
// A connection starts with HELLO (dialer → listener). Without authentication the listener
// answers HELLO_ACK or ERROR. With authentication it answers CHALLENGE (its nonce and its own
// proof), the dialer sends AUTH (its proof), and the listener answers HELLO_ACK or ERROR.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Magic identifies a kvbridge transfer frame ("KVBX" read as little-endian uint32).
const Magic uint32 = 0x5842564b

// Version is the frame format version this package speaks.
const Version uint8 = 1

// HeaderSize is the size in bytes of an encoded Header.
const HeaderSize = 40

// RangeSize is the size in bytes of one encoded Range.
const RangeSize = 24

// Op is a frame opcode.
type Op uint8

// Frame opcodes.
const (
	OpHello     Op = 1  // dialer → listener: msgpack hello payload (Length bytes)
	OpHelloAck  Op = 2  // listener → dialer: msgpack ack payload (Length bytes), fds attached on Unix sockets
	OpError     Op = 3  // response carrying an error code (Count) and a UTF-8 message (Length bytes)
	OpReadReq   Op = 4  // initiator → target: Count ranges to read, then Length tag bytes (the request's authorization tag, may be 0)
	OpReadData  Op = 5  // target → initiator: Length payload bytes, the ranges' bytes in order
	OpWriteData Op = 6  // initiator → target: Count ranges followed by Length payload bytes
	OpWriteAck  Op = 7  // target → initiator: the ranges of a WriteData frame are placed
	OpNotif     Op = 8  // either direction on a control connection: Length message bytes
	OpChallenge Op = 9  // listener → dialer: msgpack challenge payload (nonce, listener proof)
	OpAuth      Op = 10 // dialer → listener: msgpack proof payload answering a challenge
	opMax       Op = 10 // highest valid opcode; 0 is never valid
)

// String returns the opcode name.
func (o Op) String() string {
	switch o {
	case OpHello:
		return "HELLO"
	case OpHelloAck:
		return "HELLO_ACK"
	case OpError:
		return "ERROR"
	case OpReadReq:
		return "READ_REQ"
	case OpReadData:
		return "READ_DATA"
	case OpWriteData:
		return "WRITE_DATA"
	case OpWriteAck:
		return "WRITE_ACK"
	case OpNotif:
		return "NOTIF"
	case OpChallenge:
		return "CHALLENGE"
	case OpAuth:
		return "AUTH"
	}
	return fmt.Sprintf("OP(%d)", uint8(o))
}

// ErrMalformed reports a frame that does not follow the format (bad magic, version, opcode,
// reserved bits or field combination). A connection that produced one cannot be resynchronised.
var ErrMalformed = errors.New("wire: malformed frame")

// Header is the fixed part of every frame.
//
// Layout (little-endian): magic u32 | version u8 | op u8 | flags u16 | req u64 | seq u32 |
// count u32 | length u64 | aux u64.
type Header struct {
	Op     Op
	Flags  uint16 // reserved, must be 0
	Req    uint64 // request id (initiator-chosen) or notification sequence
	Seq    uint32 // stripe index within a request
	Count  uint32 // number of ranges following the header, or the error code of an OpError
	Length uint64 // payload bytes following the header (and the range list, if any)
	Aux    uint64 // opcode-specific; 0 unless documented
}

// Encode writes h into b[:HeaderSize]. It panics if b is shorter, like binary.LittleEndian.
func (h *Header) Encode(b []byte) {
	_ = b[HeaderSize-1]
	binary.LittleEndian.PutUint32(b[0:], Magic)
	b[4] = Version
	b[5] = uint8(h.Op)
	binary.LittleEndian.PutUint16(b[6:], h.Flags)
	binary.LittleEndian.PutUint64(b[8:], h.Req)
	binary.LittleEndian.PutUint32(b[16:], h.Seq)
	binary.LittleEndian.PutUint32(b[20:], h.Count)
	binary.LittleEndian.PutUint64(b[24:], h.Length)
	binary.LittleEndian.PutUint64(b[32:], h.Aux)
}

// DecodeHeader parses and checks a header. It validates the magic, the version, the opcode,
// the reserved flags and the per-opcode field rules that do not depend on limits (for those
// see Limits.Check).
func DecodeHeader(b []byte) (Header, error) {
	var h Header
	if len(b) < HeaderSize {
		return h, fmt.Errorf("%w: header truncated (%d of %d bytes)", ErrMalformed, len(b), HeaderSize)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != Magic {
		return h, fmt.Errorf("%w: bad magic %#x", ErrMalformed, m)
	}
	if v := b[4]; v != Version {
		return h, fmt.Errorf("%w: unsupported version %d", ErrMalformed, v)
	}
	h.Op = Op(b[5])
	h.Flags = binary.LittleEndian.Uint16(b[6:])
	h.Req = binary.LittleEndian.Uint64(b[8:])
	h.Seq = binary.LittleEndian.Uint32(b[16:])
	h.Count = binary.LittleEndian.Uint32(b[20:])
	h.Length = binary.LittleEndian.Uint64(b[24:])
	h.Aux = binary.LittleEndian.Uint64(b[32:])
	if h.Op == 0 || h.Op > opMax {
		return h, fmt.Errorf("%w: unknown opcode %d", ErrMalformed, uint8(h.Op))
	}
	if h.Flags != 0 {
		return h, fmt.Errorf("%w: reserved flags %#x set", ErrMalformed, h.Flags)
	}
	switch h.Op {
	case OpReadReq:
		if h.Count == 0 {
			return h, fmt.Errorf("%w: %v without ranges", ErrMalformed, h.Op)
		}
	case OpWriteData:
		if h.Count == 0 || h.Length == 0 {
			return h, fmt.Errorf("%w: %v with %d ranges and %d payload bytes", ErrMalformed, h.Op, h.Count, h.Length)
		}
	case OpReadData, OpWriteAck, OpNotif, OpHello, OpHelloAck, OpChallenge, OpAuth:
		if h.Count != 0 {
			return h, fmt.Errorf("%w: %v with %d ranges", ErrMalformed, h.Op, h.Count)
		}
	case OpError:
		if h.Count == 0 {
			return h, fmt.Errorf("%w: error frame without a code", ErrMalformed)
		}
	}
	return h, nil
}

// Limits bounds what a receiver accepts; a frame beyond them is malformed for that receiver.
type Limits struct {
	MaxRanges  uint32 // ranges per frame
	MaxPayload uint64 // payload bytes per data frame (READ_DATA, WRITE_DATA, and a READ_REQ's total)
	MaxControl uint64 // payload bytes per control frame (HELLO, HELLO_ACK, CHALLENGE, AUTH, NOTIF, ERROR)
	MaxTag     uint64 // tag bytes per READ_REQ (0: READ_REQ frames carry no tag)
}

// Check applies the limits to a decoded header.
func (l Limits) Check(h Header) error {
	if h.Count > 0 && h.Op != OpError && h.Count > l.MaxRanges {
		return fmt.Errorf("%w: %d ranges exceed the limit of %d", ErrMalformed, h.Count, l.MaxRanges)
	}
	switch h.Op {
	case OpReadData, OpWriteData:
		if h.Length > l.MaxPayload {
			return fmt.Errorf("%w: %d payload bytes exceed the limit of %d", ErrMalformed, h.Length, l.MaxPayload)
		}
	case OpReadReq:
		if h.Length > l.MaxTag {
			return fmt.Errorf("%w: READ_REQ tag of %d bytes exceeds the limit of %d", ErrMalformed, h.Length, l.MaxTag)
		}
	default:
		if h.Length > l.MaxControl {
			return fmt.Errorf("%w: %d control bytes exceed the limit of %d", ErrMalformed, h.Length, l.MaxControl)
		}
	}
	return nil
}

// Range names bytes in a registered region of the receiving agent.
type Range struct {
	Region uint32
	Offset uint64
	Length uint64
}

// PutRange writes r into b[:RangeSize]: region u32 | reserved u32 (0) | offset u64 | length u64.
func PutRange(b []byte, r Range) {
	_ = b[RangeSize-1]
	binary.LittleEndian.PutUint32(b[0:], r.Region)
	binary.LittleEndian.PutUint32(b[4:], 0)
	binary.LittleEndian.PutUint64(b[8:], r.Offset)
	binary.LittleEndian.PutUint64(b[16:], r.Length)
}

// AppendRanges decodes len(b)/RangeSize ranges from b and appends them to dst. len(b) must be a
// multiple of RangeSize, the reserved word must be zero and every length non-zero.
func AppendRanges(dst []Range, b []byte) ([]Range, error) {
	if len(b)%RangeSize != 0 {
		return dst, fmt.Errorf("%w: range list of %d bytes", ErrMalformed, len(b))
	}
	for i := 0; i+RangeSize <= len(b); i += RangeSize {
		e := b[i : i+RangeSize]
		if binary.LittleEndian.Uint32(e[4:]) != 0 {
			return dst, fmt.Errorf("%w: range %d: reserved word set", ErrMalformed, i/RangeSize)
		}
		r := Range{
			Region: binary.LittleEndian.Uint32(e[0:]),
			Offset: binary.LittleEndian.Uint64(e[8:]),
			Length: binary.LittleEndian.Uint64(e[16:]),
		}
		if r.Length == 0 {
			return dst, fmt.Errorf("%w: range %d: zero length", ErrMalformed, i/RangeSize)
		}
		dst = append(dst, r)
	}
	return dst, nil
}
