package kvcache

import "testing"

// TestCheckInvariantsDetects corrupts a healthy pool in several ways and expects the checker to
// notice each one, so that a passing random walk means something.
func TestCheckInvariantsDetects(t *testing.T) {
	corruptions := map[string]func(p *Pool){
		"negative refcount":   func(p *Pool) { p.meta[5].ref = -1 },
		"used block in heap":  func(p *Pool) { p.meta[p.free[0]].ref = 1; p.meta[p.free[0]].gen = 1 },
		"lost free block":     func(p *Pool) { p.free = p.free[:len(p.free)-1] },
		"duplicate in heap":   func(p *Pool) { p.free = append(p.free, p.free[len(p.free)-1]) },
		"heap order":          func(p *Pool) { p.free[0], p.free[len(p.free)-1] = p.free[len(p.free)-1], p.free[0] },
		"bad heap id":         func(p *Pool) { p.free = append(p.free, 1000) },
		"stale hash":          func(p *Pool) { p.meta[0].hash[0] = 1 },
		"orphan map entry":    func(p *Pool) { p.byHash[BlockHash{9}] = 3 },
		"hash not in map":     func(p *Pool) { delete(p.byHash, p.meta[0].hash) },
		"lru length":          func(p *Pool) { p.lru.n++ },
		"lru prev link":       func(p *Pool) { p.meta[p.lru.tail].prev = noBlock },
		"lru tail":            func(p *Pool) { p.lru.tail = noBlock },
		"links outside lru":   func(p *Pool) { p.meta[0].next = 2 },
		"cached free in heap": func(p *Pool) { p.meta[p.free[0]].hashed = true },
		"referenced never allocated": func(p *Pool) {
			p.meta[0].gen = 0
		},
		"hash with prefix caching off": func(p *Pool) { p.prefix = false },
		"lru cycle": func(p *Pool) {
			p.meta[p.lru.tail].next = p.lru.head
		},
	}
	for name, corrupt := range corruptions {
		p := newTestPool(t, tinyGeo, 8, true)
		hs := ChainHashes(seqTokens(16, 1), 4)
		ids := cachedRequest(t, p, hs) // blocks 0..3 cached
		_ = p.Free(ids[2:]...)         // 2 and 3 cached free (LRU), 0 and 1 in use, 4..7 in the heap
		checkPool(t, p)
		corrupt(p)
		if err := p.CheckInvariants(); err == nil {
			t.Errorf("%s: not detected", name)
		}
	}
}
