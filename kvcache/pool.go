package kvcache

import (
	"errors"
	"fmt"
	"github.com/kvbridge/kvbridge/internal/blockhash"
	"sync"
	"unsafe"
)

// PoolConfig configures a Pool.
type PoolConfig struct {
	// Geometry is the shape of every block.
	Geometry Geometry
	// NumBlocks is the number of blocks; 0 means as many as fit in the memory.
	NumBlocks int
	// PrefixCaching enables block-level prefix caching. When false, Match finds nothing and
	// Cache does nothing.
	PrefixCaching bool
	// RecordTable, if non-nil, is memory (RecordBytes per block, 8-byte aligned, usually in the
	// same shared arena as the blocks) where the pool publishes each block's record (see
	// record.go): its generation whenever it changes, before the block is handed out, and its
	// content hash once Publish is called. A remote reader that reads a block and then its
	// record knows whether the block holds what it expects.
	RecordTable []byte
	// RecordEvents keeps a log of the prefix cache's changes for TakeEvents (events.go): the
	// source of the KV cache events an engine publishes. Off, the pool records nothing.
	RecordEvents bool
	// RankMemory is, with tensor parallelism, the memory of ranks 1, 2, … (NewPool's mem is rank
	// 0's), each like mem: 64-byte aligned, at least NumBlocks × BlockBytes, and a region of its
	// own (a transfer arena per rank). Every block id then stands for one block in each rank's
	// memory, holding the KV heads that rank owns (Geometry.NumKVHeads counts one rank's heads);
	// the allocator, the prefix cache and the record table are the pool's, shared by the ranks.
	// Shard(r) views rank r's memory. Empty: one rank, the pool as it always was.
	RankMemory [][]byte
	// EventHashes computes the block hashes the event log carries (Event.External): vLLM's, so
	// that consumers can hash prompts as they would for vLLM engines. nil: the last 8 bytes of
	// each BlockHash. Only BlockTable.Commit computes vLLM's chain (it knows every block before);
	// a block registered by Cache or CacheBlock directly carries the fallback.
	EventHashes *blockhash.Hasher
}

// Pool is a paged KV block pool over caller-owned memory. All methods are safe for concurrent
// use. The block contents are not guarded: whoever holds a reference on a block reads and writes
// its bytes (HeadView, Bytes, ReadBlock, WriteBlock) without the pool's lock.
type Pool struct {
	geo    Geometry
	bb     int // block bytes
	n      int // number of blocks
	prefix bool
	shards []*Shard // each tensor-parallel rank's memory; shards[0] is NewPool's mem

	mu     sync.Mutex
	meta   []blockMeta
	free   idHeap // uncached free blocks
	lru    lruList
	byHash map[BlockHash]int32 // prefix cache: hash → block
	recs   *recordTable        // published records (PoolConfig.RecordTable), or nil

	recordEvents bool              // PoolConfig.RecordEvents
	eventHashes  *blockhash.Hasher // PoolConfig.EventHashes, nil unless recordEvents
	events       []Event           // recorded since the last TakeEvents
}

// NewPool makes a pool over mem, which must be 64-byte aligned and hold at least
// NumBlocks × BlockBytes bytes (a transfer arena, or AlignedMemory). The pool uses only that
// prefix of mem; the caller keeps ownership and must keep mem alive while the pool is in use.
// Every block starts free.
func NewPool(mem []byte, cfg PoolConfig) (*Pool, error) {
	g := cfg.Geometry
	if err := g.Validate(); err != nil {
		return nil, err
	}
	if !littleEndian() {
		return nil, fmt.Errorf("kvcache: big-endian hosts are not supported: %w", ErrMemory)
	}
	bb := g.BlockBytes()
	n := cfg.NumBlocks
	if n < 0 {
		return nil, fmt.Errorf("kvcache: %d blocks: %w", n, ErrGeometry)
	}
	if n == 0 {
		n = len(mem) / bb
		if n == 0 {
			return nil, fmt.Errorf("kvcache: memory of %d bytes holds no block of %d bytes: %w", len(mem), bb, ErrMemory)
		}
	}
	if n > maxBlocks || n > len(mem)/bb {
		return nil, fmt.Errorf("kvcache: %d blocks of %d bytes need %d bytes, memory has %d: %w",
			n, bb, int64(n)*int64(bb), len(mem), ErrMemory)
	}
	shards := make([]*Shard, 0, 1+len(cfg.RankMemory))
	for r, m := range append([][]byte{mem}, cfg.RankMemory...) {
		sh, err := newShard(m, g, n)
		if err != nil {
			return nil, fmt.Errorf("kvcache: rank %d: %w", r, err)
		}
		shards = append(shards, sh)
	}
	var recs *recordTable
	if t := cfg.RecordTable; t != nil {
		var err error
		if recs, err = newRecordTable(t, n); err != nil {
			return nil, err
		}
	}
	p := &Pool{
		recs:         recs,
		recordEvents: cfg.RecordEvents,
		eventHashes:  eventHashes(cfg),
		geo:          g,
		bb:           bb,
		n:            n,
		prefix:       cfg.PrefixCaching,
		shards:       shards,
		meta:         make([]blockMeta, n),
		free:         make(idHeap, 0, n),
		lru:          newLRU(),
		byHash:       make(map[BlockHash]int32),
	}
	for i := range n {
		p.meta[i].prev, p.meta[i].next = noBlock, noBlock
		p.free = append(p.free, int32(i)) // ascending order is a valid min-heap
	}
	return p, nil
}

