package pdbench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/kernel"
	"github.com/kvbridge/kvbridge/proxy"
)

// clusterConfig describes the engines a benchmark starts in this process.
type clusterConfig struct {
	model       *model.Model // shared by every engine
	backend     string       // transfer backend of P and D ("SHM", "TCP"); "" = automatic
	single      bool         // also start a single engine without a connector
	blockSize   int
	numBlocks   int
	maxModelLen int
	// proxyTransport carries the proxy's engine legs; wrapped in a tracer when trace is set.
	proxyTransport http.RoundTripper
	trace          bool
	log            *slog.Logger
}

// cluster is a prefiller P, a decoder D and the one-way proxy in front of them, all on
// 127.0.0.1, and optionally a single engine for comparison.
type cluster struct {
	single, p, d *instance.Instance
	proxy        *proxy.OneWay
	proxyURL     string
	tracer       *tracer // nil unless traced

	srv    *http.Server
	served chan error
}

// bigStatsInterval keeps the engines' "KV Transfer metrics" logger from taking the transfer
// samples the benchmark reads (both call TakeInterval).
const bigStatsInterval = 1000 * time.Hour

// startCluster starts the engines and the proxy. On error everything started is stopped.
func startCluster(ctx context.Context, cfg clusterConfig) (_ *cluster, err error) {
	c := &cluster{served: make(chan error, 1)}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	base := instance.Config{
		OpenedModel: cfg.model, Host: "127.0.0.1", BlockSize: cfg.blockSize, NumBlocks: cfg.numBlocks,
		MaxModelLen: cfg.maxModelLen, StatsInterval: bigStatsInterval, Logger: cfg.log, PromptTokensDetails: true,
	}
	if cfg.single {
		if c.single, err = instance.Start(ctx, base); err != nil {
			return nil, fmt.Errorf("pdbench: start the single engine: %w", err)
		}
	}
	role := func(r connector.Role) (instance.Config, error) {
		doc := map[string]any{"kv_connector": "NixlConnector", "kv_role": string(r)}
		if cfg.backend != "" {
			doc["kv_connector_extra_config"] = map[string]any{"backends": []string{strings.ToUpper(cfg.backend)}}
		}
		data, err := json.Marshal(doc)
		if err != nil {
			return instance.Config{}, err
		}
		kv, err := connector.ParseConfig(data, cfg.log)
		if err != nil {
			return instance.Config{}, fmt.Errorf("pdbench: %w", err)
		}
		ic := base
		ic.KVTransfer, ic.SideChannelPort = kv, -1
		return ic, nil
	}
	pc, err := role(connector.RoleProducer)
	if err != nil {
		return nil, err
	}
	if c.p, err = instance.Start(ctx, pc); err != nil {
		return nil, fmt.Errorf("pdbench: start the prefiller: %w", err)
	}
	dc, err := role(connector.RoleConsumer)
	if err != nil {
		return nil, err
	}
	if c.d, err = instance.Start(ctx, dc); err != nil {
		return nil, fmt.Errorf("pdbench: start the decoder: %w", err)
	}
	pi, err := proxy.NewInstance("127.0.0.1", c.p.Addr.Port)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	di, err := proxy.NewInstance("127.0.0.1", c.d.Addr.Port)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	rt := cfg.proxyTransport
	if cfg.trace {
		c.tracer = newTracer(rt, c.p.Addr.String())
		rt = c.tracer
	}
	if c.proxy, err = proxy.NewOneWay(proxy.Config{Prefill: []proxy.Instance{pi}, Decode: []proxy.Instance{di}, Transport: rt, Logger: cfg.log}); err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("pdbench: proxy listener: %w", err)
	}
	c.proxyURL = "http://" + ln.Addr().String()
	c.srv = &http.Server{Handler: c.proxy, ReadHeaderTimeout: 30 * time.Second}
	go func() { c.served <- c.srv.Serve(ln) }()
	return c, nil
}

// client returns the benchmark's HTTP client for this cluster's proxy and single engine.
func (c *cluster) client() *http.Client { return &http.Client{Transport: newTransport(4)} }

// urls returns the single engine's and the proxy's base URLs.
func (c *cluster) urls() (single, proxy string) { return c.single.URL, c.proxyURL }

// engineTTFT returns the single engine's, P's and D's summed engine-side TTFT so far.
func (c *cluster) engineTTFT(context.Context) (single, p, d time.Duration, err error) {
	if single, err = c.single.Registry.TimeToFirstTokenTotal(); err != nil {
		return 0, 0, 0, err
	}
	if p, err = c.p.Registry.TimeToFirstTokenTotal(); err != nil {
		return 0, 0, 0, err
	}
	d, err = c.d.Registry.TimeToFirstTokenTotal()
	return single, p, d, err
}

// takeTransfers returns D's KV reads since the previous call.
func (c *cluster) takeTransfers(context.Context) (transfers, error) {
	iv := c.d.Metrics.Nixl().TakeInterval()
	t := transfers{n: int64(len(iv.Transfers)), failed: int64(iv.FailedTransfers)}
	for _, s := range iv.Transfers {
		t.dur += s.Duration
		t.bytes += s.Bytes
	}
	return t, nil
}

// legs returns the proxy's legs of request id.
func (c *cluster) legs(id string) (legTimes, bool) { return c.tracer.take(id) }

// ceiling is one goroutine's memcpy of n bytes, in GB/s.
func (c *cluster) ceiling(_ context.Context, n int64) (ceilings, error) {
	return ceilings{best: kernel.MemcpyGBps(int(n))}, nil
}

// Close stops the proxy and the engines.
func (c *cluster) Close() error {
	var errs []error
	if c.srv != nil {
		errs = append(errs, stopServer(c.srv, c.served))
		c.srv = nil
	}
	if c.proxy != nil {
		errs = append(errs, c.proxy.Close())
	}
	for _, in := range []*instance.Instance{c.d, c.p, c.single} {
		if in != nil {
			errs = append(errs, in.Close())
		}
	}
	return errors.Join(errs...)
}

// stopServer shuts srv down (waiting up to 10 s for requests in flight) and returns what its
// Serve, which reports on served, returned besides http.ErrServerClosed.
func stopServer(srv *http.Server, served <-chan error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := srv.Shutdown(ctx)
	if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}

// newTransport returns the HTTP transport of a benchmark: keep-alive connections, enough idle
// ones per host for that many concurrent clients, no compression.
func newTransport(clients int) *http.Transport {
	idle := max(2*clients, 64)
	return &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        4 * idle,
		MaxIdleConnsPerHost: idle,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
}
