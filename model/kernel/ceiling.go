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

// PeakInt8GOPS is [PeakGFLOPS] for int8 products: one goroutine per GOMAXPROCS runs a loop of
// independent VPDPBUSD (each 16 lanes × 4 byte multiply-adds = 64 multiply-adds on a zmm
// register), and the result is
//
//	GOP/s = Σ over goroutines (instructions × 64 multiply-adds × 2 operations) / elapsed ns
//
// counted as the float peaks count FLOPs (a multiply-add is 2), so that an int8 product's
// operations, 2 × its multiply-adds, compare with it as a float product's FLOPs compare with
// the float peaks. It returns 0 when this process computes int8 products without the
// instruction (see [Int8Products]).
func PeakInt8GOPS(d time.Duration) float64 {
	loop := int8PeakLoop()
	if loop == nil {
		return 0
	}
	return peak(d, loop)
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

// ReadGBps measures read bandwidth with every core: a [ReadProbe] over a buffer of bytes bytes
// (default 256 MiB), allocated for the call, reads for about 100ms; the result is in GB/s
// (10^9 bytes read per second). With bytes several times the last-level cache (32 MiB L3 here)
// it is the memory bandwidth that bounds decoding, where every weight byte is read once per
// token:
//
//	decode tokens/s ≤ ReadGBps(max(weightBytes, 256<<20))·10^9 / weightBytes
//
// With a smaller buffer it measures the cache level the buffer fits in. To measure again and
// again beside what the bandwidth bounds, keep a ReadProbe: a fresh buffer faults in far slower
// than it reads.
func ReadGBps(bytes int) float64 {
	return NewReadProbe(bytes, 0).GBps(100 * time.Millisecond)
}

// ReadProbe measures all-core memory read bandwidth as a batch-1 decode step reads its weights
// — every worker streaming its own stretch of memory at once — over a buffer it allocates and
// faults in once, so that it can measure right beside each measurement it bounds.
//
// [ReadProbe.GBps] runs one goroutine per worker, each locked to its OS thread and reading its
// share of the buffer. It reads the shares in two patterns, one after the other, and returns
// the faster one's rate: one sequential stream (the share start to end), and [probeStreams]
// streams side by side (its quarters, a few cache lines of each in turn within one loop, so that
// the hardware prefetchers run on all four at once). A one-row product keeps several panels'
// streams in flight per core (schedule.widePanels; the int8 kernel reads two panels at once),
// which can read faster than a single stream; the better of the two patterns is the ceiling the
// products are held to.
//
// Reading the streams in turns of [probeChunk] bytes instead (the probe's former second
// pattern, kept where the side-by-side kernel is missing) keeps one stream in flight at a time:
// on the shared 2-core VM it read 15–25% less than four streams side by side and less than the
// int8 batch-1 decode itself moved, which made that decode's ratios read above 1.
//
// A ReadProbe is not safe for concurrent use.
type ReadProbe struct {
	buf     []float32
	workers int
}

// probeStreams is how many streams side by side the second pattern of [ReadProbe] reads a worker.
const probeStreams = 4

// probeChunk is how many bytes of one stream the turn-based fallback of the second pattern (no
// side-by-side kernel) reads before turning to the next: 8 KB, two 4 KB pages, long enough that
// the calls cost nothing beside the reads (shorter turns measured slower).
const probeChunk = 8 << 10

// NewReadProbe returns a probe over a buffer of bytes bytes (≤ 0: 256 MiB; make it several
// times the last-level cache to measure memory, not a cache) read by workers goroutines (≤ 0:
// GOMAXPROCS — as many as a decode step's products run on).
func NewReadProbe(bytes, workers int) *ReadProbe {
	if bytes <= 0 {
		bytes = 256 << 20
	}
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	buf := make([]float32, bytes/4)
	for i := range buf {
		buf[i] = 1 // fault the pages in
	}
	return &ReadProbe{buf: buf, workers: workers}
}

// GBps reads for about window, half of it in each pattern (at least a pass of each), and returns
// the faster pattern's rate in GB/s (10^9 bytes a second).
func (p *ReadProbe) GBps(window time.Duration) float64 {
	return max(p.rate(1, window/2), p.rate(probeStreams, window/2))
}

// rate reads the buffer in streams streams a worker for about window — the workers start
// together and each reads at least one whole pass — and returns
// the sum of the workers' rates in GB/s, each its bytes over its passes' time (as a decode's
// figure is the time of all its steps).
func (p *ReadProbe) rate(streams int, window time.Duration) float64 {
	n := len(p.buf) / p.workers
	if n == 0 {
		return 0
	}
	rates := make([]float64, p.workers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for w := range p.workers {
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			share := p.buf[w*n : (w+1)*n]
			<-start
			t0 := time.Now()
			passes := 0
			for passes < 1 || time.Since(t0) < window {
				runtime.KeepAlive(readStreams(share, streams))
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

// readStreams reads all of x as streams sequential streams side by side: its equal stretches,
// a few cache lines of each in turn (readSideBySide), or where that kernel is missing probeChunk
// bytes of each in turn (the tail past the last whole stretch is read last).
func readStreams(x []float32, streams int) float32 {
	if streams <= 1 {
		return defaultImpl.readSum(x)
	}
	if sum, ok := readSideBySide(x, streams); ok {
		return sum
	}
	return readInTurns(x, streams)
}

// readInTurns reads all of x as streams sequential streams: its equal stretches, probeChunk
// bytes of each in turn (the tail past the last whole stretch is read last).
func readInTurns(x []float32, streams int) float32 {
	per := len(x) / streams / 16 * 16 // whole vectors, so that readSum takes every float
	const chunk = probeChunk / 4
	var sum float32
	for off := 0; off < per; off += chunk {
		end := min(per, off+chunk)
		for s := range streams {
			sum += defaultImpl.readSum(x[s*per+off : s*per+end])
		}
	}
	return sum + defaultImpl.readSum(x[streams*per:])
}
