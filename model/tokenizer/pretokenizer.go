package tokenizer

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// preTokenizer refines a list of pieces into smaller pieces; BPE then runs on each piece alone.
// Implementations are immutable and safe for concurrent use.
type preTokenizer interface {
	// split appends the refined pieces of in to out and returns out. atStart says in[0]
	// begins the input text (Metaspace prepends only there under prepend_scheme "first").
	split(in, out []string, atStart bool) []string
}

// splitBehavior is what Split does with the matched spans (HF SplitDelimiterBehavior).
type splitBehavior uint8

const (
	behaviorIsolated splitBehavior = iota
	behaviorRemoved
	behaviorMergedWithPrevious
	behaviorMergedWithNext
	behaviorContiguous
)

// parseBehavior maps the tokenizer.json name of a split behavior.
func parseBehavior(s string) (splitBehavior, error) {
	switch s {
	case "Isolated", "":
		return behaviorIsolated, nil
	case "Removed":
		return behaviorRemoved, nil
	case "MergedWithPrevious":
		return behaviorMergedWithPrevious, nil
	case "MergedWithNext":
		return behaviorMergedWithNext, nil
	case "Contiguous":
		return behaviorContiguous, nil
	}
	return 0, fmt.Errorf("%w: split behavior %q", ErrUnsupported, s)
}

// matcher finds the spans a Split pre-tokenizer matches in s: it appends [start,end) byte
// offsets of successive non-overlapping matches to dst.
type matcher interface {
	find(s string, dst [][2]int) [][2]int
}

// splitPre is HF's Split pre-tokenizer.
type splitPre struct {
	m        matcher
	behavior splitBehavior
	invert   bool
}

// span is a piece of the input with whether it was a match.
type span struct {
	start, end int
	match      bool
}

func (p *splitPre) split(in, out []string, _ bool) []string {
	// Fast path: a hand splitter with Isolated behavior (the usual configuration) produces the
	// pieces directly, without span bookkeeping.
	if hm, ok := p.m.(handMatcher); ok && p.behavior == behaviorIsolated && !p.invert {
		for _, s := range in {
			out = hm.splitAll(s, out)
		}
		return out
	}
	var matches [][2]int
	var spans []span
	for _, s := range in {
		if s == "" {
			continue
		}
		matches = p.m.find(s, matches[:0])
		spans = spans[:0]
		prev := 0
		for _, m := range matches {
			if m[0] > prev {
				spans = append(spans, span{prev, m[0], p.invert})
			}
			spans = append(spans, span{m[0], m[1], !p.invert})
			prev = m[1]
		}
		if prev < len(s) {
			spans = append(spans, span{prev, len(s), p.invert})
		}
		spans = applyBehavior(spans, p.behavior)
		for _, sp := range spans {
			if sp.end > sp.start {
				out = append(out, s[sp.start:sp.end])
			}
		}
	}
	return out
}

// applyBehavior folds the spans the way tokenizers' NormalizedString::split does.
func applyBehavior(spans []span, b splitBehavior) []span {
	res := spans[:0:0]
	switch b {
	case behaviorIsolated:
		return spans
	case behaviorRemoved:
		for _, sp := range spans {
			if !sp.match {
				res = append(res, sp)
			}
		}
	case behaviorMergedWithPrevious:
		prevMatch := false
		for _, sp := range spans {
			if sp.match && !prevMatch && len(res) > 0 {
				res[len(res)-1].end = sp.end
			} else {
				res = append(res, span{sp.start, sp.end, false})
			}
			prevMatch = sp.match
		}
	case behaviorMergedWithNext:
		prevMatch := false
		for i := len(spans) - 1; i >= 0; i-- {
			sp := spans[i]
			if sp.match && !prevMatch && len(res) > 0 {
				res[len(res)-1].start = sp.start
			} else {
				res = append(res, span{sp.start, sp.end, false})
			}
			prevMatch = sp.match
		}
		for i, j := 0, len(res)-1; i < j; i, j = i+1, j-1 {
			res[i], res[j] = res[j], res[i]
		}
	case behaviorContiguous:
		prevMatch := false
		for i, sp := range spans {
			if i > 0 && sp.match == prevMatch {
				res[len(res)-1].end = sp.end
			} else {
				res = append(res, span{sp.start, sp.end, false})
			}
			prevMatch = sp.match
		}
	}
	return res
}

