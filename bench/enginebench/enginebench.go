// Package enginebench measures the model's forward pass — prefill throughput and achieved
// GFLOP/s, decode tokens/s — against ceilings measured in the same run: the machine's FP32 FMA
// peak and its memory bandwidth. It backs `kvbridge bench engine`.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package enginebench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"text/tabwriter"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/stack"
)

// Options configure a run. Zero values take the defaults noted on each field.
type Options struct {
	// Model is the model to load (default kvbridge/small).
	Model string
	// PromptLen is the number of prompt tokens prefilled (default 2000).
	PromptLen int
	// DecodeTokens is the number of tokens decoded one at a time after the prompt (0: 64;
	// negative: none).
	DecodeTokens int
	// Chunk is the prefill chunk size in tokens; 0 prefills the whole prompt in one step.
	Chunk int
	// BlockSize is the KV block size in tokens (default kvcache.DefaultBlockSize).
	BlockSize int
	// PeakDuration is how long the FMA peak is measured (default 1s).
	PeakDuration time.Duration
	// Repeat is how many times the prefill and decode are run; the fastest run of each is
	// reported (default 3), as the machine may be shared.
	Repeat int
	// Seed chooses the random prompt (default 1).
	Seed uint64
	// Progress, if non-nil, receives one line per phase.
	Progress io.Writer
}

