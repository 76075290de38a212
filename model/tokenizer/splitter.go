package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// Pre-tokenizer patterns with a hand-written splitter. Each splitter produces exactly the pieces
// dlclark/regexp2 produces for the pattern (splitter_test.go checks this on random and fuzzed
// text), at a fraction of the cost.
const (
	// PatternQwen2 is the Split regex of Qwen2, Qwen2.5 and Qwen3 tokenizer.json files.
	PatternQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// PatternLlama3 is the Split regex of Llama 3.x tokenizer.json files (digits in groups of
	// up to three).
	PatternLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// PatternGPT2 is the regex of the ByteLevel pre-tokenizer with use_regex (GPT-2, RoBERTa).
	PatternGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// runeClass partitions runes the way the patterns above see them.
type runeClass uint8

const (
	classOther   runeClass = iota // [^\s\p{L}\p{N}]
	classLetter                   // \p{L}
	classNumber                   // \p{N}
	classSpace                    // \s other than \r and \n
	classNewline                  // \r or \n
)

// classify matches regexp2's definitions: \p{L} and \p{N} are Go's unicode.Letter and
// unicode.Number tables, \s is unicode.IsSpace. Invalid UTF-8 arrives as U+FFFD (classOther).
func classify(r rune) runeClass {
	if r < utf8.RuneSelf {
		switch {
		case 'a' <= r && r <= 'z', 'A' <= r && r <= 'Z':
			return classLetter
		case '0' <= r && r <= '9':
			return classNumber
		case r == '\r' || r == '\n':
			return classNewline
		case r == ' ' || r == '\t' || r == '\v' || r == '\f':
			return classSpace
		}
		return classOther
	}
	switch {
	case unicode.IsLetter(r):
		return classLetter
	case unicode.IsNumber(r):
		return classNumber
	case unicode.IsSpace(r):
		return classSpace
	}
	return classOther
}

// runeAt decodes the rune at byte offset i (i < len(s)).
func runeAt(s string, i int) (rune, int) {
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1
	}
	return utf8.DecodeRuneInString(s[i:])
}

// classAt returns the class and width of the rune at i, or ok=false at the end of s.
func classAt(s string, i int) (c runeClass, r rune, w int, ok bool) {
	if i >= len(s) {
		return 0, 0, 0, false
	}
	r, w = runeAt(s, i)
	return classify(r), r, w, true
}

// skipClass returns the end of the run of runes of class c starting at i.
func skipClass(s string, i int, c runeClass) int {
	for i < len(s) {
		cc, _, w, _ := classAt(s, i)
		if cc != c {
			break
		}
		i += w
	}
	return i
}

// contraction reports the end of an English contraction ('s 't 're 've 'm 'll 'd) that starts
// with the apostrophe at i, or -1. With fold, letters match case-insensitively the way regexp2's
// (?i) does (lower-casing the input rune).
func contraction(s string, i int, fold bool) int {
	lower := func(j int) (rune, int) {
		if j >= len(s) {
			return -1, 0
		}
		r, w := runeAt(s, j)
		if fold {
			r = unicode.ToLower(r)
		}
		return r, w
	}
	j := i + 1
	r1, w1 := lower(j)
	switch r1 {
	case 's', 't', 'm', 'd':
		return j + w1
	case 'r', 'v', 'l':
		r2, w2 := lower(j + w1)
		if (r1 == 'r' && r2 == 'e') || (r1 == 'v' && r2 == 'e') || (r1 == 'l' && r2 == 'l') {
			return j + w1 + w2
		}
	}
	return -1
}

// spaceRunEnd returns the end of the run of \s runes starting at i, the start of its last rune,
// the number of runes and the end of its last \r or \n (-1 if none).
func spaceRunEnd(s string, i int) (end, lastStart, n, afterNewline int) {
	end, lastStart, afterNewline = i, i, -1
	for end < len(s) {
		c, _, w, _ := classAt(s, end)
		if c != classSpace && c != classNewline {
			break
		}
		if c == classNewline {
			afterNewline = end + w
		}
		lastStart = end
		end += w
		n++
	}
	return end, lastStart, n, afterNewline
}

// splitQwen appends to out the pieces of s under PatternQwen2 (maxDigits 1) or PatternLlama3
// (maxDigits 3).
func splitQwen(s string, maxDigits int, out []string) []string {
	for i := 0; i < len(s); {
		end := matchQwen(s, i, maxDigits)
		out = append(out, s[i:end])
		i = end
	}
	return out
}

// matchQwen returns the end of the match that starts at i, trying the alternatives in pattern
// order exactly as a backtracking engine would.
func matchQwen(s string, i, maxDigits int) int {
	c, r, w, _ := classAt(s, i)
	// (?i:'s|'t|'re|'ve|'m|'ll|'d)
	if r == '\'' {
		if end := contraction(s, i, true); end > 0 {
			return end
		}
	}
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if c == classOther || c == classSpace {
		if nc, _, nw, ok := classAt(s, i+w); ok && nc == classLetter {
			return skipClass(s, i+w+nw, classLetter)
		}
	}
	if c == classLetter {
		return skipClass(s, i+w, classLetter)
	}
	// \p{N} or \p{N}{1,3}
	if c == classNumber {
		end := i + w
		for k := 1; k < maxDigits; k++ {
			nc, _, nw, ok := classAt(s, end)
			if !ok || nc != classNumber {
				break
			}
			end += nw
		}
		return end
	}
	// ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	if r == ' ' {
		if nc, _, nw, ok := classAt(s, i+w); ok && nc == classOther {
			return skipClass(s, skipClass(s, i+w+nw, classOther), classNewline)
		}
	}
	if c == classOther {
		return skipClass(s, skipClass(s, i+w, classOther), classNewline)
	}
	// Whitespace: \s*[\r\n]+ | \s+(?!\S) | \s+
	end, lastStart, n, afterNewline := spaceRunEnd(s, i)
	switch {
	case afterNewline > 0:
		return afterNewline
	case end == len(s) || n == 1:
		return end
	default:
		return lastStart
	}
}

// splitGPT2 appends to out the pieces of s under PatternGPT2.
func splitGPT2(s string, out []string) []string {
	for i := 0; i < len(s); {
		end := matchGPT2(s, i)
		out = append(out, s[i:end])
		i = end
	}
	return out
}

// matchGPT2 returns the end of the PatternGPT2 match that starts at i.
func matchGPT2(s string, i int) int {
	c, r, w, _ := classAt(s, i)
	if r == '\'' {
		if end := contraction(s, i, false); end > 0 {
			return end
		}
	}
	// ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
	if r == ' ' {
		if nc, _, nw, ok := classAt(s, i+w); ok && nc != classSpace && nc != classNewline {
			return skipClass(s, i+w+nw, nc)
		}
	}
	if c != classSpace && c != classNewline {
		return skipClass(s, i+w, c)
	}
	end, lastStart, n, _ := spaceRunEnd(s, i)
	if end == len(s) || n == 1 {
		return end
	}
	return lastStart
}
