package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode"

	"github.com/dlclark/regexp2"
	"golang.org/x/text/unicode/norm"
)

// normalizer rewrites a stretch of input text before pre-tokenization, as tokenizer.json's
// "normalizer" declares (Hugging Face tokenizers' normalizers). Implementations are immutable
// and safe for concurrent use.
type normalizer interface {
	normalize(s string) string
}

// unicodeForm is NFC, NFD, NFKC or NFKD (golang.org/x/text/unicode/norm).
type unicodeForm struct{ f norm.Form }

func (u unicodeForm) normalize(s string) string { return u.f.String(s) }

// lowercase maps every character to its lowercase as Rust's char::to_lowercase does (no
// context: Σ is always σ; İ becomes i followed by U+0307, its one multi-character mapping).
type lowercase struct{}

func (lowercase) normalize(s string) string {
	return strings.Map(unicode.ToLower, strings.ReplaceAll(s, "\u0130", "i\u0307"))
}

// strip removes whitespace (Unicode White_Space) on the left and/or right.
type strip struct{ left, right bool }

func (p strip) normalize(s string) string {
	if p.left {
		s = strings.TrimLeftFunc(s, unicode.IsSpace)
	}
	if p.right {
		s = strings.TrimRightFunc(s, unicode.IsSpace)
	}
	return s
}

// replace substitutes content for every match of a literal string or a regex.
type replace struct {
	lit     string
	re      *regexp2.Regexp // nil for a literal
	content string
}

func (p replace) normalize(s string) string { return p.apply(s) }

// apply replaces every non-overlapping match, left to right, by the content verbatim.
func (p replace) apply(s string) string {
	if p.re == nil {
		if p.lit == "" {
			return s
		}
		return strings.ReplaceAll(s, p.lit, p.content)
	}
	out, err := p.re.ReplaceFunc(s, func(regexp2.Match) string { return p.content }, -1, -1)
	if err != nil {
		return s // a match over the time budget leaves the text as it is
	}
	return out
}

// prepend puts a string in front of non-empty text.
type prepend struct{ s string }

func (p prepend) normalize(s string) string {
	if s == "" {
		return s
	}
	return p.s + s
}

// normalizers applies normalizers in order (a Sequence).
type normalizers []normalizer

func (seq normalizers) normalize(s string) string {
	for _, n := range seq {
		s = n.normalize(s)
	}
	return s
}

// patternJSON is a Replace/Split pattern: {"String": …} or {"Regex": …}.
type patternJSON struct {
	Regex  *string `json:"Regex"`
	String *string `json:"String"`
}

// parseReplace builds a replace from a tokenizer.json Replace normalizer or decoder.
func parseReplace(p patternJSON, content string) (replace, error) {
	switch {
	case p.String != nil:
		return replace{lit: *p.String, content: content}, nil
	case p.Regex != nil:
		re, err := regexp2.Compile(*p.Regex, regexp2.None)
		if err != nil {
			return replace{}, fmt.Errorf("%w: Replace regex %q: %w", ErrUnsupported, *p.Regex, err)
		}
		re.MatchTimeout = regexTimeout
		return replace{re: re, content: content}, nil
	}
	return replace{}, fmt.Errorf("%w: Replace without a pattern", ErrMalformed)
}

// parseNormalizer builds tokenizer.json's normalizer (nil for none): NFC, NFD, NFKC, NFKD,
// Lowercase, Strip, Replace, Prepend and Sequence, the ones these model families declare.
func parseNormalizer(raw json.RawMessage) (normalizer, error) {
	if isNull(raw) {
		return nil, nil
	}
	var n struct {
		Type        string            `json:"type"`
		Normalizers []json.RawMessage `json:"normalizers"`
		StripLeft   *bool             `json:"strip_left"`
		StripRight  *bool             `json:"strip_right"`
		Pattern     patternJSON       `json:"pattern"`
		Content     string            `json:"content"`
		Prepend     string            `json:"prepend"`
	}
	if err := json.Unmarshal(raw, &n); err != nil {
		return nil, fmt.Errorf("%w: normalizer: %w", ErrMalformed, err)
	}
	switch n.Type {
	case "NFC":
		return unicodeForm{norm.NFC}, nil
	case "NFD":
		return unicodeForm{norm.NFD}, nil
	case "NFKC":
		return unicodeForm{norm.NFKC}, nil
	case "NFKD":
		return unicodeForm{norm.NFKD}, nil
	case "Lowercase":
		return lowercase{}, nil
	case "Strip":
		return strip{left: n.StripLeft == nil || *n.StripLeft, right: n.StripRight == nil || *n.StripRight}, nil
	case "Replace":
		return parseReplace(n.Pattern, n.Content)
	case "Prepend":
		return prepend{s: n.Prepend}, nil
	case "Sequence":
		var seq normalizers
		for _, sub := range n.Normalizers {
			s, err := parseNormalizer(sub)
			if err != nil {
				return nil, err
			}
			if s != nil {
				seq = append(seq, s)
			}
		}
		return seq, nil
	}
	return nil, fmt.Errorf("%w: normalizer %q (supported: NFC, NFD, NFKC, NFKD, Lowercase, Strip, Replace, Prepend, Sequence)", ErrUnsupported, n.Type)
}