// handMatcher is a matcher whose matches tile the whole input, so Isolated splitting is just the
// list of matches.
type handMatcher interface {
	matcher
	splitAll(s string, out []string) []string
}

// qwenMatcher is the hand-written splitter for PatternQwen2 / PatternLlama3.
type qwenMatcher struct{ maxDigits int }

func (m qwenMatcher) splitAll(s string, out []string) []string { return splitQwen(s, m.maxDigits, out) }

func (m qwenMatcher) find(s string, dst [][2]int) [][2]int {
	for i := 0; i < len(s); {
		end := matchQwen(s, i, m.maxDigits)
		dst = append(dst, [2]int{i, end})
		i = end
	}
	return dst
}

// gpt2Matcher is the hand-written splitter for PatternGPT2.
type gpt2Matcher struct{}

func (gpt2Matcher) splitAll(s string, out []string) []string { return splitGPT2(s, out) }

func (gpt2Matcher) find(s string, dst [][2]int) [][2]int {
	for i := 0; i < len(s); {
		end := matchGPT2(s, i)
		dst = append(dst, [2]int{i, end})
		i = end
	}
	return dst
}

// regexTimeout bounds one regexp2 match attempt, and regexBudget the regex work on one piece;
// past either, the rest of the piece is split by the Qwen splitter instead, so no input can hang
// Encode.
const (
	regexTimeout = 250 * time.Millisecond
	regexBudget  = 2 * time.Second
)

// regexMatcher runs an arbitrary pattern with dlclark/regexp2 (backtracking, with lookaround),
// which is what HF patterns need.
type regexMatcher struct{ re *regexp2.Regexp }

// newMatcher picks the hand-written splitter for known patterns and regexp2 otherwise.
func newMatcher(pattern string) (matcher, error) {
	switch pattern {
	case PatternQwen2:
		return qwenMatcher{maxDigits: 1}, nil
	case PatternLlama3:
		return qwenMatcher{maxDigits: 3}, nil
	case PatternGPT2:
		return gpt2Matcher{}, nil
	}
	return newRegexMatcher(pattern)
}

// newRegexMatcher compiles pattern with regexp2 (never the hand splitters; tests use it as the
// reference).
func newRegexMatcher(pattern string) (*regexMatcher, error) {
	re, err := regexp2.Compile(pattern, regexp2.None)
	if err != nil {
		return nil, fmt.Errorf("%w: pre-tokenizer regex %q: %w", ErrUnsupported, pattern, err)
	}
	re.MatchTimeout = regexTimeout
	return &regexMatcher{re: re}, nil
}

func (m *regexMatcher) find(s string, dst [][2]int) [][2]int {
	runes := make([]rune, 0, len(s))
	offs := make([]int, 0, len(s)+1) // byte offset of each rune, then len(s)
	for i, r := range s {
		runes = append(runes, r)
		offs = append(offs, i)
	}
	offs = append(offs, len(s))
	deadline := time.Now().Add(regexBudget)
	mt, err := m.re.FindRunesMatch(runes)
	pos := 0 // rune index up to which the input is covered
	for err == nil && mt != nil {
		start, end := mt.Index, mt.Index+mt.Length
		if end > start {
			dst = append(dst, [2]int{offs[start], offs[end]})
		}
		pos = end
		if time.Now().After(deadline) {
			err = errRegexBudget
			break
		}
		mt, err = m.re.FindNextMatch(mt)
	}
	if err != nil {
		// Timed out: split what is left with the Qwen splitter, whose pieces tile the text.
		base, n := offs[pos], len(dst)
		dst = qwenMatcher{maxDigits: 1}.find(s[base:], dst)
		for k := n; k < len(dst); k++ {
			dst[k][0] += base
			dst[k][1] += base
		}
	}
	return dst
}

