package kvcache

import (
	"errors"
	"strings"
	"testing"
)

// TestPoolShards: a pool over three ranks' memories allocates one set of block ids; a block's
// view in each shard is in that rank's memory only, with the pool's layout, and rank 0's is
// the pool's own.
func TestPoolShards(t *testing.T) {
	g := Geometry{NumLayers: 2, NumKVHeads: 1, HeadDim: 8, BlockSize: 4, Layout: NHD}
	const n = 3
	mems := [][]byte{AlignedMemory(n * g.BlockBytes()), AlignedMemory(n * g.BlockBytes()), AlignedMemory(n * g.BlockBytes())}
	p, err := NewPool(mems[0], PoolConfig{Geometry: g, NumBlocks: n, RankMemory: mems[1:]})
	if err != nil {
		t.Fatal(err)
	}
	if p.TensorParallelSize() != 3 {
		t.Fatalf("TensorParallelSize() = %d", p.TensorParallelSize())
	}
	ids, err := p.Allocate(2)
	if err != nil {
		t.Fatal(err)
	}
	for r := range 3 {
		k, v, _ := p.Shard(r).HeadView(1, int(ids[1]), 0)
		k[0], v[0] = float32(10+r), float32(20+r)
	}
	for r := range 3 {
		k, v, _ := p.Shard(r).HeadView(1, int(ids[1]), 0)
		if k[0] != float32(10+r) || v[0] != float32(20+r) {
			t.Fatalf("rank %d reads %v, %v: another rank's memory", r, k[0], v[0])
		}
		b := p.Shard(r).Bytes(ids[1])
		if &b[0] != &mems[r][int(ids[1])*g.BlockBytes()] {
			t.Fatalf("rank %d's block is not in its memory", r)
		}
	}
	if k, _, _ := p.HeadView(1, int(ids[1]), 0); k[0] != 10 {
		t.Fatalf("the pool's HeadView reads %v, not rank 0's", k[0])
	}
	if err := p.Free(ids...); err != nil || p.NumFree() != n {
		t.Fatalf("free: %v, %d free", err, p.NumFree())
	}
	_, err = NewPool(mems[0], PoolConfig{Geometry: g, NumBlocks: n, RankMemory: [][]byte{mems[1][:g.BlockBytes()]}})
	if !errors.Is(err, ErrMemory) || !strings.Contains(err.Error(), "rank 1") {
		t.Fatalf("short rank memory: err = %v", err)
	}
}
