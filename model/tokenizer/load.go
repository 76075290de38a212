package tokenizer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// maxTokenID bounds ids read from files, so a corrupt id cannot allocate gigabytes.
const maxTokenID = 1 << 24

// tokenizerFile is the part of Hugging Face tokenizer.json this package reads.
type tokenizerFile struct {
	AddedTokens   []addedTokenJSON `json:"added_tokens"`
	Normalizer    json.RawMessage  `json:"normalizer"`
	PreTokenizer  json.RawMessage  `json:"pre_tokenizer"`
	PostProcessor json.RawMessage  `json:"post_processor"`
	Decoder       json.RawMessage  `json:"decoder"`
	Model         struct {
		Type                    string            `json:"type"`
		Vocab                   map[string]int64  `json:"vocab"`
		Merges                  []json.RawMessage `json:"merges"`
		UnkToken                *string           `json:"unk_token"`
		FuseUnk                 bool              `json:"fuse_unk"`
		ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
		EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
		IgnoreMerges            bool              `json:"ignore_merges"`
		ByteFallback            bool              `json:"byte_fallback"`
	} `json:"model"`
}

// addedTokenJSON is one added token in tokenizer.json or tokenizer_config.json.
type addedTokenJSON struct {
	ID         int64  `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Special    bool   `json:"special"`
	Normalized *bool  `json:"normalized"`
}

// configFile is the part of tokenizer_config.json this package reads.
type configFile struct {
	BOSToken           json.RawMessage           `json:"bos_token"`
	EOSToken           json.RawMessage           `json:"eos_token"`
	AddBOSToken        *bool                     `json:"add_bos_token"`
	AddEOSToken        *bool                     `json:"add_eos_token"`
	ChatTemplate       json.RawMessage           `json:"chat_template"`
	AddedTokensDecoder map[string]addedTokenJSON `json:"added_tokens_decoder"`
}

// isNull reports whether raw is absent or JSON null.
func isNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || string(t) == "null"
}

// Load builds a Tokenizer from the contents of a Hugging Face tokenizer.json and, optionally
// (nil or empty), tokenizer_config.json. It supports BPE models, byte-level (a ByteLevel
// pre-tokenizer step) or character-level with byte_fallback, unk_token and fuse_unk
// (SentencePiece-style); the normalizers NFC, NFD, NFKC, NFKD, Lowercase, Strip, Replace, Prepend
// and Sequence; the pre-tokenizers ByteLevel, Split (Regex or String), Digits, Metaspace and
// Sequence; added tokens (normalized or not); ignore_merges; the post-processors
// TemplateProcessing, ByteLevel, Bert/RobertaProcessing and Sequence; and the decoders ByteLevel,
// Metaspace, Replace, ByteFallback, Fuse, Strip and Sequence. From the config it reads bos_token,
// eos_token, add_bos_token and add_eos_token (which, as in transformers, replace the
// post-processor's template), chat_template and added_tokens_decoder.
func Load(tokenizerJSON, tokenizerConfigJSON []byte) (*Tokenizer, error) {
	var f tokenizerFile
	if err := json.Unmarshal(tokenizerJSON, &f); err != nil {
		return nil, fmt.Errorf("%w: tokenizer.json: %w", ErrMalformed, err)
	}
	var cfg configFile
	if len(bytes.TrimSpace(tokenizerConfigJSON)) > 0 {
		if err := json.Unmarshal(tokenizerConfigJSON, &cfg); err != nil {
			return nil, fmt.Errorf("%w: tokenizer_config.json: %w", ErrMalformed, err)
		}
	}
	if err := checkSupported(&f); err != nil {
		return nil, err
	}
	norm, err := parseNormalizer(f.Normalizer)
	if err != nil {
		return nil, err
	}
	pre, byteLevelSeen, err := parsePreTokenizer(f.PreTokenizer)
	if err != nil {
		return nil, err
	}
	bl := newByteLevel()
	dec, err := parseDecoder(f.Decoder, bl)
	if err != nil {
		return nil, err
	}
	special, err := parsePostProcessor(f.PostProcessor)
	if err != nil {
		return nil, err
	}

	t := &Tokenizer{
		norm:           norm,
		pre:            pre,
		dec:            dec,
		special:        special,
		vocab:          make(map[string]int32, len(f.Model.Vocab)),
		addedByContent: map[string]int32{},
		bosID:          -1,
		eosID:          -1,
	}
	t.bpe.ignoreMerges = f.Model.IgnoreMerges
	t.bpe.unk = -1
	t.bpe.charLevel = !byteLevelSeen
	t.bpe.byteFallback = f.Model.ByteFallback
	t.bpe.fuseUnk = f.Model.FuseUnk
	if err := t.loadVocab(bl, f.Model.Vocab); err != nil {
		return nil, err
	}
	if err := t.loadMerges(f.Model.Merges); err != nil {
		return nil, err
	}
	if f.Model.UnkToken != nil {
		if id, ok := t.vocab[*f.Model.UnkToken]; ok {
			t.bpe.unk = id
		}
	}

	// Added tokens: tokenizer.json first, then any only listed in tokenizer_config.json.
	added := f.AddedTokens
	seen := map[int64]bool{}
	for _, a := range added {
		seen[a.ID] = true
	}
	var extra []addedTokenJSON
	for key, a := range cfg.AddedTokensDecoder {
		id, err := strconv.ParseInt(key, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%w: tokenizer_config.json: added_tokens_decoder key %q", ErrMalformed, key)
		}
		if !seen[id] {
			a.ID = id
			extra = append(extra, a)
		}
	}
	sort.Slice(extra, func(i, j int) bool { return extra[i].ID < extra[j].ID })
	if err := t.loadAdded(append(added, extra...)); err != nil {
		return nil, err
	}
	if err := t.loadSpecialConfig(&cfg); err != nil {
		return nil, err
	}
	t.streamBytes()
	return t, nil
}

// streamBytes sets each vocabulary token's bytes as it decodes after another token: byte-level
// tokens their bytes; character-level ones through the decoders (▁ a space, <0xXX> its byte).
func (t *Tokenizer) streamBytes() {
	if !t.bpe.charLevel {
		return
	}
	_, hasFallback := t.dec.(byteFallbackDecoder)
	if seq, ok := t.dec.(decoders); ok {
		for _, d := range seq {
			if _, ok := d.(byteFallbackDecoder); ok {
				hasFallback = true
			}
		}
	}
	for id := range t.tokens {
		ti := &t.tokens[id]
		if !ti.ok || ti.added {
			continue
		}
		if b, ok := fallbackByte(ti.piece); ok && hasFallback {
			ti.bytes = []byte{b}
			continue
		}
		if t.dec == nil {
			ti.bytes = []byte(" " + ti.piece)
			continue
		}
		// Decoded behind a plain character, so no step treats it as the start of the text.
		ti.bytes = []byte(strings.Join(t.dec.chain([]string{"x", ti.piece}), "")[1:])
	}
}

// checkSupported rejects tokenizer.json features this package cannot honour.
func checkSupported(f *tokenizerFile) error {
	switch f.Model.Type {
	case "BPE":
	case "":
		if f.Model.Vocab == nil || f.Model.Merges == nil {
			return fmt.Errorf("%w: model has no type and no BPE vocab/merges", ErrUnsupported)
		}
	default:
		return fmt.Errorf("%w: model type %q (only BPE)", ErrUnsupported, f.Model.Type)
	}
	if p := f.Model.ContinuingSubwordPrefix; p != nil && *p != "" {
		return fmt.Errorf("%w: continuing_subword_prefix %q", ErrUnsupported, *p)
	}
	if s := f.Model.EndOfWordSuffix; s != nil && *s != "" {
		return fmt.Errorf("%w: end_of_word_suffix %q", ErrUnsupported, *s)
	}
	return nil
}

// parsePreTokenizer builds the pre-tokenizer and reports whether a ByteLevel step is present.
func parsePreTokenizer(raw json.RawMessage) (preTokenizer, bool, error) {
	if isNull(raw) {
		return nil, false, nil
	}
	var p struct {
		Type           string            `json:"type"`
		Pretokenizers  []json.RawMessage `json:"pretokenizers"`
		AddPrefixSpace *bool             `json:"add_prefix_space"`
		UseRegex       *bool             `json:"use_regex"`
		Pattern        struct {
			Regex  *string `json:"Regex"`
			String *string `json:"String"`
		} `json:"pattern"`
		Behavior         string `json:"behavior"`
		Invert           bool   `json:"invert"`
		IndividualDigits bool   `json:"individual_digits"`
		Replacement      string `json:"replacement"`
		PrependScheme    string `json:"prepend_scheme"`
		Split            *bool  `json:"split"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, false, fmt.Errorf("%w: pre_tokenizer: %w", ErrMalformed, err)
	}
	switch p.Type {
	case "Sequence":
		var seq sequencePre
		byteLevel := false
		for _, sub := range p.Pretokenizers {
			pt, bl, err := parsePreTokenizer(sub)
			if err != nil {
				return nil, false, err
			}
			byteLevel = byteLevel || bl
			if pt != nil {
				seq = append(seq, pt)
			}
		}
		if len(seq) == 1 {
			return seq[0], byteLevel, nil
		}
		return seq, byteLevel, nil
	case "ByteLevel":
		bl := byteLevelPre{addPrefixSpace: true, useRegex: true}
		if p.AddPrefixSpace != nil {
			bl.addPrefixSpace = *p.AddPrefixSpace
		}
		if p.UseRegex != nil {
			bl.useRegex = *p.UseRegex
		}
		if !bl.addPrefixSpace && !bl.useRegex {
			return nil, true, nil // identity: the byte mapping is implicit
		}
		return bl, true, nil
	case "Split":
		behavior, err := parseBehavior(p.Behavior)
		if err != nil {
			return nil, false, err
		}
		sp := &splitPre{behavior: behavior, invert: p.Invert}
		switch {
		case p.Pattern.Regex != nil:
			if sp.m, err = newMatcher(*p.Pattern.Regex); err != nil {
				return nil, false, err
			}
		case p.Pattern.String != nil:
			sp.m = stringMatcher{lit: *p.Pattern.String}
		default:
			return nil, false, fmt.Errorf("%w: Split pre-tokenizer without a pattern", ErrMalformed)
		}
		return sp, false, nil
	case "Digits":
		return digitsPre{individual: p.IndividualDigits}, false, nil
	case "Metaspace":
		scheme, err := parsePrependScheme(p.PrependScheme, p.AddPrefixSpace)
		if err != nil {
			return nil, false, err
		}
		r, err := singleRune("Metaspace replacement", p.Replacement, '▁')
		if err != nil {
			return nil, false, err
		}
		return metaspacePre{replacement: string(r), scheme: scheme, split_: p.Split == nil || *p.Split}, false, nil
	}
	return nil, false, fmt.Errorf("%w: pre-tokenizer %q", ErrUnsupported, p.Type)
}

