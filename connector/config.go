// Package connector implements the NixlConnector semantics of kvbridge: the kv_transfer_params
// contract, the side-channel handshake, leases and heartbeats, the load-failure policy and the
// transfer statistics. docs/architecture.md shows where it sits among kvbridge's packages and
// which file holds each item of the wire contract.
//
// Security: kv_transfer_params are untrusted hints. A reader uses pulled blocks only if what
// their owner published beside them (block records and the lease's tag) matches its own prompt
// (verify.go); every read, notification and heartbeat presents the lease's token (lease.go,
// notification.go). With kv_connector_extra_config.auth_token (or KVBRIDGE_KV_AUTH_TOKEN) every
// side-channel and transfer connection is mutually authenticated and params carry their
// issuer's MAC (mac.go); allowed_peers bounds the hosts params may name (peers.go). In push mode
// (NixlPushConnector, push.go) a producer writes only into blocks registered by the engine that
// owns them, over its own authenticated transfer agent, for the same prompt, and a decoder uses
// written KV only after a completion from that producer for its own prompt. Details in
// auth.go; the threat model is in docs/reliability.md.
package connector

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/kvbridge/kvbridge/transfer"
)

// Role is an engine's KV role. With NixlConnector the proxy decides who prefills and who decodes;
// vLLM then ignores the role, but kvbridge refuses a leg the role cannot serve (CheckRole), so
// that a proxy with P and D swapped fails loudly instead of recomputing every prompt.
type Role string

// The accepted roles. RoleBoth is deprecated (vllm#33702) and accepted with a warning.
const (
	RoleProducer Role = "kv_producer"
	RoleConsumer Role = "kv_consumer"
	RoleBoth     Role = "kv_both"
)

// FailurePolicy says what a consumer does when loading remote KV fails.
type FailurePolicy string

// The load-failure policies of kv_load_failure_policy.
const (
	// PolicyFail finishes the request with an error (HTTP 500 for non-streaming clients).
	PolicyFail FailurePolicy = "fail"
	// PolicyRecompute computes the missing tokens locally and answers normally.
	PolicyRecompute FailurePolicy = "recompute"
)

// Config is the parsed --kv-transfer-config. The zero value is "no connector".
type Config struct {
	// Connector is kv_connector: "NixlConnector" or its synonym "NixlPullConnector" (the
	// decoder READs the prefiller's blocks), or "NixlPushConnector" (the decoder registers
	// destination blocks and the prefiller WRITEs into them, push.go). P and D must run the
	// same mode: it is part of the compatibility hash.
	Connector string
	// Role is kv_role.
	Role Role
	// EngineID is engine_id; a UUID when not given.
	EngineID string
	// LoadFailurePolicy is kv_load_failure_policy (default fail).
	LoadFailurePolicy FailurePolicy
	// EnablePermuteLocalKV is enable_permute_local_kv: accept a remote HND layout into a local NHD one.
	EnablePermuteLocalKV bool
	// KVBufferDevice is kv_buffer_device; accepted for compatibility, KV always lives in host memory.
	KVBufferDevice string

	// Backends is kv_connector_extra_config.backends, in order of preference; empty means automatic.
	Backends []string
	// LeaseDuration is kv_lease_duration: how long a prefiller holds finished blocks for the decoder.
	LeaseDuration time.Duration
	// Bidirectional is bidirectional_kv_xfer: D keeps its blocks so that P can pull them next turn.
	Bidirectional bool
	// RecomputeThreshold is kv_recompute_threshold: fewer remote tokens than this are recomputed
	// instead of pulled. Unset (-1) means 64 with bidirectional transfer and 0 without, as in vLLM,
	// so that a one-way prompt shorter than a block is still pulled (conformance item 13).
	RecomputeThreshold int
	// DecoderBlocksTTL is decoder_kv_blocks_ttl: how long D holds a finished turn's blocks.
	DecoderBlocksTTL time.Duration
	// EnforceHandshakeCompat is enforce_handshake_compat: refuse peers whose compatibility hash differs.
	EnforceHandshakeCompat bool
	// EngineTTL is engine_ttl: remote engines idle this long are forgotten.
	EngineTTL time.Duration
	// NumThreads is num_threads; accepted for compatibility (transfer workers size themselves).
	NumThreads int
	// AuthToken is auth_token: a shared secret every side-channel and transfer connection must
	// prove (HMAC-SHA256 challenge-response, both ways). When empty, the environment variable
	// KVBRIDGE_KV_AUTH_TOKEN (EnvAuthToken) is used instead; the config key wins. Every engine
	// of a deployment needs the same token, or none (see auth.go). Never logged.
	AuthToken string
	// AllowedPeers is allowed_peers: the hosts (names, IPs or CIDR prefixes) that
	// kv_transfer_params may name; params naming any other host are refused before any
	// connection. Nil allows every host (see peers.go).
	AllowedPeers []string
	// PushLayerwise is push_layerwise (NixlPushConnector, prefiller): write each layer's KV of a
	// prefill chunk as soon as the layer is computed, to a decoder that registered before the
	// prefill ended (both legs at once), instead of the whole request when it ends.
	PushLayerwise bool
}

