package connector

import (
	"bufio"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbridge/kvbridge/transfer"
)

// Authentication and read authorization of the KV paths (issue 7, scope item 3).
//
// With an auth token every side-channel connection (see sidechannel.go) and every transfer
// connection (transfer.Config.Auth, an HMAC-SHA256 challenge-response run by the transfer
// agent on TCP and Unix connections alike) must prove knowledge of the token, mutually, on
// fresh nonces. The token comes from kv_connector_extra_config.auth_token or, when that key is
// absent or empty, from the environment variable KVBRIDGE_KV_AUTH_TOKEN. Every engine of a
// deployment must use the same token, or none: a mismatch is refused at once on both sides,
// with an error naming the setting.
//
// With or without a token, a peer reads only what is leased: every finished request whose
// blocks are held for a reader gets a fresh 128-bit lease token (lease.go), carried in the
// kv_transfer_params. Every TCP READ presents it (transfer.RequestOptions.Tag), and the transfer
// agent asks the connector (transfer.Config.AuthorizeRead) whether every requested range lies
// inside the blocks leased under that token, their records or the lease's slot; anything else
// is refused (transfer.ErrPermission at the reader) and counted here. Completion notifications
// and heartbeats present the token too (notification.go).
//
// SHM readers map the KV arena, so the owner cannot check each read. Instead the owner
// publishes, beside the blocks, what a reader needs to check for itself: each block's record
// (generation, token count and content hash, kvcache.Record) and, in the lease's slot, a tag
// derived from the token and the lease's blocks (kvlease.Tag). A reader accepts the blocks it read
// only if the slot, read after them, holds the tag of the params it was given and every block's
// record matches its own prompt's hash chain (verify.go) — on every backend. The transfer
// agent offers SHM only to processes of the same user id on the same host (SO_PEERCRED on its
// Unix socket, after authentication), which could read each other's memory anyway (ptrace,
// /proc/PID/mem); deployments that need confidentiality between such processes restrict
// kv_connector_extra_config.backends to ["TCP"].

// EnvAuthToken is the environment variable read for the auth token when
// kv_connector_extra_config.auth_token is absent or empty.
const EnvAuthToken = "KVBRIDGE_KV_AUTH_TOKEN"

// errServerProof marks a refusal by this side of a side-channel server's proof.
var errServerProof = errors.New("side channel server proof rejected")

// Side-channel authentication message tags and refusal codes.
const (
	authHelloTag     = "kvbridge_auth_hello"
	authChallengeTag = "kvbridge_auth_challenge"
	authProofTag     = "kvbridge_auth_proof"

	codeAuthRequired   = "auth_required"
	codeAuthUnexpected = "auth_unexpected"
	codeAuthFailed     = "auth_failed"
	codeServerProof    = "server_proof" // local only: never on the wire

	sideNonceBytes = 32
	sideAuthCtx    = "kvbridge side channel auth v1"
	sideClient     = "client"
	sideServer     = "server"
)

// resolveAuthToken returns the auth token and where it came from ("" when none): the config
// key wins over the environment.
func resolveAuthToken(cfg *Config, getenv func(string) string) (token, source string) {
	if cfg.AuthToken != "" {
		return cfg.AuthToken, "kv_connector_extra_config.auth_token"
	}
	if getenv != nil {
		if v := getenv(EnvAuthToken); v != "" {
			return v, EnvAuthToken
		}
	}
	return "", ""
}

// sideAuth computes side-channel proofs from the auth token.
type sideAuth struct {
	key []byte
}

// newSideAuth returns the proofs of token, or nil for no token.
func newSideAuth(token string) *sideAuth {
	if token == "" {
		return nil
	}
	return &sideAuth{key: []byte(token)}
}

// proof is HMAC-SHA256(token, context ‖ side ‖ client nonce ‖ server nonce); every part but
// the last is length-prefixed.
func (a *sideAuth) proof(side string, clientNonce, serverNonce []byte) []byte {
	m := hmac.New(sha256.New, a.key)
	for _, part := range [][]byte{[]byte(sideAuthCtx), []byte(side), clientNonce, serverNonce} {
		m.Write([]byte{byte(len(part))})
		m.Write(part)
	}
	return m.Sum(nil)
}

