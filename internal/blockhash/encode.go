package blockhash

import "encoding/binary"

// The two byte encodings of the tuple (parent, tokens, None) that vLLM hashes, written by hand for
// the few types the tuple holds: cbor2.dumps(..., canonical=True) and pickle.dumps(..., protocol=5).
// Token ids are never negative.

// cborHead appends a CBOR head of major type major with argument n, in its shortest form (as
// canonical CBOR requires).
func cborHead(dst []byte, major byte, n uint64) []byte {
	m := major << 5
	switch {
	case n < 24:
		return append(dst, m|byte(n))
	case n <= 0xff:
		return append(dst, m|24, byte(n))
	case n <= 0xffff:
		return binary.BigEndian.AppendUint16(append(dst, m|25), uint16(n))
	case n <= 0xffffffff:
		return binary.BigEndian.AppendUint32(append(dst, m|26), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(dst, m|27), n)
}

// cborText appends s as a CBOR text string.
func cborText(dst []byte, s string) []byte { return append(cborHead(dst, 3, uint64(len(s))), s...) }

// cborBlock appends the CBOR of (parent, tuple(tokens), None): an array of three items.
func cborBlock(dst []byte, parent Hash, tokens []int32) []byte {
	dst = cborHead(dst, 4, 3)
	dst = append(cborHead(dst, 2, uint64(len(parent))), parent[:]...)
	dst = cborHead(dst, 4, uint64(len(tokens)))
	for _, t := range tokens {
		dst = cborHead(dst, 0, uint64(uint32(t)))
	}
	return append(dst, 0xf6) // None
}

// Pickle opcodes (Lib/pickle.py) the tuple's pickle uses.
const (
	pProto           = 0x80
	pFrame           = 0x95
	pShortBinBytes   = 'C'
	pShortBinUnicode = 0x8c
	pBinUnicode      = 'X'
	pMemoize         = 0x94
	pMark            = '('
	pTuple           = 't'
	pEmptyTuple      = ')'
	pTuple1          = 0x85
	pTuple3          = 0x87
	pBinInt1         = 'K'
	pBinInt2         = 'M'
	pBinInt          = 'J'
	pNone            = 'N'
	pStop            = '.'
)

// pickleFramed wraps body (the pickled object and STOP) as protocol 5 writes it: PROTO 5, then the
// body in one FRAME (the pickler frames anything of 4 bytes or more).
func pickleFramed(dst, body []byte) []byte {
	dst = append(dst, pProto, 5)
	if len(body) >= 4 {
		dst = binary.LittleEndian.AppendUint64(append(dst, pFrame), uint64(len(body)))
	}
	return append(dst, body...)
}

// pickleText returns the pickle of the str s.
func pickleText(s string) []byte {
	var body []byte
	if len(s) < 256 {
		body = append(body, pShortBinUnicode, byte(len(s)))
	} else {
		body = binary.LittleEndian.AppendUint32(append(body, pBinUnicode), uint32(len(s)))
	}
	body = append(append(body, s...), pMemoize, pStop)
	return pickleFramed(nil, body)
}

// pickleBlock appends the pickle of (parent, tuple(tokens), None).
func pickleBlock(dst []byte, parent Hash, tokens []int32) []byte {
	var stack [256]byte
	body := append(stack[:0], pShortBinBytes, byte(len(parent)))
	body = append(append(body, parent[:]...), pMemoize)
	switch len(tokens) {
	case 0:
		body = append(body, pEmptyTuple)
	default:
		if len(tokens) > 3 {
			body = append(body, pMark)
		}
		for _, t := range tokens {
			switch {
			case t >= 0 && t <= 0xff:
				body = append(body, pBinInt1, byte(t))
			case t >= 0 && t <= 0xffff:
				body = binary.LittleEndian.AppendUint16(append(body, pBinInt2), uint16(t))
			default:
				body = binary.LittleEndian.AppendUint32(append(body, pBinInt), uint32(t))
			}
		}
		if len(tokens) > 3 {
			body = append(body, pTuple)
		} else {
			body = append(body, pTuple1+byte(len(tokens)-1))
		}
		body = append(body, pMemoize)
	}
	body = append(body, pNone, pTuple3, pMemoize, pStop)
	return pickleFramed(dst, body)
}
