// Package tokenizer implements BPE tokenization for kvbridge: Hugging Face tokenizer.json files —
// byte-level BPE (Qwen2/Qwen3, Llama 3, GPT-2 style) and SentencePiece-style BPE with
// byte_fallback (Llama 2, Mistral) — with their normalizers, pre-tokenizers, post-processors and
// decoders, the deterministic built-in tokenizer of the kvbridge/tiny and kvbridge/small models,
// streaming-safe decoding, and chat templates (ChatML built in, Jinja templates through
// github.com/ardanlabs/jinja). Token ids agree with Hugging Face's tokenizers library (the tests
// check them against ids it produced for real tokenizer files).
//
// A Tokenizer is immutable once built and safe for concurrent use.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package tokenizer

import (
	"errors"
	"slices"
	"strings"
)

// Sentinel errors; the errors returned by this package wrap one of them.
var (
	// ErrMalformed means tokenizer.json or tokenizer_config.json could not be parsed or is
	// inconsistent (a merge of unknown tokens, a duplicate id).
	ErrMalformed = errors.New("tokenizer: malformed tokenizer file")
	// ErrUnsupported means the file is well formed but uses a feature this package does not
	// implement (a non-BPE model, an unknown pre-tokenizer, a regex regexp2 cannot compile).
	ErrUnsupported = errors.New("tokenizer: unsupported tokenizer feature")
	// ErrChatTemplate means a chat template failed to compile or render.
	ErrChatTemplate = errors.New("tokenizer: chat template")
)

// Tokenizer converts text to token ids and back.
type Tokenizer struct {
	bpe     bpeModel
	norm    normalizer    // nil: none
	pre     preTokenizer  // nil: each plain stretch is one piece
	added   *addedMatcher // added tokens matched in the raw text (normalized: false), split out first
	addedN  *addedMatcher // added tokens matched in normalized text (normalized: true); nil if none
	dec     decodeStep    // nil: tokens joined with spaces
	special template      // what EncodeSpecial adds (the post-processor)
	tokens  []tokenInfo   // by id; holes have ok == false

	vocab          map[string]int32 // vocabulary spelling (byte-level alphabet) → id
	addedByContent map[string]int32 // added token content → id

	bosToken, eosToken string
	bosID, eosID       int32  // -1 if none
	chatTemplate       string // the Jinja source from tokenizer_config.json, "" if none
}

// tokenInfo is what decoding needs to know about one id.
type tokenInfo struct {
	piece   string // the token as the decoder sees it: vocabulary spelling or added content
	bytes   []byte // the bytes it decodes to after another token (an added token's content verbatim)
	ok      bool   // the id exists
	added   bool   // an added token (matched verbatim in text)
	special bool   // an added token marked special
}

// DecodeOptions adjusts decoding.
type DecodeOptions struct {
	// SkipSpecial drops special tokens instead of decoding them to their text.
	SkipSpecial bool
}

// Encode returns the token ids of text without special tokens (Hugging Face's encode with
// add_special_tokens=False): added and special tokens written in text (such as "<|im_start|>")
// are recognised and become their ids, every other stretch is normalized, pre-tokenized and
// BPE-encoded. Any byte sequence can be encoded; invalid UTF-8 is encoded byte by byte.
func (t *Tokenizer) Encode(text string) []int32 {
	ids := make([]int32, 0, len(text)/3+4)
	var segBuf [16]segment
	segs := t.added.split(text, segBuf[:0])
	pieces := make([]string, 0, 64)
	var sub []segment
	for i, seg := range segs {
		if seg.tok != nil {
			ids = append(ids, seg.tok.id)
			continue
		}
		s := seg.text
		if t.norm != nil {
			s = t.norm.normalize(s)
		}
		atStart := i == 0
		if t.addedN == nil {
			ids, pieces = t.encodeStretch(s, atStart, ids, pieces)
			continue
		}
		sub = t.addedN.split(s, sub[:0])
		for j, ss := range sub {
			if ss.tok != nil {
				ids = append(ids, ss.tok.id)
				continue
			}
			ids, pieces = t.encodeStretch(ss.text, atStart && j == 0, ids, pieces)
		}
	}
	return ids
}

// encodeStretch pre-tokenizes and BPE-encodes normalized text s, appending to ids; atStart says
// s begins the input. pieces is scratch space, returned for reuse.
func (t *Tokenizer) encodeStretch(s string, atStart bool, ids []int32, pieces []string) ([]int32, []string) {
	if t.pre == nil {
		return t.bpe.encodePiece(s, ids), pieces
	}
	one := [1]string{s}
	pieces = t.pre.split(one[:], pieces[:0], atStart)
	for _, p := range pieces {
		ids = t.bpe.encodePiece(p, ids)
	}
	return ids, pieces
}

