// Package stack runs kvbridge's disaggregated serving in one process, on loopback: a prefiller P
// and a decoder D (each an instance with a NixlConnector), the one-way or the multi-turn proxy in
// front of them, optionally a single engine without a connector (the reference whose answers
// P/D must equal), and, where asked, fault proxies in an engine's paths (HTTP, side channel,
// transfer). The benchmarks, the demo, the soak and the fault suite assemble their stacks here:
// Start and Config for the usual whole, StartEngine and StartProxy for the parts.
//
// Engines are read through instance.Stats (Engine.Stats), never by reaching into their pools
// and engines. See docs/architecture.md for where the package sits.
package stack

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
)

// Mode is how P and D cooperate across the turns of a conversation.
type Mode string

const (
	// OneWay is plain disaggregated prefill: KV flows from P to D only, through the one-way
	// proxy, and P recomputes a conversation's history every turn (unless its own prefix cache
	// holds it).
	OneWay Mode = "one-way"
	// Bidirectional is bidirectional_kv_xfer on P and D behind the multi-turn proxy: P pulls the
	// conversation's KV from D and computes only the new tokens.
	Bidirectional Mode = "bidirectional"
)

// Config describes a stack. Settings given once here apply to both engines, unless the
// engine's own config (P, D) sets them.
type Config struct {
	// Model is served by every engine; it is shared, never closed by the stack. Required unless
	// every engine's config names a model of its own.
	Model *model.Model
	// Mode is one-way (the default) or bidirectional. MultiTurnProxy puts the multi-turn proxy
	// in front of a one-way stack too.
	Mode           Mode
	MultiTurnProxy bool
	// Policy is kv_load_failure_policy (default fail); Backend restricts the transfers to "SHM"
	// or "TCP" (default automatic); Lease and DecoderTTL are kv_lease_duration and
	// decoder_kv_blocks_ttl (defaults the connector's).
	Policy     connector.FailurePolicy
	Backend    string
	Lease      time.Duration
	DecoderTTL time.Duration
	// BlockSize, NumBlocks and MaxModelLen size every engine (defaults the instance's).
	BlockSize, NumBlocks, MaxModelLen int
	// Host is where everything listens (default 127.0.0.1). With FallbackToFreePorts a port
	// that is taken (P.Port, D.Port, Proxy.Port) is replaced by a free one.
	Host                string
	FallbackToFreePorts bool
	// P and D are the engines' own settings (prefix caching, engine id, ports, fault proxies,
	// clocks, …). Start sets their roles, and their names to "P" and "D" when empty.
	P, D EngineConfig
	// Single also starts a single engine without a connector (prefix caching off), sized like
	// the others: the reference.
	Single bool
	// Proxy is the proxy's own settings (port, timeouts, transport, …); Start fills in the
	// engines, the kind and the side-channel ports to rewrite.
	Proxy ProxyConfig
	// StatsInterval is the period of the engines' "KV Transfer metrics" log line (default the
	// instance's).
	StatsInterval time.Duration
	// Logger receives every log line, each engine's marked with engine=NAME; nil discards.
	Logger *slog.Logger
}

// Stack is a running P, D, proxy and, with Config.Single, single engine.
type Stack struct {
	// P and D are the engines; Single is the reference engine (nil unless Config.Single).
	P, D, Single *Engine
	// Proxy is the P/D proxy; URL its base URL.
	Proxy *Proxy
	URL   string
	// Mode is the stack's mode; PrefixCaching whether P caches prefixes.
	Mode          Mode
	PrefixCaching bool

	mu        sync.Mutex // serializes restarts
	closeOnce sync.Once
	closeErr  error
}

