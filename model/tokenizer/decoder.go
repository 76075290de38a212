package tokenizer

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// decodeStep is one of tokenizer.json's decoders: it turns the list of token strings into
// another (Hugging Face tokenizers' Decoder::decode_chain). Implementations are immutable.
type decodeStep interface {
	chain(tokens []string) []string
}

// byteLevelDecoder maps the byte-level alphabet back to bytes: a token whose characters are all
// in the alphabet becomes those bytes, any other token its own UTF-8; the whole is then one
// string with invalid UTF-8 replaced (from_utf8_lossy).
type byteLevelDecoder struct{ bl *byteLevel }

func (d byteLevelDecoder) chain(tokens []string) []string {
	var b []byte
	for _, t := range tokens {
		if raw, ok := d.bl.decode(t); ok {
			b = append(b, raw...)
		} else {
			b = append(b, t...)
		}
	}
	return []string{string(appendLossy(nil, b))}
}

// metaspaceDecoder turns the replacement character back into spaces; in the first token it
// drops them instead, unless the prepend scheme is "never".
type metaspaceDecoder struct {
	replacement rune
	dropFirst   bool
}

func (d metaspaceDecoder) chain(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		out[i] = strings.Map(func(r rune) rune {
			switch {
			case r != d.replacement:
				return r
			case i == 0 && d.dropFirst:
				return -1
			}
			return ' '
		}, t)
	}
	return out
}

// replaceDecoder applies a Replace to every token.
type replaceDecoder struct{ r replace }

func (d replaceDecoder) chain(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		out[i] = d.r.apply(t)
	}
	return out
}

// byteFallbackDecoder turns each run of <0xXX> tokens into the string of its bytes when they are
// valid UTF-8, else into one U+FFFD per byte.
type byteFallbackDecoder struct{}

// fallbackByte returns the byte a <0xXX> token stands for.
func fallbackByte(t string) (byte, bool) {
	if len(t) != 6 || !strings.HasPrefix(t, "<0x") || t[5] != '>' {
		return 0, false
	}
	v, err := strconv.ParseUint(t[3:5], 16, 8)
	return byte(v), err == nil
}

func (byteFallbackDecoder) chain(tokens []string) []string {
	var out []string
	var run []byte
	flush := func() {
		if len(run) == 0 {
			return
		}
		if utf8.Valid(run) {
			out = append(out, string(run))
		} else {
			for range run {
				out = append(out, "\uFFFD")
			}
		}
		run = run[:0]
	}
	for _, t := range tokens {
		if b, ok := fallbackByte(t); ok {
			run = append(run, b)
			continue
		}
		flush()
		out = append(out, t)
	}
	flush()
	return out
}

// fuseDecoder joins every token into one.
type fuseDecoder struct{}

func (fuseDecoder) chain(tokens []string) []string { return []string{strings.Join(tokens, "")} }

// stripDecoder removes up to start leading and stop trailing content characters of each token.
type stripDecoder struct {
	content     rune
	start, stop int
}

func (d stripDecoder) chain(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		r := []rune(t)
		lo, hi := 0, len(r)
		for lo < d.start && lo < hi && r[lo] == d.content {
			lo++
		}
		for n := 0; n < d.stop && hi > lo && r[hi-1] == d.content; n++ {
			hi--
		}
		out[i] = string(r[lo:hi])
	}
	return out
}

// decoders applies decode steps in order (a Sequence).
type decoders []decodeStep

func (seq decoders) chain(tokens []string) []string {
	for _, d := range seq {
		tokens = d.chain(tokens)
	}
	return tokens
}

// parseDecoder builds tokenizer.json's decoder (nil for none): ByteLevel, Metaspace, Replace,
// ByteFallback, Fuse, Strip and Sequence.
func parseDecoder(raw json.RawMessage, bl *byteLevel) (decodeStep, error) {
	if isNull(raw) {
		return nil, nil
	}
	var d struct {
		Type           string            `json:"type"`
		Decoders       []json.RawMessage `json:"decoders"`
		Replacement    string            `json:"replacement"`
		PrependScheme  string            `json:"prepend_scheme"`
		AddPrefixSpace *bool             `json:"add_prefix_space"`
		Pattern        patternJSON       `json:"pattern"`
		Content        string            `json:"content"`
		Start, Stop    int
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		return nil, fmt.Errorf("%w: decoder: %w", ErrMalformed, err)
	}
	switch d.Type {
	case "ByteLevel":
		return byteLevelDecoder{bl: bl}, nil
	case "Metaspace":
		scheme, err := parsePrependScheme(d.PrependScheme, d.AddPrefixSpace)
		if err != nil {
			return nil, err
		}
		r, err := singleRune("Metaspace replacement", d.Replacement, '▁')
		if err != nil {
			return nil, err
		}
		return metaspaceDecoder{replacement: r, dropFirst: scheme != prependNever}, nil
	case "Replace":
		r, err := parseReplace(d.Pattern, d.Content)
		if err != nil {
			return nil, err
		}
		return replaceDecoder{r}, nil
	case "ByteFallback":
		return byteFallbackDecoder{}, nil
	case "Fuse":
		return fuseDecoder{}, nil
	case "Strip":
		r, err := singleRune("Strip content", d.Content, ' ')
		if err != nil {
			return nil, err
		}
		if d.Start < 0 || d.Stop < 0 {
			return nil, fmt.Errorf("%w: Strip start %d stop %d", ErrMalformed, d.Start, d.Stop)
		}
		return stripDecoder{content: r, start: d.Start, stop: d.Stop}, nil
	case "Sequence":
		var seq decoders
		for _, sub := range d.Decoders {
			s, err := parseDecoder(sub, bl)
			if err != nil {
				return nil, err
			}
			if s != nil {
				seq = append(seq, s)
			}
		}
		return seq, nil
	}
	return nil, fmt.Errorf("%w: decoder %q (supported: ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence)", ErrUnsupported, d.Type)
}

// singleRune reads a one-character field (def when empty).
func singleRune(what, s string, def rune) (rune, error) {
	if s == "" {
		return def, nil
	}
	r, n := utf8.DecodeRuneInString(s)
	if n != len(s) {
		return 0, fmt.Errorf("%w: %s %q is not one character", ErrMalformed, what, s)
	}
	return r, nil
}
