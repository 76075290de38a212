package main

import (
	"errors"
	"os"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/check"
)

// errNotPD is `kvbridge check`'s failure: the deployment answers, but is not doing P/D.
var errNotPD = errors.New("P/D is not working (see the problems above)")

func newCheckCmd() *cobra.Command {
	var cfg check.Config
	cmd := &cobra.Command{
		Use:   "check",
		Short: "Tell whether a P/D deployment really disaggregates: roles, backend, KV moved, tokens pulled, outputs against recompute, and each misconfiguration by name",
		Long: `check sends a few prompts (temperature 0) through the proxy — and, behind a multi-turn proxy, a
two-turn conversation — reads each engine's /metrics and GET /v1/kv_transfer before and after, and
prints a verdict. It names what is wrong: "P and D swapped", "auth token differs", "no connector
configured", "KV not pulled", "outputs differ from recompute". Exit status 0: P/D works; 1: it
does not (or could not be shown to); 2: bad flags.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfg.Requests < 1 || cfg.Requests > 100 {
				return usageError("--requests %d: want 1 to 100", cfg.Requests)
			}
			if cfg.Timeout <= 0 {
				return usageError("--timeout %v: want a positive duration", cfg.Timeout)
			}
			r, err := check.Run(cmd.Context(), cfg)
			if err != nil {
				return usageError("%v", err)
			}
			r.Print(cmd.OutOrStdout())
			if !r.OK() {
				return errNotPD
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&cfg.Proxy, "proxy", "", "the proxy's base URL, e.g. http://127.0.0.1:8000 (required)")
	fl.StringArrayVar(&cfg.Prefill, "prefill", nil, "a prefill engine's base URL (repeatable): adds its connector, metrics and a reference answer")
	fl.StringArrayVar(&cfg.Decode, "decode", nil, "a decode engine's base URL (repeatable): adds its connector and metrics")
	fl.StringVar(&cfg.Model, "model", "", "the model to ask (default: the proxy's first /v1/models entry)")
	fl.IntVar(&cfg.Requests, "requests", 3, "prompts to send through the proxy")
	fl.DurationVar(&cfg.Timeout, "timeout", check.DefaultTimeout, "bound of each HTTP request")
	cfg.APIKey = os.Getenv("OPENAI_API_KEY")
	return cmd
}