// newNonce draws a fresh nonce.
func newNonce() ([]byte, error) {
	b := make([]byte, sideNonceBytes)
	_, err := rand.Read(b)
	return b, err
}

// isAuthCode reports whether a refusal code is about authentication.
func isAuthCode(code string) bool {
	switch code {
	case codeAuthRequired, codeAuthUnexpected, codeAuthFailed:
		return true
	}
	return false
}

// authError is a side-channel authentication failure seen by the client; its message names
// the setting to fix. It matches ErrAuth (and errServerProof when this side refused).
type authError struct {
	addr   string
	code   string
	detail string
}

// Error names the side channel and the setting to fix.
func (e *authError) Error() string {
	switch e.code {
	case codeAuthRequired:
		return fmt.Sprintf("side channel at %s requires authentication: set kv_connector_extra_config.auth_token (or %s) to the token of the engines there", e.addr, EnvAuthToken)
	case codeAuthUnexpected:
		return fmt.Sprintf("side channel at %s has no auth_token configured but this engine has one: configure the same kv_connector_extra_config.auth_token (or %s) on every engine, or on none", e.addr, EnvAuthToken)
	case codeAuthFailed:
		return fmt.Sprintf("side channel at %s refused this engine's kv_connector_extra_config.auth_token: the tokens differ (%s)", e.addr, e.detail)
	case codeServerProof:
		return fmt.Sprintf("side channel at %s failed to prove this engine's kv_connector_extra_config.auth_token: the tokens differ (or it is not the engine it claims)", e.addr)
	}
	return fmt.Sprintf("side channel at %s refused authentication: %s", e.addr, e.detail)
}

// Is matches ErrAuth, and errServerProof for a refusal by this side.
func (e *authError) Is(target error) bool {
	return target == ErrAuth || (target == errServerProof && e.code == codeServerProof)
}

// authenticateClient runs the client's part of the side-channel authentication on c (reading
// through r). It returns an error matching errServerProof, after sending its own proof, when
// the server's proof does not match: the caller then reads the server's verdict before
// reporting, so that both sides have decided.
func authenticateClient(c net.Conn, r *bufio.Reader, auth *sideAuth) error {
	clientNonce, err := newNonce()
	if err != nil {
		return err
	}
	if err := writeFrame(c, []any{[]byte(authHelloTag), clientNonce}); err != nil {
		return err
	}
	body, err := readFrame(r)
	if err != nil {
		return err
	}
	tag, parts, err := decodeTagged(body)
	if err != nil || tag != authChallengeTag {
		if _, _, rerr := decodeResponse(body); rerr != nil {
			return rerr // a refusal (auth_unexpected) or garbage
		}
		return &authError{code: codeAuthUnexpected, detail: "the server answered without authenticating"}
	}
	var serverNonce, serverProof []byte
	if len(parts) != 2 || msgpack.Unmarshal(parts[0], &serverNonce) != nil || msgpack.Unmarshal(parts[1], &serverProof) != nil || len(serverNonce) != sideNonceBytes {
		return errors.New("malformed authentication challenge")
	}
	if err := writeFrame(c, []any{[]byte(authProofTag), auth.proof(sideClient, clientNonce, serverNonce)}); err != nil {
		return err
	}
	if !hmac.Equal(serverProof, auth.proof(sideServer, clientNonce, serverNonce)) {
		return &authError{code: codeServerProof}
	}
	return nil
}

// clip shortens an untrusted string for messages and logs.
func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}

