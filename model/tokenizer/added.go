package tokenizer

import (
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"
)

// addedToken is an entry of tokenizer.json's added_tokens: text matched verbatim in the input
// before pre-tokenization and BPE.
type addedToken struct {
	id         int32
	content    string
	special    bool
	lstrip     bool // absorbs whitespace on its left
	rstrip     bool // absorbs whitespace on its right
	singleWord bool // only matches when not inside a word
}

// addedMatcher finds added tokens in text, leftmost-longest.
type addedMatcher struct {
	byFirst [256][]*addedToken // by first byte of content, longest first
}

// newAddedMatcher indexes tokens; empty contents are ignored.
func newAddedMatcher(tokens []*addedToken) *addedMatcher {
	m := &addedMatcher{}
	for _, t := range tokens {
		if t.content == "" {
			continue
		}
		c := t.content[0]
		m.byFirst[c] = append(m.byFirst[c], t)
	}
	for i := range m.byFirst {
		l := m.byFirst[i]
		sort.SliceStable(l, func(a, b int) bool { return len(l[a].content) > len(l[b].content) })
	}
	return m
}

// segment is a stretch of input: either plain text for BPE (tok == nil) or one added token.
type segment struct {
	text string
	tok  *addedToken
}

// split cuts text into plain stretches and added tokens, appending them to out.
func (m *addedMatcher) split(text string, out []segment) []segment {
	start := 0 // start of the pending plain stretch
	for i := 0; i < len(text); {
		cands := m.byFirst[text[i]]
		var hit *addedToken
		for _, t := range cands {
			if strings.HasPrefix(text[i:], t.content) && (!t.singleWord || isWordBoundary(text, i, i+len(t.content))) {
				hit = t
				break
			}
		}
		if hit == nil {
			i++
			continue
		}
		mStart, mEnd := i, i+len(hit.content)
		if hit.lstrip {
			mStart = start + len(strings.TrimRightFunc(text[start:mStart], unicode.IsSpace))
		}
		if hit.rstrip {
			mEnd = len(text) - len(strings.TrimLeftFunc(text[mEnd:], unicode.IsSpace))
		}
		if mStart > start {
			out = append(out, segment{text: text[start:mStart]})
		}
		out = append(out, segment{text: text[mStart:mEnd], tok: hit})
		start, i = mEnd, mEnd
	}
	if start < len(text) {
		out = append(out, segment{text: text[start:]})
	}
	return out
}

// isWordBoundary reports whether text[start:end] is not glued to a word character on either side.
func isWordBoundary(text string, start, end int) bool {
	isWord := func(r rune) bool { return r == '_' || unicode.IsLetter(r) || unicode.IsNumber(r) }
	if start > 0 {
		if r, _ := utf8.DecodeLastRuneInString(text[:start]); isWord(r) {
			return false
		}
	}
	if end < len(text) {
		if r, _ := utf8.DecodeRuneInString(text[end:]); isWord(r) {
			return false
		}
	}
	return true
}
