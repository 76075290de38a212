package proxy

import (
	"container/list"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"strings"
	"sync"
	"time"
)

// turn is what the multi-turn proxy remembers of a conversation's last turn: D's
// kv_transfer_params and digests of the request and answer, enough to check that the next turn
// continues it exactly. The client's JSON itself is not kept: an entry's size does not grow with
// what a client chooses to send.
type turn struct {
	params  map[string]any
	sealed  []byte // the params as the store keeps them (seal.go); params is then nil
	decoder Instance
	chat    bool
	// prefixLen and prefix describe what the next request must start with. Chat: the number of
	// the previous request's messages and the digest of their canonical JSON, followed by an
	// assistant message whose text has the digest answer. Completions: the byte length of the
	// previous prompt followed by the answer, and its digest.
	prefixLen int
	prefix    [sha256.Size]byte
	answer    [sha256.Size]byte
	at        time.Time
	size      int64 // bytes accounted for the entry
}

// newChatTurn remembers a chat turn: the request's messages and the answer's text.
func newChatTurn(params map[string]any, decoder Instance, msgs []json.RawMessage, answer string) turn {
	return turn{params: params, decoder: decoder, chat: true, prefixLen: len(msgs), prefix: digestMessages(msgs),
		answer: sha256.Sum256([]byte(answer))}
}

// newCompletionTurn remembers a completions turn: the prompt and the answer's text.
func newCompletionTurn(params map[string]any, decoder Instance, prompt, answer string) turn {
	h := sha256.New()
	h.Write([]byte(prompt))
	h.Write([]byte(answer))
	t := turn{params: params, decoder: decoder, prefixLen: len(prompt) + len(answer)}
	h.Sum(t.prefix[:0])
	return t
}

// digestMessages is the SHA-256 of canonical messages, each prefixed by its length.
func digestMessages(msgs []json.RawMessage) [sha256.Size]byte {
	h := sha256.New()
	var n [8]byte
	for _, m := range msgs {
		binary.LittleEndian.PutUint64(n[:], uint64(len(m)))
		h.Write(n[:])
		h.Write(m)
	}
	var d [sha256.Size]byte
	h.Sum(d[:0])
	return d
}

// ConversationCache maps conversation ids to their last turn: single use, a TTL (450 s, below the
// decoder's 480 s block TTL) and two bounds, on the number of conversations and on the bytes
// their entries take (least recently stored first out). Safe for concurrent use.
type ConversationCache struct {
	ttl      time.Duration
	max      int
	maxBytes int64
	now      func() time.Time

	mu      sync.Mutex
	entries map[string]*list.Element // of *cacheEntry
	order   list.List                // front = most recently stored
	bytes   int64                    // sum of the entries' sizes
	stale   int64                    // entries dropped because their TTL passed
	evicted int64                    // entries dropped because the cache was full
}

type cacheEntry struct {
	id string
	t  turn
}

// Cache bounds applied when the configured ones are zero.
const (
	// DefaultMaxConversations bounds the number of cached conversations.
	DefaultMaxConversations = 10000
	// DefaultMaxConversationBytes bounds the bytes of the cached conversations.
	DefaultMaxConversationBytes = 64 << 20
	// DefaultConversationTTL is how long a conversation's D params stay usable: below the
	// decoder's decoder_kv_blocks_ttl (480 s) less the 5 s within which P declines a pull.
	DefaultConversationTTL = 450 * time.Second
	// entryOverhead is what an entry costs beside its id and params (digests, list and map).
	entryOverhead = 256
)

// NewConversationCache returns a cache with the given TTL and bounds (≤ 0:
// DefaultMaxConversations conversations, DefaultMaxConversationBytes bytes); now is the clock
// (nil: time.Now).
func NewConversationCache(ttl time.Duration, capacity int, maxBytes int64, now func() time.Time) *ConversationCache {
	if capacity <= 0 {
		capacity = DefaultMaxConversations
	}
	if maxBytes <= 0 {
		maxBytes = DefaultMaxConversationBytes
	}
	if now == nil {
		now = time.Now
	}
	return &ConversationCache{ttl: ttl, max: capacity, maxBytes: maxBytes, now: now, entries: map[string]*list.Element{}}
}

// putTurn stores conv's last turn, replacing an older one.
func (c *ConversationCache) putTurn(conv string, t turn) {
	size := int64(len(conv) + entryOverhead)
	size += int64(len(t.sealed))
	if t.params != nil {
		if b, err := json.Marshal(t.params); err == nil {
			size += int64(len(b))
		}
	}
	t.size = size
	c.mu.Lock()
	defer c.mu.Unlock()
	t.at = c.now()
	// Entries are ordered by when they were stored and share one TTL, so the stale ones are at
	// the back: drop them here, so that memory stays bounded without anyone calling Sweep.
	for last := c.order.Back(); last != nil && t.at.Sub(last.Value.(*cacheEntry).t.at) >= c.ttl; last = c.order.Back() {
		c.remove(last)
		c.stale++
	}
	if e := c.entries[conv]; e != nil {
		c.remove(e)
	}
	c.entries[conv] = c.order.PushFront(&cacheEntry{id: conv, t: t})
	c.bytes += size
	for c.order.Len() > c.max || (c.bytes > c.maxBytes && c.order.Len() > 0) {
		c.remove(c.order.Back())
		c.evicted++
	}
}

// remove drops entry e. c.mu must be held.
func (c *ConversationCache) remove(e *list.Element) {
	ce := e.Value.(*cacheEntry)
	c.order.Remove(e)
	delete(c.entries, ce.id)
	c.bytes -= ce.t.size
}

// takeTurn removes and returns conv's last turn if it is there and fresh.
func (c *ConversationCache) takeTurn(conv string) (turn, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[conv]
	if e == nil {
		return turn{}, false
	}
	c.remove(e)
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
			c.remove(e)
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

// Bytes returns the bytes the cached conversations take, as the byte bound counts them.
func (c *ConversationCache) Bytes() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.bytes
}

// continues reports whether the request b is the exact continuation of t: for chat, its
// messages are t's messages, then the assistant's answer, then at least one new message; for
// completions, its prompt starts with t's prompt followed by the answer (docs/architecture.md,
// wire contract item 38).
func (t turn) continues(b body) bool {
	if t.chat {
		msgs, ok := canonicalMessages(b)
		if !ok || len(msgs) < t.prefixLen+2 || digestMessages(msgs[:t.prefixLen]) != t.prefix {
			return false
		}
		var a struct {
			Role    string `json:"role"`
			Content any    `json:"content"`
		}
		if json.Unmarshal(msgs[t.prefixLen], &a) != nil || a.Role != "assistant" {
			return false
		}
		return sha256.Sum256([]byte(contentText(a.Content))) == t.answer
	}
	p, ok := b["prompt"].(string)
	return ok && len(p) > t.prefixLen && sha256.Sum256([]byte(p[:t.prefixLen])) == t.prefix
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
