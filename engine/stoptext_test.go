package engine

import (
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// streamText pushes the tokens of text one by one (min tokens minTok) and returns every emitted
// delta, whether a stop string ended it, and the final text.
func streamText(t *testing.T, text string, stops []string, minTok int) (deltas []string, stopped bool, final string) {
	t.Helper()
	tok := tokenizer.Builtin(4096)
	st := newStopText(tok, NewStops(stops, nil), minTok)
	for i, id := range tok.Encode(text) {
		d, stop := st.push(id, i+1, false)
		deltas = append(deltas, d)
		final += d
		if stop {
			return deltas, true, final
		}
	}
	d := st.finish(false)
	return append(deltas, d), false, final + d
}

func TestStopTextCutsAtTheEarliestStop(t *testing.T) {
	_, stopped, got := streamText(t, "Hello world, please stop here and END now", []string{"END", "stop"}, 0)
	if !stopped || got != "Hello world, please " {
		t.Fatalf("got %q stopped=%v", got, stopped)
	}
}

func TestStopTextHoldsBackAPossibleStart(t *testing.T) {
	tok := tokenizer.Builtin(4096)
	st := newStopText(tok, NewStops([]string{"stop!"}, nil), 0)
	var out string
	for i, id := range tok.Encode("a sto") {
		d, stop := st.push(id, i+1, false)
		if stop {
			t.Fatal("stopped early")
		}
		out += d
	}
	if strings.HasSuffix(out, "s") || strings.Contains(out, "sto") {
		t.Fatalf("emitted %q: the start of a stop string must be held back", out)
	}
	if rest := st.finish(false); out+rest != "a sto" {
		t.Fatalf("at the end the held text is released: %q + %q", out, rest)
	}
}

func TestStopTextNoStops(t *testing.T) {
	const text = "plain text, with ümlauts and 漢字"
	deltas, stopped, got := streamText(t, text, nil, 0)
	if stopped || got != text {
		t.Fatalf("got %q", got)
	}
	for _, d := range deltas {
		if !utf8.ValidString(d) {
			t.Fatalf("invalid UTF-8 delta %q", d)
		}
	}
}

func TestStopTextMinTokens(t *testing.T) {
	tok := tokenizer.Builtin(4096)
	ids := tok.Encode("stop and then stop again")
	// A stop string completed within the first min_tokens tokens does not count (vLLM checks
	// only once more than min_tokens tokens exist); a later one does.
	st := newStopText(tok, NewStops([]string{"stop"}, nil), len(tok.Encode("stop and")))
	var out string
	for i, id := range ids {
		d, stop := st.push(id, i+1, false)
		out += d
		if stop {
			break
		}
	}
	if out != "stop and then " {
		t.Fatalf("got %q", out)
	}
}

// naiveStopText is the matcher stopText replaced, kept as the reference of its semantics: after
// every token it searches the text from the longest stop string's length before the new text
// with strings.Index for every stop string, and holds back the longest suffix of the unsent text
// that is a proper prefix of a stop string.
type naiveStopText struct {
	stops     []string
	maxStop   int
	minTokens int
	text      string
	sent      int
}

func newNaiveStopText(stops []string, minTokens int) *naiveStopText {
	t := &naiveStopText{minTokens: minTokens}
	for _, s := range stops {
		if s != "" {
			t.stops = append(t.stops, s)
			t.maxStop = max(t.maxStop, len(s))
		}
	}
	return t
}

func (t *naiveStopText) push(piece string, numOut int) (string, bool) {
	prev := len(t.text)
	t.text += piece
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

func (t *naiveStopText) take(end int) string {
	if end <= t.sent {
		return ""
	}
	s := t.text[t.sent:end]
	t.sent = end
	return s
}

func (t *naiveStopText) heldBack() int {
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

// compareStopText feeds pieces (one per token, "" standing for a token without text) to the
// automaton and to the naive reference and fails at the first differing delta or stop.
func compareStopText(t *testing.T, stops []string, pieces []string, minTokens int) {
	t.Helper()
	got := &stopText{stops: NewStops(stops, nil), minTokens: minTokens}
	want := newNaiveStopText(stops, minTokens)
	for i, p := range pieces {
		prev := got.end()
		got.buf = append(got.buf, p...) // what push appends from the decoder
		gd, gs := got.pushed(prev, i+1)
		wd, ws := want.push(p, i+1)
		if gd != wd || gs != ws {
			t.Fatalf("stops %q, min_tokens %d, pieces %q: token %d: got %q stop=%v, want %q stop=%v",
				stops, minTokens, pieces, i, gd, gs, wd, ws)
		}
		if gs {
			return
		}
	}
	if g, w := got.finish(false), want.take(len(want.text)); g != w {
		t.Fatalf("stops %q, min_tokens %d, pieces %q: finish got %q, want %q", stops, minTokens, pieces, g, w)
	}
}

// randomText returns n bytes over a small alphabet, so that stop strings and their prefixes
// occur often.
func randomText(r *rand.Rand, n int) string {
	const alphabet = "abc"
	b := make([]byte, n)
	for i := range b {
		b[i] = alphabet[r.IntN(len(alphabet))]
	}
	return string(b)
}

// TestStopTextMatchesTheNaiveSearch: on random stop strings (overlapping, nested, repeated,
// long and short), random texts cut into random token pieces (some empty) and random
// min_tokens, the automaton emits exactly what the naive per-token search did, token by token.
func TestStopTextMatchesTheNaiveSearch(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		stops := make([]string, r.IntN(6))
		for i := range stops {
			stops[i] = randomText(r, r.IntN(7))
		}
		text := randomText(r, r.IntN(60))
		var pieces []string
		for len(text) > 0 {
			n := min(len(text), r.IntN(5))
			pieces = append(pieces, text[:n])
			text = text[n:]
		}
		compareStopText(t, stops, pieces, r.IntN(8))
	}
}

// FuzzStopText compares the automaton with the naive search on fuzzed stop strings and text.
func FuzzStopText(f *testing.F) {
	f.Add("ab\x00b", "xxabyyb", uint8(3), uint8(1))
	f.Add("stop\x00stop!", "a stop! there", uint8(2), uint8(0))
	f.Fuzz(func(t *testing.T, stopList, text string, pieceLen, minTokens uint8) {
		stops := strings.Split(stopList, "\x00")
		var pieces []string
		n := int(pieceLen%8) + 1
		for len(text) > 0 {
			k := min(len(text), n)
			pieces = append(pieces, text[:k])
			text = text[k:]
		}
		compareStopText(t, stops, pieces, int(minTokens%16))
	})
}

// TestStopTextKeepsLittleText: a long output without stop strings, or with one that never
// matches, keeps only its unsent tail and the longest stop string's length, not the whole text.
func TestStopTextKeepsLittleText(t *testing.T) {
	for _, stops := range [][]string{nil, {"never"}} {
		st := &stopText{stops: NewStops(stops, nil)}
		for i := range 100000 {
			prev := st.end()
			st.buf = append(st.buf, "token "...)
			st.pushed(prev, i+1)
		}
		if st.end() != 600000 || cap(st.buf) > 4096 {
			t.Fatalf("stops %q: %d bytes of output, %d kept", stops, st.end(), cap(st.buf))
		}
	}
}
