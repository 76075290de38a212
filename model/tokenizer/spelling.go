package tokenizer

// TokenStrings returns the vocabulary spelling of each id, as Hugging Face's
// convert_ids_to_tokens does: the token's key in tokenizer.json's vocab ("Ġthe" for " the" in a
// byte-level vocabulary, "▁the" and "<0x0A>" in a SentencePiece one), an added or special token
// as its content ("<|im_end|>"), "" for an unknown id.
func (t *Tokenizer) TokenStrings(ids []int32) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		if id >= 0 && int(id) < len(t.tokens) && t.tokens[id].ok {
			out[i] = t.tokens[id].piece
		}
	}
	return out
}
