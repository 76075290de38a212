package tokenizer

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

// hfExpected is testdata/hf/expected.json.gz, written by testdata/hf/gen.mjs with Hugging
// Face's tokenizers library (the npm package `tokenizers`, its Rust implementation): for each
// variant of a real tokenizer.json, the ids of every string without and with special tokens and
// the decoded texts.
type hfExpected struct {
	Strings  []string
	Variants []struct {
		Name        string
		Base        string
		Overrides   map[string]json.RawMessage
		Plain       [][]int32
		Special     [][]int32
		Decoded     []string
		DecodedSkip []string
		// DecodeIDs are extra id lists (byte-fallback runs, special tokens between words) with
		// their decoded texts.
		DecodeIDs         [][]int32
		DecodeIDsText     []string
		DecodeIDsTextSkip []string
	}
}

// hfTokenizerJSON returns the trimmed base tokenizer.json with the variant's components replaced.
func hfTokenizerJSON(t *testing.T, base string, overrides map[string]json.RawMessage) []byte {
	t.Helper()
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(fixture.Gunzip(t, fmt.Sprintf("testdata/hf/base-%s.json.gz", base)), &doc); err != nil {
		t.Fatal(err)
	}
	for k, v := range overrides {
		doc[k] = v
	}
	b, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestMatchesHuggingFaceTokenizers encodes and decodes 500 strings (prose, code, whitespace runs,
// twelve scripts, emoji, text that NFC/NFKC change, inline special tokens, random mixtures) with
// real Qwen3, Llama 3, Llama 3.1 and Llama 2 tokenizer files and variants of them (NFD, NFKC,
// NFKD and a Strip/Lowercase/Replace/Prepend sequence of normalizers; Metaspace pre-tokenizers
// and decoders with every prepend scheme; templates adding BOS and EOS) and requires exactly the
// ids and texts Hugging Face's tokenizers produced.
func TestMatchesHuggingFaceTokenizers(t *testing.T) {
	var want hfExpected
	if err := json.Unmarshal(fixture.Gunzip(t, "testdata/hf/expected.json.gz"), &want); err != nil {
		t.Fatal(err)
	}
	if len(want.Strings) < 450 || len(want.Variants) < 10 {
		t.Fatalf("fixture has %d strings and %d variants", len(want.Strings), len(want.Variants))
	}
	for _, v := range want.Variants {
		t.Run(v.Name, func(t *testing.T) {
			tok, err := Load(hfTokenizerJSON(t, v.Base, v.Overrides), nil)
			if err != nil {
				t.Fatal(err)
			}
			bad := 0
			report := func(format string, args ...any) {
				if bad++; bad <= 5 {
					t.Errorf(format, args...)
				}
			}
			for i, s := range want.Strings {
				if got := tok.Encode(s); !slices.Equal(got, v.Plain[i]) {
					report("Encode(%q) = %v, tokenizers gives %v", s, got, v.Plain[i])
				}
				if got := tok.EncodeSpecial(s); !slices.Equal(got, v.Special[i]) {
					report("EncodeSpecial(%q) = %v, tokenizers gives %v", s, got, v.Special[i])
				}
				if got := tok.Decode(v.Special[i]); got != v.Decoded[i] {
					report("Decode(%v) = %q, tokenizers gives %q", v.Special[i], got, v.Decoded[i])
				}
				if got := tok.DecodeWith(v.Special[i], DecodeOptions{SkipSpecial: true}); got != v.DecodedSkip[i] {
					report("Decode(%v, skip special) = %q, tokenizers gives %q", v.Special[i], got, v.DecodedSkip[i])
				}
			}
			for i, ids := range v.DecodeIDs {
				if got := tok.Decode(ids); got != v.DecodeIDsText[i] {
					report("Decode(%v) = %q, tokenizers gives %q", ids, got, v.DecodeIDsText[i])
				}
				if got := tok.DecodeWith(ids, DecodeOptions{SkipSpecial: true}); got != v.DecodeIDsTextSkip[i] {
					report("Decode(%v, skip special) = %q, tokenizers gives %q", ids, got, v.DecodeIDsTextSkip[i])
				}
			}
			if bad > 0 {
				t.Fatalf("%d of %d checks differ from Hugging Face's tokenizers", bad, 4*len(want.Strings)+2*len(v.DecodeIDs))
			}
		})
	}
}

// TestTokenStringsMatchVocab: TokenStrings spells every id as convert_ids_to_tokens does: its
// key in the tokenizer.json's vocab, or an added token's content, read here straight from the
// real Llama 2 (SentencePiece: ▁ and <0xXX>) and Qwen3 (byte-level: Ġ, Ċ) files.
func TestTokenStringsMatchVocab(t *testing.T) {
	for _, c := range []struct {
		base string
		ids  []int32
		want []string // spellings taken from the file's vocab
	}{
		{"llama2", []int32{1, 22557, 1526, 13, 493, 231}, []string{"<s>", "▁Hello", "▁world", "<0x0A>", "ok", "<0xE4>"}},
		{"qwen3", []int32{9707, 1879, 198, 562, 21927, 151645}, []string{"Hello", "Ġworld", "Ċ", "ok", "ĠHello", "<|im_end|>"}},
	} {
		t.Run(c.base, func(t *testing.T) {
			raw := hfTokenizerJSON(t, c.base, nil)
			var doc struct {
				AddedTokens []struct {
					ID      int32  `json:"id"`
					Content string `json:"content"`
				} `json:"added_tokens"`
				Model struct {
					Vocab map[string]int32 `json:"vocab"`
				} `json:"model"`
			}
			if err := json.Unmarshal(raw, &doc); err != nil {
				t.Fatal(err)
			}
			spelling := map[int32]string{}
			for s, id := range doc.Model.Vocab {
				spelling[id] = s
			}
			for _, a := range doc.AddedTokens {
				spelling[a.ID] = a.Content // added tokens take precedence, as in transformers
			}
			tok, err := Load(raw, nil)
			if err != nil {
				t.Fatal(err)
			}
			if got := tok.TokenStrings(c.ids); !slices.Equal(got, c.want) {
				t.Errorf("TokenStrings(%v) = %q, want %q", c.ids, got, c.want)
			}
			var ids []int32
			for id := range spelling {
				ids = append(ids, id)
			}
			slices.Sort(ids)
			got := tok.TokenStrings(append(ids, -1, 1<<30))
			bad := 0
			for i, id := range ids {
				if got[i] != spelling[id] {
					if bad++; bad <= 5 {
						t.Errorf("TokenStrings(%d) = %q, the file spells it %q", id, got[i], spelling[id])
					}
				}
			}
			if got[len(ids)] != "" || got[len(ids)+1] != "" {
				t.Errorf("unknown ids spelled %q, %q", got[len(ids)], got[len(ids)+1])
			}
		})
	}
}