// threshold returns the effective kv_recompute_threshold.
func (c *Config) threshold() int {
	switch {
	case c.RecomputeThreshold >= 0:
		return c.RecomputeThreshold
	case c.Bidirectional:
		return 64
	}
	return 0
}

// The accepted kv_connector names.
const (
	ConnectorNixl = "NixlConnector"
	ConnectorPull = "NixlPullConnector" // vLLM's name for the pull connector, a synonym
	ConnectorPush = "NixlPushConnector"
)

// Push reports whether the connector runs in push mode (kv_connector NixlPushConnector).
func (c *Config) Push() bool { return c != nil && c.Connector == ConnectorPush }

// TransferMode is the transfer_mode of this engine's params and compatibility hash: "push" or
// "pull".
func (c *Config) TransferMode() string {
	if c.Push() {
		return "push"
	}
	return "pull"
}

// Enabled reports whether a connector is configured.
func (c *Config) Enabled() bool { return c != nil && c.Connector != "" }

// ParseConfig decodes a --kv-transfer-config JSON document. An unknown key is an error naming the
// nearest known one (a typo must not leave an engine serving without its connector), unless
// KVBRIDGE_ALLOW_UNKNOWN_KV_CONFIG=1 (envAllowUnknownConfig) makes it a warning on log; vLLM's
// keys that kvbridge does not use (kv_buffer_size, kv_rank, kv_ip, …) are warnings on log (when
// non-nil). A value of the wrong type is an error naming the key. Defaults follow the
// seed guide: policy fail, lease 30 s, decoder TTL 480 s, threshold 64 (bidirectional) or 0,
// engine TTL 3600 s.
func ParseConfig(data []byte, log *slog.Logger) (*Config, error) {
	var raw map[string]any
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.UseNumber()
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("%w: not a JSON object: %v", ErrConfig, err)
	}
	if raw == nil {
		return nil, fmt.Errorf("%w: not a JSON object", ErrConfig)
	}
	return configFromMap(raw, log)
}

// The side channel's address when VLLM_NIXL_SIDE_CHANNEL_HOST and VLLM_NIXL_SIDE_CHANNEL_PORT
// are unset, as in vLLM.
const (
	DefaultSideChannelHost = "localhost"
	DefaultSideChannelPort = 5600
)

// DefaultConfig returns the configuration of a NixlConnector of role with every default
// ParseConfig applies and a fresh engine id: what --kv-transfer-config
// '{"kv_connector":"NixlConnector","kv_role":ROLE}' parses to. Callers that build a stack in code
// change its fields instead of writing JSON to parse it back.
func DefaultConfig(role Role) *Config {
	c := defaultConfig()
	c.Connector, c.Role, c.EngineID = "NixlConnector", role, uuid.NewString()
	return c
}

// defaultConfig returns the defaults of every key, with no connector.
func defaultConfig() *Config {
	return &Config{
		LoadFailurePolicy:      PolicyFail,
		LeaseDuration:          30 * time.Second,
		RecomputeThreshold:     -1,
		DecoderBlocksTTL:       480 * time.Second,
		EnforceHandshakeCompat: true,
		EngineTTL:              3600 * time.Second,
	}
}

