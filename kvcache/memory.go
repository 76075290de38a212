package kvcache

import (
	"fmt"
	"unsafe"
)

// AlignedMemory returns n zeroed bytes from the Go heap whose first byte is 64-byte aligned: pool
// memory for tests and for engines that do not register their KV with a transfer arena.
func AlignedMemory(n int) []byte {
	if n <= 0 {
		return nil
	}
	buf := make([]byte, n+63)
	off := 0
	if r := int(uintptr(unsafe.Pointer(unsafe.SliceData(buf))) % 64); r != 0 {
		off = 64 - r
	}
	return buf[off : off+n : off+n]
}

// Offset returns the byte offset of block id in the pool memory, id × BlockBytes, or -1 for an
// id out of range. Consecutive ids are adjacent ranges.
func (p *Pool) Offset(id int32) int64 {
	if id < 0 || int(id) >= p.n {
		return -1
	}
	return int64(id) * int64(p.bb)
}

// Bytes returns block id's memory (BlockBytes long, capacity-limited), or nil for an id out of
// range. Only a holder of a reference on the block should touch it.
func (p *Pool) Bytes(id int32) []byte {
	if id < 0 || int(id) >= p.n {
		return nil
	}
	off := int(id) * p.bb
	return p.mem[off : off+p.bb : off+p.bb]
}

// ReadBlock copies block id, which must be allocated, into dst (exactly BlockBytes long).
func (p *Pool) ReadBlock(id int32, dst []byte) error {
	if err := p.checkCopy("read", id, len(dst)); err != nil {
		return err
	}
	copy(dst, p.Bytes(id))
	return nil
}

// WriteBlock copies src (exactly BlockBytes long) into block id, which must be allocated.
func (p *Pool) WriteBlock(id int32, src []byte) error {
	if err := p.checkCopy("write", id, len(src)); err != nil {
		return err
	}
	copy(p.Bytes(id), src)
	return nil
}

// checkCopy validates a whole-block copy of n bytes to or from block id.
func (p *Pool) checkCopy(op string, id int32, n int) error {
	if n != p.bb {
		return fmt.Errorf("kvcache: %s block %d: buffer of %d bytes, block has %d: %w", op, id, n, p.bb, ErrBufferSize)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.checkUsed(op, id)
}

// HeadView returns the keys and values of KV head head in block block of layer layer, as views
// into the pool memory. The key of slot s (0 ≤ s < BlockSize) is k[s*stride : s*stride+HeadDim],
// likewise for v; stride is HeadDim for HND and NumKVHeads×HeadDim for NHD. It takes no lock and
// implements model.KVBlocks. Arguments out of range panic, as slice indexing does: the model only
// passes ids from block tables the engine built.
// It panics on a bfloat16 pool (see HeadViewBF16).
func (p *Pool) HeadView(layer, block, head int) (k, v []float32, stride int) {
	ko, vo, n, stride := p.headView(Float32, "HeadView", layer, block, head)
	return p.f32[ko : ko+n : ko+n], p.f32[vo : vo+n : vo+n], stride
}

// HeadViewBF16 is HeadView for a pool of bfloat16 values (the bits of each value). It panics on
// a float32 pool.
func (p *Pool) HeadViewBF16(layer, block, head int) (k, v []uint16, stride int) {
	ko, vo, n, stride := p.headView(BFloat16, "HeadViewBF16", layer, block, head)
	return p.u16[ko : ko+n : ko+n], p.u16[vo : vo+n : vo+n], stride
}

// headView checks a head view's arguments and returns the value offsets of its keys and values,
// their length and the stride.
func (p *Pool) headView(dtype DType, op string, layer, block, head int) (ko, vo, n, stride int) {
	g := p.geo
	if g.DType != dtype {
		panic(fmt.Sprintf("kvcache: %s on a pool of %v values", op, g.DType))
	}
	if layer < 0 || layer >= g.NumLayers || block < 0 || block >= p.n || head < 0 || head >= g.NumKVHeads {
		panic(fmt.Sprintf("kvcache: %s(layer %d, block %d, head %d) out of range (%d layers, %d blocks, %d heads)",
			op, layer, block, head, g.NumLayers, p.n, g.NumKVHeads))
	}
	stride = g.HeadDim
	if g.Layout == NHD {
		stride = g.NumKVHeads * g.HeadDim
	}
	n = (g.BlockSize-1)*stride + g.HeadDim
	base := block * g.blockValues()
	return base + g.vecIndex(g.Layout, layer, 0, head, 0), base + g.vecIndex(g.Layout, layer, 1, head, 0), n, stride
}
