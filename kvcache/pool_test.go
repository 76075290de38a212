package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"slices"
	"sync"
	"testing"
)

var tinyGeo = Geometry{NumLayers: 2, NumKVHeads: 2, HeadDim: 4, BlockSize: 4}

func newTestPool(t testing.TB, g Geometry, n int, prefix bool) *Pool {
	t.Helper()
	p, err := NewPool(AlignedMemory(n*g.BlockBytes()), PoolConfig{Geometry: g, NumBlocks: n, PrefixCaching: prefix})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// checkPool fails the test if the pool's bookkeeping is inconsistent.
func checkPool(t testing.TB, p *Pool) {
	t.Helper()
	if err := p.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// checkAllFree asserts that every block went back to the pool.
func checkAllFree(t testing.TB, p *Pool) {
	t.Helper()
	checkPool(t, p)
	if p.NumFree() != p.NumBlocks() {
		t.Fatalf("%d of %d blocks free at the end", p.NumFree(), p.NumBlocks())
	}
}

func TestNewPool(t *testing.T) {
	bb := tinyGeo.BlockBytes()
	mem := AlignedMemory(10*bb + 7)
	p, err := NewPool(mem, PoolConfig{Geometry: tinyGeo})
	if err != nil {
		t.Fatal(err)
	}
	if p.NumBlocks() != 10 || p.NumFree() != 10 || p.Usage() != 0 || p.BlockBytes() != bb || p.Geometry() != tinyGeo {
		t.Fatalf("pool: %d blocks, %d free, usage %v", p.NumBlocks(), p.NumFree(), p.Usage())
	}
	checkPool(t, p)

	if _, err := NewPool(mem, PoolConfig{Geometry: tinyGeo, NumBlocks: 11}); !errors.Is(err, ErrMemory) {
		t.Errorf("too small memory: %v", err)
	}
	if _, err := NewPool(mem[1:], PoolConfig{Geometry: tinyGeo, NumBlocks: 2}); !errors.Is(err, ErrMemory) {
		t.Errorf("misaligned memory: %v", err)
	}
	if _, err := NewPool(mem[:bb-1], PoolConfig{Geometry: tinyGeo}); !errors.Is(err, ErrMemory) {
		t.Errorf("memory smaller than a block: %v", err)
	}
	if _, err := NewPool(nil, PoolConfig{Geometry: tinyGeo, NumBlocks: 1}); !errors.Is(err, ErrMemory) {
		t.Errorf("nil memory: %v", err)
	}
	if _, err := NewPool(mem, PoolConfig{Geometry: Geometry{}, NumBlocks: 1}); !errors.Is(err, ErrGeometry) {
		t.Errorf("zero geometry: %v", err)
	}
	if _, err := NewPool(mem, PoolConfig{Geometry: tinyGeo, NumBlocks: -1}); !errors.Is(err, ErrGeometry) {
		t.Errorf("negative blocks: %v", err)
	}
	if m := AlignedMemory(100); len(m) != 100 || cap(m) != 100 {
		t.Errorf("AlignedMemory(100): len %d cap %d", len(m), cap(m))
	}
}

func TestAllocateFreeRefcount(t *testing.T) {
	p := newTestPool(t, tinyGeo, 8, true)
	ids, err := p.Allocate(3)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(ids, []int32{0, 1, 2}) {
		t.Fatalf("first allocation %v, want consecutive ids from 0", ids)
	}
	if p.NumFree() != 5 || p.Usage() != 3.0/8 {
		t.Fatalf("free %d usage %v", p.NumFree(), p.Usage())
	}
	checkPool(t, p)

	// Not enough space: nothing is allocated.
	if got, err := p.Allocate(6); !errors.Is(err, ErrNoSpace) || got != nil {
		t.Fatalf("Allocate(6) = %v, %v; want ErrNoSpace", got, err)
	}
	if p.NumFree() != 5 {
		t.Fatalf("failed allocation changed the free count to %d", p.NumFree())
	}
	if got, err := p.Allocate(0); err != nil || got != nil {
		t.Fatalf("Allocate(0) = %v, %v", got, err)
	}
	if _, err := p.Allocate(-1); err == nil {
		t.Fatal("Allocate(-1) succeeded")
	}

	// A shared block needs as many frees as references.
	h := NextHash(BlockHash{}, []int32{1, 2, 3, 4})
	if err := p.Cache(ids[0], h); err != nil {
		t.Fatal(err)
	}
	if m := p.Match([]BlockHash{h}); !slices.Equal(m, ids[:1]) {
		t.Fatalf("Match = %v", m)
	}
	if err := p.Free(ids...); err != nil {
		t.Fatal(err)
	}
	if p.NumFree() != 7 {
		t.Fatalf("free %d after freeing, block 0 still referenced once", p.NumFree())
	}
	if err := p.Free(ids[0]); err != nil {
		t.Fatal(err)
	}
	checkAllFree(t, p)

	// Double free and bad ids are errors that change nothing.
	err = p.Free(ids[1], 99, -1)
	if !errors.Is(err, ErrNotAllocated) || !errors.Is(err, ErrBadBlock) {
		t.Fatalf("double free and bad ids: %v", err)
	}
	checkAllFree(t, p)

	// Free skips the bad ids but frees the good ones.
	ids, _ = p.Allocate(2)
	if err := p.Free(ids[0], 1000, ids[1]); !errors.Is(err, ErrBadBlock) {
		t.Fatalf("free with a bad id: %v", err)
	}
	checkAllFree(t, p)
}

func TestAllocateEverythingAndReuse(t *testing.T) {
	p := newTestPool(t, tinyGeo, 5, false)
	ids, err := p.Allocate(5)
	if err != nil || p.NumFree() != 0 || p.Usage() != 1 {
		t.Fatalf("allocate all: %v, free %d, usage %v", err, p.NumFree(), p.Usage())
	}
	if _, err := p.Allocate(1); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("allocate from a full pool: %v", err)
	}
	if err := p.Free(ids[3], ids[1]); err != nil {
		t.Fatal(err)
	}
	// Lowest free ids come first.
	got, _ := p.Allocate(2)
	if !slices.Equal(got, []int32{1, 3}) {
		t.Fatalf("reallocated %v, want [1 3]", got)
	}
	if err := p.Free(ids...); err != nil {
		t.Fatal(err)
	}
	checkAllFree(t, p)
}

func TestGenerations(t *testing.T) {
	p := newTestPool(t, tinyGeo, 2, true)
	if p.Generation(0) != 0 || p.Generation(-1) != 0 || p.Generation(2) != 0 {
		t.Fatal("generation of a never-allocated or bad block is not 0")
	}
	ids, _ := p.Allocate(2)
	if g := p.Generations(ids); !slices.Equal(g, []uint64{1, 1}) {
		t.Fatalf("generations after the first allocation %v", g)
	}
	h := NextHash(BlockHash{}, []int32{9})
	if err := p.Cache(ids[0], h); err != nil {
		t.Fatal(err)
	}
	_ = p.Free(ids...)
	// A prefix hit keeps the content and the generation.
	m := p.Match([]BlockHash{h})
	if len(m) != 1 || p.Generation(m[0]) != 1 {
		t.Fatalf("match %v generation %d", m, p.Generation(m[0]))
	}
	_ = p.Free(m...)
	// Reallocation bumps it, also for the evicted cached block.
	ids2, _ := p.Allocate(2)
	if g := p.Generations(append(ids2, 7)); !slices.Equal(g, []uint64{2, 2, 0}) {
		t.Fatalf("generations after reuse %v", g)
	}
	_ = p.Free(ids2...)
	checkAllFree(t, p)
}

func TestBytesOffsetReadWrite(t *testing.T) {
	p := newTestPool(t, tinyGeo, 4, false)
	bb := p.BlockBytes()
	if p.Offset(3) != int64(3*bb) || p.Offset(4) != -1 || p.Offset(-1) != -1 {
		t.Fatal("Offset")
	}
	if len(p.Bytes(2)) != bb || cap(p.Bytes(2)) != bb || p.Bytes(4) != nil {
		t.Fatal("Bytes")
	}
	ids, _ := p.Allocate(2)
	src := make([]byte, bb)
	for i := range src {
		src[i] = byte(i*7 + 1)
	}
	if err := p.WriteBlock(ids[1], src); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, bb)
	if err := p.ReadBlock(ids[1], dst); err != nil || !slices.Equal(dst, src) {
		t.Fatalf("read back: %v", err)
	}
	if !slices.Equal(p.Bytes(ids[1]), src) || slices.Equal(p.Bytes(ids[0]), src) {
		t.Fatal("write went to the wrong block")
	}
	if err := p.ReadBlock(ids[1], dst[1:]); !errors.Is(err, ErrBufferSize) {
		t.Fatalf("short buffer: %v", err)
	}
	if err := p.WriteBlock(3, src); !errors.Is(err, ErrNotAllocated) {
		t.Fatalf("write to a free block: %v", err)
	}
	if err := p.ReadBlock(9, dst); !errors.Is(err, ErrBadBlock) {
		t.Fatalf("read of a bad block: %v", err)
	}
	_ = p.Free(ids...)
	checkAllFree(t, p)
}

