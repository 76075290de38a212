package model

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// openTiny opens kvbridge/tiny and closes it at the end of the test.
func openTiny(t testing.TB) *Model { return openTinyWith(t, precision{}) }

// openTinyWith opens kvbridge/tiny computing with prec.
func openTinyWith(t testing.TB, prec precision) *Model {
	t.Helper()
	spec, _ := builtinSpecs(Tiny)
	m, err := newBuiltin(Tiny, spec, prec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// testPrecisions are the ways a model computes: float32; bfloat16 products with a float32 KV
// cache; bfloat16 products with a bfloat16 KV cache; float32 products with an fp8_e4m3 KV cache;
// bfloat16 products with an fp8_e5m2 one; int8 weights (--quantization int8) with a float32 KV
// cache.
var testPrecisions = []struct {
	name string
	prec precision
}{
	{"float32", precision{}},
	{"bfloat16", precision{bf16: true}},
	{"bfloat16-kv", precision{bf16: true, kvBF16: true}},
	{"fp8-kv", precision{kvFP8: true, fp8: kernel.E4M3}},
	{"bfloat16-fp8_e5m2-kv", precision{bf16: true, kvFP8: true, fp8: kernel.E5M2}},
	{"int8", precision{int8: true}},
}

// forEachPrecision runs test on kvbridge/tiny in every precision: each invariant holds in each.
func forEachPrecision(t *testing.T, test func(*testing.T, *Model)) {
	for _, p := range testPrecisions {
		t.Run(p.name, func(t *testing.T) { test(t, openTinyWith(t, p.prec)) })
	}
}

// bits returns the bit patterns of x, for exact comparisons that also treat NaNs as equal.
func bits(x []float32) []uint32 {
	b := make([]uint32, len(x))
	for i, v := range x {
		b[i] = math.Float32bits(v)
	}
	return b
}

// requireSameBits fails unless a and b are bit-identical.
func requireSameBits(t *testing.T, what string, a, b []float32) {
	t.Helper()
	if !slices.Equal(bits(a), bits(b)) {
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
				t.Fatalf("%s: element %d differs: %g vs %g", what, i, a[i], b[i])
			}
		}
		t.Fatalf("%s: lengths differ: %d vs %d", what, len(a), len(b))
	}
}

// prefillChunked runs tokens through m in chunks of the given size on kv (blocks from the
// table), asking for logits on the last chunk only, and returns them.
func prefillChunked(t *testing.T, m *Model, kv KVBlocks, blockSize int, blocks []int32, tokens []int32, chunk int) []float32 {
	t.Helper()
	logits := make([]float32, m.cfg.VocabSize)
	for start := 0; start < len(tokens); start += chunk {
		end := min(len(tokens), start+chunk)
		s := Seq{Tokens: tokens[start:end], Start: start, Blocks: blocks}
		if end == len(tokens) {
			s.Logits = logits
		}
		if err := m.Forward(t.Context(), kv, blockSize, []Seq{s}); err != nil {
			t.Fatal(err)
		}
	}
	return logits
}

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

// kvOf returns all K and V values of positions [0,n) of a sequence, layer by layer.
func kvOf(kv *testKV, c Config, blocks []int32, n int) []float32 {
	var out []float32
	for l := range c.NumLayers {
		for g := range c.NumKVHeads {
			for p := range n {
				k, v := kv.position(blocks, l, g, p)
				out = append(out, k...)
				out = append(out, v...)
			}
		}
	}
	return out
}

func TestForwardChunkingInvariance(t *testing.T) { forEachPrecision(t, testForwardChunkingInvariance) }

func testForwardChunkingInvariance(t *testing.T, m *Model) {
	c := m.cfg
	const blockSize = 16
	tokens := randomTokens(50, c.VocabSize, 7)
	nb := (len(tokens) + blockSize - 1) / blockSize
	blocks := blockRange(0, nb)

	oneKV := newTestKVFor(m, blockSize, nb, false)
	want := prefillChunked(t, m, oneKV, blockSize, blocks, tokens, len(tokens))
	wantKV := kvOf(oneKV, c, blocks, len(tokens))
	for _, chunk := range []int{1, 3, 16, 17} {
		t.Run(fmt.Sprintf("chunk%d", chunk), func(t *testing.T) {
			kv := newTestKVFor(m, blockSize, nb, false)
			got := prefillChunked(t, m, kv, blockSize, blocks, tokens, chunk)
			requireSameBits(t, "logits", want, got)
			requireSameBits(t, "kv", wantKV, kvOf(kv, c, blocks, len(tokens)))
		})
	}
	t.Run("nhd-layout-scattered-blocks", func(t *testing.T) {
		kv := newTestKVFor(m, blockSize, 3*nb, true)
		scattered := []int32{7, 2, 11, 5}[:nb]
		got := prefillChunked(t, m, kv, blockSize, scattered, tokens, 13)
		requireSameBits(t, "logits", want, got)
	})
	t.Run("block-size-5", func(t *testing.T) {
		kv := newTestKVFor(m, 5, 10, false)
		got := prefillChunked(t, m, kv, 5, blockRange(0, 10), tokens, 9)
		requireSameBits(t, "logits", want, got)
	})
}

