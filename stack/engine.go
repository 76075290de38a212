package stack

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/faultproxy"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/kvevents"
	"github.com/kvbridge/kvbridge/model"
)

// FaultPaths says in front of which of an engine's paths fault proxies sit.
type FaultPaths uint8

// The paths of an engine a fault proxy can sit in.
const (
	// FaultHTTP: between the P/D proxy and the engine's HTTP server.
	FaultHTTP FaultPaths = 1 << iota
	// FaultSideChannel: in front of the engine's side channel; the P/D proxy's legs rewrite
	// remote_port so that peers dial it.
	FaultSideChannel
	// FaultTransfer: the engine publishes the fault proxy as its transfer address. Only TCP
	// transfers pass through it; SHM copies bypass it.
	FaultTransfer
	// FaultAll is every path.
	FaultAll = FaultHTTP | FaultSideChannel | FaultTransfer
)

// EngineConfig describes one engine. Zero values take the defaults noted on each field.
type EngineConfig struct {
	// Name labels the engine in errors and, when Logger is nil, in the stack's log lines.
	Name string
	// Model is the model served; it is shared, never closed by the engine. Without it each
	// incarnation opens ModelName itself and closes it with itself.
	Model     *model.Model
	ModelName string
	// Role is the NixlConnector's kv_role; "" starts an engine without a connector.
	Role connector.Role
	// The connector's settings (--kv-transfer-config): bidirectional_kv_xfer,
	// kv_load_failure_policy (default fail), kv_connector_extra_config.backends (default
	// automatic), engine_id (default a fresh id, kept across restarts), kv_lease_duration and
	// decoder_kv_blocks_ttl (defaults the connector's), allowed_peers (nil allows every host).
	Bidirectional bool
	Policy        connector.FailurePolicy
	Backends      []string
	EngineID      string
	Lease         time.Duration
	DecoderTTL    time.Duration
	AllowedPeers  []string
	// AuthToken is kv_connector_extra_config.auth_token (default none).
	AuthToken string
	// KVTransferConfig, when set, is a --kv-transfer-config JSON object the connector's
	// settings start from — kv_connector ("NixlPushConnector" for push), keys of
	// kv_connector_extra_config the fields above do not cover — before Role and the fields above
	// apply; an engine that refuses it does not start. nil starts from the connector's defaults.
	KVTransferConfig []byte
	// KVCacheDType is --kv-cache-dtype (default the model's); with Model set it must be empty.
	KVCacheDType string
	// PrefixCaching turns the engine's prefix cache on.
	PrefixCaching bool
	// KVEvents is --kv-events-config (nil: no KV cache events).
	KVEvents *kvevents.Config
	// DataParallelSize is the engine's number of data-parallel ranks (default 1; see
	// instance.Rank). Fault proxies in the side channel or transfer paths, and
	// AdvertiseTransfer, need a single rank.
	DataParallelSize int
	// TensorParallelSize is the engine's --tensor-parallel-size (default Model's, or 1): the
	// ranks of each data-parallel engine (see instance.Config.TensorParallelSize).
	TensorParallelSize int
	// BlockSize, NumBlocks and MaxModelLen size the engine, each rank (defaults the instance's).
	BlockSize, NumBlocks, MaxModelLen int
	// Host is where the engine listens (default 127.0.0.1); Port its HTTP port (0: a free one).
	// With FallbackToFreePort a Port that is taken is replaced by a free one.
	Host               string
	Port               int
	FallbackToFreePort bool
	// SideChannelPort is the side channel's port (0: a free one). With KeepSideChannelPort
	// restarts reuse the port of the first incarnation, as a restarted `kvbridge serve` with a
	// fixed VLLM_NIXL_SIDE_CHANNEL_PORT does; without it each incarnation gets a new one.
	SideChannelPort     int
	KeepSideChannelPort bool
	// AdvertiseTransfer, if set, is the transfer address published to peers (a fault proxy
	// placed by the caller); the engine then listens on a free loopback port of its own
	// (TransferAddr). FaultTransfer sets it to the engine's own fault proxy.
	AdvertiseTransfer string
	// Faults puts fault proxies in front of those of the engine's paths (Engine.Faults).
	Faults FaultPaths
	// Now and Tick replace the connector's clock and the ticker of its lease sweeps and
	// heartbeats (fault tests expire leases on demand with them).
	Now  func() time.Time
	Tick <-chan time.Time
	// StatsInterval is the period of the "KV Transfer metrics" log line (default the
	// instance's).
	StatsInterval time.Duration
	// MaxConcurrentRequests and WriteTimeout are the OpenAI server's sequence-slot limit (default
	// none) and write timeout (default the server's).
	MaxConcurrentRequests int
	WriteTimeout          time.Duration
	// Logger receives the engine's logs; nil discards.
	Logger *slog.Logger
}

