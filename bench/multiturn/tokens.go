package multiturn

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"unicode/utf8"

	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// EstimateCharsPerToken is the characters-per-token ratio of the fallback estimate used when no
// tokenizer can be loaded.
const EstimateCharsPerToken = 4

// TokenCounter counts tokens the way the benchmark reports them: message contents tokenized
// without special tokens and without a chat template. It wraps a real tokenizer or, when none
// could be loaded, estimates one token per EstimateCharsPerToken characters. It is safe for
// concurrent use.
type TokenCounter struct {
	tok  *tokenizer.Tokenizer // nil: estimate
	desc string
}

// NewTokenCounter wraps tok; name describes it in the report (e.g. the model name).
func NewTokenCounter(tok *tokenizer.Tokenizer, name string) *TokenCounter {
	return &TokenCounter{tok: tok, desc: "tokenizer of " + name}
}

// EstimateTokenCounter returns a counter that estimates tokens as ceil(characters / 4); reason
// says why no tokenizer is used and is part of String.
func EstimateTokenCounter(reason string) *TokenCounter {
	d := fmt.Sprintf("estimate: 1 token per %d characters", EstimateCharsPerToken)
	if reason != "" {
		d += " (" + reason + ")"
	}
	return &TokenCounter{desc: d}
}

// OpenTokenCounter loads the tokenizer named by the benchmark's model argument: a built-in model
// (kvbridge/tiny, kvbridge/small) through model.Open, a directory holding tokenizer.json (and
// optionally tokenizer_config.json) directly, anything else (a repo id in the local Hugging Face
// cache) through model.Open. When nothing works it returns the chars/4 estimate, whose String
// carries the reason; it never fails.
func OpenTokenCounter(ctx context.Context, name string) *TokenCounter {
	if st, err := os.Stat(name); err == nil && st.IsDir() {
		tj, err := os.ReadFile(filepath.Join(name, "tokenizer.json"))
		if err == nil {
			tcj, cerr := os.ReadFile(filepath.Join(name, "tokenizer_config.json"))
			if cerr != nil && !errors.Is(cerr, fs.ErrNotExist) {
				return EstimateTokenCounter(fmt.Sprintf("reading %s: %v", filepath.Join(name, "tokenizer_config.json"), cerr))
			}
			tok, err := tokenizer.Load(tj, tcj)
			if err != nil {
				return EstimateTokenCounter(fmt.Sprintf("loading the tokenizer of %s: %v", name, err))
			}
			return NewTokenCounter(tok, name)
		}
	}
	m, err := model.Open(ctx, name, model.OpenOptions{})
	if err != nil {
		return EstimateTokenCounter(fmt.Sprintf("no tokenizer for %q: %v", name, err))
	}
	defer m.Close()
	return NewTokenCounter(m.Tokenizer(), name)
}

// Estimated reports whether counts are the chars/4 estimate rather than a tokenizer's.
func (c *TokenCounter) Estimated() bool { return c.tok == nil }

// String says how tokens are counted.
func (c *TokenCounter) String() string { return c.desc }

// Count returns the number of tokens of text.
func (c *TokenCounter) Count(text string) int {
	if c.tok == nil {
		return (utf8.RuneCountInString(text) + EstimateCharsPerToken - 1) / EstimateCharsPerToken
	}
	return len(c.tok.Encode(text))
}

// corpus is filler text cut into tokens; text(a, b) is the text of tokens [a, b), reading past
// the end wraps around to the start.
type corpus struct {
	n      int
	decode func(a, b int) string // 0 ≤ a ≤ b ≤ n
}

// newCorpus tokenizes text.
func (c *TokenCounter) newCorpus(text string) corpus {
	if c.tok == nil {
		var pieces []string
		for len(text) > 0 {
			i, runes := 0, 0
			for i < len(text) && runes < EstimateCharsPerToken {
				_, sz := utf8.DecodeRuneInString(text[i:])
				i += sz
				runes++
			}
			pieces = append(pieces, text[:i])
			text = text[i:]
		}
		return corpus{n: len(pieces), decode: func(a, b int) string { return strings.Join(pieces[a:b], "") }}
	}
	ids := c.tok.Encode(text)
	tok := c.tok
	return corpus{n: len(ids), decode: func(a, b int) string { return tok.Decode(ids[a:b]) }}
}

// text returns the text of tokens [start, start+count), wrapping around the end of the corpus.
func (k corpus) text(start, count int) string {
	if count <= 0 || k.n == 0 {
		return ""
	}
	start %= k.n
	var b strings.Builder
	for count > 0 {
		end := min(start+count, k.n)
		b.WriteString(k.decode(start, end))
		count -= end - start
		start = 0
	}
	return b.String()
}
