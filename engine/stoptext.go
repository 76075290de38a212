package engine

import (
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// stopText turns one sequence's tokens into its output text: streaming-safe UTF-8 through a
// tokenizer.StreamDecoder, stop strings found and cut like vLLM (the stop string and everything
// after it are dropped), and any tail that could still become a stop string held back.
//
// The stop strings are matched by the request's shared automaton (Stops), fed only the bytes
// each token adds: the work per token is proportional to that token's text, whatever the length
// of the output or the number of stop strings. Only the text not emitted yet, and the last
// bytes a stop string could still start in, are kept.
type stopText struct {
	dec       *tokenizer.StreamDecoder
	stops     *Stops
	minTokens int
	state     int32 // the automaton's state after the whole text
	searched  bool  // a push has searched for stop strings (later pushes search only new bytes)
	buf       []byte
	base      int // offset of buf[0] in the output text
	sent      int // bytes of text already emitted
}

func newStopText(tok *tokenizer.Tokenizer, stops *Stops, minTokens int) *stopText {
	t := &stopText{stops: stops, minTokens: minTokens}
	if tok != nil {
		t.dec = tok.NewStreamDecoderWith(tokenizer.DecodeOptions{SkipSpecial: true})
	}
	return t
}

// end returns the length of the output text so far.
func (t *stopText) end() int { return t.base + len(t.buf) }

// push adds the text of the numOut-th output token id (skipText: its text is not part of the
// output, as for EOS and stop token ids) and returns the text that may be emitted now and
// whether a stop string ended the output. Stop strings count only once more than MinTokens
// tokens were generated (vLLM); the first push that counts them also finds one that started in
// the longest stop string's length before its text (and may end there).
func (t *stopText) push(id int32, numOut int, skipText bool) (string, bool) {
	prev := t.end()
	if !skipText && t.dec != nil {
		t.buf = append(t.buf, t.dec.Push(id)...)
	}
	return t.pushed(prev, numOut)
}

// pushed is push after the token's text was appended to the text of length prev.
func (t *stopText) pushed(prev, numOut int) (string, bool) {
	if !t.stops.hasStrings() {
		return t.take(t.end()), false
	}
	if numOut > t.minTokens && t.end() > prev {
		if cut := t.search(prev); cut >= 0 {
			t.buf = t.buf[:cut-t.base]
			return t.take(cut), true
		}
	} else {
		for i := prev - t.base; i < len(t.buf); i++ {
			t.state = t.stops.step(t.state, t.buf[i])
		}
	}
	return t.take(t.end() - int(t.stops.hold[t.state])), false
}

// search reads the text after byte prev and returns the start of the earliest stop string that
// ends in it, or −1. The first search reads again from the longest stop string's length before
// prev, from the root, so that it also finds a stop string that started (or ended) in the text
// read before stop strings counted; that read is long enough to end in the same state as a read
// of the whole text, since a state is a suffix no longer than the longest stop string.
func (t *stopText) search(prev int) int {
	s := t.stops
	from := prev
	if !t.searched {
		t.searched = true
		from, t.state = max(t.base, prev-s.maxLen+1), 0
	}
	cut := -1
	for i := from; i < t.end(); i++ {
		t.state = s.step(t.state, t.buf[i-t.base])
		if m := int(s.match[t.state]); m > 0 && (cut < 0 || i+1-m < cut) {
			cut = i + 1 - m
		}
	}
	return cut
}

// finish returns everything not emitted yet at the end of the stream (held-back text and the
// decoder's incomplete bytes, if the output did not end at a stop string).
func (t *stopText) finish(stopped bool) string {
	if !stopped && t.dec != nil {
		t.buf = append(t.buf, t.dec.Flush()...)
	}
	return t.take(t.end())
}

// take emits text up to byte end and forgets the emitted bytes no later search can read: those
// before both the unsent text and the longest stop string's length from the end.
func (t *stopText) take(end int) string {
	if end <= t.sent {
		return ""
	}
	s := string(t.buf[t.sent-t.base : end-t.base])
	t.sent = end
	maxLen := 0
	if t.stops != nil {
		maxLen = t.stops.maxLen
	}
	if keep := min(t.sent, t.end()-maxLen); keep-t.base > len(t.buf)/2 && keep-t.base >= 64 {
		n := copy(t.buf, t.buf[keep-t.base:])
		t.buf = t.buf[:n]
		t.base = keep
	}
	return s
}
