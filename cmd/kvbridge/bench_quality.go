package main

import (
	"strings"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/bench/quality"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
)

// newBenchQualityCmd returns `kvbridge bench quality`: how far reduced-precision variants move
// the model's next-token distributions from a float32 reference on the same weights.
func newBenchQualityCmd() *cobra.Command {
	var (
		opts                 quality.Options
		dtypes, kvDTypes, qs []string
		noBaseline           bool
		jsonPath             string
	)
	cmd := &cobra.Command{
		Use:   "quality",
		Short: "Measure the KL divergence and top-1 agreement of --quantization, --dtype and --kv-cache-dtype against float32",
		Long: `Runs random prompts through a float32 reference (float32 products and KV cache, unquantized
weights) and through each variant on the same weights — every combination of --dtype,
--kv-cache-dtype and --quantization — and reports, over every position of every prompt, the mean
KL divergence KL(reference ‖ variant) of the next-token distributions (with its standard error,
99th percentile and maximum) and how often the most likely token agrees, as llama.cpp's
llama-perplexity --kl-divergence does. A simulation of llama.cpp's Q8_0 (GGUF blocks of 32
weights with a float16 scale, Q8_0 activations) on the same weights is the baseline row; llama.cpp
itself does not run.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch {
			case opts.Prompts <= 0:
				return usageError("--prompts %d must be positive", opts.Prompts)
			case opts.Positions <= 0:
				return usageError("--positions %d must be positive", opts.Positions)
			case opts.Batch <= 0:
				return usageError("--batch %d must be positive", opts.Batch)
			}
			for _, d := range dtypes {
				if _, err := model.ParseDType(d); err != nil {
					return usageError("--dtype %q: want auto, bfloat16 or float32 (float16 is not supported on the CPU)", d)
				}
			}
			for _, d := range kvDTypes {
				if _, err := kvcache.ParseDType(d); err != nil {
					return usageError("--kv-cache-dtype %q: want "+kvCacheDTypes, d)
				}
			}
			for _, q := range qs {
				if _, err := model.ParseQuantization(q); err != nil {
					return usageError("--quantization %q: want none or int8", q)
				}
			}
			for _, d := range dtypes {
				for _, kv := range kvDTypes {
					for _, q := range qs {
						opts.Variants = append(opts.Variants, quality.Variant{Name: variantName(d, kv, q),
							Open: model.OpenOptions{DType: d, KVCacheDType: kv, Quantization: q}})
					}
				}
			}
			if !noBaseline {
				opts.Variants = append(opts.Variants, quality.Q8_0())
			}
			if len(opts.Variants) == 0 {
				return usageError("nothing to compare: give --dtype, --kv-cache-dtype and --quantization values, or drop --no-q8-0")
			}
			opts.Progress = cmd.ErrOrStderr()
			r, err := quality.Run(cmd.Context(), opts)
			if err != nil {
				return err
			}
			return writeBenchReport(cmd, r, jsonPath)
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.Model, "model", model.Small, "model: kvbridge/tiny, kvbridge/small, a local HF directory (kvbridge dev random-checkpoint) or a cached repo id")
	f.IntVar(&opts.Prompts, "prompts", 200, "random prompts")
	f.IntVar(&opts.Positions, "positions", 32, "tokens of each prompt; every position's next-token distribution is compared")
	f.IntVar(&opts.Batch, "batch", 8, "prompts per forward pass (the results do not depend on it)")
	f.Uint64Var(&opts.Seed, "seed", 1, "seed of the random prompts")
	f.StringSliceVar(&dtypes, "dtype", []string{"float32"}, "dtypes of the variants (auto, bfloat16, float32)")
	f.StringSliceVar(&kvDTypes, "kv-cache-dtype", []string{"auto"}, "KV cache dtypes of the variants (auto, float32, bfloat16, fp8, fp8_e4m3, fp8_e5m2)")
	f.StringSliceVar(&qs, "quantization", []string{"int8"}, "weight quantizations of the variants (none, int8)")
	f.BoolVar(&noBaseline, "no-q8-0", false, "leave out the simulated llama.cpp Q8_0 baseline")
	f.StringVar(&jsonPath, "json", "", "also write the results as JSON to this file")
	return cmd
}

// variantName names a variant by the flags that make it.
func variantName(dtype, kv, q string) string {
	parts := []string{"--dtype " + dtype}
	if kv != "auto" {
		parts = append(parts, "--kv-cache-dtype "+kv)
	}
	if q != "" && q != "none" {
		parts = append(parts, "--quantization "+q)
	}
	return strings.Join(parts, " ")
}
