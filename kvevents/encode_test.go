package kvevents

import (
	"bytes"
	"encoding/binary"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/internal/blockhash"
	"github.com/kvbridge/kvbridge/kvcache"
)

// TestEncodeClearedBytes pins the bytes of the smallest batch against msgpack's spec, as
// msgspec writes KVEventBatch(ts=1.5, events=[AllBlocksCleared()], data_parallel_rank=2).
func TestEncodeClearedBytes(t *testing.T) {
	got, err := encodeBatch(batch{ts: time.Unix(1, 5e8), events: []kvcache.Event{{Kind: kvcache.EventCleared}}}, 2, 16)
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{0x93, 0xcb}
	want = binary.BigEndian.AppendUint64(want, math.Float64bits(1.5))
	want = append(want, 0x91, 0x81, 0xa4)
	want = append(want, "type"...)
	want = append(want, 0xb0)
	want = append(want, "AllBlocksCleared"...)
	want = append(want, 0x02)
	if !bytes.Equal(got, want) {
		t.Fatalf("encoded\n% x\nwant\n% x", got, want)
	}
}

// TestEncodeFromPool encodes what a real pool records for two requests sharing a prefix, one
// eviction and a reset, and decodes it by vLLM's schema: the hashes are vLLM's chain of the same
// tokens (internal/blockhash, checked against Python there).
func TestEncodeFromPool(t *testing.T) {
	geo := kvcache.Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 4, BlockSize: 4}
	vh, err := blockhash.New(blockhash.SHA256, "0", true)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvcache.NewPool(kvcache.AlignedMemory(5*geo.BlockBytes()), kvcache.PoolConfig{Geometry: geo, NumBlocks: 5, PrefixCaching: true, RecordEvents: true, EventHashes: vh})
	if err != nil {
		t.Fatal(err)
	}
	a := []int32{1, 2, 3, 4, 5, 6, 7, 8, 70000, 100}
	b := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}
	run := func(tokens []int32) *kvcache.BlockTable {
		tab := kvcache.NewBlockTable(4)
		tab.MatchPrefix(p, tokens)
		ids, err := p.Allocate(tab.BlocksFor(len(tokens)))
		if err != nil {
			t.Fatal(err)
		}
		tab.Append(ids...)
		if err := tab.Commit(p, tokens, len(tokens)); err != nil {
			t.Fatal(err)
		}
		return tab
	}
	ta := run(a)
	tb := run(b) // matches a's two blocks, stores its third
	ha, hb := vh.Chain(a, 4), vh.Chain(b, 4)
	if err := tb.EvictFrom(p, 2); err != nil {
		t.Fatal(err)
	}
	for _, tab := range []*kvcache.BlockTable{ta, tb} {
		if err := tab.Release(p); err != nil {
			t.Fatal(err)
		}
	}
	if !p.ResetPrefixCache() {
		t.Fatal("reset refused with every block free")
	}
	payload, err := encodeBatch(batch{ts: time.Now(), events: p.TakeEvents()}, 0, 4)
	if err != nil {
		t.Fatal(err)
	}
	w, err := decodeWire(payload)
	if err != nil {
		t.Fatal(err)
	}
	if w.Rank == nil || *w.Rank != 0 || math.Abs(w.TS-float64(time.Now().UnixNano())/1e9) > 60 {
		t.Fatalf("batch rank %v ts %v", w.Rank, w.TS)
	}
	types := make([]string, len(w.Events))
	for i, e := range w.Events {
		types[i] = e.Type
	}
	// a's two full blocks and then b's third, which continues the same chain, are one store.
	if want := []string{"BlockStored", "BlockRemoved", "AllBlocksCleared"}; !slices.Equal(types, want) {
		t.Fatalf("events %v, want %v", types, want)
	}
	s0, rm := w.Events[0], w.Events[1]
	if !s0.hasKeys("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name") ||
		!slices.Equal(uints(s0.Fields["block_hashes"]), []uint64{ha[0].External(), ha[1].External(), hb[2].External()}) ||
		s0.Fields["parent_block_hash"] != nil || !slices.Equal(uints(s0.Fields["token_ids"]), []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}) ||
		uints([]any{s0.Fields["block_size"]})[0] != 4 || s0.Fields["lora_id"] != nil || s0.Fields["medium"] != "GPU" || s0.Fields["lora_name"] != nil {
		t.Errorf("store %+v, want a's two blocks and b's third from the root", s0)
	}
	if !rm.hasKeys("block_hashes", "medium") || !slices.Equal(uints(rm.Fields["block_hashes"]), []uint64{hb[2].External()}) {
		t.Errorf("removal %+v, want b's third block", rm)
	}
	if ha[1] != hb[1] {
		t.Fatal("shared prefix hashed differently")
	}
}

// TestGroupSplitsChains: a stored block that does not continue the previous one starts a new
// BlockStored with its own parent.
func TestGroupSplitsChains(t *testing.T) {
	x := kvcache.ChainHashes([]int32{1, 2, 3, 4, 5, 6, 7, 8}, 4)
	y := kvcache.ChainHashes([]int32{9, 9, 9, 9, 8, 8, 8, 8}, 4)
	evs := []kvcache.Event{
		{Kind: kvcache.EventStored, Hash: x[0], Tokens: []int32{1, 2, 3, 4}, External: x[0].External()},
		{Kind: kvcache.EventStored, Hash: y[1], Parent: y[0], Tokens: []int32{8, 8, 8, 8}, External: y[1].External(), ParentExternal: y[0].External()},
		{Kind: kvcache.EventStored, Hash: x[1], Parent: x[0], Tokens: []int32{5, 6, 7, 8}, External: x[1].External(), ParentExternal: x[0].External()},
	}
	payload, err := encodeBatch(batch{ts: time.Now(), events: evs}, 1, 4)
	if err != nil {
		t.Fatal(err)
	}
	w, err := decodeWire(payload)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Events) != 3 || *w.Rank != 1 {
		t.Fatalf("%d events rank %v, want 3 (no two consecutive blocks chain) of rank 1", len(w.Events), w.Rank)
	}
	if p := uints([]any{w.Events[1].Fields["parent_block_hash"]}); len(p) != 1 || p[0] != y[0].External() {
		t.Errorf("second store's parent %v, want %#x", w.Events[1].Fields["parent_block_hash"], y[0].External())
	}
}
