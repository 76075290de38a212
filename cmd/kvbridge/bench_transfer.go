package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/bench/xferbench"
	"github.com/kvbridge/kvbridge/transfer"
)

// newBenchTransferCmd returns `kvbridge bench transfer`: the transfer engine's
// nixlbench-like matrix between this process and a re-executed peer process.
func newBenchTransferCmd() *cobra.Command {
	var (
		matrix                         matrixFlags
		iters, warmup, rounds, workers int
		streams, ucxWorkers            int
		jsonPath                       string
		notify, quiet, peer            bool
	)
	cmd := &cobra.Command{
		Use:   "transfer",
		Short: "Benchmark the KV transfer engine (SHM, TCP, UCX) against memcpy and raw TCP ceilings",
		Long: `Runs READ and WRITE transfers between this process and a peer process on this machine:
block sizes × batch sizes, descriptors in scattered order, on the SHM and TCP backends (and UCX
in a binary built with -tags ucx; UCX_TLS and UCX_NET_DEVICES pick its transports). The
ceilings are measured in the same run (a single-thread memcpy of the same bytes, a raw Go
loopback TCP stream) and every row reports its ratio to the ceiling; the backends of a row are
measured in interleaved rounds, and UCX rows also report their ratio to the TCP and SHM rows.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			if peer {
				return xferbench.RunPeer(ctx, os.Stdin, os.Stdout)
			}
			opts := xferbench.Options{Iters: iters, Warmup: warmup, Rounds: rounds, Workers: workers, Streams: streams, UCXWorkers: ucxWorkers, Notify: notify}
			if err := matrix.apply(&opts); err != nil {
				return err
			}
			if !quiet {
				opts.Log = cmd.ErrOrStderr()
			}
			self, err := os.Executable()
			if err != nil {
				return err
			}
			// Re-execute this very command as the peer: same binary, same subcommand path.
			path := strings.Fields(cmd.CommandPath())[1:]
			opts.PeerCommand = func(ctx context.Context) *exec.Cmd {
				c := exec.CommandContext(ctx, self, append(path, "--peer")...)
				c.Stderr = cmd.ErrOrStderr()
				return c
			}
			rows, err := xferbench.Run(ctx, opts)
			if len(rows) > 0 {
				if terr := xferbench.WriteTable(cmd.OutOrStdout(), rows); terr != nil && err == nil {
					err = terr
				}
				if jsonPath != "" {
					if jerr := xferbench.WriteJSON(jsonPath, rows); jerr != nil && err == nil {
						err = jerr
					}
				}
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&matrix.backends, "backends", "SHM,TCP", "backends to measure, in order (SHM, TCP, UCX)")
	f.StringVar(&matrix.ops, "ops", "READ,WRITE", "operations to measure")
	f.StringVar(&matrix.blocks, "blocks", "4K,16K,64K,256K,1M,4M", "block sizes (K, M suffixes = KiB, MiB)")
	f.StringVar(&matrix.batches, "batches", "1,4,16,64,256,1024", "descriptors per request")
	f.IntVar(&iters, "iters", 0, "timed posts per round (0 = automatic, by bytes moved)")
	f.IntVar(&rounds, "rounds", 3, "rounds per row, each after a ceiling run; the best of each is reported")
	f.IntVar(&warmup, "warmup", 3, "untimed posts per row")
	f.StringVar(&matrix.maxBytes, "max-bytes", "256M", "skip rows whose request (block × batch) is larger")
	f.IntVar(&workers, "workers", 0, "SHM copy workers (0 = GOMAXPROCS)")
	f.IntVar(&streams, "streams", 0, "TCP connections per peer (0 = engine default)")
	f.IntVar(&ucxWorkers, "ucx-workers", 0, "UCX workers per agent (0 = engine default)")
	f.BoolVar(&notify, "notify", false, "attach a notification to every post")
	f.StringVar(&jsonPath, "json", "", "also write the rows as JSON to this file")
	f.BoolVarP(&quiet, "quiet", "q", false, "no progress lines on stderr")
	f.BoolVar(&peer, "peer", false, "run as the benchmark's peer process (internal)")
	_ = f.MarkHidden("peer")
	return cmd
}

// matrixFlags are the flags of `kvbridge bench transfer` that choose the matrix.
type matrixFlags struct {
	backends, ops, blocks, batches, maxBytes string
}

// apply checks the flags and sets the matrix of opts from them.
func (m matrixFlags) apply(opts *xferbench.Options) error {
	var err error
	if opts.Backends, err = splitList(m.backends); err != nil {
		return usageError("--backends: %v", err)
	}
	if _, err := transfer.ParseBackends(opts.Backends); err != nil {
		return usageError("--backends: %v", err)
	}
	if opts.Ops, err = parseOps(m.ops); err != nil {
		return err
	}
	if opts.Blocks, err = parseSizes(m.blocks); err != nil {
		return usageError("--blocks: %v", err)
	}
	bs, err := splitList(m.batches)
	if err != nil {
		return usageError("--batches: %v", err)
	}
	for _, b := range bs {
		n, err := strconv.Atoi(b)
		if err != nil || n <= 0 {
			return usageError("--batches: invalid batch %q", b)
		}
		opts.Batches = append(opts.Batches, n)
	}
	if m.maxBytes != "" {
		mb, err := parseSizes(m.maxBytes)
		if err != nil || len(mb) != 1 {
			return usageError("--max-bytes: invalid size %q", m.maxBytes)
		}
		opts.MaxBytes = mb[0]
	}
	return nil
}

// parseOps reads --ops: READ and WRITE, in any case.
func parseOps(s string) ([]transfer.Op, error) {
	names, err := splitList(s)
	if err != nil {
		return nil, usageError("--ops: %v", err)
	}
	var ops []transfer.Op
	for _, o := range names {
		switch strings.ToUpper(o) {
		case "READ":
			ops = append(ops, transfer.Read)
		case "WRITE":
			ops = append(ops, transfer.Write)
		default:
			return nil, usageError("--ops: unknown op %q (READ, WRITE)", o)
		}
	}
	return ops, nil
}

// splitList splits a comma-separated flag value.
func splitList(s string) ([]string, error) {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty list %q", s)
	}
	return out, nil
}

// parseSizes parses "4K,64K,1M" (binary units; KiB/MiB/GiB and plain bytes accepted).
func parseSizes(s string) ([]int64, error) {
	parts, err := splitList(s)
	if err != nil {
		return nil, err
	}
	out := make([]int64, 0, len(parts))
	for _, p := range parts {
		u := strings.ToUpper(p)
		mult := int64(1)
		for _, suf := range []struct {
			s string
			m int64
		}{{"KIB", 1 << 10}, {"MIB", 1 << 20}, {"GIB", 1 << 30}, {"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"B", 1}} {
			if strings.HasSuffix(u, suf.s) {
				u, mult = strings.TrimSuffix(u, suf.s), suf.m
				break
			}
		}
		n, err := strconv.ParseInt(u, 10, 64)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("invalid size %q", p)
		}
		out = append(out, n*mult)
	}
	return out, nil
}
