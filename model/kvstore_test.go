package model

import "github.com/kvbridge/kvbridge/model/kernel"

// testKV is a paged KV store for tests: numBlocks blocks, each [layer][k,v] with the heads in
// HND ([head][slot][dim]) or NHD ([slot][head][dim]) order, like kvcache's blocks.
type testKV struct {
	layers, heads, headDim, blockSize int
	nhd                               bool
	mem                               []float32 // float32 values, or nil
	mem16                             []uint16  // bfloat16 values, or nil
	mem8                              []uint8   // FP8 codes of format fp8 (scale 1), or nil
	fp8                               kernel.FP8
}

func newTestKV(c Config, blockSize, numBlocks int, nhd bool) *testKV {
	return &testKV{
		layers: c.NumLayers, heads: c.NumKVHeads, headDim: c.HeadDim, blockSize: blockSize, nhd: nhd,
		mem: make([]float32, numBlocks*c.NumLayers*2*c.NumKVHeads*blockSize*c.HeadDim),
	}
}

// newTestKVFor is newTestKV with m's KV cache dtype.
func newTestKVFor(m *Model, blockSize, numBlocks int, nhd bool) *testKV {
	kv := newTestKV(m.cfg, blockSize, numBlocks, nhd)
	if m.kvBF16 {
		kv.mem16, kv.mem = make([]uint16, len(kv.mem)), nil
	}
	if m.kvFP8 {
		kv.mem8, kv.fp8, kv.mem = make([]uint8, len(kv.mem)), m.fp8, nil
	}
	return kv
}

// offsets returns where the keys and values of (layer, block, head) start and the stride.
func (s *testKV) offsets(layer, block, head int) (ko, vo, n, stride int) {
	part := s.heads * s.blockSize * s.headDim
	base := (block*s.layers + layer) * 2 * part
	if s.nhd {
		o := head * s.headDim
		return base + o, base + part + o, part - o, s.heads * s.headDim
	}
	o := head * s.blockSize * s.headDim
	return base + o, base + part + o, s.blockSize * s.headDim, s.headDim
}

// HeadView implements KVBlocks.
func (s *testKV) HeadView(layer, block, head int) (k, v []float32, stride int) {
	ko, vo, n, stride := s.offsets(layer, block, head)
	return s.mem[ko : ko+n], s.mem[vo : vo+n], stride
}

// HeadViewBF16 implements KVBlocksBF16.
func (s *testKV) HeadViewBF16(layer, block, head int) (k, v []uint16, stride int) {
	ko, vo, n, stride := s.offsets(layer, block, head)
	return s.mem16[ko : ko+n], s.mem16[vo : vo+n], stride
}

// HeadViewFP8 implements KVBlocksFP8.
func (s *testKV) HeadViewFP8(layer, block, head int) (k, v []uint8, stride int) {
	ko, vo, n, stride := s.offsets(layer, block, head)
	return s.mem8[ko : ko+n], s.mem8[vo : vo+n], stride
}

// position returns copies of the K and V of (layer, head, pos) under block table blocks, as
// float32 (bfloat16 and FP8 values widened, the latter with scale 1).
func (s *testKV) position(blocks []int32, layer, head, pos int) (k, v []float32) {
	if s.mem8 != nil {
		kk, vv, stride := s.HeadViewFP8(layer, int(blocks[pos/s.blockSize]), head)
		o := (pos % s.blockSize) * stride
		for d := range s.headDim {
			k = append(k, s.fp8.ToF32(kk[o+d]))
			v = append(v, s.fp8.ToF32(vv[o+d]))
		}
		return k, v
	}
	if s.mem16 != nil {
		kk, vv, stride := s.HeadViewBF16(layer, int(blocks[pos/s.blockSize]), head)
		o := (pos % s.blockSize) * stride
		for d := range s.headDim {
			k = append(k, kernel.BF16ToF32(kk[o+d]))
			v = append(v, kernel.BF16ToF32(vv[o+d]))
		}
		return k, v
	}
	kk, vv, stride := s.HeadView(layer, int(blocks[pos/s.blockSize]), head)
	o := (pos % s.blockSize) * stride
	return append([]float32(nil), kk[o:o+s.headDim]...), append([]float32(nil), vv[o:o+s.headDim]...)
}

// blockRange returns the block ids first, first+1, ..., first+n-1.
func blockRange(first, n int) []int32 {
	b := make([]int32, n)
	for i := range b {
		b[i] = int32(first + i)
	}
	return b
}