func (o *Options) defaults() {
	if o.Model == "" {
		o.Model = model.Small
	}
	if o.PromptLen <= 0 {
		o.PromptLen = 2000
	}
	if o.DecodeTokens < 0 {
		o.DecodeTokens = 0
	} else if o.DecodeTokens == 0 {
		o.DecodeTokens = 64
	}
	if o.BlockSize <= 0 {
		o.BlockSize = kvcache.DefaultBlockSize
	}
	if o.PeakDuration <= 0 {
		o.PeakDuration = time.Second
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
	Model          string  `json:"model"`
	Kernel         string  `json:"kernel"`
	GOMAXPROCS     int     `json:"gomaxprocs"`
	PromptLen      int     `json:"prompt_len"`
	PrefillChunk   int     `json:"prefill_chunk"`
	DecodeTokens   int     `json:"decode_tokens"`
	Repeat         int     `json:"repeat"`
	WeightBytes    int64   `json:"weight_bytes"`
	KVBytesPerTok  int64   `json:"kv_bytes_per_token"`
	PrefillSeconds float64 `json:"prefill_seconds"`
	// PrefillFLOPs counts 2 × the multiply-adds of every projection and of attention (scores and
	// weighted values), lm_head for the last token only.
	PrefillFLOPs      float64 `json:"prefill_flops"`
	PrefillTokensPerS float64 `json:"prefill_tokens_per_s"`
	PrefillGFLOPS     float64 `json:"prefill_gflops"`
	// PeakGFLOPS is the measured FP32 FMA peak of all cores (kernel.PeakGFLOPS), the higher of
	// a measurement before the prefill and one after the decode.
	PeakGFLOPS       float64 `json:"peak_gflops"`
	PrefillPeakRatio float64 `json:"prefill_peak_ratio"`
	DecodeSeconds    float64 `json:"decode_seconds"`
	DecodeTokensPerS float64 `json:"decode_tokens_per_s"`
	DecodeGFLOPS     float64 `json:"decode_gflops"`
	// ReadGBps is the all-core memory read bandwidth (kernel.ReadGBps); MemcpyGBps one
	// goroutine's copy bandwidth (kernel.MemcpyGBps); each the higher of two measurements.
	ReadGBps   float64 `json:"read_gbps"`
	MemcpyGBps float64 `json:"memcpy_gbps"`
	// DecodeBoundTokensPerS = ReadGBps ÷ WeightBytes: every weight byte is read once per token.
	DecodeBoundTokensPerS float64 `json:"decode_bound_tokens_per_s"`
	DecodeBoundRatio      float64 `json:"decode_bound_ratio"`
	// DecodeBoundWithKVTokensPerS also counts reading the KV of the context at each decode step.
	DecodeBoundWithKVTokensPerS float64 `json:"decode_bound_with_kv_tokens_per_s"`
	// PromptKVBytes is the KV of the prompt; PromptKVMemcpySeconds the time to copy it once at
	// MemcpyGBps (a same-host transfer's ceiling); PrefillOverKVCopy how many times longer
	// computing it took.
	PromptKVBytes         int64   `json:"prompt_kv_bytes"`
	PromptKVMemcpySeconds float64 `json:"prompt_kv_memcpy_seconds"`
	PrefillOverKVCopy     float64 `json:"prefill_over_kv_copy"`
}

// Run loads the model, measures the ceilings, prefills a random prompt into a kvcache.Pool and
// decodes greedily from it.
func Run(ctx context.Context, opts Options) (*Result, error) {
	opts.defaults()
	progress := stack.Printer(opts.Progress)
	m, err := stack.OpenModel(ctx, opts.Model, opts.Progress)
	if err != nil {
		return nil, err
	}
	defer m.Close()
	c := m.Config()
	if total := opts.PromptLen + opts.DecodeTokens; total > c.MaxPositionEmbeddings {
		return nil, fmt.Errorf("enginebench: prompt %d + decode %d tokens exceed the model's %d positions",
			opts.PromptLen, opts.DecodeTokens, c.MaxPositionEmbeddings)
	}

	geo := kvcache.Geometry{NumLayers: c.NumLayers, NumKVHeads: c.NumKVHeads, HeadDim: c.HeadDim, BlockSize: opts.BlockSize}
	nblocks := (opts.PromptLen + opts.DecodeTokens + opts.BlockSize - 1) / opts.BlockSize
	pool, err := kvcache.NewPool(kvcache.AlignedMemory(nblocks*geo.BlockBytes()), kvcache.PoolConfig{Geometry: geo, NumBlocks: nblocks})
	if err != nil {
		return nil, fmt.Errorf("enginebench: %w", err)
	}
	blocks, err := pool.Allocate(nblocks)
	if err != nil {
		return nil, fmt.Errorf("enginebench: %w", err)
	}
	defer pool.Free(blocks...)

	r := &Result{
		Model:         m.Name(),
		Kernel:        kernel.Implementation(),
		GOMAXPROCS:    runtime.GOMAXPROCS(0),
		PromptLen:     opts.PromptLen,
		PrefillChunk:  opts.Chunk,
		DecodeTokens:  opts.DecodeTokens,
		Repeat:        opts.Repeat,
		WeightBytes:   m.WeightBytes(),
		KVBytesPerTok: int64(c.NumLayers * 2 * c.NumKVHeads * c.HeadDim * 4),
	}
	if r.PrefillChunk <= 0 || r.PrefillChunk > opts.PromptLen {
		r.PrefillChunk = opts.PromptLen
	}

	progress("measuring ceilings (FMA peak for %v, memory bandwidth)", opts.PeakDuration/2)
	r.measureCeilings(opts.PeakDuration / 2)

	rng := rand.New(rand.NewPCG(opts.Seed, 0))
	vocab := m.Tokenizer().VocabSize()
	prompt := make([]int32, opts.PromptLen)
	for i := range prompt {
		prompt[i] = int32(rng.IntN(vocab))
	}
	logits := make([]float32, c.VocabSize)

	// Warm up: fault in the weights and the pool, start the workers. Overwritten by the prefill.
	warm := min(opts.PromptLen, 32)
	if err := m.Forward(ctx, pool, opts.BlockSize, []model.Seq{{Tokens: prompt[:warm], Blocks: blocks, Logits: logits}}); err != nil {
		return nil, err
	}

	for rep := range opts.Repeat {
		progress("run %d/%d: prefilling %d tokens (chunks of %d), decoding %d", rep+1, opts.Repeat, opts.PromptLen, r.PrefillChunk, opts.DecodeTokens)
		prefill, decode, err := runOnce(ctx, m, pool, opts, r.PrefillChunk, blocks, prompt, logits)
		if err != nil {
			return nil, err
		}
		if rep == 0 || prefill < r.PrefillSeconds {
			r.PrefillSeconds = prefill
		}
		if rep == 0 || decode < r.DecodeSeconds {
			r.DecodeSeconds = decode
		}
	}
	// Only the last chunk computes lm_head, as PrefillFLOPs assumes.
	r.PrefillFLOPs = m.PrefillFLOPs(opts.PromptLen)
	r.PrefillTokensPerS = float64(opts.PromptLen) / r.PrefillSeconds
	r.PrefillGFLOPS = r.PrefillFLOPs / r.PrefillSeconds / 1e9
	if opts.DecodeTokens > 0 {
		var flops float64
		for i := range opts.DecodeTokens {
			flops += m.FLOPsPerToken(opts.PromptLen + i + 1)
		}
		r.DecodeTokensPerS = float64(opts.DecodeTokens) / r.DecodeSeconds
		r.DecodeGFLOPS = flops / r.DecodeSeconds / 1e9
	}
	progress("measuring ceilings again")
	r.measureCeilings(opts.PeakDuration / 2)
	r.PrefillPeakRatio = r.PrefillGFLOPS / r.PeakGFLOPS
	r.DecodeBoundTokensPerS = r.ReadGBps * 1e9 / float64(r.WeightBytes)
	r.DecodeBoundRatio = r.DecodeTokensPerS / r.DecodeBoundTokensPerS
	meanCtx := float64(opts.PromptLen) + float64(opts.DecodeTokens)/2
	r.DecodeBoundWithKVTokensPerS = r.ReadGBps * 1e9 / (float64(r.WeightBytes) + meanCtx*float64(r.KVBytesPerTok))

	r.PromptKVBytes = int64(opts.PromptLen) * r.KVBytesPerTok
	r.PromptKVMemcpySeconds = float64(r.PromptKVBytes) / (r.MemcpyGBps * 1e9)
	r.PrefillOverKVCopy = r.PrefillSeconds / r.PromptKVMemcpySeconds
	return r, nil
}

// measureCeilings measures the FMA peak (for about d) and the memory bandwidths, keeping the
// highest figures seen in this run: the machine is shared, and a ceiling measured while other
// work runs would flatter the ratios.
func (r *Result) measureCeilings(d time.Duration) {
	r.PeakGFLOPS = max(r.PeakGFLOPS, kernel.PeakGFLOPS(d))
	r.ReadGBps = max(r.ReadGBps, kernel.ReadGBps(256<<20))
	r.MemcpyGBps = max(r.MemcpyGBps, kernel.MemcpyGBps(64<<20))
}

// runOnce prefills prompt (in chunks) and decodes greedily from it, returning both durations.
func runOnce(ctx context.Context, m *model.Model, pool *kvcache.Pool, opts Options, chunk int, blocks, prompt []int32, logits []float32) (prefill, decode float64, err error) {
	t0 := time.Now()
	for start := 0; start < opts.PromptLen; start += chunk {
		end := min(opts.PromptLen, start+chunk)
		s := model.Seq{Tokens: prompt[start:end], Start: start, Blocks: blocks}
		if end == opts.PromptLen {
			s.Logits = logits
		}
		if err := m.Forward(ctx, pool, opts.BlockSize, []model.Seq{s}); err != nil {
			return 0, 0, err
		}
	}
	prefill = time.Since(t0).Seconds()
	t0 = time.Now()
	for i := range opts.DecodeTokens {
		next := model.Argmax(logits)
		s := model.Seq{Tokens: []int32{next}, Start: opts.PromptLen + i, Blocks: blocks, Logits: logits}
		if err := m.Forward(ctx, pool, opts.BlockSize, []model.Seq{s}); err != nil {
			return 0, 0, err
		}
	}
	return prefill, time.Since(t0).Seconds(), nil
}

// WriteTable prints the result as a table with ratios to the ceilings.
func (r *Result) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(w, "kvbridge bench engine: %s, kernel %s, GOMAXPROCS %d, weights %.1f MB, KV %.1f KiB/token\n",
		r.Model, r.Kernel, r.GOMAXPROCS, float64(r.WeightBytes)/1e6, float64(r.KVBytesPerTok)/1024)
	fmt.Fprintf(tw, "figure (best of %d runs)\tmeasured\tceiling\tratio\t\n", r.Repeat)
	fmt.Fprintf(tw, "prefill %d tokens (chunk %d)\t%.0f tok/s (%.2f s)\t\t\t\n", r.PromptLen, r.PrefillChunk, r.PrefillTokensPerS, r.PrefillSeconds)
	fmt.Fprintf(tw, "prefill compute\t%.1f GFLOP/s\t%.1f GFLOP/s FP32 peak\t%.2f\t\n", r.PrefillGFLOPS, r.PeakGFLOPS, r.PrefillPeakRatio)
	if r.DecodeTokens > 0 {
		fmt.Fprintf(tw, "decode %d tokens (context %d+)\t%.1f tok/s\t%.1f tok/s weights÷bandwidth\t%.2f\t\n",
			r.DecodeTokens, r.PromptLen, r.DecodeTokensPerS, r.DecodeBoundTokensPerS, r.DecodeBoundRatio)
		fmt.Fprintf(tw, "decode incl. KV reads\t%.1f tok/s\t%.1f tok/s (weights+KV)÷bandwidth\t%.2f\t\n",
			r.DecodeTokensPerS, r.DecodeBoundWithKVTokensPerS, r.DecodeTokensPerS/r.DecodeBoundWithKVTokensPerS)
		fmt.Fprintf(tw, "decode compute\t%.1f GFLOP/s\t%.1f GFLOP/s FP32 peak\t%.2f\t\n", r.DecodeGFLOPS, r.PeakGFLOPS, r.DecodeGFLOPS/r.PeakGFLOPS)
	}
	fmt.Fprintf(tw, "prompt KV %.1f MB: compute vs copy\t%.2f s\t%.4f s memcpy\t%.0f×\t\n",
		float64(r.PromptKVBytes)/1e6, r.PrefillSeconds, r.PromptKVMemcpySeconds, r.PrefillOverKVCopy)
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "memory: read %.1f GB/s (all cores), memcpy %.1f GB/s (one goroutine); decode bound = read bandwidth ÷ weight bytes\n"+
		"FP32 peak: measured (best of before/after), %d goroutines each running independent %s FMAs; FLOPs = FMA instructions × lanes × 2\n"+
		"FLOPs counted: 2 × multiply-adds of every projection, attention scores and weighted values, lm_head once per step\n",
		r.ReadGBps, r.MemcpyGBps, r.GOMAXPROCS, vectorWord(r.Kernel))
	return err
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
