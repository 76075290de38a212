package tokenizer

import (
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
)

// splitterAlphabet mixes the runes the patterns treat differently: ASCII and non-ASCII letters,
// digits and other numbers, every kind of whitespace, apostrophes and the contraction letters
// in both cases (and runes whose lower case is special), punctuation, symbols, emoji,
// combining marks, control characters and bytes that are not UTF-8.
var splitterAlphabet = []string{
	"a", "b", "z", "A", "Z", "s", "t", "r", "e", "v", "m", "l", "d", "S", "T", "R", "E", "V", "M", "L", "D",
	"é", "ß", "ſ", "\u212a", "İ", "ı", "Ω", "ж", "世", "界", "あ", "ㄱ", "ʼ",
	"0", "1", "9", "٣", "½", "Ⅻ", "²",
	" ", " ", " ", "\t", "\v", "\f", "\u00a0", "\u3000", "\u0085", "\u2028", "\u2009", "\u180e", "\u200b",
	"\r", "\n", "\n", "\r\n",
	"'", "'", "’", "\"", ".", ",", "!", "?", "-", "(", ")", "<", ">", "/", "_", "#", "@", "$", "€",
	"😀", "👋🏽", "\u0301", "\u200d", "\x00", "\x1b", "\x7f", "\xff", "\x80", "\xe4\xb8",
	"'s", "'S", "'re", "'VE", "'ll", "'Ll", "'d", "'m", "'t", "'x",
}

// randomSplitterText builds a string of n alphabet items.
func randomSplitterText(r *rand.Rand, n int) string {
	var b strings.Builder
	for range n {
		b.WriteString(splitterAlphabet[r.IntN(len(splitterAlphabet))])
	}
	return b.String()
}

// referencePieces splits s with regexp2 (the reference engine) and checks the matches tile s.
func referencePieces(t testing.TB, m *regexMatcher, s string) []string {
	t.Helper()
	var out []string
	prev := 0
	for _, sp := range m.find(s, nil) {
		if sp[0] != prev {
			t.Fatalf("regexp2 left a gap in %q at %d", s, prev)
		}
		out = append(out, s[sp[0]:sp[1]])
		prev = sp[1]
	}
	if prev != len(s) {
		t.Fatalf("regexp2 left a tail in %q", s)
	}
	return out
}

// handSplitters pairs each hand-written splitter with its pattern.
var handSplitters = []struct {
	name    string
	pattern string
	split   func(string) []string
}{
	{"qwen2", PatternQwen2, func(s string) []string { return splitQwen(s, 1, nil) }},
	{"llama3", PatternLlama3, func(s string) []string { return splitQwen(s, 3, nil) }},
	{"gpt2", PatternGPT2, func(s string) []string { return splitGPT2(s, nil) }},
}

// checkSplitAgreement fails if a hand splitter disagrees with regexp2 on s.
func checkSplitAgreement(t testing.TB, refs []*regexMatcher, s string) {
	t.Helper()
	for i, h := range handSplitters {
		want := referencePieces(t, refs[i], s)
		if got := h.split(s); !slices.Equal(got, want) {
			t.Fatalf("%s splitter on %q:\n got %q\nwant %q", h.name, s, got, want)
		}
	}
}

// compileRefs compiles the reference regexes.
func compileRefs(t testing.TB) []*regexMatcher {
	t.Helper()
	var refs []*regexMatcher
	for _, h := range handSplitters {
		m, err := newRegexMatcher(h.pattern)
		if err != nil {
			t.Fatal(err)
		}
		refs = append(refs, m)
	}
	return refs
}

func TestSplitterExamples(t *testing.T) {
	cases := []struct {
		split func(string) []string
		in    string
		want  []string
	}{
		{handSplitters[0].split, "Hello world", []string{"Hello", " world"}},
		{handSplitters[0].split, "I'M here, they'll see", []string{"I", "'M", " here", ",", " they", "'ll", " see"}},
		{handSplitters[0].split, "'sam", []string{"'s", "am"}},
		{handSplitters[0].split, "costs $1234.50!", []string{"costs", " $", "1", "2", "3", "4", ".", "5", "0", "!"}},
		{handSplitters[1].split, "costs $1234.50!", []string{"costs", " $", "123", "4", ".", "50", "!"}},
		{handSplitters[0].split, "a   b", []string{"a", "  ", " b"}},
		{handSplitters[0].split, "x  \n\n  y", []string{"x", "  \n\n", " ", " y"}},
		{handSplitters[0].split, "end.\n\nNext", []string{"end", ".\n\n", "Next"}},
		{handSplitters[0].split, "(hello) :)\n", []string{"(hello", ")", " :)\n"}},
		{handSplitters[0].split, "世界 你好", []string{"世界", " 你好"}},
		{handSplitters[0].split, "tail  ", []string{"tail", "  "}},
		{handSplitters[2].split, "Hello  world's 42x", []string{"Hello", " ", " world", "'s", " 42", "x"}},
	}
	for _, c := range cases {
		if got := c.split(c.in); !slices.Equal(got, c.want) {
			t.Errorf("split(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestSplitterMatchesRegexp2(t *testing.T) {
	refs := compileRefs(t)
	r := rand.New(rand.NewPCG(1, 2))
	for range 3000 {
		checkSplitAgreement(t, refs, randomSplitterText(r, 1+r.IntN(24)))
	}
	corpus, err := os.ReadFile(builtinCorpusFile)
	if err != nil {
		t.Fatal(err)
	}
	checkSplitAgreement(t, refs, string(corpus[:20000]))
	checkSplitAgreement(t, refs, "The quick brown fox's 12 jumps — “quoted” text,\r\n\ttabs  and\u00a0NBSP.\n\n\n   ")
}

func TestRegexMatcherFallbackIsValid(t *testing.T) {
	// Catastrophic backtracking: (a+)+b needs 2^40 steps on 40 a's, so regexp2 times out and
	// the rest of the text is split by the Qwen splitter (the a's become one piece; the regex
	// alone would have made 40 single-character pieces). Encode cannot hang.
	m, err := newRegexMatcher(`(a+)+b|\s+|[^\s]`)
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Repeat("a", 40) + " tail"
	var got []string
	for _, sp := range m.find(s, nil) {
		got = append(got, s[sp[0]:sp[1]])
	}
	if strings.Join(got, "") != s {
		t.Fatalf("pieces %q do not tile %q", got, s)
	}
	if want := []string{strings.Repeat("a", 40), " tail"}; !slices.Equal(got, want) {
		t.Fatalf("pieces %q, want the fallback split %q", got, want)
	}
}

func FuzzSplitters(f *testing.F) {
	f.Add("Hello world, it's 2024!\n\n  ok")
	f.Add("'S'RE'Ve \u3000\u00a0x\r\n\r\n\t")
	f.Add("\xff\xe4\xb8 世界😀\u0301")
	refs := compileRefs(f)
	f.Fuzz(func(t *testing.T, s string) {
		if len(s) > 512 {
			return
		}
		checkSplitAgreement(t, refs, s)
	})
}
