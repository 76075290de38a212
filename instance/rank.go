package instance

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/kvevents"
	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/openai"
	"github.com/kvbridge/kvbridge/transfer"
)

// Rank is one data-parallel rank of an instance, as a DP rank of vLLM is one engine core: its KV
// pool in a transfer arena of its own, its engine, its NixlConnector (engine id
// "<engine_id>_dp<rank>" and side channel on VLLM_NIXL_SIDE_CHANNEL_PORT + rank when the
// instance has several ranks) and the OpenAI server over them. The ranks share the model's
// weights and the metrics registry.
type Rank struct {
	// Index is the rank, from 0.
	Index     int
	Engine    *engine.Engine
	Connector *connector.Connector // nil without KVTransfer
	Pool      *kvcache.Pool
	Metrics   *metrics.EngineMetrics
	// KVEvents publishes the rank's KV cache events; nil without an active KVEvents config.
	KVEvents *kvevents.Publisher

	server    *openai.Server
	arena     *transfer.Arena
	tpArenas  []*transfer.Arena // tensor-parallel ranks 1, 2, …: each one's KV memory
	cancelLog context.CancelFunc
	logDone   chan struct{} // closed when the "KV Transfer metrics" logger has returned
	inFlight  atomic.Int64  // completions the dispatcher handed this rank and not yet answered
}

// rank returns the configuration of rank i of an instance configured by cfg (defaults
// applied). With one rank it is cfg itself.
func (cfg Config) rank(i int) Config {
	cfg.dpRank = i
	if cfg.DataParallelSize <= 1 {
		return cfg
	}
	cfg.Logger = cfg.Logger.With("dp_rank", i)
	if cfg.SideChannelPort != 0 { // 0: a free port for each rank
		cfg.SideChannelPort += i
	}
	if cfg.TransferPort != 0 {
		cfg.TransferPort += i
	}
	if cfg.KVEvents != nil {
		ev := cfg.KVEvents.ForRank(i)
		cfg.KVEvents = &ev
	}
	if cfg.KVTransfer != nil {
		kv := *cfg.KVTransfer
		kv.EngineID = fmt.Sprintf("%s_dp%d", kv.EngineID, i)
		cfg.KVTransfer = &kv
	}
	if cfg.MaxConcurrentRequests > 0 { // the bound is the instance's: each rank takes its share
		cfg.MaxConcurrentRequests = (cfg.MaxConcurrentRequests + cfg.DataParallelSize - 1) / cfg.DataParallelSize
	}
	return cfg
}

