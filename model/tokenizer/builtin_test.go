package tokenizer

import (
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"
)

func TestBuiltinLayout(t *testing.T) {
	const v = 4096
	tok := Builtin(v)
	if tok.VocabSize() != v {
		t.Fatalf("VocabSize = %d", tok.VocabSize())
	}
	for i, s := range []string{EndOfText, IMStart, IMEnd} {
		id, ok := tok.TokenID(s)
		if !ok || id != int32(v-3+i) || !tok.IsSpecial(id) || tok.Decode([]int32{id}) != s {
			t.Errorf("%s: id %d ok %v", s, id, ok)
		}
	}
	if id, ok := tok.EOSTokenID(); !ok || id != v-1 || tok.EOSToken() != IMEnd {
		t.Errorf("EOS = %d %v %q", id, ok, tok.EOSToken())
	}
	if _, ok := tok.BOSTokenID(); ok || tok.AddBOS() {
		t.Error("built-in tokenizer has no BOS")
	}
	for b := range 256 {
		if got := tok.TokenBytes(int32(b)); len(got) != 1 || got[0] != byte(b) {
			t.Fatalf("byte token %d = %v", b, got)
		}
	}
	if id, ok := tok.TokenID("Ġthe"); !ok || string(tok.TokenBytes(id)) != " the" {
		t.Errorf("TokenID(Ġthe) = %d %v", id, ok)
	}
	ct, err := tok.ChatTemplate()
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := ct.Render([]Message{{"user", "hi"}}, RenderOptions{AddGenerationPrompt: true}); got != "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" {
		t.Errorf("built-in chat template rendered %q", got)
	}
}

func TestBuiltinDeterministicAndNested(t *testing.T) {
	a, b := Builtin(8192), Builtin(8192)
	if !slices.EqualFunc(a.tokens, b.tokens, func(x, y tokenInfo) bool {
		return x.ok == y.ok && x.special == y.special && string(x.bytes) == string(y.bytes)
	}) {
		t.Fatal("two Builtin(8192) differ")
	}
	// Smaller vocabularies are prefixes of larger ones (apart from the three specials).
	small := Builtin(1024)
	for id := range 1024 - 3 {
		if string(small.tokens[id].bytes) != string(a.tokens[id].bytes) {
			t.Fatalf("id %d: Builtin(1024) %q, Builtin(8192) %q", id, small.tokens[id].bytes, a.tokens[id].bytes)
		}
	}
	// A golden encoding: if the corpus or the training changes, ids change for every deployment
	// (prefill and decode instances must agree), so this must be updated deliberately.
	text := "The quick brown fox jumps over the lazy dog."
	got := a.Encode(text)
	var pieces []string
	for _, id := range got {
		pieces = append(pieces, string(a.TokenBytes(id)))
	}
	want := []string{"The", " quick", " bro", "wn", " fo", "x", " j", "umps", " over", " the", " la", "z", "y", " dog", "."}
	wantIDs := []int32{664, 1527, 1159, 696, 922, 120, 722, 4103, 739, 259, 1302, 122, 121, 4167, 46}
	if !slices.Equal(pieces, want) || !slices.Equal(got, wantIDs) {
		t.Errorf("golden encoding of %q: %q %v, want %q %v", text, pieces, got, want, wantIDs)
	}
}

func TestBuiltinMinimumAndOversize(t *testing.T) {
	func() {
		defer func() {
			if recover() == nil {
				t.Error("Builtin(100) did not panic")
			}
		}()
		Builtin(100)
	}()
	tiny := Builtin(BuiltinMinVocab)
	if got := tiny.Encode("hi <|im_end|>"); !slices.Equal(got, []int32{'h', 'i', ' ', 258}) {
		t.Errorf("Builtin(259).Encode = %v", got)
	}
	// More ids than learned merges: the spare ids have no token and are never produced.
	big := Builtin(65536)
	holes := 0
	for id := range big.tokens {
		if !big.tokens[id].ok {
			holes++
			if big.Decode([]int32{int32(id)}) != "" {
				t.Fatalf("hole %d decodes to text", id)
			}
		}
	}
	if holes == 0 {
		t.Error("Builtin(65536) has no spare ids; the merges file has grown: update this test")
	}
	text := "Any text at all, even ünïcödé, encodes with the byte fallback."
	if got := big.Decode(big.Encode(text)); got != text {
		t.Errorf("round trip %q", got)
	}
}

// charsPerToken encodes text and returns characters (runes) per token.
func charsPerToken(tok *Tokenizer, text string) float64 {
	return float64(utf8.RuneCountInString(text)) / float64(len(tok.Encode(text)))
}

