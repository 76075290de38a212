package model

import (
	"fmt"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// processCPU returns the CPU seconds (user + system) the process has used so far.
func processCPU(b *testing.B) float64 {
	b.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

// hugePageKV returns n zeroed bfloat16 elements of anonymous memory, 2 MB aligned and advised
// as transparent huge pages (MADV_HUGEPAGE), for a KV store in BenchmarkDecodeSteps; it logs the
// process's AnonHugePages once the memory is faulted in. The mapping lives until the process
// ends.
func hugePageKV(b *testing.B, n int) []uint16 {
	b.Helper()
	const huge = 2 << 20
	size := (2*n + huge - 1) &^ (huge - 1)
	buf, err := unix.Mmap(-1, 0, size+huge, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON)
	if err != nil {
		b.Fatal(err)
	}
	off := (huge - int(uintptr(unsafe.Pointer(&buf[0])))%huge) % huge
	buf = buf[off : off+size]
	if err := unix.Madvise(buf, unix.MADV_HUGEPAGE); err != nil {
		b.Fatal(err)
	}
	mem := unsafe.Slice((*uint16)(unsafe.Pointer(&buf[0])), n)
	clear(mem)
	if s, err := os.ReadFile("/proc/self/smaps_rollup"); err == nil {
		for _, l := range strings.Split(string(s), "\n") {
			if strings.HasPrefix(l, "AnonHugePages") {
				b.Logf("KV in huge pages: %d MB; %s", 2*n>>20, l)
			}
		}
	}
	return mem
}

// BenchmarkDecodeSteps times batched decode steps alone — no load, no prefill — of the model
// at $KVBRIDGE_BENCH_MODEL (skipped without it; e.g. /tmp/qwen3-0.6b) in the dtype of
// $KVBRIDGE_BENCH_DTYPE (default bfloat16), at the batch sizes of $KVBRIDGE_BENCH_BATCH
// (default 8 and 32) over 128 positions of random KV each, with the weights quantized as
// $KVBRIDGE_BENCH_QUANT says (default none; "int8"). It reports the wall and the process
// CPU milliseconds of a step; with $KVBRIDGE_BENCH_CPUPROFILE set it writes a CPU profile of
// the timed steps only (so pprof shows a decode step's parts without the load's), one file per
// batch size (the name gets "-b<batch>"). With $KVBRIDGE_BENCH_THP=1 a bfloat16 KV store is in
// transparent huge pages (hugePageKV). $KVBRIDGE_BENCH_KV is the KV cache dtype (default the
// dtype's); with $KVBRIDGE_BENCH_FP8F32=1 FP8 attention runs the float32 row kernels where it
// would run the bfloat16 ones (Model.fp8F32), to compare the two in alternated runs.
func BenchmarkDecodeSteps(b *testing.B) {
	path := os.Getenv("KVBRIDGE_BENCH_MODEL")
	if path == "" {
		b.Skip("KVBRIDGE_BENCH_MODEL is not set")
	}
	dtype := os.Getenv("KVBRIDGE_BENCH_DTYPE")
	if dtype == "" {
		dtype = "bfloat16"
	}
	batches := []int{8, 32}
	if s := os.Getenv("KVBRIDGE_BENCH_BATCH"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			b.Fatalf("KVBRIDGE_BENCH_BATCH: %v", err)
		}
		batches = []int{n}
	}
	m, err := Open(b.Context(), path, OpenOptions{DType: dtype, Quantization: os.Getenv("KVBRIDGE_BENCH_QUANT"), KVCacheDType: os.Getenv("KVBRIDGE_BENCH_KV")})
	if err != nil {
		b.Fatal(err)
	}
	m.fp8F32 = os.Getenv("KVBRIDGE_BENCH_FP8F32") == "1"
	defer m.Close()
	const blockSize, ctx = 16, 128
	per := ctx / blockSize
	for _, nseq := range batches {
		b.Run(fmt.Sprintf("%s/batch%d", dtype, nseq), func(b *testing.B) {
			kv := newTestKVFor(m, blockSize, per*nseq, false)
			if os.Getenv("KVBRIDGE_BENCH_THP") == "1" && kv.mem16 != nil {
				kv.mem16 = hugePageKV(b, len(kv.mem16))
			}
			seqs := make([]Seq, nseq)
			for i := range seqs {
				seqs[i] = Seq{Tokens: []int32{int32(i + 1)}, Start: ctx - 1, Blocks: blockRange(i*per, per), Logits: make([]float32, m.cfg.VocabSize)}
			}
			for range 3 {
				if err := m.Forward(b.Context(), kv, blockSize, seqs); err != nil {
					b.Fatal(err)
				}
			}
			if f := os.Getenv("KVBRIDGE_BENCH_CPUPROFILE"); f != "" {
				out, err := os.Create(fmt.Sprintf("%s-b%d", f, nseq))
				if err != nil {
					b.Fatal(err)
				}
				defer out.Close()
				if err := pprof.StartCPUProfile(out); err != nil {
					b.Fatal(err)
				}
				defer pprof.StopCPUProfile()
			}
			var cpu float64
			var wall time.Duration
			for b.Loop() {
				c0, t0 := processCPU(b), time.Now()
				if err := m.Forward(b.Context(), kv, blockSize, seqs); err != nil {
					b.Fatal(err)
				}
				wall += time.Since(t0)
				cpu += processCPU(b) - c0
			}
			b.ReportMetric(float64(wall.Microseconds())/1000/float64(b.N), "wall-ms/step")
			b.ReportMetric(cpu*1000/float64(b.N), "cpu-ms/step")
		})
	}
}
