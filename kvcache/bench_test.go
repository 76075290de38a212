package kvcache

import "testing"

func BenchmarkAllocateFree(b *testing.B) {
	p := newTestPool(b, tinyGeo, 1024, true)
	b.ReportAllocs()
	for b.Loop() {
		ids, err := p.Allocate(16)
		if err != nil {
			b.Fatal(err)
		}
		if err := p.Free(ids...); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkChainHashes2048(b *testing.B) {
	toks := seqTokens(2048, 1)
	b.SetBytes(4 * 2048)
	b.ReportAllocs()
	for b.Loop() {
		if len(ChainHashes(toks, 16)) != 128 {
			b.Fatal("wrong chain length")
		}
	}
}

// BenchmarkRegroupHNDToNHD measures the receive-side post-processing of one local block of a
// Qwen3-0.6B-like shape (28 layers, 8 KV heads, head size 128, block 16) from remote blocks of 4.
func BenchmarkRegroupHNDToNHD(b *testing.B) {
	local := Geometry{NumLayers: 28, NumKVHeads: 8, HeadDim: 128, BlockSize: 16, Layout: NHD}
	remote := local
	remote.BlockSize, remote.Layout = 4, HND
	src := make([]byte, local.BlockBytes())
	dst := make([]byte, local.BlockBytes())
	b.SetBytes(int64(len(src)))
	for b.Loop() {
		if err := RegroupBlocks(dst, src, local, remote); err != nil {
			b.Fatal(err)
		}
	}
}
