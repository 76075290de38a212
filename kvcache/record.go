package kvcache

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"
	"unsafe"
)

// A block record is what a pool publishes about each of its blocks, in memory a transfer
// engine registers for remote READs (PoolConfig.RecordTable), so that a reader can check what it
// read against what the block's owner says — never against what a request claims:
//
//	offset  size  field
//	0       8     generation (uint64 LE): bumped by every allocation of the block
//	8       4     count (uint32 LE): tokens the hash covers; 0 = no content published
//	12      4     reserved, zero
//	16      16    hash: NextHash(parent, the block's first count tokens), parent being the
//	              chain hash of the blocks before it (the zero hash for the first block)
//
// A full block's hash is its prefix-cache chain hash (ChainHashes); a partial block's is the
// same function over the tokens it holds, which count pins down. Allocate publishes the new
// generation with count and hash zeroed before the block is handed out; Publish fills them in
// once the block's KV is final.

// RecordBytes is the size of one block record.
const RecordBytes = 32

// Record is a decoded block record.
type Record struct {
	// Gen is the block's allocation generation.
	Gen uint64
	// Count is the number of tokens Hash covers; 0 when no content is published.
	Count int
	// Hash is the chain hash of the block's first Count tokens.
	Hash BlockHash
}

// DecodeRecord decodes the RecordBytes at the start of b (which must hold that many).
func DecodeRecord(b []byte) Record {
	var r Record
	r.Gen = binary.LittleEndian.Uint64(b[0:8])
	r.Count = int(binary.LittleEndian.Uint32(b[8:12]))
	copy(r.Hash[:], b[16:32])
	return r
}

// recordTable is the pool's view of PoolConfig.RecordTable.
type recordTable struct {
	mem []byte
	gen []uint64 // the generation words, stride RecordBytes/8
}

func newRecordTable(mem []byte, n int) (*recordTable, error) {
	if len(mem) < RecordBytes*n || uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%8 != 0 {
		return nil, fmt.Errorf("kvcache: record table of %d bytes for %d blocks (need %d, 8-byte aligned): %w", len(mem), n, RecordBytes*n, ErrMemory)
	}
	mem = mem[:RecordBytes*n]
	clear(mem)
	return &recordTable{mem: mem, gen: unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(mem))), len(mem)/8)}, nil
}

// allocated publishes block id's new generation with no content. The pool's lock is held.
func (t *recordTable) allocated(id int32, gen uint64) {
	r := t.mem[int(id)*RecordBytes : (int(id)+1)*RecordBytes]
	clear(r[8:])
	atomic.StoreUint64(&t.gen[int(id)*RecordBytes/8], gen)
}

// publish writes block id's content fields. The pool's lock is held.
func (t *recordTable) publish(id int32, count int, hash BlockHash) {
	r := t.mem[int(id)*RecordBytes : (int(id)+1)*RecordBytes]
	binary.LittleEndian.PutUint32(r[8:12], uint32(count))
	copy(r[16:32], hash[:])
}

// Publish records, in block id's published record, that its KV holds count tokens whose chain
// hash is hash (see the record layout above). The block must be referenced by the caller and
// its KV final: nothing may write those positions again while this allocation lasts. It does
// nothing without a record table, and fails for an id out of range (ErrBadBlock), a free block
// (ErrNotAllocated) or a count outside [1, block size].
func (p *Pool) Publish(id int32, count int, hash BlockHash) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.checkUsed("publish", id); err != nil {
		return err
	}
	if count < 1 || count > p.geo.BlockSize {
		return fmt.Errorf("kvcache: publish block %d with %d tokens (block size %d): %w", id, count, p.geo.BlockSize, ErrBadBlock)
	}
	if p.recs != nil {
		p.recs.publish(id, count, hash)
	}
	return nil
}

// PublishChain publishes the records of the blocks holding tokens, in order: every full block
// with its chain hash and a trailing partial block with the hash of the tokens it holds. blocks
// must cover the tokens and be referenced by the caller, their KV final. It returns the chain
// hashes of the full blocks, as ChainHashes(tokens, block size) would.
func (p *Pool) PublishChain(blocks []int32, tokens []int32) ([]BlockHash, error) {
	bs := p.geo.BlockSize
	var chain []BlockHash
	if n := len(tokens) / bs; n > 0 {
		chain = make([]BlockHash, 0, n)
	}
	var parent BlockHash
	for i := 0; i*bs < len(tokens); i++ {
		if i >= len(blocks) {
			return nil, fmt.Errorf("kvcache: %d tokens need %d blocks, %d given: %w", len(tokens), (len(tokens)+bs-1)/bs, len(blocks), ErrBadBlock)
		}
		part := tokens[i*bs : min((i+1)*bs, len(tokens))]
		parent = NextHash(parent, part)
		if err := p.Publish(blocks[i], len(part), parent); err != nil {
			return nil, err
		}
		if len(part) == bs {
			chain = append(chain, parent)
		}
	}
	return chain, nil
}
