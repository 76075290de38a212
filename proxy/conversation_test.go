package proxy

import (
	"strconv"
	"testing"
	"time"
)

// TestConversationCacheDropsStaleOnPut: stale conversations leave the cache when new ones are
// stored, without anyone calling Sweep (the proxy's memory stays bounded when /health is never
// polled).
func TestConversationCacheDropsStaleOnPut(t *testing.T) {
	now := time.Unix(1000, 0)
	c := NewConversationCache(time.Minute, 0, 0, func() time.Time { return now })
	for i := range 100 {
		c.putTurn(strconv.Itoa(i), turn{prefixLen: 1})
	}
	now = now.Add(2 * time.Minute)
	c.putTurn("fresh", turn{})
	if n, stale := c.Sweep(); n != 1 || stale != 100 {
		t.Errorf("after a put past the TTL: %d cached, %d stale; want 1 and 100", n, stale)
	}
	if _, ok := c.takeTurn("fresh"); !ok {
		t.Error("the fresh conversation is gone")
	}
}
