package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/bench/enginebench"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
)

// newBenchEngineCmd returns `kvbridge bench engine`: prefill and decode throughput of the model's
// forward pass against the FP32 peak and memory bandwidth measured in the same run.
func newBenchEngineCmd() *cobra.Command {
	var (
		opts     enginebench.Options
		jsonPath string
	)
	cmd := &cobra.Command{
		Use:   "engine",
		Short: "Measure prefill and decode speed of the model against this machine's ceilings",
		Long: `Prefills a random prompt into a paged KV pool, decodes greedily from it, and prints prefill
tokens/s and GFLOP/s against the measured FP32 FMA peak, and decode tokens/s against the bound
set by weight bytes ÷ memory read bandwidth. Ceilings are measured in the same run; quote ratios.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			opts.Progress = cmd.ErrOrStderr()
			if opts.DecodeTokens == 0 {
				opts.DecodeTokens = -1 // the flag's 0 means none; Options' 0 means the default
			}
			r, err := enginebench.Run(cmd.Context(), opts)
			if err != nil {
				return err
			}
			if err := r.WriteTable(cmd.OutOrStdout()); err != nil {
				return err
			}
			if jsonPath != "" {
				if err := r.WriteJSON(jsonPath); err != nil {
					return err
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", jsonPath)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.Model, "model", model.Small, "model: kvbridge/tiny, kvbridge/small, a local HF directory or a cached repo id")
	f.IntVar(&opts.PromptLen, "prompt-len", 2000, "prompt tokens to prefill")
	f.IntVar(&opts.DecodeTokens, "decode-tokens", 64, "tokens to decode after the prompt (0: none)")
	f.IntVar(&opts.Chunk, "chunk", 0, "prefill chunk size in tokens (0: the whole prompt in one step)")
	f.IntVar(&opts.BlockSize, "block-size", kvcache.DefaultBlockSize, "KV block size in tokens")
	f.IntVar(&opts.Repeat, "repeat", 3, "runs of prefill and decode; the fastest of each is reported")
	f.DurationVar(&opts.PeakDuration, "peak-duration", 0, "how long to measure the FMA peak (default 1s)")
	f.StringVar(&jsonPath, "json", "", "also write the results as JSON to this file")
	return cmd
}
