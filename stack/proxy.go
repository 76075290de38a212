package stack

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/kvbridge/kvbridge/faultproxy"
	"github.com/kvbridge/kvbridge/proxy"
)

// ProxyConfig describes a P/D proxy. Zero values take the defaults noted on each field.
type ProxyConfig struct {
	// Prefill and Decode are the engines' HTTP addresses (host:port), or those of fault proxies
	// in front of them. Start fills them in.
	Prefill, Decode []string
	// MultiTurn selects the multi-turn proxy (conversation cache, bidirectional pulls) instead
	// of the one-way proxy. Start sets it for a bidirectional stack.
	MultiTurn bool
	// CacheTTL is the multi-turn proxy's conversation TTL (default the proxy's).
	CacheTTL time.Duration
	// HeaderTimeout and IdleTimeout bound the engine legs (default proxy.DefaultHeaderTimeout and
	// proxy.DefaultIdleTimeout); WriteTimeout each write to a client (default
	// proxy.DefaultWriteTimeout).
	HeaderTimeout, IdleTimeout, WriteTimeout time.Duration
	// Transport carries the engine legs (default NewTransport(16) with HeaderTimeout as its
	// response header timeout). Close closes its idle connections.
	Transport http.RoundTripper
	// RewritePorts maps side-channel ports to the ports a peer should dial instead (fault
	// proxies in front of side channels): the legs rewrite remote_port in kv_transfer_params.
	// With InterceptLegs the rewriter (Proxy.Legs) is installed even without a mapping, for a
	// test to set one later or to watch the legs leave.
	RewritePorts  map[int]int
	InterceptLegs bool
	// Host is where the proxy listens (default 127.0.0.1); Port its port (0: a free one). With
	// FallbackToFreePort a Port that is taken is replaced by a free one.
	Host               string
	Port               int
	FallbackToFreePort bool
	// TransferMode is the proxy's transfer mode (default proxy.TransferAuto).
	TransferMode proxy.TransferMode
	// Logger receives the proxy's logs; nil discards.
	Logger *slog.Logger
}

// Proxy is a P/D proxy served on a listener of its own.
type Proxy struct {
	// URL is the proxy's base URL (http://host:port).
	URL string
	// Legs rewrites side-channel ports and watches the engine legs (nil unless RewritePorts or
	// InterceptLegs).
	Legs *faultproxy.PortRewriter

	handler interface {
		http.Handler
		Close() error
	}
	transport http.RoundTripper
	srv       *http.Server
	served    chan error
	closeOnce sync.Once
	closeErr  error
}

// StartProxy starts the one-way or multi-turn proxy in front of the engines of cfg.
func StartProxy(cfg ProxyConfig) (*Proxy, error) {
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if cfg.HeaderTimeout <= 0 {
		cfg.HeaderTimeout = proxy.DefaultHeaderTimeout // the transport below enforces it
	}
	if cfg.Transport == nil {
		tr := NewTransport(16)
		tr.ResponseHeaderTimeout = cfg.HeaderTimeout
		cfg.Transport = tr
	}
	p := &Proxy{transport: cfg.Transport, served: make(chan error, 1)}
	legs := cfg.Transport
	if cfg.RewritePorts != nil || cfg.InterceptLegs {
		p.Legs = faultproxy.NewPortRewriter(cfg.Transport, cfg.RewritePorts)
		legs = p.Legs
	}
	pc := proxy.Config{HeaderTimeout: cfg.HeaderTimeout, IdleTimeout: cfg.IdleTimeout, WriteTimeout: cfg.WriteTimeout, Transport: legs, Logger: cfg.Logger, TransferMode: cfg.TransferMode}
	for _, side := range []struct {
		addrs []string
		to    *[]proxy.Instance
	}{{cfg.Prefill, &pc.Prefill}, {cfg.Decode, &pc.Decode}} {
		for _, a := range side.addrs {
			host, port, err := net.SplitHostPort(a)
			if err != nil {
				return nil, fmt.Errorf("stack: engine address %q: %w", a, err)
			}
			n, _ := strconv.Atoi(port)
			in, err := proxy.NewInstance(host, n)
			if err != nil {
				return nil, fmt.Errorf("stack: %w", err)
			}
			*side.to = append(*side.to, in)
		}
	}
	var err error
	if cfg.MultiTurn {
		p.handler, err = proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: pc, CacheTTL: cfg.CacheTTL})
	} else {
		p.handler, err = proxy.NewOneWay(pc)
	}
	if err != nil {
		return nil, fmt.Errorf("stack: %w", err)
	}
	ln, err := listen(cfg.Host, cfg.Port, cfg.FallbackToFreePort)
	if err != nil {
		p.handler.Close()
		return nil, fmt.Errorf("stack: proxy listener: %w", err)
	}
	p.URL = "http://" + ln.Addr().String()
	p.srv = &http.Server{Handler: p.handler, ReadHeaderTimeout: 30 * time.Second}
	go func() { p.served <- p.srv.Serve(ln) }()
	return p, nil
}

// Close stops the proxy: it waits up to 10 s for requests in flight, then cuts what is left.
// It is idempotent.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		errs := []error{p.srv.Shutdown(ctx)}
		cancel()
		if errs[0] != nil {
			errs = append(errs, p.srv.Close())
		}
		if err := <-p.served; !errors.Is(err, http.ErrServerClosed) {
			errs = append(errs, err)
		}
		errs = append(errs, p.handler.Close())
		if t, ok := p.transport.(interface{ CloseIdleConnections() }); ok {
			t.CloseIdleConnections()
		}
		p.closeErr = errors.Join(errs...)
	})
	return p.closeErr
}

// listen listens on host:port, or on a free port of host when port is 0 or, with fallback,
// taken.
func listen(host string, port int, fallback bool) (net.Listener, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil && port != 0 && fallback && errors.Is(err, syscall.EADDRINUSE) {
		ln, err = net.Listen("tcp", net.JoinHostPort(host, "0"))
	}
	return ln, err
}

// NewTransport returns an HTTP transport for the proxy's legs or a benchmark's clients:
// keep-alive connections, idlePerHost of them kept per host (enough for as many concurrent
// clients), no compression.
func NewTransport(idlePerHost int) *http.Transport {
	return &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        4 * idlePerHost,
		MaxIdleConnsPerHost: idlePerHost,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
}
