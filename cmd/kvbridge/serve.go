package main

import (
	"context"
	"errors"
	"fmt"
	"github.com/kvbridge/kvbridge/internal/blockhash"
	"log/slog"
	"math"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/kvevents"
	"github.com/kvbridge/kvbridge/model"
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
	kvEventsConfig      string
	prefixCachingHash   string
	enforceEager        bool
	tensorParallelSize  int
	tpCPUs              string
	chatTemplate        string
	apiKey              string
	kvCacheMemory       string
	memoryUtilization   float64
	numBlocksOverride   int
	tokenizer           string
	revision            string
	kvCacheLayout       string
	maxConcurrent       int
	transferPort        int
	writeTimeout        time.Duration

	// vLLM flags with an effect here.
	dataParallelSize     int
	pipelineParallelSize int
	maxLogprobs          int
	disableLogStats      bool
	promptTokensDetails  bool
	forceIncludeUsage    bool
	dtype                string
	kvCacheDType         string
	quantization         string
	log                  logFlags
	// changed reports whether a flag was given (set when the command runs).
	changed func(name string) bool
}

// pythonOnlyFlags take a value and only tune vLLM's Python internals (servers, logging,
// CUDA graphs, compilation, memory fractions, parallel transports): kvbridge accepts them and
// says so in a debug log.
var pythonOnlyFlags = []string{
	"uvicorn-log-level", "swap-space", "cpu-offload-gb", "distributed-executor-backend",
	"compilation-config", "optimization-level", "api-server-count", "max-seq-len-to-capture", "cuda-graph-sizes",
	"load-format", "download-dir", "worker-cls", "otlp-traces-endpoint", "collect-detailed-traces",
	"data-parallel-backend", "data-parallel-address", "data-parallel-rpc-port", "data-parallel-size-local",
	"data-parallel-rank", "data-parallel-start-rank", "max-parallel-loading-workers", "tokenizer-mode",
	"root-path", "middleware", "allowed-origins", "allowed-methods", "allowed-headers",
	"max-log-len",
}

// pythonOnlyBools are the boolean flags of the same kind.
var pythonOnlyBools = []string{
	"disable-log-requests", "enable-log-requests", "disable-frontend-multiprocessing", "disable-custom-all-reduce",
	"enable-chunked-prefill", "no-enable-chunked-prefill", "trust-remote-code", "disable-uvicorn-access-log",
	"disable-fastapi-docs", "disable-async-output-proc", "async-scheduling", "no-async-scheduling",
	"enable-log-outputs", "enable-server-load-tracking", "data-parallel-hybrid-lb", "data-parallel-external-lb",
	"enable-expert-parallel", "enable-sleep-mode", "disable-cascade-attn",
}

func newServeCmd() *cobra.Command { return serveCommand(serve) }

