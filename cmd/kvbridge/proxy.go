package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvbridge/kvbridge/proxy"
)

// proxyFlags are the toy proxy's flags (and, later, the multi-turn proxy's).
type proxyFlags struct {
	host                              string
	port                              int
	prefillHosts, decodeHosts         []string
	prefillPorts, decodePorts         []int
	prefillHostAlias, decodeHostAlias []string
	prefillPortAlias, decodePortAlias []int
	headerTimeout, idleTimeout        time.Duration
}

func newProxyCmd() *cobra.Command {
	var f proxyFlags
	cmd := &cobra.Command{
		Use:   "proxy",
		Short: "Route each request to a prefill instance, then to a decode instance (vLLM's toy proxy)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runProxy(cmd.Context(), f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.host, "host", "127.0.0.1", "address to listen on")
	fl.IntVar(&f.port, "port", 8000, "port to listen on (0 picks a free port)")
	fl.StringSliceVar(&f.prefillHosts, "prefiller-hosts", nil, "prefill instance hosts (default localhost)")
	fl.StringSliceVar(&f.prefillHostAlias, "prefiller-host", nil, "alias of --prefiller-hosts")
	fl.IntSliceVar(&f.prefillPorts, "prefiller-ports", nil, "prefill instance ports, one per host (default 8100)")
	fl.IntSliceVar(&f.prefillPortAlias, "prefiller-port", nil, "alias of --prefiller-ports")
	fl.StringSliceVar(&f.decodeHosts, "decoder-hosts", nil, "decode instance hosts (default localhost)")
	fl.StringSliceVar(&f.decodeHostAlias, "decoder-host", nil, "alias of --decoder-hosts")
	fl.IntSliceVar(&f.decodePorts, "decoder-ports", nil, "decode instance ports, one per host (default 8200)")
	fl.IntSliceVar(&f.decodePortAlias, "decoder-port", nil, "alias of --decoder-ports")
	fl.DurationVar(&f.headerTimeout, "header-timeout", 5*time.Minute, "longest wait for an engine's response headers (covers P's prefill)")
	fl.DurationVar(&f.idleTimeout, "idle-timeout", 2*time.Minute, "longest silence of an engine's response stream")
	return cmd
}

func orDefault[T any](a, b []T, def T) []T {
	out := append(append([]T(nil), a...), b...)
	if len(out) == 0 {
		return []T{def}
	}
	return out
}

func runProxy(ctx context.Context, f proxyFlags) error {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	pre, err := proxy.Pairs("prefiller", orDefault(f.prefillHosts, f.prefillHostAlias, "localhost"), orDefault(f.prefillPorts, f.prefillPortAlias, 8100))
	if err != nil {
		return usageError("%v", err)
	}
	dec, err := proxy.Pairs("decoder", orDefault(f.decodeHosts, f.decodeHostAlias, "localhost"), orDefault(f.decodePorts, f.decodePortAlias, 8200))
	if err != nil {
		return usageError("%v", err)
	}
	if f.port < 0 || f.port > 65535 {
		return usageError("--port %d is not a port number", f.port)
	}
	h, err := proxy.NewOneWay(proxy.Config{
		Prefill: pre, Decode: dec, APIKey: os.Getenv("OPENAI_API_KEY"), Logger: log,
		HeaderTimeout: f.headerTimeout, IdleTimeout: f.idleTimeout,
	})
	if err != nil {
		return usageError("%v", err)
	}
	defer h.Close()
	ln, err := net.Listen("tcp", net.JoinHostPort(f.host, strconv.Itoa(f.port)))
	if err != nil {
		return fmt.Errorf("listen on port %d: %w (is another server using it? pick another with --port)", f.port, err)
	}
	log.Info("kvbridge proxy listening", "addr", "http://"+ln.Addr().String(), "prefill", fmt.Sprint(pre), "decode", fmt.Sprint(dec))
	return serveUntilDone(ctx, &http.Server{Handler: h, ReadHeaderTimeout: 30 * time.Second}, ln)
}

// serveUntilDone serves on ln until ctx ends, then shuts the server down gracefully.
func serveUntilDone(ctx context.Context, hs *http.Server, ln net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := hs.Shutdown(shutdown)
	if serr := <-errc; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}
