package main

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/bench/multiturn"
	"github.com/kvbridge/kvbridge/internal/buildinfo"
)

// newBenchMultiTurnCmd returns `kvbridge bench multi-turn`, vLLM's
// benchmark_serving_multi_turn.py with the same flags, plus --plot and --json.
func newBenchMultiTurnCmd() *cobra.Command {
	var fl multiTurnFlags
	cmd := &cobra.Command{
		Use:   "multi-turn",
		Short: "Benchmark multi-turn chat against an OpenAI-compatible server (vLLM's benchmark_serving_multi_turn.py)",
		Long: `Replays multi-turn conversations against {url}/v1/chat/completions, as vLLM's
benchmarks/multi_turn/benchmark_serving_multi_turn.py does, and prints the same summary: the
Parameters block, runtime_sec, requests_per_sec and count/mean/std/min/percentiles/max of
ttft_ms, tpot_ms, latency_ms, input_num_turns, input_num_tokens, output_num_tokens and
output_num_chunks.

The input file is either a generator config ("filetype": "generate_conversations"; a sample is
bench/multiturn/generate_multi_turn.json) or a ShareGPT-style list of {"id", "messages"}. Text
files of a generator config are looked up next to the config, then in the current directory; a
missing one is replaced by the public-domain text built into kvbridge (with a notice).

Each request sends the conversation so far with the server's real earlier answers, as the
current vLLM script does: model, messages, (conversation_id,) stream, stream_options and
max_tokens, which defaults to the dataset answer's length. --temperature, --request-seed and
--send-min-tokens add what older versions sent ("temperature": 0, "seed": 0, min_tokens). Clients are goroutines sharing a queue of conversations. --model names the
tokenizer used to count tokens (kvbridge/tiny, kvbridge/small, a local HF directory or a cached
repo id); when it cannot be loaded, tokens are estimated as characters/4 and the summary says so.

Additions: --plot FILE draws the mean TTFT per user turn (SVG); --json FILE writes the summary
(per-metric statistics and ttft_ms_by_turn) for ` + "`kvbridge bench compare`" + `.`,
		Example: `  kvbridge bench multi-turn -m kvbridge/small -u http://localhost:8000 \
      -i bench/multiturn/generate_multi_turn.json -p 2 -k 4 --plot ttft.svg --json run.json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return fl.run(cmd) },
	}
	f := cmd.Flags()
	f.SortFlags = false
	f.StringVarP(&fl.input, "input-file", "i", "", "input JSON: a generator config or a ShareGPT-style list of conversations (required)")
	f.StringVarP(&fl.output, "output-file", "o", "", "write the finished conversations, with the server's answers, to this JSON file")
	f.Int64Var(&fl.opts.Seed, "seed", 0, "seed of the random draws (client i uses seed+i+1)")
	f.StringVarP(&fl.model, "model", "m", "", "tokenizer: kvbridge/tiny, kvbridge/small, a local HF directory or a cached repo id; also the API model name (required)")
	f.StringVar(&fl.served, "served-model-name", "", "API model name, if different from --model")
	f.StringVarP(&fl.opts.URL, "url", "u", "http://localhost:8000", "base URL of the server")
	f.StringVar(&fl.apiKey, "api-key", "", "send Authorization: Bearer <key>")
	f.StringArrayVar(&fl.headers, "header", nil, `extra request header, "Name: value" or "Name=value" (repeatable)`)
	f.IntVarP(&fl.opts.NumClients, "num-clients", "p", 1, "clients sending requests in parallel")
	f.IntVarP(&fl.opts.MaxActiveConversations, "max-active-conversations", "k", 0, "active conversations across all clients; each client gets k/p (default: num-clients)")
	f.IntVarP(&fl.opts.MaxNumRequests, "max-num-requests", "n", 0, "cap on requests across all clients, split evenly (default: none)")
	f.BoolVar(&fl.opts.WarmupStep, "warmup-step", false, "first send only the first user turn of every conversation; those samples are excluded")
	f.IntVar(&fl.opts.MaxTurns, "max-turns", 0, "cap on messages per conversation, user and assistant (default: none)")
	f.BoolVar(&fl.opts.NoEarlyStop, "no-early-stop", false, "keep the other clients running after the first client finishes")
	f.IntVar(&fl.opts.LimitMaxTokens, "limit-max-tokens", 0, "max_tokens of every request: 0 = the dataset answer's length, negative = no limit (set with --limit-min-tokens)")
	f.IntVar(&fl.opts.LimitMinTokens, "limit-min-tokens", 0, "min_tokens of every request: 0 = the dataset answer's length, negative = no limit (set with --limit-max-tokens)")
	f.Float64Var(&fl.opts.RequestRate, "request-rate", 0, "Poisson request rate per client in requests/s; 0 = back to back")
	f.IntVar(&fl.opts.MaxRetries, "max-retries", 0, "retries of a failed request, with exponential backoff from 1 s (env MULTITURN_BENCH_MAX_RETRIES)")
	f.StringVar(&fl.sampling, "conversation-sampling", string(multiturn.RoundRobin), "how a client picks its next conversation: round_robin or random")
	f.BoolVar(&fl.opts.VerifyOutput, "verify-output", false, "compare every answer with the dataset's")
	f.IntVar(&fl.timeoutSec, "request-timeout-sec", 120, "timeout of each request in seconds (raised to max_tokens×0.2 s when larger)")
	f.BoolVar(&fl.opts.NoStream, "no-stream", false, "send non-streaming requests")
	f.BoolVar(&fl.opts.SendConversationID, "send-conversation-id", false, `add "conversation_id" to every payload and the X-Session-ID header (for kvbridge proxy --multi-turn)`)
	f.StringVar(&fl.statsJSON, "stats-json-output", "", "write the per-request stats to this JSON file")
	f.StringVar(&fl.warmups, "warmup-percentages", "0%", "comma-separated shares of the earliest samples to drop, e.g. 0%,50% (ignored with --warmup-step)")
	f.StringVar(&fl.plotOut, "plot", "", "draw the mean TTFT per user turn to this SVG file")
	f.StringVar(&fl.summaryJSON, "json", "", "write the summary (statistics and ttft_ms_by_turn) to this JSON file")
	f.BoolVar(&fl.trustRemoteCode, "trust-remote-code", false, "accepted for compatibility; has no effect")
	f.BoolVarP(&fl.excel, "excel-output", "e", false, "write the summary and the raw data to statistics_<N>_clients__<timestamp>.xlsx")
	f.BoolVarP(&fl.opts.Verbose, "verbose", "v", false, "report each client's conversations and turns; Excel raw data get time_between_user_turns_sec")
	f.BoolVar(&fl.printContent, "print-content", false, "print the user prompts and the server's answers")
	f.BoolVar(&fl.version, "version", false, "print the benchmark's version and exit")
	f.Float64Var(&fl.temperature, "temperature", 0, `send "temperature" in every request (the current vLLM script sends none)`)
	f.Int64Var(&fl.requestSeed, "request-seed", 0, `send "seed" in every request (the current vLLM script sends none)`)
	f.BoolVar(&fl.opts.SendMinTokens, "send-min-tokens", false, "send min_tokens (the --limit-min-tokens value) as older versions of the vLLM script did")
	return cmd
}

// newBenchCompareCmd returns `kvbridge bench compare A.json B.json`: two multi-turn summaries
// side by side, optionally as a TTFT-per-turn chart.
func newBenchCompareCmd() *cobra.Command {
	var plotOut, names, title string
	cmd := &cobra.Command{
		Use:   "compare A.json B.json",
		Short: "Compare two `bench multi-turn --json` summaries (table with ratios, optional TTFT-per-turn chart)",
		Long: `Reads two summaries written by ` + "`kvbridge bench multi-turn --json`" + ` and prints requests/s, the
mean, p50 and p90 of ttft_ms, tpot_ms and latency_ms, and the mean TTFT per user turn of both
runs with the ratio B/A. --plot FILE draws the two runs' TTFT per turn in one SVG chart.`,
		Example: `  kvbridge bench compare oneway.json bidirectional.json --plot ttft.svg`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 2 {
				return usageError("compare needs two summary files, got %d", len(args))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			var sums [2]*multiturn.Summary
			for i, p := range args {
				s, err := multiturn.ReadSummaryJSON(p)
				if err != nil {
					return err
				}
				sums[i] = s
			}
			labels := []string{summaryLabel(args[0]), summaryLabel(args[1])}
			if names != "" {
				parts := strings.Split(names, ",")
				if len(parts) != 2 || strings.TrimSpace(parts[0]) == "" || strings.TrimSpace(parts[1]) == "" {
					return usageError("--names %q: want two comma-separated labels", names)
				}
				labels = []string{strings.TrimSpace(parts[0]), strings.TrimSpace(parts[1])}
			}
			if err := multiturn.WriteComparison(cmd.OutOrStdout(), labels[0], labels[1], sums[0], sums[1]); err != nil {
				return err
			}
			if plotOut != "" {
				err := writeFileWithDir(plotOut, func() error {
					return multiturn.WriteTTFTChartFile(plotOut, title, labels, sums[0], sums[1])
				})
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", plotOut)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&plotOut, "plot", "", "draw both runs' mean TTFT per user turn to this SVG file")
	f.StringVar(&names, "names", "", "labels of the two runs, comma-separated (default: the file names)")
	f.StringVar(&title, "title", "TTFT per turn", "chart title")
	return cmd
}

// multiTurnFlags are the flags of `kvbridge bench multi-turn`.
type multiTurnFlags struct {
	opts                            multiturn.Options
	input, output, model, served    string
	apiKey, sampling, warmups       string
	statsJSON, summaryJSON, plotOut string
	headers                         []string
	timeoutSec                      int
	trustRemoteCode                 bool
	excel, printContent, version    bool
	temperature                     float64
	requestSeed                     int64
}

// run runs the benchmark and writes its report and output files.
func (fl *multiTurnFlags) run(cmd *cobra.Command) error {
	if fl.version {
		fmt.Fprintf(cmd.OutOrStdout(), "Benchmark serving with multi-turn conversations 1.0 (kvbridge %s)\n", buildinfo.Version())
		return nil
	}
	warmupPct, err := fl.options(cmd)
	if err != nil {
		return err
	}
	opts, model := fl.opts, fl.model
	_ = fl.trustRemoteCode // accepted for compatibility: kvbridge's tokenizers run no code

	ctx := cmd.Context()
	errw := cmd.ErrOrStderr()
	opts.Progress = errw
	opts.ProgressBar = isCharDevice(errw)
	fmt.Fprintf(errw, "url=%s model=%s num_clients=%d\n", opts.URL, model, max(opts.NumClients, 1))
	opts.Tokens = multiturn.OpenTokenCounter(ctx, model)
	if opts.Tokens.Estimated() {
		fmt.Fprintf(errw, "warning: token counts are an %s\n", opts.Tokens)
	}
	for _, l := range multiturn.ServerInfo(ctx, nil, opts.URL, opts.Header) {
		fmt.Fprintln(errw, l)
	}
	in, err := multiturn.ReadInput(fl.input, opts.Tokens, opts.Seed)
	if err != nil {
		return benchInputError(err)
	}
	for _, n := range in.Notices {
		fmt.Fprintln(errw, "notice:", n)
	}
	fmt.Fprintf(errw, "%d conversations from %s\n", len(in.Conversations), fl.input)
	if in.Gen != nil && in.Gen.PrintStats {
		if err := multiturn.WriteConversationStats(cmd.OutOrStdout(), in.Conversations, opts.Tokens); err != nil {
			return err
		}
	}

	res, runErr := multiturn.Run(ctx, in.Conversations, opts)
	if res == nil {
		return benchInputError(runErr)
	}
	fmt.Fprintf(errw, "all clients finished: benchmark runtime %.3f s, %d requests (%.3f requests/s)\n",
		res.Runtime.Seconds(), len(res.Samples), float64(len(res.Samples))/max(res.Runtime.Seconds(), 1e-9))
	sum := multiturn.Summarize(res, multiturn.ReportInfo{Model: model, Options: opts, Input: in, WarmupPercentages: warmupPct})
	errs := []error{runErr, multiturn.WriteReport(cmd.OutOrStdout(), sum)}
	if len(res.Samples) == 0 && runErr == nil {
		errs = append(errs, fmt.Errorf("no request succeeded (%d failed); is the server at %s up?", res.Failures, opts.URL))
	}
	errs = append(errs, fl.writeFiles(errw, opts, res, sum)...)
	return errors.Join(errs...)
}

// options checks the flags and completes fl.opts from them; it returns the warmup percentages.
func (fl *multiTurnFlags) options(cmd *cobra.Command) ([]float64, error) {
	f, opts := cmd.Flags(), &fl.opts
	if fl.input == "" {
		return nil, usageError("-i/--input-file is required")
	}
	if fl.model == "" {
		return nil, usageError("-m/--model is required (it names the tokenizer)")
	}
	if f.Changed("max-turns") && opts.MaxTurns < 1 {
		return nil, usageError("--max-turns %d: max turns must be a positive number", opts.MaxTurns)
	}
	if fl.timeoutSec <= 0 {
		return nil, usageError("--request-timeout-sec %d: request timeout must be a positive number", fl.timeoutSec)
	}
	if !f.Changed("max-retries") {
		if env := os.Getenv("MULTITURN_BENCH_MAX_RETRIES"); env != "" {
			n, err := strconv.Atoi(env)
			if err != nil || n < 0 {
				return nil, usageError("MULTITURN_BENCH_MAX_RETRIES=%q is not a non-negative integer", env)
			}
			opts.MaxRetries = n
		}
	}
	switch multiturn.Sampling(fl.sampling) {
	case multiturn.RoundRobin, multiturn.Random:
		opts.Sampling = multiturn.Sampling(fl.sampling)
	default:
		return nil, usageError("--conversation-sampling %q: want round_robin or random", fl.sampling)
	}
	warmupPct := []float64{0}
	if !opts.WarmupStep {
		var err error
		if warmupPct, err = multiturn.ParseWarmupPercentages(fl.warmups); err != nil {
			return nil, usageError("--warmup-percentages: %v", err)
		}
	}
	opts.Header = http.Header{}
	for _, h := range fl.headers {
		k, v, err := parseBenchHeader(h)
		if err != nil {
			return nil, err
		}
		opts.Header.Set(k, v)
	}
	if fl.apiKey != "" {
		opts.Header.Set("Authorization", "Bearer "+fl.apiKey)
	}
	opts.Model = fl.model
	if fl.served != "" {
		opts.Model = fl.served
	}
	opts.RequestTimeout = time.Duration(fl.timeoutSec) * time.Second
	if f.Changed("temperature") {
		opts.Temperature = &fl.temperature
	}
	if f.Changed("request-seed") {
		opts.RequestSeed = &fl.requestSeed
	}
	if fl.printContent {
		opts.Content = cmd.OutOrStdout()
	}
	return warmupPct, nil
}

// writeFiles writes the output files asked for, noting each on errw; it returns their errors.
func (fl *multiTurnFlags) writeFiles(errw io.Writer, opts multiturn.Options, res *multiturn.Result, sum *multiturn.Summary) []error {
	var errs []error
	wrote := func(path string, err error) {
		if err != nil {
			errs = append(errs, err)
		} else {
			fmt.Fprintf(errw, "wrote %s\n", path)
		}
	}
	if fl.statsJSON != "" {
		wrote(fl.statsJSON, writeFileWithDir(fl.statsJSON, func() error { return multiturn.WriteStatsJSON(fl.statsJSON, res.Samples) }))
	}
	if fl.summaryJSON != "" {
		wrote(fl.summaryJSON, writeFileWithDir(fl.summaryJSON, func() error { return multiturn.WriteSummaryJSON(fl.summaryJSON, sum) }))
	}
	if fl.plotOut != "" {
		if len(sum.TTFTMsByTurn) == 0 {
			errs = append(errs, fmt.Errorf("--plot %s: no measured requests to draw", fl.plotOut))
		} else {
			wrote(fl.plotOut, writeFileWithDir(fl.plotOut, func() error {
				return multiturn.WriteTTFTChartFile(fl.plotOut, "TTFT per turn: "+opts.Model, []string{opts.Model}, sum)
			}))
		}
	}
	if fl.excel {
		name := multiturn.ExcelFileName(max(opts.NumClients, 1), time.Now())
		wrote(name, multiturn.WriteExcel(name, sum, res.Samples, opts.Verbose))
	}
	if fl.output != "" {
		wrote(fl.output, writeFileWithDir(fl.output, func() error { return multiturn.WriteConversations(fl.output, res.Conversations) }))
	}
	return errs
}

// parseBenchHeader splits "Name: value" or "Name=value" (the first ':' wins, as in the original).
func parseBenchHeader(h string) (string, string, error) {
	for _, sep := range []string{":", "="} {
		if k, v, ok := strings.Cut(h, sep); ok {
			k, v = strings.TrimSpace(k), strings.TrimSpace(v)
			if k != "" {
				return k, v, nil
			}
			break
		}
	}
	return "", "", usageError("--header %q: headers must be given as 'Header-Name: value' or 'Header-Name=value'", h)
}

// benchInputError marks input-file and option errors as usage errors (exit status 2).
func benchInputError(err error) error {
	if errors.Is(err, multiturn.ErrConfig) || errors.Is(err, multiturn.ErrOptions) {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return err
}

// writeFileWithDir creates path's directory, then runs write.
func writeFileWithDir(path string, write func() error) error {
	if dir := filepath.Dir(path); dir != "." {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	return write()
}

// summaryLabel names a summary file in tables and legends: its base name without extension.
func summaryLabel(path string) string {
	b := filepath.Base(path)
	return strings.TrimSuffix(b, filepath.Ext(b))
}

// isCharDevice reports whether w is a character device (a terminal), without x/term.
func isCharDevice(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
