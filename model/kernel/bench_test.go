package kernel

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// benchWeights returns an out × in Linear on pool storing random weights as dtype.
func benchWeights(pool *Pool, dtype DType, out, in int) *Linear {
	r := rand.New(rand.NewPCG(1, 1))
	w := randSlice(r, out*in)
	if dtype == F32 {
		return NewLinearOn(pool, w, out, in)
	}
	h, _ := to16(w, dtype)
	return NewLinear16From(pool, dtype, out, in, func(n int, dst []uint16) { copy(dst, h[n*in:(n+1)*in]) })
}

// benchLinear reports achieved GFLOP/s and its ratio to the FMA peak (bfloat16 products: the
// VDPBF16PS peak) measured just before. dot selects bfloat16 products (BF16 weights).
func benchLinear(b *testing.B, dtype DType, dot bool, rows, out, in int) {
	r := rand.New(rand.NewPCG(1, 1))
	pool := NewPool(0)
	defer pool.Close()
	l := benchWeights(pool, dtype, out, in)
	peak := PeakGFLOPS(100 * time.Millisecond)
	if dot {
		l.bf16Dot = true
		peak = PeakBF16GFLOPS(100 * time.Millisecond)
	}
	x, dst := randSlice(r, rows*in), make([]float32, rows*out)
	l.Apply(dst, x, rows)
	b.SetBytes(l.Bytes())
	b.ResetTimer()
	for b.Loop() {
		l.Apply(dst, x, rows)
	}
	gflops := 2 * float64(rows) * float64(out) * float64(in) * float64(b.N) / b.Elapsed().Seconds() / 1e9
	b.ReportMetric(gflops, "GFLOP/s")
	b.ReportMetric(peak, "peakGFLOP/s")
	b.ReportMetric(gflops/peak, "ofPeak")
}

// BenchmarkGEMM is the prefill case: rows × out × in. The last three are kvbridge/small's fused
// qkv, fused gate/up and down projections on a 512-token chunk.
func BenchmarkGEMM(b *testing.B) {
	for _, s := range [][3]int{{2048, 1024, 1024}, {512, 1024, 1024}, {512, 2048, 2048}, {2048, 3072, 1024},
		{2048, 1024, 3072}, {64, 1024, 1024}, {512, 1024, 512}, {512, 3072, 512}, {512, 512, 1536}} {
		for _, dt := range []DType{F32, BF16} {
			b.Run(fmt.Sprintf("%v/%dx%dx%d", dt, s[0], s[1], s[2]), func(b *testing.B) { benchLinear(b, dt, false, s[0], s[1], s[2]) })
		}
		if BF16Products() == "VDPBF16PS" {
			b.Run(fmt.Sprintf("bf16dot/%dx%dx%d", s[0], s[1], s[2]), func(b *testing.B) { benchLinear(b, BF16, true, s[0], s[1], s[2]) })
		}
	}
}

// BenchmarkGEMV is the decode case (one row): the first five shapes are Qwen3-0.6B's fused qkv,
// o_proj, fused gate/up, down_proj and a slice of lm_head. Besides GFLOP/s it reports the weight bytes read
// per second and their ratio to the all-core read bandwidth measured just before (for weights
// larger than the last-level cache that is the memory-bound ceiling).
func BenchmarkGEMV(b *testing.B) {
	for _, s := range [][2]int{{4096, 1024}, {1024, 2048}, {6144, 1024}, {1024, 3072}, {16384, 1024}, {3072, 512}, {2048, 2048}, {4096, 4096}} {
		for _, kind := range []string{"float32", "bfloat16", "bf16dot"} {
			b.Run(fmt.Sprintf("%s/%dx%d", kind, s[0], s[1]), func(b *testing.B) {
				out, in := s[0], s[1]
				r := rand.New(rand.NewPCG(1, 1))
				pool := NewPool(0)
				defer pool.Close()
				dt := BF16
				if kind == "float32" {
					dt = F32
				}
				l := benchWeights(pool, dt, out, in)
				l.bf16Dot = kind == "bf16dot"
				x, dst := randSlice(r, in), make([]float32, out)
				bw := ReadGBps(max(int(l.Bytes()), 256<<20))
				l.Apply(dst, x, 1)
				b.SetBytes(l.Bytes())
				b.ResetTimer()
				for b.Loop() {
					l.Apply(dst, x, 1)
				}
				sec := b.Elapsed().Seconds() / float64(b.N)
				gbps := float64(l.Bytes()) / sec / 1e9
				b.ReportMetric(2*float64(out*in)/sec/1e9, "GFLOP/s")
				b.ReportMetric(bw, "readGB/s")
				b.ReportMetric(gbps/bw, "ofReadBW")
			})
		}
	}
}

