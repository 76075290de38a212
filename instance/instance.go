// Package instance assembles one running kvbridge engine: the model, the KV pool in a shared
// transfer arena, the engine, the NixlConnector when configured, and the OpenAI HTTP server on a
// listener. `kvbridge serve`, the stack package (and through it the demo, the benchmarks and the
// fault suite) start engines through it. Config's defaults are applied in one place
// (withDefaults); Stats is the narrow view of a running engine that benchmarks read. See
// docs/architecture.md for where the package sits.
package instance

import (
	"context"
	"errors"
	"fmt"
	"github.com/kvbridge/kvbridge/internal/blockhash"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/kvevents"
	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/kernel"
)

// ErrConfig reports an instance configuration that cannot work.
var ErrConfig = errors.New("instance: invalid configuration")

// Defaults of Config owned by the instance. The others live with the package that owns the
// setting: kvcache.DefaultBlockSize, engine.DefaultMaxNumSeqs and
// engine.DefaultMaxNumBatchedTokens, connector.DefaultSideChannelHost and
// connector.DefaultSideChannelPort, openai.DefaultMaxConcurrentRequests.
const (
	// DefaultKVBytes is the memory of the KV pool when neither NumBlocks nor KVBytes is set
	// (--kv-cache-memory-bytes).
	DefaultKVBytes int64 = 1 << 30
	// DefaultStatsInterval is the period of the "KV Transfer metrics" log line
	// (VLLM_LOG_STATS_INTERVAL's default).
	DefaultStatsInterval = 10 * time.Second
)

