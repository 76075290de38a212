package connector

import (
	"fmt"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/transfer"
)

// KV between tensor-parallel ranks (docs/architecture.md, "KV between tensor-parallel ranks").
// An engine has one transfer agent whatever its TP size: its ranks are goroutines of one
// process, so one agent, one control connection per peer, one lease and one notification per
// request serve them all. Each rank's KV memory is a region of that agent, named in the
// handshake metadata (agentMetadata.KVRegion for rank 0, RankKVRegions for the others). A
// load reads each local rank's heads from the producer rank(s) that hold them and posts the
// producer's notification only once every rank's reads are done.

// maxRemoteTP bounds the tensor-parallel size a peer may publish (it sizes the descriptor lists
// prepared for it, one per rank).
const maxRemoteTP = 256

// maxTPDescs bounds the descriptors a heterogeneous-TP handshake prepares for one producer rank
// (blocks × layers × K/V × head chunks).
const maxTPDescs = 1 << 22

// checkRankArenas checks that arenas hold the pool's tensor-parallel ranks 1, 2, … at offset 0.
func checkRankArenas(p *kvcache.Pool, arenas []*transfer.Arena) error {
	if len(arenas) != p.TensorParallelSize()-1 {
		return fmt.Errorf("connector: %d rank arenas for a pool of %d tensor-parallel ranks (want %d)",
			len(arenas), p.TensorParallelSize(), p.TensorParallelSize()-1)
	}
	for i, a := range arenas {
		s := p.Shard(i + 1)
		if a.Size() < int64(p.BlockBytes())*int64(p.NumBlocks()) || &a.Bytes()[0] != &s.Bytes(0)[0] {
			return fmt.Errorf("connector: the KV memory of tensor-parallel rank %d is not at the start of its arena", i+1)
		}
	}
	return nil
}

// tpMap pairs this engine's tensor-parallel ranks with a producer's when their TP sizes
// differ. A rank of an engine at TP n holds the model's K KV heads [r·K/n, (r+1)·K/n), or,
// when n > K (n a multiple of K), the one head r·K/n, replicated (as vLLM shards them). Heads
// move in chunks of unit heads, the smaller of the two engines' heads per rank: a chunk is
// contiguous in both ranks' blocks in the HND layout, for each layer's keys and values.
type tpMap struct {
	localTP, remoteTP       int
	localHeads, remoteHeads int // KV heads per rank
	total                   int // the model's KV heads
	unit                    int // heads per chunk
}

// headsPerRank returns the KV heads one rank of an engine at TP tp holds, or 0 when the model's
// total KV heads cannot be sharded over tp ranks.
func headsPerRank(total, tp int) int {
	switch {
	case tp <= 0 || total <= 0:
		return 0
	case tp <= total && total%tp == 0:
		return total / tp
	case tp > total && tp%total == 0:
		return 1
	}
	return 0
}

// newTPMap checks that a producer at TP remoteTP with remoteHeads KV heads per rank can feed
// this engine (TP localTP, localHeads per rank) of a model with total KV heads, and returns
// the mapping. Errors wrap ErrIncompatible.
func newTPMap(localTP, localHeads, remoteTP, remoteHeads, total int) (tpMap, error) {
	m := tpMap{localTP: localTP, remoteTP: remoteTP, localHeads: localHeads, remoteHeads: remoteHeads, total: total,
		unit: min(localHeads, remoteHeads)}
	if h := headsPerRank(total, localTP); h == 0 || h != localHeads {
		return m, fmt.Errorf("%w: this engine's TP %d with %d KV heads per rank does not shard the model's %d KV heads",
			ErrIncompatible, localTP, localHeads, total)
	}
	if h := headsPerRank(total, remoteTP); h == 0 || h != remoteHeads {
		return m, fmt.Errorf("%w: the producer runs TP %d with %d KV heads per rank, which does not shard this model's %d KV heads (heterogeneous TP needs both engines to hold whole heads per rank)",
			ErrIncompatible, remoteTP, remoteHeads, total)
	}
	if max(localTP, remoteTP)%min(localTP, remoteTP) != 0 {
		return m, fmt.Errorf("%w: TP %d and TP %d: heterogeneous TP needs one TP size to be a multiple of the other",
			ErrIncompatible, remoteTP, localTP)
	}
	return m, nil
}

// inverse returns the mapping seen from the other engine: its ranks local, this engine's remote.
// A push producer writes with it what the decoder would read (pushPairs).
func (m tpMap) inverse() tpMap {
	return tpMap{localTP: m.remoteTP, remoteTP: m.localTP, localHeads: m.remoteHeads, remoteHeads: m.localHeads, total: m.total, unit: m.unit}
}

