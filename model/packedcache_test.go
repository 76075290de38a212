package model

import (
	"context"
	"fmt"
	"sync"
	"testing"
)

// decodeRun prefills prompt in chunks of chunk tokens, then decodes n tokens greedily, one per
// step, and returns the logits of every decode step.
func decodeRun(t *testing.T, m *Model, kv KVBlocks, blockSize int, blocks []int32, prompt []int32, chunk, n int) [][]float32 {
	t.Helper()
	out, err := decode(t.Context(), m, kv, blockSize, blocks, prompt, chunk, n)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// decode is decodeRun returning its error (for goroutines other than the test's).
func decode(ctx context.Context, m *Model, kv KVBlocks, blockSize int, blocks []int32, prompt []int32, chunk, n int) ([][]float32, error) {
	var out [][]float32
	var logits []float32
	for start := 0; start < len(prompt); start += chunk {
		end := min(len(prompt), start+chunk)
		s := Seq{Tokens: prompt[start:end], Start: start, Blocks: blocks}
		if end == len(prompt) {
			logits = make([]float32, m.cfg.VocabSize)
			s.Logits = logits
		}
		if err := m.Forward(ctx, kv, blockSize, []Seq{s}); err != nil {
			return nil, err
		}
	}
	out = append(out, logits)
	pos := len(prompt)
	for range n {
		next := Argmax(logits)
		logits = make([]float32, m.cfg.VocabSize)
		if err := m.Forward(ctx, kv, blockSize, []Seq{{Tokens: []int32{next}, Start: pos, Blocks: blocks, Logits: logits}}); err != nil {
			return nil, err
		}
		out = append(out, logits)
		pos++
	}
	return out, nil
}

func TestPackedCacheGivesSameBits(t *testing.T) {
	m := openTiny(t)
	c := m.cfg
	const blockSize = 16
	prompt := randomTokens(150, c.VocabSize, 31)
	blocks := blockRange(0, 14)
	want := decodeRun(t, m, newTestKV(c, blockSize, 14, false), blockSize, blocks, prompt, len(prompt), 40)
	if n := len(m.packed.entries); n != 0 {
		t.Fatalf("a store without generations populated the cache (%d entries)", n)
	}
	for _, chunk := range []int{len(prompt), 17, 1} {
		t.Run(fmt.Sprintf("chunk%d", chunk), func(t *testing.T) {
			kv := newGenKV(c, blockSize, 14)
			got := decodeRun(t, m, kv, blockSize, blocks, prompt, chunk, 40)
			for i := range want {
				requireSameBits(t, fmt.Sprintf("step %d", i), want[i], got[i])
			}
			if len(m.packed.entries) == 0 {
				t.Fatal("the packed cache was not used")
			}
		})
	}
}

func TestPackedCacheNotStale(t *testing.T) {
	m := openTiny(t)
	c := m.cfg
	const blockSize = 16
	const n = 140
	blocks := blockRange(0, 10)
	a, b := randomTokens(n, c.VocabSize, 41), randomTokens(n, c.VocabSize, 42)
	// computed prefills prompt into a store without generations and returns it with the logits
	// of one more token decoded at position n.
	computed := func(p []int32) (*testKV, []float32) {
		src := newTestKV(c, blockSize, 10, false)
		prefillChunked(t, m, src, blockSize, blocks, p, n)
		before := append([]float32(nil), src.mem...)
		logits := make([]float32, c.VocabSize)
		if err := m.Forward(t.Context(), src, blockSize, []Seq{{Tokens: []int32{7}, Start: n, Blocks: blocks, Logits: logits}}); err != nil {
			t.Fatal(err)
		}
		src.mem = before
		return src, logits
	}
	decodeOne := func(kv KVBlocks) []float32 {
		logits := make([]float32, c.VocabSize)
		if err := m.Forward(t.Context(), kv, blockSize, []Seq{{Tokens: []int32{7}, Start: n, Blocks: blocks, Logits: logits}}); err != nil {
			t.Fatal(err)
		}
		return logits
	}
	srcA, wantA := computed(a)
	srcB, wantB := computed(b)

	kv := newGenKV(c, blockSize, 10)
	decodeRun(t, m, kv, blockSize, blocks, a, 70, 3) // caches a's chunks
	if len(m.packed.entries) == 0 {
		t.Fatal("nothing cached")
	}
	// The blocks are freed, reallocated (new generations) and filled by a transfer with b's KV.
	for i := range kv.gens {
		kv.gens[i]++
	}
	copy(kv.mem, srcB.mem)
	requireSameBits(t, "reallocated and transferred blocks", wantB, decodeOne(kv))

	// Another store with the same block ids and generations but a's KV shares nothing with kv.
	other := newGenKV(c, blockSize, 10)
	copy(other.gens, kv.gens)
	copy(other.mem, srcA.mem)
	requireSameBits(t, "second store", wantA, decodeOne(other))
	requireSameBits(t, "first store again", wantB, decodeOne(kv))
}

func TestPackedCacheBudget(t *testing.T) {
	m := openTiny(t)
	c := m.cfg
	entry := linearBytes(attnChunk, c.HeadDim) + linearBytes(c.HeadDim, attnChunk)
	m.packed = newPackedCache(10 * entry)
	prompt := randomTokens(200, c.VocabSize, 51)
	blocks := blockRange(0, 14)
	want := decodeRun(t, m, newTestKV(c, 16, 14, false), 16, blocks, prompt, 200, 5)
	got := decodeRun(t, m, newGenKV(c, 16, 14), 16, blocks, prompt, 200, 5)
	for i := range want {
		requireSameBits(t, fmt.Sprintf("step %d", i), want[i], got[i])
	}
	if m.packed.bytes > m.packed.budget || len(m.packed.entries) == 0 {
		t.Fatalf("cache holds %d bytes in %d entries, budget %d", m.packed.bytes, len(m.packed.entries), m.packed.budget)
	}
	// Stores beyond maxCachedStores push out the least recently used one.
	for range maxCachedStores + 2 {
		prefillChunked(t, m, newGenKV(c, 16, 14), 16, blocks, prompt[:70], 70)
	}
	if len(m.packed.stores) > maxCachedStores {
		t.Fatalf("%d stores referenced", len(m.packed.stores))
	}
	m.Close()
	if len(m.packed.entries) != 0 || m.packed.bytes != 0 {
		t.Fatal("Close left cached chunks")
	}
}

func TestAttentionPathsAgree(t *testing.T) {
	// The packed-values path (prefill) and the Axpy path (decode) compute the same chains: force
	// each for the same multi-token step and compare.
	m := openTiny(t)
	c := m.cfg
	prompt := randomTokens(90, c.VocabSize, 61)
	var want []float32
	for i, min := range []int{1, 1 << 30, packedMinTokens} {
		m.packedMin = min
		kv := newTestKV(c, 16, 6, false)
		got := prefillChunked(t, m, kv, 16, blockRange(0, 6), prompt, 45)
		if i == 0 {
			want = got
			continue
		}
		requireSameBits(t, fmt.Sprintf("packedMin %d", min), want, got)
	}
}

func TestForwardConcurrent(t *testing.T) {
	// Concurrent steps on one model (shared workers, scratch and packed cache) give the results
	// of sequential ones.
	m := openTiny(t)
	c := m.cfg
	const streams = 4
	want := make([][][]float32, streams)
	for i := range streams {
		want[i] = decodeRun(t, m, newTestKV(c, 16, 8, false), 16, blockRange(0, 8), randomTokens(90+i, c.VocabSize, uint64(70+i)), 30, 10)
	}
	got := make([][][]float32, streams)
	errs := make([]error, streams)
	var wg sync.WaitGroup
	for i := range streams {
		wg.Go(func() {
			got[i], errs[i] = decode(t.Context(), m, newGenKV(c, 16, 8), 16, blockRange(0, 8), randomTokens(90+i, c.VocabSize, uint64(70+i)), 30, 10)
		})
	}
	wg.Wait()
	for i := range streams {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		for j := range want[i] {
			requireSameBits(t, fmt.Sprintf("stream %d step %d", i, j), want[i][j], got[i][j])
		}
	}
}
