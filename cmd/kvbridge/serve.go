package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/openai"
)

// defaultModel is served when `kvbridge serve` gets no model argument.
const defaultModel = "kvbridge/small"

// serveFlags are the flags of `kvbridge serve`, named as vLLM names them.
type serveFlags struct {
	model               string
	host                string
	port                int
	blockSize           int
	maxModelLen         int
	maxNumSeqs          int
	maxNumBatchedTokens int
	seed                int64
	servedModelNames    []string
	prefixCaching       bool
	noPrefixCaching     bool
	kvTransferConfig    string
	enforceEager        bool
	tensorParallelSize  int
	chatTemplate        string
	apiKey              string
	kvCacheMemory       string
	numBlocksOverride   int
	kvCacheLayout       string
	maxConcurrent       int
}

func newServeCmd() *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve [MODEL]",
		Short: "Run an inference engine with an OpenAI-compatible API (and, with --kv-transfer-config, a NixlConnector)",
		Long: `Run an inference engine with an OpenAI-compatible API.

MODEL is a built-in model (kvbridge/tiny, kvbridge/small), a Hugging Face model directory, or a
repo id found in the local Hugging Face cache. Without MODEL, kvbridge/small is served.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 1 {
				if f.model != "" && f.model != args[0] {
					return usageError("the model is given twice: %q and --model %q", args[0], f.model)
				}
				f.model = args[0]
			}
			if f.model == "" {
				f.model = defaultModel
			}
			return serve(cmd.Context(), f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.model, "model", "", "model to serve (prefer the positional argument)")
	fl.StringVar(&f.host, "host", "", "address to listen on (default: all interfaces)")
	fl.IntVar(&f.port, "port", 8000, "HTTP port (0 picks a free port)")
	fl.IntVar(&f.blockSize, "block-size", kvcache.DefaultBlockSize, "tokens per KV cache block")
	fl.IntVar(&f.maxModelLen, "max-model-len", 0, "context length: prompt plus output (default: the model's, at most 32768)")
	fl.IntVar(&f.maxNumSeqs, "max-num-seqs", engine.DefaultMaxNumSeqs, "most sequences in one batch")
	fl.IntVar(&f.maxNumBatchedTokens, "max-num-batched-tokens", engine.DefaultMaxNumBatchedTokens, "most tokens computed in one step (longer prompts are prefilled in chunks)")
	fl.Int64Var(&f.seed, "seed", 0, "default sampling seed")
	fl.StringSliceVar(&f.servedModelNames, "served-model-name", nil, "model name(s) the API answers to (default: MODEL)")
	fl.BoolVar(&f.prefixCaching, "enable-prefix-caching", true, "reuse the KV of identical prompt prefixes")
	fl.BoolVar(&f.noPrefixCaching, "no-enable-prefix-caching", false, "disable prefix caching")
	fl.StringVar(&f.kvTransferConfig, "kv-transfer-config", "", "NixlConnector configuration as JSON (dotted keys such as --kv-transfer-config.kv_role also work)")
	fl.BoolVar(&f.enforceEager, "enforce-eager", false, "accepted for vLLM compatibility; no effect (no CUDA graphs on CPU)")
	fl.IntVarP(&f.tensorParallelSize, "tensor-parallel-size", "t", 1, "tensor parallelism; only 1 is supported")
	fl.StringVar(&f.chatTemplate, "chat-template", "", "Jinja chat template file (default: the model's, else ChatML)")
	fl.StringVar(&f.apiKey, "api-key", "", "require this Bearer token on the /v1 routes")
	fl.StringVar(&f.kvCacheMemory, "kv-cache-memory-bytes", formatBytes(instance.DefaultKVBytes), "memory for the KV cache pool (suffixes k, M, G)")
	fl.IntVar(&f.numBlocksOverride, "num-gpu-blocks-override", 0, "number of KV cache blocks (overrides --kv-cache-memory-bytes)")
	fl.IntVar(&f.maxConcurrent, "max-concurrent-requests", openai.DefaultMaxConcurrentRequests, "completions served at once; one more is answered 429 (0: no limit)")
	fl.StringVar(&f.kvCacheLayout, "kv-cache-layout", os.Getenv("VLLM_KV_CACHE_LAYOUT"), "KV block layout, HND or NHD (default HND; env VLLM_KV_CACHE_LAYOUT)")
	return cmd
}

// serve runs one engine until ctx ends.
func serve(ctx context.Context, f serveFlags) error {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if f.tensorParallelSize != 1 {
		return usageError("--tensor-parallel-size %d: kvbridge runs one rank per engine; only 1 is supported", f.tensorParallelSize)
	}
	if f.port < 0 || f.port > 65535 {
		return usageError("--port %d is not a port number", f.port)
	}
	if f.blockSize <= 0 || f.blockSize > kvcache.MaxBlockSize {
		return usageError("--block-size %d must be between 1 and %d", f.blockSize, kvcache.MaxBlockSize)
	}
	if f.maxNumSeqs <= 0 || f.maxNumBatchedTokens <= 0 || f.maxModelLen < 0 || f.numBlocksOverride < 0 {
		return usageError("--max-num-seqs, --max-num-batched-tokens, --max-model-len and --num-gpu-blocks-override must be positive")
	}
	kvLayout := kvcache.HND
	if f.kvCacheLayout != "" {
		l, err := kvcache.ParseLayout(f.kvCacheLayout)
		if err != nil {
			return usageError("--kv-cache-layout: %v", err)
		}
		kvLayout = l
	}
	kvMem, err := parseBytes(f.kvCacheMemory)
	if err != nil {
		return usageError("--kv-cache-memory-bytes: %v", err)
	}
	var kvCfg *connector.Config
	if f.kvTransferConfig != "" {
		kvCfg, err = connector.ParseConfig([]byte(f.kvTransferConfig), log)
		if err != nil {
			return usageError("%v", err)
		}
		if !kvCfg.Enabled() {
			kvCfg = nil
		}
	}

	port := 0
	if v := os.Getenv("VLLM_NIXL_SIDE_CHANNEL_PORT"); v != "" {
		p, err := strconv.Atoi(v)
		if err != nil || p < 0 || p > 65535 {
			return usageError("VLLM_NIXL_SIDE_CHANNEL_PORT=%q is not a port number", v)
		}
		port = p
		if p == 0 {
			port = -1 // pick a free port
		}
	}
	var chatTemplate string
	if f.chatTemplate != "" {
		src, err := os.ReadFile(f.chatTemplate)
		if err != nil {
			return usageError("--chat-template: %v", err)
		}
		chatTemplate = string(src)
	}
	cfg := instance.Config{
		Model:                 f.model,
		ChatTemplate:          chatTemplate,
		Host:                  f.host,
		Port:                  f.port,
		BlockSize:             f.blockSize,
		Layout:                kvLayout,
		NumBlocks:             f.numBlocksOverride,
		KVBytes:               kvMem,
		MaxModelLen:           f.maxModelLen,
		MaxNumSeqs:            f.maxNumSeqs,
		MaxNumBatchedTokens:   f.maxNumBatchedTokens,
		PrefixCaching:         f.prefixCaching && !f.noPrefixCaching,
		Seed:                  f.seed,
		ServedModelNames:      f.servedModelNames,
		APIKey:                f.apiKey,
		MaxConcurrentRequests: f.maxConcurrent,
		KVTransfer:            kvCfg,
		SideChannelHost:       os.Getenv("VLLM_NIXL_SIDE_CHANNEL_HOST"),
		SideChannelPort:       port,
		StatsInterval:         statsInterval(),
		Logger:                log,
	}
	in, err := instance.Start(ctx, cfg)
	if errors.Is(err, instance.ErrConfig) {
		return usageError("%v", err)
	}
	if err != nil {
		return err
	}
	defer in.Close()
	if err := in.Wait(ctx); err != nil {
		return err
	}
	return in.Close()
}

// statsInterval is VLLM_LOG_STATS_INTERVAL (seconds); 0 (the instance's default) when unset.
func statsInterval() time.Duration {
	if v, err := strconv.ParseFloat(os.Getenv("VLLM_LOG_STATS_INTERVAL"), 64); err == nil && v > 0 {
		return time.Duration(v * float64(time.Second))
	}
	return 0
}

// formatBytes writes n as parseBytes reads it: 1G, 512M, 64K or a plain byte count.
func formatBytes(n int64) string {
	for _, u := range []struct {
		suffix string
		shift  uint
	}{{"T", 40}, {"G", 30}, {"M", 20}, {"K", 10}} {
		if n > 0 && n%(1<<u.shift) == 0 {
			return strconv.FormatInt(n>>u.shift, 10) + u.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}

// parseBytes reads sizes such as 1G, 512M, 64k or a plain byte count.
func parseBytes(s string) (int64, error) {
	v := scalarValue(s)
	switch n := v.(type) {
	case float64:
		if n > 0 && n == float64(int64(n)) {
			return int64(n), nil
		}
	case int64:
		if n > 0 {
			return n, nil
		}
	}
	return 0, fmt.Errorf("%q is not a positive size such as 1G, 512M or 1048576", s)
}