// Config describes one engine. Zero values take the documented defaults, applied by Start in
// one place (withDefaults).
type Config struct {
	// Model is the model to open (a built-in name, a directory or a cached repo id), unless
	// OpenedModel is set; OpenedModel is shared, not closed by the instance.
	Model       string
	OpenedModel *model.Model
	// ChatTemplate, if set, is a Jinja template source replacing the model's.
	ChatTemplate string
	// Tokenizer, Revision, DType, KVCacheDType and Quantization are model.OpenOptions' (vLLM's
	// --tokenizer, --revision, --dtype, --kv-cache-dtype and --quantization).
	Tokenizer, Revision, DType, KVCacheDType, Quantization string
	// Host and Port are where the HTTP server listens; Port 0 picks a free port.
	Host string
	Port int
	// BlockSize is tokens per KV block (default kvcache.DefaultBlockSize, at most
	// kvcache.MaxBlockSize); Layout the block layout (default HND).
	BlockSize int
	Layout    kvcache.Layout
	// NumBlocks sizes the KV pool; when 0, KVBytes does; when that is 0 too,
	// MemoryUtilization does; else the pool gets DefaultKVBytes.
	NumBlocks int
	KVBytes   int64
	// MemoryUtilization, in (0, 1], sizes the KV pool as vLLM's --gpu-memory-utilization sizes
	// a GPU's: the pool gets that fraction of the machine's memory (MemTotal) less what the
	// process holds after loading the model (its resident set: weights and runtime).
	MemoryUtilization float64
	// MaxModelLen defaults to the model's context (max_position_embeddings), shortened to what
	// the KV pool holds when that is less (logged); an explicit length that does not fit is an
	// ErrConfig error.
	MaxModelLen int
	// MaxNumSeqs and MaxNumBatchedTokens bound a step (defaults engine.DefaultMaxNumSeqs and
	// engine.DefaultMaxNumBatchedTokens, applied by the engine).
	MaxNumSeqs          int
	MaxNumBatchedTokens int
	PrefixCaching       bool
	Seed                int64
	// ServedModelNames default to the model argument.
	ServedModelNames []string
	// APIKey, if set, is required as a Bearer token on /v1 routes.
	APIKey string
	// MaxConcurrentRequests bounds the sequences served at once (a request takes max(n, best_of);
	// 429 beyond); 0 = no limit
	// (`kvbridge serve` passes openai.DefaultMaxConcurrentRequests unless told otherwise).
	MaxConcurrentRequests int
	// WriteTimeout bounds each write of a response to a client (--write-timeout; default
	// openai.DefaultWriteTimeout): a client that stalls longer has its request aborted.
	WriteTimeout time.Duration
	// MaxLogprobs is --max-logprobs (0: the OpenAI server's default, 20).
	MaxLogprobs int
	// PromptTokensDetails is --enable-prompt-tokens-details: usage.prompt_tokens_details
	// (cached and transferred prompt tokens) in responses. Off by default, as in vLLM; the
	// multi-turn proxy's prefill headers and kvbridge's benchmarks read it.
	PromptTokensDetails bool
	// ForceIncludeUsage is --enable-force-include-usage: every stream ends with its usage.
	ForceIncludeUsage bool
	// KVTransfer configures the NixlConnector; nil means none.
	KVTransfer *connector.Config
	// KVEvents is --kv-events-config: when active, every rank publishes its KV cache events
	// (rank i on the endpoints' ports + i, as vLLM). nil means none.
	KVEvents *kvevents.Config
	// BlockHashes computes the block hashes KV cache events carry: vLLM's, from
	// --prefix-caching-hash-algo and PYTHONHASHSEED, so that consumers hash prompts as they
	// would for vLLM. nil: vLLM's default, sha256 seeded from PYTHONHASHSEED (random without it).
	// Every rank shares it.
	BlockHashes *blockhash.Hasher
	// DevMode is VLLM_SERVER_DEV_MODE=1: the development routes vLLM then serves, here POST
	// /reset_prefix_cache (every rank's prefix cache).
	DevMode bool
	// SideChannelHost and SideChannelPort place the connector's side channel
	// (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT); the defaults are connector.DefaultSideChannelHost and
	// connector.DefaultSideChannelPort. Port -1 picks a free port.
	SideChannelHost string
	SideChannelPort int
	// TransferPort is the port of the transfer agent's TCP listener (--kv-transfer-port), on
	// the side channel's host; with several data-parallel ranks rank i listens on TransferPort
	// + i. 0 picks a free port (the default).
	TransferPort int
	// StatsInterval is the period of the "KV Transfer metrics" log line (default
	// DefaultStatsInterval).
	StatsInterval time.Duration
	// DisableLogStats (--disable-log-stats) turns that log line off.
	DisableLogStats bool
	// Logger receives the instance's logs; nil discards.
	Logger *slog.Logger
	// DataParallelSize is --data-parallel-size: the number of ranks (default 1), each a whole
	// engine with its own KV pool (NumBlocks, KVBytes and MaxNumSeqs are per rank, as vLLM's
	// are per GPU; MemoryUtilization's share is split between them) and connector, behind the
	// one HTTP port (see Rank).
	DataParallelSize int
	// TensorParallelSize is --tensor-parallel-size: the ranks each engine's forward pass runs on
	// (model.OpenOptions.TensorParallelSize; default 1). Every data-parallel engine gets its own
	// group of them (DataParallelSize × TensorParallelSize ranks in all). The KV pool's memory
	// (NumBlocks, KVBytes) is the engine's, split over its ranks' arenas, so the same figure
	// holds the same tokens at any size (unless KV heads are replicated). With OpenedModel it
	// must be the model's size. P/D (KVTransfer) pulls and pushes between any TP sizes;
	// push_layerwise needs a prefiller at TP 1.
	TensorParallelSize int
	// RankCPUs pins the tensor-parallel ranks' threads to CPU sets (model.OpenOptions.RankCPUs).
	RankCPUs [][]int
	// Connector overrides test hooks of the connector (clock, tick, transfer settings); it is
	// called for every rank.
	ConnectorHooks func(*connector.Options)

	dpRank int                             // the rank a Config made by rank describes
	ready  func(ctx context.Context) error // the instance's Ready, for every rank's /ready
	// reset is the instance's ResetPrefixCache for rank 0's POST /reset_prefix_cache (DevMode).
	reset func(ctx context.Context) (bool, error)
}

