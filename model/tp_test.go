package model

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
)

// tpRun is what one tensor-parallel size computed in tpScenario: every logits row, and the KV
// of every (sequence, layer, KV head, position), per KV head of the model.
type tpRun struct {
	logits [][]float32
	kv     [][]float32 // [global KV head] all its values, sequence by sequence, layer by layer
}

// newRankKVs returns one test KV store per rank of m (each with the rank's KV heads).
func newRankKVs(m *Model, blockSize, numBlocks int, nhd bool) ([]KVBlocks, []*testKV) {
	var kvs []KVBlocks
	var stores []*testKV
	for r := range m.TensorParallelSize() {
		_, n := m.RankKVHeads(r)
		c := m.cfg
		c.NumKVHeads = n
		kv := newTestKVFor(m, blockSize, numBlocks, nhd)
		*kv = *newTestKV(c, blockSize, numBlocks, nhd)
		switch {
		case m.kvBF16:
			kv.mem16, kv.mem = make([]uint16, len(kv.mem)), nil
		case m.kvFP8:
			kv.mem8, kv.fp8, kv.mem = make([]uint8, len(kv.mem)), m.fp8, nil
		}
		kvs, stores = append(kvs, kv), append(stores, kv)
	}
	return kvs, stores
}

// tpScenario runs, on m with one KV store per rank, a batched step of a chunk of prompt A with
// the whole prompt B (B's prompt logprobs asked for), the rest of A, then C, which shares A's
// first two blocks (a prefix-cache hit) and computes only its own tokens, then four batched
// greedy decode steps of A, B and C. It returns every logits row and every stored KV value.
func tpScenario(t *testing.T, m *Model, nhd bool) tpRun {
	t.Helper()
	const bs = 16
	kvs, stores := newRankKVs(m, bs, 16, nhd)
	v := m.cfg.VocabSize
	prompt := func(n int, seed int32) []int32 {
		p := make([]int32, n)
		for i := range p {
			p[i] = (seed*131 + int32(i)*977) % int32(v)
		}
		return p
	}
	a, b := prompt(40, 3), prompt(30, 5)
	c := append(append([]int32(nil), a[:2*bs]...), prompt(10, 7)...)
	blocks := [][]int32{{0, 1, 2, 3}, {4, 5, 6, 7}, {0, 1, 8, 9}}
	var run tpRun
	logits := func() []float32 {
		l := make([]float32, v)
		run.logits = append(run.logits, l)
		return l
	}
	step := func(seqs ...Seq) {
		t.Helper()
		if err := m.ForwardRanks(t.Context(), kvs, bs, seqs); err != nil {
			t.Fatal(err)
		}
	}
	rowLogits := func(_ int, l []float32) { run.logits = append(run.logits, append([]float32(nil), l...)) }
	step(Seq{Tokens: a[:24], Blocks: blocks[0]}, Seq{Tokens: b, Blocks: blocks[1], RowLogits: rowLogits})
	la := logits()
	step(Seq{Tokens: a[24:], Start: 24, Blocks: blocks[0], Logits: la})
	lc := logits()
	step(Seq{Tokens: c[2*bs:], Start: 2 * bs, Blocks: blocks[2], Logits: lc})
	last := [][]float32{la, run.logits[len(b)-1], lc}
	pos := []int{len(a), len(b), len(c)}
	for range 4 {
		var seqs []Seq
		for i := range last {
			l := logits()
			seqs = append(seqs, Seq{Tokens: []int32{Argmax(last[i])}, Start: pos[i], Blocks: blocks[i], Logits: l})
			last[i] = l
			pos[i]++
		}
		step(seqs...)
	}
	// Every KV head's values, read from the first rank that holds it.
	run.kv = make([][]float32, m.cfg.NumKVHeads)
	for g := range m.cfg.NumKVHeads {
		for r := range m.TensorParallelSize() {
			first, n := m.RankKVHeads(r)
			if g < first || g >= first+n {
				continue
			}
			for i := range blocks {
				for l := range m.cfg.NumLayers {
					for p := range pos[i] {
						k, v := stores[r].position(blocks[i], l, g-first, p)
						run.kv[g] = append(run.kv[g], k...)
						run.kv[g] = append(run.kv[g], v...)
					}
				}
			}
			break
		}
	}
	return run
}

