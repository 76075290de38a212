package bidibench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

// Mode is how P and D cooperate across the turns of a conversation.
type Mode string

const (
	// ModeOneWay is plain disaggregated prefill: KV flows from P to D only, through the one-way
	// proxy, and P recomputes the whole history every turn (unless its own prefix cache holds it).
	ModeOneWay Mode = "one-way"
	// ModeBidirectional is bidirectional_kv_xfer on P and D behind the multi-turn proxy: P pulls
	// the conversation's KV from D and computes only the new tokens.
	ModeBidirectional Mode = "bidirectional"
)

// StackConfig describes a P/D stack: a prefiller, a decoder and the proxy of the mode, all in
// this process.
type StackConfig struct {
	// Model is served by both engines; it is shared and not closed by the stack.
	Model *model.Model
	Mode  Mode
	// PrefixCaching turns P's prefix cache on (--enable-prefix-caching); D always caches
	// prefixes, as vLLM's default does, so that it pulls from P only what it lacks.
	PrefixCaching bool
	// Host is where everything listens (default 127.0.0.1).
	Host string
	// ProxyPort, PrefillPort and DecodePort are the HTTP ports; 0 picks free ports. With
	// FallbackToFreePorts a port that is taken is replaced by a free one instead of failing.
	ProxyPort, PrefillPort, DecodePort int
	FallbackToFreePorts                bool
	// BlockSize (default 16), NumBlocks and MaxModelLen size each engine (0 = instance defaults).
	BlockSize, NumBlocks, MaxModelLen int
	// StatsInterval is the period of the engines' "KV Transfer metrics" log line; 0 means never,
	// which leaves the transfer samples to the benchmark (both take them).
	StatsInterval time.Duration
	// Logger receives the engines' and the proxy's logs; nil discards.
	Logger *slog.Logger
}

// Stack is a running prefiller, decoder and proxy.
type Stack struct {
	// P and D are the engines; URL is the proxy's base URL (http://host:port).
	P, D *instance.Instance
	URL  string
	Mode Mode
	// PrefixCaching is whether P caches prefixes.
	PrefixCaching bool

	handler interface {
		http.Handler
		Close() error
	}
	srv    *http.Server
	served chan error

	closeOnce sync.Once
	closeErr  error
}

// neverLog is the stats interval that keeps the engines' logger away from the transfer samples.
const neverLog = 1000 * time.Hour

// StartStack starts P, D and the proxy of cfg.Mode. On error everything started is stopped.
func StartStack(ctx context.Context, cfg StackConfig) (_ *Stack, err error) {
	if cfg.Model == nil {
		return nil, fmt.Errorf("bidibench: %w: no model", instance.ErrConfig)
	}
	if cfg.Mode != ModeOneWay && cfg.Mode != ModeBidirectional {
		return nil, fmt.Errorf("bidibench: %w: mode %q is neither %q nor %q", instance.ErrConfig, cfg.Mode, ModeOneWay, ModeBidirectional)
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.StatsInterval <= 0 {
		cfg.StatsInterval = neverLog
	}
	s := &Stack{Mode: cfg.Mode, PrefixCaching: cfg.PrefixCaching, served: make(chan error, 1)}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if s.P, err = startEngine(ctx, cfg, connector.RoleProducer, cfg.PrefixCaching, cfg.PrefillPort); err != nil {
		return nil, fmt.Errorf("bidibench: start the prefiller: %w", err)
	}
	if s.D, err = startEngine(ctx, cfg, connector.RoleConsumer, true, cfg.DecodePort); err != nil {
		return nil, fmt.Errorf("bidibench: start the decoder: %w", err)
	}
	pi, err := proxy.NewInstance(cfg.Host, s.P.Addr.Port)
	if err != nil {
		return nil, fmt.Errorf("bidibench: %w", err)
	}
	di, err := proxy.NewInstance(cfg.Host, s.D.Addr.Port)
	if err != nil {
		return nil, fmt.Errorf("bidibench: %w", err)
	}
	pcfg := proxy.Config{Prefill: []proxy.Instance{pi}, Decode: []proxy.Instance{di}, Logger: cfg.Logger, Transport: newTransport()}
	if cfg.Mode == ModeBidirectional {
		mt, err := proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: pcfg})
		if err != nil {
			return nil, fmt.Errorf("bidibench: %w", err)
		}
		s.handler = mt
	} else {
		ow, err := proxy.NewOneWay(pcfg)
		if err != nil {
			return nil, fmt.Errorf("bidibench: %w", err)
		}
		s.handler = ow
	}
	ln, err := listen(cfg.Host, cfg.ProxyPort, cfg.FallbackToFreePorts)
	if err != nil {
		return nil, fmt.Errorf("bidibench: proxy listener: %w", err)
	}
	s.URL = "http://" + ln.Addr().String()
	s.srv = &http.Server{Handler: s.handler, ReadHeaderTimeout: 30 * time.Second}
	go func() { s.served <- s.srv.Serve(ln) }()
	return s, nil
}

// startEngine starts one engine of the stack with the connector of role.
func startEngine(ctx context.Context, cfg StackConfig, role connector.Role, prefix bool, port int) (*instance.Instance, error) {
	doc := map[string]any{"kv_connector": "NixlConnector", "kv_role": string(role)}
	if cfg.Mode == ModeBidirectional {
		doc["kv_connector_extra_config"] = map[string]any{"bidirectional_kv_xfer": true}
	}
	data, err := json.Marshal(doc)
	if err != nil {
		return nil, err
	}
	kv, err := connector.ParseConfig(data, cfg.Logger)
	if err != nil {
		return nil, err
	}
	ic := instance.Config{
		OpenedModel: cfg.Model, Host: cfg.Host, Port: port, BlockSize: cfg.BlockSize, NumBlocks: cfg.NumBlocks,
		MaxModelLen: cfg.MaxModelLen, PrefixCaching: prefix, SideChannelPort: -1, KVTransfer: kv,
		StatsInterval: cfg.StatsInterval, Logger: cfg.Logger, PromptTokensDetails: true,
	}
	in, err := instance.Start(ctx, ic)
	if err != nil && port != 0 && cfg.FallbackToFreePorts && errors.Is(err, syscall.EADDRINUSE) {
		ic.Port = 0
		in, err = instance.Start(ctx, ic)
	}
	return in, err
}

// listen listens on host:port, or on a free port when port is 0 or (with fallback) taken.
func listen(host string, port int, fallback bool) (net.Listener, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil && port != 0 && fallback && errors.Is(err, syscall.EADDRINUSE) {
		ln, err = net.Listen("tcp", net.JoinHostPort(host, "0"))
	}
	return ln, err
}

// newTransport returns the HTTP transport of the proxy's legs and of the benchmark's client:
// keep-alive connections, no compression.
func newTransport() *http.Transport {
	return &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
}

// Close stops the proxy, then D, then P (every block returns to its pool). It is idempotent.
func (s *Stack) Close() error {
	s.closeOnce.Do(func() {
		var errs []error
		if s.srv != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			errs = append(errs, s.srv.Shutdown(ctx))
			cancel()
			if err := <-s.served; !errors.Is(err, http.ErrServerClosed) {
				errs = append(errs, err)
			}
		}
		if s.handler != nil {
			errs = append(errs, s.handler.Close())
		}
		for _, in := range []*instance.Instance{s.D, s.P} {
			if in != nil {
				errs = append(errs, in.Close())
			}
		}
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}
