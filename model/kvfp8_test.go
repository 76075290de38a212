package model

import (
	"fmt"
	"slices"
	"testing"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// TestFP8AttentionBF16Kernels: FP8 attention on the bfloat16 scores kernels (keys of a
// bfloat16-exact table widened to bfloat16, gathered over KV heads) computes the bits it computes
// on the float32 ones (widened to float32, fp8F32) — every logit of a prefill and of the decode steps after it, and
// every KV code written — in both formats, at batch 1 (split by positions past 8 chunks), 3 and
// 8, with contexts ending inside, at and past 64-key chunks, in both layouts, with the default
// scales and with power-of-two scales beside a non-power-of-two key scale (whose keys keep the
// float32 kernels).
func TestFP8AttentionBF16Kernels(t *testing.T) {
	spec := builtinSpec{seed: 0x5f8, hidden: 64, layers: 2, heads: 8, kvHeads: 4, headDim: 16, intermediate: 96}
	lens := []int{5, 64, 130, 9*attnChunk + 3, 3, 65, 20, 200}
	const steps = 3
	precs := []struct {
		name string
		prec precision
	}{
		{"fp8_e4m3", precision{kvFP8: true, fp8: kernel.E4M3}},
		{"bfloat16-fp8_e5m2", precision{bf16: true, kvFP8: true, fp8: kernel.E5M2}},
	}
	// Each layer's key and value scale.
	scaleSets := map[string][][2]float32{"default": {{1, 1}, {1, 1}}, "powers": {{2, 0.5}, {0.037, 0.25}}}
	for _, p := range precs {
		for sname, scales := range scaleSets {
			t.Run(p.name+"/"+sname, func(t *testing.T) {
				m, err := newBuiltin("test/fp8bf16", spec, p.prec)
				if err != nil {
					t.Fatal(err)
				}
				defer m.Close()
				if !m.inPlace {
					t.Skip("this kernel implementation packs every chunk")
				}
				for l, s := range scales {
					m.fp8Layers[l] = fp8Layer{kScale: s[0], vScale: s[1], kTab: kernel.NewFP8Table(m.fp8, s[0]), vTab: kernel.NewFP8Table(m.fp8, s[1])}
				}
				if !m.fp8Layers[0].kTab.BF16() {
					t.Fatal("layer 0's key table is not bfloat16-exact")
				}
				for _, batch := range []int{1, 3, 8} {
					for _, nhd := range []bool{false, true} {
						const blockSize = 16
						per := (slices.Max(lens) + steps + blockSize - 1) / blockSize
						run := func(f32 bool) ([][]float32, []uint8) {
							m.fp8F32 = f32
							defer func() { m.fp8F32 = false }()
							kv := newTestKVFor(m, blockSize, per*batch, nhd)
							seqs := make([]Seq, batch)
							var out [][]float32
							for i := range seqs {
								n := lens[(i+3*batch)%len(lens)]
								blocks := blockRange(i*per, per)
								logits := prefillChunked(t, m, kv, blockSize, blocks, randomTokens(n, m.cfg.VocabSize, uint64(700+i)), 70)
								out = append(out, logits)
								seqs[i] = Seq{Tokens: []int32{Argmax(logits)}, Start: n, Blocks: blocks}
							}
							for range steps {
								for i := range seqs {
									seqs[i].Logits = make([]float32, m.cfg.VocabSize)
								}
								if err := m.Forward(t.Context(), kv, blockSize, seqs); err != nil {
									t.Fatal(err)
								}
								for i := range seqs {
									out = append(out, seqs[i].Logits)
									seqs[i].Tokens, seqs[i].Start = []int32{Argmax(seqs[i].Logits)}, seqs[i].Start+1
								}
							}
							return out, kv.mem8
						}
						want, wantKV := run(true)
						got, gotKV := run(false)
						name := fmt.Sprintf("batch %d, NHD %v", batch, nhd)
						for i := range want {
							requireSameBits(t, fmt.Sprintf("%s: logits %d", name, i), want[i], got[i])
						}
						if i := slices.Compare(wantKV, gotKV); i != 0 {
							t.Fatalf("%s: the KV codes differ", name)
						}
					}
				}
			})
		}
	}
}
