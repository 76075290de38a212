package kvcache

import (
	"errors"
	"fmt"
)

// CheckInvariants verifies the pool's bookkeeping and returns every violation found (nil when
// consistent): reference counts agree with states, every free block is in exactly one free
// container, the LRU list is well linked, and the prefix cache maps each hash to the one block
// carrying it. Tests call it after every operation; it is O(NumBlocks).
func (p *Pool) CheckInvariants() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	bad := func(format string, args ...any) {
		if len(errs) < 20 {
			errs = append(errs, fmt.Errorf("kvcache: invariant: "+format, args...))
		}
	}
	inHeap := make([]int, p.n)
	for i, id := range p.free {
		if id < 0 || int(id) >= p.n {
			bad("free heap holds id %d", id)
			continue
		}
		inHeap[id]++
		if i > 0 && p.free[(i-1)/2] > id {
			bad("free heap order broken at index %d", i)
		}
	}
	inLRU := make([]int, p.n)
	count, prev := 0, noBlock
	for id := p.lru.head; id != noBlock; id = p.meta[id].next {
		if id < 0 || int(id) >= p.n {
			bad("LRU list holds id %d", id)
			break
		}
		if count > p.n {
			bad("LRU list has a cycle")
			break
		}
		inLRU[id]++
		if p.meta[id].prev != prev {
			bad("LRU block %d: prev %d, want %d", id, p.meta[id].prev, prev)
		}
		prev = id
		count++
	}
	if prev != p.lru.tail {
		bad("LRU tail %d, last linked block %d", p.lru.tail, prev)
	}
	if count != p.lru.n {
		bad("LRU length %d, counted %d", p.lru.n, count)
	}
	hashed := 0
	for i := range p.meta {
		m := &p.meta[i]
		id := int32(i)
		if m.ref < 0 {
			bad("block %d: refcount %d", id, m.ref)
		}
		if m.ref > 0 && m.gen == 0 {
			bad("block %d: referenced but never allocated", id)
		}
		if m.hashed {
			hashed++
			if !p.prefix {
				bad("block %d: cached with prefix caching disabled", id)
			}
			if owner, ok := p.byHash[m.hash]; !ok || owner != id {
				bad("block %d: hash %v maps to block %d (present %v)", id, m.hash, owner, ok)
			}
		} else if m.hash != (BlockHash{}) {
			bad("block %d: stale hash %v", id, m.hash)
		}
		var want blockState
		switch {
		case m.ref > 0:
			want = stateUsed
		case m.hashed:
			want = stateCachedFree
		default:
			want = stateFree
		}
		if m.state != want {
			bad("block %d: state %d, want %d (ref %d, hashed %v)", id, m.state, want, m.ref, m.hashed)
		}
		wantHeap, wantLRU := 0, 0
		switch want {
		case stateFree:
			wantHeap = 1
		case stateCachedFree:
			wantLRU = 1
		}
		if inHeap[id] != wantHeap || inLRU[id] != wantLRU {
			bad("block %d (ref %d, hashed %v): %d times in the free heap, %d in the LRU list",
				id, m.ref, m.hashed, inHeap[id], inLRU[id])
		}
		if want != stateCachedFree && (m.prev != noBlock || m.next != noBlock) {
			bad("block %d: LRU links set outside the LRU list", id)
		}
	}
	if hashed != len(p.byHash) {
		bad("%d hashed blocks, prefix cache has %d entries", hashed, len(p.byHash))
	}
	for h, id := range p.byHash {
		if id < 0 || int(id) >= p.n || !p.meta[id].hashed || p.meta[id].hash != h {
			bad("prefix cache entry %v → block %d does not match the block", h, id)
		}
	}
	return errors.Join(errs...)
}