// withDefaults returns cfg with every default applied for the opened model m, or an error
// wrapping ErrConfig naming what cannot work. In the result, NumBlocks, MaxModelLen,
// ServedModelNames and the side channel's host are set, and SideChannelPort is the port to
// listen on (0: a free one).
func (cfg Config) withDefaults(m *model.Model) (Config, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = kvcache.DefaultBlockSize
	}
	if cfg.DataParallelSize == 0 {
		cfg.DataParallelSize = 1
	}
	if cfg.DataParallelSize < 0 {
		return cfg, fmt.Errorf("%w: data parallel size %d must be at least 1", ErrConfig, cfg.DataParallelSize)
	}
	if cfg.BlockSize < 0 || cfg.BlockSize > kvcache.MaxBlockSize {
		return cfg, fmt.Errorf("%w: block size %d must be between 1 and %d", ErrConfig, cfg.BlockSize, kvcache.MaxBlockSize)
	}
	if cfg.TensorParallelSize == 0 {
		cfg.TensorParallelSize = 1
	}
	switch tp := m.TensorParallelSize(); {
	case cfg.TensorParallelSize != tp:
		return cfg, fmt.Errorf("%w: tensor parallel size %d, but the model runs on %d ranks", ErrConfig, cfg.TensorParallelSize, tp)
	case tp > 1 && cfg.KVTransfer != nil && cfg.KVTransfer.Push() && cfg.KVTransfer.PushLayerwise:
		return cfg, fmt.Errorf("%w: --kv-transfer-config with push_layerwise and --tensor-parallel-size %d: layer-by-layer push needs a prefiller at TP 1 (the engine streams one rank's layers; it may push into a decoder of any TP size, and push without it works between any TP sizes)", ErrConfig, tp)
	}
	// A block's bytes over every tensor-parallel rank's memory.
	blockBytes := engine.KVGeometry(m, cfg.BlockSize).BlockBytes() * m.TensorParallelSize()
	var err error
	if cfg.NumBlocks, err = kvBlocks(cfg, blockBytes); err != nil {
		return cfg, err
	}
	if cfg.MaxModelLen, err = fitModelLen(cfg, m.Config().MaxPositionEmbeddings, blockBytes); err != nil {
		return cfg, err
	}
	if len(cfg.ServedModelNames) == 0 {
		cfg.ServedModelNames = []string{m.Name()}
		if cfg.Model != "" {
			cfg.ServedModelNames = []string{cfg.Model}
		}
	}
	if cfg.SideChannelHost == "" {
		cfg.SideChannelHost = connector.DefaultSideChannelHost
	}
	switch {
	case cfg.SideChannelPort == 0:
		cfg.SideChannelPort = connector.DefaultSideChannelPort
	case cfg.SideChannelPort < 0:
		cfg.SideChannelPort = 0
	}
	if last := cfg.SideChannelPort + cfg.DataParallelSize - 1; cfg.SideChannelPort > 0 && last > 65535 {
		return cfg, fmt.Errorf("%w: side channel ports %d to %d (VLLM_NIXL_SIDE_CHANNEL_PORT + data-parallel rank) run past 65535",
			ErrConfig, cfg.SideChannelPort, last)
	}
	if last := cfg.TransferPort + cfg.DataParallelSize - 1; cfg.TransferPort < 0 || (cfg.TransferPort > 0 && last > 65535) {
		return cfg, fmt.Errorf("%w: transfer ports %d to %d (--kv-transfer-port + data-parallel rank) are not ports",
			ErrConfig, cfg.TransferPort, last)
	}
	if cfg.StatsInterval <= 0 {
		cfg.StatsInterval = DefaultStatsInterval
	}
	if cfg.KVEvents != nil && cfg.KVEvents.Active() && cfg.BlockHashes == nil {
		if cfg.BlockHashes, err = blockhash.FromEnv(blockhash.SHA256, os.LookupEnv); err != nil {
			return cfg, err
		}
	}
	return cfg, nil
}

