// Package enginebench measures the model's forward pass — prefill throughput and achieved
// GFLOP/s, decode tokens/s at several batch sizes — in float32 and bfloat16, against ceilings
// measured in the same run: the machine's float32 FMA, VDPBF16PS and VPDPBUSD peaks and its
// memory read bandwidth. It backs `kvbridge bench engine`.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package enginebench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/kvbridge/kvbridge/internal/procmem"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/stack"
)

// Options configure a run. Zero values take the defaults noted on each field.
type Options struct {
	// Model is the model to load (default kvbridge/small).
	Model string
	// DTypes are the --dtype values measured, one after the other (default float32 and
	// bfloat16).
	DTypes []string
	// KVCacheDTypes are the --kv-cache-dtype values each dtype is measured with (default auto:
	// keys and values in the dtype measured).
	KVCacheDTypes []string
	// Quantizations are the --quantization values each dtype and KV cache dtype is measured
	// with (default none; "int8": int8 weights, whose bound counts a byte a weight plus the
	// scales).
	Quantizations []string
	// TensorParallelSizes are the --tensor-parallel-size values each dtype, KV cache dtype and
	// quantization is measured at (default 1): the forward pass on that many ranks, each with
	// GOMAXPROCS ÷ size kernel workers and its KV heads in a memory of its own.
	TensorParallelSizes []int
	// PromptLen is the number of prompt tokens prefilled (default 1024).
	PromptLen int
	// Chunk is the prefill chunk size in tokens; 0 prefills the whole prompt in one step.
	Chunk int
	// DecodeTokens is the number of decode steps timed after the prompt, one token each
	// (0: 32; negative: none).
	DecodeTokens int
	// Batches are the batch sizes of the batched decode (default 1, 8, 32): that many
	// sequences with a context of each of DecodeContexts tokens decode DecodeSteps steps
	// together, one Forward call (one pass over the weights) per step.
	Batches []int
	// DecodeContexts are the contexts of the batched sequences before decoding (default 128,
	// so that the weights, more than the KV cache, are what a step reads).
	DecodeContexts []int
	// DecodeSteps is the number of timed steps of each batch size (default 16).
	DecodeSteps int
	// BlockSize is the KV block size in tokens (default kvcache.DefaultBlockSize).
	BlockSize int
	// PeakDuration is how long each compute peak is measured (default 1s).
	PeakDuration time.Duration
	// ProbeBytes is the buffer the read-bandwidth probe reads (default 256 MiB, eight times the
	// 32 MiB last-level cache of docs/performance.md's machine: keep it far above the
	// last-level cache), ProbeWindow how long the probe before a repetition's first step reads
	// it (default 10ms; at least a pass in each of its patterns). The probe runs before the
	// first and after every timed decode step (kernel.ReadProbe, Rep).
	ProbeBytes  int
	ProbeWindow time.Duration
	// Repeat is how many times each measurement runs; the fastest is reported (default 3), as
	// the machine may be shared.
	Repeat int
	// Seed chooses the random prompts (default 1).
	Seed uint64
	// Progress, if non-nil, receives one line per phase.
	Progress io.Writer
}