// naiveIndex is the reference float32 index of (layer, kv, head, slot, dim) in one block.
func naiveIndex(g Geometry, l Layout, layer, kv, h, s, d int) int {
	H, S, D := g.NumKVHeads, g.BlockSize, g.HeadDim
	if l == NHD {
		return (((layer*2+kv)*S+s)*H+h)*D + d
	}
	return (((layer*2+kv)*H+h)*S+s)*D + d
}

func TestHeadView(t *testing.T) {
	for _, l := range []Layout{HND, NHD} {
		g := Geometry{NumLayers: 3, NumKVHeads: 2, HeadDim: 5, BlockSize: 4, Layout: l}
		p := newTestPool(t, g, 3, false)
		blockFloats := g.BlockBytes() / 4
		for layer := range g.NumLayers {
			for b := range 3 {
				for h := range g.NumKVHeads {
					k, v, stride := p.HeadView(layer, b, h)
					wantStride := g.HeadDim
					if l == NHD {
						wantStride = g.NumKVHeads * g.HeadDim
					}
					if stride != wantStride {
						t.Fatalf("%v stride %d, want %d", l, stride, wantStride)
					}
					for s := range g.BlockSize {
						for d := range g.HeadDim {
							k[s*stride+d] = float32(1 + b*blockFloats + naiveIndex(g, l, layer, 0, h, s, d))
							v[s*stride+d] = float32(1 + b*blockFloats + naiveIndex(g, l, layer, 1, h, s, d))
						}
					}
				}
			}
		}
		// Every float of the pool was written once, with its own index.
		for i, f := range p.shards[0].f32 {
			if f != float32(i+1) {
				t.Fatalf("%v: float %d = %v, want %d", l, i, f, i+1)
			}
		}
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("HeadView out of range did not panic")
				}
			}()
			p.HeadView(0, 3, 0)
		}()
	}
}