// maxBlocks keeps block ids within int32.
const maxBlocks = 1<<31 - 1

// littleEndian reports whether the host stores integers little-endian (the block format is
// little-endian float32 or bfloat16 and the pool views memory as native values).
func littleEndian() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}

// Geometry returns the block geometry.
func (p *Pool) Geometry() Geometry { return p.geo }

// BlockBytes returns the size of one block in bytes.
func (p *Pool) BlockBytes() int { return p.bb }

// NumBlocks returns the number of blocks in the pool.
func (p *Pool) NumBlocks() int { return p.n }

// PrefixCaching reports whether prefix caching is enabled.
func (p *Pool) PrefixCaching() bool { return p.prefix }

// NumFree returns the number of blocks with no reference, cached or not. After every request
// has finished, NumFree() == NumBlocks().
func (p *Pool) NumFree() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.free) + p.lru.n
}

// NumCached returns the number of blocks registered in the prefix cache (in use or free).
func (p *Pool) NumCached() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.byHash)
}

// Usage returns the fraction of blocks in use (referenced), in [0, 1], like vLLM's
// vllm:kv_cache_usage_perc: cached free blocks count as free.
func (p *Pool) Usage() float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return 1 - float64(len(p.free)+p.lru.n)/float64(p.n)
}

// Allocate takes n free blocks, each with reference count 1 and a new generation. Blocks that
// hold no cached prefix are used first, lowest id first; then cached free blocks, least recently
// freed first, which leave the prefix cache. If fewer than n blocks are free (or n < 0) it
// allocates nothing and returns an error wrapping ErrNoSpace. Allocate(0) returns nil, nil.
func (p *Pool) Allocate(n int) ([]int32, error) {
	if n <= 0 {
		if n < 0 {
			return nil, fmt.Errorf("kvcache: allocate %d blocks: negative count: %w", n, ErrNoSpace)
		}
		return nil, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if free := len(p.free) + p.lru.n; n > free {
		return nil, fmt.Errorf("kvcache: allocate %d blocks, %d free of %d: %w", n, free, p.n, ErrNoSpace)
	}
	ids := make([]int32, n)
	for i := range ids {
		var id int32
		if len(p.free) > 0 {
			id = p.free.pop()
		} else {
			id = p.lru.head
			p.lru.remove(p.meta, id)
			p.uncache(id)
		}
		m := &p.meta[id]
		m.ref = 1
		m.state = stateUsed
		m.gen++
		if p.recs != nil {
			p.recs.allocated(id, m.gen)
		}
		ids[i] = id
	}
	return ids, nil
}

// Free drops one reference on each block. Blocks whose count reaches zero become free; a cached
// block stays in the prefix cache until its memory is reused. Blocks are released in reverse
// argument order, so passing a request's block table in position order makes its tail blocks
// the first cached ones to be reused (a prefix is worth more than a suffix).
//
// An id out of range (ErrBadBlock) or without a reference (ErrNotAllocated, a double free) is a
// caller bug: it is skipped and reported in the returned error; the other ids are freed.
func (p *Pool) Free(ids ...int32) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for i := len(ids) - 1; i >= 0; i-- {
		id := ids[i]
		if err := p.checkUsed("free", id); err != nil {
			errs = append(errs, err)
			continue
		}
		m := &p.meta[id]
		m.ref--
		if m.ref > 0 {
			continue
		}
		if m.hashed {
			m.state = stateCachedFree
			p.lru.pushBack(p.meta, id)
		} else {
			m.state = stateFree
			p.free.push(id)
		}
	}
	return errors.Join(errs...)
}

// checkUsed returns an error unless id is in range and referenced. p.mu must be held.
func (p *Pool) checkUsed(op string, id int32) error {
	if id < 0 || int(id) >= p.n {
		return fmt.Errorf("kvcache: %s block %d of %d: %w", op, id, p.n, ErrBadBlock)
	}
	if p.meta[id].ref <= 0 {
		return fmt.Errorf("kvcache: %s block %d: %w", op, id, ErrNotAllocated)
	}
	return nil
}

// Generation returns the allocation generation of block id: it increases every time the block
// is allocated, so a reader that recorded it can tell whether the block was freed and reused
// since. Taking a reference through Match does not change it (the content is kept). It returns 0
// for an id out of range or a block never allocated.
func (p *Pool) Generation(id int32) uint64 {
	if id < 0 || int(id) >= p.n {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.meta[id].gen
}

// Generations returns Generation of each id, under one lock.
func (p *Pool) Generations(ids []int32) []uint64 {
	gens := make([]uint64, len(ids))
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, id := range ids {
		if id >= 0 && int(id) < p.n {
			gens[i] = p.meta[id].gen
		}
	}
	return gens
}
