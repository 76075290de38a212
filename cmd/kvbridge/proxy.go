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

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/proxy"
)

// envStoreKey is --conversation-store-key's environment variable.
const envStoreKey = "KVBRIDGE_CONVERSATION_STORE_KEY"

// proxyFlags are the flags of vLLM's toy proxy and multi-turn proxy.
type proxyFlags struct {
	multiTurn, requireConversationID  bool
	cacheTTL                          time.Duration
	maxConversations                  int
	maxConversationBytes              string
	conversationStore                 string
	conversationStoreKey              string
	host                              string
	port                              int
	prefillHosts, decodeHosts         []string
	prefillPorts, decodePorts         []int
	prefillHostAlias, decodeHostAlias []string
	prefillPortAlias, decodePortAlias []int
	headerTimeout, idleTimeout        time.Duration
	log                               logFlags
	writeTimeout                      time.Duration
	transferMode                      string
	routing                           string
	kvEvents, kvEventsReplay          []string
	kvEventsDP                        int
	kvEventsTopic, hashAlgo           string
}

func newProxyCmd() *cobra.Command {
	var f proxyFlags
	cmd := &cobra.Command{
		Use:   "proxy",
		Short: "Route each request to a prefill instance, then to a decode instance (vLLM's toy proxy; --multi-turn: the stateful multi-turn proxy)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runProxy(cmd.Context(), f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.host, "host", "", "address to listen on (default: all interfaces, as kvbridge serve's and vLLM's)")
	fl.IntVar(&f.port, "port", 8000, "port to listen on (0 picks a free port)")
	fl.StringSliceVar(&f.prefillHosts, "prefiller-hosts", nil, "prefill instance hosts (default localhost)")
	fl.StringSliceVar(&f.prefillHostAlias, "prefiller-host", nil, "alias of --prefiller-hosts")
	fl.IntSliceVar(&f.prefillPorts, "prefiller-ports", nil, "prefill instance ports, one per host (default 8100)")
	fl.IntSliceVar(&f.prefillPortAlias, "prefiller-port", nil, "alias of --prefiller-ports")
	fl.StringSliceVar(&f.decodeHosts, "decoder-hosts", nil, "decode instance hosts (default localhost)")
	fl.StringSliceVar(&f.decodeHostAlias, "decoder-host", nil, "alias of --decoder-hosts")
	fl.IntSliceVar(&f.decodePorts, "decoder-ports", nil, "decode instance ports, one per host (default 8200)")
	fl.IntSliceVar(&f.decodePortAlias, "decoder-port", nil, "alias of --decoder-ports")
	fl.DurationVar(&f.headerTimeout, "header-timeout", proxy.DefaultHeaderTimeout, "longest wait for an engine's response headers (covers P's prefill)")
	fl.DurationVar(&f.idleTimeout, "idle-timeout", proxy.DefaultIdleTimeout, "longest silence of an engine's response stream")
	fl.DurationVar(&f.writeTimeout, "write-timeout", proxy.DefaultWriteTimeout, "longest a write of a response may wait for the client to read; a client that stalls longer has its request cancelled on both engines")
	fl.StringVar(&f.transferMode, "transfer-mode", string(proxy.TransferAuto), "how P's KV reaches D: auto (push where P's GET /v1/kv_transfer says transfer_mode push, pull elsewhere), pull, push (both legs at once; D registers, P writes), or push-serial (vLLM's toy push proxy: P's leg, then D's); with --multi-turn only turns that pull nothing from D push")
	fl.BoolVar(&f.multiTurn, "multi-turn", false, "cache D's kv_transfer_params per conversation_id so that P pulls earlier turns' KV from D (bidirectional transfer)")
	fl.BoolVar(&f.requireConversationID, "require-conversation-id", false, "with --multi-turn: answer 400 to requests without a conversation_id")
	fl.DurationVar(&f.cacheTTL, "conversation-ttl", proxy.DefaultConversationTTL, "with --multi-turn: how long a conversation's cached params stay usable (keep it below decoder_kv_blocks_ttl)")
	fl.IntVar(&f.maxConversations, "max-conversations", proxy.DefaultMaxConversations, "with --multi-turn: most conversations cached (least recently used dropped first)")
	fl.StringVar(&f.maxConversationBytes, "max-conversation-bytes", formatBytes(proxy.DefaultMaxConversationBytes), "with --multi-turn and the memory store: most bytes of cached conversations (least recently used dropped first), e.g. 64M")
	fl.StringVar(&f.conversationStore, "conversation-store", "memory", "with --multi-turn: where conversations are kept between turns: memory, or redis://HOST:PORT/DB shared by the replicas of a proxy tier")
	fl.StringVar(&f.conversationStoreKey, "conversation-store-key", "", "with --multi-turn: the secret D's kv_transfer_params are sealed under in the conversation store, the same on every replica (default: env "+envStoreKey+", else "+connector.EnvAuthToken+"; required with Redis; the memory store otherwise uses a random key)")
	fl.StringVar(&f.routing, "routing", "", "how prefillers and decoders are chosen: round-robin, least-loaded, or kv-aware (P by the longest prefix of the prompt it caches, weighted by load; D by load) (default kv-aware with --kv-events, else round-robin)")
	fl.StringSliceVar(&f.kvEvents, "kv-events", nil, "the prefillers' KV cache event endpoints (their --kv-events-config endpoint, e.g. tcp://HOST:5557), one per prefiller in the order of --prefiller-hosts")
	fl.StringSliceVar(&f.kvEventsReplay, "kv-events-replay", nil, "with --kv-events: the prefillers' replay endpoints (their replay_endpoint), one per prefiller, to fill sequence gaps; without, a gap marks the engine's index stale")
	fl.IntVar(&f.kvEventsDP, "kv-events-dp", 1, "with --kv-events: data-parallel ranks per prefiller; rank r publishes on the endpoint's port + r")
	fl.StringVar(&f.kvEventsTopic, "kv-events-topic", "", "with --kv-events: the engines' event topic")
	fl.StringVar(&f.hashAlgo, "prefix-caching-hash-algo", proxy.DefaultPrefixHashAlgo, "with --kv-events: the engines' --prefix-caching-hash-algo (sha256 or sha256_cbor); the engines and the proxy must share PYTHONHASHSEED too")
	f.log.register(fl)
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
	log, err := f.log.logger(os.Stderr)
	if err != nil {
		return err
	}
	routeRedisLogs(log)
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
	if f.writeTimeout <= 0 {
		return usageError("--write-timeout %v must be positive", f.writeTimeout)
	}
	if !f.multiTurn && f.requireConversationID {
		return usageError("--require-conversation-id needs --multi-turn")
	}
	if !f.multiTurn && f.conversationStore != "memory" {
		return usageError("--conversation-store needs --multi-turn")
	}
	if !f.multiTurn && f.conversationStoreKey != "" {
		return usageError("--conversation-store-key needs --multi-turn")
	}
	mode, err := proxy.ParseTransferMode(f.transferMode)
	if err != nil {
		return usageError("--transfer-mode: %v", err)
	}
	storeKey := f.conversationStoreKey
	for _, env := range []string{envStoreKey, connector.EnvAuthToken} {
		if storeKey == "" {
			storeKey = os.Getenv(env)
		}
	}
	maxBytes, err := parseBytes(f.maxConversationBytes)
	if err != nil {
		return usageError("--max-conversation-bytes: %v", err)
	}
	routing, err := f.routingConfig(len(pre))
	if err != nil {
		return err
	}
	cfg := proxy.Config{
		Prefill: pre, Decode: dec, APIKey: os.Getenv("OPENAI_API_KEY"), Logger: log,
		HeaderTimeout: f.headerTimeout, IdleTimeout: f.idleTimeout, WriteTimeout: f.writeTimeout, TransferMode: mode,
		Routing: routing,
	}
	var h interface {
		http.Handler
		Close() error
	}
	if f.multiTurn {
		h, err = proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: cfg, CacheTTL: f.cacheTTL, MaxConversations: f.maxConversations,
			MaxConversationBytes: maxBytes, RequireConversationID: f.requireConversationID, Store: f.conversationStore, StoreKey: storeKey})
	} else {
		h, err = proxy.NewOneWay(cfg)
	}
	if err != nil {
		return usageError("%v", err)
	}
	defer h.Close()
	ln, err := net.Listen("tcp", net.JoinHostPort(f.host, strconv.Itoa(f.port)))
	if err != nil {
		return fmt.Errorf("listen on port %d: %w (is another server using it? pick another with --port)", f.port, err)
	}
	bound := ln.Addr().(*net.TCPAddr)
	log.Info("kvbridge proxy listening", "addr", bound.String(), "url", instance.LocalURL(bound), "multi_turn", f.multiTurn, "transfer_mode", string(mode), "prefill", fmt.Sprint(pre), "decode", fmt.Sprint(dec))
	return serveUntilDone(ctx, log, &http.Server{Handler: h, ReadHeaderTimeout: 30 * time.Second}, ln, h.Close)
}