// EncodeSpecial is Encode with the special tokens the tokenizer's post-processor adds around a
// sequence (Hugging Face's encode with add_special_tokens=True, vLLM's default for completion
// prompts): Llama's <|begin_of_text|> or <s>, nothing for Qwen.
func (t *Tokenizer) EncodeSpecial(text string) []int32 {
	ids := t.Encode(text)
	if len(t.special.before)+len(t.special.after) == 0 {
		return ids
	}
	out := make([]int32, 0, len(t.special.before)+len(ids)+len(t.special.after))
	out = append(append(append(out, t.special.before...), ids...), t.special.after...)
	return out
}

// Decode returns the text of ids as Hugging Face's decode does: the tokens (special ones as
// their text) through the tokenizer's decoders — for byte-level BPE the bytes, with invalid UTF-8
// as U+FFFD (one per maximal invalid subsequence, as Rust's String::from_utf8_lossy); for
// SentencePiece-style BPE ▁ as spaces, <0xXX> runs as their bytes, the leading space of the text
// stripped. Ids outside the vocabulary are skipped.
func (t *Tokenizer) Decode(ids []int32) string { return t.DecodeWith(ids, DecodeOptions{}) }

// DecodeWith is Decode with options.
func (t *Tokenizer) DecodeWith(ids []int32, opts DecodeOptions) string {
	pieces := make([]string, 0, len(ids))
	for _, id := range ids {
		if id < 0 || int(id) >= len(t.tokens) {
			continue
		}
		ti := &t.tokens[id]
		if ti.ok && !(opts.SkipSpecial && ti.special) {
			pieces = append(pieces, ti.piece)
		}
	}
	if t.dec == nil {
		return strings.Join(pieces, " ")
	}
	return strings.Join(t.dec.chain(pieces), "")
}

// appendToken appends the bytes of id to b, honouring opts.
func (t *Tokenizer) appendToken(b []byte, id int32, opts DecodeOptions) []byte {
	if id < 0 || int(id) >= len(t.tokens) {
		return b
	}
	ti := &t.tokens[id]
	if !ti.ok || (opts.SkipSpecial && ti.special) {
		return b
	}
	return append(b, ti.bytes...)
}

// VocabSize returns one more than the largest token id (vocabulary and added tokens). A model's
// embedding table may be larger (padded); ids past VocabSize decode to nothing.
func (t *Tokenizer) VocabSize() int { return len(t.tokens) }

// TokenID returns the id of an added or special token given its content ("<|im_end|>"), or of a
// vocabulary token given its spelling in the vocabulary (byte-level alphabet: "Ġthe" for " the").
func (t *Tokenizer) TokenID(s string) (int32, bool) {
	if id, ok := t.addedByContent[s]; ok {
		return id, true
	}
	id, ok := t.vocab[s]
	return id, ok
}

// TokenBytes returns the bytes id decodes to (nil for an unknown id). The slice is a copy.
func (t *Tokenizer) TokenBytes(id int32) []byte {
	if id < 0 || int(id) >= len(t.tokens) || !t.tokens[id].ok {
		return nil
	}
	return slices.Clone(t.tokens[id].bytes)
}

// IsSpecial reports whether id is a special token (an added token marked special).
func (t *Tokenizer) IsSpecial(id int32) bool {
	return id >= 0 && int(id) < len(t.tokens) && t.tokens[id].special
}

// SpecialIDs returns the ids of all special tokens, ascending.
func (t *Tokenizer) SpecialIDs() []int32 {
	var ids []int32
	for id := range t.tokens {
		if t.tokens[id].special {
			ids = append(ids, int32(id))
		}
	}
	return ids
}

// BOSToken returns the beginning-of-sequence token text ("" if none).
func (t *Tokenizer) BOSToken() string { return t.bosToken }

// EOSToken returns the end-of-sequence token text ("" if none).
func (t *Tokenizer) EOSToken() string { return t.eosToken }

// BOSTokenID returns the id of the BOS token, if the tokenizer has one.
func (t *Tokenizer) BOSTokenID() (int32, bool) { return t.bosID, t.bosID >= 0 }

// EOSTokenID returns the id of the EOS token, if the tokenizer has one.
func (t *Tokenizer) EOSTokenID() (int32, bool) { return t.eosID, t.eosID >= 0 }

// AddBOS reports whether EncodeSpecial starts with the BOS token (a TemplateProcessing
// post-processor that starts with it, or tokenizer_config.json's add_bos_token).
func (t *Tokenizer) AddBOS() bool {
	return t.bosID >= 0 && len(t.special.before) > 0 && t.special.before[0] == t.bosID
}

// ChatTemplateSource returns the Jinja chat template from tokenizer_config.json ("" if none).
func (t *Tokenizer) ChatTemplateSource() string { return t.chatTemplate }

// ChatTemplate returns the tokenizer's chat template: the parsed Jinja template from
// tokenizer_config.json, or ChatML if there is none.
func (t *Tokenizer) ChatTemplate() (ChatTemplate, error) {
	if t.chatTemplate == "" {
		return ChatML(), nil
	}
	return ParseChatTemplate(t.chatTemplate, t.bosToken, t.eosToken)
}
