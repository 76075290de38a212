package model

import (
	"fmt"
	"testing"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// A chunk's keys and values reach attention packed into the step's Linears (a sequence whose
// work items share its chunks: prefill), into a work item's scratch Linears, or read in place
// from the blocks by the row kernels (decode). All run the same kernel chains, so a token's result must not depend on
// which one a step used, nor on who wrote the KV (the model or a transfer); these tests force
// each way and compare bits.

func TestAttentionPathsAgree(t *testing.T) { forEachPrecision(t, testAttentionPathsAgree) }

func testAttentionPathsAgree(t *testing.T, m *Model) {
	c := m.cfg
	prompt := randomTokens(150, c.VocabSize, 61)
	var want [][]float32
	var wantKV []float32
	// prefillMin 1: every sequence's chunks packed once per step; 1<<30: every work item packs
	// its own (several items per KV head in the multi-token steps); the default. inPlace false:
	// items that pack their own chunks pack them (Linears); true: they read the keys and values
	// in place (kernel.RowDots, kernel.AccumulateRows), where the kernel can. Block size 7 splits
	// the kernels' 16-key groups and the 64-key chunks across blocks.
	defer func(p int, in bool) { m.prefillMin, m.inPlace = p, in }(m.prefillMin, m.inPlace)
	for _, blockSize := range []int{16, 7} {
		nb := (len(prompt) + 9 + blockSize - 1) / blockSize
		blocks := blockRange(0, nb)
		for _, prefillMin := range []int{c.tileTokens() + 1, 1, 1 << 30} {
			for _, inPlace := range []bool{false, kernel.RowKernels(c.HeadDim)} {
				for _, chunk := range []int{150, 45, 1} {
					name := fmt.Sprintf("block%d/prefillMin%d/inPlace%v/chunk%d", blockSize, prefillMin, inPlace, chunk)
					m.prefillMin, m.inPlace = prefillMin, inPlace
					kv := newTestKVFor(m, blockSize, nb, false)
					got := decodeRun(t, m, kv, blockSize, blocks, prompt, chunk, 9)
					gotKV := kvOf(kv, c, blocks, len(prompt)+9)
					if want == nil {
						want, wantKV = got, gotKV
						continue
					}
					for i := range want {
						requireSameBits(t, fmt.Sprintf("%s: step %d", name, i), want[i], got[i])
					}
					requireSameBits(t, name+": kv", wantKV, gotKV)
				}
			}
		}
	}
}

// copyBlock copies block sb of src (all layers, keys and values) into block db of dst, as a KV
// transfer does. Both stores have the same geometry.
func copyBlock(dst *testKV, db int, src *testKV, sb int) {
	n := src.layers * 2 * src.heads * src.blockSize * src.headDim
	if src.mem16 != nil {
		copy(dst.mem16[db*n:(db+1)*n], src.mem16[sb*n:(sb+1)*n])
		return
	}
	if src.mem8 != nil {
		copy(dst.mem8[db*n:(db+1)*n], src.mem8[sb*n:(sb+1)*n])
		return
	}
	copy(dst.mem[db*n:(db+1)*n], src.mem[sb*n:(sb+1)*n])
}

// transferred returns a store holding the KV of positions [0,n) of src (blocks srcBlocks) in
// other, scattered blocks, and its block table of nb blocks.
func transferred(c Config, src *testKV, srcBlocks []int32, n, nb int) (*testKV, []int32) {
	dst := newTestKV(c, src.blockSize, 3*nb, false)
	if src.mem16 != nil {
		dst.mem16, dst.mem = make([]uint16, len(dst.mem)), nil
	}
	if src.mem8 != nil {
		dst.mem8, dst.fp8, dst.mem = make([]uint8, len(dst.mem)), src.fp8, nil
	}
	blocks := make([]int32, nb)
	for i := range blocks {
		blocks[i] = int32(3*nb - 1 - 2*i) // descending, with gaps
	}
	for i := range (n + src.blockSize - 1) / src.blockSize {
		copyBlock(dst, int(blocks[i]), src, int(srcBlocks[i]))
	}
	return dst, blocks
}

func TestAttentionAfterTransfer(t *testing.T) { forEachPrecision(t, testAttentionAfterTransfer) }

func testAttentionAfterTransfer(t *testing.T, m *Model) {
	// D's view of disaggregated prefill: the KV of a prompt but its last token arrives in other
	// blocks; D computes the last token, then decodes. Every step must give the bits of the
	// instance that computed everything itself.
	c := m.cfg
	const blockSize, n, steps = 16, 300, 12
	nb := (n + steps + blockSize - 1) / blockSize
	prompt := randomTokens(n, c.VocabSize, 71)
	srcBlocks := blockRange(0, nb)
	src := newTestKVFor(m, blockSize, nb, false)
	want := decodeRun(t, m, src, blockSize, srcBlocks, prompt, n, steps)

	dst, blocks := transferred(c, src, srcBlocks, n-1, nb)
	logits := make([]float32, c.VocabSize)
	if err := m.Forward(t.Context(), dst, blockSize, []Seq{{Tokens: prompt[n-1:], Start: n - 1, Blocks: blocks, Logits: logits}}); err != nil {
		t.Fatal(err)
	}
	requireSameBits(t, "last prompt token", want[0], logits)
	for i := 1; i <= steps; i++ {
		next := Argmax(logits)
		logits = make([]float32, c.VocabSize)
		if err := m.Forward(t.Context(), dst, blockSize, []Seq{{Tokens: []int32{next}, Start: n - 1 + i, Blocks: blocks, Logits: logits}}); err != nil {
			t.Fatal(err)
		}
		requireSameBits(t, fmt.Sprintf("decode step %d", i), want[i], logits)
	}
	requireSameBits(t, "kv", kvOf(src, c, srcBlocks, n+steps), kvOf(dst, c, blocks, n+steps))
}

func TestPrefillOverTransferredHistory(t *testing.T) {
	forEachPrecision(t, testPrefillOverTransferredHistory)
}

func testPrefillOverTransferredHistory(t *testing.T, m *Model) {
	// P's view of a bidirectional turn: the history's KV arrives by transfer and only the new
	// tokens are prefilled, attending over all of it, in one step or in chunks.
	c := m.cfg
	const blockSize, history, extra = 16, 200, 75
	nb := (history + extra + blockSize - 1) / blockSize
	tokens := randomTokens(history+extra, c.VocabSize, 81)
	srcBlocks := blockRange(0, nb)
	src := newTestKVFor(m, blockSize, nb, false)
	want := prefillChunked(t, m, src, blockSize, srcBlocks, tokens, len(tokens))
	for _, chunk := range []int{extra, 33, 1} {
		t.Run(fmt.Sprintf("chunk%d", chunk), func(t *testing.T) {
			dst, blocks := transferred(c, src, srcBlocks, history, nb)
			logits := make([]float32, c.VocabSize)
			for start := history; start < len(tokens); start += chunk {
				end := min(len(tokens), start+chunk)
				s := Seq{Tokens: tokens[start:end], Start: start, Blocks: blocks}
				if end == len(tokens) {
					s.Logits = logits
				}
				if err := m.Forward(t.Context(), dst, blockSize, []Seq{s}); err != nil {
					t.Fatal(err)
				}
			}
			requireSameBits(t, "logits", want, logits)
			requireSameBits(t, "kv", kvOf(src, c, srcBlocks, len(tokens)), kvOf(dst, c, blocks, len(tokens)))
		})
	}
}

func TestAttentionMixedBatch(t *testing.T) {
	// One step holding a prefill over transferred history (chunks packed for the step), a
	// prefill short enough for one work item per KV head and a decode over a transfer (chunks
	// packed by the work items) gives each sequence the bits it gets alone.
	m := openTiny(t)
	c := m.cfg
	const blockSize = 16
	lens := []int{230, 170, 140}
	known := []int{180, 150, 140} // sequence i's KV of positions [0, known[i]) is transferred
	var refs [][]float32
	var srcs []*testKV
	prompts := make([][]int32, len(lens))
	for i, n := range lens {
		prompts[i] = randomTokens(n+1, c.VocabSize, uint64(90+i))
		nb := (n + 1 + blockSize - 1) / blockSize
		src := newTestKV(c, blockSize, nb, false)
		refs = append(refs, prefillChunked(t, m, src, blockSize, blockRange(0, nb), prompts[i], n+1))
		srcs = append(srcs, src)
	}
	kv := newTestKV(c, blockSize, 64, false)
	var seqs []Seq
	next := 0
	for i, n := range lens {
		nb := (n + 1 + blockSize - 1) / blockSize
		blocks := blockRange(next, nb)
		next += nb
		for b := range (known[i] + blockSize - 1) / blockSize {
			copyBlock(kv, int(blocks[b]), srcs[i], b)
		}
		seqs = append(seqs, Seq{Tokens: prompts[i][known[i]:], Start: known[i], Blocks: blocks, Logits: make([]float32, c.VocabSize)})
	}
	if n := len(seqs[0].Tokens); n < m.prefillMin {
		t.Fatalf("sequence 0 computes %d tokens, not a shared-chunks prefill (from %d)", n, m.prefillMin)
	}
	if n := len(seqs[1].Tokens); n >= m.prefillMin || n < 2 {
		t.Fatalf("sequence 1 computes %d tokens, want a one-item prefill (< %d)", n, m.prefillMin)
	}
	if err := m.Forward(t.Context(), kv, blockSize, seqs); err != nil {
		t.Fatal(err)
	}
	for i := range seqs {
		requireSameBits(t, fmt.Sprintf("seq %d", i), refs[i], seqs[i].Logits)
	}
}

func TestAttentionReadsTheStoreAfresh(t *testing.T) {
	// Blocks freed, reallocated and filled by a transfer with another context's KV under the
	// same block ids: the next step attends over the new contents (nothing packed earlier is
	// reused), and another store with the same block ids is independent.
	m := openTiny(t)
	c := m.cfg
	const blockSize, n = 16, 140
	blocks := blockRange(0, 10)
	a, b := randomTokens(n, c.VocabSize, 41), randomTokens(n, c.VocabSize, 42)
	// computed prefills prompt into a store and returns it with the logits of one more token
	// decoded at position n (the store keeps the prompt's KV only).
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

	kv := newTestKV(c, blockSize, 10, false)
	decodeRun(t, m, kv, blockSize, blocks, a, 70, 3)
	copy(kv.mem, srcB.mem)
	requireSameBits(t, "reallocated and transferred blocks", wantB, decodeOne(kv))
	other := newTestKV(c, blockSize, 10, false)
	copy(other.mem, srcA.mem)
	requireSameBits(t, "second store", wantA, decodeOne(other))
	requireSameBits(t, "first store again", wantB, decodeOne(kv))
}

func TestAttentionHeadSpans(t *testing.T) {
	// Decoding sequences read in place get work items covering several KV heads (each block's
	// keys, then values, of those heads in one stretch). However many heads an item covers — all
	// of them, 2, or 3 of 4 (an uneven split) — every sequence decodes the bits it decodes alone
	// (one sequence: one head per item), in every precision, in both layouts, with contexts
	// ending inside, at and past 64-key chunks and blocks that split them.
	spec := builtinSpec{seed: 0x5e9, hidden: 64, layers: 2, heads: 8, kvHeads: 4, headDim: 16, intermediate: 96}
	lens := []int{3, 63, 64, 65, 130}
	const steps = 3
	for _, p := range testPrecisions {
		t.Run(p.name, func(t *testing.T) {
			m, err := newBuiltin("test/heads8-kv4", spec, p.prec)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if !m.inPlace {
				t.Skip("this kernel implementation packs every chunk")
			}
			c := m.cfg
			for _, blockSize := range []int{16, 7} {
				for _, nhd := range []bool{false, true} {
					per := (lens[len(lens)-1] + steps + blockSize - 1) / blockSize
					prompts := make([][]int32, len(lens))
					want := make([][][]float32, len(lens))
					for i, n := range lens {
						prompts[i] = randomTokens(n, c.VocabSize, uint64(300+i))
						kv := newTestKVFor(m, blockSize, per, nhd)
						want[i] = decodeRun(t, m, kv, blockSize, blockRange(0, per), prompts[i], n, steps)
					}
					for _, heads := range []int{0, 2, 3} {
						name := fmt.Sprintf("block%d/nhd%v/itemHeads%d", blockSize, nhd, heads)
						m.itemHeads = heads
						kv := newTestKVFor(m, blockSize, per*len(lens), nhd)
						seqs := make([]Seq, len(lens))
						for i, n := range lens {
							blocks := blockRange(i*per, per)
							got := prefillChunked(t, m, kv, blockSize, blocks, prompts[i], n)
							requireSameBits(t, fmt.Sprintf("%s: seq %d prompt", name, i), want[i][0], got)
							seqs[i] = Seq{Tokens: []int32{Argmax(got)}, Start: n, Blocks: blocks, Logits: got}
						}
						for s := 1; s <= steps; s++ {
							for i := range seqs {
								seqs[i].Logits = make([]float32, c.VocabSize)
							}
							if err := m.Forward(t.Context(), kv, blockSize, seqs); err != nil {
								t.Fatal(err)
							}
							for i := range seqs {
								requireSameBits(t, fmt.Sprintf("%s: seq %d step %d", name, i, s), want[i][s], seqs[i].Logits)
								seqs[i].Tokens, seqs[i].Start = []int32{Argmax(seqs[i].Logits)}, seqs[i].Start+1
							}
						}
					}
					m.itemHeads = 0
				}
			}
		})
	}
}
