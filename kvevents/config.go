package kvevents

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// ErrConfig reports an invalid --kv-events-config.
var ErrConfig = errors.New("kvevents: invalid --kv-events-config")

// Defaults of Config, vLLM's KVEventsConfig defaults.
const (
	DefaultEndpoint     = "tcp://*:5557"
	DefaultBufferSteps  = 10_000
	DefaultHWM          = 100_000
	DefaultMaxQueueSize = 100_000
)

// The publishers vLLM's EventPublisherFactory knows.
const (
	PublisherZMQ  = "zmq"
	PublisherNull = "null"
)

// configKeys are vLLM's KVEventsConfig keys, all of which kvbridge implements.
var configKeys = []string{"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
	"buffer_steps", "hwm", "max_queue_size", "topic"}

// Config is --kv-events-config: vLLM's KVEventsConfig.
type Config struct {
	// Enabled is enable_kv_cache_events: record and publish events at all.
	Enabled bool
	// Publisher is "zmq" or "null"; when not given, "zmq" if Enabled, else "null" (vLLM's
	// __post_init__).
	Publisher string
	// Endpoint is the PUB socket's address (default DefaultEndpoint). As in vLLM it is bound
	// when it contains "*" or "::" or is ipc://, and connected to otherwise (a subscriber that
	// binds).
	Endpoint string
	// ReplayEndpoint is the ROUTER socket's address for replay requests, always bound; "" (null)
	// means no replay socket.
	ReplayEndpoint string
	// BufferSteps is how many past batches the replay socket can resend.
	BufferSteps int
	// HWM is the PUB socket's high-water mark: messages queued beyond it are dropped.
	HWM int
	// MaxQueueSize bounds the batches waiting for the publisher's goroutine; beyond it the
	// oldest is dropped (vLLM's bounded queue blocks the engine instead).
	MaxQueueSize int
	// Topic is the first frame of every message; subscribers filter on its prefix.
	Topic string
}

// Active reports whether events are published: enabled with the zmq publisher.
func (c Config) Active() bool { return c.Enabled && c.Publisher == PublisherZMQ }

// ParseConfig parses --kv-events-config, a JSON object with vLLM's KVEventsConfig keys, applying
// vLLM's defaults. An unknown key, a value of the wrong type or out of range, or a publisher
// other than "zmq" and "null" is an error wrapping ErrConfig that names the key.
func ParseConfig(s string) (Config, error) {
	cfg := Config{Endpoint: DefaultEndpoint, BufferSteps: DefaultBufferSteps, HWM: DefaultHWM, MaxQueueSize: DefaultMaxQueueSize}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal([]byte(s), &raw); err != nil || raw == nil {
		if err == nil {
			err = errors.New("not an object")
		}
		return cfg, fmt.Errorf("%w: want a JSON object: %w", ErrConfig, err)
	}
	keys := make([]string, 0, len(raw))
	for k := range raw {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if !slices.Contains(configKeys, k) {
			return cfg, fmt.Errorf("%w: unknown key %s (known keys: %s)", ErrConfig, strconv.QuoteToASCII(clip(k)), strings.Join(configKeys, ", "))
		}
	}
	var replay *string
	fields := []struct {
		key string
		dst any
	}{
		{"enable_kv_cache_events", &cfg.Enabled}, {"publisher", &cfg.Publisher}, {"endpoint", &cfg.Endpoint},
		{"replay_endpoint", &replay}, {"buffer_steps", &cfg.BufferSteps}, {"hwm", &cfg.HWM},
		{"max_queue_size", &cfg.MaxQueueSize}, {"topic", &cfg.Topic},
	}
	for _, f := range fields {
		v, ok := raw[f.key]
		if !ok {
			continue
		}
		if f.key != "replay_endpoint" && bytes.Equal(bytes.TrimSpace(v), []byte("null")) {
			return cfg, fmt.Errorf("%w: %s must not be null", ErrConfig, f.key)
		}
		if err := json.Unmarshal(v, f.dst); err != nil {
			return cfg, fmt.Errorf("%w: %s: %w", ErrConfig, f.key, err)
		}
	}
	if replay != nil {
		cfg.ReplayEndpoint = *replay
	}
	switch cfg.Publisher {
	case "":
		cfg.Publisher = PublisherNull
		if cfg.Enabled {
			cfg.Publisher = PublisherZMQ
		}
	case PublisherZMQ, PublisherNull:
	default:
		return cfg, fmt.Errorf("%w: publisher %s: kvbridge publishes with %q or %q", ErrConfig, strconv.QuoteToASCII(clip(cfg.Publisher)), PublisherZMQ, PublisherNull)
	}
	switch {
	case cfg.BufferSteps < 0:
		return cfg, fmt.Errorf("%w: buffer_steps %d is negative", ErrConfig, cfg.BufferSteps)
	case cfg.HWM < 0:
		return cfg, fmt.Errorf("%w: hwm %d is negative", ErrConfig, cfg.HWM)
	case cfg.MaxQueueSize <= 0:
		return cfg, fmt.Errorf("%w: max_queue_size %d: must be positive (the queue is bounded)", ErrConfig, cfg.MaxQueueSize)
	}
	if cfg.Active() {
		if _, err := splitEndpoint(cfg.Endpoint); err != nil {
			return cfg, fmt.Errorf("%w: endpoint: %w", ErrConfig, err)
		}
		if cfg.ReplayEndpoint != "" {
			if _, err := splitEndpoint(cfg.ReplayEndpoint); err != nil {
				return cfg, fmt.Errorf("%w: replay_endpoint: %w", ErrConfig, err)
			}
		}
	}
	return cfg, nil
}

