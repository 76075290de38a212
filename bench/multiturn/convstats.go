package multiturn

import (
	"fmt"
	"io"
	"strings"

	"github.com/kvbridge/kvbridge/stats"
)

// WriteConversationStats prints statistics of the conversations (the generator's print_stats):
// per conversation its turn count and mean user and assistant message tokens, and the prompt
// tokens of every request it implies (history included).
func WriteConversationStats(w io.Writer, convs []Conversation, tc *TokenCounter) error {
	var turns, user, assistant, request []float64
	for _, c := range convs {
		var u, a []float64
		total := 0
		for _, m := range c.Messages {
			n := tc.Count(m.Content)
			total += n
			if m.Role == "user" {
				u = append(u, float64(n))
				request = append(request, float64(total))
			} else {
				a = append(a, float64(n))
			}
		}
		turns = append(turns, float64(len(c.Messages)))
		user = append(user, stats.Mean(u))
		assistant = append(assistant, stats.Mean(a))
	}
	qs := []float64{0.25, 0.5, 0.75, 0.9, 0.99}
	var b strings.Builder
	b.WriteString(separator + "\nConversations statistics:\n" + separator + "\n")
	writeStatTableRows(&b, []string{"conversation_turns", "user_tokens", "assistant_tokens"},
		[]Stat{Describe(turns, qs), Describe(user, qs), Describe(assistant, qs)})
	b.WriteString(separator + "\nRequest statistics:\n" + separator + "\n")
	writeStatTableRows(&b, []string{"request_tokens"}, []Stat{Describe(request, qs)})
	b.WriteString(separator + "\n")
	_, err := io.WriteString(w, b.String())
	if err != nil {
		return fmt.Errorf("writing conversation statistics: %w", err)
	}
	return nil
}