// serveCommand returns `kvbridge serve`, which calls run with its flags.
func serveCommand(run func(context.Context, serveFlags) error) *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve [MODEL]",
		Short: "Run an inference engine with an OpenAI-compatible API (and, with --kv-transfer-config, a NixlConnector)",
		Long: `Run an inference engine with an OpenAI-compatible API.

MODEL is a built-in model (kvbridge/tiny, kvbridge/small), a Hugging Face model directory
(config.json, model.safetensors or a sharded index, tokenizer.json), or a repo id such as
Qwen/Qwen3-0.6B found in the local Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else
~/.cache/huggingface/hub; --revision picks a branch, tag or commit). kvbridge never downloads.
Without MODEL, kvbridge/small is served.

The KV cache gets --kv-cache-memory-bytes (default 1G; env VLLM_CPU_KVCACHE_SPACE in GiB as
vLLM's CPU backend reads it), or with --gpu-memory-utilization that fraction of the machine's
memory less what the loaded model holds. Without --max-model-len the model's context is served,
shortened (and logged) to what the KV cache holds when it is longer.`,
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
			if !cmd.Flags().Changed("kv-cache-memory-bytes") {
				f.kvCacheMemory = "" // sized by VLLM_CPU_KVCACHE_SPACE, --gpu-memory-utilization or the default
			}
			f.changed = cmd.Flags().Changed
			return run(cmd.Context(), f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.model, "model", "", "model to serve (prefer the positional argument)")
	fl.StringVar(&f.host, "host", "", "address to listen on (default: all interfaces, as vLLM's)")
	fl.IntVar(&f.port, "port", 8000, "HTTP port (0 picks a free port)")
	fl.IntVar(&f.blockSize, "block-size", kvcache.DefaultBlockSize, "tokens per KV cache block")
	fl.IntVar(&f.maxModelLen, "max-model-len", 0, "context length: prompt plus output (default: the model's, at most 32768)")
	fl.IntVar(&f.maxNumSeqs, "max-num-seqs", engine.DefaultMaxNumSeqs, "most sequences in one batch")
	fl.IntVar(&f.maxNumBatchedTokens, "max-num-batched-tokens", engine.DefaultMaxNumBatchedTokens, "most tokens computed in one step (longer prompts are prefilled in chunks)")
	fl.Int64Var(&f.seed, "seed", 0, "default sampling seed")
	fl.StringSliceVar(&f.servedModelNames, "served-model-name", nil, "model name(s) the API answers to (default: MODEL)")
	fl.BoolVar(&f.prefixCaching, "enable-prefix-caching", true, "reuse the KV of identical prompt prefixes")
	fl.BoolVar(&f.noPrefixCaching, "no-enable-prefix-caching", false, "disable prefix caching")
	fl.StringVar(&f.kvTransferConfig, "kv-transfer-config", "", "NixlConnector (or NixlPushConnector) configuration as JSON (dotted keys such as --kv-transfer-config.kv_role also work)")
	fl.StringVar(&f.kvEventsConfig, "kv-events-config", "", "KV cache events publisher as JSON with vLLM's keys: enable_kv_cache_events, publisher (zmq or null), endpoint, replay_endpoint, topic, buffer_steps, hwm, max_queue_size")
	fl.StringVar(&f.prefixCachingHash, "prefix-caching-hash-algo", string(blockhash.SHA256), "hash of prefix-cache blocks in KV cache events: sha256 (vLLM's default) or sha256_cbor, from PYTHONHASHSEED")
	fl.BoolVar(&f.enforceEager, "enforce-eager", false, "accepted for vLLM compatibility; no effect (no CUDA graphs on CPU)")
	fl.IntVarP(&f.tensorParallelSize, "tensor-parallel-size", "t", 1, "tensor-parallel ranks (-tp) each engine's forward pass runs on, threads of this process sharing its memory; it must divide the attention heads and divide or be a multiple of the KV heads; outputs are bit-identical at every size")
	fl.StringVar(&f.tpCPUs, "tp-cpus", os.Getenv("VLLM_CPU_OMP_THREADS_BIND"), "pin each tensor-parallel rank's thread to CPUs, vLLM's format: one list per rank separated by |, such as 0-3|4-7 (data-parallel engines take the next lists, cycling); auto or nobind: no pinning (env VLLM_CPU_OMP_THREADS_BIND)")
	fl.StringVar(&f.chatTemplate, "chat-template", "", "Jinja chat template file (default: the model's, else ChatML)")
	fl.StringVar(&f.apiKey, "api-key", "", "require this Bearer token on the /v1 routes")
	fl.StringVar(&f.kvCacheMemory, "kv-cache-memory-bytes", formatBytes(instance.DefaultKVBytes), "memory for the KV cache pool (suffixes k, M, G; env VLLM_CPU_KVCACHE_SPACE in GiB)")
	fl.Float64Var(&f.memoryUtilization, "gpu-memory-utilization", 0, "size the KV cache to this fraction of the machine's memory less the loaded model (0 < x ≤ 1; instead of --kv-cache-memory-bytes)")
	fl.StringVar(&f.tokenizer, "tokenizer", "", "directory or cached repo id to take the tokenizer and chat template from (default: the model's)")
	fl.StringVar(&f.revision, "revision", "", "revision of a cached repo id: branch, tag or commit hash (default: refs/main)")
	fl.IntVar(&f.numBlocksOverride, "num-gpu-blocks-override", 0, "number of KV cache blocks (overrides --kv-cache-memory-bytes)")
	fl.IntVar(&f.maxConcurrent, "max-concurrent-requests", openai.DefaultMaxConcurrentRequests, "sequences served at once (a request counts max(n, best_of)); a request beyond is answered 429 (0: no limit)")
	fl.DurationVar(&f.writeTimeout, "write-timeout", openai.DefaultWriteTimeout, "longest a write of a response may wait for the client to read; a client that stalls longer has its request aborted (kvbridge:http_client_stalled_total)")
	fl.StringVar(&f.kvCacheLayout, "kv-cache-layout", os.Getenv("VLLM_KV_CACHE_LAYOUT"), "KV block layout, HND or NHD (default HND; env VLLM_KV_CACHE_LAYOUT)")
	fl.IntVar(&f.transferPort, "kv-transfer-port", 0, "port of the KV transfer engine's TCP listener, on VLLM_NIXL_SIDE_CHANNEL_HOST (data-parallel rank i: port + i), so that network policies can name it (default 0: a free port)")
	fl.IntVar(&f.dataParallelSize, "data-parallel-size", 1, "data-parallel ranks (-dp) behind the one port, each with its own KV cache and side channel (VLLM_NIXL_SIDE_CHANNEL_PORT + rank)")
	fl.IntVar(&f.pipelineParallelSize, "pipeline-parallel-size", 1, "pipeline parallelism (-pp); only 1 is supported")
	fl.IntVar(&f.maxLogprobs, "max-logprobs", 20, "most logprobs a request may ask for per position (-1: the vocabulary)")
	fl.BoolVar(&f.disableLogStats, "disable-log-stats", false, "no periodic KV Transfer metrics log line")
	fl.BoolVar(&f.promptTokensDetails, "enable-prompt-tokens-details", false, "report usage.prompt_tokens_details (cached and transferred prompt tokens)")
	fl.BoolVar(&f.forceIncludeUsage, "enable-force-include-usage", false, "end every stream with a usage chunk")
	fl.StringVar(&f.dtype, "dtype", "auto", "matrix products: auto (the checkpoint's dtype; float32 for built-in models), bfloat16 or float32")
	fl.StringVar(&f.kvCacheDType, "kv-cache-dtype", "auto", "KV cache values: auto (the model's dtype, as --dtype resolves it), float32, bfloat16, fp8 (= fp8_e4m3) or fp8_e5m2 (one byte a value, scaled by the checkpoint's k_scale/v_scale, else 1.0)")
	fl.Bool("calculate-kv-scales", false, "FP8 KV scales from the first batch; not supported (the checkpoint's scales, else 1.0, are used)")
	fl.StringVarP(&f.quantization, "quantization", "q", "", "weight quantization: int8 (weights quantized at load to int8 in groups of 32, products on int8 activations), or none")
	f.log.register(fl)
	// Only whether they were given matters (checkVLLMFlags), so their values are not kept.
	for _, name := range pythonOnlyFlags {
		fl.String(name, "", "accepted for vLLM compatibility; tunes only vLLM's Python internals")
		_ = fl.MarkHidden(name)
	}
	for _, name := range pythonOnlyBools {
		fl.Bool(name, false, "accepted for vLLM compatibility; tunes only vLLM's Python internals")
		_ = fl.MarkHidden(name)
	}
	return cmd
}