func TestConcurrentUse(t *testing.T) {
	const (
		workers = 6
		rounds  = 200
		bs      = 4
	)
	g := Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 2, BlockSize: bs}
	p := newTestPool(t, g, 24, true)
	prompts := make([][]int32, 4)
	for i := range prompts {
		prompts[i] = append(seqTokens(2*bs, 0), seqTokens(2*bs+1, int32(i+1))...) // shared 2-block prefix
	}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for r := range rounds {
				toks := prompts[(w+r)%len(prompts)]
				bt := NewBlockTable(bs)
				cached := bt.MatchPrefix(p, toks)
				ids, err := p.Allocate(bt.BlocksFor(len(toks)))
				if err != nil {
					if !errors.Is(err, ErrNoSpace) {
						errs <- err
						return
					}
					if err := bt.Release(p); err != nil {
						errs <- err
						return
					}
					continue
				}
				bt.Append(ids...)
				for pos := cached; pos < len(toks); pos++ { // "compute" the KV of new tokens
					k, v, stride := p.HeadView(0, int(bt.IDs()[pos/bs]), 0)
					k[(pos%bs)*stride] = float32(toks[pos])
					v[(pos%bs)*stride] = -float32(toks[pos])
				}
				for pos := range cached { // read the cached ones
					k, _, stride := p.HeadView(0, int(bt.IDs()[pos/bs]), 0)
					if k[(pos%bs)*stride] != float32(toks[pos]) {
						errs <- errors.New("cached block holds the wrong KV")
						return
					}
				}
				if err := bt.Commit(p, toks, len(toks)); err != nil {
					errs <- err
					return
				}
				_ = p.Usage()
				if err := bt.Release(p); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	checkAllFree(t, p)
}

