package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/bench/bidibench"
	"github.com/kvbridge/kvbridge/conversation"
	"github.com/kvbridge/kvbridge/demo"
	"github.com/kvbridge/kvbridge/model"
)

// newDemoCmd returns `kvbridge demo`: the one-command showcase of bidirectional KV transfer, or
// with --serve a running bidirectional stack to try with curl.
func newDemoCmd() *cobra.Command {
	var (
		opts  demo.Options
		serve bool
	)
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Show bidirectional KV transfer: multi-turn TTFT one-way against bidirectional, in one process",
		Long: `Starts a prefiller (P), a decoder (D) and a proxy in this process on free loopback ports and runs
the same multi-turn conversations twice: one-way (P recomputes the whole history every turn) and
with bidirectional KV transfer behind the multi-turn proxy (P pulls the history's KV from D and
computes only the new tokens). Prints the time to first token per turn in both modes, their
ratio, the KV bytes moved and whether the answers are identical, and draws the TTFT per turn to
kvbridge-demo.svg (or --plot FILE).

With --serve, starts the bidirectional stack on the seed guide's ports (proxy 8000, P 8100,
D 8200; free ports where those are taken), prints curl commands to try and runs until
interrupted.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if serve {
				for _, name := range []string{"turns", "conversations", "json", "plot"} {
					if cmd.Flags().Changed(name) {
						return usageError("--%s does not apply to --serve", name)
					}
				}
				return demo.Serve(cmd.Context(), demo.ServeOptions{
					Model: opts.Model, ProxyPort: demo.DefaultProxyPort, PrefillPort: demo.DefaultPrefillPort, DecodePort: demo.DefaultDecodePort,
					Out: cmd.OutOrStdout(), Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)),
				})
			}
			if opts.Turns <= 0 || opts.Conversations <= 0 {
				return usageError("--turns and --conversations must be positive")
			}
			opts.Out, opts.Progress = cmd.OutOrStdout(), cmd.ErrOrStderr()
			if _, err := demo.Run(cmd.Context(), opts); err != nil {
				return err
			}
			if opts.JSONPath != "" {
				fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", opts.JSONPath)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.Model, "model", model.Small, "model of P and D: kvbridge/tiny, kvbridge/small, a local HF directory or a cached repo id")
	f.IntVar(&opts.Turns, "turns", conversation.DefaultTurns, "turns per conversation")
	f.IntVar(&opts.Conversations, "conversations", conversation.DefaultConversations, "conversations, interleaved turn by turn")
	f.StringVar(&opts.PlotPath, "plot", demo.DefaultPlot, "SVG chart of TTFT per turn")
	f.StringVar(&opts.JSONPath, "json", "", "also write the summary as JSON to this file")
	f.BoolVar(&serve, "serve", false, "keep a bidirectional stack running (proxy :8000, P :8100, D :8200 when free) and print curl commands")
	return cmd
}

// newBenchBidirectionalCmd returns `kvbridge bench bidirectional`: per-turn TTFT of multi-turn
// conversations one-way against bidirectional, with P's prefix caching off and on, against the
// floor of the bidirectional last turn measured in the same run.
func newBenchBidirectionalCmd() *cobra.Command {
	var (
		opts             bidibench.BenchOptions
		jsonPath, plotTo string
	)
	cmd := &cobra.Command{
		Use:   "bidirectional",
		Short: "Measure multi-turn TTFT one-way against bidirectional KV transfer, P's prefix caching off and on",
		Long: `Starts, in this process and on one opened model, two P/D stacks side by side — one-way (no
bidirectional_kv_xfer, the one-way proxy: P recomputes the whole history every turn) and
bidirectional (bidirectional_kv_xfer on P and D, the multi-turn proxy with conversation_id) —
and drives the same conversations through both in lockstep, with P's prefix caching off
(--no-enable-prefix-caching, vLLM's evaluation) and on, --repeats times with new conversations. Prints per-turn TTFT tables (one-way,
bidirectional, ratio) and checks the targets: with prefix caching off, the last turn's
bidirectional TTFT at most 1/5 of one-way and within 2× of its lower bound (the KV moved at the
memcpy ceiling plus the prefill of the new tokens alone on a fresh engine, both measured in the
same run); with prefix caching on, the gain; and identical answers in every mode.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if opts.Turns <= 0 || opts.Conversations <= 0 || opts.UserTokens <= 0 || opts.AnswerTokens <= 0 || opts.Repeats <= 0 {
				return usageError("--turns, --conversations, --user-tokens, --answer-tokens and --repeats must be positive")
			}
			opts.Progress = cmd.ErrOrStderr()
			rep, err := bidibench.RunBench(cmd.Context(), opts)
			if err != nil {
				return err
			}
			if err := bidibench.WriteReport(cmd.OutOrStdout(), rep); err != nil {
				return err
			}
			var errs []error
			if jsonPath != "" {
				if err := bidibench.WriteJSON(jsonPath, rep); err != nil {
					errs = append(errs, err)
				} else {
					fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", jsonPath)
				}
			}
			if plotTo != "" {
				if err := bidibench.WritePlot(plotTo, rep); err != nil {
					errs = append(errs, err)
				} else {
					fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", plotTo)
				}
			}
			if !rep.OutputsIdentical {
				errs = append(errs, errors.New("the answers differ between modes"))
			}
			return errors.Join(errs...)
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.Model, "model", model.Small, "model of P and D")
	f.IntVar(&opts.Conversations, "conversations", conversation.DefaultConversations, "conversations, interleaved turn by turn")
	f.IntVar(&opts.Turns, "turns", conversation.DefaultTurns, "turns per conversation")
	f.IntVar(&opts.UserTokens, "user-tokens", conversation.DefaultUserTokens, "tokens in every user message")
	f.IntVar(&opts.AnswerTokens, "answer-tokens", conversation.DefaultAnswerTokens, "tokens in every answer (greedy, EOS ignored)")
	f.IntVar(&opts.Repeats, "repeats", 3, "repetitions of each comparison with new conversations; each turn's TTFT is the median over conversations × repetitions")
	f.StringVar(&jsonPath, "json", "", "also write the report as JSON to this file")
	f.StringVar(&plotTo, "plot", "", "draw TTFT per turn of the four runs as SVG to this file")
	return cmd
}