// serveUntilDone serves on ln until ctx ends, then shuts the server down gracefully (at most
// 10 s for the requests in flight) and calls closeAfter, logging the shutdown.
func serveUntilDone(ctx context.Context, log *slog.Logger, hs *http.Server, ln net.Listener, closeAfter func() error) error {
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	return logShutdown(ctx, log, "kvbridge proxy", func() error {
		shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err := hs.Shutdown(shutdown)
		if serr := <-errc; !errors.Is(serr, http.ErrServerClosed) && err == nil {
			err = serr
		}
		return errors.Join(err, closeAfter())
	})
}

// routingConfig checks the routing flags for n prefillers; PYTHONHASHSEED comes from the
// environment, as the engines read it.
func (f proxyFlags) routingConfig(n int) (proxy.RoutingConfig, error) {
	rc := proxy.RoutingConfig{Policy: f.routing, KVEvents: f.kvEvents, KVEventsReplay: f.kvEventsReplay, KVEventsDP: f.kvEventsDP,
		KVEventsTopic: f.kvEventsTopic, HashAlgo: f.hashAlgo}
	rc.HashSeed, rc.HashSeeded = os.LookupEnv("PYTHONHASHSEED")
	if f.routing != "" {
		if _, err := proxy.ParsePolicy(f.routing); err != nil {
			return rc, usageError("--routing: %v", err)
		}
	}
	switch {
	case f.routing == proxy.KVAware && len(f.kvEvents) == 0:
		return rc, usageError("--routing kv-aware needs --kv-events (one endpoint per prefiller)")
	case len(f.kvEvents) > 0 && len(f.kvEvents) != n:
		return rc, usageError("--kv-events: %d endpoints for %d prefillers: give one per prefiller, in the order of --prefiller-hosts", len(f.kvEvents), n)
	case len(f.kvEventsReplay) > 0 && len(f.kvEventsReplay) != len(f.kvEvents):
		return rc, usageError("--kv-events-replay: %d endpoints for %d --kv-events: give one per prefiller", len(f.kvEventsReplay), len(f.kvEvents))
	case f.kvEventsDP < 1:
		return rc, usageError("--kv-events-dp %d: want 1 or more", f.kvEventsDP)
	}
	return rc, nil // the endpoints and the hash algorithm are checked by the proxy's constructor
}
