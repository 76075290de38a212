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
	// need returns the size of a header of h bytes followed by a body of l bytes, if present.
	need := func(h int, l uint64) (int, error) {
		if uint64(len(b)) < uint64(h) || l > uint64(len(b)-h) {
			return 0, fmt.Errorf("declared length %d exceeds input", l)
		}
		return h + int(l), nil
	}
	length := func(h int) (uint64, error) {
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
	items := func(h int, count uint64) (int, error) {
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
	switch {
	case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		return 1, nil
	case c >= 0x80 && c <= 0x8f:
		return items(1, 2*uint64(c&0x0f))
	case c >= 0x90 && c <= 0x9f:
		return items(1, uint64(c&0x0f))
	case c >= 0xa0 && c <= 0xbf:
		return need(1, uint64(c&0x1f))
	}
	switch c {
	case 0xcc, 0xd0:
		return need(1, 1)
	case 0xcd, 0xd1:
		return need(1, 2)
	case 0xca, 0xce, 0xd2:
		return need(1, 4)
	case 0xcb, 0xcf, 0xd3:
		return need(1, 8)
	case 0xd4:
		return need(2, 1)
	case 0xd5:
		return need(2, 2)
	case 0xd6:
		return need(2, 4)
	case 0xd7:
		return need(2, 8)
	case 0xd8:
		return need(2, 16)
	case 0xc4, 0xd9: // bin8, str8
		l, err := length(1)
		if err != nil {
			return 0, err
		}
		return need(2, l)
	case 0xc5, 0xda: // bin16, str16
		l, err := length(2)
		if err != nil {
			return 0, err
		}
		return need(3, l)
	case 0xc6, 0xdb: // bin32, str32
		l, err := length(4)
		if err != nil {
			return 0, err
		}
		return need(5, l)
	case 0xc7, 0xc8, 0xc9: // ext8/16/32
		h := map[byte]int{0xc7: 1, 0xc8: 2, 0xc9: 4}[c]
		l, err := length(h)
		if err != nil {
			return 0, err
		}
		return need(2+h, l)
	case 0xdc:
		l, err := length(2)
		if err != nil {
			return 0, err
		}
		return items(3, l)
	case 0xdd:
		l, err := length(4)
		if err != nil {
			return 0, err
		}
		return items(5, l)
	case 0xde:
		l, err := length(2)
		if err != nil {
			return 0, err
		}
		return items(3, 2*l)
	case 0xdf:
		l, err := length(4)
		if err != nil {
			return 0, err
		}
		return items(5, 2*l)
	}
	return 0, fmt.Errorf("invalid type byte %#x", c)
}