// globalHead returns the model KV head that local head h of rank r of an engine at TP tp (heads
// per rank) holds.
func globalHead(r, h, tp, heads, total int) int {
	if tp <= total {
		return r*heads + h
	}
	return r / (tp / total)
}

// source returns the producer rank and the chunk in it that hold chunk c of local rank r. A
// head the producer replicates is read from the replica r picks, spreading the reads.
func (m tpMap) source(r, c int) (rr, rc int) {
	g := globalHead(r, c*m.unit, m.localTP, m.localHeads, m.total)
	if m.remoteTP <= m.total {
		return g / m.remoteHeads, (g % m.remoteHeads) / m.unit
	}
	reps := m.remoteTP / m.total
	return g*reps + r%reps, 0
}

// chunkDescs describes numBlocks blocks of geometry g (HND, g.NumKVHeads heads per block) in
// region as chunks of unit heads: descriptor chunkIndex(g, unit, b, layer, kv, c).
func chunkDescs(region uint32, g kvcache.Geometry, numBlocks, unit int) []transfer.Desc {
	per := g.NumKVHeads / unit
	vsz := int64(g.DType.Size())
	chunk := int64(unit*g.BlockSize*g.HeadDim) * vsz
	bb := int64(g.BlockBytes())
	d := make([]transfer.Desc, 0, numBlocks*g.NumLayers*2*per)
	for b := range numBlocks {
		for part := range g.NumLayers * 2 {
			for c := range per {
				off := int64(b)*bb + int64((part*g.NumKVHeads+c*unit)*g.BlockSize*g.HeadDim)*vsz
				d = append(d, transfer.Desc{Region: region, Offset: off, Length: chunk})
			}
		}
	}
	return d
}

// chunkIndex is the index in chunkDescs of chunk c of layer's keys (kv 0) or values (kv 1) in
// block b.
func chunkIndex(g kvcache.Geometry, unit, b, layer, kv, c int) int {
	return ((b*g.NumLayers+layer)*2+kv)*(g.NumKVHeads/unit) + c
}

// chunkLayer returns the layer of descriptor idx of chunkDescs(_, g, _, unit).
func chunkLayer(g kvcache.Geometry, unit, idx int) int {
	return idx / (g.NumKVHeads / unit) / 2 % g.NumLayers
}

// rankPair names one local rank and the producer rank it reads from.
type rankPair struct{ local, remote int }

// tpPlan turns a block-level read plan (ratio 1) into per-rank-pair chunk reads: for each pair
// of local block and remote block, every local rank's every chunk, from the producer rank that
// holds it. rg is the producer's per-rank geometry, lg this engine's.
func (m tpMap) plan(p readPlan, lg, rg kvcache.Geometry) map[rankPair]*readPlan {
	out := map[rankPair]*readPlan{}
	for i, lb := range p.local {
		rb := p.remote[i]
		for r := range m.localTP {
			for layer := range lg.NumLayers {
				for kv := range 2 {
					for c := range m.localHeads / m.unit {
						rr, rc := m.source(r, c)
						key := rankPair{r, rr}
						q := out[key]
						if q == nil {
							q = &readPlan{}
							out[key] = q
						}
						q.local = append(q.local, chunkIndex(lg, m.unit, lb, layer, kv, c))
						q.remote = append(q.remote, chunkIndex(rg, m.unit, rb, layer, kv, rc))
					}
				}
			}
		}
	}
	return out
}

// rankPairs returns how many pairs of a decoder rank and a producer rank move a request's KV
// between a decoder at TP dTP and a producer at TP pTP of a model with total KV heads: each D
// rank takes its heads from the P rank(s) holding them (tpMap.source; a replicated head from one
// replica). It is the number of notifications vLLM's ranks exchange for one request — each D
// worker notifies each P worker it read from ("<id>:<consumers>"), and in push each P worker
// each D worker it wrote — and so what vLLM's per-notification counters count per request
// (docs/architecture.md, "Notifications per remote rank"). It fails when the sizes cannot map.
func rankPairs(dTP, pTP, total int) (int, error) {
	if dTP == pTP && dTP >= 1 {
		return dTP, nil // rank r with rank r
	}
	if dTP > maxRemoteTP || pTP > maxRemoteTP {
		return 0, fmt.Errorf("%w: TP %d and TP %d: at most %d ranks", ErrIncompatible, dTP, pTP, maxRemoteTP)
	}
	m, err := newTPMap(dTP, headsPerRank(total, dTP), pTP, headsPerRank(total, pTP), total)
	if err != nil {
		return 0, err
	}
	seen := map[rankPair]struct{}{}
	for r := range m.localTP {
		for c := range m.localHeads / m.unit {
			rr, _ := m.source(r, c)
			seen[rankPair{r, rr}] = struct{}{}
		}
	}
	return len(seen), nil
}
