package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
)

// gpt2ByteOrder lists the bytes in GPT-2's vocabulary order: the printable bytes ('!'…'~',
// '¡'…'¬', '®'…'ÿ') ascending, then the others ascending. The test vocabulary gives byte
// gpt2ByteOrder[i] the id i, as GPT-2 does ("!" = 0, "Ġ" = 220, "Ċ" = 198).
func gpt2ByteOrder() []byte {
	var printable, rest []byte
	for b := range 256 {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			printable = append(printable, byte(b))
		} else {
			rest = append(rest, byte(b))
		}
	}
	return append(printable, rest...)
}

// testMerges are the merges of the test tokenizer, in rank order; merge i creates id 256+i.
var testMerges = [][2]string{
	{"Ġ", "t"},     // 256 Ġt
	{"h", "e"},     // 257 he
	{"Ġt", "he"},   // 258 Ġthe
	{"i", "n"},     // 259 in
	{"in", "g"},    // 260 ing
	{"Ġ", "a"},     // 261 Ġa
	{"e", "r"},     // 262 er
	{"l", "l"},     // 263 ll
	{"e", "ll"},    // 264 ell
	{"h", "ell"},   // 265 hell
	{"hell", "o"},  // 266 hello
	{"Ġ", "w"},     // 267 Ġw
	{"o", "r"},     // 268 or
	{"Ġw", "or"},   // 269 Ġwor
	{"Ġwor", "l"},  // 270 Ġworl
	{"Ġworl", "d"}, // 271 Ġworld
	{"'", "s"},     // 272 's
	{"Ġ", "Ġ"},     // 273 ĠĠ
	{"Ċ", "Ċ"},     // 274 ĊĊ
	{"ä", "¸"},     // 275 first two bytes of 世 (E4 B8)
	{"ä¸", "ĸ"},    // 276 世 (E4 B8 96)
}

// Ids of the test tokenizer's added tokens.
const (
	testEndOfText = 300
	testIMStart   = 301
	testIMEnd     = 302
	testThink     = 303 // not special
)

