package model

import (
	"cmp"
	"reflect"
	"slices"
	"sync"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// BlockGenerations is optionally implemented by a KVBlocks (kvcache.Pool implements it). A
// block's generation must change whenever its contents may change other than through Forward —
// in kvcache.Pool it increases on every allocation, and transfers only fill freshly allocated
// blocks before they are computed with. When the store implements it, Forward keeps the packed
// keys and values of fully computed 64-position chunks across steps (keyed by store, layer, head,
// block ids and generations), so decoding does not re-pack the whole context every step. The
// cached data is exactly what re-packing would produce, so results are unchanged.
type BlockGenerations interface {
	// Generations returns the generation of each block id.
	Generations(ids []int32) []uint64
}

// maxChunkBlocks is the most blocks a cacheable chunk may span (block size ≥ attnChunk/4).
const maxChunkBlocks = 4

// maxCachedStores bounds how many KV stores the cache holds entries (and references) for.
const maxCachedStores = 8

// DefaultPackedKVCacheBytes is the default budget of the packed-KV cache.
const DefaultPackedKVCacheBytes = 256 << 20

// packedKey identifies the contents of one chunk of one (layer, KV head) in one store.
type packedKey struct {
	store       KVBlocks
	layer, head int32
	off         int32 // slot of the chunk's first position in its first block
	n           int32 // blocks spanned
	ids         [maxChunkBlocks]int32
	gens        [maxChunkBlocks]uint64
}

// packedEntry is one cached chunk: its keys (outputs = keys) and transposed values.
type packedEntry struct {
	k, v  *kernel.Linear
	bytes int64
	used  uint64 // epoch of the last step that used it
}

// packedCache holds packed attention chunks across Forward calls. Safe for concurrent use.
type packedCache struct {
	mu      sync.Mutex
	budget  int64
	bytes   int64
	epoch   uint64
	entries map[packedKey]*packedEntry
	stores  map[KVBlocks]uint64 // store → epoch last seen
	// fullEpoch is the epoch in which eviction last found too little to evict; puts in that
	// epoch are dropped without scanning again.
	fullEpoch uint64
}

func newPackedCache(budget int64) *packedCache {
	if budget <= 0 {
		return nil
	}
	return &packedCache{budget: budget, entries: map[packedKey]*packedEntry{}, stores: map[KVBlocks]uint64{}}
}

// begin starts a step on store and returns its epoch, or ok=false if the store cannot be
// cached (it does not implement BlockGenerations, or its dynamic type is not comparable).
func (pc *packedCache) begin(store KVBlocks) (epoch uint64, ok bool) {
	if pc == nil {
		return 0, false
	}
	if _, gens := store.(BlockGenerations); !gens || !reflect.TypeOf(store).Comparable() {
		return 0, false
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	pc.epoch++
	if _, known := pc.stores[store]; !known && len(pc.stores) >= maxCachedStores {
		// Forget the least recently used store, releasing its entries and the reference.
		var oldest KVBlocks
		var oldestEpoch uint64
		for s, e := range pc.stores {
			if oldest == nil || e < oldestEpoch {
				oldest, oldestEpoch = s, e
			}
		}
		for k, e := range pc.entries {
			if k.store == oldest {
				pc.bytes -= e.bytes
				delete(pc.entries, k)
			}
		}
		delete(pc.stores, oldest)
	}
	pc.stores[store] = pc.epoch
	return pc.epoch, true
}

// get returns the entry for key, marking it used in epoch.
func (pc *packedCache) get(key packedKey, epoch uint64) (*packedEntry, bool) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	e, ok := pc.entries[key]
	if ok {
		e.used = max(e.used, epoch)
	}
	return e, ok
}

// put stores an entry, evicting entries not used in this epoch, least recently used first, to
// stay within the budget. If that is not enough the entry is not stored.
func (pc *packedCache) put(key packedKey, e *packedEntry, epoch uint64) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	e.used = epoch
	if old, ok := pc.entries[key]; ok {
		pc.bytes -= old.bytes
		delete(pc.entries, key)
	}
	if pc.bytes+e.bytes > pc.budget {
		if pc.fullEpoch == epoch {
			return
		}
		pc.evict(pc.bytes + e.bytes - pc.budget*9/10)
		if pc.bytes+e.bytes > pc.budget {
			pc.fullEpoch = epoch
			return
		}
	}
	pc.entries[key] = e
	pc.bytes += e.bytes
}

// evict drops at least need bytes of entries not used in the current epoch, oldest first, if
// there are enough. pc.mu must be held.
func (pc *packedCache) evict(need int64) {
	type victim struct {
		key  packedKey
		used uint64
	}
	var vs []victim
	for k, e := range pc.entries {
		if e.used < pc.epoch {
			vs = append(vs, victim{k, e.used})
		}
	}
	slices.SortFunc(vs, func(a, b victim) int { return cmp.Compare(a.used, b.used) })
	for _, v := range vs {
		if need <= 0 {
			return
		}
		e := pc.entries[v.key]
		pc.bytes -= e.bytes
		need -= e.bytes
		delete(pc.entries, v.key)
	}
}

// clear drops everything.
func (pc *packedCache) clear() {
	if pc == nil {
		return
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	clear(pc.entries)
	clear(pc.stores)
	pc.bytes = 0
}

// linearBytes returns the packed size of a Linear of out × in (panels of 64 outputs).
func linearBytes(out, in int) int64 {
	return 4 * int64((out+63)/64*64) * int64(in)
}
