package conversation

import (
	"fmt"
	"math/rand/v2"
	"strings"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// topicWords are the words the user messages are made of: plain English about serving, so that
// the text tokenizes like prose (a few characters per token).
var topicWords = strings.Fields(`the a of and to in is that for on with as by it this from at be are was
cache block token prefill decode transfer memory layer head attention prompt request turn answer
history conversation engine proxy scheduler batch latency throughput bandwidth copy read write
page table pool free evict hash chain prefix suffix model weight matrix vector kernel step queue
client server stream chunk header body json field value time first second minute hour fast slow
long short large small new old same other every each both many few more less most least only
compute reuse pull push send receive hold keep drop move share store load save check verify
because while when after before during until since although however therefore instead also then
network socket port host address buffer arena region descriptor handle notify lease expire renew
producer consumer remote local peer agent backend shared process thread core machine node rack`)

// userMessage returns the text of one user message of about want tokens (at least want, within
// a few), deterministic in (seed, conv, turn): a line naming the turn, then sentences of topic
// words.
func userMessage(tok *tokenizer.Tokenizer, seed uint64, conv, turn, want int) string {
	rng := rand.New(rand.NewPCG(seed, uint64(conv)<<32|uint64(turn)))
	var b strings.Builder
	fmt.Fprintf(&b, "Conversation %d, turn %d. Please consider the following notes and answer briefly.", conv+1, turn+1)
	n := len(tok.Encode(b.String()))
	words, sentenceLen := 0, 0
	for n < want {
		// Words are added in small groups and the text re-encoded: the count is exact, and a
		// message of a few hundred tokens costs a few dozen encodings.
		for range 4 {
			w := topicWords[rng.IntN(len(topicWords))]
			if words == 0 {
				w = strings.ToUpper(w[:1]) + w[1:]
				sentenceLen = 8 + rng.IntN(8)
			}
			b.WriteByte(' ')
			b.WriteString(w)
			if words++; words == sentenceLen {
				b.WriteByte('.')
				words = 0
			}
		}
		n = len(tok.Encode(b.String()))
	}
	s := b.String()
	if !strings.HasSuffix(s, ".") {
		s += "."
	}
	return s
}

// conversationScript is the user side of one conversation: its id and one message per turn.
type conversationScript struct {
	id    string
	users []string
}

// scripts returns the user messages of convs conversations of turns turns.
func scripts(tok *tokenizer.Tokenizer, seed uint64, convs, turns, userTokens int) []conversationScript {
	out := make([]conversationScript, convs)
	for c := range out {
		out[c].id = fmt.Sprintf("conversation-%d-%d", seed, c+1)
		for t := range turns {
			out[c].users = append(out[c].users, userMessage(tok, seed, c, t, userTokens))
		}
	}
	return out
}
