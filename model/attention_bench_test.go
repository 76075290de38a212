package model

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"testing"
	"time"
)

// benchKV returns a store for the small model holding n positions of random
// KV (the work of a step does not depend on the values).
func benchKV(b *testing.B, m *Model, blockSize, n int) (*testKV, []int32) {
	b.Helper()
	nb := (n + blockSize - 1) / blockSize
	kv := newTestKV(m.cfg, blockSize, nb, false)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range kv.mem {
		kv.mem[i] = float32(rng.NormFloat64())
	}
	return kv, blockRange(0, nb)
}

// BenchmarkStepAfterTransfer times one forward step of `tokens` tokens at the end of a context
// of `ctx` positions whose KV the model did not compute (random values, as if transferred):
// D's first step after a transfer (1 token), a bidirectional turn's prefill over transferred
// history (236 tokens over 2,052) and, for comparison, a fresh prefill of 236 tokens.
func BenchmarkStepAfterTransfer(b *testing.B) {
	m, err := Open(b.Context(), Small, OpenOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	const blockSize = 16
	for _, tc := range []struct{ ctx, tokens int }{{2048, 1}, {4096, 1}, {2052, 236}, {236, 236}} {
		kv, blocks := benchKV(b, m, blockSize, tc.ctx)
		toks := randomTokens(tc.tokens, m.cfg.VocabSize, 9)
		logits := make([]float32, m.cfg.VocabSize)
		seq := []Seq{{Tokens: toks, Start: tc.ctx - tc.tokens, Blocks: blocks, Logits: logits}}
		b.Run(fmt.Sprintf("ctx%d/tokens%d", tc.ctx, tc.tokens), func(b *testing.B) {
			best := time.Duration(1 << 62)
			for b.Loop() {
				t0 := time.Now()
				if err := m.Forward(b.Context(), kv, blockSize, seq); err != nil {
					b.Fatal(err)
				}
				best = min(best, time.Since(t0))
			}
			b.ReportMetric(float64(best.Microseconds())/1000, "min-ms")
		})
	}
}

// BenchmarkBatchDecode times one decode step of 6 sequences of 2,048 positions each, after a
// few steps (so whatever can be kept across steps is).
func BenchmarkBatchDecode(b *testing.B) {
	m, err := Open(b.Context(), Small, OpenOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	const blockSize, ctx, nseq = 16, 2048, 6
	kv, blocks := benchKV(b, m, blockSize, ctx*nseq)
	per := ctx / blockSize
	var seqs []Seq
	for i := range nseq {
		seqs = append(seqs, Seq{Tokens: []int32{int32(i + 1)}, Start: ctx - 1, Blocks: blocks[i*per : (i+1)*per], Logits: make([]float32, m.cfg.VocabSize)})
	}
	for range 8 {
		if err := m.Forward(b.Context(), kv, blockSize, seqs); err != nil {
			b.Fatal(err)
		}
	}
	best := time.Duration(1 << 62)
	for b.Loop() {
		t0 := time.Now()
		if err := m.Forward(b.Context(), kv, blockSize, seqs); err != nil {
			b.Fatal(err)
		}
		best = min(best, time.Since(t0))
	}
	b.ReportMetric(float64(best.Microseconds())/1000, "min-ms")
}

// BenchmarkAttentionSplitPaired runs a lone sequence's decode step at contexts 128 and 1024
// alternately with its attention split by KV heads (itemHeads 2: the items headSpan gives one
// sequence on two workers) and by positions (attention_split.go; not at context 128, below
// splitMinChunks: there it measures the pairing's own bias), so that a load change on a shared
// machine hits both alike, and reports the median over the pairs of the split step's speed ÷ the
// other's (positions/heads). The model is KVBRIDGE_BENCH_MODEL (default kvbridge/small, e.g.
// /tmp/qwen3-0.6b), in bfloat16 with a bfloat16 KV cache.
func BenchmarkAttentionSplitPaired(b *testing.B) {
	name := cmp.Or(os.Getenv("KVBRIDGE_BENCH_MODEL"), Small)
	m, err := Open(b.Context(), name, OpenOptions{DType: "bfloat16"})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	const bs = 16
	for _, ctx := range []int{128, 1024} {
		b.Run(fmt.Sprintf("ctx-%d", ctx), func(b *testing.B) {
			nb := ctx/bs + 1
			kv := newTestKVFor(m, bs, nb, false)
			s := []Seq{{Tokens: []int32{7}, Start: ctx, Blocks: blockRange(0, nb), Logits: make([]float32, m.cfg.VocabSize)}}
			var ratios []float64
			for k := 0; b.Loop(); k++ {
				var took [2]time.Duration
				for j := range 2 {
					i := (j + k) % 2 // which way goes first alternates
					m.itemHeads = 2 * i
					t0 := time.Now()
					if err := m.Forward(b.Context(), kv, bs, s); err != nil {
						b.Fatal(err)
					}
					took[i] = time.Since(t0)
				}
				ratios = append(ratios, took[1].Seconds()/took[0].Seconds())
			}
			m.itemHeads = 0
			slices.Sort(ratios)
			b.ReportMetric(ratios[len(ratios)/2], "positions/heads")
		})
	}
}
