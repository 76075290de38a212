package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/bench/soak"
	"github.com/kvbridge/kvbridge/connector"
)

// newBenchSoakCmd returns `kvbridge bench soak`: the multi-turn workload through the multi-turn
// proxy with faults injected at random, every answer checked against a single engine.
func newBenchSoakCmd() *cobra.Command {
	var (
		cfg      soak.Config
		policy   string
		faults   string
		jsonPath string
		verbose  bool
	)
	cmd := &cobra.Command{
		Use:   "soak",
		Short: "Run the multi-turn workload through P/D with random faults and check every answer",
		Long: `Starts a prefiller and a decoder with bidirectional KV transfer (kvbridge/tiny) behind the
multi-turn proxy, all in this process, with a fault proxy on every path: the proxy's HTTP legs,
both side channels and both transfer paths (TCP; with --backend SHM the transfers bypass the
fault proxies). Conversations run through the proxy while
faults are injected at random from the seed: latency, stalls, connection cuts, connections
closed after some bytes, refused connections, and engine restarts with the same engine_id.
Every answer is compared with a single engine given the same messages and sampling.

The report gives the requests served, errors by class, wrong outputs (must be 0), and the heap,
goroutines and free KV blocks at the start and at the end, after the stack quiesced (must be
flat). The exit status is 1 when the verdict is FAIL.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.Policy = connector.FailurePolicy(policy)
			if faults != "" && faults != "all" {
				cfg.Faults = []string{}
				for _, f := range strings.Split(faults, ",") {
					if f = strings.TrimSpace(f); f != "" && f != "none" {
						cfg.Faults = append(cfg.Faults, f)
					}
				}
			}
			cfg.Progress = cmd.ErrOrStderr()
			if verbose {
				cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
			}
			rep, err := soak.Run(cmd.Context(), cfg)
			if err != nil {
				if errors.Is(err, soak.ErrConfig) {
					return usageError("%v", err)
				}
				return err
			}
			if err := rep.WriteText(cmd.OutOrStdout()); err != nil {
				return err
			}
			if jsonPath != "" {
				if err := rep.WriteJSON(jsonPath); err != nil {
					return err
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", jsonPath)
			}
			if !rep.Pass {
				return fmt.Errorf("soak verdict FAIL: %s", strings.Join(rep.Failures, "; "))
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.DurationVar(&cfg.Duration, "duration", 0, "how long the workload and the faults run (default 1m)")
	f.Int64Var(&cfg.Seed, "seed", 1, "seed of the workload and the faults")
	f.IntVar(&cfg.Concurrency, "concurrency", 4, "conversations in flight")
	f.StringVar(&policy, "policy", "recompute", "kv_load_failure_policy of both engines: fail or recompute")
	f.StringVar(&cfg.Backend, "backend", soak.BackendTCP, "transfer backend: TCP (transfers go through the fault proxies) or SHM (they bypass them)")
	f.DurationVar(&cfg.FaultInterval, "fault-interval", 0, "mean time between two faults (default 2s)")
	f.StringVar(&faults, "faults", "all", "fault kinds, comma-separated: "+strings.Join(soak.AllFaults(), ",")+", all or none")
	f.StringVar(&jsonPath, "json", "", "also write the report as JSON to this file")
	f.BoolVarP(&verbose, "verbose", "v", false, "log the engines' and the proxy's warnings to stderr")
	return cmd
}
