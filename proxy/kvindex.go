package proxy

import (
	"sync"
	"sync/atomic"
)

// The KV index: per event source (an engine, or one data-parallel rank of it), the set of block
// hashes it announced as cached and has not removed since, as vLLM's KV cache events give them
// (the external uint64 hash). It is a plain state machine: the subscribers (kvsub.go) feed it,
// the router (route.go) asks it for the longest cached prefix of a request's chain.

// DefaultKVIndexBlocks is Config.KVIndexBlocks's default: the most block hashes the index keeps
// per event source (beyond it the oldest stored go first). 4 Mi blocks of 16 tokens cover 64 Mi
// tokens of one engine's cache, far beyond a GPU's; the state costs about 45 bytes a block
// (TestKVIndexBytesPerBlock).
const DefaultKVIndexBlocks = 4 << 20

// kvSource is the index's state for one event source. Its blocks are a map from hash to the
// stamp of its store, and a FIFO of (hash, stamp) in store order for eviction beyond the cap: an
// entry of the FIFO whose stamp no longer matches the map's was removed or stored again since,
// and is skipped; the FIFO is compacted when such entries outnumber live ones.
type kvSource struct {
	mu        sync.RWMutex
	blocks    map[uint64]uint64
	fifo      []stampedHash
	head      int // first live position of fifo
	stamp     uint64
	blockSize int  // the block_size of the last BlockStored (0 before any)
	stale     bool // events were lost and not replayed: the set may hold what is gone and lack what is there
	// evicted counts hashes dropped because of the cap; resets counts resets.
	evicted, resets atomic.Uint64
}

type stampedHash struct{ hash, stamp uint64 }

// kvIndex is the index of every source. Sources are fixed at construction; engine maps each
// source to the engine (prefiller position) it belongs to.
type kvIndex struct {
	max     int
	sources []*kvSource
	engine  []int // source → engine
	engines int
}

// newKVIndex returns an index of sources, source i belonging to engine owner[i] (< engines),
// each bounded to maxBlocks hashes.
func newKVIndex(owner []int, engines, maxBlocks int) *kvIndex {
	ix := &kvIndex{max: maxBlocks, engine: owner, engines: engines}
	for range owner {
		ix.sources = append(ix.sources, &kvSource{blocks: map[uint64]uint64{}})
	}
	return ix
}

// store records hashes as cached by source src, announced with blockSize.
func (ix *kvIndex) store(src int, hashes []uint64, blockSize int) {
	s := ix.sources[src]
	s.mu.Lock()
	defer s.mu.Unlock()
	if blockSize > 0 {
		s.blockSize = blockSize
	}
	for _, h := range hashes {
		s.stamp++
		s.blocks[h] = s.stamp
		s.fifo = append(s.fifo, stampedHash{h, s.stamp})
	}
	for len(s.blocks) > ix.max {
		e := s.fifo[s.head]
		s.head++
		if st, ok := s.blocks[e.hash]; ok && st == e.stamp {
			delete(s.blocks, e.hash)
			s.evicted.Add(1)
		}
	}
	s.compact()
}

// remove records hashes as no longer cached by source src.
func (ix *kvIndex) remove(src int, hashes []uint64) {
	s := ix.sources[src]
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, h := range hashes {
		delete(s.blocks, h)
	}
	s.compact()
}

// compact drops the FIFO's dead entries once they outnumber the live ones. s.mu is held.
func (s *kvSource) compact() {
	if len(s.fifo) <= 2*len(s.blocks)+1024 {
		return
	}
	live := make([]stampedHash, 0, len(s.blocks)+len(s.blocks)/4)
	for _, e := range s.fifo[s.head:] {
		if st, ok := s.blocks[e.hash]; ok && st == e.stamp {
			live = append(live, e)
		}
	}
	s.fifo, s.head = live, 0
}

// reset empties source src (AllBlocksCleared, or a new incarnation of the engine) and clears
// its staleness: what it announces from now on is all it holds.
func (ix *kvIndex) reset(src int) {
	s := ix.sources[src]
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.blocks)
	s.fifo, s.head, s.stale = nil, 0, false
	s.resets.Add(1)
}

// setStale marks source src as missing events (or not).
func (ix *kvIndex) setStale(src int, stale bool) {
	s := ix.sources[src]
	s.mu.Lock()
	s.stale = stale
	s.mu.Unlock()
}

// isStale reports whether source src missed events.
func (ix *kvIndex) isStale(src int) bool {
	s := ix.sources[src]
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.stale
}

// resetEngine resets every source of engine e.
func (ix *kvIndex) resetEngine(e int) {
	for i, owner := range ix.engine {
		if owner == e {
			ix.reset(i)
		}
	}
}

// len returns the number of hashes source src holds.
func (ix *kvIndex) len(src int) int {
	s := ix.sources[src]
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.blocks)
}

// blockSize returns the block size the sources announce (the first known), 0 before any store.
func (ix *kvIndex) blockSize() int {
	for _, s := range ix.sources {
		s.mu.RLock()
		bs := s.blockSize
		s.mu.RUnlock()
		if bs > 0 {
			return bs
		}
	}
	return 0
}

// prefixMatch is what the index knows of one engine for one request.
type prefixMatch struct {
	blocks int  // consecutive blocks of the chain cached from block 0 (the best of its sources)
	stale  bool // one of its sources is stale
}

// longestPrefix returns, per engine, how many consecutive blocks of chain, from block 0, one of
// its sources holds.
func (ix *kvIndex) longestPrefix(chain []uint64) []prefixMatch {
	out := make([]prefixMatch, ix.engines)
	for i, s := range ix.sources {
		m := &out[ix.engine[i]]
		s.mu.RLock()
		n := 0
		for n < len(chain) {
			if _, ok := s.blocks[chain[n]]; !ok {
				break
			}
			n++
		}
		m.stale = m.stale || s.stale
		s.mu.RUnlock()
		m.blocks = max(m.blocks, n)
	}
	return out
}
