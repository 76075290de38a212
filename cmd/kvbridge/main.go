// Command kvbridge is a disaggregated prefill/decode LLM server with KV-cache transfer: an engine
// with a NixlConnector-compatible connector (serve), the P/D proxies (proxy), benchmarks (bench)
// and a one-command showcase (demo).
//
// See docs/architecture.md for the map of kvbridge's packages.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

// run executes the command line and returns the process exit status: 0 on success, 2 for a
// usage error (bad flag, bad value, bad config key), 1 for any other failure.
func run(args []string) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if path := os.Getenv(cpuProfileEnv); path != "" {
		// A CPU profile of the whole process (e.g. `kvbridge serve` until SIGTERM), for go tool
		// pprof. If it cannot start the command still runs, without one.
		stopProfile, err := startCPUProfile(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "kvbridge: %s: %v\n", cpuProfileEnv, err)
		} else {
			defer func() {
				if err := stopProfile(); err != nil {
					fmt.Fprintf(os.Stderr, "kvbridge: %s: %v\n", cpuProfileEnv, err)
				}
			}()
		}
	}
	args, err := normalizeArgs(args)
	if err == nil {
		root := newRootCmd()
		root.SetArgs(args)
		err = root.ExecuteContext(ctx)
	}
	if err == nil {
		return 0
	}
	fmt.Fprintln(os.Stderr, "kvbridge:", err)
	if errors.Is(err, errUsage) {
		return 2
	}
	return 1
}

// cpuProfileEnv names a file to write a CPU profile of the whole process to.
const cpuProfileEnv = "KVBRIDGE_CPUPROFILE"

// startCPUProfile starts the process's CPU profile into a new file at path; stop ends it and
// closes the file. On error no file is left open.
func startCPUProfile(path string) (stop func() error, err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}, nil
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "kvbridge",
		Short:         "Disaggregated prefill/decode LLM serving with KV-cache transfer",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError("%v", err) })
	root.AddCommand(newServeCmd(), newProxyCmd(), newCheckCmd(), newBenchCmd(), newDemoCmd(), newDevCmd())
	return root
}

func newBenchCmd() *cobra.Command {
	bench := &cobra.Command{
		Use:   "bench",
		Short: "Benchmarks that print each figure next to a ceiling measured in the same run",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usageError("bench needs a subcommand; see kvbridge bench --help")
		},
	}
	bench.AddCommand(newBenchTransferCmd(), newBenchEngineCmd(), newBenchQualityCmd(), newBenchPDCmd(), newBenchProxyCmd(), newBenchBidirectionalCmd(), newBenchMultiTurnCmd(), newBenchCompareCmd(), newBenchSoakCmd(), newBenchRoutingCmd())
	return bench
}
