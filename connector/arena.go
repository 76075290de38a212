package connector

import (
	"fmt"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/transfer"
)

// maxBlockRatio bounds how many smaller remote blocks make one local block (heterogeneous
// block sizes, spec §8.2); it sizes the scratch area that receives remote generations.
const maxBlockRatio = 16

// ArenaLayout places a connector's memory in one shared arena: the KV blocks at offset 0, then
// the table where the pool publishes each block's generation (peers read it after the blocks to
// detect reuse), then a private scratch area that receives the generations read from peers.
type ArenaLayout struct {
	BlocksBytes   int64
	GenOffset     int64
	GenBytes      int64
	ScratchOffset int64
	ScratchBytes  int64
	Size          int64
}

// NewArenaLayout returns the layout for numBlocks blocks of blockBytes bytes.
func NewArenaLayout(blockBytes, numBlocks int) ArenaLayout {
	align := func(n int64) int64 { return (n + 4095) &^ 4095 }
	l := ArenaLayout{BlocksBytes: int64(blockBytes) * int64(numBlocks)}
	l.GenOffset = align(l.BlocksBytes)
	l.GenBytes = 8 * int64(numBlocks)
	l.ScratchOffset = align(l.GenOffset + l.GenBytes)
	l.ScratchBytes = 8 * int64(numBlocks) * maxBlockRatio
	l.Size = align(l.ScratchOffset + l.ScratchBytes)
	return l
}

// GenerationTable returns the slice of arena memory the pool publishes generations into.
func (l ArenaLayout) GenerationTable(arena []byte) []byte {
	return arena[l.GenOffset : l.GenOffset+l.GenBytes]
}

func (l ArenaLayout) check(p *kvcache.Pool, a *transfer.Arena) error {
	want := NewArenaLayout(p.BlockBytes(), p.NumBlocks())
	if l != want {
		return fmt.Errorf("connector: arena layout %+v does not match the pool (want %+v)", l, want)
	}
	if a.Size() < l.Size {
		return fmt.Errorf("connector: arena of %d bytes, layout needs %d", a.Size(), l.Size)
	}
	if &a.Bytes()[0] != &p.Bytes(0)[0] {
		return fmt.Errorf("connector: the pool's blocks are not at the start of the arena")
	}
	return nil
}

// u64s views 8-byte-aligned memory as uint64s.
func u64s(b []byte) []uint64 {
	return unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/8)
}

func encodeMetadata(hash string, meta AgentMetadata) (handshakePayload, error) {
	b, err := msgpack.Marshal(meta)
	if err != nil {
		return handshakePayload{}, fmt.Errorf("connector: encode agent metadata: %w", err)
	}
	return handshakePayload{CompatibilityHash: hash, AgentMetadataBytes: b}, nil
}