// startRank builds rank cfg.dpRank over the opened model m, recording into reg. On error it
// returns what it started (to be closed) with the error.
func startRank(cfg Config, m *model.Model, reg *metrics.Registry) (_ *Rank, err error) {
	label := strconv.Itoa(cfg.dpRank)
	name := cfg.ServedModelNames[0]
	rk := &Rank{Index: cfg.dpRank, Metrics: reg.Engine(name, label)}
	geo := engine.KVGeometry(m, cfg.BlockSize)
	geo.Layout = cfg.Layout
	layout := connector.NewArenaLayout(geo.BlockBytes(), cfg.NumBlocks)
	if rk.arena, err = transfer.NewArena("kvcache", layout.Size); err != nil {
		return nil, fmt.Errorf("allocate the KV cache: %w", err)
	}
	// Tensor-parallel ranks 1, 2, … get an arena each (rank 0's is the one above, with the
	// record table), so that each rank's KV can be registered on its own.
	var rankMem [][]byte
	for r := 1; r < m.TensorParallelSize(); r++ {
		a, err := transfer.NewArena(fmt.Sprintf("kvcache-tp%d", r), int64(geo.BlockBytes())*int64(cfg.NumBlocks))
		if err != nil {
			return rk, fmt.Errorf("allocate the KV cache of tensor-parallel rank %d: %w", r, err)
		}
		rk.tpArenas = append(rk.tpArenas, a)
		rankMem = append(rankMem, a.Bytes())
	}
	events := cfg.KVEvents != nil && cfg.KVEvents.Active()
	rk.Pool, err = kvcache.NewPool(rk.arena.Bytes(), kvcache.PoolConfig{
		Geometry: geo, NumBlocks: cfg.NumBlocks, PrefixCaching: cfg.PrefixCaching,
		RecordTable: layout.RecordTable(rk.arena.Bytes()), RecordEvents: events, EventHashes: cfg.BlockHashes,
		RankMemory: rankMem,
	})
	if err != nil {
		return rk, err
	}
	ecfg := engine.Config{
		BlockSize: cfg.BlockSize, NumBlocks: cfg.NumBlocks, MaxModelLen: cfg.MaxModelLen,
		MaxNumSeqs: cfg.MaxNumSeqs, MaxNumBatchedTokens: cfg.MaxNumBatchedTokens,
		PrefixCaching: cfg.PrefixCaching, Seed: cfg.Seed, Observer: engineObserver{rk.Metrics},
	}
	if events {
		if err := startKVEvents(cfg, rk, reg); err != nil {
			return rk, err
		}
		ecfg.KVEvents = rk.KVEvents
	}
	if kv := cfg.KVTransfer; kv != nil {
		if rk.Connector, err = startConnector(cfg, m, rk, layout); err != nil {
			return rk, err
		}
		labels := prometheus.Labels{metrics.LabelModelName: name, metrics.LabelEngine: label}
		if err := reg.Prometheus().Register(rk.Connector.AuthRefusalsCollector(labels)); err != nil {
			return rk, fmt.Errorf("register the KV auth refusal counter: %w", err)
		}
		ecfg.Connector = rk.Connector
		if kv.LoadFailurePolicy == connector.PolicyRecompute {
			ecfg.KVLoadFailurePolicy = engine.FailurePolicyRecompute
		}
		logCtx, cancel := context.WithCancel(context.Background())
		rk.cancelLog, rk.logDone = cancel, make(chan struct{})
		go func() {
			defer close(rk.logDone)
			if !cfg.DisableLogStats {
				rk.Metrics.Nixl().LogEvery(logCtx, cfg.Logger, cfg.StatsInterval)
			}
		}()
	}
	if rk.Engine, err = engine.New(m, rk.Pool, ecfg, cfg.Logger); err != nil {
		return rk, err
	}
	err = rk.Metrics.Configure(metrics.EngineConfig{MaxModelLen: rk.Engine.Config().MaxModelLen, Cache: metrics.CacheConfig{
		BlockSize: cfg.BlockSize, CacheDType: cfg.KVCacheDType, EnablePrefixCaching: cfg.PrefixCaching,
		GPUMemoryUtilization: cfg.MemoryUtilization, NumGPUBlocks: cfg.NumBlocks, KVCacheMemoryBytes: cfg.KVBytes,
	}})
	if err != nil {
		return rk, err
	}
	if rk.Connector != nil {
		rk.Connector.Start(rk.Engine)
	}
	ocfg := openai.Config{
		ServedModelNames: cfg.ServedModelNames, MaxModelLen: cfg.MaxModelLen, Logger: cfg.Logger, Metrics: reg,
		EngineLabel: label, APIKey: cfg.APIKey, MaxConcurrentRequests: cfg.MaxConcurrentRequests, MaxLogprobs: cfg.MaxLogprobs,
		WriteTimeout:        cfg.WriteTimeout,
		PromptTokensDetails: cfg.PromptTokensDetails, ForceIncludeUsage: cfg.ForceIncludeUsage,
	}
	if rk.Connector != nil {
		ocfg.DeclineKV = rk.Connector.Decline
		ocfg.CheckKV = rk.Connector.CheckRole
		ocfg.KVInfo = func() any { return rk.Connector.Info() }
	} else {
		u := &unconnected{log: cfg.Logger}
		ocfg.CheckKV, ocfg.KVInfo = u.observe, u.info
	}
	ocfg.Ready = cfg.ready
	if cfg.dpRank == 0 {
		ocfg.ResetPrefixCache = cfg.reset
	}
	rk.server = openai.NewServer(ocfg, rk.Engine, m)
	return rk, nil
}