func (o *Options) defaults() {
	if o.Model == "" {
		o.Model = model.Small
	}
	if len(o.DTypes) == 0 {
		o.DTypes = []string{"float32", "bfloat16"}
	}
	if len(o.KVCacheDTypes) == 0 {
		o.KVCacheDTypes = []string{"auto"}
	}
	if len(o.Quantizations) == 0 {
		o.Quantizations = []string{""}
	}
	if len(o.TensorParallelSizes) == 0 {
		o.TensorParallelSizes = []int{1}
	}
	if o.PromptLen <= 0 {
		o.PromptLen = 1024
	}
	if o.DecodeTokens < 0 {
		o.DecodeTokens = 0
	} else if o.DecodeTokens == 0 {
		o.DecodeTokens = 32
	}
	if len(o.Batches) == 0 {
		o.Batches = []int{1, 8, 32}
	}
	if len(o.DecodeContexts) == 0 {
		o.DecodeContexts = []int{128}
	}
	if o.DecodeSteps <= 0 {
		o.DecodeSteps = 16
	}
	if o.BlockSize <= 0 {
		o.BlockSize = kvcache.DefaultBlockSize
	}
	if o.PeakDuration <= 0 {
		o.PeakDuration = time.Second
	}
	if o.ProbeBytes <= 0 {
		o.ProbeBytes = 256 << 20
	}
	if o.ProbeWindow <= 0 {
		o.ProbeWindow = 10 * time.Millisecond
	}
	if o.Repeat <= 0 {
		o.Repeat = 3
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
}

// Result is one run's figures. JSON names are the `--json` file's keys.
type Result struct {
	Model      string `json:"model"`
	Kernel     string `json:"kernel"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	// BF16Products is how bfloat16 products run: "VDPBF16PS" or "portable Go".
	BF16Products string `json:"bf16_products"`
	// Int8Products is how int8 products run (--quantization int8): "VPDPBUSD" or "portable Go".
	Int8Products string `json:"int8_products"`
	PromptLen    int    `json:"prompt_len"`
	PrefillChunk int    `json:"prefill_chunk"`
	DecodeTokens int    `json:"decode_tokens"`
	DecodeSteps  int    `json:"decode_steps"`
	Repeat       int    `json:"repeat"`
	// ProbeBytes is the read-bandwidth probe's buffer (Options.ProbeBytes).
	ProbeBytes int `json:"probe_bytes"`
	// CheckpointBytes is the size of the model's safetensors files (0 for a built-in model).
	CheckpointBytes int64 `json:"checkpoint_bytes"`
	// PeakGFLOPS and PeakBF16GFLOPS are the measured float32 FMA and VDPBF16PS peaks of all
	// cores (kernel.PeakGFLOPS, kernel.PeakBF16GFLOPS; 0 without the instruction), the higher of
	// a measurement before and one after the model runs.
	PeakGFLOPS     float64 `json:"peak_gflops"`
	PeakBF16GFLOPS float64 `json:"peak_bf16_gflops"`
	// PeakInt8GOPS is the measured VPDPBUSD peak of all cores (kernel.PeakInt8GOPS; 0 without
	// the instruction), in GOP/s counted as the FLOP peaks are (2 a multiply-add), the higher
	// of a measurement before and one after the model runs: int8 weights' products are held to
	// it (--quantization int8).
	PeakInt8GOPS float64 `json:"peak_int8_gops"`
	// ReadGBps is the all-core memory read bandwidth (kernel.ReadProbe), the highest of the
	// probes before and after the model runs; MemcpyGBps one goroutine's copy bandwidth
	// (kernel.MemcpyGBps), the higher of two measurements. Each decode repetition is also
	// divided by the bandwidth probed right beside it (Rep).
	ReadGBps   float64 `json:"read_gbps"`
	MemcpyGBps float64 `json:"memcpy_gbps"`
	// Runs are the measurements of each dtype.
	Runs []DTypeResult `json:"runs"`
}

// DTypeResult is one dtype's figures (with one KV cache dtype).
type DTypeResult struct {
	DType        string `json:"dtype"`
	KVCacheDType string `json:"kv_cache_dtype"`
	// Quantization is the weights' quantization ("int8"; empty: none). WeightBytes then counts
	// one byte a weight plus the float32 scales.
	Quantization string `json:"quantization,omitempty"`
	// TensorParallelSize is the ranks the forward pass ran on.
	TensorParallelSize int   `json:"tensor_parallel_size"`
	WeightBytes        int64 `json:"weight_bytes"`
	KVBytesPerTok      int64 `json:"kv_bytes_per_token"`
	// ResidentAfterLoad is the process's resident memory right after loading the model (before
	// any KV pool); against CheckpointBytes it is the memory target's ratio (≤ 1.15).
	ResidentAfterLoad int64 `json:"resident_after_load"`
	// PrefillFLOPs counts 2 × the multiply-adds of every projection and of attention (scores and
	// weighted values), lm_head for the last token only. PeakRatio is against the peak of the
	// products (float32 FMA, VDPBF16PS, or VPDPBUSD for int8 weights).
	PrefillSeconds    float64 `json:"prefill_seconds"`
	PrefillFLOPs      float64 `json:"prefill_flops"`
	PrefillTokensPerS float64 `json:"prefill_tokens_per_s"`
	PrefillGFLOPS     float64 `json:"prefill_gflops"`
	PrefillPeakRatio  float64 `json:"prefill_peak_ratio"`
	// DecodeTokensPerS is one sequence decoding DecodeTokens tokens right after the prompt
	// (context PromptLen and on); DecodeBoundWithKVTokensPerS its bound when every step reads
	// the weights and the context's KV once.
	DecodeTokensPerS            float64 `json:"decode_tokens_per_s"`
	DecodeBoundWithKVTokensPerS float64 `json:"decode_bound_with_kv_tokens_per_s"`
	// DecodeBoundRatio is DecodeTokensPerS ÷ DecodeBoundWithKVTokensPerS, the bound at the run's
	// best bandwidth (ReadGBps).
	DecodeBoundRatio float64 `json:"decode_bound_ratio"`
	// DecodeReps are that decode's repetitions, each with the bandwidth probed right beside it;
	// DecodeProbedRatio is the median of their ratios: batch-1 decode's figure of merit.
	DecodeReps        []Rep   `json:"decode_reps"`
	DecodeProbedRatio float64 `json:"decode_probed_ratio"`
	// DecodeCPUCores is the CPU time the process used per second of that decode (its fastest
	// run): GOMAXPROCS on a quiet machine, less when other work took the cores (0: not read).
	DecodeCPUCores float64 `json:"decode_cpu_cores"`
	// Batched is the batched decode at each batch size.
	Batched []BatchResult `json:"batched"`
}

// BatchResult is decoding a batch of sequences.
type BatchResult struct {
	Batch   int `json:"batch"`
	Context int `json:"context"`
	// TokensPerS is tokens generated per second by the whole batch.
	TokensPerS float64 `json:"tokens_per_s"`
	// BoundTokensPerS = Batch × ReadGBps ÷ WeightBytes: one pass over the weights per step
	// serves the whole batch.
	BoundTokensPerS float64 `json:"bound_tokens_per_s"`
	BoundRatio      float64 `json:"bound_ratio"`
	// BoundWithKVTokensPerS also counts reading every sequence's context KV at each step.
	BoundWithKVTokensPerS float64 `json:"bound_with_kv_tokens_per_s"`
	// StepBoundTokensPerS counts weights, KV reads and compute: a step is at least its matrix
	// products, max(weight bytes ÷ bandwidth, their FLOPs ÷ the dtype's peak), plus its
	// attention, max(KV bytes ÷ bandwidth, its FLOPs ÷ the float32 peak) — the two alternate,
	// each layer's attention needing its products' queries and its next products attention's
	// output. StepBoundRatio is TokensPerS ÷ it.
	StepBoundTokensPerS float64 `json:"step_bound_tokens_per_s"`
	StepBoundRatio      float64 `json:"step_bound_ratio"`
	// RooflineTokensPerS is the looser bound of a step whose memory traffic and compute overlap
	// completely: max((weights + KV) ÷ bandwidth, all FLOPs ÷ peak).
	RooflineTokensPerS float64 `json:"roofline_tokens_per_s"`
	// GFLOPS is the products' FLOPs per second; PeakRatio against the dtype's peak.
	GFLOPS    float64 `json:"gflops"`
	PeakRatio float64 `json:"peak_ratio"`
	// OverBatch1 is TokensPerS ÷ batch 1's at the same context; StepBoundOverBatch1 is
	// StepBoundTokensPerS ÷ batch 1's measured tokens/s: the most OverBatch1 can be.
	OverBatch1          float64 `json:"over_batch1"`
	StepBoundOverBatch1 float64 `json:"step_bound_over_batch1"`
	// Reps are the repetitions, each with the bandwidth probed right beside it, and ProbedRatio
	// the median of their ratios to the bound the summary quotes: at batch 1 the weights+KV
	// bound, above it the step bound (with the run's compute peaks).
	Reps        []Rep   `json:"reps"`
	ProbedRatio float64 `json:"probed_ratio"`
	// CPUCores is the CPU time the process used per second of the fastest repetition's steps
	// (Rep.CPUCores; 0: not read), as DecodeCPUCores is for the decode after the prompt: below
	// GOMAXPROCS, other work shared the cores while this figure ran.
	CPUCores float64 `json:"cpu_cores"`
	// productFLOPs and attnFLOPs are one step's FLOPs (averaged over the steps), kvBytes its
	// KV reads.
	productFLOPs, attnFLOPs, kvBytes float64
}

// Rep is one timed repetition of a decode figure, its steps timed one by one and the read
// bandwidth probed between them (kernel.ReadProbe, on GOMAXPROCS threads, as many as the
// decode's products run on): before the first step for Options.ProbeWindow, after each step
// for as long as that step took. The probes thus sample the machine for about as long as the
// steps, interleaved with them, and the repetition has the ceiling of its own moments.
type Rep struct {
	// TokensPerS is the tokens of all steps ÷ the steps' time (the probes' time left out).
	TokensPerS float64 `json:"tokens_per_s"`
	// ReadGBps is the probes' rates averaged over their time; ReadGBpsMin and ReadGBpsMax are
	// the lowest and highest probe.
	ReadGBps    float64 `json:"read_gbps"`
	ReadGBpsMin float64 `json:"read_gbps_min"`
	ReadGBpsMax float64 `json:"read_gbps_max"`
	// Ratio is TokensPerS ÷ the figure's bound at ReadGBps.
	Ratio float64 `json:"ratio"`
	// CPUCores is the CPU time the process used per second of the steps (the probes' time left
	// out): GOMAXPROCS when the steps had the cores to themselves, less when other work took
	// them (0: not read). TokensPerS ÷ CPUCores is the tokens a CPU second, which the machine's
	// load moves far less than TokensPerS.
	CPUCores float64 `json:"cpu_cores,omitempty"`
}

// probedRatios sets each repetition's Ratio, bound(its bandwidth in bytes a second) being the
// figure's bound in tokens/s, and returns their median.
func probedRatios(reps []Rep, bound func(bw float64) float64) float64 {
	ratios := make([]float64, len(reps))
	for i := range reps {
		reps[i].Ratio = reps[i].TokensPerS / bound(reps[i].ReadGBps*1e9)
		ratios[i] = reps[i].Ratio
	}
	return median(ratios)
}

// median returns the median of x (0 for none), sorting x.
func median(x []float64) float64 {
	if len(x) == 0 {
		return 0
	}
	slices.Sort(x)
	if n := len(x); n%2 == 0 {
		return (x[n/2-1] + x[n/2]) / 2
	}
	return x[len(x)/2]
}

// probedSteps runs steps decode steps (step(i) runs the i-th, generating tokens tokens)
// interleaved with probes of the read bandwidth (see Rep), timing each step alone, and returns
// the repetition, with the CPU time the process used per second of the steps (Rep.CPUCores).
func probedSteps(probe *kernel.ReadProbe, window time.Duration, steps, tokens int, step func(i int) error) (Rep, error) {
	r := Rep{ReadGBpsMin: math.Inf(1)}
	var probeSec float64
	sample := func(d time.Duration) {
		t0 := time.Now()
		gbps := probe.GBps(d)
		sec := time.Since(t0).Seconds()
		r.ReadGBps += gbps * sec
		probeSec += sec
		r.ReadGBpsMin, r.ReadGBpsMax = min(r.ReadGBpsMin, gbps), max(r.ReadGBpsMax, gbps)
	}
	sample(window)
	var sec, cpu float64
	cpuOK := true
	for i := range steps {
		cpu0, ok0 := cpuTime()
		t0 := time.Now()
		if err := step(i); err != nil {
			return Rep{}, err
		}
		d := time.Since(t0)
		cpu1, ok1 := cpuTime()
		cpuOK = cpuOK && ok0 && ok1
		sec, cpu = sec+d.Seconds(), cpu+(cpu1-cpu0).Seconds()
		sample(d)
	}
	r.TokensPerS, r.ReadGBps = float64(steps*tokens)/sec, r.ReadGBps/probeSec
	if cpuOK {
		r.CPUCores = cpu / sec
	}
	return r, nil
}

// Run loads the model in each dtype, measures the ceilings, prefills a random prompt into a
// kvcache.Pool and decodes from it, then decodes batches of sequences.
func Run(ctx context.Context, opts Options) (*Result, error) {
	opts.defaults()
	progress := stack.Printer(opts.Progress)
	r := &Result{
		Kernel: kernel.Implementation(), GOMAXPROCS: runtime.GOMAXPROCS(0), BF16Products: kernel.BF16Products(),
		Int8Products: kernel.Int8Products(),
		PromptLen:    opts.PromptLen, PrefillChunk: opts.Chunk, DecodeTokens: opts.DecodeTokens, DecodeSteps: opts.DecodeSteps, Repeat: opts.Repeat,
		ProbeBytes: opts.ProbeBytes,
	}
	if r.PrefillChunk <= 0 || r.PrefillChunk > opts.PromptLen {
		r.PrefillChunk = opts.PromptLen
	}
	progress("faulting in the bandwidth probe's %d MiB", opts.ProbeBytes>>20)
	probe := kernel.NewReadProbe(opts.ProbeBytes, 0)
	progress("measuring ceilings (float32, bfloat16 and int8 peaks for %v each, memory bandwidth)", opts.PeakDuration/2)
	r.measureCeilings(opts.PeakDuration/2, probe)
	for _, dt := range opts.DTypes {
		for _, kvdt := range opts.KVCacheDTypes {
			for _, q := range opts.Quantizations {
				for _, tp := range opts.TensorParallelSizes {
					d, err := runDType(ctx, opts, r, probe, model.OpenOptions{DType: dt, KVCacheDType: kvdt, Quantization: q, TensorParallelSize: tp}, progress)
					if err != nil {
						return nil, err
					}
					r.Runs = append(r.Runs, *d)
				}
			}
		}
	}
	progress("measuring ceilings again")
	r.measureCeilings(opts.PeakDuration/2, probe)
	for i := range r.Runs {
		r.Runs[i].ratios(r)
	}
	return r, nil
}

// runDType measures one dtype with one KV cache dtype and one quantization (those of open).
func runDType(ctx context.Context, opts Options, r *Result, probe *kernel.ReadProbe, open model.OpenOptions, progress func(string, ...any)) (*DTypeResult, error) {
	progress("loading %s (dtype %s, KV cache %s, quantization %q, tensor parallel size %d)", opts.Model, open.DType, open.KVCacheDType, open.Quantization, max(1, open.TensorParallelSize))
	// Return the previous dtype's model and pool to the OS, so the resident figure is this
	// one's: the first collection empties the sync.Pools still holding the closed model's
	// scratch, the second frees what they held.
	debug.FreeOSMemory()
	debug.FreeOSMemory()
	m, err := model.Open(ctx, opts.Model, open)
	if err != nil {
		return nil, err
	}
	defer m.Close()
	resident, err := procmem.Resident()
	if err != nil {
		progress("no resident memory figure: %v", err)
	}
	r.Model, r.CheckpointBytes = m.Name(), m.CheckpointBytes()
	c := m.Config()
	maxContext := slices.Max(opts.DecodeContexts)
	if total := max(opts.PromptLen+opts.DecodeTokens, maxContext+opts.DecodeSteps); total > c.MaxPositionEmbeddings {
		return nil, fmt.Errorf("enginebench: %d positions (prompt %d + decode %d, or decode context %d + steps %d) exceed the model's %d",
			total, opts.PromptLen, opts.DecodeTokens, maxContext, opts.DecodeSteps, c.MaxPositionEmbeddings)
	}
	d := &DTypeResult{
		DType: m.DType(), KVCacheDType: m.KVCacheDType(), WeightBytes: m.WeightBytes(), ResidentAfterLoad: resident,
		KVBytesPerTok: m.KVBytesPerToken(), Quantization: m.Quantization(), TensorParallelSize: m.TensorParallelSize(),
	}

	// One pool for the prompt and for the batches (not at once): the largest batch's sequences
	// hold the longest context, and every batch decodes the first of them.
	kvType, err := kvcache.ParseDType(m.KVCacheDType())
	if err != nil {
		return nil, fmt.Errorf("enginebench: %w", err)
	}
	_, heads := m.RankKVHeads(0)
	geo := kvcache.Geometry{NumLayers: c.NumLayers, NumKVHeads: heads, HeadDim: c.HeadDim, BlockSize: opts.BlockSize, DType: kvType}
	perSeq := (maxContext + opts.DecodeSteps + opts.BlockSize - 1) / opts.BlockSize
	nseq := slices.Max(opts.Batches)
	nblocks := max((opts.PromptLen+opts.DecodeTokens+opts.BlockSize-1)/opts.BlockSize, nseq*perSeq)
	mems := make([][]byte, m.TensorParallelSize()) // each rank's KV memory
	for i := range mems {
		mems[i] = kvcache.AlignedMemory(nblocks * geo.BlockBytes())
		faultIn(mems[i])
	}
	pool, err := kvcache.NewPool(mems[0], kvcache.PoolConfig{Geometry: geo, NumBlocks: nblocks, RankMemory: mems[1:]})
	if err != nil {
		return nil, fmt.Errorf("enginebench: %w", err)
	}
	kv := make([]model.KVBlocks, pool.TensorParallelSize())
	for i := range kv {
		kv[i] = pool.Shard(i)
	}
	blocks, err := pool.Allocate(nblocks)
	if err != nil {
		return nil, fmt.Errorf("enginebench: %w", err)
	}
	defer pool.Free(blocks...)

	rng := rand.New(rand.NewPCG(opts.Seed, 0))
	vocab := m.Tokenizer().VocabSize()
	random := func(n int) []int32 {
		t := make([]int32, n)
		for i := range t {
			t[i] = int32(rng.IntN(vocab))
		}
		return t
	}
	prompt := random(opts.PromptLen)
	logits := make([]float32, c.VocabSize)

	// Warm up: fault in the weights and the pool, start the workers. Overwritten by the prefill.
	warm := min(opts.PromptLen, 32)
	if err := m.ForwardRanks(ctx, kv, opts.BlockSize, []model.Seq{{Tokens: prompt[:warm], Blocks: blocks, Logits: logits}}); err != nil {
		return nil, err
	}
	for rep := range opts.Repeat {
		progress("%s run %d/%d: prefilling %d tokens (chunks of %d), decoding %d", d.name(), rep+1, opts.Repeat, opts.PromptLen, r.PrefillChunk, opts.DecodeTokens)
		prefill, err := prefillOnce(ctx, m, kv, opts, r.PrefillChunk, blocks, prompt, logits)
		if err != nil {
			return nil, err
		}
		if rep == 0 || prefill < d.PrefillSeconds {
			d.PrefillSeconds = prefill
		}
		if opts.DecodeTokens <= 0 {
			continue
		}
		decode, err := decodeOnce(ctx, m, kv, opts, probe, blocks, logits)
		if err != nil {
			return nil, err
		}
		d.DecodeReps = append(d.DecodeReps, decode)
		if decode.TokensPerS > d.DecodeTokensPerS {
			d.DecodeTokensPerS, d.DecodeCPUCores = decode.TokensPerS, decode.CPUCores
		}
	}
	// Only the last chunk computes lm_head, as PrefillFLOPs assumes.
	d.PrefillFLOPs = m.PrefillFLOPs(opts.PromptLen)
	d.PrefillTokensPerS = float64(opts.PromptLen) / d.PrefillSeconds
	d.PrefillGFLOPS = d.PrefillFLOPs / d.PrefillSeconds / 1e9

	// The batched sequences' longest context, in one batched prefill (a step's cost does not
	// depend on what the KV holds, so a shorter context decodes over the first positions).
	seqs := make([]model.Seq, nseq)
	for i := range seqs {
		seqs[i] = model.Seq{Tokens: random(maxContext), Blocks: blocks[i*perSeq : (i+1)*perSeq], Logits: make([]float32, c.VocabSize)}
	}
	progress("%s: prefilling %d sequences of %d tokens", d.name(), nseq, maxContext)
	if err := m.ForwardRanks(ctx, kv, opts.BlockSize, seqs); err != nil {
		return nil, err
	}
	// The repetitions take turns across the batch sizes, so that every batch size sees the
	// machine in each state a shared machine passes through: their ratios compare like with like.
	for _, context := range opts.DecodeContexts {
		best := make([]Rep, len(opts.Batches))
		reps := make([][]Rep, len(opts.Batches))
		for rep := range opts.Repeat {
			for i, b := range opts.Batches {
				progress("%s run %d/%d: decoding %d steps at batch %d (context %d)", d.name(), rep+1, opts.Repeat, opts.DecodeSteps, b, context)
				r, err := decodeBatch(ctx, m, kv, opts, probe, seqs[:b], context)
				if err != nil {
					return nil, err
				}
				if r.TokensPerS > best[i].TokensPerS {
					best[i] = r
				}
				reps[i] = append(reps[i], r)
			}
		}
		for i, b := range opts.Batches {
			br := BatchResult{Batch: b, Context: context, TokensPerS: best[i].TokensPerS, Reps: reps[i], CPUCores: best[i].CPUCores}
			for s := range opts.DecodeSteps {
				n := context + s + 1 // positions attended to
				br.productFLOPs += float64(b) * (m.FLOPsPerToken(n) - m.AttentionFLOPsPerToken(n))
				br.attnFLOPs += float64(b) * m.AttentionFLOPsPerToken(n)
				br.kvBytes += float64(b) * float64(n) * float64(d.KVBytesPerTok)
			}
			steps := float64(opts.DecodeSteps)
			br.productFLOPs, br.attnFLOPs, br.kvBytes = br.productFLOPs/steps, br.attnFLOPs/steps, br.kvBytes/steps
			br.GFLOPS = (br.productFLOPs + br.attnFLOPs) * br.TokensPerS / float64(b) / 1e9
			d.Batched = append(d.Batched, br)
		}
	}
	return d, nil
}

// faultIn writes a zero to every page of mem (fresh memory, all zeros already), so that the
// kernel maps the pages now, untimed, rather than in the first timed step that writes KV there.
// On the 2-core VM of docs/performance.md faulting in fresh memory ran at about 0.1 GB/s (10–12 s
// a GiB, under load): a batched decode's first steps write a new block of every sequence, 32 ×
// 3.7 MB for Qwen3-0.6B in float32, about as long as a whole step of that batch, and the first
// repetition of every figure paid for the blocks it wrote first (with --repeat 1, the only one).
func faultIn(mem []byte) {
	page := os.Getpagesize()
	for i := 0; i < len(mem); i += page {
		mem[i] = 0
	}
}

// name names the run: its dtype, its KV cache dtype where that is not the dtype's own (what
// --kv-cache-dtype auto gives), and its quantization.
func (d *DTypeResult) name() string {
	n := d.DType
	if d.KVCacheDType != d.DType {
		n += ", KV " + d.KVCacheDType
	}
	if d.Quantization != "" {
		n += ", " + d.Quantization + " weights"
	}
	if d.TensorParallelSize > 1 {
		n += fmt.Sprintf(", TP %d", d.TensorParallelSize)
	}
	return n
}

// ratios fills the figures that depend on the ceilings.
func (d *DTypeResult) ratios(r *Result) {
	peak, _ := r.productPeak(d)
	bw, w := r.ReadGBps*1e9, float64(d.WeightBytes)
	d.PrefillPeakRatio = d.PrefillGFLOPS / peak
	meanCtx := float64(r.PromptLen) + float64(r.DecodeTokens)/2
	d.DecodeBoundWithKVTokensPerS = bw / (w + meanCtx*float64(d.KVBytesPerTok))
	d.DecodeBoundRatio = d.DecodeTokensPerS / d.DecodeBoundWithKVTokensPerS
	d.DecodeProbedRatio = probedRatios(d.DecodeReps, func(bw float64) float64 { return bw / (w + meanCtx*float64(d.KVBytesPerTok)) })
	one := map[int]float64{} // batch 1's tokens/s by context
	for _, b := range d.Batched {
		if b.Batch == 1 {
			one[b.Context] = b.TokensPerS
		}
	}
	for i := range d.Batched {
		b := &d.Batched[i]
		n := float64(b.Batch)
		b.BoundTokensPerS = n * bw / w
		b.BoundRatio = b.TokensPerS / b.BoundTokensPerS
		b.BoundWithKVTokensPerS = n * bw / (w + b.kvBytes)
		stepBound := func(bw float64) float64 {
			return n / (max(w/bw, b.productFLOPs/(peak*1e9)) + max(b.kvBytes/bw, b.attnFLOPs/(r.PeakGFLOPS*1e9)))
		}
		b.StepBoundTokensPerS = stepBound(bw)
		if b.Batch == 1 {
			b.ProbedRatio = probedRatios(b.Reps, func(bw float64) float64 { return n * bw / (w + b.kvBytes) })
		} else {
			b.ProbedRatio = probedRatios(b.Reps, stepBound)
		}
		b.StepBoundRatio = b.TokensPerS / b.StepBoundTokensPerS
		b.RooflineTokensPerS = n / max((w+b.kvBytes)/bw, b.productFLOPs/(peak*1e9)+b.attnFLOPs/(r.PeakGFLOPS*1e9))
		b.PeakRatio = b.GFLOPS / peak
		if o := one[b.Context]; o > 0 {
			b.OverBatch1 = b.TokensPerS / o
			b.StepBoundOverBatch1 = b.StepBoundTokensPerS / o
		}
	}
}

// productPeak returns the peak the products of d are held to, in GFLOP/s (GOP/s for int8), and
// its name in the table: VPDPBUSD's for int8 weights, VDPBF16PS's for bfloat16 (unquantized),
// the float32 FMA's otherwise or when the instruction is missing (its peak measured 0).
func (r *Result) productPeak(d *DTypeResult) (float64, string) {
	switch {
	case d.Quantization == "int8" && r.PeakInt8GOPS > 0:
		return r.PeakInt8GOPS, "int8 peak"
	case d.DType == "bfloat16" && d.Quantization == "" && r.PeakBF16GFLOPS > 0:
		return r.PeakBF16GFLOPS, "bf16 peak"
	}
	return r.PeakGFLOPS, "float32 peak"
}

// ceilingWindow is how long the read bandwidth of the run's ceilings (Result.ReadGBps) is probed.
const ceilingWindow = 100 * time.Millisecond

// measureCeilings measures the compute peaks (for about d each) and the memory bandwidths (the
// read bandwidth with probe for about ceilingWindow), keeping the highest figures seen in this run:
// the machine is shared, and a ceiling measured while other work runs would flatter the ratios.
func (r *Result) measureCeilings(d time.Duration, probe *kernel.ReadProbe) {
	r.PeakGFLOPS = max(r.PeakGFLOPS, kernel.PeakGFLOPS(d))
	r.PeakBF16GFLOPS = max(r.PeakBF16GFLOPS, kernel.PeakBF16GFLOPS(d))
	r.PeakInt8GOPS = max(r.PeakInt8GOPS, kernel.PeakInt8GOPS(d))
	r.ReadGBps = max(r.ReadGBps, probe.GBps(ceilingWindow))
	r.MemcpyGBps = max(r.MemcpyGBps, kernel.MemcpyGBps(64<<20))
}

// prefillOnce prefills prompt (in chunks, into kv: each rank's KV store), leaving the last
// token's logits in logits, and returns the seconds it took.
func prefillOnce(ctx context.Context, m *model.Model, kv []model.KVBlocks, opts Options, chunk int, blocks, prompt []int32, logits []float32) (float64, error) {
	t0 := time.Now()
	for start := 0; start < opts.PromptLen; start += chunk {
		end := min(opts.PromptLen, start+chunk)
		s := model.Seq{Tokens: prompt[start:end], Start: start, Blocks: blocks}
		if end == opts.PromptLen {
			s.Logits = logits
		}
		if err := m.ForwardRanks(ctx, kv, opts.BlockSize, []model.Seq{s}); err != nil {
			return 0, err
		}
	}
	return time.Since(t0).Seconds(), nil
}

// decodeOnce decodes DecodeTokens tokens greedily after the prompt prefillOnce left in kv and
// logits, a step at a time between probes of the read bandwidth (probedSteps), and returns the
// repetition.
func decodeOnce(ctx context.Context, m *model.Model, kv []model.KVBlocks, opts Options, probe *kernel.ReadProbe, blocks []int32, logits []float32) (Rep, error) {
	return probedSteps(probe, opts.ProbeWindow, opts.DecodeTokens, 1, func(i int) error {
		next := model.Argmax(logits)
		s := model.Seq{Tokens: []int32{next}, Start: opts.PromptLen + i, Blocks: blocks, Logits: logits}
		return m.ForwardRanks(ctx, kv, opts.BlockSize, []model.Seq{s})
	})
}

// decodeBatch decodes DecodeSteps greedy steps of every sequence of seqs together from
// position context on (their KV holds at least context positions; their Logits hold logits
// to sample the first tokens from), a step at a time between probes of the read bandwidth
// (probedSteps), and returns the repetition. The sequences are left as they were, so every
// repetition decodes the same steps.
func decodeBatch(ctx context.Context, m *model.Model, kv []model.KVBlocks, opts Options, probe *kernel.ReadProbe, seqs []model.Seq, context int) (Rep, error) {
	step := make([]model.Seq, len(seqs))
	toks := make([]int32, len(seqs))
	last := make([][]float32, len(seqs))
	for i, s := range seqs {
		last[i] = slices.Clone(s.Logits)
		step[i] = model.Seq{Blocks: s.Blocks, Logits: make([]float32, len(s.Logits))}
	}
	r, err := probedSteps(probe, opts.ProbeWindow, opts.DecodeSteps, len(seqs), func(k int) error {
		kernel.Parallel(len(step), func(i int) { // greedy sampling of every sequence, on every core
			toks[i] = model.Argmax(last[i])
			step[i].Tokens, step[i].Start = toks[i:i+1], context+k
		})
		if err := m.ForwardRanks(ctx, kv, opts.BlockSize, step); err != nil {
			return err
		}
		for i := range step {
			last[i], step[i].Logits = step[i].Logits, last[i]
		}
		return nil
	})
	return r, err
}

// WriteTable prints the result as tables with ratios to the ceilings.
func (r *Result) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "kvbridge bench engine: %s, kernel %s (bfloat16 products: %s, int8 products: %s), GOMAXPROCS %d\n", r.Model, r.Kernel, r.BF16Products, r.Int8Products, r.GOMAXPROCS)
	fmt.Fprintf(w, "ceilings (best of before/after): float32 FMA peak %.1f GFLOP/s, VDPBF16PS peak %.1f GFLOP/s, VPDPBUSD peak %.1f GOP/s, memory read %.1f GB/s (all cores), memcpy %.1f GB/s (one goroutine)\n",
		r.PeakGFLOPS, r.PeakBF16GFLOPS, r.PeakInt8GOPS, r.ReadGBps, r.MemcpyGBps)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "figure (best of %d runs)\tdtype\tmeasured\tceiling\tratio\t\n", r.Repeat)
	for _, d := range r.Runs {
		_, peakName := r.productPeak(&d)
		name := d.name()
		fmt.Fprintf(tw, "weights\t%s\t%.1f MB\t\t\t\n", name, float64(d.WeightBytes)/1e6)
		if r.CheckpointBytes > 0 && d.ResidentAfterLoad > 0 {
			fmt.Fprintf(tw, "resident memory after load\t%s\t%.1f MB\t%.1f MB safetensors\t%.2f\t\n",
				name, float64(d.ResidentAfterLoad)/1e6, float64(r.CheckpointBytes)/1e6, float64(d.ResidentAfterLoad)/float64(r.CheckpointBytes))
		}
		fmt.Fprintf(tw, "prefill %d tokens (chunk %d)\t%s\t%.0f tok/s (%.2f s)\t\t\t\n", r.PromptLen, r.PrefillChunk, name, d.PrefillTokensPerS, d.PrefillSeconds)
		fmt.Fprintf(tw, "prefill compute\t%s\t%.1f GFLOP/s\t%s\t%.2f\t\n", name, d.PrefillGFLOPS, peakName, d.PrefillPeakRatio)
		if r.DecodeTokens > 0 {
			fmt.Fprintf(tw, "decode after the prompt (context %d+)\t%s\t%.1f tok/s\t%.1f tok/s (weights+KV)÷bandwidth\t%.2f\t\n",
				r.PromptLen, name, d.DecodeTokensPerS, d.DecodeBoundWithKVTokensPerS, d.DecodeTokensPerS/d.DecodeBoundWithKVTokensPerS)
			writeProbed(tw, name, "(weights+KV)÷bandwidth", d.DecodeReps, d.DecodeProbedRatio)
		}
		for _, b := range d.Batched {
			fmt.Fprintf(tw, "decode batch %d (context %d)\t%s\t%.1f tok/s (%.1f× batch 1)\t%.1f tok/s weights÷bandwidth\t%.2f\t\n",
				b.Batch, b.Context, name, b.TokensPerS, b.OverBatch1, b.BoundTokensPerS, b.BoundRatio)
			fmt.Fprintf(tw, "  incl. KV reads\t%s\t\t%.1f tok/s (weights+KV)÷bandwidth\t%.2f\t\n", name, b.BoundWithKVTokensPerS, b.TokensPerS/b.BoundWithKVTokensPerS)
			fmt.Fprintf(tw, "  its compute\t%s\t%.1f GFLOP/s\t%s\t%.2f\t\n", name, b.GFLOPS, peakName, b.PeakRatio)
			fmt.Fprintf(tw, "  weights, KV and compute\t%s\t\t%.1f tok/s step bound (%.1f× batch 1)\t%.2f\t\n",
				name, b.StepBoundTokensPerS, b.StepBoundOverBatch1, b.StepBoundRatio)
			fmt.Fprintf(tw, "  all overlapped\t%s\t\t%.1f tok/s roofline\t%.2f\t\n", name, b.RooflineTokensPerS, b.TokensPerS/b.RooflineTokensPerS)
			if b.Batch == 1 {
				writeProbed(tw, name, "(weights+KV)÷bandwidth", b.Reps, b.ProbedRatio)
			} else {
				writeProbed(tw, name, "step bound", b.Reps, b.ProbedRatio)
			}
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	r.writeTargets(w)
	_, err := fmt.Fprintf(w, "probed beside each run: a run's tok/s (its steps' time) ÷ its bound at the read bandwidth probed between its steps, after each step for as long\n"+
		"  as the step took (the probes' rates averaged over their time); a probe: %d goroutines, each reading its share of a %d MiB buffer as one stream\n"+
		"  and as four side by side, the faster of the two; the ratio is the median of the runs' ratios\n"+
		"peaks: %d goroutines each running independent %s FMAs (FLOPs = instructions × lanes × 2), VDPBF16PS (× lanes × 4) or VPDPBUSD (× lanes × 8)\n"+
		"FLOPs counted: 2 × multiply-adds of every projection, attention scores and weighted values, lm_head once per step and sequence\n"+
		"decode bound = batch × read bandwidth ÷ weight bytes: a step reads the weights once for the whole batch (int8 weights: a byte each plus a float32 scale per 32)\n"+
		"int8 weights' products (2 operations a multiply-add) are compared with the VPDPBUSD peak, attention with the float32 FMA peak\n"+
		"step bound = batch ÷ (max(weight bytes ÷ bandwidth, product FLOPs ÷ dtype peak) + max(KV bytes ÷ bandwidth, attention FLOPs ÷ float32 peak)):\n"+
		"  each layer's attention waits for its products and its next products for attention; × batch 1 = the step bound ÷ batch 1's measured tok/s\n"+
		"roofline = batch ÷ max((weight + KV bytes) ÷ bandwidth, all FLOPs ÷ peak): memory and compute fully overlapped\n",
		r.GOMAXPROCS, r.ProbeBytes>>20, r.GOMAXPROCS, vectorWord(r.Kernel))
	return err
}

// writeProbed prints a decode figure's row against its bound at the bandwidth probed beside each
// step of each repetition: the range of the probes and the median ratio.
func writeProbed(tw io.Writer, name, bound string, reps []Rep, ratio float64) {
	if len(reps) == 0 {
		return
	}
	lo, hi := reps[0].ReadGBpsMin, reps[0].ReadGBpsMax
	for _, r := range reps[1:] {
		lo, hi = min(lo, r.ReadGBpsMin), max(hi, r.ReadGBpsMax)
	}
	fmt.Fprintf(tw, "  probed beside each run\t%s\t\t%s at %.1f–%.1f GB/s\t%.2f\t\n", name, bound, lo, hi, ratio)
}

// The targets (docs/performance.md) the summary under the table checks each figure against.
const (
	// batch1Target is batch-1 decode's least ratio to its (weights+KV)÷bandwidth bound.
	batch1Target = 0.9
	// batchedTarget is batched decode's (batch > 1) least ratio to its step bound.
	batchedTarget = 0.8
	// maxProbedRatio is the highest probed ratio a memory-bound figure (batch 1) is judged by:
	// above it, the probes read less than the decode itself moved between them, so they were
	// starved (something else had the memory or the cores at their moment), not the ceiling.
	maxProbedRatio = 1.05
)

// writeTargets prints, per run, batch-1 decode against its bound and batched decode against its
// step bound, each with its target and the CPU the process had during its fastest run (below
// GOMAXPROCS: other work shared the cores, and the figure understates the engine; figures of
// one run compare only at like CPU).
func (r *Result) writeTargets(w io.Writer) {
	fmt.Fprintf(w, "summary: batch-1 decode ÷ (weights+KV)÷bandwidth (target ≥ %.2f); batched decode ÷ step bound (target ≥ %.2f);\n"+
		"  each the median over the runs of a run ÷ its bound at the bandwidth probed beside it [in brackets: the best run ÷ the bound at the run's best probe]\n",
		batch1Target, batchedTarget)
	fmt.Fprintf(w, "  a batch-1 figure probed above %.2f is judged by its bracket: its probes read less than the decode itself moved\n", maxProbedRatio)
	for _, d := range r.Runs {
		line := fmt.Sprintf("  %-22s", d.name())
		if r.DecodeTokens > 0 {
			line += fmt.Sprintf(" batch 1 after the prompt %.2f [%.2f] (%s", d.DecodeProbedRatio, d.DecodeBoundRatio, verdict(d.DecodeProbedRatio, d.DecodeBoundRatio, batch1Target, true))
			if d.DecodeCPUCores > 0 {
				line += fmt.Sprintf(", CPU %.2f of %d cores", d.DecodeCPUCores, r.GOMAXPROCS)
			}
			line += ")"
		}
		for _, b := range d.Batched {
			old, target := b.StepBoundRatio, batchedTarget
			if b.Batch == 1 {
				old, target = b.TokensPerS/b.BoundWithKVTokensPerS, batch1Target
			}
			line += fmt.Sprintf("; batch %d ctx %d %.2f [%.2f] (%s", b.Batch, b.Context, b.ProbedRatio, old, verdict(b.ProbedRatio, old, target, b.Batch == 1))
			if b.CPUCores > 0 {
				line += fmt.Sprintf(", CPU %.2f", b.CPUCores)
			}
			line += ")"
		}
		fmt.Fprintln(w, line)
	}
}

// verdict says whether a figure meets its target: by its probed ratio, or, for a memory-bound
// figure (memory: batch 1, whose bound is the read bandwidth's alone) probed above
// maxProbedRatio, by its bracketed ratio (old), saying so. Batched figures keep their probed
// ratio.
func verdict(probed, old, target float64, memory bool) string {
	ratio, by := probed, ""
	if memory && probed > maxProbedRatio {
		ratio, by = old, ", by the bracket: probe starved"
	}
	if ratio >= target {
		return "ok" + by
	}
	return "below" + by
}

// vectorWord names the vector width a kernel implementation's FMAs use.
func vectorWord(impl string) string {
	switch impl {
	case "avx512":
		return "512-bit (16-lane)"
	case "avx2":
		return "256-bit (8-lane)"
	}
	return "scalar"
}

// WriteJSON writes the result to path as indented JSON.
func (r *Result) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("enginebench: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("enginebench: %w", err)
	}
	return nil
}
