package tokenizer

// StreamDecoder turns a stream of token ids into text deltas that are always complete UTF-8:
// the bytes of a character split across tokens are held back until the character is complete.
// Concatenating every Push result and the final Flush equals Decode of all the ids.
// A StreamDecoder serves one stream and is not safe for concurrent use.
type StreamDecoder struct {
	t       *Tokenizer
	opts    DecodeOptions
	pending []byte // bytes of an incomplete character
}

// NewStreamDecoder returns a decoder for one stream of ids; special tokens decode to their text.
func (t *Tokenizer) NewStreamDecoder() *StreamDecoder {
	return t.NewStreamDecoderWith(DecodeOptions{})
}

// NewStreamDecoderWith returns a stream decoder with options.
func (t *Tokenizer) NewStreamDecoderWith(opts DecodeOptions) *StreamDecoder {
	return &StreamDecoder{t: t, opts: opts}
}

// Push adds one token and returns the text that became complete (possibly "").
func (d *StreamDecoder) Push(id int32) string {
	d.pending = d.t.appendToken(d.pending, id, d.opts)
	if len(d.pending) == 0 {
		return ""
	}
	out, used := appendValid(nil, d.pending, false)
	d.pending = append(d.pending[:0], d.pending[used:]...)
	return string(out)
}

// Flush returns the held bytes of an incomplete character as U+FFFD (or "" if none) and resets
// the decoder; call it at the end of the stream.
func (d *StreamDecoder) Flush() string {
	out := appendLossy(nil, d.pending)
	d.pending = d.pending[:0]
	return string(out)
}

// Pending reports whether bytes of an incomplete character are held back.
func (d *StreamDecoder) Pending() bool { return len(d.pending) > 0 }