// AuthRefusals counts what an engine refused for authentication or authorization.
type AuthRefusals struct {
	// SideChannel counts side-channel connections refused: a missing, unexpected or wrong
	// auth token from a client, or (as a client) a server whose proof did not match.
	SideChannel int64 `json:"side_channel"`
	// Transfer counts transfer connections refused by the challenge-response, either side.
	Transfer int64 `json:"transfer"`
	// Reads counts TCP READs refused because the blocks were not leased under the token the
	// reader presented.
	Reads int64 `json:"reads"`
	// Params counts kv_transfer_params refused before any connection: malformed, without a
	// valid MAC (with an auth token), or naming a host outside allowed_peers.
	Params int64 `json:"params"`
	// Notifications counts completion notifications refused because they presented another
	// lease's token.
	Notifications int64 `json:"notifications"`
	// Verification counts loads whose blocks did not match what their owner published (its
	// lease slot or block records): the KV was not used. A decoder's hold that expired or was
	// evicted is a cache miss, not counted here.
	Verification int64 `json:"verification"`
}

// Total returns the sum of the counts.
func (a AuthRefusals) Total() int64 {
	return a.SideChannel + a.Transfer + a.Reads + a.Params + a.Notifications + a.Verification
}

// AuthRefusals returns the engine's authentication and authorization refusals so far.
func (c *Connector) AuthRefusals() AuthRefusals {
	st := c.agent.Stats()
	return AuthRefusals{
		SideChannel:   c.side.refusals.Load() + c.sideRefusals.Load(),
		Transfer:      st.AuthRefused,
		Reads:         st.ReadsDenied,
		Params:        c.counts.params.Load(),
		Notifications: c.counts.notifications.Load(),
		Verification:  c.counts.verification.Load(),
	}
}

// transferAuthHint adds the setting to fix to a transfer connection refused for
// authentication.
func (c *Connector) transferAuthHint(r *remoteLink, err error) error {
	var te *transfer.Error
	if errors.As(err, &te) && errors.Is(err, transfer.ErrPermission) && (te.Op == "connect" || te.Op == "select backend") {
		return fmt.Errorf("the transfer connection to engine %s was refused: every engine needs the same kv_connector_extra_config.auth_token (or %s), or none: %w", r.id, EnvAuthToken, err)
	}
	return err
}

// AuthRefusalsCollector returns a Prometheus collector exposing AuthRefusals as the counter
// kvbridge:kv_auth_refusals_total{kind="side_channel"|"transfer"|"read"}, with constLabels
// (model_name and engine, as the engine's other series) added.
func (c *Connector) AuthRefusalsCollector(constLabels prometheus.Labels) prometheus.Collector {
	return &authRefusalsCollector{c: c,
		desc: prometheus.NewDesc("kvbridge:kv_auth_refusals_total",
			"KV side-channel and transfer connections refused for authentication, TCP reads and notifications refused for a lease token that does not match, kv_transfer_params refused before any connection, and loads whose blocks did not match what their owner published.",
			[]string{"kind"}, constLabels),
		evicted: prometheus.NewDesc("kvbridge:kv_decoder_holds_evicted_total",
			"Decoder holds (blocks kept for a conversation's next turn, decoder_kv_blocks_ttl) evicted before their TTL because the KV pool was needed by new requests.",
			nil, constLabels)}
}

// authRefusalsCollector reads a connector's AuthRefusals at scrape time.
type authRefusalsCollector struct {
	c             *Connector
	desc, evicted *prometheus.Desc
}

// Describe implements prometheus.Collector.
func (x *authRefusalsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- x.desc; ch <- x.evicted }

// Collect implements prometheus.Collector.
func (x *authRefusalsCollector) Collect(ch chan<- prometheus.Metric) {
	r := x.c.AuthRefusals()
	for _, k := range []struct {
		kind string
		n    int64
	}{{"side_channel", r.SideChannel}, {"transfer", r.Transfer}, {"read", r.Reads}, {"params", r.Params},
		{"notification", r.Notifications}, {"verification", r.Verification}} {
		ch <- prometheus.MustNewConstMetric(x.desc, prometheus.CounterValue, float64(k.n), k.kind)
	}
	ch <- prometheus.MustNewConstMetric(x.evicted, prometheus.CounterValue, float64(x.c.counts.evictedHolds.Load()))
}