// checkVLLMFlags refuses, naming the flag, the vLLM settings that would change results and that
// kvbridge cannot honour, and debug-logs the accepted ones that only tune vLLM's internals.
func (f *serveFlags) checkVLLMFlags(log *slog.Logger, changed func(string) bool) error {
	switch {
	case f.tensorParallelSize < 1:
		return usageError("--tensor-parallel-size %d must be at least 1", f.tensorParallelSize)
	case f.pipelineParallelSize != 1:
		return usageError("--pipeline-parallel-size %d: kvbridge runs one rank per engine; only 1 is supported", f.pipelineParallelSize)
	case f.dataParallelSize < 1:
		return usageError("--data-parallel-size %d must be at least 1", f.dataParallelSize)
	case f.maxLogprobs < -1 || f.maxLogprobs == 0:
		return usageError("--max-logprobs %d must be -1 (the vocabulary) or at least 1", f.maxLogprobs)
	}
	if _, err := model.ParseQuantization(f.quantization); err != nil {
		return usageError("--quantization %s: want int8 (or none); checkpoints in other quantized formats are not supported", f.quantization)
	}
	if _, err := model.ParseDType(f.dtype); err != nil {
		return usageError("--dtype %q: want auto, bfloat16 or float32 (float16 is not supported on the CPU)", f.dtype)
	}
	if _, err := kvcache.ParseDType(f.kvCacheDType); err != nil {
		return usageError("--kv-cache-dtype %q: want "+kvCacheDTypes, f.kvCacheDType)
	}
	if changed("calculate-kv-scales") {
		return usageError("--calculate-kv-scales: not supported: scales computed from the first batch would differ between a prefill and a decode engine; an FP8 KV cache uses the checkpoint's k_scale/v_scale, else 1.0, as vLLM does without the flag")
	}
	for _, names := range [][]string{pythonOnlyFlags, pythonOnlyBools} {
		for _, name := range names {
			if changed(name) {
				log.Debug("accepted for vLLM compatibility; it only tunes vLLM's Python internals and has no effect here", "flag", "--"+name)
			}
		}
	}
	return nil
}

