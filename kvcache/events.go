package kvcache

import (
	"encoding/binary"

	"github.com/kvbridge/kvbridge/internal/blockhash"
)

// The prefix cache's event log, kept when PoolConfig.RecordEvents is set: every block that enters
// the cache (Stored), leaves it (Removed: reused by Allocate, dropped by Evict) or the whole cache
// being dropped (Cleared, by ResetPrefixCache), in the order they happened, for the owner to drain
// with TakeEvents — the engine once per step, which publishes them as vLLM's KV cache events. The
// pool does no I/O: it only appends to a slice under its lock.

// EventKind is what happened to the prefix cache.
type EventKind uint8

// The kinds of Event, after vLLM's BlockStored, BlockRemoved and AllBlocksCleared.
const (
	// EventStored: a full block entered the prefix cache under Hash.
	EventStored EventKind = iota + 1
	// EventRemoved: the block cached under Hash left the prefix cache.
	EventRemoved
	// EventCleared: every block left the prefix cache at once.
	EventCleared
)

// String returns vLLM's name of the event kind.
func (k EventKind) String() string {
	switch k {
	case EventStored:
		return "BlockStored"
	case EventRemoved:
		return "BlockRemoved"
	case EventCleared:
		return "AllBlocksCleared"
	}
	return "EventKind(?)"
}

// Event is one change to the prefix cache.
type Event struct {
	Kind EventKind
	// Hash is the block's chain hash (Stored, Removed).
	Hash BlockHash
	// Parent is the chain hash of the block before it; the zero BlockHash for the first block
	// of a sequence (Stored, when Tokens is set).
	Parent BlockHash
	// Tokens are the block's token ids (Stored). They are nil for a block registered through
	// Cache, which does not know them (BlockTable.Commit always gives them); Parent is then
	// unknown too.
	Tokens []int32
	// External is the block's hash as consumers see it (Stored, Removed): vLLM's block hash as
	// a 64-bit integer when PoolConfig.EventHashes is set, else the last 8 bytes of Hash.
	External uint64
	// ParentExternal is External of the block before it (Stored, when Parent is not zero).
	ParentExternal uint64
}

// eventHashes is the hasher of a pool's events: cfg.EventHashes when the pool records events.
func eventHashes(cfg PoolConfig) *blockhash.Hasher {
	if !cfg.RecordEvents {
		return nil
	}
	return cfg.EventHashes
}

// External returns the fallback external hash of h: its last 8 bytes read big-endian, as vLLM's
// maybe_convert_block_hash reads a hash's bytes.
func (h BlockHash) External() uint64 { return binary.BigEndian.Uint64(h[len(h)-8:]) }

// TakeEvents returns the events recorded since the last call, oldest first, and forgets them. It
// returns nil when there are none or PoolConfig.RecordEvents is off.
func (p *Pool) TakeEvents() []Event {
	p.mu.Lock()
	defer p.mu.Unlock()
	evs := p.events
	p.events = nil
	return evs
}

// record appends ev to the event log if the pool keeps one. p.mu must be held.
func (p *Pool) record(ev Event) {
	if p.recordEvents {
		p.events = append(p.events, ev)
	}
}

// ResetPrefixCache drops every block from the prefix cache, as vLLM's reset_prefix_cache: only
// when no block is referenced (every request has finished), so no running request loses a block
// it matched. It reports whether it did; a reset records one EventCleared, and no EventRemoved
// for the blocks it drops.
func (p *Pool) ResetPrefixCache() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.free)+p.lru.n != p.n {
		return false
	}
	for p.lru.n > 0 {
		id := p.lru.head
		p.lru.remove(p.meta, id)
		m := &p.meta[id]
		delete(p.byHash, m.hash)
		m.hashed = false
		m.hash = BlockHash{}
		m.state = stateFree
		p.free.push(id)
	}
	p.record(Event{Kind: EventCleared})
	return true
}