// growTokens makes sure id has a slot in t.tokens.
func (t *Tokenizer) growTokens(id int64) error {
	if id < 0 || id >= maxTokenID {
		return fmt.Errorf("%w: token id %d out of range", ErrMalformed, id)
	}
	if int(id) >= len(t.tokens) {
		t.tokens = append(t.tokens, make([]tokenInfo, int(id)+1-len(t.tokens))...)
	}
	return nil
}

// loadVocab fills the vocabulary and the single-byte tokens.
func (t *Tokenizer) loadVocab(bl *byteLevel, vocab map[string]int64) error {
	if len(vocab) == 0 {
		return fmt.Errorf("%w: empty vocab", ErrMalformed)
	}
	t.bpe.byBytes = make(map[string]int32, len(vocab))
	for s, id := range vocab {
		if err := t.growTokens(id); err != nil {
			return fmt.Errorf("vocab %q: %w", s, err)
		}
		if t.tokens[id].ok {
			return fmt.Errorf("%w: vocab id %d used twice", ErrMalformed, id)
		}
		b := []byte(s)
		if !t.bpe.charLevel {
			b, _ = bl.decode(s)
		}
		t.tokens[id] = tokenInfo{piece: s, bytes: b, ok: true}
		t.vocab[s] = int32(id)
		t.bpe.byBytes[string(b)] = int32(id)
	}
	for b := range 256 {
		t.bpe.byteIDs[b], t.bpe.fallbackIDs[b] = -1, -1
		if id, ok := t.vocab[string(bl.toRune[b])]; ok && !t.bpe.charLevel {
			t.bpe.byteIDs[b] = id
		}
		if id, ok := t.vocab[fmt.Sprintf("<0x%02X>", b)]; ok && t.bpe.charLevel {
			t.bpe.fallbackIDs[b] = id
		}
	}
	return nil
}