// requireSameRuns fails unless two runs computed the same bits.
func requireSameRuns(t *testing.T, what string, want, got tpRun) {
	t.Helper()
	if len(want.logits) != len(got.logits) {
		t.Fatalf("%s: %d logits rows, want %d", what, len(got.logits), len(want.logits))
	}
	for i := range want.logits {
		requireSameBits(t, fmt.Sprintf("%s: logits row %d", what, i), want.logits[i], got.logits[i])
	}
	for g := range want.kv {
		requireSameBits(t, fmt.Sprintf("%s: KV head %d", what, g), want.kv[g], got.kv[g])
	}
}

// TestTensorParallelBitIdentical: kvbridge/tiny (4 attention heads, 2 KV heads) at TP 2 and 4 —
// at 4 each KV head is replicated on two ranks — computes the logits and KV of TP 1 bit for
// bit, in every precision, through batched and chunked prefill, a prefix-cache hit, prompt
// logprobs and batched decode, in both KV layouts.
func TestTensorParallelBitIdentical(t *testing.T) {
	for _, p := range testPrecisions {
		t.Run(p.name, func(t *testing.T) {
			for _, nhd := range []bool{false, true} {
				want := tpScenario(t, openTinyWith(t, p.prec), nhd)
				for _, n := range []int{2, 4} {
					prec := p.prec
					prec.tp = n
					m := openTinyWith(t, prec)
					if got := m.TensorParallelSize(); got != n {
						t.Fatalf("TensorParallelSize() = %d, want %d", got, n)
					}
					requireSameRuns(t, fmt.Sprintf("TP %d, NHD %v", n, nhd), want, tpScenario(t, m, nhd))
				}
			}
		})
	}
}

// TestTensorParallelQwen3Checkpoint: a Qwen3-shaped checkpoint (16 attention and 8 KV heads of
// 128, QK norm, a vocabulary that no rank count splits on a panel boundary), loaded from
// safetensors in bfloat16, float32, int8 and with an FP8 KV cache, gives TP 1's bits at TP 2
// and 4.
func TestTensorParallelQwen3Checkpoint(t *testing.T) {
	cfg := Qwen3_0_6B()
	cfg.NumLayers, cfg.HiddenSize, cfg.IntermediateSize, cfg.VocabSize = 2, 256, 640, 4100
	dir := t.TempDir()
	if _, err := WriteRandomCheckpoint(dir, RandomCheckpoint{Config: cfg}); err != nil {
		t.Fatal(err)
	}
	for _, opts := range []OpenOptions{{}, {DType: "float32"}, {Quantization: "int8"}, {KVCacheDType: "fp8"}} {
		t.Run(fmt.Sprintf("%+v", opts), func(t *testing.T) {
			var want tpRun
			for _, n := range []int{1, 2, 4} {
				opts.TensorParallelSize = n
				m, err := Open(t.Context(), dir, opts)
				if err != nil {
					t.Fatal(err)
				}
				got := tpScenario(t, m, false)
				m.Close()
				if n == 1 {
					want = got
					continue
				}
				requireSameRuns(t, fmt.Sprintf("TP %d", n), want, got)
			}
		})
	}
}

