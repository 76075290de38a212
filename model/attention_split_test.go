package model

import (
	"fmt"
	"runtime"
	"testing"
)

// TestAttentionPositionSplit: a sequence decoding alone over a long context is split by
// positions (its work items chunks of all KV heads), and decodes the bits it decodes with items
// of one KV head over all positions (itemHeads 1, not split) — for 1, 2 and 3 workers (the
// workers share the chunks differently), in every precision, in both layouts, with blocks that
// split chunks, and contexts ending inside, at and past 64-key chunks (and split from the first
// decode step on, or from a later one).
func TestAttentionPositionSplit(t *testing.T) {
	spec := builtinSpec{seed: 0x5e7, hidden: 64, layers: 2, heads: 8, kvHeads: 4, headDim: 16, intermediate: 96}
	lens := []int{3, 130, 7*attnChunk - 2, 8 * attnChunk, 8*attnChunk + 1, 700}
	const steps = 3
	for _, p := range testPrecisions {
		for _, procs := range []int{1, 2, 3} {
			t.Run(fmt.Sprintf("%s/workers%d", p.name, procs), func(t *testing.T) {
				defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs)) // the model's pool has procs workers
				m, err := newBuiltin("test/split", spec, p.prec)
				if err != nil {
					t.Fatal(err)
				}
				defer m.Close()
				if !m.inPlace {
					t.Skip("this kernel implementation packs every chunk")
				}
				// One sequence's items cover fewer than all KV heads, so a decoding sequence of
				// splitMinChunks chunks or more is split (the third prompt from its third step on,
				// the last three throughout), a shorter one not.
				w := &workspace{seqAttn: []seqAttn{{n: 1, packs: -1}}}
				span := m.headSpan(w)
				for nch, want := range map[int]bool{splitMinChunks - 1: false, splitMinChunks: true} {
					if sa := (seqAttn{n: 1, nch: nch, packs: -1}); m.splits(&sa, span) != want {
						t.Fatalf("a lone decoding sequence over %d chunks: split %v, want %v (head span %d of %d)", nch, !want, want, span, m.cfg.NumKVHeads)
					}
				}
				for _, blockSize := range []int{16, 7} {
					for _, nhd := range []bool{false, true} {
						for i, n := range lens {
							per := (n + steps + blockSize - 1) / blockSize
							prompt := randomTokens(n, m.cfg.VocabSize, uint64(500+i))
							m.itemHeads = 1
							want := decodeRun(t, m, newTestKVFor(m, blockSize, per, nhd), blockSize, blockRange(0, per), prompt, n, steps)
							m.itemHeads = 0
							got := decodeRun(t, m, newTestKVFor(m, blockSize, per, nhd), blockSize, blockRange(0, per), prompt, n, steps)
							for s := range want {
								requireSameBits(t, fmt.Sprintf("block %d, NHD %v, prompt %d, step %d", blockSize, nhd, n, s), want[s], got[s])
							}
						}
					}
				}
			})
		}
	}
}
