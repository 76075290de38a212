//go:build linux

package kernel

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"unsafe"
)

// kvAheadStore is a bfloat16 KV store laid out as the model's (Qwen3-0.6B shape, blocks of 16
// tokens): each block holds, for each of 28 layers, a 64 KB stretch (8 heads' keys, then their
// values); a layer's KV of a batch of 32 sequences at context 128 is 256 such stretches, 1.8 MB
// apart, 16.8 MB.
type kvAheadStore struct {
	buf    []uint8
	blocks int
}

const (
	kvStretch = 64 << 10
	kvLayers  = 28
	kvBlock   = kvLayers * kvStretch
)

// newKVAheadStore returns a store of blocks blocks, its pages faulted in.
func newKVAheadStore(blocks int) *kvAheadStore {
	s := &kvAheadStore{buf: make([]uint8, blocks*kvBlock), blocks: blocks}
	for i := 0; i < len(s.buf); i += 4096 {
		s.buf[i] = 1
	}
	return s
}

// stretch returns layer l's stretch of block b.
func (s *kvAheadStore) stretch(l, b int) []uint8 {
	o := b*kvBlock + l*kvStretch
	return s.buf[o : o+kvStretch]
}

// read touches layer l's KV of every block, block after block.
func (s *kvAheadStore) read(l int) {
	for b := range s.blocks {
		Touch(s.stretch(l, b))
	}
}

// layerBytes is the bytes of one layer's KV.
func (s *kvAheadStore) layerBytes() float64 { return float64(s.blocks * kvStretch) }

// BenchmarkKVAheadGate measures whether a layer's KV read ahead of attention is still in the
// caches when attention comes: one thread, thread CPU time; each sample reads a layer's KV (16.8
// MB, 64 KB stretches 1.8 MB apart) after something else, the layers taken in turn so that
// every first read is from memory:
//
//   - cold: the layer's KV read from memory;
//   - hot: read twice in a row, the second timed;
//   - streamN: read, then N MB of other data streamed (touched) through the core, then timed;
//   - tilesN: read, then 32-row bfloat16 products over N MB of weights streamed from memory,
//     then timed;
//
// and, against the products' compute alone (32 rows over one 256 × 1024 matrix in L2, 200
// calls), the same calls with the layer's KV read in 200 slices between them: the CPU the
// interleaved read adds (mixExtra), the compute alone (mixTiles), and the KV read right after
// (mixReread). Reported as GB of KV per CPU second (for mixExtra: KV bytes ÷ the added CPU).
func BenchmarkKVAheadGate(b *testing.B) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	pool := NewPool(1)
	defer pool.Close()
	s := newKVAheadStore(256)
	other := make([]uint8, 256<<20)
	for i := 0; i < len(other); i += 4096 {
		other[i] = 1
	}
	ls, _ := streamLinearsBF16(pool, true, 256<<20)
	l2 := benchWeights(pool, BF16, 256, 1024)
	l2.bf16Dot = true
	const rows = 32
	r := rand.New(rand.NewPCG(1, 1))
	x, dst := randSlice(r, rows*3072), make([]float32, rows*6144)
	layer, off, li := 0, 0, 0
	next := func() int { layer = (layer + 1) % kvLayers; return layer }
	stream := func(mb int) {
		n := mb << 20
		if off+n > len(other) {
			off = 0
		}
		Touch(other[off : off+n])
		off += n
	}
	products := func(mb int) {
		var done int64
		for done < int64(mb)<<20 {
			l := ls[li%len(ls)]
			li++
			l.Apply(dst, x, rows)
			done += l.Bytes()
		}
	}
	timed := func(fn func()) float64 {
		t0 := threadCPU(b)
		fn()
		return threadCPU(b) - t0
	}
	type mode struct {
		name string
		run  func() float64 // thread CPU seconds of the timed read
	}
	modes := []mode{
		{"cold", func() float64 { l := next(); return timed(func() { s.read(l) }) }},
		{"hot", func() float64 { l := next(); s.read(l); return timed(func() { s.read(l) }) }},
	}
	for _, mb := range []int{4, 8, 16, 24} {
		modes = append(modes, mode{fmt.Sprintf("stream%d", mb), func() float64 {
			l := next()
			s.read(l)
			stream(mb)
			return timed(func() { s.read(l) })
		}})
	}
	for _, mb := range []int{8, 16} {
		modes = append(modes, mode{fmt.Sprintf("tiles%d", mb), func() float64 {
			l := next()
			s.read(l)
			products(mb)
			return timed(func() { s.read(l) })
		}})
	}
	var mixTiles, mixBoth, mixReread float64
	mix := func() {
		const calls = 200
		l := next()
		mixTiles += timed(func() {
			for range calls {
				l2.Apply(dst, x, rows)
			}
		})
		stream(32) // evict what the tiles left
		l = next()
		per := s.blocks * kvStretch / calls / 64 * 64
		mixBoth += timed(func() {
			for c := range calls {
				for o := c * per; o < (c+1)*per; {
					blk, in := o/kvStretch, o%kvStretch
					n := min(kvStretch-in, (c+1)*per-o)
					Touch(s.stretch(l, blk)[in : in+n])
					o += n
				}
				l2.Apply(dst, x, rows)
			}
		})
		mixReread += timed(func() { s.read(l) })
	}
	cpu := make([]float64, len(modes))
	for range 2 { // warm up
		for _, m := range modes {
			m.run()
		}
		mix()
	}
	mixTiles, mixBoth, mixReread = 0, 0, 0
	n := 0
	for b.Loop() {
		for j := range modes {
			i := (j + n) % len(modes)
			cpu[i] += modes[i].run()
		}
		mix()
		n++
	}
	gb := s.layerBytes() / 1e9 * float64(n)
	for i, m := range modes {
		b.ReportMetric(gb/cpu[i], m.name+"GB/cpu-s")
	}
	b.ReportMetric(gb/(mixBoth-mixTiles), "mixExtraGB/cpu-s")
	b.ReportMetric(mixTiles/float64(n)*1e3, "mixTilesms")
	b.ReportMetric(gb/mixReread, "mixRereadGB/cpu-s")
}

