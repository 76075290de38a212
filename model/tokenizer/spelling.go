package tokenizer

// TokenStrings returns the vocabulary spelling of each id, as Hugging Face's
// convert_ids_to_tokens does: a byte-level token in the byte-level alphabet ("Ġthe" for
// " the"), an added or special token as its content ("<|im_end|>"), "" for an unknown id.
func (t *Tokenizer) TokenStrings(ids []int32) []string {
	bl := newByteLevel()
	out := make([]string, len(ids))
	for i, id := range ids {
		if id < 0 || int(id) >= len(t.tokens) || !t.tokens[id].ok {
			continue
		}
		if ti := &t.tokens[id]; ti.added {
			out[i] = string(ti.bytes)
		} else {
			out[i] = bl.encode(ti.bytes)
		}
	}
	return out
}
