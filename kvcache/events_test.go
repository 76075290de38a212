package kvcache

import (
	"slices"
	"testing"
)

// TestEventLog follows one sequence through the prefix cache: committed blocks are Stored with
// their parent and tokens, a block reused by Allocate and one dropped by Evict are Removed, and a
// reset is one Cleared — in the order they happened, each drained once.
func TestEventLog(t *testing.T) {
	p, err := NewPool(AlignedMemory(3*tinyGeo.BlockBytes()), PoolConfig{Geometry: tinyGeo, NumBlocks: 3, PrefixCaching: true, RecordEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	toks := seqTokens(9, 3)
	hs := ChainHashes(toks, 4)
	tab := NewBlockTable(4)
	tab.MatchPrefix(p, toks)
	ids, err := p.Allocate(3)
	if err != nil {
		t.Fatal(err)
	}
	tab.Append(ids...)
	if err := tab.Commit(p, toks, 9); err != nil {
		t.Fatal(err)
	}
	evs := p.TakeEvents()
	want := []Event{
		{Kind: EventStored, Hash: hs[0], Tokens: toks[0:4]},
		{Kind: EventStored, Hash: hs[1], Parent: hs[0], Tokens: toks[4:8]},
	}
	if !eventsEqual(evs, want) {
		t.Fatalf("after commit: events %+v, want %+v", evs, want)
	}
	if again := p.TakeEvents(); again != nil {
		t.Fatalf("second TakeEvents = %+v, want nil", again)
	}
	if err := tab.Release(p); err != nil {
		t.Fatal(err)
	}
	// Released blocks stay cached: no event. Taking all three blocks reuses the cached ones,
	// which leave the cache.
	all, err := p.Allocate(3)
	if err != nil {
		t.Fatal(err)
	}
	evs = p.TakeEvents()
	if len(evs) != 2 || evs[0].Kind != EventRemoved || evs[1].Kind != EventRemoved ||
		!slices.ContainsFunc(evs, func(e Event) bool { return e.Hash == hs[0] }) ||
		!slices.ContainsFunc(evs, func(e Event) bool { return e.Hash == hs[1] }) {
		t.Fatalf("after reuse: events %+v, want two Removed of %v and %v", evs, hs[0], hs[1])
	}
	if err := p.Cache(all[0], hs[0]); err != nil {
		t.Fatal(err)
	}
	if err := p.Evict(all[0]); err != nil {
		t.Fatal(err)
	}
	evs = p.TakeEvents()
	want = []Event{{Kind: EventStored, Hash: hs[0]}, {Kind: EventRemoved, Hash: hs[0]}}
	if !eventsEqual(evs, want) {
		t.Fatalf("after Cache and Evict: events %+v, want %+v", evs, want)
	}
	// A reset refuses while a block is referenced, then clears.
	if err := p.Cache(all[1], hs[1]); err != nil {
		t.Fatal(err)
	}
	if p.ResetPrefixCache() {
		t.Fatal("ResetPrefixCache succeeded with blocks in use")
	}
	if err := p.Free(all...); err != nil {
		t.Fatal(err)
	}
	p.TakeEvents()
	if !p.ResetPrefixCache() {
		t.Fatal("ResetPrefixCache failed with every block free")
	}
	if evs = p.TakeEvents(); !eventsEqual(evs, []Event{{Kind: EventCleared}}) || p.NumCached() != 0 || p.Lookup(hs[1:2]) != 0 {
		t.Fatalf("after reset: events %+v, %d cached", evs, p.NumCached())
	}
	checkAllFree(t, p)
}

// TestEventLogOff: without RecordEvents the pool keeps nothing.
func TestEventLogOff(t *testing.T) {
	p := newTestPool(t, tinyGeo, 2, true)
	ids := cachedRequest(t, p, ChainHashes(seqTokens(8, 1), 4))
	if err := p.Free(ids...); err != nil {
		t.Fatal(err)
	}
	if evs := p.TakeEvents(); evs != nil {
		t.Fatalf("events %+v with RecordEvents off", evs)
	}
}

func eventsEqual(a, b []Event) bool {
	return slices.EqualFunc(a, b, func(x, y Event) bool {
		return x.Kind == y.Kind && x.Hash == y.Hash && x.Parent == y.Parent && slices.Equal(x.Tokens, y.Tokens)
	})
}
