package main

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/bench/routebench"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

func newBenchRoutingCmd() *cobra.Command {
	var (
		opts           routebench.Options
		policies, jsnP string
	)
	cmd := &cobra.Command{
		Use:   "routing",
		Short: "Compare the proxy's routing policies on a shared-prefix workload: prefix-cache hit rate against an oracle, TTFT, load balance",
		Long: `Starts several prefillers with small KV pools that publish their KV cache events, a decoder,
and, per policy, a one-way proxy subscribed to the prefillers' events, in this process. Runs the
same workload through each from empty prefix caches — a few system prompts shared by many
conversations of several turns — and prints, per policy, the prefillers' prefix-cache hit rate
and an oracle's (the longest prefix any prefiller held at each request), TTFT p50 and p99, the
most loaded prefiller against the mean, this process's CPU per request, and how many answers
differ from the first policy's (none may).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			list, err := splitList(policies)
			if err != nil {
				return usageError("--policies: %v", err)
			}
			for _, p := range list {
				if _, err := proxy.ParsePolicy(p); err != nil {
					return usageError("--policies: %v", err)
				}
			}
			opts.Policies = list
			for name, v := range map[string]int{"--prefillers": opts.Prefillers, "--prefill-blocks": opts.PrefillBlocks, "--systems": opts.Systems,
				"--system-len": opts.SystemLen, "--users": opts.Users, "--turns": opts.Turns, "--user-len": opts.UserLen, "--concurrency": opts.Concurrency, "--max-tokens": opts.MaxTokens} {
				if v < 1 {
					return usageError("%s %d: at least 1", name, v)
				}
			}
			opts.Progress = cmd.ErrOrStderr()
			rows, err := routebench.Run(cmd.Context(), opts)
			if len(rows) > 0 {
				if terr := routebench.WriteTable(cmd.OutOrStdout(), rows); terr != nil && err == nil {
					err = terr
				}
				if jsnP != "" {
					if jerr := routebench.WriteJSON(jsnP, rows); jerr != nil {
						err = errors.Join(err, jerr)
					} else {
						fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", jsnP)
					}
				}
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.Model, "model", model.Tiny, "model of the engines")
	f.IntVar(&opts.Prefillers, "prefillers", 3, "prefill engines")
	f.IntVar(&opts.PrefillBlocks, "prefill-blocks", 64, "KV blocks of each prefiller (small, so that prefixes are evicted)")
	f.IntVar(&opts.Systems, "systems", 8, "system prompts shared by the conversations")
	f.IntVar(&opts.SystemLen, "system-len", 160, "tokens of each system prompt")
	f.IntVar(&opts.Users, "users", 48, "conversations")
	f.IntVar(&opts.Turns, "turns", 2, "turns of each conversation")
	f.IntVar(&opts.UserLen, "user-len", 24, "tokens a user adds each turn")
	f.IntVar(&opts.Concurrency, "concurrency", 4, "conversations at once")
	f.IntVar(&opts.MaxTokens, "max-tokens", 4, "max_tokens of each request")
	f.StringVar(&policies, "policies", "round-robin,least-loaded,kv-aware", "policies to run, in order")
	f.StringVar(&jsnP, "json", "", "also write the rows as JSON to this file")
	return cmd
}
