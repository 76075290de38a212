package kvcache

import (
	"fmt"
	"unsafe"
)

// Shard is one tensor-parallel rank's KV memory in a Pool (PoolConfig.RankMemory): block id's
// bytes hold the rank's KV heads (Geometry.NumKVHeads of them) in the pool's geometry. The pool
// allocates and frees the block ids of every shard at once. A Shard implements model.KVBlocks
// (and the bfloat16 and FP8 forms) for the rank; like the pool's, its views take no lock.
type Shard struct {
	geo Geometry
	bb  int       // block bytes
	n   int       // number of blocks
	mem []byte    // exactly n×bb bytes
	f32 []float32 // mem viewed as float32 (a float32 pool)
	u16 []uint16  // mem viewed as bfloat16 bits (a bfloat16 pool)
}

// newShard checks mem (alignment, room for n blocks of g) and views its first n blocks.
func newShard(mem []byte, g Geometry, n int) (*Shard, error) {
	bb := g.BlockBytes()
	if n > len(mem)/bb {
		return nil, fmt.Errorf("kvcache: %d blocks of %d bytes need %d bytes, memory has %d: %w",
			n, bb, int64(n)*int64(bb), len(mem), ErrMemory)
	}
	if p := uintptr(unsafe.Pointer(unsafe.SliceData(mem))); p%64 != 0 {
		return nil, fmt.Errorf("kvcache: memory at %#x is not 64-byte aligned: %w", p, ErrMemory)
	}
	mem = mem[: n*bb : n*bb]
	return &Shard{
		geo: g, bb: bb, n: n, mem: mem,
		f32: unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(mem))), len(mem)/4),
		u16: unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(mem))), len(mem)/2),
	}, nil
}

// TensorParallelSize returns the number of ranks whose KV the pool holds (1 + the length of
// PoolConfig.RankMemory).
func (p *Pool) TensorParallelSize() int { return len(p.shards) }

// Shard returns rank r's memory (0 ≤ r < TensorParallelSize; rank 0's is NewPool's mem). It
// panics for a rank out of range.
func (p *Pool) Shard(r int) *Shard { return p.shards[r] }

// Bytes returns block id's memory in the shard (BlockBytes long, capacity-limited), or nil for
// an id out of range. Only a holder of a reference on the block (in the pool) should touch it.
func (s *Shard) Bytes(id int32) []byte {
	if id < 0 || int(id) >= s.n {
		return nil
	}
	off := int(id) * s.bb
	return s.mem[off : off+s.bb : off+s.bb]
}

// HeadView is Pool.HeadView in the shard's memory (head counts the rank's heads from 0).
func (s *Shard) HeadView(layer, block, head int) (k, v []float32, stride int) {
	ko, vo, n, stride := s.headView(Float32, "HeadView", layer, block, head)
	return s.f32[ko : ko+n : ko+n], s.f32[vo : vo+n : vo+n], stride
}

// HeadViewBF16 is Pool.HeadViewBF16 in the shard's memory.
func (s *Shard) HeadViewBF16(layer, block, head int) (k, v []uint16, stride int) {
	ko, vo, n, stride := s.headView(BFloat16, "HeadViewBF16", layer, block, head)
	return s.u16[ko : ko+n : ko+n], s.u16[vo : vo+n : vo+n], stride
}

// HeadViewFP8 is Pool.HeadViewFP8 in the shard's memory.
func (s *Shard) HeadViewFP8(layer, block, head int) (k, v []uint8, stride int) {
	if s.geo.DType.Size() != 1 {
		panic(fmt.Sprintf("kvcache: HeadViewFP8 on a pool of %v values", s.geo.DType))
	}
	ko, vo, n, stride := s.headView(s.geo.DType, "HeadViewFP8", layer, block, head)
	return s.mem[ko : ko+n : ko+n], s.mem[vo : vo+n : vo+n], stride
}

// headView checks a head view's arguments and returns the value offsets of its keys and values,
// their length and the stride.
func (s *Shard) headView(dtype DType, op string, layer, block, head int) (ko, vo, n, stride int) {
	g := s.geo
	if g.DType != dtype {
		panic(fmt.Sprintf("kvcache: %s on a pool of %v values", op, g.DType))
	}
	if layer < 0 || layer >= g.NumLayers || block < 0 || block >= s.n || head < 0 || head >= g.NumKVHeads {
		panic(fmt.Sprintf("kvcache: %s(layer %d, block %d, head %d) out of range (%d layers, %d blocks, %d heads)",
			op, layer, block, head, g.NumLayers, s.n, g.NumKVHeads))
	}
	stride = g.HeadDim
	if g.Layout == NHD {
		stride = g.NumKVHeads * g.HeadDim
	}
	n = (g.BlockSize-1)*stride + g.HeadDim
	base := block * g.blockValues()
	return base + g.vecIndex(g.Layout, layer, 0, head, 0), base + g.vecIndex(g.Layout, layer, 1, head, 0), n, stride
}