// Faults are the fault proxies in an engine's paths; a field is nil where there is none.
type Faults struct {
	HTTP, SideChannel, Transfer *faultproxy.Proxy
}

func (f Faults) all() []*faultproxy.Proxy {
	return []*faultproxy.Proxy{f.HTTP, f.SideChannel, f.Transfer}
}

// Engine is a running engine that can be restarted: a new incarnation (instance) behind the same
// fault proxies, with the same engine_id. Its methods are safe for concurrent use.
type Engine struct {
	// Name is EngineConfig.Name.
	Name string
	// Faults are the fault proxies in the engine's paths.
	Faults Faults

	cfg EngineConfig

	mu       sync.Mutex
	in       *instance.Instance
	transfer string // the transfer listener's address when another one is published
	closed   bool
}

// StartEngine starts an engine (and its fault proxies). On error everything it started is
// stopped.
func StartEngine(ctx context.Context, cfg EngineConfig) (_ *Engine, err error) {
	if cfg.Model == nil && cfg.ModelName == "" {
		return nil, fmt.Errorf("stack: %w: engine %q has no model", instance.ErrConfig, cfg.Name)
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if cfg.Role != "" && cfg.EngineID == "" {
		cfg.EngineID = connector.DefaultConfig(cfg.Role).EngineID // kept across restarts
	}
	if cfg.DataParallelSize > 1 && (cfg.Faults&(FaultSideChannel|FaultTransfer) != 0 || cfg.AdvertiseTransfer != "") {
		return nil, fmt.Errorf("stack: %w: engine %q: fault proxies in the side channel or transfer paths need a single data-parallel rank", instance.ErrConfig, cfg.Name)
	}
	e := &Engine{Name: cfg.Name, cfg: cfg}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	for _, f := range []struct {
		path FaultPaths
		fp   **faultproxy.Proxy
	}{{FaultHTTP, &e.Faults.HTTP}, {FaultSideChannel, &e.Faults.SideChannel}, {FaultTransfer, &e.Faults.Transfer}} {
		if cfg.Faults&f.path == 0 {
			continue
		}
		if *f.fp, err = faultproxy.New(""); err != nil {
			return nil, fmt.Errorf("stack: %s: %w", cfg.Name, err)
		}
	}
	if e.Faults.Transfer != nil {
		e.cfg.AdvertiseTransfer = e.Faults.Transfer.Addr()
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e, e.start(ctx)
}

// instanceConfig returns the instance configuration of cfg, without the transfer listener start
// chooses.
func (cfg EngineConfig) instanceConfig() (instance.Config, error) {
	ic := instance.Config{
		Model: cfg.ModelName, OpenedModel: cfg.Model, Host: cfg.Host, Port: cfg.Port, BlockSize: cfg.BlockSize, NumBlocks: cfg.NumBlocks,
		MaxModelLen: cfg.MaxModelLen, PrefixCaching: cfg.PrefixCaching, SideChannelPort: cfg.SideChannelPort,
		StatsInterval: cfg.StatsInterval, Logger: cfg.Logger, PromptTokensDetails: true, DataParallelSize: cfg.DataParallelSize,
		KVCacheDType: cfg.KVCacheDType, TensorParallelSize: cfg.TensorParallelSize,
		MaxConcurrentRequests: cfg.MaxConcurrentRequests, WriteTimeout: cfg.WriteTimeout, KVEvents: cfg.KVEvents,
	}
	if ic.TensorParallelSize == 0 && cfg.Model != nil {
		ic.TensorParallelSize = cfg.Model.TensorParallelSize()
	}
	if ic.SideChannelPort == 0 {
		ic.SideChannelPort = -1 // a free port, not the default 5600
	}
	if cfg.Role == "" {
		return ic, nil
	}
	kv := connector.DefaultConfig(cfg.Role)
	if cfg.KVTransferConfig != nil {
		var m map[string]any
		if err := json.Unmarshal(cfg.KVTransferConfig, &m); err != nil {
			return ic, fmt.Errorf("stack: engine %s: KVTransferConfig: %w", cfg.Name, err)
		}
		m["kv_role"] = string(cfg.Role)
		data, _ := json.Marshal(m)
		var err error
		if kv, err = connector.ParseConfig(data, nil); err != nil {
			return ic, fmt.Errorf("stack: engine %s: %w", cfg.Name, err)
		}
	}
	if cfg.EngineID != "" {
		kv.EngineID = cfg.EngineID
	}
	if cfg.Policy != "" {
		kv.LoadFailurePolicy = cfg.Policy
	}
	if cfg.Lease > 0 {
		kv.LeaseDuration = cfg.Lease
	}
	if cfg.DecoderTTL > 0 {
		kv.DecoderBlocksTTL = cfg.DecoderTTL
	}
	kv.Bidirectional, kv.Backends, kv.AllowedPeers, kv.AuthToken = cfg.Bidirectional, cfg.Backends, cfg.AllowedPeers, cfg.AuthToken
	ic.KVTransfer = kv
	if cfg.Now != nil || cfg.Tick != nil || cfg.AdvertiseTransfer != "" {
		ic.ConnectorHooks = func(o *connector.Options) {
			if cfg.Now != nil {
				o.Now = cfg.Now
			}
			if cfg.Tick != nil {
				o.Tick = cfg.Tick
			}
			if cfg.AdvertiseTransfer != "" {
				o.Transfer.AdvertiseTCP = cfg.AdvertiseTransfer
			}
		}
	}
	return ic, nil
}

// start starts a new incarnation and points the fault proxies at it. e.mu must be held.
func (e *Engine) start(ctx context.Context) error {
	ic, err := e.cfg.instanceConfig()
	if err != nil {
		return err
	}
	if e.cfg.AdvertiseTransfer != "" {
		// The agent reports the advertised address, so the listener's is chosen here.
		addr, err := freeAddr()
		if err != nil {
			return err
		}
		e.transfer = addr
		publish := ic.ConnectorHooks
		ic.ConnectorHooks = func(o *connector.Options) {
			publish(o)
			o.Transfer.ListenTCP = addr
		}
	}
	in, err := instance.Start(ctx, ic)
	if err != nil && ic.Port != 0 && e.cfg.FallbackToFreePort && errors.Is(err, syscall.EADDRINUSE) {
		ic.Port = 0
		in, err = instance.Start(ctx, ic)
	}
	if err != nil {
		return fmt.Errorf("stack: start %s: %w", e.Name, err)
	}
	e.in = in
	if e.cfg.KeepSideChannelPort && in.Connector != nil {
		e.cfg.SideChannelPort = portOf(in.Connector.SideChannelAddr())
	}
	if e.Faults.HTTP != nil {
		e.Faults.HTTP.SetTarget(in.Addr.String())
	}
	if e.Faults.SideChannel != nil && in.Connector != nil {
		e.Faults.SideChannel.SetTarget(in.Connector.SideChannelAddr())
	}
	if e.Faults.Transfer != nil {
		e.Faults.Transfer.SetTarget(e.transfer)
	}
	return nil
}

// Restart closes the running incarnation and starts a new one with the same configuration and
// engine_id (and side-channel port with KeepSideChannelPort), behind the same fault proxies.
// A start that fails is tried twice more, 100 ms apart (a port just released may linger).
func (e *Engine) Restart(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return fmt.Errorf("stack: restart %s: closed", e.Name)
	}
	if err := e.in.Close(); err != nil {
		return fmt.Errorf("stack: close %s: %w", e.Name, err)
	}
	var err error
	for range 3 {
		if err = e.start(ctx); err == nil {
			return nil
		}
		t := time.NewTimer(100 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return errors.Join(err, ctx.Err())
		case <-t.C:
		}
	}
	return err
}

// Instance returns the running incarnation.
func (e *Engine) Instance() *instance.Instance {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.in
}

// URL returns the engine's own HTTP base URL (not through its fault proxy).
func (e *Engine) URL() string { return e.Instance().URL }

// FrontAddr returns the host:port a P/D proxy should dial: the HTTP fault proxy's when there is
// one, else the engine's own.
func (e *Engine) FrontAddr() string {
	if e.Faults.HTTP != nil {
		return e.Faults.HTTP.Addr()
	}
	return e.Instance().Addr.String()
}

// SideChannelPort returns the port of the running incarnation's side channel (0 without a
// connector).
func (e *Engine) SideChannelPort() int {
	if in := e.Instance(); in.Connector != nil {
		return portOf(in.Connector.SideChannelAddr())
	}
	return 0
}

// TransferAddr returns the transfer listener's address when the engine publishes another one
// (AdvertiseTransfer, FaultTransfer); "" otherwise.
func (e *Engine) TransferAddr() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.transfer
}

// Stats returns a snapshot of the running incarnation (instance.Stats).
func (e *Engine) Stats() (instance.Stats, error) { return e.Instance().Stats() }

// Close stops the engine's fault proxies (cutting whatever they hold, a stalled request
// included) and then the engine (every block returns to its pool). It is idempotent.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	var errs []error
	for _, fp := range e.Faults.all() {
		if fp != nil {
			errs = append(errs, fp.Close())
		}
	}
	if e.in != nil {
		errs = append(errs, e.in.Close())
	}
	return errors.Join(errs...)
}

// freeAddr returns a loopback address whose port was free a moment ago.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// portOf returns the port of host:port (0 when there is none).
func portOf(addr string) int {
	_, p, _ := net.SplitHostPort(addr)
	n, _ := strconv.Atoi(p)
	return n
}
