package tokenizer

// seqPrefix returns how many leading bytes of p (non-empty) form a prefix of one well-formed
// UTF-8 sequence (0 if p[0] cannot start one) and the length that sequence needs.
func seqPrefix(p []byte) (n, size int) {
	c := p[0]
	lo, hi := byte(0x80), byte(0xBF) // allowed range of the second byte
	switch {
	case c < 0x80:
		return 1, 1
	case c >= 0xC2 && c <= 0xDF:
		size = 2
	case c == 0xE0:
		size, lo = 3, 0xA0
	case c == 0xED:
		size, hi = 3, 0x9F
	case c >= 0xE1 && c <= 0xEF:
		size = 3
	case c == 0xF0:
		size, lo = 4, 0x90
	case c >= 0xF1 && c <= 0xF3:
		size = 4
	case c == 0xF4:
		size, hi = 4, 0x8F
	default:
		return 0, 1
	}
	n = 1
	for n < size && n < len(p) {
		b := p[n]
		if n == 1 && (b < lo || b > hi) || n > 1 && (b < 0x80 || b > 0xBF) {
			break
		}
		n++
	}
	return n, size
}

// appendValid appends to dst the longest prefix of b that can be decided now: valid sequences as
// they are, each maximal invalid subsequence as U+FFFD. With final false, an incomplete but
// possibly valid sequence at the very end is left undecided; the number of bytes consumed is
// returned.
func appendValid(dst, b []byte, final bool) ([]byte, int) {
	i := 0
	for i < len(b) {
		if c := b[i]; c < 0x80 {
			dst = append(dst, c)
			i++
			continue
		}
		n, size := seqPrefix(b[i:])
		switch {
		case n == size:
			dst = append(dst, b[i:i+n]...)
			i += n
		case !final && n > 0 && i+n == len(b):
			return dst, i // may still be completed by the next token
		default:
			dst = append(dst, "\uFFFD"...)
			i += max(n, 1)
		}
	}
	return dst, i
}

// appendLossy appends b to dst with invalid UTF-8 replaced by U+FFFD.
func appendLossy(dst, b []byte) []byte {
	dst, _ = appendValid(dst, b, true)
	return dst
}