func configFromMap(raw map[string]any, log *slog.Logger) (*Config, error) {
	c := defaultConfig()
	allow := strings.ToLower(os.Getenv(envAllowUnknownConfig))
	p := fieldParser{log: log, allowUnknown: allow == "1" || allow == "true"}
	for key, v := range raw {
		switch key {
		case "kv_connector":
			c.Connector = p.str(key, v)
		case "kv_role":
			c.Role = Role(p.str(key, v))
		case "engine_id":
			c.EngineID = p.str(key, v)
		case "kv_load_failure_policy":
			c.LoadFailurePolicy = FailurePolicy(p.str(key, v))
		case "enable_permute_local_kv":
			c.EnablePermuteLocalKV = p.boolean(key, v)
		case "kv_buffer_device":
			c.KVBufferDevice = p.str(key, v)
		case "kv_connector_extra_config":
			extra, ok := v.(map[string]any)
			if !ok && v != nil {
				p.fail(key, v, "an object")
				continue
			}
			p.extra(c, extra)
		default:
			if slices.Contains(vllmTopKeys, key) {
				// Accepted vLLM keys with no meaning here.
				if log != nil {
					log.Warn("ignoring a --kv-transfer-config key of vLLM's that kvbridge's NixlConnector does not use", "key", key)
				}
				continue
			}
			p.unknown(key, key, true)
		}
	}
	if p.err != nil {
		return nil, p.err
	}
	return c, c.validate(log)
}

func (p *fieldParser) extra(c *Config, extra map[string]any) {
	for key, v := range extra {
		name := "kv_connector_extra_config." + key
		switch key {
		case "backends":
			c.Backends = p.strings(name, v)
		case "kv_lease_duration":
			c.LeaseDuration = p.seconds(name, v)
		case "bidirectional_kv_xfer":
			c.Bidirectional = p.boolean(name, v)
		case "kv_recompute_threshold":
			c.RecomputeThreshold = p.integer(name, v)
		case "decoder_kv_blocks_ttl":
			c.DecoderBlocksTTL = p.seconds(name, v)
		case "enforce_handshake_compat":
			c.EnforceHandshakeCompat = p.boolean(name, v)
		case "engine_ttl":
			c.EngineTTL = p.seconds(name, v)
		case "num_threads":
			c.NumThreads = p.integer(name, v)
		case "auth_token":
			c.AuthToken = p.str(name, v)
		case "allowed_peers":
			c.AllowedPeers = p.strings(name, v) // an empty list allows no host
		case "push_layerwise":
			c.PushLayerwise = p.boolean(name, v)
		case "enable_cross_layers_blocks":
			// Accepted: kvbridge blocks are always contiguous across layers.
		default:
			p.unknown(key, name, false)
		}
	}
}

func (c *Config) validate(log *slog.Logger) error {
	if c.Connector == "" {
		// As in vLLM, a config without kv_connector configures no connector.
		if log != nil {
			log.Warn("--kv-transfer-config has no kv_connector: KV transfer is off (add \"kv_connector\":\"NixlConnector\" and a kv_role)")
		}
		return nil
	}
	switch c.Connector {
	case ConnectorNixl, ConnectorPull, ConnectorPush:
	default:
		return fmt.Errorf("%w: kv_connector %q is not supported; kvbridge implements \"NixlConnector\" (also spelled \"NixlPullConnector\") and \"NixlPushConnector\"", ErrConfig, c.Connector)
	}
	switch c.Role {
	case RoleProducer, RoleConsumer:
	case RoleBoth:
		if log != nil {
			log.Warn("kv_role=\"kv_both\" is deprecated for NixlConnector; set kv_producer on prefill instances and kv_consumer on decode instances (vllm#33702)")
		}
	case "":
		return fmt.Errorf("%w: kv_role is required (kv_producer or kv_consumer)", ErrConfig)
	default:
		return fmt.Errorf("%w: kv_role %q must be kv_producer, kv_consumer or kv_both", ErrConfig, c.Role)
	}
	switch c.LoadFailurePolicy {
	case PolicyFail, PolicyRecompute:
	default:
		return fmt.Errorf("%w: kv_load_failure_policy %q must be \"fail\" or \"recompute\"", ErrConfig, c.LoadFailurePolicy)
	}
	// The transfer engine owns the list of backends (and knows whether this binary was built
	// with UCX).
	if _, err := transfer.ParseBackends(c.Backends); err != nil {
		detail := err.Error()
		if te, ok := errors.AsType[*transfer.Error](err); ok {
			detail = te.Detail
		}
		return fmt.Errorf("%w: kv_connector_extra_config.backends: %s", ErrConfig, detail)
	}
	if _, err := newPeerFilter(c.AllowedPeers); err != nil {
		return fmt.Errorf("%w: kv_connector_extra_config.allowed_peers: %v", ErrConfig, err)
	}
	if c.LeaseDuration < time.Second {
		return fmt.Errorf("%w: kv_connector_extra_config.kv_lease_duration must be at least 1 second", ErrConfig)
	}
	if c.Push() && c.LeaseDuration < minPushLease {
		return fmt.Errorf("%w: kv_connector_extra_config.kv_lease_duration must be at least %s with NixlPushConnector: a decoder's registered blocks wait that long for the write, and a prefiller posts none within %s of their end",
			ErrConfig, minPushLease, expiryMargin)
	}
	if c.DecoderBlocksTTL <= 0 || c.EngineTTL <= 0 {
		return fmt.Errorf("%w: decoder_kv_blocks_ttl and engine_ttl must be positive", ErrConfig)
	}
	if c.RecomputeThreshold < -1 {
		return fmt.Errorf("%w: kv_connector_extra_config.kv_recompute_threshold must not be negative", ErrConfig)
	}
	if c.EngineID == "" {
		c.EngineID = uuid.NewString()
	}
	return nil
}

