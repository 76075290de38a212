package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/openai"
	"github.com/kvbridge/kvbridge/transfer"
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
	fl.IntVar(&f.blockSize, "block-size", 16, "tokens per KV cache block")
	fl.IntVar(&f.maxModelLen, "max-model-len", 0, "context length: prompt plus output (default: the model's, at most 32768)")
	fl.IntVar(&f.maxNumSeqs, "max-num-seqs", 256, "most sequences in one batch")
	fl.IntVar(&f.maxNumBatchedTokens, "max-num-batched-tokens", 2048, "most tokens computed in one step (longer prompts are prefilled in chunks)")
	fl.Int64Var(&f.seed, "seed", 0, "default sampling seed")
	fl.StringSliceVar(&f.servedModelNames, "served-model-name", nil, "model name(s) the API answers to (default: MODEL)")
	fl.BoolVar(&f.prefixCaching, "enable-prefix-caching", true, "reuse the KV of identical prompt prefixes")
	fl.BoolVar(&f.noPrefixCaching, "no-enable-prefix-caching", false, "disable prefix caching")
	fl.StringVar(&f.kvTransferConfig, "kv-transfer-config", "", "NixlConnector configuration as JSON (dotted keys such as --kv-transfer-config.kv_role also work)")
	fl.BoolVar(&f.enforceEager, "enforce-eager", false, "accepted for vLLM compatibility; no effect (no CUDA graphs on CPU)")
	fl.IntVarP(&f.tensorParallelSize, "tensor-parallel-size", "t", 1, "tensor parallelism; only 1 is supported")
	fl.StringVar(&f.chatTemplate, "chat-template", "", "Jinja chat template file (default: the model's, else ChatML)")
	fl.StringVar(&f.apiKey, "api-key", "", "require this Bearer token on the /v1 routes")
	fl.StringVar(&f.kvCacheMemory, "kv-cache-memory-bytes", "1G", "memory for the KV cache pool (suffixes k, M, G)")
	fl.IntVar(&f.numBlocksOverride, "num-gpu-blocks-override", 0, "number of KV cache blocks (overrides --kv-cache-memory-bytes)")
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
	if f.blockSize <= 0 || f.blockSize > 1024 {
		return usageError("--block-size %d must be between 1 and 1024", f.blockSize)
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
	}

	var opts model.OpenOptions
	if f.chatTemplate != "" {
		src, err := os.ReadFile(f.chatTemplate)
		if err != nil {
			return usageError("--chat-template: %v", err)
		}
		opts.ChatTemplate = string(src)
	}
	m, err := model.Open(ctx, f.model, opts)
	if err != nil {
		return err
	}
	defer m.Close()
	cfg := m.Config()
	maxLen := f.maxModelLen
	if maxLen == 0 {
		maxLen = min(cfg.MaxPositionEmbeddings, 32768)
	}
	if maxLen > cfg.MaxPositionEmbeddings {
		return usageError("--max-model-len %d exceeds the model's max_position_embeddings %d", maxLen, cfg.MaxPositionEmbeddings)
	}
	geo := engine.KVGeometry(m, f.blockSize)
	geo.Layout = kvLayout
	numBlocks := f.numBlocksOverride
	if numBlocks == 0 {
		numBlocks = int(kvMem / int64(geo.BlockBytes()))
	}
	if need := (maxLen + f.blockSize - 1) / f.blockSize; numBlocks < need {
		return usageError("the KV cache holds %d blocks of %d tokens but one %d-token sequence needs %d: raise --kv-cache-memory-bytes or lower --max-model-len", numBlocks, f.blockSize, maxLen, need)
	}
	names := f.servedModelNames
	if len(names) == 0 {
		names = []string{f.model}
	}
	reg := metrics.NewRegistry()
	em := reg.Engine(names[0], "0")

	layout := connector.NewArenaLayout(geo.BlockBytes(), numBlocks)
	arena, err := transfer.NewArena("kvcache", layout.Size)
	if err != nil {
		return fmt.Errorf("allocate the KV cache: %w", err)
	}
	defer arena.Close()
	prefix := f.prefixCaching && !f.noPrefixCaching
	pool, err := kvcache.NewPool(arena.Bytes(), kvcache.PoolConfig{
		Geometry: geo, NumBlocks: numBlocks, PrefixCaching: prefix,
		GenerationTable: layout.GenerationTable(arena.Bytes()),
	})
	if err != nil {
		return err
	}
	ecfg := engine.Config{
		BlockSize:           f.blockSize,
		NumBlocks:           numBlocks,
		MaxModelLen:         maxLen,
		MaxNumSeqs:          f.maxNumSeqs,
		MaxNumBatchedTokens: f.maxNumBatchedTokens,
		PrefixCaching:       prefix,
		Seed:                f.seed,
	}
	var conn *connector.Connector
	if kvCfg != nil {
		conn, err = startConnector(kvCfg, m, pool, arena, layout, em, log)
		if err != nil {
			return err
		}
		defer conn.Close()
		ecfg.Connector = conn
		if kvCfg.LoadFailurePolicy == connector.PolicyRecompute {
			ecfg.KVLoadFailurePolicy = engine.FailurePolicyRecompute
		}
		logCtx, cancelLog := context.WithCancel(ctx)
		defer cancelLog()
		go em.Nixl().LogEvery(logCtx, log, statsInterval())
	}
	eng, err := engine.New(m, pool, ecfg, log)
	if err != nil {
		return err
	}
	defer eng.Close() // runs before conn.Close: the engine releases every held block first
	if conn != nil {
		conn.Start(eng)
		log.Info("NIXL connector ready", "engine_id", conn.EngineID(), "role", string(kvCfg.Role), "side_channel", conn.SideChannelAddr())
	}

	srv := openai.NewServer(openai.Config{
		ServedModelNames: names,
		MaxModelLen:      maxLen,
		Logger:           log,
		Metrics:          reg,
		APIKey:           f.apiKey,
	}, eng, m)

	ln, err := net.Listen("tcp", net.JoinHostPort(f.host, strconv.Itoa(f.port)))
	if err != nil {
		return fmt.Errorf("listen on port %d: %w (is another server using it? pick another with --port)", f.port, err)
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 30 * time.Second}
	log.Info("kvbridge serving", "model", f.model, "addr", "http://"+ln.Addr().String(), "blocks", numBlocks, "block_size", f.blockSize, "max_model_len", maxLen)
	return serveUntilDone(ctx, hs, ln)
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