// loadMerges reads merges in either form: "a b" strings or ["a", "b"] pairs.
func (t *Tokenizer) loadMerges(raw []json.RawMessage) error {
	t.bpe.merges = make(map[uint64]merge, len(raw))
	for rank, m := range raw {
		var a, b string
		var pair []string
		if m = bytes.TrimSpace(m); len(m) > 0 && m[0] == '"' {
			var s string
			if err := json.Unmarshal(m, &s); err != nil {
				return fmt.Errorf("%w: merge %d: %w", ErrMalformed, rank, err)
			}
			var ok bool
			if a, b, ok = strings.Cut(s, " "); !ok || strings.Contains(b, " ") {
				return fmt.Errorf("%w: merge %d %q is not two tokens", ErrMalformed, rank, s)
			}
		} else if err := json.Unmarshal(m, &pair); err != nil || len(pair) != 2 {
			return fmt.Errorf("%w: merge %d %s is neither \"a b\" nor [a, b]", ErrMalformed, rank, m)
		} else {
			a, b = pair[0], pair[1]
		}
		ia, okA := t.vocab[a]
		ib, okB := t.vocab[b]
		im, okM := t.vocab[a+b]
		if !okA || !okB || !okM {
			return fmt.Errorf("%w: merge %d (%q, %q) uses a token not in the vocab", ErrMalformed, rank, a, b)
		}
		k := pairKey(ia, ib)
		if _, dup := t.bpe.merges[k]; !dup {
			t.bpe.merges[k] = merge{rank: int32(rank), id: im}
		}
	}
	return nil
}

