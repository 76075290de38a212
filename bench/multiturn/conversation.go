package multiturn

import (
	"encoding/json"
	"fmt"
	"os"
)

// Message is one chat message.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Conversation is one conversation of the benchmark: user and assistant messages alternating,
// starting with a user message. Assistant messages of the input only set the answer length
// (max_tokens/min_tokens); during the run they are replaced by the server's answers.
type Conversation struct {
	ID       string    `json:"id"`
	Messages []Message `json:"messages"`
}

// clone returns a deep copy (the run edits messages in place).
func (c Conversation) clone() Conversation {
	c.Messages = append([]Message(nil), c.Messages...)
	return c
}

// ParseShareGPT parses a ShareGPT-style list: [{"id": "…", "messages": [{"role": "user",
// "content": "…"}, {"role": "assistant", "content": "…"}, …]}, …]. Ids must be unique strings;
// every conversation needs at least one message, and roles must alternate user, assistant, user…
// (each request ends with a user message). Errors wrap ErrConfig and name the item.
func ParseShareGPT(data []byte) ([]Conversation, error) {
	var items []map[string]json.RawMessage
	if err := json.Unmarshal(data, &items); err != nil {
		return nil, fmt.Errorf("%w: ShareGPT list: %w", ErrConfig, err)
	}
	seen := make(map[string]int, len(items))
	out := make([]Conversation, 0, len(items))
	for i, it := range items {
		where := fmt.Sprintf("[%d]", i)
		if it == nil {
			return nil, configErr(where, "must be an object with \"id\" and \"messages\"")
		}
		var c Conversation
		raw, ok := it["id"]
		if !ok {
			return nil, configErr(where+".id", "missing")
		}
		if err := json.Unmarshal(raw, &c.ID); err != nil {
			return nil, configErr(where+".id", "must be a string, got "+string(raw))
		}
		where = fmt.Sprintf("[%d] (id %q)", i, c.ID)
		if j, dup := seen[c.ID]; dup {
			return nil, configErr(where+".id", fmt.Sprintf("duplicate of item [%d]", j))
		}
		seen[c.ID] = i
		raw, ok = it["messages"]
		if !ok {
			return nil, configErr(where+".messages", "missing")
		}
		if err := json.Unmarshal(raw, &c.Messages); err != nil || c.Messages == nil {
			return nil, configErr(where+".messages", "must be a list of {\"role\", \"content\"} objects")
		}
		if len(c.Messages) == 0 {
			return nil, configErr(where+".messages", "conversation with no messages")
		}
		for j, m := range c.Messages {
			want := "user"
			if j%2 == 1 {
				want = "assistant"
			}
			if m.Role != want {
				return nil, configErr(fmt.Sprintf("%s.messages[%d].role", where, j), fmt.Sprintf("is %q, want %q (roles must alternate user, assistant, …)", m.Role, want))
			}
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, configErr("(top level)", "the ShareGPT list is empty")
	}
	return out, nil
}

// WriteConversations writes conversations as a ShareGPT-style list (the --output-file format).
func WriteConversations(path string, convs []Conversation) error {
	if convs == nil {
		convs = []Conversation{}
	}
	b, err := json.MarshalIndent(convs, "", "    ")
	if err != nil {
		return fmt.Errorf("encoding conversations: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing conversations: %w", err)
	}
	return nil
}
