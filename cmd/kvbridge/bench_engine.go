package main

import (
	"os"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/bench/enginebench"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
)

// newBenchEngineCmd returns `kvbridge bench engine`: prefill and decode throughput of the model's
// forward pass, in float32 and bfloat16, against the peaks and memory bandwidth measured in the
// same run.
func newBenchEngineCmd() *cobra.Command {
	var (
		opts       enginebench.Options
		jsonPath   string
		cpuProfile string
	)
	cmd := &cobra.Command{
		Use:   "engine",
		Short: "Measure prefill and decode speed of the model against this machine's ceilings",
		Long: `Prefills a random prompt into a paged KV pool and decodes greedily from it, then decodes
batches of sequences (one pass over the weights per step for the whole batch), for each --dtype
(and each --kv-cache-dtype and --quantization).
Prints prefill tokens/s and GFLOP/s against the measured float32 FMA, VDPBF16PS or (int8
weights) VPDPBUSD peak, and
decode tokens/s at each batch size and context against the bound set by batch × memory read
bandwidth ÷ weight bytes, the one that adds the context's KV reads, and the step bound that
counts weights, KV reads and compute (each layer's products, then its attention), with what
that bound allows over batch 1. Ceilings are measured in the same run, and each decode
repetition is divided by the read bandwidth probed between its own steps; quote ratios.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) (err error) {
			opts.Progress = cmd.ErrOrStderr()
			if opts.DecodeTokens == 0 {
				opts.DecodeTokens = -1 // the flag's 0 means none; Options' 0 means the default
			}
			for _, b := range opts.Batches {
				if b <= 0 {
					return usageError("--batch %d: batch sizes must be positive", b)
				}
			}
			for _, c := range opts.DecodeContexts {
				if c <= 0 {
					return usageError("--decode-context %d: contexts must be positive", c)
				}
			}
			for _, d := range opts.DTypes {
				if _, err := model.ParseDType(d); err != nil {
					return usageError("--dtype %q: want auto, bfloat16 or float32 (float16 is not supported on the CPU)", d)
				}
			}
			for i, q := range opts.Quantizations {
				if opts.Quantizations[i], err = model.ParseQuantization(q); err != nil {
					return usageError("--quantization %q: want none or int8", q)
				}
			}
			for _, n := range opts.TensorParallelSizes {
				if n < 1 {
					return usageError("--tensor-parallel-size %d: sizes must be at least 1", n)
				}
			}
			for _, d := range opts.KVCacheDTypes {
				if _, err := kvcache.ParseDType(d); err != nil {
					return usageError("--kv-cache-dtype %q: want "+kvCacheDTypes, d)
				}
			}
			if cpuProfile != "" {
				// Go runs one CPU profile at a time.
				if os.Getenv(cpuProfileEnv) != "" {
					return usageError("--cpuprofile and %s both ask for a CPU profile of the run: give one", cpuProfileEnv)
				}
				stop, err := startCPUProfile(cpuProfile)
				if err != nil {
					return usageError("--cpuprofile: %v", err)
				}
				defer stop()
			}
			r, err := enginebench.Run(cmd.Context(), opts)
			if err != nil {
				return err
			}
			return writeBenchReport(cmd, r, jsonPath)
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.Model, "model", model.Small, "model: kvbridge/tiny, kvbridge/small, a local HF directory or a cached repo id")
	f.StringSliceVar(&opts.DTypes, "dtype", []string{"float32", "bfloat16"}, "dtypes to measure, one after the other (auto, bfloat16, float32)")
	f.IntSliceVarP(&opts.TensorParallelSizes, "tensor-parallel-size", "t", []int{1}, "tensor-parallel sizes (-tp 1,2) each dtype is measured at: ranks of the forward pass, GOMAXPROCS ÷ size kernel workers each")
	f.IntVar(&opts.PromptLen, "prompt-len", 1024, "prompt tokens to prefill")
	f.IntVar(&opts.DecodeTokens, "decode-tokens", 32, "tokens to decode after the prompt (0: none)")
	f.IntVar(&opts.Chunk, "chunk", 0, "prefill chunk size in tokens (0: the whole prompt in one step)")
	f.IntSliceVar(&opts.Batches, "batch", []int{1, 8, 32}, "batch sizes of the batched decode")
	f.StringSliceVar(&opts.KVCacheDTypes, "kv-cache-dtype", []string{"auto"}, "KV cache dtypes each dtype is measured with (auto = the dtype's own, float32, bfloat16, fp8, fp8_e4m3, fp8_e5m2)")
	f.StringSliceVar(&opts.Quantizations, "quantization", []string{"none"}, "weight quantizations each dtype is measured with (none, int8: its bound counts int8 weights plus their scales)")
	f.IntSliceVar(&opts.DecodeContexts, "decode-context", []int{128}, "contexts of the sequences of the batched decode")
	f.IntVar(&opts.DecodeSteps, "decode-steps", 16, "timed steps at each batch size")
	f.IntVar(&opts.BlockSize, "block-size", kvcache.DefaultBlockSize, "KV block size in tokens")
	f.IntVar(&opts.Repeat, "repeat", 3, "runs of each measurement; the fastest is reported")
	f.DurationVar(&opts.PeakDuration, "peak-duration", 0, "how long to measure each compute peak (default 1s)")
	f.StringVar(&jsonPath, "json", "", "also write the results as JSON to this file")
	f.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the whole run to this file (go tool pprof)")
	return cmd
}
