package kvcache

import (
	"errors"
	"fmt"
)

// Match returns the blocks caching the longest prefix of hashes (a hash chain such as
// ChainHashes returns) and takes one reference on each; release them with Free. Matching stops
// at the first hash not in the cache. It returns nil when prefix caching is disabled.
func (p *Pool) Match(hashes []BlockHash) []int32 {
	if !p.prefix || len(hashes) == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var ids []int32
	for _, h := range hashes {
		id, ok := p.byHash[h]
		if !ok {
			break
		}
		m := &p.meta[id]
		if m.state == stateCachedFree {
			p.lru.remove(p.meta, id)
			m.state = stateUsed
		}
		m.ref++
		ids = append(ids, id)
	}
	return ids
}

// Lookup returns how many leading hashes are cached, like Match but without taking references.
func (p *Pool) Lookup(hashes []BlockHash) int {
	if !p.prefix {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, h := range hashes {
		if _, ok := p.byHash[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// Cache registers block id, which must hold a reference and contain the full block's KV, in the
// prefix cache under hash. It does nothing if another block already caches hash, if id is already
// cached under hash, or if prefix caching is disabled (the id is still checked). It fails for an
// id out of range (ErrBadBlock), a free block (ErrNotAllocated) or a block cached under another
// hash (ErrHashConflict). A block it registers is logged as EventStored (PoolConfig.RecordEvents)
// without its parent and tokens, which CacheBlock gives.
func (p *Pool) Cache(id int32, hash BlockHash) error {
	return p.cache(id, hash, Event{Kind: EventStored, Hash: hash, External: hash.External()})
}

// CacheBlock is Cache for a block whose chain parent and tokens are known (BlockTable.Commit's
// case): the Stored event it records (PoolConfig.RecordEvents) carries them, as vLLM's
// BlockStored does. The event holds a copy of tokens, and the fallback external hashes
// (PoolConfig.EventHashes is BlockTable.Commit's to apply).
func (p *Pool) CacheBlock(id int32, parent, hash BlockHash, tokens []int32) error {
	return p.cache(id, hash, Event{Kind: EventStored, Hash: hash, Parent: parent, Tokens: tokens,
		External: hash.External(), ParentExternal: parent.External()})
}

// cache is Cache, recording stored when the block enters the prefix cache.
func (p *Pool) cache(id int32, hash BlockHash, stored Event) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.checkUsed("cache", id); err != nil {
		return err
	}
	if !p.prefix {
		return nil
	}
	m := &p.meta[id]
	if m.hashed {
		if m.hash == hash {
			return nil
		}
		return fmt.Errorf("kvcache: cache block %d as %v: cached as %v: %w", id, hash, m.hash, ErrHashConflict)
	}
	if _, ok := p.byHash[hash]; ok {
		return nil
	}
	m.hashed = true
	m.hash = hash
	m.ext = stored.External
	p.byHash[hash] = id
	if p.recordEvents && stored.Tokens != nil {
		stored.Tokens = append([]int32(nil), stored.Tokens...)
	}
	p.record(stored)
	return nil
}

// Evict removes blocks from the prefix cache, for example after a failed KV load wrote unknown
// bytes into them. References are unchanged: a block in use stays in use, and a cached free block
// becomes an ordinary free block. Ids that are not cached are ignored; ids out of range are
// reported with ErrBadBlock and skipped.
func (p *Pool) Evict(ids ...int32) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, id := range ids {
		if id < 0 || int(id) >= p.n {
			errs = append(errs, fmt.Errorf("kvcache: evict block %d of %d: %w", id, p.n, ErrBadBlock))
			continue
		}
		m := &p.meta[id]
		if !m.hashed {
			continue
		}
		p.uncache(id)
		if m.state == stateCachedFree {
			p.lru.remove(p.meta, id)
			m.state = stateFree
			p.free.push(id)
		}
	}
	return errors.Join(errs...)
}

// uncache drops block id's hash from the prefix cache, recording EventRemoved. p.mu must be held.
func (p *Pool) uncache(id int32) {
	m := &p.meta[id]
	if !m.hashed {
		return
	}
	p.record(Event{Kind: EventRemoved, Hash: m.hash, External: m.ext})
	delete(p.byHash, m.hash)
	m.hashed = false
	m.hash = BlockHash{}
	m.ext = 0
}