// errRegexBudget stops a regex split that used up regexBudget.
var errRegexBudget = errors.New("tokenizer: regex split over budget")

// stringMatcher is Split with a literal String pattern.
type stringMatcher struct{ lit string }

func (m stringMatcher) find(s string, dst [][2]int) [][2]int {
	if m.lit == "" {
		return dst
	}
	for i := 0; ; {
		j := strings.Index(s[i:], m.lit)
		if j < 0 {
			return dst
		}
		dst = append(dst, [2]int{i + j, i + j + len(m.lit)})
		i += j + len(m.lit)
	}
}

// byteLevelPre is the ByteLevel pre-tokenizer. The byte→rune mapping itself is implicit (BPE
// works on raw bytes); what remains is the optional prefix space and the optional GPT-2 regex.
type byteLevelPre struct {
	addPrefixSpace bool
	useRegex       bool
}

func (p byteLevelPre) split(in, out []string, _ bool) []string {
	for _, s := range in {
		if s == "" {
			continue
		}
		if p.addPrefixSpace && s[0] != ' ' {
			s = " " + s
		}
		if p.useRegex {
			out = splitGPT2(s, out)
		} else {
			out = append(out, s)
		}
	}
	return out
}

// digitsPre is the Digits pre-tokenizer (ASCII digits split off, one by one or in runs).
type digitsPre struct{ individual bool }

func (p digitsPre) split(in, out []string, _ bool) []string {
	for _, s := range in {
		start := 0
		for i := 0; i < len(s); {
			isDigit := s[i] >= '0' && s[i] <= '9'
			if !isDigit {
				_, w := utf8.DecodeRuneInString(s[i:])
				i += w
				continue
			}
			if i > start {
				out = append(out, s[start:i])
			}
			j := i + 1
			if !p.individual {
				for j < len(s) && s[j] >= '0' && s[j] <= '9' {
					j++
				}
			}
			out = append(out, s[i:j])
			start, i = j, j
		}
		if start < len(s) {
			out = append(out, s[start:])
		}
	}
	return out
}

// sequencePre applies pre-tokenizers in order.
type sequencePre []preTokenizer

func (seq sequencePre) split(in, out []string, atStart bool) []string {
	cur := in
	for _, p := range seq {
		cur = p.split(cur, nil, atStart)
	}
	return append(out, cur...)
}

// prependScheme is when Metaspace puts the replacement character in front of a piece.
type prependScheme uint8

const (
	prependAlways prependScheme = iota
	prependFirst                // only the piece that begins the input
	prependNever
)

// parsePrependScheme reads Metaspace's prepend_scheme, or the older add_prefix_space.
func parsePrependScheme(s string, addPrefixSpace *bool) (prependScheme, error) {
	switch s {
	case "always":
		return prependAlways, nil
	case "first":
		return prependFirst, nil
	case "never":
		return prependNever, nil
	case "":
		if addPrefixSpace != nil && !*addPrefixSpace {
			return prependNever, nil
		}
		return prependAlways, nil
	}
	return 0, fmt.Errorf("%w: Metaspace prepend_scheme %q", ErrUnsupported, s)
}

// metaspacePre is the Metaspace pre-tokenizer (SentencePiece's whitespace handling): spaces
// become the replacement character (▁), which is prepended to a piece that does not start with
// it (always, or only at the start of the input, or never), and with split the piece is cut
// before every replacement character.
type metaspacePre struct {
	replacement string
	scheme      prependScheme
	split_      bool
}

func (p metaspacePre) split(in, out []string, atStart bool) []string {
	for i, s := range in {
		s = strings.ReplaceAll(s, " ", p.replacement)
		if !strings.HasPrefix(s, p.replacement) && s != "" &&
			(p.scheme == prependAlways || p.scheme == prependFirst && atStart && i == 0) {
			s = p.replacement + s
		}
		if !p.split_ {
			if s != "" {
				out = append(out, s)
			}
			continue
		}
		for s != "" {
			j := strings.Index(s[1:], p.replacement)
			if j < 0 {
				out = append(out, s)
				break
			}
			out = append(out, s[:j+1])
			s = s[j+1:]
		}
	}
	return out
}
