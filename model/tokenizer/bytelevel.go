package tokenizer

import "unicode/utf8"

// byteLevel is GPT-2's reversible map between bytes and printable runes, used by byte-level BPE
// vocabularies (every vocabulary string is written in this alphabet: a space is "Ġ", a newline
// "Ċ").
type byteLevel struct {
	toRune [256]rune
	toByte map[rune]byte
}

// newByteLevel builds the map exactly as GPT-2's bytes_to_unicode: printable Latin-1 bytes map to
// themselves, the 68 others to U+0100 onwards in byte order.
func newByteLevel() *byteLevel {
	bl := &byteLevel{toByte: make(map[rune]byte, 256)}
	printable := func(b int) bool {
		return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)
	}
	n := 0
	for b := range 256 {
		r := rune(b)
		if !printable(b) {
			r = rune(256 + n)
			n++
		}
		bl.toRune[b] = r
		bl.toByte[r] = byte(b)
	}
	return bl
}

// encode returns the byte-level spelling of raw bytes b (the form used in vocab and merges).
func (bl *byteLevel) encode(b []byte) string {
	out := make([]byte, 0, 2*len(b))
	for _, c := range b {
		out = utf8.AppendRune(out, bl.toRune[c])
	}
	return string(out)
}

// decode maps a byte-level string back to raw bytes. Runes outside the alphabet (which a
// well-formed byte-level vocabulary never contains) are kept as their UTF-8 encoding; ok reports
// whether every rune was in the alphabet.
func (bl *byteLevel) decode(s string) (b []byte, ok bool) {
	b = make([]byte, 0, len(s))
	ok = true
	for _, r := range s {
		if c, in := bl.toByte[r]; in {
			b = append(b, c)
			continue
		}
		ok = false
		b = utf8.AppendRune(b, r)
	}
	return b, ok
}
