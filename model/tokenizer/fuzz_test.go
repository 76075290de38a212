package tokenizer

import (
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzEncodeDecode checks that Decode(Encode(s)) == s for valid UTF-8 (and the U+FFFD-repaired
// s otherwise) for the built-in tokenizer and tokenizer.json ones with the Qwen2 and Llama 3
// patterns, that streaming decoding agrees with Decode, and that the heap and scan merge
// strategies agree. Seeds are in testdata/fuzz/FuzzEncodeDecode.
func FuzzEncodeDecode(f *testing.F) {
	f.Add("Hello, world! It's 2024.")
	toks := []*Tokenizer{Builtin(4096), loadTest(f)}
	llama, err := Load(testTokenizerJSON(f, PatternLlama3, true, true, nil), nil)
	if err != nil {
		f.Fatal(err)
	}
	toks = append(toks, llama)
	f.Fuzz(func(t *testing.T, s string) {
		want := s
		if !utf8.ValidString(s) {
			want = string(appendLossy(nil, []byte(s)))
		}
		for i, tok := range toks {
			want := want
			if tok.norm != nil {
				want = tok.norm.normalize(want) // NFC for the Qwen-style tokenizer.json
			}
			ids := tok.Encode(s)
			if got := tok.Decode(ids); got != want {
				t.Fatalf("tokenizer %d: Decode(Encode(%q)) = %q (ids %v)", i, s, got, ids)
			}
			d := tok.NewStreamDecoder()
			var b strings.Builder
			for _, id := range ids {
				b.WriteString(d.Push(id))
			}
			b.WriteString(d.Flush())
			if b.String() != want {
				t.Fatalf("tokenizer %d: stream decode of %q = %q", i, s, b.String())
			}
		}
		bpe := &toks[0].bpe
		for _, p := range splitQwen(s, 1, nil) {
			if len(p) < 2 || len(p) > smallPiece {
				continue
			}
			if scan, heap := bpe.mergeScan(bpe.byteSymbols(p), nil), bpe.mergeHeap(bpe.byteSymbols(p), nil); !slices.Equal(scan, heap) {
				t.Fatalf("piece %q: scan %v, heap %v", p, scan, heap)
			}
		}
	})
}

// FuzzChatTemplate checks that compiling and rendering arbitrary template text and message
// content returns (output or an error) without panicking. Seeds are in
// testdata/fuzz/FuzzChatTemplate.
//
// Inputs containing '*' are skipped: ardanlabs/jinja repeats strings ('a' * n) without a bound,
// so the fuzzer could ask for terabytes; that is a known gap of templates (which come from the
// operator, never from API clients).
func FuzzChatTemplate(f *testing.F) {
	f.Add("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}", "hi")
	f.Fuzz(func(t *testing.T, src, content string) {
		if len(src) > 4096 || len(content) > 64 || strings.Contains(src, "*") {
			return
		}
		ct, err := ParseChatTemplate(src, "<s>", "</s>")
		if err != nil {
			return
		}
		msgs := []Message{{"system", content}, {"user", content}, {"assistant", content}}
		_, _ = ct.Render(msgs, RenderOptions{AddGenerationPrompt: true})
		_, _ = ct.Render(nil, RenderOptions{})
	})
}
