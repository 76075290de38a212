package proxy

import (
	"context"
	"log/slog"
	"runtime"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbridge/kvbridge/internal/blockhash"
)

// TestKVIndexLongestPrefix: per engine, the consecutive blocks of a chain it holds from block 0,
// the best of its sources; a removal or a reset cuts the prefix where it happens.
func TestKVIndexLongestPrefix(t *testing.T) {
	// Engines 0 and 1; engine 1 has two sources (DP ranks).
	ix := newKVIndex([]int{0, 1, 1}, 2, 1000)
	chain := []uint64{10, 11, 12, 13, 14}
	ix.store(0, []uint64{10, 11, 12}, 16)
	ix.store(1, []uint64{10, 11}, 16)
	ix.store(2, []uint64{10, 11, 12, 13}, 16)
	ix.store(0, []uint64{14}, 16) // a hole at 13: block 14 does not count
	got := ix.longestPrefix(chain)
	if got[0].blocks != 3 || got[1].blocks != 4 {
		t.Fatalf("prefixes %+v, want 3 and 4", got)
	}
	ix.remove(2, []uint64{11})
	ix.setStale(1, true)
	got = ix.longestPrefix(chain)
	if got[1].blocks != 2 || !got[1].stale || got[0].stale {
		t.Fatalf("after removing block 1 from rank 1 and marking rank 0 stale: %+v", got)
	}
	ix.reset(1) // its staleness goes with its entries
	if got = ix.longestPrefix(chain); got[1].blocks != 1 || got[1].stale {
		t.Fatalf("after resetting rank 0 of engine 1 (rank 1 holds block 0): %+v", got)
	}
	ix.resetEngine(1)
	if got = ix.longestPrefix(chain); got[1].blocks != 0 || got[1].stale || ix.blockSize() != 16 {
		t.Fatalf("after resetting engine 1: %+v (block size %d)", got, ix.blockSize())
	}
}

// TestKVIndexBoundEvictsOldest: beyond its bound a source drops the hashes stored first, and a
// hash stored again counts as new; the FIFO does not grow with removals.
func TestKVIndexBoundEvictsOldest(t *testing.T) {
	ix := newKVIndex([]int{0}, 1, 4)
	ix.store(0, []uint64{1, 2, 3, 4}, 16)
	ix.store(0, []uint64{1}, 16) // 1 is now the newest
	ix.store(0, []uint64{5, 6}, 16)
	for h, want := range map[uint64]bool{1: true, 2: false, 3: false, 4: true, 5: true, 6: true} {
		if _, ok := ix.sources[0].blocks[h]; ok != want {
			t.Errorf("hash %d held %v, want %v", h, ok, want)
		}
	}
	if ix.len(0) != 4 || ix.sources[0].evicted.Load() != 2 {
		t.Errorf("%d held, %d evicted; want 4 and 2", ix.len(0), ix.sources[0].evicted.Load())
	}
	big := newKVIndex([]int{0}, 1, 1<<20)
	for i := range uint64(100_000) {
		big.store(0, []uint64{i}, 16)
		big.remove(0, []uint64{i})
	}
	if n := len(big.sources[0].fifo); n > 4096 {
		t.Errorf("the FIFO holds %d entries for an empty set", n)
	}
}

