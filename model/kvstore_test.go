package model

// testKV is a paged KV store for tests: numBlocks blocks, each [layer][k,v] with the heads in
// HND ([head][slot][dim]) or NHD ([slot][head][dim]) order, like kvcache's blocks.
type testKV struct {
	layers, heads, headDim, blockSize int
	nhd                               bool
	mem                               []float32
}

func newTestKV(c Config, blockSize, numBlocks int, nhd bool) *testKV {
	return &testKV{
		layers: c.NumLayers, heads: c.NumKVHeads, headDim: c.HeadDim, blockSize: blockSize, nhd: nhd,
		mem: make([]float32, numBlocks*c.NumLayers*2*c.NumKVHeads*blockSize*c.HeadDim),
	}
}

// HeadView implements KVBlocks.
func (s *testKV) HeadView(layer, block, head int) (k, v []float32, stride int) {
	part := s.heads * s.blockSize * s.headDim
	base := (block*s.layers + layer) * 2 * part
	kp, vp := s.mem[base:base+part], s.mem[base+part:base+2*part]
	if s.nhd {
		o := head * s.headDim
		return kp[o:], vp[o:], s.heads * s.headDim
	}
	o := head * s.blockSize * s.headDim
	return kp[o : o+s.blockSize*s.headDim], vp[o : o+s.blockSize*s.headDim], s.headDim
}

// position returns copies of the K and V of (layer, head, pos) under block table blocks.
func (s *testKV) position(blocks []int32, layer, head, pos int) (k, v []float32) {
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
