package kvcache

import (
	"errors"
	"slices"
	"testing"
)

// cachedRequest allocates len(hashes) blocks, caches each under its hash and returns the ids.
func cachedRequest(t *testing.T, p *Pool, hashes []BlockHash) []int32 {
	t.Helper()
	ids, err := p.Allocate(len(hashes))
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range hashes {
		if err := p.Cache(ids[i], h); err != nil {
			t.Fatal(err)
		}
	}
	return ids
}

func TestMatchPrefix(t *testing.T) {
	p := newTestPool(t, tinyGeo, 10, true)
	a := seqTokens(16, 1)
	ha := ChainHashes(a, 4)
	ids := cachedRequest(t, p, ha[:3])

	if m := p.Match(nil); m != nil {
		t.Fatalf("Match(nil) = %v", m)
	}
	// Full chain: the three cached blocks, in order; the fourth is a miss.
	m := p.Match(ha)
	if !slices.Equal(m, ids) || p.Lookup(ha) != 3 {
		t.Fatalf("Match = %v, want %v; Lookup %d", m, ids, p.Lookup(ha))
	}
	// A chain diverging at block 1 matches block 0 only; a chain with a new block 0 matches nothing.
	b := slices.Clone(a)
	b[5]++
	if mb := p.Match(ChainHashes(b, 4)); !slices.Equal(mb, ids[:1]) {
		t.Fatalf("diverging chain matched %v", mb)
	} else {
		m = append(m, mb...)
	}
	c := slices.Clone(a)
	c[0]++
	if mc := p.Match(ChainHashes(c, 4)); mc != nil || p.Lookup(ChainHashes(c, 4)) != 0 {
		t.Fatalf("chain with a different block 0 matched %v", mc)
	}
	checkPool(t, p)
	_ = p.Free(ids...)
	_ = p.Free(m...)
	checkAllFree(t, p)
	if p.NumCached() != 3 {
		t.Fatalf("%d cached blocks after freeing, want 3 (cached free blocks stay matchable)", p.NumCached())
	}
	// Matching a cached free block takes it out of the free list.
	m = p.Match(ha)
	if len(m) != 3 || p.NumFree() != 7 {
		t.Fatalf("match of free cached blocks: %v, free %d", m, p.NumFree())
	}
	checkPool(t, p)
	_ = p.Free(m...)
	checkAllFree(t, p)
}

func TestCacheRules(t *testing.T) {
	p := newTestPool(t, tinyGeo, 4, true)
	h1 := NextHash(BlockHash{}, []int32{1})
	h2 := NextHash(BlockHash{}, []int32{2})
	ids, _ := p.Allocate(2)
	if err := p.Cache(ids[0], h1); err != nil {
		t.Fatal(err)
	}
	if err := p.Cache(ids[0], h1); err != nil { // idempotent
		t.Fatal(err)
	}
	if err := p.Cache(ids[0], h2); !errors.Is(err, ErrHashConflict) {
		t.Fatalf("recache under another hash: %v", err)
	}
	// Another block with an already cached hash: no-op, the first block keeps the hash.
	if err := p.Cache(ids[1], h1); err != nil {
		t.Fatal(err)
	}
	if p.NumCached() != 1 || !slices.Equal(p.Match([]BlockHash{h1}), ids[:1]) {
		t.Fatal("duplicate hash replaced the cached block")
	}
	_ = p.Free(ids[0])
	if err := p.Cache(3, h2); !errors.Is(err, ErrNotAllocated) {
		t.Fatalf("cache of a free block: %v", err)
	}
	if err := p.Cache(4, h2); !errors.Is(err, ErrBadBlock) {
		t.Fatalf("cache of a bad block: %v", err)
	}
	checkPool(t, p)
	_ = p.Free(ids...)
	checkAllFree(t, p)
}

func TestPrefixCachingDisabled(t *testing.T) {
	p := newTestPool(t, tinyGeo, 4, false)
	hs := ChainHashes(seqTokens(8, 3), 4)
	ids, _ := p.Allocate(2)
	for i, h := range hs {
		if err := p.Cache(ids[i], h); err != nil {
			t.Fatal(err)
		}
	}
	if m := p.Match(hs); m != nil || p.Lookup(hs) != 0 || p.NumCached() != 0 {
		t.Fatalf("disabled prefix cache matched %v", m)
	}
	_ = p.Free(ids...)
	checkAllFree(t, p)
}