func TestForwardBatchInvariance(t *testing.T) { forEachPrecision(t, testForwardBatchInvariance) }

func testForwardBatchInvariance(t *testing.T, m *Model) {
	c := m.cfg
	const blockSize = 16
	const perSeq = 4 // blocks per sequence
	prompts := [][]int32{
		randomTokens(41, c.VocabSize, 21),
		randomTokens(30, c.VocabSize, 22),
		randomTokens(55, c.VocabSize, 23),
		randomTokens(9, c.VocabSize, 24),
	}
	// Reference: each prompt alone, in one step, on its own store.
	want := make([][]float32, len(prompts))
	for i, p := range prompts {
		kv := newTestKVFor(m, blockSize, perSeq, false)
		want[i] = prefillChunked(t, m, kv, blockSize, blockRange(0, perSeq), p, len(p))
	}

	// Batched: all sequences share one store and advance by different chunk sizes per step, so
	// each step mixes sequences at different positions (prefill chunks and single tokens).
	for _, order := range [][]int{{0, 1, 2, 3}, {3, 2, 1, 0}, {2, 0, 3, 1}} {
		t.Run(fmt.Sprint(order), func(t *testing.T) {
			kv := newTestKVFor(m, blockSize, perSeq*len(prompts), false)
			chunks := []int{7, 1, 20, 3}
			done := make([]int, len(prompts))
			got := make([][]float32, len(prompts))
			for step := 0; ; step++ {
				var seqs []Seq
				for _, i := range order {
					p := prompts[i]
					if done[i] == len(p) {
						continue
					}
					n := min(len(p)-done[i], chunks[(i+step)%len(chunks)])
					s := Seq{Tokens: p[done[i] : done[i]+n], Start: done[i], Blocks: blockRange(i*perSeq, perSeq)}
					if done[i]+n == len(p) {
						got[i] = make([]float32, c.VocabSize)
						s.Logits = got[i]
					} else if step%2 == 0 {
						s.Logits = make([]float32, c.VocabSize) // intermediate logits must not disturb anything
					}
					seqs = append(seqs, s)
					done[i] += n
				}
				if len(seqs) == 0 {
					break
				}
				if err := m.Forward(t.Context(), kv, blockSize, seqs); err != nil {
					t.Fatal(err)
				}
			}
			for i := range prompts {
				requireSameBits(t, fmt.Sprintf("seq %d logits", i), want[i], got[i])
			}
		})
	}
}

// TestForwardDecodeBatch32: 32 sequences decoding a token a step together (products of 32 rows:
// six row tiles in the int8 kernels, then fewer rows as the shorter prompts end) get, each,
// the logits of its prompt prefilled alone.
func TestForwardDecodeBatch32(t *testing.T) { forEachPrecision(t, testForwardDecodeBatch32) }

func testForwardDecodeBatch32(t *testing.T, m *Model) {
	c := m.cfg
	const blockSize, seqs = 8, 32
	prompts := make([][]int32, seqs)
	for i := range prompts {
		prompts[i] = randomTokens(3+i%4, c.VocabSize, uint64(100+i))
	}
	kv := newTestKVFor(m, blockSize, seqs, false)
	got := make([][]float32, seqs)
	for step := 0; step < 6; step++ {
		var batch []Seq
		for i, p := range prompts {
			if step >= len(p) {
				continue
			}
			s := Seq{Tokens: p[step : step+1], Start: step, Blocks: blockRange(i, 1)}
			if step == len(p)-1 {
				got[i] = make([]float32, c.VocabSize)
				s.Logits = got[i]
			}
			batch = append(batch, s)
		}
		if err := m.Forward(t.Context(), kv, blockSize, batch); err != nil {
			t.Fatal(err)
		}
	}
	for i, p := range prompts {
		want := prefillChunked(t, m, newTestKVFor(m, blockSize, 1, false), blockSize, blockRange(0, 1), p, len(p))
		requireSameBits(t, fmt.Sprintf("seq %d logits", i), want, got[i])
	}
}

func TestForwardDecodeMatchesPrefill(t *testing.T) {
	forEachPrecision(t, testForwardDecodeMatchesPrefill)
}

