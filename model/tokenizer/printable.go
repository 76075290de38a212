package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// IsPrintable reports whether id decodes, on its own, to non-empty printable UTF-8 text: it is
// a vocabulary token (not an added or special token) whose bytes are valid UTF-8 and whose runes
// are all printable (unicode.IsPrint, which includes the space) or '\n' or '\t'.
// A sequence of printable tokens always decodes to valid, printable UTF-8.
func (t *Tokenizer) IsPrintable(id int32) bool {
	if id < 0 || int(id) >= len(t.tokens) {
		return false
	}
	ti := &t.tokens[id]
	if !ti.ok || ti.added || len(ti.bytes) == 0 || !utf8.Valid(ti.bytes) {
		return false
	}
	for _, r := range string(ti.bytes) {
		if r != '\n' && r != '\t' && !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// UnprintableIDs returns, ascending, every id in [0, VocabSize) that is not printable (see
// IsPrintable): control bytes, lone bytes ≥ 0x80 and partial characters, special and added
// tokens, and ids without a token. A model that never samples these (generation_config
// suppress_tokens) always produces valid, printable UTF-8.
func (t *Tokenizer) UnprintableIDs() []int32 {
	var ids []int32
	for id := range t.tokens {
		if !t.IsPrintable(int32(id)) {
			ids = append(ids, int32(id))
		}
	}
	return ids
}