// startConnector starts the NixlConnector for an engine: side channel at
// VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT (localhost:5600 by default), transfer
// agent, registered KV arena.
func startConnector(cfg *connector.Config, m *model.Model, pool *kvcache.Pool, arena *transfer.Arena, layout connector.ArenaLayout, em *metrics.EngineMetrics, log *slog.Logger) (*connector.Connector, error) {
	host := os.Getenv("VLLM_NIXL_SIDE_CHANNEL_HOST")
	if host == "" {
		host = "localhost"
	}
	port := 5600
	if v := os.Getenv("VLLM_NIXL_SIDE_CHANNEL_PORT"); v != "" {
		p, err := strconv.Atoi(v)
		if err != nil || p < 0 || p > 65535 {
			return nil, usageError("VLLM_NIXL_SIDE_CHANNEL_PORT=%q is not a port number", v)
		}
		port = p
	}
	mc := m.Config()
	listenHost := host
	if listenHost == "localhost" {
		listenHost = "127.0.0.1"
	}
	return connector.New(connector.Options{
		Config: cfg, Pool: pool, Arena: arena, Layout: layout,
		Compat: connector.CompatFactors{
			Model: m.Name(), DType: "float32", NumKVHeads: mc.NumKVHeads, HeadSize: mc.HeadDim,
			NumLayers: mc.NumLayers, CacheDType: "float32",
		},
		SideChannelAddr: net.JoinHostPort(listenHost, strconv.Itoa(port)),
		AdvertiseHost:   host,
		Logger:          log,
		Metrics:         em.Nixl(),
		Transfer:        transfer.Config{ListenTCP: net.JoinHostPort(listenHost, "0")},
	})
}

// statsInterval is VLLM_LOG_STATS_INTERVAL (seconds, default 10).
func statsInterval() time.Duration {
	if v, err := strconv.ParseFloat(os.Getenv("VLLM_LOG_STATS_INTERVAL"), 64); err == nil && v > 0 {
		return time.Duration(v * float64(time.Second))
	}
	return 10 * time.Second
}