// loadAdded registers added tokens; they decode to their content verbatim.
func (t *Tokenizer) loadAdded(added []addedTokenJSON) error {
	var raw, normalized []*addedToken
	for _, a := range added {
		if err := t.growTokens(a.ID); err != nil {
			return fmt.Errorf("added token %q: %w", a.Content, err)
		}
		id := int32(a.ID)
		t.tokens[id] = tokenInfo{piece: a.Content, bytes: []byte(a.Content), ok: true, added: true, special: a.Special}
		t.addedByContent[a.Content] = id
		tok := &addedToken{id: id, content: a.Content, special: a.Special, lstrip: a.LStrip, rstrip: a.RStrip, singleWord: a.SingleWord}
		// Hugging Face matches normalized added tokens in the normalized text, by their
		// normalized content; by default special tokens are not normalized, others are.
		if a.Normalized == nil && !a.Special || a.Normalized != nil && *a.Normalized {
			if t.norm != nil {
				tok.content = t.norm.normalize(a.Content)
			}
			normalized = append(normalized, tok)
			continue
		}
		raw = append(raw, tok)
	}
	t.added = newAddedMatcher(raw)
	if len(normalized) > 0 {
		t.addedN = newAddedMatcher(normalized)
	}
	return nil
}

// tokenContent reads a token given as a string, an {"content": ...} object, or null.
func tokenContent(raw json.RawMessage) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var obj struct {
		Content string `json:"content"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil {
		return "", err
	}
	return obj.Content, nil
}

// chatTemplateSource reads chat_template given as a string or a list of {name, template}
// (the one named "default" wins, else the first).
func chatTemplateSource(raw json.RawMessage) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var list []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return "", err
	}
	for _, e := range list {
		if e.Name == "default" {
			return e.Template, nil
		}
	}
	if len(list) > 0 {
		return list[0].Template, nil
	}
	return "", nil
}

// loadSpecialConfig reads BOS/EOS, add_bos_token and add_eos_token (which replace the
// post-processor's template, as transformers' update_post_processor does) and the chat template.
func (t *Tokenizer) loadSpecialConfig(cfg *configFile) error {
	var err error
	if t.bosToken, err = tokenContent(cfg.BOSToken); err != nil {
		return fmt.Errorf("%w: tokenizer_config.json bos_token: %w", ErrMalformed, err)
	}
	if t.eosToken, err = tokenContent(cfg.EOSToken); err != nil {
		return fmt.Errorf("%w: tokenizer_config.json eos_token: %w", ErrMalformed, err)
	}
	if t.chatTemplate, err = chatTemplateSource(cfg.ChatTemplate); err != nil {
		return fmt.Errorf("%w: tokenizer_config.json chat_template: %w", ErrMalformed, err)
	}
	// Checked before the template's first id names the BOS token below.
	for _, id := range append(append([]int32(nil), t.special.before...), t.special.after...) {
		if id < 0 || int(id) >= len(t.tokens) || !t.tokens[id].ok {
			return fmt.Errorf("%w: post_processor adds token id %d, which is not in the vocabulary", ErrMalformed, id)
		}
	}
	if t.bosToken == "" && len(t.special.before) > 0 {
		t.bosToken = t.tokens[t.special.before[0]].piece // the template's first special token
	}
	if id, ok := t.TokenID(t.bosToken); ok && t.bosToken != "" {
		t.bosID = id
	}
	if id, ok := t.TokenID(t.eosToken); ok && t.eosToken != "" {
		t.eosID = id
	}
	// Either key rebuilds the template from both, a missing one counting as false: transformers
	// 5's TokenizersBackend reads kwargs.get("add_bos_token", False) and likewise for EOS, and
	// rebuilds the post-processor when either is given (transformers 4 instead used per-class
	// defaults, such as LlamaTokenizerFast's add_bos_token=True).
	if cfg.AddBOSToken != nil || cfg.AddEOSToken != nil {
		t.special = template{}
		if cfg.AddBOSToken != nil && *cfg.AddBOSToken && t.bosID >= 0 {
			t.special.before = []int32{t.bosID}
		}
		if cfg.AddEOSToken != nil && *cfg.AddEOSToken && t.eosID >= 0 {
			t.special.after = []int32{t.eosID}
		}
	}
	return nil
}