// ForRank returns the configuration of data-parallel rank rank: as vLLM's
// offset_endpoint_port, the port of a tcp endpoint is raised by rank and an ipc endpoint gets
// the suffix "_dp<rank>". Port 0 (a free port, for tests) stays 0.
func (c Config) ForRank(rank int) Config {
	c.Endpoint = offsetEndpoint(c.Endpoint, rank)
	c.ReplayEndpoint = offsetEndpoint(c.ReplayEndpoint, rank)
	return c
}

// offsetEndpoint is vLLM's ZmqEventPublisher.offset_endpoint_port for a valid endpoint.
func offsetEndpoint(ep string, rank int) string {
	if ep == "" || rank == 0 {
		return ep
	}
	if strings.HasPrefix(ep, "ipc://") {
		return fmt.Sprintf("%s_dp%d", ep, rank)
	}
	i := strings.LastIndexByte(ep, ':')
	port, err := strconv.Atoi(ep[i+1:])
	if err != nil || port == 0 {
		return ep
	}
	return ep[:i+1] + strconv.Itoa(port+rank)
}

// endpoint is a parsed ZeroMQ endpoint.
type endpoint struct {
	network string // "tcp" or "unix"
	addr    string // host:port (host "" for "*") or a socket path
	bind    bool   // vLLM's heuristic: bind rather than connect
}

// splitEndpoint parses tcp://host:port (host "*" for every interface) or ipc://path.
func splitEndpoint(ep string) (endpoint, error) {
	switch {
	case strings.HasPrefix(ep, "tcp://"):
		host, port, err := splitHostPort(strings.TrimPrefix(ep, "tcp://"))
		if err != nil {
			return endpoint{}, fmt.Errorf("%s: %w", strconv.QuoteToASCII(clip(ep)), err)
		}
		bind := strings.Contains(ep, "*") || strings.Contains(ep, "::")
		if host == "*" {
			host = ""
		}
		return endpoint{network: "tcp", addr: joinHostPort(host, port), bind: bind}, nil
	case strings.HasPrefix(ep, "ipc://") && len(ep) > len("ipc://"):
		return endpoint{network: "unix", addr: strings.TrimPrefix(ep, "ipc://"), bind: true}, nil
	}
	return endpoint{}, fmt.Errorf("%s: want tcp://host:port or ipc://path", strconv.QuoteToASCII(clip(ep)))
}

// splitHostPort splits host:port and checks the port.
func splitHostPort(s string) (host string, port int, err error) {
	i := strings.LastIndexByte(s, ':')
	if i < 0 {
		return "", 0, errors.New("no port")
	}
	host = strings.TrimSuffix(strings.TrimPrefix(s[:i], "["), "]")
	port, err = strconv.Atoi(s[i+1:])
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("bad port %s", strconv.QuoteToASCII(clip(s[i+1:])))
	}
	return host, port, nil
}

// joinHostPort is net.JoinHostPort for an int port.
func joinHostPort(host string, port int) string {
	if strings.Contains(host, ":") {
		return "[" + host + "]:" + strconv.Itoa(port)
	}
	return host + ":" + strconv.Itoa(port)
}

// clip shortens untrusted text quoted in an error.
func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}
