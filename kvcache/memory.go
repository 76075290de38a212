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

// Bytes returns block id's memory (BlockBytes long, capacity-limited; rank 0's with tensor
// parallelism), or nil for an id out of range. Only a holder of a reference on the block should touch it.
func (p *Pool) Bytes(id int32) []byte {
	if id < 0 || int(id) >= p.n {
		return nil
	}
	return p.shards[0].Bytes(id)
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
// into the pool memory (rank 0's with tensor parallelism: Shard). The key of slot s
// (0 ≤ s < BlockSize) is k[s*stride : s*stride+HeadDim], likewise for v; stride is HeadDim for
// HND and NumKVHeads×HeadDim for NHD. It takes no lock and implements model.KVBlocks. Arguments
// out of range panic, as slice indexing does: the model only passes ids from block tables the
// engine built. It panics on a bfloat16 pool (see HeadViewBF16).
func (p *Pool) HeadView(layer, block, head int) (k, v []float32, stride int) {
	return p.shards[0].HeadView(layer, block, head)
}

// HeadViewBF16 is HeadView for a pool of bfloat16 values (the bits of each value). It panics on
// a float32 pool.
func (p *Pool) HeadViewBF16(layer, block, head int) (k, v []uint16, stride int) {
	return p.shards[0].HeadViewBF16(layer, block, head)
}