func TestBuiltinCompression(t *testing.T) {
	held, err := os.ReadFile("testdata/heldout_english.txt")
	if err != nil {
		t.Fatal(err)
	}
	corpus, err := os.ReadFile(builtinCorpusFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []int{512, 1024, 2048, 4096, 8192} {
		tok := Builtin(v)
		h, c := charsPerToken(tok, string(held)), charsPerToken(tok, string(corpus))
		t.Logf("vocab %5d: %.2f chars/token on held-out English, %.2f on the training text", v, h, c)
		if v >= 4096 && (h < 3.5 || h > 4.6) {
			t.Errorf("vocab %d: %.2f chars/token on held-out English, want 3.5–4.6", v, h)
		}
	}
}

func TestBuiltinEncodeSpeed(t *testing.T) {
	corpus, err := os.ReadFile(builtinCorpusFile)
	if err != nil {
		t.Fatal(err)
	}
	tok := Builtin(8192)
	text := string(corpus[:32000])
	ids := tok.Encode(text)
	start := time.Now()
	const n = 10
	for range n {
		ids = tok.Encode(text)
	}
	// Logged, never asserted: timings on a shared machine are noise.
	t.Logf("encode: %d chars → %d tokens in %v", len(text), len(ids), time.Since(start)/n)
}

func BenchmarkEncodeBuiltin(b *testing.B) {
	corpus, err := os.ReadFile(builtinCorpusFile)
	if err != nil {
		b.Fatal(err)
	}
	tok := Builtin(8192)
	text := string(corpus[:32000])
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		tok.Encode(text)
	}
}

func BenchmarkBuiltinConstruct(b *testing.B) {
	for b.Loop() {
		Builtin(8192)
	}
}

func TestBuiltinPrintable(t *testing.T) {
	tok := Builtin(65536)
	unprintable := tok.UnprintableIDs()
	in := func(id int32) bool { _, ok := slices.BinarySearch(unprintable, id); return ok }
	for b := range 256 {
		want := b < 0x20 && b != '\t' && b != '\n' || b == 0x7F || b >= 0x80
		if in(int32(b)) != want {
			t.Errorf("byte %#x: unprintable = %v, want %v", b, in(int32(b)), want)
		}
	}
	for _, s := range []string{EndOfText, IMStart, IMEnd} {
		if id, _ := tok.TokenID(s); !in(id) {
			t.Errorf("%s not listed as unprintable", s)
		}
	}
	printable := 0
	for id := range int32(tok.VocabSize()) {
		if in(id) {
			continue
		}
		printable++
		s := string(tok.TokenBytes(id))
		if !utf8.ValidString(s) || s == "" {
			t.Fatalf("printable id %d = %q", id, s)
		}
		for _, r := range s {
			if !unicode.IsPrint(r) && r != '\n' && r != '\t' {
				t.Fatalf("printable id %d = %q has %U", id, s, r)
			}
		}
	}
	if printable < 3000 {
		t.Errorf("only %d printable tokens", printable)
	}
	// Random generation restricted to printable ids is valid, printable UTF-8 text.
	var ok []int32
	for id := range int32(tok.VocabSize()) {
		if !in(id) {
			ok = append(ok, id)
		}
	}
	r := rand.New(rand.NewPCG(5, 6))
	ids := make([]int32, 500)
	for i := range ids {
		ids[i] = ok[r.IntN(len(ok))]
	}
	d := tok.NewStreamDecoder()
	for _, id := range ids {
		if s := d.Push(id); s == "" || !utf8.ValidString(s) || strings.ContainsRune(s, utf8.RuneError) {
			t.Fatalf("printable id %d streamed as %q", id, s)
		}
	}
	if d.Pending() {
		t.Error("printable ids left a partial character")
	}
}

func TestTokenStrings(t *testing.T) {
	tok := Builtin(4096)
	ids := tok.Encode("the cat\n")
	strs := tok.TokenStrings(append(ids, -1))
	for i, id := range ids {
		// Each spelling maps back to its id through the vocabulary, and spaces and newlines
		// are written in the byte-level alphabet.
		if back, ok := tok.TokenID(strs[i]); !ok || back != id {
			t.Errorf("TokenStrings(%d) = %q, which maps back to %d", id, strs[i], back)
		}
		if strings.ContainsAny(strs[i], " \n") {
			t.Errorf("spelling %q is not in the byte-level alphabet", strs[i])
		}
	}
	if strs[len(ids)] != "" {
		t.Errorf("unknown id spelled %q", strs[len(ids)])
	}
}

func TestBuiltinJSONLoadsAsBuiltin(t *testing.T) {
	for _, vocab := range []int{BuiltinMinVocab, 1000, 4096} {
		want := Builtin(vocab)
		tj, cfg := BuiltinJSON(vocab)
		got, err := Load(tj, cfg)
		if err != nil {
			t.Fatalf("vocab %d: %v", vocab, err)
		}
		if got.VocabSize() != want.VocabSize() {
			t.Fatalf("vocab %d: VocabSize %d, want %d", vocab, got.VocabSize(), want.VocabSize())
		}
		for _, text := range []string{"Hello, world! 1234 ünïcödé\n\n  spaces", "<|im_start|>user\nhi<|im_end|>", string(must(os.ReadFile("testdata/heldout_english.txt")))} {
			if a, b := got.Encode(text), want.Encode(text); !slices.Equal(a, b) {
				t.Fatalf("vocab %d: Encode(%.40q) = %v, Builtin gives %v", vocab, text, a, b)
			}
		}
		msgs := []Message{{Role: "user", Content: "hi"}}
		tmpl, err := got.ChatTemplate()
		if err != nil {
			t.Fatal(err)
		}
		a, _ := tmpl.Render(msgs, RenderOptions{AddGenerationPrompt: true})
		b, _ := ChatML().Render(msgs, RenderOptions{AddGenerationPrompt: true})
		if a != b {
			t.Fatalf("chat template renders %q, ChatML %q", a, b)
		}
	}
}

// must returns v, panicking on err (test inputs that are part of the repository).
func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
