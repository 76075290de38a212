package tokenizer

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"strings"
)

// The built-in tokenizer's merges, in Hugging Face merges.txt form (byte-level spelling, one
// "left right" pair per line, highest priority first). They were learned by byte-level BPE
// training on builtin_corpus.txt; regenerate with `go generate` (see builtin_train_test.go).
//
//go:generate go test -run TestBuiltinMergesUpToDate -update-builtin-merges
//go:embed builtin_merges.txt
var builtinMerges string

// Special tokens of the built-in tokenizer (Qwen ChatML names). They take the last three ids.
const (
	EndOfText = "<|endoftext|>"
	IMStart   = "<|im_start|>"
	IMEnd     = "<|im_end|>"
)

// BuiltinMinVocab is the smallest vocabulary Builtin accepts: 256 byte tokens and 3 specials.
const BuiltinMinVocab = 256 + 3

// Builtin returns the deterministic tokenizer of the built-in models (kvbridge/tiny,
// kvbridge/small) with exactly vocabSize ids:
//
//   - ids 0–255 are the 256 bytes, so any text can be encoded;
//   - then as many learned merges as fit (English text encodes at about 4 characters per token
//     with a few thousand ids); ids left over when the merges run out have no token
//     (they decode to nothing and are in UnprintableIDs);
//   - the last three ids are <|endoftext|>, <|im_start|> and <|im_end|>.
//
// Pre-tokenization is Qwen2's. EOSToken is <|im_end|>; there is no BOS; the chat template is
// ChatML. Builtin needs no files and returns equal tokenizers for equal sizes. It panics if
// vocabSize < BuiltinMinVocab (a programming error: the size comes from a built-in config).
func Builtin(vocabSize int) *Tokenizer {
	if vocabSize < BuiltinMinVocab {
		panic(fmt.Sprintf("tokenizer.Builtin: vocabSize %d < %d", vocabSize, BuiltinMinVocab))
	}
	bl := newByteLevel()
	t := &Tokenizer{
		pre:            &splitPre{m: qwenMatcher{maxDigits: 1}},
		dec:            byteLevelDecoder{bl: bl},
		tokens:         make([]tokenInfo, vocabSize),
		vocab:          make(map[string]int32, vocabSize),
		addedByContent: map[string]int32{},
		bosID:          -1,
		eosID:          -1,
	}
	t.bpe.unk = -1
	for b := range 256 {
		t.tokens[b] = tokenInfo{piece: string(bl.toRune[b]), bytes: []byte{byte(b)}, ok: true}
		t.vocab[string(bl.toRune[b])] = int32(b)
		t.bpe.byteIDs[b] = int32(b)
	}
	next, limit := int32(256), int32(vocabSize-3)
	t.bpe.merges = make(map[uint64]merge, limit-next)
	rank := int32(0)
	for line := range strings.Lines(builtinMerges) {
		a, b, ok := strings.Cut(strings.TrimSuffix(line, "\n"), " ")
		ia, okA := t.vocab[a]
		ib, okB := t.vocab[b]
		if !ok || !okA || !okB {
			panic(fmt.Sprintf("tokenizer.Builtin: corrupt builtin_merges.txt line %d: %q", rank+1, line))
		}
		id, exists := t.vocab[a+b]
		if !exists {
			if next == limit {
				break
			}
			id, next = next, next+1
			t.vocab[a+b] = id
			t.tokens[id] = tokenInfo{piece: a + b, bytes: append(append([]byte(nil), t.tokens[ia].bytes...), t.tokens[ib].bytes...), ok: true}
		}
		if _, dup := t.bpe.merges[pairKey(ia, ib)]; !dup {
			t.bpe.merges[pairKey(ia, ib)] = merge{rank: rank, id: id}
		}
		rank++
	}
	var specials []*addedToken
	for i, s := range []string{EndOfText, IMStart, IMEnd} {
		id := int32(vocabSize - 3 + i)
		t.tokens[id] = tokenInfo{piece: s, bytes: []byte(s), ok: true, added: true, special: true}
		t.addedByContent[s] = id
		specials = append(specials, &addedToken{id: id, content: s, special: true})
	}
	t.added = newAddedMatcher(specials)
	t.eosToken = IMEnd
	t.eosID = int32(vocabSize - 1)
	return t
}

// chatMLJinja is ChatML as a Jinja chat template (what ChatML renders).
const chatMLJinja = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}" +
	"{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"

// BuiltinJSON returns Builtin(vocabSize) as the Hugging Face tokenizer.json and
// tokenizer_config.json that Load turns into the same tokenizer (same ids for every text), for
// writing model directories (random checkpoints for benchmarks and tests). It panics as Builtin
// does.
func BuiltinJSON(vocabSize int) (tokenizerJSON, tokenizerConfigJSON []byte) {
	t := Builtin(vocabSize)
	// Replay Builtin's merge list: every line up to the first one whose result has no id left.
	var merges []string
	for line := range strings.Lines(builtinMerges) {
		line = strings.TrimSuffix(line, "\n")
		a, b, _ := strings.Cut(line, " ")
		if _, ok := t.vocab[a+b]; !ok {
			break
		}
		merges = append(merges, line)
	}
	var added []map[string]any
	for i, s := range []string{EndOfText, IMStart, IMEnd} {
		added = append(added, map[string]any{"id": vocabSize - 3 + i, "content": s, "single_word": false,
			"lstrip": false, "rstrip": false, "normalized": false, "special": true})
	}
	byteLevel := map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
	doc := map[string]any{
		"version":        "1.0",
		"added_tokens":   added,
		"normalizer":     nil,
		"pre_tokenizer":  map[string]any{"type": "Sequence", "pretokenizers": []any{map[string]any{"type": "Split", "pattern": map[string]any{"Regex": PatternQwen2}, "behavior": "Isolated", "invert": false}, byteLevel}},
		"post_processor": byteLevel,
		"decoder":        byteLevel,
		"model":          map[string]any{"type": "BPE", "vocab": t.vocab, "merges": merges, "byte_fallback": false, "ignore_merges": false},
	}
	tj, err := json.Marshal(doc)
	if err != nil {
		panic(err) // maps of strings and numbers always marshal
	}
	cfg, err := json.Marshal(map[string]any{"bos_token": nil, "eos_token": IMEnd, "pad_token": EndOfText,
		"add_bos_token": false, "chat_template": chatMLJinja})
	if err != nil {
		panic(err)
	}
	return tj, cfg
}