// BenchmarkKVAheadTilePrefetch measures reading a layer's KV under compute-bound products:
// 32-row bfloat16 tiles over one 256 × 1024 matrix in L2, called directly. Per round, one layer
// each: the calls alone (tilesms); the calls each given a chunk of the KV as the memory they
// prefetch on the way (their pf, a product's share of the next panel; tilesPFms), then the KV
// read as attention would (pfRereadGB/cpu-s); the calls each after a demand read (Touch) of a
// chunk (tilesTouchms), then the KV read (touchRereadGB/cpu-s); a layer's KV read cold. Thread
// CPU time; the added CPU of each read-ahead as the KV's GB per added CPU second.
func BenchmarkKVAheadTilePrefetch(b *testing.B) {
	for _, chunk := range []int{4 << 10, 16 << 10, 32 << 10} {
		b.Run(fmt.Sprintf("chunk%dK", chunk>>10), func(b *testing.B) {
			kvAheadTilePrefetch(b, 256, chunk, 1)
		})
	}
}

// kvAheadTilePrefetch is BenchmarkKVAheadTilePrefetch for a store of blocks blocks (a layer's KV
// of 64 KB a block), chunk bytes of the KV a tile call, on threads
// threads at once (each with its own store and matrix, the phases of a round started together;
// the figures are the threads' sums).
func kvAheadTilePrefetch(b *testing.B, blocks, chunk, threads int) {
	ws := make([]*aheadWorker, threads)
	for i := range ws {
		ws[i] = newAheadWorker(blocks, chunk)
	}
	defer func() {
		for _, w := range ws {
			w.pool.Close()
		}
	}()
	// phase runs phase k of a round on every worker, each on its own locked thread.
	phase := func(k int) {
		var wg sync.WaitGroup
		for _, w := range ws {
			wg.Add(1)
			go func() {
				defer wg.Done()
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				w.phase(b, k)
			}()
		}
		wg.Wait()
	}
	round := func() {
		for k := range 6 {
			phase(k)
		}
	}
	round()
	for _, w := range ws {
		w.t = [6]float64{}
	}
	n := 0
	for b.Loop() {
		round()
		n++
	}
	var t [6]float64
	for _, w := range ws {
		for k := range t {
			t[k] += w.t[k]
		}
	}
	gb := ws[0].s.layerBytes() / 1e9 * float64(n*threads)
	ms := func(x float64) float64 { return x / float64(n*threads) * 1e3 }
	b.ReportMetric(ms(t[0]), "tilesms")
	b.ReportMetric(ms(t[1]), "tilesPFms")
	b.ReportMetric(ms(t[3]), "tilesTouchms")
	b.ReportMetric(gb/(t[1]-t[0]), "pfAddedGB/cpu-s")
	b.ReportMetric(gb/(t[3]-t[0]), "touchAddedGB/cpu-s")
	b.ReportMetric(gb/t[2], "pfRereadGB/cpu-s")
	b.ReportMetric(gb/t[4], "touchRereadGB/cpu-s")
	b.ReportMetric(gb/t[5], "coldGB/cpu-s")
	b.ReportMetric(t[5]/t[2], "cold/pfReread")
	// Above 1 the read-ahead in the tiles and the read after it took less CPU than the cold read.
	b.ReportMetric(t[5]/(t[2]+t[1]-t[0]), "cold/(pf+reread)")
}

