package main

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/bench/pdbench"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
)

// newBenchPDCmd returns `kvbridge bench pd`: TTFT through the P/D proxy against a single engine,
// and D's KV read against a memcpy ceiling measured in the same run.
func newBenchPDCmd() *cobra.Command {
	var (
		opts                     pdbench.PDOptions
		promptLens, jsonP, modes string
	)
	cmd := &cobra.Command{
		Use:   "pd",
		Short: "Measure P/D time to first token against a single engine, and the KV transfer against memcpy",
		Long: `Starts, in this process and on one opened model, a single engine, a prefiller (kv_producer), a
decoder (kv_consumer) and the one-way proxy. For each prompt length it sends distinct random
token-id prompts (max_tokens=1, non-stream) through the proxy and to the single engine and
prints the median TTFT both ways, the P/D overhead, D's KV read (its share of the P/D TTFT and
its GB/s against a single-goroutine memcpy of as many bytes measured in the same run), and a
breakdown of where the P/D time goes.

With --hosts (root needed), the single engine, P and D run as kvbridge processes on hosts of
their own — network namespaces with their own addresses joined by a bridge — and the proxy
in this process on a client host, so every hop crosses a network stack; P and D use TCP, and
the ceiling is the better of two raw TCP streams of as many bytes from P's host to D's (one
connection, and four as the transfer engine opens), measured right after each request.

--transfer-mode runs one set of rows per mode, each on engines and a proxy of their own: pull
(the NixlConnector), push (the NixlPushConnector on P and D, the proxy sending both legs at
once) and push-layered (push with kv_connector_extra_config.push_layerwise on P: each layer's
KV written as soon as it is computed). A mode whose configuration the engines refuse
gets a line saying "unsupported by engines" instead of figures. The hidden_share column is the
share of the transfer spent before P had answered: hidden under P's compute.

--prefill-tp and --decode-tp run P and D at tensor-parallel sizes of their own (default 1; the
single engine stays at TP 1): D's ranks read their KV heads from P's (heterogeneous TP), or in
push P's ranks write them; with --hosts the engine processes get --tensor-parallel-size. A load
is then one READ (or WRITE) per pair of D rank and P rank: transfer_ms sums their durations, so
it overstates the wall time they overlap in.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var err error
			if opts.PromptLens, err = parseInts("--prompt-lens", promptLens); err != nil {
				return err
			}
			if opts.TransferModes, err = splitList(modes); err != nil {
				return usageError("--transfer-mode: %v", err)
			}
			for _, m := range opts.TransferModes {
				if m != pdbench.TransferPull && m != pdbench.TransferPush && m != pdbench.TransferPushLayered {
					return usageError("--transfer-mode %q: want pull, push or push-layered (a comma-separated list)", m)
				}
			}
			if b := strings.ToUpper(opts.Backend); b != "SHM" && b != "TCP" {
				return usageError("--backend %q: SHM or TCP", opts.Backend)
			}
			if opts.Hosts {
				if cmd.Flags().Changed("backend") && strings.ToUpper(opts.Backend) != "TCP" {
					return usageError("--backend %s cannot cross hosts: --hosts uses TCP", opts.Backend)
				}
				opts.Backend = "TCP"
			}
			if opts.PrefillTP <= 0 || opts.DecodeTP <= 0 {
				return usageError("--prefill-tp %d, --decode-tp %d: tensor-parallel sizes are at least 1", opts.PrefillTP, opts.DecodeTP)
			}
			opts.Progress = cmd.ErrOrStderr()
			rows, err := pdbench.RunPD(cmd.Context(), opts)
			if len(rows) > 0 {
				if terr := pdbench.WritePDTable(cmd.OutOrStdout(), rows); terr != nil && err == nil {
					err = terr
				}
				if jsonP != "" {
					if jerr := pdbench.WriteJSON(jsonP, rows); jerr != nil {
						err = errors.Join(err, jerr)
					} else {
						fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", jsonP)
					}
				}
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.Model, "model", model.Small, "model: kvbridge/tiny, kvbridge/small, a local HF directory or a cached repo id")
	f.StringVar(&promptLens, "prompt-lens", "512,1024,2048,4096", "prompt lengths in tokens, one row each")
	f.IntVar(&opts.Iters, "iters", 3, "measured requests per prompt length and path (after one warm-up); rows are medians")
	f.StringVar(&opts.Backend, "backend", "SHM", "transfer backend of P and D: SHM or TCP")
	f.IntVar(&opts.BlockSize, "block-size", kvcache.DefaultBlockSize, "KV block size in tokens")
	f.StringVar(&jsonP, "json", "", "also write the rows as JSON to this file")
	f.StringVar(&modes, "transfer-mode", pdbench.TransferPull, "transfer modes, one set of rows each: pull, push, push-layered (comma-separated)")
	f.IntVar(&opts.PrefillTP, "prefill-tp", 1, "P's tensor-parallel size")
	f.IntVar(&opts.DecodeTP, "decode-tp", 1, "D's tensor-parallel size")
	f.BoolVar(&opts.Hosts, "hosts", false, "run the engines on hosts of their own (network namespaces; root) over TCP, against raw TCP streams between them")
	return cmd
}

// newBenchProxyCmd returns `kvbridge bench proxy`: requests/s and added latency of the one-way
// proxy against the same two legs made straight to the engines, in the same run.
func newBenchProxyCmd() *cobra.Command {
	var (
		opts                     pdbench.ProxyOptions
		clients, maxTokens, jsnP string
	)
	cmd := &cobra.Command{
		Use:   "proxy",
		Short: "Measure the one-way proxy's requests/s and added latency against direct P and D legs",
		Long: `Starts a prefiller, a decoder and the one-way proxy in this process. For every number of
concurrent clients and every max_tokens, runs a closed loop of short requests for the duration
straight to the engines (the benchmark makes the P leg and the D leg itself, as the proxy does)
and then through the proxy, and prints requests/s both ways and the latency the proxy adds at
p50 and p99.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var err error
			if opts.Clients, err = parseInts("--clients", clients); err != nil {
				return err
			}
			if opts.MaxTokens, err = parseInts("--max-tokens", maxTokens); err != nil {
				return err
			}
			if opts.Duration <= 0 {
				return usageError("--duration %s must be positive", opts.Duration)
			}
			opts.Progress = cmd.ErrOrStderr()
			rows, err := pdbench.RunProxy(cmd.Context(), opts)
			if len(rows) > 0 {
				if terr := pdbench.WriteProxyTable(cmd.OutOrStdout(), rows); terr != nil && err == nil {
					err = terr
				}
				if jsnP != "" {
					if jerr := pdbench.WriteJSON(jsnP, rows); jerr != nil {
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
	f.StringVar(&clients, "clients", "1,4,16,64,256", "concurrent clients, one row each")
	f.DurationVar(&opts.Duration, "duration", 3*time.Second, "measured time of each way of each row")
	f.StringVar(&maxTokens, "max-tokens", "1,16", "max_tokens of the requests, one row each")
	f.IntVar(&opts.PromptLen, "prompt-len", 32, "prompt length in tokens")
	f.IntVar(&opts.Rounds, "rounds", 3, "alternating windows per way and row (the duration is split among them)")
	f.StringVar(&jsnP, "json", "", "also write the rows as JSON to this file")
	return cmd
}

// parseInts parses a comma-separated list of positive integers of the flag name.
func parseInts(name, s string) ([]int, error) {
	parts, err := splitList(s)
	if err != nil {
		return nil, usageError("%s: %v", name, err)
	}
	out := make([]int, 0, len(parts))
	for _, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n <= 0 {
			return nil, usageError("%s: %q is not a positive integer", name, p)
		}
		out = append(out, n)
	}
	return out, nil
}
