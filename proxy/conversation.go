package proxy

import (
	"container/list"
	"encoding/json"
	"strings"
	"sync"
	"time"
)

// turn is what the multi-turn proxy remembers of a conversation's last turn: D's
// kv_transfer_params and enough of the request and answer to check that the next turn continues
// it exactly.
type turn struct {
	params   map[string]any
	decoder  Instance
	chat     bool
	messages []json.RawMessage // chat: the previous request's messages, canonical JSON
	prompt   string            // completions: the previous prompt
	text     string            // the generated text
	at       time.Time
}

// ConversationCache maps conversation ids to their last turn: single use, a TTL (450 s, below the
// decoder's 480 s block TTL) and a bound on the number of conversations (least recently stored
// first out). Safe for concurrent use.
type ConversationCache struct {
	ttl time.Duration
	max int
	now func() time.Time

	mu      sync.Mutex
	entries map[string]*list.Element // of *cacheEntry
	order   list.List                // front = most recently stored
	stale   int64                    // entries dropped because their TTL passed
	evicted int64                    // entries dropped because the cache was full
}

type cacheEntry struct {
	id string
	t  turn
}

// NewConversationCache returns a cache with the given TTL and capacity (≤ 0: 10,000); now is the
// clock (nil: time.Now).
func NewConversationCache(ttl time.Duration, capacity int, now func() time.Time) *ConversationCache {
	if capacity <= 0 {
		capacity = 10000
	}
	if now == nil {
		now = time.Now
	}
	return &ConversationCache{ttl: ttl, max: capacity, now: now, entries: map[string]*list.Element{}}
}

// put stores conv's last turn, replacing an older one.
func (c *ConversationCache) put(conv string, t turn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t.at = c.now()
	// Entries are ordered by when they were stored and share one TTL, so the stale ones are at
	// the back: drop them here, so that memory stays bounded without anyone calling Sweep.
	for last := c.order.Back(); last != nil && t.at.Sub(last.Value.(*cacheEntry).t.at) >= c.ttl; last = c.order.Back() {
		c.order.Remove(last)
		delete(c.entries, last.Value.(*cacheEntry).id)
		c.stale++
	}
	if e := c.entries[conv]; e != nil {
		e.Value.(*cacheEntry).t = t
		c.order.MoveToFront(e)
		return
	}
	c.entries[conv] = c.order.PushFront(&cacheEntry{id: conv, t: t})
	for c.order.Len() > c.max {
		last := c.order.Back()
		c.order.Remove(last)
		delete(c.entries, last.Value.(*cacheEntry).id)
		c.evicted++
	}
}

// take removes and returns conv's last turn if it is there and fresh.
func (c *ConversationCache) take(conv string) (turn, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[conv]
	if e == nil {
		return turn{}, false
	}
	c.order.Remove(e)
	delete(c.entries, conv)
	t := e.Value.(*cacheEntry).t
	if c.now().Sub(t.at) >= c.ttl {
		c.stale++
		return turn{}, false
	}
	return t, true
}

// Sweep drops stale entries and returns how many conversations are cached and how many entries
// have gone stale so far.
func (c *ConversationCache) Sweep() (cached int, stale int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	for e := c.order.Back(); e != nil; {
		prev := e.Prev()
		if now.Sub(e.Value.(*cacheEntry).t.at) >= c.ttl {
			c.order.Remove(e)
			delete(c.entries, e.Value.(*cacheEntry).id)
			c.stale++
		}
		e = prev
	}
	return c.order.Len(), c.stale
}

// Evicted returns how many conversations were dropped because the cache was full.
func (c *ConversationCache) Evicted() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.evicted
}

// continues reports whether the request b is the exact continuation of t: for chat, its
// messages are t's messages, then the assistant's answer, then at least one new message; for
// completions, its prompt starts with t's prompt followed by the answer (spec §5.6).
func (t turn) continues(b body) bool {
	if t.chat {
		msgs, ok := canonicalMessages(b)
		if !ok || len(msgs) < len(t.messages)+2 {
			return false
		}
		for i, m := range t.messages {
			if string(msgs[i]) != string(m) {
				return false
			}
		}
		var a struct {
			Role    string `json:"role"`
			Content any    `json:"content"`
		}
		if json.Unmarshal(msgs[len(t.messages)], &a) != nil || a.Role != "assistant" {
			return false
		}
		return contentText(a.Content) == t.text
	}
	p, ok := b["prompt"].(string)
	return ok && len(p) > len(t.prompt)+len(t.text) && strings.HasPrefix(p, t.prompt+t.text)
}

// canonicalMessages returns a chat request's messages, each re-encoded canonically (sorted keys).
func canonicalMessages(b body) ([]json.RawMessage, bool) {
	list, ok := b["messages"].([]any)
	if !ok {
		return nil, false
	}
	out := make([]json.RawMessage, len(list))
	for i, m := range list {
		data, err := json.Marshal(m) // maps encode with sorted keys
		if err != nil {
			return nil, false
		}
		out[i] = data
	}
	return out, true
}

// contentText flattens a message content: a string, or a list of {"type":"text","text":…} parts.
func contentText(c any) string {
	switch v := c.(type) {
	case string:
		return v
	case []any:
		var b strings.Builder
		for _, p := range v {
			if m, ok := p.(map[string]any); ok {
				if s, ok := m["text"].(string); ok {
					b.WriteString(s)
				}
			}
		}
		return b.String()
	}
	return ""
}
