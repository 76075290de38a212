package engine

import (
	"strings"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// stopText turns one request's tokens into its output text: streaming-safe UTF-8 through a
// tokenizer.StreamDecoder, stop strings found and cut like vLLM (the stop string and everything
// after it are dropped), and any tail that could still become a stop string held back.
type stopText struct {
	dec       *tokenizer.StreamDecoder
	stops     []string
	maxStop   int
	minTokens int
	text      string // output text so far (cut at a stop string)
	sent      int    // bytes of text already emitted
}

func newStopText(tok *tokenizer.Tokenizer, stops []string, minTokens int) *stopText {
	t := &stopText{stops: stops, minTokens: minTokens}
	if tok != nil {
		t.dec = tok.NewStreamDecoderWith(tokenizer.DecodeOptions{SkipSpecial: true})
	}
	for _, s := range stops {
		t.maxStop = max(t.maxStop, len(s))
	}
	return t
}

// push adds the text of the numOut-th output token id (skipText: its text is not part of the
// output, as for EOS and stop token ids) and returns the text that may be emitted now and
// whether a stop string ended the output. Stop strings count only once more than MinTokens
// tokens were generated (vLLM).
func (t *stopText) push(id int32, numOut int, skipText bool) (string, bool) {
	prev := len(t.text)
	if !skipText && t.dec != nil {
		t.text += t.dec.Push(id)
	}
	if len(t.stops) > 0 && numOut > t.minTokens && len(t.text) > prev {
		from := max(0, prev-t.maxStop+1)
		cut := -1
		for _, s := range t.stops {
			if i := strings.Index(t.text[from:], s); i >= 0 && (cut < 0 || from+i < cut) {
				cut = from + i
			}
		}
		if cut >= 0 {
			t.text = t.text[:cut]
			return t.take(len(t.text)), true
		}
	}
	return t.take(len(t.text) - t.heldBack()), false
}

// finish returns everything not emitted yet at the end of the stream (held-back text and the
// decoder's incomplete bytes, if the output did not end at a stop string).
func (t *stopText) finish(stopped bool) string {
	if !stopped && t.dec != nil {
		t.text += t.dec.Flush()
	}
	return t.take(len(t.text))
}

// take emits text up to byte end.
func (t *stopText) take(end int) string {
	if end <= t.sent {
		return ""
	}
	s := t.text[t.sent:end]
	t.sent = end
	return s
}

// heldBack returns the length of the longest suffix of the unsent text that is a proper prefix
// of a stop string (it may yet complete one).
func (t *stopText) heldBack() int {
	best := 0
	tail := t.text[t.sent:]
	for _, s := range t.stops {
		for n := min(len(s)-1, len(tail)); n > best; n-- {
			if strings.HasSuffix(tail, s[:n]) {
				best = n
				break
			}
		}
	}
	return best
}