// Instance is a running engine with its HTTP server: one or, with data parallelism, several
// ranks behind one port.
type Instance struct {
	// URL is an HTTP base URL that reaches the instance from this host (LocalURL of Addr),
	// e.g. http://127.0.0.1:8000.
	URL string
	// Addr is the address the HTTP listener is bound to, e.g. [::]:8000 for all interfaces.
	Addr *net.TCPAddr

	Model *model.Model
	// Ranks are the engine's data-parallel ranks (Config.DataParallelSize of them), rank i at
	// index i.
	Ranks []*Rank
	// Engine, Connector, Pool and Metrics are rank 0's: the whole engine's unless
	// DataParallelSize > 1.
	Engine    *engine.Engine
	Connector *connector.Connector // nil without KVTransfer
	Pool      *kvcache.Pool
	Metrics   *metrics.EngineMetrics
	// Registry holds every rank's metrics (the "engine" label is the rank) and is what
	// /metrics serves.
	Registry *metrics.Registry

	ownModel  bool
	srv       *http.Server
	served    chan error
	closeOnce sync.Once
	closeErr  error
}

// Start builds and starts an instance. On error everything it started is stopped.
func Start(ctx context.Context, cfg Config) (_ *Instance, err error) {
	in := &Instance{served: make(chan error, 1)}
	defer func() {
		if err != nil {
			in.Close()
		}
	}()
	in.Model = cfg.OpenedModel
	if in.Model == nil {
		m, err := model.Open(ctx, cfg.Model, model.OpenOptions{ChatTemplate: cfg.ChatTemplate, Tokenizer: cfg.Tokenizer,
			Revision: cfg.Revision, DType: cfg.DType, KVCacheDType: cfg.KVCacheDType, Quantization: cfg.Quantization,
			TensorParallelSize: cfg.TensorParallelSize, RankCPUs: cfg.RankCPUs})
		if errors.Is(err, model.ErrTensorParallel) {
			return nil, fmt.Errorf("%w: --tensor-parallel-size %d: %w", ErrConfig, cfg.TensorParallelSize, err)
		}
		if err != nil {
			return nil, err
		}
		in.Model, in.ownModel = m, true
	}
	if cfg, err = cfg.withDefaults(in.Model); err != nil {
		return nil, err
	}
	loaded := []any{"model", in.Model.String(), "dtype", in.Model.DType(), "kv_cache_dtype", in.Model.KVCacheDType(),
		"weights_mb", math.Round(float64(in.Model.WeightBytes()) / 1e6), "kernel", kernel.Implementation()}
	if in.Model.DType() == "bfloat16" {
		loaded = append(loaded, "bf16_products", kernel.BF16Products())
	}
	if q := in.Model.Quantization(); q != "" {
		loaded = append(loaded, "quantization", q, "int8_products", kernel.Int8Products())
	}
	cfg.Logger.Info("model loaded", loaded...)
	if s := in.Model.Config().RopeScaling; s != nil && s.Type == "dynamic" {
		cfg.Logger.Info("dynamic RoPE scaling uses vLLM's formula, not transformers': the base is enlarged once, for a context of factor × original_max_position_embeddings, and used at every position, where transformers keeps the original base up to original_max_position_embeddings tokens and beyond that enlarges it for each forward's sequence length; outputs match vLLM's, not transformers'",
			"factor", s.Factor, "original_max_position_embeddings", s.OriginalMaxPositionEmbeddings)
	}
	if in.Model.DType() == "bfloat16" && kernel.BF16Products() != "VDPBF16PS" {
		cfg.Logger.Warn("this CPU has no VDPBF16PS: bfloat16 products run in portable Go, exact but many times slower than float32; --dtype float32 is faster here (P and D must then both use it)")
	}
	in.Registry = metrics.NewRegistry()
	cfg.ready = in.Ready
	if cfg.DevMode {
		cfg.reset = in.ResetPrefixCache
	}
	for i := range cfg.DataParallelSize {
		rk, err := startRank(cfg.rank(i), in.Model, in.Registry)
		if rk != nil {
			in.Ranks = append(in.Ranks, rk)
		}
		if err != nil {
			if cfg.DataParallelSize > 1 {
				err = fmt.Errorf("data-parallel rank %d: %w", i, err)
			}
			return nil, err
		}
	}
	r0 := in.Ranks[0]
	in.Engine, in.Connector, in.Pool, in.Metrics = r0.Engine, r0.Connector, r0.Pool, r0.Metrics
	var handler http.Handler = r0.server
	if len(in.Ranks) > 1 {
		handler = &dispatcher{ranks: in.Ranks}
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port)))
	if err != nil {
		return nil, fmt.Errorf("listen on port %d: %w (is another server using it? pick another port)", cfg.Port, err)
	}
	in.Addr = ln.Addr().(*net.TCPAddr)
	in.URL = LocalURL(in.Addr)
	in.srv = &http.Server{Handler: handler, ReadHeaderTimeout: 30 * time.Second}
	go func() { in.served <- in.srv.Serve(ln) }()
	attrs := []any{"model", cfg.ServedModelNames[0], "addr", in.Addr.String(), "url", in.URL, "blocks", cfg.NumBlocks, "block_size", cfg.BlockSize, "max_model_len", cfg.MaxModelLen}
	if cfg.DataParallelSize > 1 {
		attrs = append(attrs, "data_parallel_size", cfg.DataParallelSize)
	}
	if cfg.TensorParallelSize > 1 {
		attrs = append(attrs, "tensor_parallel_size", cfg.TensorParallelSize)
	}
	if in.Connector != nil {
		var ids, sides []string
		for _, rk := range in.Ranks {
			ids, sides = append(ids, rk.Connector.EngineID()), append(sides, rk.Connector.SideChannelAddr())
		}
		attrs = append(attrs, "engine_id", strings.Join(ids, ","), "role", string(cfg.KVTransfer.Role), "side_channel", strings.Join(sides, ","))
	}
	cfg.Logger.Info("kvbridge serving", attrs...)
	return in, nil
}