// fieldParser converts loosely typed JSON values, remembering the first type error.
type fieldParser struct {
	log          *slog.Logger
	err          error
	allowUnknown bool // envAllowUnknownConfig: unknown keys are warnings
}

func (p *fieldParser) fail(key string, v any, want string) {
	if p.err == nil {
		p.err = fmt.Errorf("%w: %s must be %s, got %s", ErrConfig, key, want, describe(v))
	}
}

// unknown refuses an unknown key (name is its dotted name; top says at which level), naming the
// nearest known one, or only warns with envAllowUnknownConfig.
func (p *fieldParser) unknown(key, name string, top bool) {
	switch {
	case !p.allowUnknown:
		if p.err == nil {
			p.err = unknownKeyError(key, name, top)
		}
	case p.log != nil:
		p.log.Warn("ignoring an unknown --kv-transfer-config key ("+envAllowUnknownConfig+" is set)", "key", clip(name), "hint", unknownKeyHint(key, top))
	}
}

func (p *fieldParser) str(key string, v any) string {
	switch x := v.(type) {
	case string:
		return x
	case nil:
		return ""
	}
	p.fail(key, v, "a string")
	return ""
}

// boolean accepts JSON booleans and the strings "true"/"false" in any case (the seed guide writes
// "enable_permute_local_kv":"True").
func (p *fieldParser) boolean(key string, v any) bool {
	switch x := v.(type) {
	case bool:
		return x
	case string:
		if b, err := strconv.ParseBool(strings.ToLower(x)); err == nil {
			return b
		}
	}
	p.fail(key, v, "a boolean")
	return false
}

func (p *fieldParser) number(key string, v any) (float64, bool) {
	var s string
	switch x := v.(type) {
	case json.Number:
		s = x.String()
	case float64:
		return x, true
	case string:
		s = x
	default:
		p.fail(key, v, "a number")
		return 0, false
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		p.fail(key, v, "a number")
		return 0, false
	}
	return f, true
}

func (p *fieldParser) integer(key string, v any) int {
	f, ok := p.number(key, v)
	if !ok {
		return 0
	}
	if f != math.Trunc(f) || math.Abs(f) > 1<<31 {
		p.fail(key, v, "an integer")
		return 0
	}
	return int(f)
}

func (p *fieldParser) seconds(key string, v any) time.Duration {
	f, ok := p.number(key, v)
	if !ok {
		return 0
	}
	if f < 0 || f > 1e7 {
		p.fail(key, v, "a number of seconds between 0 and 1e7")
		return 0
	}
	return time.Duration(f * float64(time.Second))
}

func (p *fieldParser) strings(key string, v any) []string {
	switch x := v.(type) {
	case []any:
		out := make([]string, 0, len(x))
		for _, e := range x {
			s, ok := e.(string)
			if !ok {
				p.fail(key, v, "a list of strings")
				return nil
			}
			out = append(out, s)
		}
		return out
	case string:
		return []string{x}
	}
	p.fail(key, v, "a list of strings")
	return nil
}

func describe(v any) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case string:
		return fmt.Sprintf("the string %q", x)
	case bool:
		return fmt.Sprintf("the boolean %v", x)
	case json.Number, float64:
		return fmt.Sprintf("the number %v", x)
	case []any:
		return "a list"
	case map[string]any:
		return "an object"
	}
	return fmt.Sprintf("%T", v)
}
