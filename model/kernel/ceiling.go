package kernel

import (
	"runtime"
	"sync"
	"time"
)

// PeakGFLOPS measures this machine's float32 multiply-add peak over about d, using every core
// the Go scheduler may use: one goroutine per GOMAXPROCS, each locked to its OS thread, runs a
// loop of independent vector FMAs (enough independent accumulators to cover the FMA latency
// on every FMA pipe). The result is
//
//	GFLOP/s = Σ over goroutines (FMA instructions × lanes per instruction × 2 FLOPs) / elapsed ns
//
// with 16 lanes per instruction on AVX-512 (zmm), 8 on AVX2 (ymm); the portable build counts
// scalar multiply-adds. On a Zen 4/5 core with two 512-bit FMA pipes that is
// 2 pipes × 16 lanes × 2 FLOPs = 64 FLOPs per cycle per core. Because it is measured, other
// load on the machine lowers it; quote ratios against a peak measured in the same run.
func PeakGFLOPS(d time.Duration) float64 { return peak(d, defaultImpl.fmaLoop) }

// PeakBF16GFLOPS is [PeakGFLOPS] for bfloat16 products: one goroutine per GOMAXPROCS runs a loop
// of independent VDPBF16PS (each 16 lanes × 2 multiply-adds = 64 FLOPs on a zmm register). It
// returns 0 when this process computes bfloat16 products without the instruction (see
// [BF16Products]). On Zen 4, whose two 512-bit FMA pipes also run VDPBF16PS, it is twice the
// float32 peak.
func PeakBF16GFLOPS(d time.Duration) float64 {
	if defaultImpl.dpLoop == nil {
		return 0
	}
	return peak(d, defaultImpl.dpLoop)
}

// peak runs loop on every core for about d and returns the GFLOP/s they achieved together.
func peak(d time.Duration, loop func(n int) float64) float64 {
	if d <= 0 {
		d = 100 * time.Millisecond
	}
	workers := runtime.GOMAXPROCS(0)
	flops := make([]float64, workers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for w := range workers {
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			<-start
			flops[w] = burn(d, loop)
		})
	}
	close(start)
	wg.Wait()
	var total float64
	for _, f := range flops {
		total += f
	}
	return total / 1e9
}

// burn runs loop for about d and returns the FLOP/s it achieved.
func burn(d time.Duration, loop func(n int) float64) float64 {
	const chunk = 1 << 14 // loop iterations per timing check
	var n int64
	var perIter float64
	t0 := time.Now()
	for {
		perIter = loop(chunk)
		n += chunk
		if el := time.Since(t0); el >= d {
			return float64(n) * perIter / el.Seconds()
		}
	}
}

// MemcpyGBps measures single-goroutine copy bandwidth between two buffers of bytes bytes each
// (copy, i.e. runtime memmove), best of several repetitions over at least ~50ms, in GB/s of
// bytes copied (10^9 bytes per second; each copied byte is one read and one write).
func MemcpyGBps(bytes int) float64 {
	if bytes <= 0 {
		bytes = 64 << 20
	}
	src := make([]byte, bytes)
	dst := make([]byte, bytes)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src) // fault the pages in
	best := 0.0
	t0 := time.Now()
	for rep := 0; rep < 3 || time.Since(t0) < 50*time.Millisecond; rep++ {
		s := time.Now()
		copy(dst, src)
		if gbps := float64(bytes) / time.Since(s).Seconds() / 1e9; gbps > best {
			best = gbps
		}
		if rep > 1000 {
			break
		}
	}
	return best
}

// ReadGBps measures read bandwidth with every core: a buffer of bytes bytes (default 256 MiB)
// is split between GOMAXPROCS goroutines, which start together and each read their share over
// and over with vector loads for about 100ms; the result is the sum of their rates in GB/s
// (10^9 bytes read per second). With bytes several times the last-level cache (32 MiB L3 here)
// it is the memory bandwidth that bounds decoding, where every weight byte is read once per
// token:
//
//	decode tokens/s ≤ ReadGBps(max(weightBytes, 256<<20))·10^9 / weightBytes
//
// With a smaller buffer it measures the cache level the buffer fits in.
func ReadGBps(bytes int) float64 {
	if bytes <= 0 {
		bytes = 256 << 20
	}
	buf := make([]float32, bytes/4)
	for i := range buf {
		buf[i] = 1 // fault the pages in
	}
	workers := runtime.GOMAXPROCS(0)
	n := len(buf) / workers
	if n == 0 {
		return 0
	}
	const window = 100 * time.Millisecond
	rates := make([]float64, workers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for w := range workers {
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			share := buf[w*n : (w+1)*n]
			<-start
			defaultImpl.readSum(share) // warm-up pass
			t0 := time.Now()
			passes := 0
			for passes < 2 || time.Since(t0) < window {
				runtime.KeepAlive(defaultImpl.readSum(share))
				passes++
			}
			rates[w] = float64(passes*n*4) / time.Since(t0).Seconds()
		})
	}
	close(start)
	wg.Wait()
	var total float64
	for _, r := range rates {
		total += r
	}
	return total / 1e9
}
