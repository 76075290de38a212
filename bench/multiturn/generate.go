package multiturn

import (
	"fmt"
	"math/rand/v2"
	"slices"
)

// BasePrompt is the instruction every generated user message carries before its filler text.
const BasePrompt = "Please rewrite the following text and add more content: "

// maxGenTokens bounds any single sampled token count, so an uncapped heavy-tailed distribution
// (zipf, lognormal) fails with a message instead of building a gigantic prompt.
const maxGenTokens = 1 << 20

// Generated is the result of Generate.
type Generated struct {
	Conversations []Conversation
	// CorpusTokens is the number of tokens of the filler text; Wrapped reports that the
	// requested token counts needed more text than that, so text was reused from the start.
	CorpusTokens int
	Wrapped      bool
}

// Generate builds cfg.NumConversations synthetic conversations from text, drawing every random
// value from a PCG source seeded with seed. The rules are vLLM's:
//
//   - a conversation has max(num_turns, 2) messages, rounded up to an even number;
//   - one common-prefix length is drawn for all conversations; its text (the first tokens of
//     the filler, ending in ".") starts the first user message of every conversation;
//   - user message i of conversation n starts with "<n> is a nice number... "; the first one
//     then gets "<n>, " and the conversation's own prefix text (prefix_num_tokens tokens, taken
//     from a part of the text no other conversation uses);
//   - then comes BasePrompt and filler text up to the drawn num_tokens (the common prefix and
//     the "nice number" line count towards it, the per-conversation prefix does not);
//   - assistant messages are the first output num_tokens tokens of the text (only their length
//     matters: it becomes the request's max_tokens and min_tokens).
//
// Conversation ids are CONV_ID_<n>.
func Generate(cfg *GenConfig, text string, tc *TokenCounter, seed int64) (*Generated, error) {
	rng := rand.New(rand.NewPCG(uint64(seed), uint64(seed)^0x6d756c7469747572))
	k := tc.newCorpus(text)
	if k.n == 0 {
		return nil, fmt.Errorf("%w: text_files: the text is empty", ErrConfig)
	}
	g := &Generated{CorpusTokens: k.n}
	take := func(start, count int) string {
		if start+count > k.n {
			g.Wrapped = true
		}
		return k.text(start, count)
	}
	check := func(key string, vals []int) error {
		for _, v := range vals {
			if v > maxGenTokens {
				return configErr(key, fmt.Sprintf("drew %d, more than the %d this generator accepts; set \"max\"", v, maxGenTokens))
			}
		}
		return nil
	}
	baseTokens := tc.Count(BasePrompt)

	n := cfg.NumConversations
	turns := cfg.NumTurns.Sample(rng, n)
	if err := check("prompt_input.num_turns", turns); err != nil {
		return nil, err
	}
	for i, t := range turns {
		t = max(t, 2)
		turns[i] = t + t%2
	}
	prefixes := cfg.PrefixNumTokens.Sample(rng, n)
	if err := check("prompt_input.prefix_num_tokens", prefixes); err != nil {
		return nil, err
	}
	base := 0 // offset of unused text: moves on so conversations share as little text as possible
	common := cfg.CommonPrefixNumTokens.Sample(rng, 1)[0]
	if err := check("prompt_input.common_prefix_num_tokens", []int{common}); err != nil {
		return nil, err
	}
	commonText := ""
	if common > 0 {
		commonText = take(0, max(common-2, 0)) + "."
		base += common
	}

	for c := range n {
		nt := turns[c]
		in := cfg.InputNumTokens.Sample(rng, nt)
		out := cfg.OutputNumTokens.Sample(rng, nt)
		if err := check("prompt_input.num_tokens", in); err != nil {
			return nil, err
		}
		if err := check("prompt_output.num_tokens", out); err != nil {
			return nil, err
		}
		for i := range in {
			in[i] = max(in[i], baseTokens)
			out[i] = max(out[i], 1)
		}
		maxIn := slices.Max(in)
		msgs := make([]Message, 0, nt)
		for t := range nt {
			if t%2 == 1 {
				msgs = append(msgs, Message{Role: "assistant", Content: take(0, out[t])})
				continue
			}
			content := fmt.Sprintf("%d is a nice number... ", c)
			if t == 0 && commonText != "" {
				content = commonText + content
			}
			left := in[t] - tc.Count(content)
			if t == 0 && prefixes[c] > 0 {
				content += fmt.Sprintf("%d, ", c) + take(base, prefixes[c])
				base += prefixes[c]
			}
			content += BasePrompt
			left -= baseTokens
			if left > 0 {
				content += take(base+t*maxIn, left)
			}
			msgs = append(msgs, Message{Role: "user", Content: content})
		}
		g.Conversations = append(g.Conversations, Conversation{ID: fmt.Sprintf("CONV_ID_%d", c), Messages: msgs})
		base += nt
	}
	return g, nil
}