// TestTensorParallelSizeRefused: a size the head counts do not allow fails Open, naming them.
func TestTensorParallelSizeRefused(t *testing.T) {
	cfg := Qwen3_0_6B()
	cfg.NumLayers, cfg.HiddenSize, cfg.IntermediateSize, cfg.VocabSize = 1, 128, 256, 4096
	cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 12, 4, 32
	dir := t.TempDir()
	if _, err := WriteRandomCheckpoint(dir, RandomCheckpoint{Config: cfg}); err != nil {
		t.Fatal(err)
	}
	for n, want := range map[int]string{
		5: "does not divide the 12 attention heads",
		6: "more than the 4 KV heads but not a multiple of them",
	} {
		_, err := Open(t.Context(), dir, OpenOptions{TensorParallelSize: n})
		if !errors.Is(err, ErrTensorParallel) || !strings.Contains(err.Error(), want) {
			t.Errorf("TP %d: err = %v, want ErrTensorParallel saying %q", n, err, want)
		}
	}
	cfg.NumHeads, cfg.NumKVHeads = 8, 4
	if err := cfg.checkTensorParallel(8); err != nil { // 8 > 4 KV heads, a multiple: replicated
		t.Errorf("TP 8 of 8/4 heads: %v", err)
	}
	cfg.NumKVHeads = 6
	if err := cfg.checkTensorParallel(4); err == nil || !strings.Contains(err.Error(), "does not divide the 6 KV heads") {
		t.Errorf("TP 4 of 6 KV heads: err = %v", err)
	}
}

// TestTensorParallelFailuresEndTheStep: at TP 2, a bad block id (a rank's store panics) and a
// cancelled context end the step with an error instead of leaving a rank waiting for the
// other, and the model still computes TP 1's bits afterwards.
func TestTensorParallelFailuresEndTheStep(t *testing.T) {
	m := openTinyWith(t, precision{tp: 2})
	kvs, _ := newRankKVs(m, 4, 2, false)
	err := m.ForwardRanks(t.Context(), kvs, 4, []Seq{{Tokens: []int32{1, 2}, Blocks: []int32{99}, Logits: make([]float32, m.cfg.VocabSize)}})
	if !errors.Is(err, ErrBadInput) {
		t.Fatalf("bad block: err = %v", err)
	}
	// The context ends while the ranks compute the first layer (the store cancels it when a
	// rank first reads it): they stop after the layer, together.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	cancelling := &cancelOnView{KVBlocks: kvs[0], cancel: cancel}
	if err := m.ForwardRanks(ctx, []KVBlocks{cancelling, kvs[1]}, 4, []Seq{{Tokens: []int32{1, 2}, Blocks: []int32{1}}}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: err = %v", err)
	}
	if l := cancelling.lastLayer.Load(); l != 0 {
		t.Fatalf("the ranks went on to layer %d after the context ended in layer 0", l)
	}
	if err := m.Forward(t.Context(), kvs[0], 4, []Seq{{Tokens: []int32{1}, Blocks: []int32{1}}}); !errors.Is(err, ErrBadInput) {
		t.Fatalf("Forward with one store at TP 2: err = %v", err)
	}
	observed := []KVBlocks{layerCounter{KVBlocks: kvs[0]}, kvs[1]}
	if err := m.ForwardRanks(t.Context(), observed, 4, []Seq{{Tokens: []int32{1}, Blocks: []int32{1}}}); !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), "layer observer") {
		t.Fatalf("a layer observer at TP 2: err = %v", err)
	}
	requireSameRuns(t, "after failures", tpScenario(t, openTiny(t), false), tpScenario(t, m, false))
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// cancelOnView is a KV store that cancels a context whenever it is read, and records the last
// layer read.
type cancelOnView struct {
	KVBlocks
	cancel    context.CancelFunc
	lastLayer atomic.Int32
}

func (c *cancelOnView) HeadView(layer, block, head int) (k, v []float32, stride int) {
	c.cancel()
	c.lastLayer.Store(int32(layer))
	return c.KVBlocks.HeadView(layer, block, head)
}

// layerCounter is a KV store that is a LayerObserver.
type layerCounter struct{ KVBlocks }

func (layerCounter) LayerDone(int) {}