// serve runs one engine until ctx ends.
func serve(ctx context.Context, f serveFlags) error {
	log, err := f.log.logger(os.Stderr)
	if err != nil {
		return err
	}
	cfg, err := f.instanceConfig(log)
	if err != nil {
		return err
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
	return logShutdown(ctx, log, "kvbridge serve", in.Close)
}

// logShutdown logs why what (a server whose ctx ended: a signal) stops and that it drains,
// closes it, and logs that it closed, with the error if closing failed.
func logShutdown(ctx context.Context, log *slog.Logger, what string, close func() error) error {
	log.Info(what+": shutting down, draining requests (at most 10 s)", "cause", context.Cause(ctx).Error())
	if err := close(); err != nil {
		log.Error(what+": closed with an error", "err", err)
		return err
	}
	log.Info(what + ": closed")
	return nil
}

// instanceConfig checks the flags and builds the engine's configuration.
func (f serveFlags) instanceConfig(log *slog.Logger) (instance.Config, error) {
	changed := f.changed
	if changed == nil {
		changed = func(string) bool { return false }
	}
	if err := f.checkVLLMFlags(log, changed); err != nil {
		return instance.Config{}, err
	}
	if err := f.checkLimits(); err != nil {
		return instance.Config{}, err
	}
	kvLayout, err := f.kvLayout()
	if err != nil {
		return instance.Config{}, err
	}
	kvMem, err := f.kvMemory()
	if err != nil {
		return instance.Config{}, err
	}
	kvCfg, err := f.kvTransfer(log)
	if err != nil {
		return instance.Config{}, err
	}
	if kvCfg != nil && kvCfg.Push() && kvCfg.PushLayerwise && f.tensorParallelSize > 1 {
		return instance.Config{}, usageError("--kv-transfer-config with push_layerwise and --tensor-parallel-size %d: layer-by-layer push needs a prefiller at TP 1 (into a decoder of any TP size); push without it works between any TP sizes", f.tensorParallelSize)
	}
	rankCPUs, err := parseRankCPUs(f.tpCPUs)
	if err != nil {
		return instance.Config{}, usageError("--tp-cpus: %v", err)
	}
	evCfg, err := f.kvEvents()
	if err != nil {
		return instance.Config{}, err
	}
	hashes, err := f.blockHashes(evCfg)
	if err != nil {
		return instance.Config{}, err
	}
	port, err := sideChannelPort()
	if err != nil {
		return instance.Config{}, err
	}
	chatTemplate, err := f.readChatTemplate()
	if err != nil {
		return instance.Config{}, err
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
		WriteTimeout:          f.writeTimeout,
		KVTransfer:            kvCfg,
		KVEvents:              evCfg,
		BlockHashes:           hashes,
		DevMode:               os.Getenv("VLLM_SERVER_DEV_MODE") == "1",
		SideChannelHost:       os.Getenv("VLLM_NIXL_SIDE_CHANNEL_HOST"),
		SideChannelPort:       port,
		TransferPort:          f.transferPort,
		StatsInterval:         statsInterval(),
		Logger:                log,
		MaxLogprobs:           f.maxLogprobs,
		PromptTokensDetails:   f.promptTokensDetails,
		ForceIncludeUsage:     f.forceIncludeUsage,
		DisableLogStats:       f.disableLogStats,
		MemoryUtilization:     f.memoryUtilization,
		Tokenizer:             f.tokenizer,
		Revision:              f.revision,
		DType:                 f.dtype,
		KVCacheDType:          f.kvCacheDType,
		Quantization:          f.quantization,
		DataParallelSize:      f.dataParallelSize,
		TensorParallelSize:    f.tensorParallelSize,
		RankCPUs:              rankCPUs,
	}
	return cfg, nil
}

// checkLimits checks the ports, the write timeout and the sizes of the cache and the batch.
func (f serveFlags) checkLimits() error {
	if f.port < 0 || f.port > 65535 {
		return usageError("--port %d is not a port number", f.port)
	}
	if f.transferPort < 0 || f.transferPort > 65535 {
		return usageError("--kv-transfer-port %d is not a port number", f.transferPort)
	}
	if f.writeTimeout <= 0 {
		return usageError("--write-timeout %v must be positive", f.writeTimeout)
	}
	if f.blockSize <= 0 || f.blockSize > kvcache.MaxBlockSize {
		return usageError("--block-size %d must be between 1 and %d", f.blockSize, kvcache.MaxBlockSize)
	}
	if f.maxNumSeqs <= 0 || f.maxNumBatchedTokens <= 0 || f.maxModelLen < 0 || f.numBlocksOverride < 0 {
		return usageError("--max-num-seqs, --max-num-batched-tokens, --max-model-len and --num-gpu-blocks-override must be positive")
	}
	return nil
}

// kvLayout returns --kv-cache-layout (default HND).
func (f serveFlags) kvLayout() (kvcache.Layout, error) {
	if f.kvCacheLayout == "" {
		return kvcache.HND, nil
	}
	l, err := kvcache.ParseLayout(f.kvCacheLayout)
	if err != nil {
		return l, usageError("--kv-cache-layout: %v", err)
	}
	return l, nil
}

// kvMemory returns the KV cache's size in bytes from --kv-cache-memory-bytes or
// VLLM_CPU_KVCACHE_SPACE (0: the default, or --gpu-memory-utilization, which it checks).
func (f serveFlags) kvMemory() (int64, error) {
	switch {
	case f.kvCacheMemory != "":
		if f.memoryUtilization != 0 {
			return 0, usageError("--kv-cache-memory-bytes and --gpu-memory-utilization both size the KV cache: give one")
		}
		v, err := parseBytes(f.kvCacheMemory)
		if err != nil {
			return 0, usageError("--kv-cache-memory-bytes: %v", err)
		}
		return v, nil
	case f.memoryUtilization != 0:
		if !(f.memoryUtilization > 0 && f.memoryUtilization <= 1) {
			return 0, usageError("--gpu-memory-utilization %g must be in (0, 1]", f.memoryUtilization)
		}
	case os.Getenv("VLLM_CPU_KVCACHE_SPACE") != "":
		gib, err := strconv.ParseFloat(os.Getenv("VLLM_CPU_KVCACHE_SPACE"), 64)
		// inf, or more than 2^33 GiB, would overflow int64 bytes (and a negative size would
		// silently mean the default).
		if err != nil || !(gib > 0) || !(gib*(1<<30) < math.Ldexp(1, 63)) {
			return 0, usageError("VLLM_CPU_KVCACHE_SPACE=%q is not a positive, finite number of GiB below 2^33", os.Getenv("VLLM_CPU_KVCACHE_SPACE"))
		}
		return int64(gib * (1 << 30)), nil
	}
	return 0, nil
}

// kvTransfer parses --kv-transfer-config; nil when not given or not enabled.
func (f serveFlags) kvTransfer(log *slog.Logger) (*connector.Config, error) {
	if f.kvTransferConfig == "" {
		return nil, nil
	}
	kvCfg, err := connector.ParseConfig([]byte(f.kvTransferConfig), log)
	if err != nil {
		return nil, usageError("%v", err)
	}
	if !kvCfg.Enabled() {
		return nil, nil
	}
	return kvCfg, nil
}

// kvEvents parses --kv-events-config; nil when not given or publishing nothing.
func (f serveFlags) kvEvents() (*kvevents.Config, error) {
	if f.kvEventsConfig == "" {
		return nil, nil
	}
	cfg, err := kvevents.ParseConfig(f.kvEventsConfig)
	if err != nil {
		return nil, usageError("%v", err)
	}
	if !cfg.Active() {
		return nil, nil
	}
	return &cfg, nil
}

// blockHashes checks --prefix-caching-hash-algo and, when KV cache events are published, returns
// the hasher of their block hashes, seeded from PYTHONHASHSEED as vLLM's init_none_hash.
func (f serveFlags) blockHashes(ev *kvevents.Config) (*blockhash.Hasher, error) {
	algo, err := blockhash.ParseAlgo(f.prefixCachingHash)
	if err != nil {
		return nil, usageError("--prefix-caching-hash-algo: %v", err)
	}
	if ev == nil {
		return nil, nil
	}
	return blockhash.FromEnv(algo, os.LookupEnv)
}

// sideChannelPort reads VLLM_NIXL_SIDE_CHANNEL_PORT: 0 when unset (the default), −1 for 0 (pick
// a free port).
func sideChannelPort() (int, error) {
	v := os.Getenv("VLLM_NIXL_SIDE_CHANNEL_PORT")
	if v == "" {
		return 0, nil
	}
	p, err := strconv.Atoi(v)
	if err != nil || p < 0 || p > 65535 {
		return 0, usageError("VLLM_NIXL_SIDE_CHANNEL_PORT=%q is not a port number", v)
	}
	if p == 0 {
		return -1, nil // pick a free port
	}
	return p, nil
}

// readChatTemplate reads the --chat-template file, if given.
func (f serveFlags) readChatTemplate() (string, error) {
	if f.chatTemplate == "" {
		return "", nil
	}
	src, err := os.ReadFile(f.chatTemplate)
	if err != nil {
		return "", usageError("--chat-template: %v", err)
	}
	return string(src), nil
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
