package kvcache

import (
	"fmt"

	"github.com/kvbridge/kvbridge/internal/blockhash"
)

// BlockTable is one request's KV blocks: the block ids in position order (position q lives in
// block IDs()[q/BlockSize], slot q%BlockSize), the hash chain of its full blocks, and how many
// leading blocks are registered in the prefix cache. It is a plain data structure for one owner
// (the engine's scheduler); it is not safe for concurrent use and does no I/O. The zero value is
// not usable; make one with NewBlockTable.
type BlockTable struct {
	blockSize int
	ids       []int32
	hashes    []BlockHash // chain of the first len(hashes) full blocks of the request's tokens
	// vhashes is vLLM's chain of the same blocks (blockhash), kept only for a pool whose events
	// carry it (PoolConfig.EventHashes); len(vhashes) ≤ len(hashes).
	vhashes   []blockhash.Hash
	numCached int // leading blocks registered in (or taken from) the prefix cache
}

// NewBlockTable returns an empty table for blocks of blockSize tokens (blockSize > 0).
func NewBlockTable(blockSize int) *BlockTable {
	if blockSize <= 0 {
		blockSize = 1
	}
	return &BlockTable{blockSize: blockSize}
}

// BlockSize returns the block size in tokens.
func (t *BlockTable) BlockSize() int { return t.blockSize }

// IDs returns the block ids in position order. The slice is the table's own: do not modify it.
func (t *BlockTable) IDs() []int32 { return t.ids }

// Len returns the number of blocks.
func (t *BlockTable) Len() int { return len(t.ids) }

// Slots returns how many token positions the blocks hold.
func (t *BlockTable) Slots() int { return len(t.ids) * t.blockSize }

// Hashes returns the hash chain computed so far (full blocks only). Do not modify it.
func (t *BlockTable) Hashes() []BlockHash { return t.hashes }

// NumCached returns the number of leading blocks that are in the prefix cache: matched by
// MatchPrefix or registered by Commit.
func (t *BlockTable) NumCached() int { return t.numCached }

// BlocksFor returns how many blocks must be appended for positions [0, numTokens) to fit.
func (t *BlockTable) BlocksFor(numTokens int) int {
	need := (numTokens + t.blockSize - 1) / t.blockSize
	return max(need-len(t.ids), 0)
}

// Append adds freshly allocated blocks at the end of the table.
func (t *BlockTable) Append(ids ...int32) { t.ids = append(t.ids, ids...) }

// MatchPrefix looks up the longest cached prefix of tokens (a new request's prompt) and takes
// those blocks into the empty table, returning the number of tokens they cover. At least one
// token is always left to compute (vLLM recomputes the last prompt token for its logits), so a
// prompt that is an exact multiple of the block size matches one block fewer at most. The hash
// chain of every full block of tokens is kept for Commit. On a table that already has blocks it
// changes nothing and returns the number of tokens its cached blocks cover.
func (t *BlockTable) MatchPrefix(p *Pool, tokens []int32) int {
	if len(t.ids) != 0 {
		return t.numCached * t.blockSize
	}
	t.hashes = AppendChainHashes(t.hashes[:0], BlockHash{}, tokens, t.blockSize)
	t.vhashes = t.vhashes[:0]
	limit := 0
	if len(tokens) > 0 {
		limit = min((len(tokens)-1)/t.blockSize, len(t.hashes))
	}
	t.ids = append(t.ids, p.Match(t.hashes[:limit])...)
	t.numCached = len(t.ids)
	return t.numCached * t.blockSize
}

// Commit registers in the prefix cache the blocks that became full: those whose every position
// is below numComputed (the positions whose KV has been written). tokens is the request's token
// sequence so far (prompt then output), of which the first numComputed have KV. It extends the
// hash chain as needed. Blocks are committed at most once.
func (t *BlockTable) Commit(p *Pool, tokens []int32, numComputed int) error {
	full := min(numComputed, len(tokens)) / t.blockSize
	full = min(full, len(t.ids))
	if full <= t.numCached {
		return nil
	}
	if len(t.hashes) < full {
		var parent BlockHash
		if n := len(t.hashes); n > 0 {
			parent = t.hashes[n-1]
		}
		start := len(t.hashes) * t.blockSize
		t.hashes = AppendChainHashes(t.hashes, parent, tokens[start:full*t.blockSize], t.blockSize)
	}
	ext := t.externals(p, tokens, full)
	for i := t.numCached; i < full; i++ {
		var parent BlockHash
		if i > 0 {
			parent = t.hashes[i-1]
		}
		ev := Event{Kind: EventStored, Hash: t.hashes[i], Parent: parent, Tokens: tokens[i*t.blockSize : (i+1)*t.blockSize],
			External: t.hashes[i].External(), ParentExternal: parent.External()}
		if ext != nil {
			ev.External = ext[i].External()
			if i > 0 {
				ev.ParentExternal = ext[i-1].External()
			}
		}
		if err := p.cache(t.ids[i], t.hashes[i], ev); err != nil {
			t.numCached = i
			return fmt.Errorf("kvcache: commit block %d of the table: %w", i, err)
		}
	}
	t.numCached = full
	return nil
}

// externals returns vLLM's hash chain of the first full blocks of tokens, extending the table's
// as needed, or nil when p's events do not carry it.
func (t *BlockTable) externals(p *Pool, tokens []int32, full int) []blockhash.Hash {
	h := p.eventHashes
	if h == nil {
		return nil
	}
	for i := len(t.vhashes); i < full; i++ {
		blk := tokens[i*t.blockSize : (i+1)*t.blockSize]
		if i == 0 {
			t.vhashes = append(t.vhashes, h.First(blk))
		} else {
			t.vhashes = append(t.vhashes, h.Next(t.vhashes[i-1], blk))
		}
	}
	return t.vhashes
}

// EvictFrom removes the blocks from index first on from the prefix cache (their KV is bad, for
// example after a failed load) and lowers NumCached to first, so a later Commit, after the KV has
// been recomputed, registers them again. The blocks stay in the table.
func (t *BlockTable) EvictFrom(p *Pool, first int) error {
	first = max(first, 0)
	if first >= len(t.ids) {
		return nil
	}
	t.numCached = min(t.numCached, first)
	return p.Evict(t.ids[first:]...)
}

// Release frees every block of the table (tail blocks become reusable first) and empties it.
func (t *BlockTable) Release(p *Pool) error {
	err := p.Free(t.ids...)
	t.ids = t.ids[:0]
	t.hashes = t.hashes[:0]
	t.vhashes = t.vhashes[:0]
	t.numCached = 0
	return err
}