// TestRecordTablePublishesRecords checks the records a remote reader consults: the generation
// of every allocation, the content hash once published, both cleared when the block is reused.
func TestRecordTablePublishesRecords(t *testing.T) {
	g := Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 4, BlockSize: 2}
	table := AlignedMemory(RecordBytes * 4)
	p, err := NewPool(AlignedMemory(4*g.BlockBytes()), PoolConfig{Geometry: g, NumBlocks: 4, RecordTable: table})
	if err != nil {
		t.Fatal(err)
	}
	read := func(id int32) Record { return DecodeRecord(table[RecordBytes*id:]) }
	ids, _ := p.Allocate(2)
	for _, id := range ids {
		if r := read(id); r.Gen != p.Generation(id) || r.Gen == 0 || r.Count != 0 || r.Hash != (BlockHash{}) {
			t.Fatalf("record %d = %+v, pool generation %d", id, r, p.Generation(id))
		}
	}
	// Three tokens in blocks of two: one full block, one partial block of one token.
	toks := []int32{5, 6, 7}
	chain, err := p.PublishChain(ids, toks)
	if err != nil {
		t.Fatal(err)
	}
	if want := ChainHashes(toks, g.BlockSize); !slices.Equal(chain, want) {
		t.Errorf("PublishChain returned the chain %v, ChainHashes says %v", chain, want)
	}
	// Independent derivation: SHA-256(parent ‖ tokens as uint32 LE), first 16 bytes.
	h := func(parent BlockHash, tokens ...int32) BlockHash {
		buf := append([]byte(nil), parent[:]...)
		for _, tk := range tokens {
			buf = binary.LittleEndian.AppendUint32(buf, uint32(tk))
		}
		sum := sha256.Sum256(buf)
		var out BlockHash
		copy(out[:], sum[:16])
		return out
	}
	full := h(BlockHash{}, 5, 6)
	if r := read(ids[0]); r.Count != 2 || r.Hash != full {
		t.Errorf("full block record %+v, want count 2 hash %v", r, full)
	}
	if r := read(ids[1]); r.Count != 1 || r.Hash != h(full, 7) {
		t.Errorf("partial block record %+v, want count 1 hash %v", r, h(full, 7))
	}
	before := read(ids[0])
	p.Free(ids...)
	again, _ := p.Allocate(4)
	if r := read(ids[0]); r.Gen == before.Gen || r.Count != 0 || r.Hash != (BlockHash{}) {
		t.Errorf("reusing block %d left record %+v (was %+v)", ids[0], r, before)
	}
	p.Free(again...)
	if err := p.Publish(again[0], 1, full); !errors.Is(err, ErrNotAllocated) {
		t.Errorf("publishing a free block: %v, want ErrNotAllocated", err)
	}
	if _, err := NewPool(AlignedMemory(4*g.BlockBytes()), PoolConfig{Geometry: g, NumBlocks: 4, RecordTable: table[:RecordBytes]}); !errors.Is(err, ErrMemory) {
		t.Errorf("short record table: %v, want ErrMemory", err)
	}
}
