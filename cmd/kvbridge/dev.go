package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/model"
)

// newDevCmd returns `kvbridge dev`: tools for developing kvbridge itself (hidden from help).
func newDevCmd() *cobra.Command {
	dev := &cobra.Command{
		Use:    "dev",
		Short:  "Tools for developing kvbridge",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usageError("dev needs a subcommand; see kvbridge dev --help")
		},
	}
	dev.AddCommand(newRandomCheckpointCmd())
	return dev
}

// checkpointShapes are the real model shapes `kvbridge dev random-checkpoint` can write.
var checkpointShapes = map[string]func() model.Config{
	"qwen3-0.6b": model.Qwen3_0_6B,
}

// newRandomCheckpointCmd returns `kvbridge dev random-checkpoint DIR`: a Hugging Face model
// directory with a real model's shape and random weights, for benchmarks and memory checks of
// real model sizes without their weights.
func newRandomCheckpointCmd() *cobra.Command {
	var shape, dtype string
	var seed uint64
	var layers int
	cmd := &cobra.Command{
		Use:   "random-checkpoint DIR",
		Short: "Write a Hugging Face model directory with a real model's shape and random weights",
		Long: `Writes config.json (as transformers writes it), generation_config.json, the built-in tokenizer
as tokenizer.json and model.safetensors with random weights of the shape's exact tensor shapes,
streamed to disk. Serve or benchmark it like a downloaded checkpoint.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg, ok := checkpointShapes[shape]
			if !ok {
				return usageError("--shape %q: known shapes are qwen3-0.6b", shape)
			}
			dt, err := model.ParseWeightDType(dtype)
			if err != nil {
				return usageError("--dtype %q: want bfloat16, float16 or float32", dtype)
			}
			c := cfg()
			if layers < 0 || layers > c.NumLayers {
				return usageError("--layers %d: the shape has %d", layers, c.NumLayers)
			}
			if layers > 0 {
				c.NumLayers = layers
			}
			n, err := model.WriteRandomCheckpoint(args[0], model.RandomCheckpoint{Config: c, DType: dt, Seed: seed})
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s: %s shape, %s weights, model.safetensors %d bytes\n", args[0], shape, dt, n)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&shape, "shape", "qwen3-0.6b", "model shape: qwen3-0.6b")
	f.StringVar(&dtype, "dtype", "bfloat16", "weight dtype: bfloat16, float16 or float32")
	f.Uint64Var(&seed, "seed", 1, "random seed of the weights")
	f.IntVar(&layers, "layers", 0, "keep only the first N decoder layers (0: all), for a smaller file of the same width")
	return cmd
}
