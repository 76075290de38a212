package engine

import (
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
	st := newStopText(tok, stops, minTok)
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
	st := newStopText(tok, []string{"stop!"}, 0)
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
	st := newStopText(tok, []string{"stop"}, len(tok.Encode("stop and")))
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
