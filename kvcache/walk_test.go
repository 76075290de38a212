package kvcache

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
)

// poolWalker drives a pool with an operation sequence decoded from bytes and checks it against a
// model of the references it holds.
type poolWalker struct {
	t      testing.TB
	p      *Pool
	data   []byte
	pos    int
	held   []int32  // one entry per reference the walker holds
	refs   []int32  // expected reference count per block
	gens   []uint64 // expected generation per block
	chains [][]BlockHash
}

const walkBlocks = 12

func newPoolWalker(t testing.TB, data []byte) *poolWalker {
	prefix := len(data) == 0 || data[0]&0x80 == 0
	w := &poolWalker{
		t:    t,
		p:    newTestPool(t, tinyGeo, walkBlocks, prefix),
		data: data,
		refs: make([]int32, walkBlocks),
		gens: make([]uint64, walkBlocks),
	}
	// Four chains of six blocks; chain c shares its first c blocks with chain 0.
	base := seqTokens(6*4, 100)
	for c := range 4 {
		toks := slices.Clone(base)
		for i := c * 4; i < len(toks); i++ {
			toks[i] += int32(c) * 1000
		}
		w.chains = append(w.chains, ChainHashes(toks, 4))
	}
	return w
}

func (w *poolWalker) next() int {
	if w.pos >= len(w.data) {
		return 0
	}
	b := w.data[w.pos]
	w.pos++
	return int(b)
}

func (w *poolWalker) run() {
	for w.pos < len(w.data) {
		w.step()
		if err := w.p.CheckInvariants(); err != nil {
			w.t.Fatalf("after op ending at byte %d: %v", w.pos, err)
		}
		for id, want := range w.refs {
			if got := w.p.meta[id].ref; got != want {
				w.t.Fatalf("after op ending at byte %d: block %d refcount %d, want %d", w.pos, id, got, want)
			}
		}
	}
	if err := w.p.Free(w.held...); err != nil {
		w.t.Fatal(err)
	}
	w.held = nil
	checkAllFree(w.t, w.p)
}

func (w *poolWalker) takeHeld(i int) int32 {
	id := w.held[i]
	w.held = slices.Delete(w.held, i, i+1)
	w.refs[id]--
	return id
}

func (w *poolWalker) step() {
	t, p := w.t, w.p
	switch op := w.next() % 7; op {
	case 0: // allocate
		n := w.next() % 5
		free := p.NumFree()
		ids, err := p.Allocate(n)
		if n > free {
			if !errors.Is(err, ErrNoSpace) || ids != nil || p.NumFree() != free {
				t.Fatalf("Allocate(%d) with %d free = %v, %v", n, free, ids, err)
			}
			return
		}
		if err != nil || len(ids) != n {
			t.Fatalf("Allocate(%d) with %d free = %v, %v", n, free, ids, err)
		}
		for _, id := range ids {
			if w.refs[id] != 0 {
				t.Fatalf("Allocate returned block %d which holds %d references", id, w.refs[id])
			}
			w.gens[id]++
			if g := p.Generation(id); g != w.gens[id] {
				t.Fatalf("block %d generation %d, want %d", id, g, w.gens[id])
			}
			w.refs[id] = 1
			w.held = append(w.held, id)
		}
	case 1: // free one held reference
		if len(w.held) == 0 {
			return
		}
		id := w.takeHeld(w.next() % len(w.held))
		if err := p.Free(id); err != nil {
			t.Fatalf("Free(%d): %v", id, err)
		}
	case 2: // match a chain prefix
		c, n := w.chains[w.next()%len(w.chains)], w.next()%7
		want := p.Lookup(c[:n])
		ids := p.Match(c[:n])
		if len(ids) != want || (!p.PrefixCaching() && ids != nil) {
			t.Fatalf("Match found %d blocks, Lookup %d", len(ids), want)
		}
		for i, id := range ids {
			if m := p.meta[id]; !m.hashed || m.hash != c[i] {
				t.Fatalf("Match returned block %d for hash %d, block holds %v", id, i, m.hash)
			}
			if g := p.Generation(id); g != w.gens[id] {
				t.Fatalf("Match changed block %d generation to %d", id, g)
			}
			w.refs[id]++
			w.held = append(w.held, id)
		}
	case 3: // cache a held block under a chain hash
		if len(w.held) == 0 {
			return
		}
		id := w.held[w.next()%len(w.held)]
		h := w.chains[w.next()%len(w.chains)][w.next()%6]
		err := p.Cache(id, h)
		if err != nil && !errors.Is(err, ErrHashConflict) {
			t.Fatalf("Cache(%d): %v", id, err)
		}
		if m := p.meta[id]; err != nil && (!m.hashed || m.hash == h) {
			t.Fatalf("Cache(%d) conflict but block hashed=%v", id, m.hashed)
		}
	case 4: // evict one id, sometimes out of range
		id := int32(w.next()%(walkBlocks+2)) - 1
		err := p.Evict(id)
		if bad := id < 0 || id >= walkBlocks; bad != errors.Is(err, ErrBadBlock) || (!bad && err != nil) {
			t.Fatalf("Evict(%d): %v", id, err)
		}
		if id >= 0 && id < walkBlocks && p.meta[id].hashed {
			t.Fatalf("block %d still cached after Evict", id)
		}
	case 5: // a buggy free: unreferenced or out-of-range block
		id := int32(w.next()%(walkBlocks+2)) - 1
		if id >= 0 && id < walkBlocks && w.refs[id] > 0 {
			return
		}
		if err := p.Free(id); !errors.Is(err, ErrNotAllocated) && !errors.Is(err, ErrBadBlock) {
			t.Fatalf("Free(%d) of an unreferenced block: %v", id, err)
		}
	case 6: // free several held references at once
		n := min(w.next()%4, len(w.held))
		ids := make([]int32, 0, n)
		for range n {
			ids = append(ids, w.takeHeld(w.next()%len(w.held)))
		}
		if err := p.Free(ids...); err != nil {
			t.Fatalf("Free(%v): %v", ids, err)
		}
	}
}

// TestRandomWalk runs seeded random operation sequences, checking the invariants after every
// step and that every block is free at the end.
func TestRandomWalk(t *testing.T) {
	for seed := range uint64(12) {
		rng := rand.New(rand.NewPCG(seed, 0x6b76))
		data := make([]byte, 4000)
		for i := range data {
			data[i] = byte(rng.UintN(256))
		}
		if seed%4 == 3 {
			data[0] |= 0x80 // prefix caching off
		} else {
			data[0] &^= 0x80
		}
		newPoolWalker(t, data).run()
	}
}

// FuzzPoolOps decodes the input as a sequence of pool operations (see poolWalker.step).
// Seed corpus: testdata/fuzz/FuzzPoolOps. Run with: go test -run=^$ -fuzz=FuzzPoolOps ./kvcache/
func FuzzPoolOps(f *testing.F) {
	f.Add([]byte{0, 4, 3, 0, 0, 0, 1, 0, 2, 0, 6, 1, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 1<<14 {
			data = data[:1<<14]
		}
		newPoolWalker(t, data).run()
	})
}