// TestKVIndexBytesPerBlock measures the index's memory per block hash held (the figure
// docs/architecture.md states per million blocks).
func TestKVIndexBytesPerBlock(t *testing.T) {
	const n = 1 << 20
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ix := newKVIndex([]int{0}, 1, 2*n)
	hashes := make([]uint64, 1024)
	for i := 0; i < n; i += len(hashes) {
		for j := range hashes {
			hashes[j] = uint64(i+j) * 0x9e3779b97f4a7c15
		}
		ix.store(0, hashes, 16)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / n
	t.Logf("KV index: %.1f bytes per block hash, %.1f MiB per million blocks", per, per*1e6/(1<<20))
	if ix.len(0) != n {
		t.Fatalf("%d held, want %d", ix.len(0), n)
	}
	if per > 100 {
		t.Errorf("%.1f bytes per block hash; want at most 100", per)
	}
	runtime.KeepAlive(ix)
}

// BenchmarkKVIndexEvents measures how many stored-and-removed block events one index applies a
// second (one source; each op stores a batch of 16 hashes and removes the 16 stored before).
func BenchmarkKVIndexEvents(b *testing.B) {
	ix := newKVIndex([]int{0}, 1, DefaultKVIndexBlocks)
	batch := make([]uint64, 16)
	prev := make([]uint64, 16)
	var h uint64
	for b.Loop() {
		for j := range batch {
			h++
			batch[j] = h * 0x9e3779b97f4a7c15
		}
		ix.store(0, batch, 16)
		ix.remove(0, prev)
		copy(prev, batch)
	}
	b.ReportMetric(float64(b.N*32)/b.Elapsed().Seconds(), "block-events/s")
}

// BenchmarkKVSubscriberApply measures the events per second one subscriber decodes and indexes:
// each op is a batch of vLLM's msgpack with a BlockStored of 16 blocks and a BlockRemoved of the
// 16 before (2 events, 32 block hashes).
func BenchmarkKVSubscriberApply(b *testing.B) {
	ix := newKVIndex([]int{0}, 1, DefaultKVIndexBlocks)
	sub := &kvSubscriber{ix: ix, log: slog.New(slog.DiscardHandler)}
	const batches = 1024
	payloads := make([][]byte, batches)
	var h uint64
	for i := range payloads {
		st, rm := make([]any, 16), make([]any, 16)
		for j := range st {
			rm[j] = h * 0x9e3779b97f4a7c15
			h++
			st[j] = (h + 15) * 0x9e3779b97f4a7c15
		}
		payloads[i] = vllmBatch(b, 0, stored(st, 16), map[string]any{"type": kvBlockRemoved, "block_hashes": rm, "medium": "GPU"})
	}
	i := 0
	for b.Loop() {
		sub.apply(payloads[i%batches])
		i++
	}
	if sub.malformed.Load() != 0 {
		b.Fatal("malformed batches")
	}
	b.ReportMetric(float64(b.N*2)/b.Elapsed().Seconds(), "events/s")
	b.ReportMetric(float64(b.N*32)/b.Elapsed().Seconds(), "block-hashes/s")
}

// BenchmarkKVAwareChoice measures the proxy's CPU for one kv-aware choice of a prompt given as
// token ids (no /tokenize call): hashing its chain (sha256, 1024 tokens: 64 blocks) and asking
// the index of 3 prefillers, each holding 100 000 blocks.
func BenchmarkKVAwareChoice(b *testing.B) {
	cfg := Config{Prefill: make([]Instance, 3), Decode: []Instance{{Host: "d", Port: 1}}, Logger: slog.New(slog.DiscardHandler)}
	for i := range cfg.Prefill {
		cfg.Prefill[i] = Instance{Host: "p", Port: i + 1}
	}
	h, err := blockhash.New(blockhash.SHA256, "0", true)
	if err != nil {
		b.Fatal(err)
	}
	rt := &router{cfg: RoutingConfig{Policy: KVAware}, log: cfg.Logger, p: newPool(cfg.Prefill), d: newPool(cfg.Decode), hasher: h,
		ix: newKVIndex([]int{0, 1, 2}, 3, DefaultKVIndexBlocks)}
	rt.routed = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "r"}, []string{"policy", "reason"})
	rt.prefixTokens = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "p"})
	prompt := make([]any, 1024)
	toks := make([]int32, 1024)
	for i := range prompt {
		prompt[i], toks[i] = float64(i%500), int32(i%500)
	}
	for e := range 3 {
		fill := make([]uint64, 100_000)
		for i := range fill {
			fill[i] = uint64(e*1_000_000+i) * 0x9e3779b97f4a7c15
		}
		ix := rt.ix
		ix.store(e, fill, 16)
	}
	chain := h.Chain(toks, 16)
	ext := make([]uint64, 40)
	for i := range ext {
		ext[i] = chain[i].External()
	}
	rt.ix.store(1, ext, 16) // prefiller 1 holds 40 of the 64 blocks
	var l legs
	for b.Loop() {
		inst, release := rt.pickPrefill(context.Background(), &l, "/v1/completions", "id", nil, body{"prompt": prompt})
		release()
		if inst != cfg.Prefill[1] {
			b.Fatalf("chose %v", inst)
		}
	}
}
