package connector

import (
	"fmt"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/transfer"
)

// maxBlockRatio bounds how many smaller remote blocks make one local block (heterogeneous
// block sizes, docs/architecture.md, "Heterogeneous KV geometry"); it sizes the scratch area
// that receives remote records.
const maxBlockRatio = 16

// slotBytes is the size of one lease slot: the lease's 16-byte tag (kvlease.Tag), then zeros.
const slotBytes = kvcache.RecordBytes

// ArenaLayout places a connector's memory in one shared arena: the KV blocks at offset 0, then
// the metadata peers read after the blocks — the pool's block records (kvcache.RecordBytes per
// block: generation, token count and content hash) followed by the lease slots (one per block:
// the tag of the lease using the slot, zero when free) — then a private scratch area that
// receives the records and slots read from peers.
type ArenaLayout struct {
	BlocksBytes   int64
	MetaOffset    int64 // block records, then lease slots
	RecordsBytes  int64
	SlotsBytes    int64
	ScratchOffset int64
	ScratchBytes  int64
	Size          int64
	NumBlocks     int
}

// NewArenaLayout returns the layout for numBlocks blocks of blockBytes bytes.
func NewArenaLayout(blockBytes, numBlocks int) ArenaLayout {
	align := func(n int64) int64 { return (n + 4095) &^ 4095 }
	l := ArenaLayout{BlocksBytes: int64(blockBytes) * int64(numBlocks), NumBlocks: numBlocks}
	l.MetaOffset = align(l.BlocksBytes)
	l.RecordsBytes = kvcache.RecordBytes * int64(numBlocks)
	l.SlotsBytes = slotBytes * int64(numBlocks)
	l.ScratchOffset = align(l.MetaOffset + l.RecordsBytes + l.SlotsBytes)
	l.ScratchBytes = kvcache.RecordBytes * int64(l.scratchEntries())
	l.Size = align(l.ScratchOffset + l.ScratchBytes)
	return l
}

// scratchEntries is the number of record-sized scratch entries: maxBlockRatio per local block
// (the records of the remote blocks read into it), then one per local block (the slot read by
// the load whose first local block it is).
func (l ArenaLayout) scratchEntries() int { return l.NumBlocks*maxBlockRatio + l.NumBlocks }

// RecordTable returns the slice of arena memory the pool publishes its block records into
// (kvcache.PoolConfig.RecordTable).
func (l ArenaLayout) RecordTable(arena []byte) []byte {
	return arena[l.MetaOffset : l.MetaOffset+l.RecordsBytes]
}

// slots returns the lease slots in arena.
func (l ArenaLayout) slots(arena []byte) []byte {
	off := l.MetaOffset + l.RecordsBytes
	return arena[off : off+l.SlotsBytes]
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

func encodeMetadata(hash string, meta agentMetadata) (handshakePayload, error) {
	b, err := msgpack.Marshal(meta)
	if err != nil {
		return handshakePayload{}, fmt.Errorf("connector: encode agent metadata: %w", err)
	}
	return handshakePayload{CompatibilityHash: hash, AgentMetadataBytes: b}, nil
}