// aheadWorker is one thread's store, matrix and timings in kvAheadTilePrefetch.
type aheadWorker struct {
	pool  *Pool
	s     *kvAheadStore
	kv16  []uint16
	l     *Linear
	a     []uint32
	dst   []float32
	chunk int
	calls int
	layer int
	t     [6]float64 // tiles, tiles+pf, pf reread, tiles+touch, touch reread, cold
}

const aheadRows, aheadTiles = 32, 6

func newAheadWorker(blocks, chunk int) *aheadWorker {
	w := &aheadWorker{pool: NewPool(1), s: newKVAheadStore(blocks), chunk: chunk}
	w.kv16 = unsafe.Slice((*uint16)(unsafe.Pointer(&w.s.buf[0])), len(w.s.buf)/2)
	w.l = benchWeights(w.pool, BF16, 256, 1024)
	kp := w.l.in / 2
	r := rand.New(rand.NewPCG(1, 1))
	x := randSlice(r, aheadRows*w.l.in)
	w.a = make([]uint32, aheadRows*kp)
	for m := range aheadRows {
		defaultImpl.toPairs(w.a[m*kp:(m+1)*kp], x[m*w.l.in:(m+1)*w.l.in])
	}
	w.dst = make([]float32, aheadRows*w.l.out)
	w.calls = blocks * kvStretch / chunk
	return w
}

// kvChunk returns the chunk of the current layer's KV that tile call i reads ahead (nil: none).
func (w *aheadWorker) kvChunk(i int) []uint16 {
	if i >= w.calls {
		return nil
	}
	o := i * w.chunk
	blk, in := o/kvStretch, o%kvStretch
	base := (blk*kvBlock + w.layer*kvStretch + in) / 2
	return w.kv16[base : base+w.chunk/2]
}

// run makes the tile calls that cover the layer's KV; with pf, call i prefetches kvChunk(i),
// with touch it reads it (Touch) first instead.
func (w *aheadWorker) run(pf, touch bool) {
	l, kp, stride := w.l, w.l.in/2, w.l.panel16Len()
	for i := 0; i < w.calls; {
		for p := range l.panels {
			for ti := range aheadTiles {
				m0, m1 := ti*aheadRows/aheadTiles, (ti+1)*aheadRows/aheadTiles
				var q []uint16
				if pf || touch {
					q = w.kvChunk(i)
				}
				if touch {
					Touch(q)
					q = nil
				}
				defaultImpl.tileDot(w.dst[m0*l.out+p*panelWidth:], l.out, w.a[m0*kp:], kp, l.h[p*stride:(p+1)*stride], kp, m1-m0, panelWidth, q, false)
				i++
			}
		}
	}
}

// phase runs and times phase k of a round: 0 the calls alone (a new layer), 1 the calls
// prefetching the layer's KV, 2 its read, 3 the calls reading the next layer's KV, 4 its
// read, 5 the next layer's read cold.
func (w *aheadWorker) phase(b *testing.B, k int) {
	if k == 0 || k == 3 || k == 5 {
		w.layer = (w.layer + 1) % kvLayers
	}
	t0 := threadCPU(b)
	switch k {
	case 0:
		w.run(false, false)
	case 1:
		w.run(true, false)
	case 3:
		w.run(false, true)
	default:
		w.s.read(w.layer)
	}
	w.t[k] += threadCPU(b) - t0
}

// BenchmarkKVAheadTilePrefetch2 is BenchmarkKVAheadTilePrefetch on both cores at once, each
// thread with half a layer's KV (8.4 MB) or all of one, as a batch-32 step's two workers would.
func BenchmarkKVAheadTilePrefetch2(b *testing.B) {
	for _, blocks := range []int{64, 128, 256} {
		for _, chunk := range []int{16 << 10, 32 << 10} {
			b.Run(fmt.Sprintf("blocks%d/chunk%dK", blocks, chunk>>10), func(b *testing.B) {
				kvAheadTilePrefetch(b, blocks, chunk, 2)
			})
		}
	}
}