// LocalURL returns an HTTP base URL that reaches a listener bound to addr from this host: the
// bound address itself, or the loopback address when addr is every interface (0.0.0.0, [::]),
// which is no address a client can name.
func LocalURL(addr *net.TCPAddr) string {
	host := addr.IP.String()
	if addr.IP == nil || addr.IP.IsUnspecified() {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, strconv.Itoa(addr.Port))
}

// kvBlocks returns the number of KV blocks of blockBytes bytes the configuration asks for;
// cfg.Logger is set.
func kvBlocks(cfg Config, blockBytes int) (int, error) {
	switch {
	case cfg.NumBlocks > 0:
		return cfg.NumBlocks, nil
	case cfg.KVBytes > 0:
		return int(cfg.KVBytes / int64(blockBytes)), nil
	case cfg.MemoryUtilization != 0:
		total, resident, err := memoryFigures()
		if err != nil {
			return 0, fmt.Errorf("%w: memory utilization needs the machine's memory figures: %w", ErrConfig, err)
		}
		if !(cfg.MemoryUtilization > 0 && cfg.MemoryUtilization <= 1) {
			return 0, fmt.Errorf("%w: memory utilization %g must be in (0, 1]", ErrConfig, cfg.MemoryUtilization)
		}
		kv := (int64(cfg.MemoryUtilization*float64(total)) - resident) / int64(cfg.DataParallelSize)
		if kv < int64(blockBytes) {
			return 0, fmt.Errorf("%w: memory utilization %g of %.2f GiB leaves no room for the KV cache after the model (%.2f GiB resident): raise it",
				ErrConfig, cfg.MemoryUtilization, gib(total), gib(resident))
		}
		cfg.Logger.Info("KV cache sized by memory utilization", "utilization", cfg.MemoryUtilization,
			"memory_gib", round2(gib(total)), "resident_gib", round2(gib(resident)), "kv_cache_gib", round2(gib(kv)))
		return int(kv / int64(blockBytes)), nil
	}
	return int(DefaultKVBytes / int64(blockBytes)), nil
}