// testTokenizerJSON writes a small but real byte-level BPE tokenizer.json in the layout of
// Qwen2's: a Split pre-tokenizer with pattern, then ByteLevel without regex.
// pairMerges selects the [a, b] merge form; extraVocab adds vocabulary entries.
func testTokenizerJSON(t testing.TB, pattern string, pairMerges, ignoreMerges bool, extraVocab map[string]int) []byte {
	t.Helper()
	bl := newByteLevel()
	vocab := map[string]int{}
	for i, b := range gpt2ByteOrder() {
		vocab[string(bl.toRune[b])] = i
	}
	var merges []any
	for i, m := range testMerges {
		vocab[m[0]+m[1]] = 256 + i
		if pairMerges {
			merges = append(merges, []string{m[0], m[1]})
		} else {
			merges = append(merges, m[0]+" "+m[1])
		}
	}
	for k, v := range extraVocab {
		vocab[k] = v
	}
	added := func(id int, content string, special bool) map[string]any {
		return map[string]any{"id": id, "content": content, "single_word": false, "lstrip": false,
			"rstrip": false, "normalized": !special, "special": special}
	}
	doc := map[string]any{
		"version":    "1.0",
		"truncation": nil,
		"padding":    nil,
		"added_tokens": []any{
			added(testEndOfText, "<|endoftext|>", true),
			added(testIMStart, "<|im_start|>", true),
			added(testIMEnd, "<|im_end|>", true),
			added(testThink, "<think>", false),
		},
		"normalizer": map[string]any{"type": "NFC"},
		"pre_tokenizer": map[string]any{
			"type": "Sequence",
			"pretokenizers": []any{
				map[string]any{"type": "Split", "pattern": map[string]any{"Regex": pattern}, "behavior": "Isolated", "invert": false},
				map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
			},
		},
		"post_processor": map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
		"decoder":        map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
		"model": map[string]any{
			"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": "",
			"end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
			"ignore_merges": ignoreMerges, "vocab": vocab, "merges": merges,
		},
	}
	b, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// testConfigJSON is a Qwen3-like tokenizer_config.json.
const testConfigJSON = `{
  "add_bos_token": false,
  "bos_token": null,
  "eos_token": {"content": "<|im_end|>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false},
  "pad_token": "<|endoftext|>",
  "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
}`

// loadTest loads the test tokenizer with the Qwen2 pattern.
func loadTest(t testing.TB) *Tokenizer {
	t.Helper()
	tok, err := Load(testTokenizerJSON(t, PatternQwen2, false, false, nil), []byte(testConfigJSON))
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// byteID is the test vocabulary's id of a single byte.
func byteID(b byte) int32 {
	return int32(slices.Index(gpt2ByteOrder(), b))
}

func TestLoadEncodeHandDerived(t *testing.T) {
	tok := loadTest(t)
	if got := byteID(' '); got != 220 {
		t.Fatalf("byte order: id of space = %d, want 220 as in GPT-2", got)
	}
	b := byteID
	cases := []struct {
		text string
		want []int32
	}{
		// "the" → t,h,e; "h e" (rank 1) merges; "t he" has no rule.
		{"the", []int32{b('t'), 257}},
		// " theater": Ġt (0), he (1), Ġthe (2), then er (6).
		{" theater", []int32{258, b('a'), b('t'), 262}},
		{"the theater", []int32{b('t'), 257, 258, b('a'), b('t'), 262}},
		// "hello": "h e" (rank 1) wins over "l l" (rank 7), so the he/ll split blocks the
		// ell/hell/hello chain; " world": Ġw, or, Ġwor, Ġworl, Ġworld.
		{"hello world", []int32{257, 263, b('o'), 271}},
		// "yell" can use the chain: ll, ell.
		{"yell", []int32{b('y'), 264}},
		// Contraction split: "it's" → "it", "'s" (rule 272).
		{"it's", []int32{b('i'), b('t'), 272}},
		// Qwen splits numbers into single digits.
		{"2024", []int32{b('2'), b('0'), b('2'), b('4')}},
		// "  the": \s+(?!\S) leaves one space for " the": pieces " ", " the".
		{"  the", []int32{220, 258}},
		// Trailing spaces stay together: "a", "   " → ĠĠ (273) + Ġ.
		{"a   ", []int32{b('a'), 273, 220}},
		// "\n\nthe": \s*[\r\n]+ takes both newlines (ĊĊ = 274), then "the".
		{"\n\nthe", []int32{274, b('t'), 257}},
		// 世 is E4 B8 96: merged by rules 275 and 276; 界 (E7 95 8C) stays as bytes.
		{"世界", []int32{276, b(0xE7), b(0x95), b(0x8C)}},
		// Added tokens are split out first, special or not.
		{"<|im_start|>user\nhi<|im_end|>", []int32{testIMStart, b('u'), b('s'), 262, b('\n'), b('h'), b('i'), testIMEnd}},
		// "</think>" is not an added token: pieces "</", "think" (i n → in), ">".
		{"<think>the</think>", []int32{testThink, b('t'), 257, b('<'), b('/'), b('t'), b('h'), 259, b('k'), b('>')}},
	}
	for _, c := range cases {
		got := tok.Encode(c.text)
		if !slices.Equal(got, c.want) {
			t.Errorf("Encode(%q) = %v, want %v", c.text, got, c.want)
		}
		if dec := tok.Decode(got); dec != c.text {
			t.Errorf("Decode(Encode(%q)) = %q", c.text, dec)
		}
	}
}

func TestLoadMergeForms(t *testing.T) {
	str, err := Load(testTokenizerJSON(t, PatternQwen2, false, false, nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := Load(testTokenizerJSON(t, PatternQwen2, true, false, nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"hello world, the theater's ringing", "世界 2024\n\n  x"} {
		if a, b := str.Encode(s), pair.Encode(s); !slices.Equal(a, b) {
			t.Errorf("%q: string merges %v, pair merges %v", s, a, b)
		}
	}
}

func TestLoadLlama3DigitsAndIgnoreMerges(t *testing.T) {
	bl := newByteLevel()
	// "Ġtheater" is in the vocab but no merge sequence reaches it: only ignore_merges finds it.
	extra := map[string]int{bl.encode([]byte(" theater")): 290}
	tok, err := Load(testTokenizerJSON(t, PatternLlama3, false, true, extra), nil)
	if err != nil {
		t.Fatal(err)
	}
	b := byteID
	if got, want := tok.Encode("12345"), []int32{b('1'), b('2'), b('3'), b('4'), b('5')}; !slices.Equal(got, want) {
		// Pieces "123", "45": no digit merges, so the ids are the same bytes.
		t.Errorf("Encode(12345) = %v, want %v", got, want)
	}
	if got, want := tok.Encode("the theater"), []int32{b('t'), 257, 290}; !slices.Equal(got, want) {
		t.Errorf("ignore_merges: Encode = %v, want %v", got, want)
	}
	var pieces []string
	pieces = tok.pre.split([]string{"12345 x"}, pieces, true)
	if want := []string{"123", "45", " x"}; !slices.Equal(pieces, want) {
		t.Errorf("Llama-3 pieces %q, want %q", pieces, want)
	}
}

func TestLoadConfig(t *testing.T) {
	tok := loadTest(t)
	if tok.EOSToken() != "<|im_end|>" {
		t.Errorf("EOSToken = %q", tok.EOSToken())
	}
	if id, ok := tok.EOSTokenID(); !ok || id != testIMEnd {
		t.Errorf("EOSTokenID = %d, %v", id, ok)
	}
	if _, ok := tok.BOSTokenID(); ok || tok.AddBOS() {
		t.Error("Qwen-like config has no BOS")
	}
	if tok.VocabSize() != testThink+1 {
		t.Errorf("VocabSize = %d, want %d", tok.VocabSize(), testThink+1)
	}
	if id, ok := tok.TokenID("<think>"); !ok || id != testThink {
		t.Errorf("TokenID(<think>) = %d, %v", id, ok)
	}
	if id, ok := tok.TokenID("Ġthe"); !ok || id != 258 {
		t.Errorf("TokenID(Ġthe) = %d, %v", id, ok)
	}
	if !tok.IsSpecial(testIMEnd) || tok.IsSpecial(testThink) {
		t.Error("IsSpecial")
	}
	if got := tok.SpecialIDs(); !slices.Equal(got, []int32{testEndOfText, testIMStart, testIMEnd}) {
		t.Errorf("SpecialIDs = %v", got)
	}
	ct, err := tok.ChatTemplate()
	if err != nil {
		t.Fatal(err)
	}
	got, err := ct.Render([]Message{{"user", "hi"}}, RenderOptions{AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	if want := "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"; got != want {
		t.Errorf("config chat_template rendered %q, want %q", got, want)
	}

	// Llama-3 style: a TemplateProcessing post-processor prepends BOS; the list form of
	// chat_template; the string form of eos_token.
	var doc map[string]any
	if err := json.Unmarshal(testTokenizerJSON(t, PatternLlama3, false, false, nil), &doc); err != nil {
		t.Fatal(err)
	}
	doc["added_tokens"] = append(doc["added_tokens"].([]any), map[string]any{"id": 304, "content": "<|begin_of_text|>", "special": true})
	doc["post_processor"] = map[string]any{"type": "Sequence", "processors": []any{
		map[string]any{"type": "ByteLevel"},
		map[string]any{"type": "TemplateProcessing",
			"single": []any{
				map[string]any{"SpecialToken": map[string]any{"id": "<|begin_of_text|>", "type_id": 0}},
				map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}},
			},
			"special_tokens": map[string]any{"<|begin_of_text|>": map[string]any{"id": "<|begin_of_text|>", "ids": []int{304}, "tokens": []string{"<|begin_of_text|>"}}}},
	}}
	tj, _ := json.Marshal(doc)
	cfg := `{"eos_token": "<|endoftext|>", "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}`
	llama, err := Load(tj, []byte(cfg))
	if err != nil {
		t.Fatal(err)
	}
	if id, ok := llama.BOSTokenID(); !ok || id != 304 || !llama.AddBOS() || llama.BOSToken() != "<|begin_of_text|>" {
		t.Errorf("BOS from post-processor: %d %v %v %q", id, ok, llama.AddBOS(), llama.BOSToken())
	}
	if id, _ := llama.EOSTokenID(); id != testEndOfText {
		t.Errorf("EOS id %d", id)
	}
	if llama.ChatTemplateSource() != "D" {
		t.Errorf("chat_template list: got %q, want the default entry", llama.ChatTemplateSource())
	}
}

func TestLoadErrors(t *testing.T) {
	good := testTokenizerJSON(t, PatternQwen2, false, false, nil)
	mutate := func(f func(doc map[string]any)) []byte {
		var doc map[string]any
		if err := json.Unmarshal(good, &doc); err != nil {
			t.Fatal(err)
		}
		f(doc)
		b, _ := json.Marshal(doc)
		return b
	}
	model := func(doc map[string]any) map[string]any { return doc["model"].(map[string]any) }
	cases := []struct {
		name string
		json []byte
		cfg  string
		want error
	}{
		{"not json", []byte("{"), "", ErrMalformed},
		{"bad config", good, "[", ErrMalformed},
		{"unigram", mutate(func(d map[string]any) { model(d)["type"] = "Unigram" }), "", ErrUnsupported},
		{"merge of unknown token", mutate(func(d map[string]any) { model(d)["merges"] = []any{"x y"} }), "", ErrMalformed},
		{"bad merge form", mutate(func(d map[string]any) { model(d)["merges"] = []any{"abc"} }), "", ErrMalformed},
		{"negative id", mutate(func(d map[string]any) { model(d)["vocab"].(map[string]any)["zz"] = -1 }), "", ErrMalformed},
		{"huge id", mutate(func(d map[string]any) { model(d)["vocab"].(map[string]any)["zz"] = 1 << 40 }), "", ErrMalformed},
		{"bad regex", mutate(func(d map[string]any) {
			d["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["pattern"] = map[string]any{"Regex": "(?<"}
		}), "", ErrUnsupported},
		{"whitespace pre-tokenizer", mutate(func(d map[string]any) { d["pre_tokenizer"] = map[string]any{"type": "Whitespace"} }), "", ErrUnsupported},
		{"wordpiece decoder", mutate(func(d map[string]any) { d["decoder"] = map[string]any{"type": "WordPiece"} }), "", ErrUnsupported},
		{"precompiled normalizer", mutate(func(d map[string]any) { d["normalizer"] = map[string]any{"type": "Precompiled"} }), "", ErrUnsupported},
		{"bert normalizer in a sequence", mutate(func(d map[string]any) {
			d["normalizer"] = map[string]any{"type": "Sequence", "normalizers": []any{map[string]any{"type": "NFC"}, map[string]any{"type": "BertNormalizer"}}}
		}), "", ErrUnsupported},
		{"unknown post-processor", mutate(func(d map[string]any) { d["post_processor"] = map[string]any{"type": "Mystery"} }), "", ErrUnsupported},
		{"template without special_tokens", mutate(func(d map[string]any) {
			d["post_processor"] = map[string]any{"type": "TemplateProcessing", "single": []any{map[string]any{"SpecialToken": map[string]any{"id": "<s>"}}}}
		}), "", ErrMalformed},
	}
	for _, c := range cases {
		_, err := Load(c.json, []byte(c.cfg))
		if !errors.Is(err, c.want) {
			t.Errorf("%s: err = %v, want %v", c.name, err, c.want)
		}
	}
}

func TestSplitBehaviors(t *testing.T) {
	m := stringMatcher{lit: "-"}
	cases := []struct {
		b      splitBehavior
		invert bool
		want   []string
	}{
		{behaviorIsolated, false, []string{"a", "-", "b", "-", "-", "c"}},
		{behaviorRemoved, false, []string{"a", "b", "c"}},
		{behaviorMergedWithPrevious, false, []string{"a-", "b-", "-", "c"}},
		{behaviorMergedWithNext, false, []string{"a", "-b", "-", "-c"}},
		{behaviorContiguous, false, []string{"a", "-", "b", "--", "c"}},
		{behaviorRemoved, true, []string{"-", "-", "-"}},
	}
	for _, c := range cases {
		p := &splitPre{m: m, behavior: c.b, invert: c.invert}
		if got := p.split([]string{"a-b--c"}, nil, true); !slices.Equal(got, c.want) {
			t.Errorf("behavior %d invert %v: %q, want %q", c.b, c.invert, got, c.want)
		}
	}
	if got := (digitsPre{individual: true}).split([]string{"ab12c3"}, nil, true); !slices.Equal(got, []string{"ab", "1", "2", "c", "3"}) {
		t.Errorf("Digits individual: %q", got)
	}
	if got := (digitsPre{}).split([]string{"ab12c3"}, nil, true); !slices.Equal(got, []string{"ab", "12", "c", "3"}) {
		t.Errorf("Digits: %q", got)
	}
	if got := (byteLevelPre{addPrefixSpace: true, useRegex: true}).split([]string{"hello world"}, nil, true); !slices.Equal(got, []string{" hello", " world"}) {
		t.Errorf("ByteLevel: %q", got)
	}
}

func TestLongPieceHeapMatchesScan(t *testing.T) {
	tok := loadTest(t)
	for _, s := range []string{
		strings.Repeat("l", 100),
		strings.Repeat("hello", 30),
		strings.Repeat("ĠĠ", 40) + "thethe",
		strings.Repeat("世", 20),
	} {
		scan := tok.bpe.mergeScan(tok.bpe.byteSymbols(s[:min(len(s), smallPiece)]), nil)
		heap := tok.bpe.mergeHeap(tok.bpe.byteSymbols(s[:min(len(s), smallPiece)]), nil)
		if !slices.Equal(scan, heap) {
			t.Errorf("%q: scan %v, heap %v", s[:min(len(s), smallPiece)], scan, heap)
		}
		ids := tok.bpe.encodePiece(s, nil)
		if got := tok.Decode(ids); got != s {
			t.Errorf("long piece round trip: %q", got)
		}
	}
}

func TestLoadRegexp2PathMatchesHandPath(t *testing.T) {
	// The same pattern spelled differently is run by regexp2 instead of the hand splitter;
	// both tokenizers must agree everywhere, including when used concurrently.
	hand := loadTest(t)
	viaRegex, err := Load(testTokenizerJSON(t, "(?:"+PatternQwen2+")", false, false, nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := viaRegex.pre.(*splitPre).m.(*regexMatcher); !ok {
		t.Fatal("the respelled pattern did not select regexp2")
	}
	corpus, err := os.ReadFile(builtinCorpusFile)
	if err != nil {
		t.Fatal(err)
	}
	texts := []string{string(corpus[:30000]), "<|im_start|>user\n世界 it'S  2024\r\n\r\n\t x<|im_end|>"}
	var wg sync.WaitGroup
	errs := make(chan string, 4)
	for range 4 {
		wg.Go(func() {
			for _, s := range texts {
				if a, b := hand.Encode(s), viaRegex.Encode(s); !slices.Equal(a, b) {
					errs <- fmt.Sprintf("hand and regexp2 paths differ on %.40q", s)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// byteSymbols returns the initial symbols of a byte-level piece (one per byte).
func (m *bpeModel) byteSymbols(s string) []int32 {
	ids := make([]int32, len(s))
	for i := range len(s) {
		ids[i] = m.byteIDs[s[i]]
	}
	return ids
}

// Post-processor token ids outside the vocabulary (negative, past maxTokenID, or past the
// vocabulary) are rejected with an error, never an index panic; Bert/RobertaProcessing's name
// the key holding the id.
func TestLoadPostProcessorIDRange(t *testing.T) {
	good := testTokenizerJSON(t, PatternQwen2, false, false, nil)
	with := func(pp map[string]any) []byte {
		var doc map[string]any
		if err := json.Unmarshal(good, &doc); err != nil {
			t.Fatal(err)
		}
		doc["post_processor"] = pp
		b, _ := json.Marshal(doc)
		return b
	}
	bert := func(typ string, cls, sep int64) map[string]any {
		return map[string]any{"type": typ, "cls": []any{"a", cls}, "sep": []any{"b", sep}}
	}
	template := func(id int64) map[string]any {
		return map[string]any{"type": "TemplateProcessing",
			"single":         []any{map[string]any{"SpecialToken": map[string]any{"id": "<s>"}}, map[string]any{"Sequence": map[string]any{"id": "A"}}},
			"special_tokens": map[string]any{"<s>": map[string]any{"id": "<s>", "ids": []int64{id}}}}
	}
	// The test vocabulary holds ids 0…testThink.
	cases := []struct {
		name string
		pp   map[string]any
		key  string // in the error, if set
	}{
		{"bert negative cls", bert("BertProcessing", -1, 0), "cls"},
		{"roberta negative sep", bert("RobertaProcessing", 0, -2), "sep"},
		{"bert huge cls", bert("BertProcessing", 1<<30, 0), "cls"},
		{"bert cls past vocabulary", bert("BertProcessing", testThink+1, 0), ""},
		{"roberta sep past vocabulary", bert("RobertaProcessing", 0, 5000), ""},
		{"template past vocabulary", template(5000), ""},
		{"sequence of bert negative", map[string]any{"type": "Sequence", "processors": []any{bert("BertProcessing", -1, 0)}}, "cls"},
	}
	for _, c := range cases {
		for _, cfg := range []string{"", testConfigJSON} {
			_, err := Load(with(c.pp), []byte(cfg))
			if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), c.key) {
				t.Errorf("%s (config %t): err = %v, want ErrMalformed naming %q", c.name, cfg != "", err, c.key)
			}
		}
	}
	// In range: accepted, and EncodeSpecial adds cls before and sep after.
	tok, err := Load(with(bert("RobertaProcessing", testEndOfText, testIMEnd)), nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := tok.EncodeSpecial("he"), []int32{testEndOfText, 257, testIMEnd}; !slices.Equal(got, want) {
		t.Errorf("EncodeSpecial = %v, want %v", got, want)
	}
}

// add_bos_token or add_eos_token alone rebuilds the template with the other one off, as
// transformers 5's TokenizersBackend does (kwargs.get("add_bos_token", False), likewise for EOS,
// then update_post_processor), whatever the post-processor added.
func TestLoadAddBOSEOSAlone(t *testing.T) {
	var doc map[string]any
	if err := json.Unmarshal(testTokenizerJSON(t, PatternQwen2, false, false, nil), &doc); err != nil {
		t.Fatal(err)
	}
	// The post-processor adds <|im_start|> before and <|endoftext|> after.
	doc["post_processor"] = map[string]any{"type": "BertProcessing", "cls": []any{"<|im_start|>", testIMStart}, "sep": []any{"<|endoftext|>", testEndOfText}}
	tj, _ := json.Marshal(doc)
	he := int32(257)
	for _, c := range []struct {
		cfg  string
		want []int32
	}{
		{`{}`, []int32{testIMStart, he, testEndOfText}},
		{`{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_eos_token": true}`, []int32{he, testIMEnd}},
		{`{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": true}`, []int32{testIMStart, he}},
		{`{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": true, "add_eos_token": true}`, []int32{testIMStart, he, testIMEnd}},
	} {
		tok, err := Load(tj, []byte(c.cfg))
		if err != nil {
			t.Fatal(err)
		}
		if got := tok.EncodeSpecial("he"); !slices.Equal(got, c.want) {
			t.Errorf("config %s: EncodeSpecial = %v, want %v", c.cfg, got, c.want)
		}
	}
}

// A Sequence of post-processors applies them in order, each wrapping the encoding the earlier
// ones produced (tokenizers' Sequence::process_encodings): before2 before1 A after1 after2.
func TestLoadPostProcessorSequenceOrder(t *testing.T) {
	var doc map[string]any
	if err := json.Unmarshal(testTokenizerJSON(t, PatternQwen2, false, false, nil), &doc); err != nil {
		t.Fatal(err)
	}
	tmpl := func(before, after int) map[string]any {
		return map[string]any{"type": "TemplateProcessing",
			"single": []any{
				map[string]any{"SpecialToken": map[string]any{"id": "b"}},
				map[string]any{"Sequence": map[string]any{"id": "A"}},
				map[string]any{"SpecialToken": map[string]any{"id": "a"}},
			},
			"special_tokens": map[string]any{"b": map[string]any{"id": "b", "ids": []int{before}}, "a": map[string]any{"id": "a", "ids": []int{after}}}}
	}
	doc["post_processor"] = map[string]any{"type": "Sequence", "processors": []any{
		tmpl(testIMStart, testIMEnd),
		map[string]any{"type": "ByteLevel"},
		map[string]any{"type": "Sequence", "processors": []any{
			tmpl(testEndOfText, testThink),
			map[string]any{"type": "RobertaProcessing", "cls": []any{"x", 0}, "sep": []any{"y", 1}},
		}},
	}}
	tj, _ := json.Marshal(doc)
	tok, err := Load(tj, nil)
	if err != nil {
		t.Fatal(err)
	}
	// 0 and 1 are the byte tokens "!" and "\"", 257 is "he".
	want := []int32{0, testEndOfText, testIMStart, 257, testIMEnd, testThink, 1}
	if got := tok.EncodeSpecial("he"); !slices.Equal(got, want) {
		t.Errorf("EncodeSpecial = %v, want %v", got, want)
	}
}
