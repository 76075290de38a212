//go:build linux

package kernel

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
)

// BenchmarkTallStreamTiles is batched decode's bfloat16 products of 7 rows over about 320 MB
// of Qwen3-0.6B-shaped weights, far larger than the last-level cache, each read once a pass, on
// one thread: the schedule without the tall tile (old: half-panel tiles) and with it (new)
// alternated pass by pass, each first every other pass, after a pass of each to warm up. It
// reports each one's GB of weights per CPU second of the thread, which leaves out what other
// processes take of a shared machine's cores, and new ÷ old. Rows 1 and 8 run the same code both
// ways: the one-row kernels' stream rate in the same minutes, and the pairing's bias.
func BenchmarkTallStreamTiles(b *testing.B) {
	if defaultImpl.tileDotTall == nil {
		b.Skip("no tall tiles")
	}
	alternateStreamImpls(b, []int{1, 7, 8}, 320<<20, "old", func(im *impl) { im.tileDotTall = nil })
}

// BenchmarkTallL2Tiles is BenchmarkTallStreamTiles over one 256 × 1024 matrix read over and
// over (its weights in L2): what the tiles reach when the weights do not wait for memory.
// (Rows 8 is again the pairing's bias.)
func BenchmarkTallL2Tiles(b *testing.B) {
	if defaultImpl.tileDotTall == nil {
		b.Skip("no tall tiles")
	}
	for _, rows := range []int{7, 8} {
		b.Run(fmt.Sprintf("rows%d", rows), func(b *testing.B) {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			pool := NewPool(1)
			defer pool.Close()
			l := benchWeights(pool, BF16, 256, 1024)
			l.bf16Dot = true
			r := rand.New(rand.NewPCG(1, 1))
			x, dst := randSlice(r, rows*1024), make([]float32, rows*256)
			old := *defaultImpl
			old.tileDotTall = nil
			pass := func(im *impl) float64 {
				l.impl = im
				t0 := threadCPU(b)
				for range 200 {
					l.Apply(dst, x, rows)
				}
				return threadCPU(b) - t0
			}
			alternateImpls(b, "old", &old, float64(l.Bytes())*200/1e9, pass)
		})
	}
}