// fitModelLen returns the context length to serve: cfg.MaxModelLen, which must fit the pool
// (vLLM's error, with the numbers, when not); or by default the model's context, shortened to
// the pool's capacity (logged) when that is smaller.
func fitModelLen(cfg Config, modelLen, blockBytes int) (int, error) {
	capacity := cfg.NumBlocks * cfg.BlockSize
	kvGiB := round2(gib(int64(cfg.NumBlocks) * int64(blockBytes)))
	if capacity < cfg.BlockSize {
		return 0, fmt.Errorf("%w: the KV cache (%.2f GiB) holds no block of %d bytes: give it more memory (--kv-cache-memory-bytes)", ErrConfig, kvGiB, blockBytes)
	}
	maxLen := cfg.MaxModelLen
	if maxLen == 0 {
		maxLen = modelLen
		if capacity < maxLen {
			cfg.Logger.Warn("the model's context does not fit the KV cache; serving the longest that fits (raise --kv-cache-memory-bytes or --gpu-memory-utilization for more)",
				"max_model_len", capacity, "model_context", modelLen, "kv_cache_gib", kvGiB)
			maxLen = capacity
		}
	}
	if maxLen > modelLen {
		return 0, fmt.Errorf("%w: max model length %d exceeds the model's max_position_embeddings %d", ErrConfig, maxLen, modelLen)
	}
	if maxLen > capacity {
		need := float64((maxLen+cfg.BlockSize-1)/cfg.BlockSize) * float64(blockBytes)
		return 0, fmt.Errorf("%w: to serve at least one request with the model's max seq len (%d), %.2f GiB KV cache is needed, which is larger than the available KV cache memory (%.2f GiB). "+
			"Based on the available memory, the estimated maximum model length is %d. Try increasing --kv-cache-memory-bytes or decreasing --max-model-len",
			ErrConfig, maxLen, need/(1<<30), kvGiB, capacity)
	}
	return maxLen, nil
}

// gib converts bytes to GiB; round2 rounds to two decimals for logs.
func gib(b int64) float64      { return float64(b) / (1 << 30) }
func round2(x float64) float64 { return math.Round(x*100) / 100 }

// Wait blocks until the HTTP server stops on its own (an error) or ctx ends.
func (in *Instance) Wait(ctx context.Context) error {
	select {
	case err := <-in.served:
		return err
	case <-ctx.Done():
		return nil
	}
}

// Ready reports whether the instance can take part in disaggregated serving now: every rank's
// connector answers its side channel (connector.Connector.Ready); an instance without a
// connector is ready whenever it serves. GET /ready answers with it.
func (in *Instance) Ready(ctx context.Context) error {
	var errs []error
	for _, rk := range in.Ranks {
		if rk.Connector != nil {
			errs = append(errs, rk.Connector.Ready(ctx))
		}
	}
	return errors.Join(errs...)
}

// ResetPrefixCache drops every rank's prefix cache (engine.Engine.ResetPrefixCache) and reports
// whether each did: a rank with a request holding blocks keeps its cache.
func (in *Instance) ResetPrefixCache(ctx context.Context) (bool, error) {
	all := true
	for _, rk := range in.Ranks {
		ok, err := rk.Engine.ResetPrefixCache(ctx)
		if err != nil {
			return false, err
		}
		all = all && ok
	}
	return all, nil
}

// Close stops the HTTP server (waiting up to 10 s for requests), then every rank (see
// Rank.close) and the model it opened. It is idempotent.
func (in *Instance) Close() error {
	in.closeOnce.Do(func() {
		var errs []error
		if in.srv != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			errs = append(errs, in.srv.Shutdown(ctx))
			cancel()
		}
		for _, rk := range in.Ranks {
			errs = append(errs, rk.close())
		}
		if in.ownModel && in.Model != nil {
			errs = append(errs, in.Model.Close())
		}
		in.closeErr = errors.Join(errs...)
	})
	return in.closeErr
}
