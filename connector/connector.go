package connector

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/metrics"
	"github.com/kvbridge/kvbridge/transfer"
)

// Scheduler is what the connector tells its engine: which asynchronous loads finished and which
// delayed frees may happen. *engine.Engine implements it.
type Scheduler interface {
	LoadsDone(ok []string, first map[string]engine.FirstToken, failed map[string]int)
	LoadsMissed(ids []string)
	ReleaseDelayed(id string)
}

// Options are a Connector's parts. Config, Pool, Arena and Compat are required.
type Options struct {
	// Config is the parsed --kv-transfer-config.
	Config *Config
	// Pool is the engine's KV pool; its blocks start at offset 0 of Arena and its generation
	// table lives at Layout.GenOffset (see NewArenaLayout).
	Pool   *kvcache.Pool
	Arena  *transfer.Arena
	Layout ArenaLayout
	// RankArenas hold the KV memory of tensor-parallel ranks 1, 2, … (Pool.Shard(r) for
	// r ≥ 1, at offset 0 of RankArenas[r-1]); empty at TP 1. Each is registered with the
	// transfer agent as a region of its own and named in the handshake metadata.
	RankArenas []*transfer.Arena
	// Compat names what peers must agree on (model, dtype, KV shape).
	Compat CompatFactors
	// SideChannelAddr is where the side channel listens (host:port; port 0 picks one).
	SideChannelAddr string
	// AdvertiseHost is the remote_host put in kv_transfer_params (default: the host of
	// SideChannelAddr, "localhost" when that is empty or unspecified).
	AdvertiseHost string
	// Logger receives the connector's log lines; nil discards.
	Logger *slog.Logger
	// Metrics receives transfer statistics; nil records nothing.
	Metrics *metrics.NixlMetrics
	// Now is the clock (default time.Now); Tick drives lease sweeps and heartbeats (default a
	// ticker every 250 ms). Tests substitute both.
	Now  func() time.Time
	Tick <-chan time.Time
	// Transfer overrides transfer agent settings (Backends comes from Config; Auth and
	// AuthorizeRead are the connector's, see auth.go).
	Transfer transfer.Config
	// Getenv reads the environment (default os.Getenv); the auth token falls back to
	// KVBRIDGE_KV_AUTH_TOKEN when kv_connector_extra_config.auth_token is absent.
	Getenv func(string) string
	// VocabSize is the model's vocabulary size. A push decoder that knows it asks its producer
	// for the first token it sampled (and refuses one outside the vocabulary); 0 never asks:
	// the decoder computes its last prompt position itself.
	VocabSize int
}

// Connector is kvbridge's NixlConnector: it implements engine.Connector (the scheduler side),
// runs the transfers (the worker side) and serves the side channel. It is the Node around the
// core (core.go): every engine hook, notification, tick and finished handshake or load is an
// event it hands the core under its mutex, and it performs the actions the core returns —
// starting handshakes, loads and notifications on goroutines it owns, forgetting peers, and
// telling the engine what finished. Its hooks never block.
type Connector struct {
	// Set by New, never changed after.
	cfg     *Config
	pool    *kvcache.Pool
	geo     kvcache.Geometry
	layout  ArenaLayout
	log     *slog.Logger
	metrics *metrics.NixlMetrics
	now     func() time.Time
	compat  CompatFactors // with the transfer mode
	hash    string        // CompatibilityHash(compat)
	agent   *transfer.Agent
	kvReg   *transfer.Region
	metaReg *transfer.Region
	scrReg  *transfer.Region
	rankReg []*transfer.Region // KV regions of tensor-parallel ranks 1, 2, …
	side    *sideChannelServer
	auth    *sideAuth // side-channel proofs; nil without an auth token
	scratch []byte    // records and slots read from producers (see ArenaLayout.scratchEntries)
	ctx     context.Context
	cancel  context.CancelFunc
	// totalKVHeads is the model's KV heads (Compat.NumKVHeads; geo.NumKVHeads counts one rank's).
	totalKVHeads int

	// Set by New or Start, before the worker starts.
	tick   <-chan time.Time
	ticker *time.Ticker

	// Atomic: read and written without the lock.
	counts       counters
	sideRefusals atomic.Int64 // side-channel servers whose proof this engine refused

	wg sync.WaitGroup // the goroutines the connector owns (see takeLocked)

	// mu guards the fields below, and the core: every event reaches it through apply.
	mu         sync.Mutex
	core       *core
	sched      Scheduler
	localLists map[localListKey]*transfer.PreparedList
	scrList    *transfer.PreparedList
	flights    map[remoteKey]*flight // handshakes in progress that somebody waits for
	streams    map[string]*stream    // layer-by-layer pushes by request id (pushstream.go)
	closed     bool
}

