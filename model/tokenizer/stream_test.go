package tokenizer

import (
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"
)

// pushAll streams ids through a fresh decoder and returns each Push result and the Flush.
func pushAll(d *StreamDecoder, ids []int32) (deltas []string, flushed string) {
	for _, id := range ids {
		deltas = append(deltas, d.Push(id))
	}
	return deltas, d.Flush()
}

func TestStreamHoldsPartialCharacters(t *testing.T) {
	tok := Builtin(1024)
	im := int32(1023)
	// Byte tokens have id = byte value in the built-in tokenizer.
	cases := []struct {
		name  string
		ids   []int32
		want  []string // per Push
		flush string
	}{
		{"2-byte é", []int32{0xC3, 0xA9}, []string{"", "é"}, ""},
		{"3-byte 世", []int32{0xE4, 0xB8, 0x96}, []string{"", "", "世"}, ""},
		{"4-byte emoji", []int32{0xF0, 0x9F, 0x98, 0x80, 'x'}, []string{"", "", "", "😀", "x"}, ""},
		{"ascii then partial", []int32{'a', 0xE4, 'b'}, []string{"a", "", "\uFFFDb"}, ""},
		{"lone continuation", []int32{0x80, 'a'}, []string{"\uFFFD", "a"}, ""},
		{"invalid lead", []int32{0xFF}, []string{"\uFFFD"}, ""},
		// ED may start a valid sequence (ED 80..9F), so it is held until A0 shows it cannot.
		{"surrogate is invalid", []int32{0xED, 0xA0, 0x80}, []string{"", "\uFFFD\uFFFD", "\uFFFD"}, ""},
		{"incomplete at end", []int32{'o', 'k', 0xF0, 0x9F}, []string{"o", "k", "", ""}, "\uFFFD"},
		{"special token after partial", []int32{0xE4, 0xB8, im}, []string{"", "", "\uFFFD<|im_end|>"}, ""},
	}
	for _, c := range cases {
		deltas, flushed := pushAll(tok.NewStreamDecoder(), c.ids)
		if strings.Join(deltas, "|") != strings.Join(c.want, "|") || flushed != c.flush {
			t.Errorf("%s: pushes %q flush %q, want %q flush %q", c.name, deltas, flushed, c.want, c.flush)
		}
		if all := strings.Join(deltas, "") + flushed; all != tok.Decode(c.ids) {
			t.Errorf("%s: stream %q != Decode %q", c.name, all, tok.Decode(c.ids))
		}
	}
}

func TestStreamSkipSpecial(t *testing.T) {
	tok := Builtin(1024)
	ids := tok.Encode("<|im_start|>assistant\nhi 世界<|im_end|>")
	d := tok.NewStreamDecoderWith(DecodeOptions{SkipSpecial: true})
	deltas, flushed := pushAll(d, ids)
	if got := strings.Join(deltas, "") + flushed; got != "assistant\nhi 世界" {
		t.Errorf("skip special stream = %q", got)
	}
	if got := tok.DecodeWith(ids, DecodeOptions{SkipSpecial: true}); got != "assistant\nhi 世界" {
		t.Errorf("DecodeWith skip special = %q", got)
	}
	if got := tok.Decode(ids); got != "<|im_start|>assistant\nhi 世界<|im_end|>" {
		t.Errorf("Decode = %q", got)
	}
}

func TestStreamRandomIDsMatchDecode(t *testing.T) {
	tok := Builtin(2048)
	r := rand.New(rand.NewPCG(3, 4))
	for range 2000 {
		ids := make([]int32, 1+r.IntN(12))
		for i := range ids {
			switch r.IntN(3) {
			case 0:
				ids[i] = int32(0x80 + r.IntN(0x80)) // high bytes: partial and invalid UTF-8
			case 1:
				ids[i] = int32(r.IntN(tok.VocabSize() + 5)) // includes ids past the vocabulary
			default:
				ids[i] = int32(r.IntN(256))
			}
		}
		d := tok.NewStreamDecoder()
		var all strings.Builder
		for _, id := range ids {
			s := d.Push(id)
			if !utf8.ValidString(s) {
				t.Fatalf("Push returned invalid UTF-8 %q for %v", s, ids)
			}
			all.WriteString(s)
		}
		all.WriteString(d.Flush())
		if d.Pending() {
			t.Fatal("Pending after Flush")
		}
		if want := tok.Decode(ids); all.String() != want {
			t.Fatalf("ids %v: stream %q, Decode %q", ids, all.String(), want)
		}
	}
}

func TestLossyMatchesMaximalSubparts(t *testing.T) {
	// Expected values follow the Unicode "maximal subpart" practice (Rust from_utf8_lossy).
	cases := map[string]string{
		"a\xe4\xb8b":         "a\uFFFDb",
		"\x80\x80":           "\uFFFD\uFFFD",
		"\xf0\x9f\x98":       "\uFFFD",
		"\xed\xa0\x80":       "\uFFFD\uFFFD\uFFFD",
		"\xc0\xaf":           "\uFFFD\uFFFD",
		"\xf4\x90\x80\x80":   "\uFFFD\uFFFD\uFFFD\uFFFD",
		"ok \xe2\x82\xac ok": "ok € ok",
	}
	for in, want := range cases {
		if got := string(appendLossy(nil, []byte(in))); got != want {
			t.Errorf("lossy(%q) = %q, want %q", in, got, want)
		}
	}
}
