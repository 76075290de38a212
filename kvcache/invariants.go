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
	var v violations
	inHeap := p.checkFreeHeap(&v)
	inLRU := p.checkLRU(&v)
	hashed := 0
	for i := range p.meta {
		if p.meta[i].hashed {
			hashed++
		}
		p.checkBlock(&v, int32(i), inHeap, inLRU)
	}
	if hashed != len(p.byHash) {
		v.add("%d hashed blocks, prefix cache has %d entries", hashed, len(p.byHash))
	}
	for h, id := range p.byHash {
		if id < 0 || int(id) >= p.n || !p.meta[id].hashed || p.meta[id].hash != h {
			v.add("prefix cache entry %v → block %d does not match the block", h, id)
		}
	}
	return errors.Join(v.errs...)
}

// violations collects the first 20 invariant violations found.
type violations struct{ errs []error }

// add records a violation, unless 20 are recorded already.
func (v *violations) add(format string, args ...any) {
	if len(v.errs) < 20 {
		v.errs = append(v.errs, fmt.Errorf("kvcache: invariant: "+format, args...))
	}
}

// checkFreeHeap checks the free heap's ids and order, and returns how many times each block is
// in it. p.mu must be held.
func (p *Pool) checkFreeHeap(v *violations) []int {
	inHeap := make([]int, p.n)
	for i, id := range p.free {
		if id < 0 || int(id) >= p.n {
			v.add("free heap holds id %d", id)
			continue
		}
		inHeap[id]++
		if i > 0 && p.free[(i-1)/2] > id {
			v.add("free heap order broken at index %d", i)
		}
	}
	return inHeap
}

// checkLRU checks the LRU list's links, tail and length, and returns how many times each block
// is in it. p.mu must be held.
func (p *Pool) checkLRU(v *violations) []int {
	inLRU := make([]int, p.n)
	count, prev := 0, noBlock
	for id := p.lru.head; id != noBlock; id = p.meta[id].next {
		if id < 0 || int(id) >= p.n {
			v.add("LRU list holds id %d", id)
			break
		}
		if count > p.n {
			v.add("LRU list has a cycle")
			break
		}
		inLRU[id]++
		if p.meta[id].prev != prev {
			v.add("LRU block %d: prev %d, want %d", id, p.meta[id].prev, prev)
		}
		prev = id
		count++
	}
	if prev != p.lru.tail {
		v.add("LRU tail %d, last linked block %d", p.lru.tail, prev)
	}
	if count != p.lru.n {
		v.add("LRU length %d, counted %d", p.lru.n, count)
	}
	return inLRU
}

// checkBlock checks block id's reference count, hash, state, and its presence in the free
// containers (inHeap, inLRU: how many times each block is in them). p.mu must be held.
func (p *Pool) checkBlock(v *violations, id int32, inHeap, inLRU []int) {
	m := &p.meta[id]
	if m.ref < 0 {
		v.add("block %d: refcount %d", id, m.ref)
	}
	if m.ref > 0 && m.gen == 0 {
		v.add("block %d: referenced but never allocated", id)
	}
	if m.hashed {
		if !p.prefix {
			v.add("block %d: cached with prefix caching disabled", id)
		}
		if owner, ok := p.byHash[m.hash]; !ok || owner != id {
			v.add("block %d: hash %v maps to block %d (present %v)", id, m.hash, owner, ok)
		}
	} else if m.hash != (BlockHash{}) {
		v.add("block %d: stale hash %v", id, m.hash)
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
		v.add("block %d: state %d, want %d (ref %d, hashed %v)", id, m.state, want, m.ref, m.hashed)
	}
	wantHeap, wantLRU := 0, 0
	switch want {
	case stateFree:
		wantHeap = 1
	case stateCachedFree:
		wantLRU = 1
	}
	if inHeap[id] != wantHeap || inLRU[id] != wantLRU {
		v.add("block %d (ref %d, hashed %v): %d times in the free heap, %d in the LRU list",
			id, m.ref, m.hashed, inHeap[id], inLRU[id])
	}
	if want != stateCachedFree && (m.prev != noBlock || m.next != noBlock) {
		v.add("block %d: LRU links set outside the LRU list", id)
	}
}
