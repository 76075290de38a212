// Package msgpackcheck verifies untrusted msgpack before it is decoded: every declared length
// must fit in the input and nesting must stay shallow, so that a decoder never allocates more
// than the input's size suggests (a 6-byte array32 header can otherwise ask for gigabytes).
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package msgpackcheck

import (
	"encoding/binary"
	"fmt"
)

// Check walks one msgpack value in b, verifying that every declared length fits in the
// remaining input and that nesting stays within maxDepth. It returns the number of bytes the
// value occupies.
func Check(b []byte, maxDepth int) (int, error) {
	return msgpackWalk(b, 0, maxDepth)
}

// msgpackWalk returns the size of the value starting at b[0].
func msgpackWalk(b []byte, depth, maxDepth int) (int, error) {
	if depth > maxDepth {
		return 0, fmt.Errorf("nesting deeper than %d", maxDepth)
	}
	if len(b) == 0 {
		return 0, fmt.Errorf("truncated")
	}
	c := b[0]
	switch {
	case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		return 1, nil
	case c >= 0x80 && c <= 0x8f:
		return walkItems(b, 1, 2*uint64(c&0x0f), depth, maxDepth)
	case c >= 0x90 && c <= 0x9f:
		return walkItems(b, 1, uint64(c&0x0f), depth, maxDepth)
	case c >= 0xa0 && c <= 0xbf:
		return need(b, 1, uint64(c&0x1f))
	}
	l, ok := layoutOf(c)
	if !ok {
		return 0, fmt.Errorf("invalid type byte %#x", c)
	}
	if l.lenBytes == 0 {
		return need(b, l.header, l.body)
	}
	n, err := declaredLength(b, l.lenBytes)
	if err != nil {
		return 0, err
	}
	if l.perLen == 0 {
		return need(b, l.header, n)
	}
	return walkItems(b, l.header, l.perLen*n, depth, maxDepth)
}

// layout is how the value of a type byte (other than the fix* ones) is laid out.
type layout struct {
	lenBytes int    // size of the declared length that follows the type byte (0: none)
	header   int    // bytes before the body: the type byte, the length and an ext's type
	body     uint64 // the body's size when it is fixed (lenBytes 0)
	perLen   uint64 // items per unit of declared length: 0 (it counts bytes), 1 (array), 2 (map)
}

// layoutOf returns the layout of type byte c, if c is a valid one outside the fix* ranges.
func layoutOf(c byte) (layout, bool) {
	switch c {
	case 0xcc, 0xd0: // uint8, int8
		return layout{header: 1, body: 1}, true
	case 0xcd, 0xd1: // uint16, int16
		return layout{header: 1, body: 2}, true
	case 0xca, 0xce, 0xd2: // float32, uint32, int32
		return layout{header: 1, body: 4}, true
	case 0xcb, 0xcf, 0xd3: // float64, uint64, int64
		return layout{header: 1, body: 8}, true
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext1/2/4/8/16
		return layout{header: 2, body: 1 << (c - 0xd4)}, true
	case 0xc4, 0xd9: // bin8, str8
		return layout{lenBytes: 1, header: 2}, true
	case 0xc5, 0xda: // bin16, str16
		return layout{lenBytes: 2, header: 3}, true
	case 0xc6, 0xdb: // bin32, str32
		return layout{lenBytes: 4, header: 5}, true
	case 0xc7: // ext8
		return layout{lenBytes: 1, header: 3}, true
	case 0xc8: // ext16
		return layout{lenBytes: 2, header: 4}, true
	case 0xc9: // ext32
		return layout{lenBytes: 4, header: 6}, true
	case 0xdc: // array16
		return layout{lenBytes: 2, header: 3, perLen: 1}, true
	case 0xdd: // array32
		return layout{lenBytes: 4, header: 5, perLen: 1}, true
	case 0xde: // map16
		return layout{lenBytes: 2, header: 3, perLen: 2}, true
	case 0xdf: // map32
		return layout{lenBytes: 4, header: 5, perLen: 2}, true
	}
	return layout{}, false
}

// need returns the size of a header of h bytes followed by a body of l bytes, if b holds them.
func need(b []byte, h int, l uint64) (int, error) {
	if uint64(len(b)) < uint64(h) || l > uint64(len(b)-h) {
		return 0, fmt.Errorf("declared length %d exceeds input", l)
	}
	return h + int(l), nil
}

// declaredLength reads the big-endian length of h bytes (1, 2 or 4) after the type byte.
func declaredLength(b []byte, h int) (uint64, error) {
	if len(b) < 1+h {
		return 0, fmt.Errorf("truncated length")
	}
	switch h {
	case 1:
		return uint64(b[1]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(b[1:])), nil
	}
	return uint64(binary.BigEndian.Uint32(b[1:])), nil
}

// walkItems returns the size of a header of h bytes followed by count values, walking each one
// level deeper.
func walkItems(b []byte, h int, count uint64, depth, maxDepth int) (int, error) {
	// every item takes at least one byte
	if count > uint64(len(b)) {
		return 0, fmt.Errorf("declared %d items exceed input", count)
	}
	off := h
	for i := uint64(0); i < count; i++ {
		if off > len(b) {
			return 0, fmt.Errorf("truncated")
		}
		m, err := msgpackWalk(b[off:], depth+1, maxDepth)
		if err != nil {
			return 0, err
		}
		off += m
	}
	return off, nil
}