func testForwardDecodeMatchesPrefill(t *testing.T, m *Model) {
	// Logits of position p computed while decoding (one token, KV of 0..p-1 from earlier steps)
	// equal those of a prefill that ends at p.
	c := m.cfg
	tokens := randomTokens(20, c.VocabSize, 3)
	all := forwardAll(t, m, tokens, 8)
	for _, n := range []int{1, 8, 9, 20} {
		kv := newTestKVFor(m, 8, 3, false)
		got := prefillChunked(t, m, kv, 8, blockRange(0, 3), tokens[:n], n)
		requireSameBits(t, fmt.Sprintf("prefix %d", n), all[n-1], got)
	}
}

func TestForwardConcurrent(t *testing.T) { forEachPrecision(t, testForwardConcurrent) }

func testForwardConcurrent(t *testing.T, m *Model) {
	// Concurrent steps on one model (shared workers and scratch) give the results of
	// sequential ones.
	c := m.cfg
	const streams = 4
	want := make([][][]float32, streams)
	for i := range streams {
		want[i] = decodeRun(t, m, newTestKVFor(m, 16, 8, false), 16, blockRange(0, 8), randomTokens(90+i, c.VocabSize, uint64(70+i)), 30, 10)
	}
	got := make([][][]float32, streams)
	errs := make([]error, streams)
	var wg sync.WaitGroup
	for i := range streams {
		wg.Go(func() {
			got[i], errs[i] = decode(t.Context(), m, newTestKVFor(m, 16, 8, false), 16, blockRange(0, 8), randomTokens(90+i, c.VocabSize, uint64(70+i)), 30, 10)
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

func TestForwardFarPositionsFinite(t *testing.T) {
	// Positions near max_position_embeddings: RoPE and a softmax over ~32k keys stay finite.
	// The earlier positions' KV is left zero; only finiteness is checked.
	m := openTiny(t)
	c := m.cfg
	const blockSize = 256
	start := c.MaxPositionEmbeddings - 4
	nb := c.MaxPositionEmbeddings / blockSize
	kv := newTestKVFor(m, blockSize, nb, false)
	logits := make([]float32, c.VocabSize)
	err := m.Forward(t.Context(), kv, blockSize, []Seq{{Tokens: randomTokens(4, c.VocabSize, 5), Start: start, Blocks: blockRange(0, nb), Logits: logits}})
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range logits {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			t.Fatalf("logit %d = %g", i, v)
		}
	}
}

func TestForwardRejectsBadInput(t *testing.T) {
	m := openTiny(t)
	c := m.cfg
	kv := newTestKVFor(m, 4, 2, false)
	cases := map[string]Seq{
		"token out of range": {Tokens: []int32{int32(c.VocabSize)}, Blocks: blockRange(0, 1)},
		"negative token":     {Tokens: []int32{-1}, Blocks: blockRange(0, 1)},
		"too few blocks":     {Tokens: make([]int32, 5), Blocks: blockRange(0, 1)},
		"short logits":       {Tokens: []int32{1}, Blocks: blockRange(0, 1), Logits: make([]float32, 3)},
		"logits no tokens":   {Blocks: blockRange(0, 1), Logits: make([]float32, c.VocabSize)},
		"negative start":     {Tokens: []int32{1}, Start: -1, Blocks: blockRange(0, 1)},
	}
	for name, s := range cases {
		if err := m.Forward(t.Context(), kv, 4, []Seq{s}); !errors.Is(err, ErrBadInput) {
			t.Errorf("%s: err = %v, want ErrBadInput", name, err)
		}
	}
	if err := m.Forward(t.Context(), kv, 0, nil); !errors.Is(err, ErrBadInput) {
		t.Errorf("block size 0: err = %v", err)
	}
	m.Close()
	if err := m.Forward(t.Context(), kv, 4, []Seq{{Tokens: []int32{1}, Blocks: blockRange(0, 1)}}); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: err = %v", err)
	}
	if err := m.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestForwardBadBlockIsAnError(t *testing.T) {
	m := openTiny(t)
	kv := newTestKV(m.cfg, 4, 2, false)
	err := m.Forward(t.Context(), kv, 4, []Seq{{Tokens: []int32{1, 2}, Blocks: []int32{99}, Logits: make([]float32, m.cfg.VocabSize)}})
	if !errors.Is(err, ErrBadInput) {
		t.Fatalf("err = %v", err)
	}
	// The model still works.
	if err := m.Forward(t.Context(), kv, 4, []Seq{{Tokens: []int32{1, 2}, Blocks: []int32{1}}}); err != nil {
		t.Fatal(err)
	}
}