func BenchmarkDot(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	x, y := randSlice(r, 128), randSlice(r, 128)
	b.SetBytes(128 * 8)
	for b.Loop() {
		Dot(x, y)
	}
}

func BenchmarkSiLUMul(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	g, u, d := randSlice(r, 3072), randSlice(r, 3072), make([]float32, 3072)
	b.SetBytes(3072 * 4)
	for b.Loop() {
		SiLUMul(d, g, u)
	}
}

func BenchmarkSoftmax(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	x := randSlice(r, 2048)
	y := make([]float32, 2048)
	b.SetBytes(2048 * 4)
	for b.Loop() {
		copy(y, x)
		Softmax(y)
	}
}

func BenchmarkCeilings(b *testing.B) {
	for b.Loop() {
		b.ReportMetric(PeakGFLOPS(200*time.Millisecond), "peakGFLOP/s")
		b.ReportMetric(PeakBF16GFLOPS(200*time.Millisecond), "peakBF16GFLOP/s")
		b.ReportMetric(MemcpyGBps(64<<20), "memcpyGB/s")
		b.ReportMetric(ReadGBps(256<<20), "readGB/s")
	}
}

// BenchmarkParallel measures the cost of one Parallel call with trivial items (dispatch and
// wait) on a pool and on the stateless package-level function.
func BenchmarkParallel(b *testing.B) {
	b.Run("pool", func(b *testing.B) {
		p := NewPool(0)
		defer p.Close()
		for b.Loop() {
			p.Parallel(8, func(int) {})
		}
	})
	b.Run("func", func(b *testing.B) {
		for b.Loop() {
			Parallel(8, func(int) {})
		}
	})
}

// BenchmarkRepack is packing one attention chunk (64 keys × 64 dims) from rows held in a paged
// store: the keys transposed (SetRows) and the values copied (SetColumns).
func BenchmarkRepack(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	store := randSlice(r, 64*64)
	row := func(n int) []float32 { return store[n*64 : (n+1)*64] }
	var l Linear
	b.Run("rows", func(b *testing.B) {
		for b.Loop() {
			l.SetRows(nil, 64, 64, row)
		}
	})
	b.Run("columns", func(b *testing.B) {
		for b.Loop() {
			l.SetColumns(nil, 64, 64, row)
		}
	})
	b.Run("NewLinear", func(b *testing.B) {
		pool := NewPool(1)
		defer pool.Close()
		for b.Loop() {
			NewLinearOn(pool, store, 64, 64)
		}
	})
}

// streamShapes are a decode layer's products (N × K: q/k/v, o_proj, gate/up, down_proj), which the
// stream benchmarks repeat to about 320 MB of weights.
var streamShapes = [][2]int{{4096, 1024}, {1024, 2048}, {6144, 1024}, {1024, 3072}}

