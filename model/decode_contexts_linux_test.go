package model

import (
	"os"
	"runtime"
	"slices"
	"testing"
	"time"
)

// BenchmarkDecodeBatch1Contexts times batch-1 decode steps of the model at
// $KVBRIDGE_BENCH_MODEL (skipped without it; e.g. /tmp/qwen3-0.6b) in bfloat16 in one process,
// three kinds alternated step by step so that a shared machine's load falls on each alike: a
// step at context 128, one at context 1024, and one at context 128 right after a batch-32 step
// at context 128 (the order `kvbridge bench engine` runs its cells in: does a batched step leave
// anything that slows the next batch-1 step?). It reports each kind's median process CPU and
// wall milliseconds a step, the median over the rounds of each kind's CPU over the context-128
// step's of the same round, and logs the goroutines alive between steps (at GOMAXPROCS 1 the
// model's kernel pool has no worker goroutine, so the benchmark's own are all there are).
func BenchmarkDecodeBatch1Contexts(b *testing.B) {
	path := os.Getenv("KVBRIDGE_BENCH_MODEL")
	if path == "" {
		b.Skip("KVBRIDGE_BENCH_MODEL is not set")
	}
	m, err := Open(b.Context(), path, OpenOptions{DType: "bfloat16"})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	const blockSize, short, long, batch = 16, 128, 1024, 32
	per, perLong := short/blockSize+1, long/blockSize+1
	kv := newTestKVFor(m, blockSize, batch*per+perLong, false)
	seqs := make([]Seq, batch)
	for i := range seqs {
		seqs[i] = Seq{Tokens: []int32{int32(i + 1)}, Start: short, Blocks: blockRange(i*per, per), Logits: make([]float32, m.cfg.VocabSize)}
	}
	longSeq := []Seq{{Tokens: []int32{int32(batch + 1)}, Start: long, Blocks: blockRange(batch*per, perLong), Logits: make([]float32, m.cfg.VocabSize)}}
	step := func(s []Seq) (cpu, wall float64) {
		c0, t0 := processCPU(b), time.Now()
		if err := m.Forward(b.Context(), kv, blockSize, s); err != nil {
			b.Fatal(err)
		}
		return processCPU(b) - c0, time.Since(t0).Seconds()
	}
	for range 2 { // fault in the weights and the KV, size the workspaces for batch 32
		step(seqs[:1])
		step(longSeq)
		step(seqs)
	}
	b.Logf("GOMAXPROCS %d, %d goroutines between steps", runtime.GOMAXPROCS(0), runtime.NumGoroutine())
	const kinds = 3
	var cpu, wall [kinds][]float64
	for r := 0; b.Loop(); r++ {
		for i := range kinds {
			k := (i + r) % kinds // each kind comes first, second and third in turn
			var c, w float64
			switch k {
			case 0:
				c, w = step(seqs[:1])
			case 1:
				c, w = step(longSeq)
			case 2:
				step(seqs)
				c, w = step(seqs[:1])
			}
			cpu[k], wall[k] = append(cpu[k], c), append(wall[k], w)
		}
	}
	median := func(x []float64) float64 {
		x = slices.Clone(x)
		slices.Sort(x)
		return x[len(x)/2]
	}
	names := []string{"ctx128", "ctx1024", "ctx128-after-b32"}
	for k, name := range names {
		b.ReportMetric(1000*median(cpu[k]), "cpu-ms/"+name)
		b.ReportMetric(1000*median(wall[k]), "wall-ms/"+name)
	}
	// Each round's CPU of a kind over that of the plain context-128 step, the load of the round
	// cancelling out: the median of those ratios.
	for k := 1; k < kinds; k++ {
		ratios := make([]float64, len(cpu[0]))
		for r := range ratios {
			ratios[r] = cpu[k][r] / cpu[0][r]
		}
		b.ReportMetric(median(ratios), names[k]+"/ctx128")
	}
}