// startKVEvents starts rk's KV cache event publisher and registers its drop counter.
func startKVEvents(cfg Config, rk *Rank, reg *metrics.Registry) error {
	pub, err := kvevents.Start(kvevents.Options{Config: *cfg.KVEvents, Rank: cfg.dpRank, BlockSize: cfg.BlockSize, Logger: cfg.Logger})
	if err != nil {
		return fmt.Errorf("start the KV cache event publisher: %w", err)
	}
	rk.KVEvents = pub
	if !cfg.BlockHashes.Seeded() && cfg.dpRank == 0 {
		cfg.Logger.Warn("PYTHONHASHSEED is not set: the block hashes of KV cache events come from a random seed, so no consumer (a KV-aware router) can compute them from a prompt; set PYTHONHASHSEED to the same value on engines and routers",
			"prefix_caching_hash_algo", cfg.BlockHashes.Algo())
	}
	if !cfg.PrefixCaching {
		cfg.Logger.Warn("KV cache events are enabled but prefix caching is not: no block is cached, so none is published")
	}
	labels := prometheus.Labels{metrics.LabelModelName: cfg.ServedModelNames[0], metrics.LabelEngine: strconv.Itoa(cfg.dpRank)}
	dropped := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name:        "kvbridge:kv_events_dropped_total",
		Help:        "KV cache event batches dropped because the publisher's queue (max_queue_size) was full.",
		ConstLabels: labels,
	}, func() float64 { return float64(pub.Dropped()) })
	if err := reg.Prometheus().Register(dropped); err != nil {
		return fmt.Errorf("register the KV event drop counter: %w", err)
	}
	return nil
}

// startConnector starts the NixlConnector of rk; cfg is the rank's, with its defaults applied.
func startConnector(cfg Config, m *model.Model, rk *Rank, layout connector.ArenaLayout) (*connector.Connector, error) {
	listen := cfg.SideChannelHost
	if listen == "localhost" {
		listen = "127.0.0.1"
	}
	mc := m.Config()
	opts := connector.Options{
		Config: cfg.KVTransfer, Pool: rk.Pool, Arena: rk.arena, Layout: layout, RankArenas: rk.tpArenas,
		Compat: connector.CompatFactors{
			Model: m.Name(), DType: m.DType(), NumKVHeads: mc.NumKVHeads, HeadSize: mc.HeadDim,
			NumLayers: mc.NumLayers, CacheDType: m.KVCacheDType(), Quantization: m.Quantization(),
		},
		SideChannelAddr: net.JoinHostPort(listen, strconv.Itoa(cfg.SideChannelPort)),
		AdvertiseHost:   cfg.SideChannelHost,
		Logger:          cfg.Logger,
		Metrics:         rk.Metrics.Nixl(),
		Transfer:        transfer.Config{ListenTCP: net.JoinHostPort(listen, strconv.Itoa(cfg.TransferPort))},
		VocabSize:       mc.VocabSize,
	}
	if cfg.ConnectorHooks != nil {
		cfg.ConnectorHooks(&opts)
	}
	return connector.New(opts)
}

// close stops the engine (releasing every block it holds), the connector, the "KV Transfer
// metrics" logger (waiting for it to return) and the arenas.
func (rk *Rank) close() error {
	var errs []error
	if rk.Engine != nil {
		errs = append(errs, rk.Engine.Close())
	}
	if rk.KVEvents != nil { // after the engine: its last events are sent
		errs = append(errs, rk.KVEvents.Close())
	}
	if rk.Connector != nil {
		errs = append(errs, rk.Connector.Close())
	}
	if rk.cancelLog != nil {
		rk.cancelLog()
		<-rk.logDone
	}
	if rk.arena != nil {
		errs = append(errs, rk.arena.Close())
	}
	for _, a := range rk.tpArenas {
		errs = append(errs, a.Close())
	}
	return errors.Join(errs...)
}