// Start starts P, D, the single engine if asked and the proxy. On error everything started is
// stopped.
func Start(ctx context.Context, cfg Config) (_ *Stack, err error) {
	switch cfg.Mode {
	case "":
		cfg.Mode = OneWay
	case OneWay, Bidirectional:
	default:
		return nil, fmt.Errorf("stack: %w: mode %q is neither %q nor %q", instance.ErrConfig, cfg.Mode, OneWay, Bidirectional)
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Stack{Mode: cfg.Mode, PrefixCaching: cfg.P.PrefixCaching}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if cfg.Single {
		if s.Single, err = StartEngine(ctx, cfg.engine(EngineConfig{Name: "single"}, "")); err != nil {
			return nil, err
		}
	}
	if s.P, err = StartEngine(ctx, cfg.engine(cfg.P, connector.RoleProducer)); err != nil {
		return nil, err
	}
	if s.D, err = StartEngine(ctx, cfg.engine(cfg.D, connector.RoleConsumer)); err != nil {
		return nil, err
	}
	pc := cfg.Proxy
	pc.Prefill, pc.Decode = []string{s.P.FrontAddr()}, []string{s.D.FrontAddr()}
	pc.MultiTurn = pc.MultiTurn || cfg.MultiTurnProxy || cfg.Mode == Bidirectional
	pc.RewritePorts = s.rewrites()
	if pc.Host == "" {
		pc.Host = cfg.Host
	}
	pc.FallbackToFreePort = pc.FallbackToFreePort || cfg.FallbackToFreePorts
	if pc.Logger == nil {
		pc.Logger = cfg.Logger.With("component", "proxy")
	}
	if s.Proxy, err = StartProxy(pc); err != nil {
		return nil, err
	}
	s.URL = s.Proxy.URL
	return s, nil
}

// engine completes an engine's config with the stack's settings.
func (cfg Config) engine(e EngineConfig, role connector.Role) EngineConfig {
	e.Role = role
	if e.Name == "" {
		e.Name = map[connector.Role]string{connector.RoleProducer: "P", connector.RoleConsumer: "D"}[role]
	}
	if e.Model == nil {
		e.Model = cfg.Model
	}
	e.Bidirectional = e.Bidirectional || (role != "" && cfg.Mode == Bidirectional)
	if e.Policy == "" {
		e.Policy = cfg.Policy
	}
	if e.Backends == nil && cfg.Backend != "" {
		e.Backends = []string{cfg.Backend}
	}
	e.Lease = cmp.Or(e.Lease, cfg.Lease)
	e.DecoderTTL = cmp.Or(e.DecoderTTL, cfg.DecoderTTL)
	e.BlockSize = cmp.Or(e.BlockSize, cfg.BlockSize)
	e.NumBlocks = cmp.Or(e.NumBlocks, cfg.NumBlocks)
	e.MaxModelLen = cmp.Or(e.MaxModelLen, cfg.MaxModelLen)
	e.StatsInterval = cmp.Or(e.StatsInterval, cfg.StatsInterval)
	if e.Host == "" {
		e.Host = cfg.Host
	}
	e.FallbackToFreePort = e.FallbackToFreePort || cfg.FallbackToFreePorts
	if e.Logger == nil {
		e.Logger = cfg.Logger.With("engine_name", e.Name)
	}
	return e
}

// rewrites maps each engine's side-channel port to its fault proxy's, for the engines with one;
// nil when none has.
func (s *Stack) rewrites() map[int]int {
	var m map[int]int
	for _, e := range []*Engine{s.P, s.D} {
		if e.Faults.SideChannel != nil {
			if m == nil {
				m = map[int]int{}
			}
			m[e.SideChannelPort()] = e.Faults.SideChannel.Port()
		}
	}
	return m
}

// Restart restarts one of the stack's engines (Engine.Restart) and points the proxy's port
// rewriting at its new side channel.
func (s *Stack) Restart(ctx context.Context, e *Engine) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := e.Restart(ctx); err != nil {
		return err
	}
	if m := s.rewrites(); m != nil && s.Proxy.Legs != nil {
		s.Proxy.Legs.SetPorts(maps.Clone(m))
	}
	return nil
}

// Engines returns the stack's engines: P, D and the single engine when there is one.
func (s *Stack) Engines() []*Engine {
	out := []*Engine{s.P, s.D}
	if s.Single != nil {
		out = append(out, s.Single)
	}
	return out
}

// Close stops the proxy, then D, P and the single engine (every block returns to its pool) and
// the fault proxies. It is idempotent.
func (s *Stack) Close() error {
	s.closeOnce.Do(func() {
		var errs []error
		if s.Proxy != nil {
			errs = append(errs, s.Proxy.Close())
		}
		for _, e := range []*Engine{s.D, s.P, s.Single} {
			if e != nil {
				errs = append(errs, e.Close())
			}
		}
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// CheckPools returns an error naming every engine whose KV pool is not full: after Close, a
// block not returned is a leak.
func (s *Stack) CheckPools() error {
	var errs []error
	for _, e := range s.Engines() {
		st, err := e.Stats()
		if err != nil {
			errs = append(errs, err)
		} else if st.FreeBlocks != st.NumBlocks {
			errs = append(errs, fmt.Errorf("stack: %s %s leaked KV blocks: %d of %d free", s.Mode, e.Name, st.FreeBlocks, st.NumBlocks))
		}
	}
	return errors.Join(errs...)
}
