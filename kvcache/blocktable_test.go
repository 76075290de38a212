package kvcache

import (
	"slices"
	"testing"
)

func TestBlockTableLifecycle(t *testing.T) {
	const bs = 4
	p := newTestPool(t, Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 1, BlockSize: bs}, 16, true)
	prompt := seqTokens(10, 1) // 2 full blocks + 2 tokens

	// First request: nothing cached.
	a := NewBlockTable(bs)
	if got := a.MatchPrefix(p, prompt); got != 0 {
		t.Fatalf("cold match %d tokens", got)
	}
	if n := a.BlocksFor(len(prompt)); n != 3 {
		t.Fatalf("BlocksFor(10) = %d", n)
	}
	ids, _ := p.Allocate(3)
	a.Append(ids...)
	if a.Len() != 3 || a.Slots() != 12 || a.BlocksFor(12) != 0 || a.BlocksFor(13) != 1 {
		t.Fatalf("len %d slots %d", a.Len(), a.Slots())
	}
	// A prefill chunk of 5 tokens commits one block.
	if err := a.Commit(p, prompt, 5); err != nil || a.NumCached() != 1 {
		t.Fatalf("commit after 5 tokens: cached %d, %v", a.NumCached(), err)
	}
	if err := a.Commit(p, prompt, 10); err != nil || a.NumCached() != 2 {
		t.Fatalf("commit after 10 tokens: cached %d, %v", a.NumCached(), err)
	}
	// Decode two tokens: the third block becomes full.
	seq := append(slices.Clone(prompt), 500, 501)
	if err := a.Commit(p, seq, len(seq)); err != nil || a.NumCached() != 3 {
		t.Fatalf("commit after decode: cached %d, %v", a.NumCached(), err)
	}
	if h := a.Hashes(); len(h) != 3 || !slices.Equal(h, ChainHashes(seq, bs)) {
		t.Fatal("table chain differs from ChainHashes of the sequence")
	}

	// Second request with the same prompt while the first still runs: shares 2 blocks.
	b := NewBlockTable(bs)
	if got := b.MatchPrefix(p, prompt); got != 8 || !slices.Equal(b.IDs(), ids[:2]) {
		t.Fatalf("warm match %d tokens, ids %v", got, b.IDs())
	}
	// A prompt that is an exact block multiple leaves its last block to compute.
	c := NewBlockTable(bs)
	if got := c.MatchPrefix(p, prompt[:8]); got != 4 {
		t.Fatalf("exact multiple matched %d tokens, want 4", got)
	}
	if got := c.MatchPrefix(p, prompt[:8]); got != 4 { // non-empty table: reports, does not rematch
		t.Fatalf("second MatchPrefix %d", got)
	}

	if err := a.Release(p); err != nil {
		t.Fatal(err)
	}
	if a.Len() != 0 || a.NumCached() != 0 || len(a.Hashes()) != 0 {
		t.Fatal("Release did not empty the table")
	}
	// After a failed load, evicting from block 1 drops it and later blocks from the cache.
	if err := b.EvictFrom(p, 1); err != nil || b.NumCached() != 1 {
		t.Fatalf("EvictFrom: %v, cached %d", err, b.NumCached())
	}
	if p.Lookup(ChainHashes(prompt, bs)) != 1 {
		t.Fatalf("lookup after EvictFrom(1) = %d", p.Lookup(ChainHashes(prompt, bs)))
	}
	// Recompute then commit registers it again.
	if err := b.Commit(p, prompt, len(prompt)); err != nil || b.NumCached() != 2 {
		t.Fatalf("recommit: %v, cached %d", err, b.NumCached())
	}
	if p.Lookup(ChainHashes(prompt, bs)) != 2 {
		t.Fatal("recommitted block not matchable")
	}
	if err := b.EvictFrom(p, 5); err != nil {
		t.Fatal(err)
	}
	for _, bt := range []*BlockTable{b, c} {
		if err := bt.Release(p); err != nil {
			t.Fatal(err)
		}
	}
	checkAllFree(t, p)
	if NewBlockTable(0).BlockSize() != 1 {
		t.Fatal("NewBlockTable(0) block size")
	}
}

func TestBlockTableNoPrefixCaching(t *testing.T) {
	const bs = 2
	p := newTestPool(t, Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 1, BlockSize: bs}, 4, false)
	prompt := seqTokens(4, 2)
	for range 2 {
		bt := NewBlockTable(bs)
		if got := bt.MatchPrefix(p, prompt); got != 0 {
			t.Fatalf("matched %d with prefix caching off", got)
		}
		ids, _ := p.Allocate(bt.BlocksFor(len(prompt)))
		bt.Append(ids...)
		if err := bt.Commit(p, prompt, len(prompt)); err != nil {
			t.Fatal(err)
		}
		if err := bt.Release(p); err != nil {
			t.Fatal(err)
		}
	}
	checkAllFree(t, p)
}