// New builds a connector: it starts a transfer agent, registers the KV arena, and listens on
// the side channel. Call Start with the engine before the first request.
func New(opts Options) (*Connector, error) {
	cfg := opts.Config
	if cfg == nil || opts.Pool == nil || opts.Arena == nil {
		return nil, errors.New("connector: Config, Pool and Arena are required")
	}
	c := &Connector{
		cfg:        cfg,
		pool:       opts.Pool,
		geo:        opts.Pool.Geometry(),
		layout:     opts.Layout,
		log:        opts.Logger,
		metrics:    opts.Metrics,
		now:        opts.Now,
		compat:     withMode(opts.Compat, cfg.TransferMode()),
		localLists: map[localListKey]*transfer.PreparedList{},
		flights:    map[remoteKey]*flight{},
		streams:    map[string]*stream{},
		tick:       opts.Tick,
	}
	c.hash = CompatibilityHash(c.compat)
	c.totalKVHeads = opts.Compat.NumKVHeads
	if c.totalKVHeads == 0 {
		c.totalKVHeads = c.geo.NumKVHeads * opts.Pool.TensorParallelSize()
	}
	peers, err := newPeerFilter(cfg.AllowedPeers)
	if err != nil {
		return nil, fmt.Errorf("%w: kv_connector_extra_config.allowed_peers: %v", ErrConfig, err)
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	if c.now == nil {
		c.now = time.Now
	}
	k := &core{
		cfg: cfg, pool: c.pool, geo: c.geo, layout: c.layout, log: c.log, metrics: c.metrics,
		epoch: c.now(), engineID: cfg.EngineID, peers: peers, random: rand.Reader,
		reqs: map[string]*reqState{}, remotes: map[remoteKey]*remoteRecord{}, counts: &c.counts,
		push: newPushState(), kvHeads: c.totalKVHeads, vocab: opts.VocabSize,
	}
	k.heartbeats.Interval = max(cfg.LeaseDuration/6, time.Second)
	c.core = k
	if err := c.layout.check(opts.Pool, opts.Arena); err != nil {
		return nil, err
	}
	if err := checkRankArenas(opts.Pool, opts.RankArenas); err != nil {
		return nil, err
	}
	if opts.Pool.TensorParallelSize() > 1 && cfg.Push() && cfg.PushLayerwise {
		return nil, fmt.Errorf("%w: push_layerwise with tensor parallel size %d: layer-by-layer push needs a prefiller at TP 1 (the engine streams one rank's layers; it may push into a decoder of any TP size, and push without it works between any TP sizes)",
			ErrConfig, opts.Pool.TensorParallelSize())
	}
	tc := opts.Transfer
	tc.Backends = cfg.Backends
	if tc.Logger == nil {
		tc.Logger = c.log
	}
	if err := c.setupAuth(opts.Getenv, &tc); err != nil {
		return nil, err
	}
	tc.AuthorizeRead = c.authorizeRead
	if cfg.Push() {
		tc.AuthorizeWrite = c.authorizeWrite // producers write only into blocks registered with them
	}
	tc.OnPeerLost = c.peerLost
	agent, err := transfer.NewAgent("kvbridge-"+cfg.EngineID, tc)
	if err != nil {
		return nil, fmt.Errorf("connector: start the transfer agent: %w", err)
	}
	c.agent = agent
	fail := func(err error) (*Connector, error) {
		c.closeResources()
		return nil, err
	}
	// In push mode producers WRITE into this engine's blocks (only into the ones it registered
	// with them, push.go); in pull mode peers only read.
	kvPerm := transfer.PermRead
	if cfg.Push() {
		kvPerm |= transfer.PermWrite
	}
	if c.kvReg, err = agent.Register(opts.Arena, 0, c.layout.BlocksBytes, kvPerm); err != nil {
		return fail(fmt.Errorf("connector: register the KV blocks: %w", err))
	}
	if c.metaReg, err = agent.Register(opts.Arena, c.layout.MetaOffset, c.layout.RecordsBytes+c.layout.SlotsBytes, transfer.PermRead); err != nil {
		return fail(fmt.Errorf("connector: register the block records and lease slots: %w", err))
	}
	if c.scrReg, err = agent.Register(opts.Arena, c.layout.ScratchOffset, c.layout.ScratchBytes, 0); err != nil {
		return fail(fmt.Errorf("connector: register the scratch area: %w", err))
	}
	var rankRegions []uint32
	for r, a := range opts.RankArenas {
		reg, err := agent.Register(a, 0, c.layout.BlocksBytes, kvPerm)
		if err != nil {
			return fail(fmt.Errorf("connector: register the KV blocks of tensor-parallel rank %d: %w", r+1, err))
		}
		c.rankReg = append(c.rankReg, reg)
		rankRegions = append(rankRegions, reg.ID())
	}
	c.scratch = c.scrReg.Bytes()
	k.slots = c.layout.slots(opts.Arena.Bytes())
	clear(k.slots)
	c.locked(func() { k.kvRegion, k.metaRegion, k.rankRegions = c.kvReg.ID(), c.metaReg.ID(), rankRegions })
	var inst [8]byte
	if _, err := rand.Read(inst[:]); err != nil {
		return fail(fmt.Errorf("connector: draw an instance id: %w", err))
	}
	k.instance = hex.EncodeToString(inst[:])
	meta := agentMetadata{
		Instance:        k.instance,
		EngineID:        cfg.EngineID,
		AgentMetadata:   agent.LocalMetadata(),
		KVRegion:        c.kvReg.ID(),
		MetaRegion:      c.metaReg.ID(),
		NumBlocks:       opts.Pool.NumBlocks(),
		BlockLen:        opts.Pool.BlockBytes(),
		BlockSize:       c.geo.BlockSize,
		KVCacheLayout:   c.geo.Layout.String(),
		NumLayers:       c.geo.NumLayers,
		NumKVHeads:      c.geo.NumKVHeads,
		HeadDim:         c.geo.HeadDim,
		Version:         ConnectorVersion,
		TPSize:          opts.Pool.TensorParallelSize(),
		RankKVRegions:   rankRegions,
		ReleaseReaderTP: true,
	}
	payload, err := encodeMetadata(c.hash, meta)
	if err != nil {
		return fail(err)
	}
	payload.KVCacheDType = c.geo.DType.String()
	if cfg.Push() {
		payload.TransferMode = cfg.TransferMode()
	}
	if c.side, err = listenSideChannel(opts.SideChannelAddr, payload, c.clockSeconds, c.log, c.auth); err != nil {
		return fail(err)
	}
	k.host = opts.AdvertiseHost
	k.port = c.side.addr().(*net.TCPAddr).Port
	if k.host == "" {
		k.host, _, _ = net.SplitHostPort(opts.SideChannelAddr)
		if ip := net.ParseIP(k.host); k.host == "" || (ip != nil && ip.IsUnspecified()) {
			k.host = "localhost"
		}
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	return c, nil
}

// withMode returns f with the transfer mode set.
func withMode(f CompatFactors, mode string) CompatFactors {
	f.TransferMode = mode
	return f
}

// setupAuth turns on authentication when an auth token is set (the config key, or the
// environment read through getenv, os.Getenv when nil): the transfer agent's (tc.Auth), the
// side channel's and the params' MAC.
func (c *Connector) setupAuth(getenv func(string) string, tc *transfer.Config) error {
	if getenv == nil {
		getenv = os.Getenv
	}
	token, source := resolveAuthToken(c.cfg, getenv)
	if token == "" {
		return nil
	}
	if slices.ContainsFunc(c.cfg.Backends, func(b string) bool { return strings.EqualFold(b, "UCX") }) {
		return fmt.Errorf("%w: kv_connector_extra_config.backends lists UCX and an auth token is set (%s): "+
			"UCX's transports do not authenticate peers; leave UCX out of the backends or run without the token", ErrConfig, source)
	}
	ta, err := transfer.NewHMACAuth([]byte(token))
	if err != nil {
		return fmt.Errorf("connector: auth token: %w", err)
	}
	tc.Auth = ta
	c.auth = newSideAuth(token)
	c.core.paramsKey = paramsMACKey(token)
	c.log.Info("KV transfer authentication enabled: side channel and transfer connections require the shared auth token", "source", source)
	if len(token) < 16 {
		c.log.Warn("the KV auth token is shorter than 16 characters; use a long random value", "source", source)
	}
	return nil
}

// Start attaches the engine and starts the worker goroutine.
func (c *Connector) Start(s Scheduler) {
	c.locked(func() { c.sched = s })
	if c.tick == nil {
		c.ticker = time.NewTicker(250 * time.Millisecond)
		c.tick = c.ticker.C
	}
	c.wg.Add(1)
	go c.worker()
}

// SideChannelAddr returns the address the side channel listens on.
func (c *Connector) SideChannelAddr() string { return c.side.addr().String() }

// EngineID returns this engine's id (engine_id).
func (c *Connector) EngineID() string { return c.cfg.EngineID }

// LeaseDeadline returns when the blocks held for request id will be released unless a reader
// finishes first, and false when none are held.
func (c *Connector) LeaseDeadline(id string) (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if l := c.core.leases.Get(id); l != nil {
		return l.Deadline, true
	}
	return time.Time{}, false
}

// Agent returns the transfer agent (for diagnostics and tests).
func (c *Connector) Agent() *transfer.Agent { return c.agent }

// Close stops the worker and the loads, the side channel and the transfer agent. It is
// idempotent. Blocks still held for remote readers stay allocated: close the engine first (its
// Close releases every delayed free).
func (c *Connector) Close() error {
	if !c.markClosed() {
		return nil
	}
	c.event(func(k *core) { k.closePushes(c.now()) })
	if c.cancel != nil {
		c.cancel()
	}
	c.wg.Wait()
	if c.ticker != nil {
		c.ticker.Stop()
	}
	return c.closeResources()
}

// markClosed marks the connector closing, and reports whether this call did (Close is
// idempotent).
func (c *Connector) markClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.closed, c.core.closed = true, true
	return true
}

// isClosed reports whether Close was called.
func (c *Connector) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// locked runs f under c.mu.
func (c *Connector) locked(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f()
}

// closeResources closes the side channel, releases every descriptor list, deregisters the
// regions and closes the transfer agent.
func (c *Connector) closeResources() error {
	var errs []error
	if c.side != nil {
		errs = append(errs, c.side.close())
	}
	if c.agent != nil {
		c.locked(c.releaseListsLocked)
		for _, r := range append([]*transfer.Region{c.kvReg, c.metaReg, c.scrReg}, c.rankReg...) {
			if r != nil {
				errs = append(errs, c.agent.Deregister(r))
			}
		}
		errs = append(errs, c.agent.Close())
	}
	return errors.Join(errs...)
}

// releaseListsLocked releases the local descriptor lists and those of every handshaken
// producer. c.mu is held.
func (c *Connector) releaseListsLocked() {
	for _, l := range c.localLists {
		l.Release()
	}
	if c.scrList != nil {
		c.scrList.Release()
	}
	c.localLists, c.scrList = nil, nil
	for _, r := range c.core.remotes {
		if r.link != nil {
			r.link.releaseLists()
		}
	}
}

// clockSeconds is this engine's clock for the side channel and remote_blocks_expiry_time:
// seconds since the connector started (monotonic).
func (c *Connector) clockSeconds() float64 { return c.core.seconds(c.now()) }

var (
	_ engine.Connector       = (*Connector)(nil)
	_ engine.ArrivalObserver = (*Connector)(nil)
	_ engine.HoldEvicter     = (*Connector)(nil)
)