func TestLRUReuseOrder(t *testing.T) {
	p := newTestPool(t, tinyGeo, 6, true)
	chainA := ChainHashes(seqTokens(12, 1), 4)
	chainB := ChainHashes(seqTokens(8, 2), 4)
	a := cachedRequest(t, p, chainA) // blocks 0,1,2
	b := cachedRequest(t, p, chainB) // blocks 3,4
	_ = p.Free(a...)                 // freed in reverse: 2, 1, 0
	_ = p.Free(b...)                 // then 4, 3
	if p.NumFree() != 6 || p.NumCached() != 5 {
		t.Fatalf("free %d cached %d", p.NumFree(), p.NumCached())
	}
	// The uncached block 5 goes first, then cached ones, least recently freed first.
	var order []int32
	for range 6 {
		id, err := p.Allocate(1)
		if err != nil {
			t.Fatal(err)
		}
		order = append(order, id[0])
		checkPool(t, p)
	}
	if want := []int32{5, 2, 1, 0, 4, 3}; !slices.Equal(order, want) {
		t.Fatalf("reuse order %v, want %v", order, want)
	}
	if p.NumCached() != 0 {
		t.Fatalf("%d hashes left after every cached block was reused", p.NumCached())
	}
	_ = p.Free(order...)
	checkAllFree(t, p)

	// Reusing the tail of a chain leaves its head matchable.
	a = cachedRequest(t, p, chainA)
	_ = p.Free(a...)
	filler, _ := p.Allocate(4) // 3 uncached, then the least recently freed cached block: chainA's tail
	if p.Lookup(chainA) != 2 {
		t.Fatalf("after evicting the tail, %d of chain A matchable, want 2", p.Lookup(chainA))
	}
	_ = p.Free(filler...)
	checkAllFree(t, p)
}

func TestMatchRefreshesLRU(t *testing.T) {
	p := newTestPool(t, tinyGeo, 2, true)
	h := ChainHashes(seqTokens(8, 5), 4)
	ids := cachedRequest(t, p, h[:1])
	ids = append(ids, cachedRequest(t, p, []BlockHash{NextHash(BlockHash{}, []int32{42})})...)
	_ = p.Free(ids[0])
	_ = p.Free(ids[1]) // LRU: ids[0], ids[1]
	m := p.Match(h[:1])
	_ = p.Free(m...) // ids[0] is now the most recently freed
	got, _ := p.Allocate(1)
	if got[0] != ids[1] {
		t.Fatalf("reused %d, want the least recently freed %d", got[0], ids[1])
	}
	_ = p.Free(got...)
	checkAllFree(t, p)
}

func TestEvict(t *testing.T) {
	p := newTestPool(t, tinyGeo, 4, true)
	hs := ChainHashes(seqTokens(12, 7), 4)
	ids := cachedRequest(t, p, hs)
	_ = p.Free(ids[2]) // block 2 cached and free; 0 and 1 in use
	if err := p.Evict(ids[1], ids[2], 3, 99); !errors.Is(err, ErrBadBlock) {
		t.Fatalf("Evict with a bad id: %v", err)
	}
	checkPool(t, p)
	if p.Lookup(hs) != 1 || p.NumCached() != 1 {
		t.Fatalf("after evicting blocks 1 and 2: lookup %d cached %d", p.Lookup(hs), p.NumCached())
	}
	// The in-use evicted block keeps its reference; the free one is an ordinary free block now.
	if p.NumFree() != 2 {
		t.Fatalf("free %d", p.NumFree())
	}
	if err := p.Free(ids[1]); err != nil {
		t.Fatal(err)
	}
	// Evicted blocks can be cached again (after recompute).
	again, _ := p.Allocate(1)
	if err := p.Cache(again[0], hs[1]); err != nil {
		t.Fatal(err)
	}
	if p.Lookup(hs) != 2 {
		t.Fatalf("lookup after recaching %d", p.Lookup(hs))
	}
	_ = p.Free(again...)
	_ = p.Free(ids[0])
	checkAllFree(t, p)
}