// BenchmarkGEMVStream is batch-1 decode's weight stream: one-row products over a stack of
// matrices far larger than the last-level cache (Qwen3-0.6B's fused qkv, o_proj, fused gate/up
// and down_proj, repeated to about 320 MB of weights), each read once per pass as a decode step
// reads its layers. After each pass the bandwidth probe that `kvbridge bench engine` divides by
// (ReadProbe) reads for as long as the pass took, so the two share the machine's load; it reports
// the medians of the passes' weight bytes a second and of their ratio to the probe's: what the
// products alone reach of the ceiling, which no whole step (the products plus attention, norms
// and hand-offs) can exceed.
func BenchmarkGEMVStream(b *testing.B) {
	shapes := streamShapes
	probe := NewReadProbe(0, 0)
	for _, kind := range []string{"bfloat16", "bf16dot", "int8"} {
		b.Run(kind, func(b *testing.B) {
			if kind == "bf16dot" && BF16Products() != "VDPBF16PS" {
				b.Skip("no VDPBF16PS")
			}
			pool := NewPool(0)
			defer pool.Close()
			r := rand.New(rand.NewPCG(1, 1))
			var ls []*Linear
			var bytes int64
			for bytes < 320<<20 {
				s := shapes[len(ls)%len(shapes)]
				var l *Linear
				if kind == "int8" {
					w := randSlice(r, s[0]*s[1])
					l = NewLinearInt8From(pool, s[0], s[1], func(n int, dst []float32) { copy(dst, w[n*s[1]:(n+1)*s[1]]) })
				} else {
					l = benchWeights(pool, BF16, s[0], s[1])
					l.bf16Dot = kind == "bf16dot"
				}
				ls = append(ls, l)
				bytes += l.Bytes()
			}
			x, dst := randSlice(r, 3072), make([]float32, 6144)
			b.SetBytes(bytes)
			var rates, ratios []float64
			for b.Loop() {
				t0 := time.Now()
				for _, l := range ls {
					l.Apply(dst, x, 1)
				}
				d := time.Since(t0)
				b.StopTimer()
				gbps := float64(bytes) / d.Seconds() / 1e9
				rates, ratios = append(rates, gbps), append(ratios, gbps/probe.GBps(d))
				b.StartTimer()
			}
			b.ReportMetric(median(rates), "GB/s")
			b.ReportMetric(median(ratios), "ofProbe")
		})
	}
}

// median returns the median of x (reordering it).
func median(x []float64) float64 {
	slices.Sort(x)
	return x[len(x)/2]
}

// BenchmarkBatchStream is batched decode's products: rows (8 or 32) × the matrices of
// BenchmarkGEMVStream (about 320 MB of weights, far larger than the last-level cache), each read
// once per pass. It reports the median of the passes' ratios to their bound, max(weight bytes ÷
// read bandwidth, FLOPs ÷ the dtype's peak): the bandwidth probed after each pass for as long
// as it took (ReadProbe, as `kvbridge bench engine` probes), the peak measured once after the
// passes. That is the fraction of the step bound's product term the kernels reach alone.
func BenchmarkBatchStream(b *testing.B) {
	probe := NewReadProbe(0, 0)
	for _, kind := range []string{"bfloat16", "bf16dot"} {
		for _, rows := range []int{8, 32} {
			b.Run(fmt.Sprintf("%s/rows%d", kind, rows), func(b *testing.B) {
				if kind == "bf16dot" && BF16Products() != "VDPBF16PS" {
					b.Skip("no VDPBF16PS")
				}
				pool := NewPool(0)
				defer pool.Close()
				r := rand.New(rand.NewPCG(1, 1))
				ls, bytes := streamLinearsBF16(pool, kind == "bf16dot", 320<<20)
				flops := float64(rows) * float64(bytes) // 2·rows FLOPs a weight of 2 bytes
				x, dst := randSlice(r, rows*3072), make([]float32, rows*6144)
				b.SetBytes(bytes)
				var secs, bws []float64
				for b.Loop() {
					t0 := time.Now()
					for _, l := range ls {
						l.Apply(dst, x, rows)
					}
					d := time.Since(t0)
					b.StopTimer()
					secs, bws = append(secs, d.Seconds()), append(bws, probe.GBps(d))
					b.StartTimer()
				}
				peak := PeakGFLOPS(100 * time.Millisecond)
				if kind == "bf16dot" {
					peak = PeakBF16GFLOPS(100 * time.Millisecond)
				}
				ratios := make([]float64, len(secs))
				for i, sec := range secs {
					ratios[i] = max(float64(bytes)/(bws[i]*1e9), flops/(peak*1e9)) / sec
				}
				b.ReportMetric(flops/median(secs)/1e9, "GFLOP/s")
				b.ReportMetric(peak, "peakGFLOP/s")
				b.ReportMetric(median(bws), "readGB/s")
				b.ReportMetric(median(ratios), "ofBound")
			})
		}
	}
}

// streamLinearsBF16 returns BF16 Linears of the stream shapes on pool (bfloat16 products when
// dot), repeated until they hold at least limit bytes of weights, and their bytes.
func streamLinearsBF16(pool *Pool, dot bool, limit int64) ([]*Linear, int64) {
	var ls []*Linear
	var bytes int64
	for bytes < limit {
		s := streamShapes[len(ls)%len(streamShapes)]
		l := benchWeights(pool, BF16, s[0], s[1])
		l.bf16Dot = dot
		ls = append(ls, l)
		bytes += l.Bytes()
	}
	return ls, bytes
}
