package connector

import (
	"bufio"
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbridge/kvbridge/internal/msgpackcheck"
	"github.com/vmihailenco/msgpack/v5"
)

// The side channel is how a consumer learns how to read a producer's KV: one TCP listener per
// engine at VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT (+ data-parallel rank).
// Its wire format is kvbridge's own (vLLM uses ZeroMQ), shaped after vLLM's messages:
//
//	frame    = length (uint32, big-endian, at most 16 MiB) ‖ msgpack body
//	request  = msgpack array [bin "get_meta_msg", pp_rank int, tp_rank int]
//	           (every tp_rank gets the same answer: the engine's one agent names all its
//	           ranks' KV regions, tp.go)
//	response = msgpack array [payload map, ts float64]
//	payload  = {"compatibility_hash": str (SHA-256 hex), "agent_metadata_bytes": bin,
//	            "error": str, "error_code": str, "kv_cache_dtype": str}
//
// kv_cache_dtype (kvbridge's addition; vLLM's peers neither send nor need it) is the producer's
// KV dtype by kvcache's name, readable before the hash is compared, so that a consumer refusing
// a producer names both dtypes when they are the cause (kvdtype.go).
//
// agent_metadata_bytes is the msgpack map agentMetadata, decoded only after the hash matched, so
// a schema change fails with a clear error. ts is the responder's clock in seconds (its own
// monotonic epoch, like Python's perf_counter): the consumer estimates the clock offset from the
// sample with the smallest round trip. A connection may carry several requests; the server
// closes it after an idle period. A request that is not get_meta_msg gets a payload with only
// "error" set.
//
// Authentication. With an auth token (kv_connector_extra_config.auth_token, or the environment
// variable KVBRIDGE_KV_AUTH_TOKEN when the key is absent) the client authenticates first, and
// both sides prove that they know the token, on every connection, before any metadata flows:
//
//	client → server  [bin "kvbridge_auth_hello", client_nonce bin(32)]
//	server → client  [bin "kvbridge_auth_challenge", server_nonce bin(32), server_proof bin(32)]
//	client → server  [bin "kvbridge_auth_proof", client_proof bin(32)]
//	then get_meta_msg requests and responses as above
//
// with proof(side) = HMAC-SHA256(token, "kvbridge side channel auth v1" ‖ side ‖ client_nonce ‖
// server_nonce), side "client" or "server", each nonce drawn from crypto/rand per connection
// and each proof checked with hmac.Equal, so a proof captured on one connection is worthless
// on the next. The client sends its first get_meta_msg right after its proof.
//
// A server refuses with a response whose payload carries only "error" and "error_code", then
// closes: "auth_required" when it has a token and the client sent a plain get_meta_msg,
// "auth_unexpected" when it has none and the client sent kvbridge_auth_hello, "auth_failed"
// when the client's proof does not match. A client with a token refuses a server whose proof
// does not match. Every refusal is logged and counted by the refusing side (Connector.
// AuthRefusals, Prometheus kvbridge:kv_auth_refusals_total), and the refused side fails at
// once with an error naming the setting to fix (ErrAuth) — a mismatch never waits for a
// timeout.

// handshakeMagic is the request tag, as in vLLM.
const handshakeMagic = "get_meta_msg"

// maxFrame bounds a side-channel frame.
const maxFrame = 16 << 20

// ConnectorVersion is folded into the compatibility hash; bump it when P/D interoperability
// changes.
const ConnectorVersion = 2

// Errors of the handshake, checkable with errors.Is.
var (
	// ErrHandshake is any side-channel failure (dial, timeout, bad frame, refused peer).
	ErrHandshake = errors.New("NIXL handshake failed")
	// ErrIncompatible is a peer whose compatibility hash or geometry does not match.
	ErrIncompatible = errors.New("incompatible KV peer")
)

// agentMetadata is what a producer publishes about its KV memory (vLLM's NixlAgentMetadata).
type agentMetadata struct {
	EngineID      string `msgpack:"engine_id"`
	AgentMetadata []byte `msgpack:"agent_metadata"` // the transfer agent's metadata blob
	KVRegion      uint32 `msgpack:"kv_region"`      // region id of the blocks
	MetaRegion    uint32 `msgpack:"meta_region"`    // region id of the block records, then the lease slots
	NumBlocks     int    `msgpack:"num_blocks"`
	BlockLen      int    `msgpack:"block_len"`  // bytes per block
	BlockSize     int    `msgpack:"block_size"` // tokens per block
	KVCacheLayout string `msgpack:"kv_cache_layout"`
	NumLayers     int    `msgpack:"num_layers"`
	NumKVHeads    int    `msgpack:"num_kv_heads"` // one tensor-parallel rank's
	HeadDim       int    `msgpack:"head_dim"`
	Version       int    `msgpack:"connector_version"`
	// Instance is random per connector start: params that name another instance are stale.
	Instance string `msgpack:"instance"`
	// TPSize is the engine's tensor-parallel size (absent: 1); RankKVRegions are the KV regions
	// of its ranks 1 … TPSize−1 (rank 0's is KVRegion), each NumBlocks blocks of BlockLen bytes
	// holding that rank's NumKVHeads heads (docs/architecture.md, "KV between tensor-parallel
	// ranks").
	TPSize        int      `msgpack:"tp_size,omitempty"`
	RankKVRegions []uint32 `msgpack:"rank_kv_regions,omitempty"`
	// ReleaseReaderTP says that this engine parses release notifications of version 2, which
	// carry the reader's TP size (kvlease.ReaderTPPrefix): readers append it only then.
	ReleaseReaderTP bool `msgpack:"release_reader_tp,omitempty"`
}

type handshakePayload struct {
	CompatibilityHash  string `msgpack:"compatibility_hash"`
	AgentMetadataBytes []byte `msgpack:"agent_metadata_bytes"`
	Error              string `msgpack:"error,omitempty"`
	ErrorCode          string `msgpack:"error_code,omitempty"`
	KVCacheDType       string `msgpack:"kv_cache_dtype,omitempty"`
	// TransferMode is the server's transfer_mode ("push"; absent for pull), outside the hash,
	// so that a mode mismatch is refused with both modes named, even with the check off.
	TransferMode string `msgpack:"transfer_mode,omitempty"`
}

// CompatFactors are what two engines must agree on to exchange KV.
type CompatFactors struct {
	Model      string
	DType      string
	NumKVHeads int
	HeadSize   int
	NumLayers  int
	CacheDType string
	// Quantization is the weights' quantization ("" or "int8", vLLM's --quantization): the
	// KV a quantized model computes differs from the unquantized model's.
	Quantization string
	// TransferMode is "pull" (the default, when empty) or "push"; New sets it from the
	// connector's Config.
	TransferMode string
}

// Fields returns what CompatibilityHash hashes: the factors, the connector version and the
// transfer mode, keyed as in the hashed JSON. GET /v1/kv_transfer reports them, so that a
// mismatch can be explained by the factor that differs.
func (f CompatFactors) Fields() map[string]any {
	return map[string]any{
		"kvbridge_connector_version": ConnectorVersion,
		"model":                      f.Model,
		"dtype":                      f.DType,
		"num_kv_heads":               f.NumKVHeads,
		"head_size":                  f.HeadSize,
		"num_hidden_layers":          f.NumLayers,
		"cache_dtype":                f.CacheDType,
		"quantization":               f.Quantization,
		"transfer_mode":              cmp.Or(f.TransferMode, "pull"),
	}
}

// CompatibilityHash returns the SHA-256 hex of the canonical JSON of f.Fields(). The block size
// is not part of it (heterogeneous block sizes are allowed).
func CompatibilityHash(f CompatFactors) string {
	data, _ := json.Marshal(f.Fields()) // map keys are sorted
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

func writeFrame(w io.Writer, v any) error {
	body, err := msgpack.Marshal(v)
	if err != nil {
		return err
	}
	if len(body) > maxFrame {
		return fmt.Errorf("frame of %d bytes exceeds %d", len(body), maxFrame)
	}
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(body)))
	if _, err := w.Write(hdr[:]); err != nil {
		return err
	}
	_, err = w.Write(body)
	return err
}

func readFrame(r io.Reader) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > maxFrame {
		return nil, fmt.Errorf("frame of %d bytes exceeds %d", n, maxFrame)
	}
	// Grow with the bytes that arrive rather than trusting the header with an allocation.
	body, err := io.ReadAll(io.LimitReader(r, int64(n)))
	if err != nil {
		return nil, err
	}
	if len(body) < int(n) {
		return nil, io.ErrUnexpectedEOF
	}
	if err := checkBody(body); err != nil {
		return nil, err
	}
	return body, nil
}

// checkBody verifies that an untrusted frame body is one msgpack value whose declared lengths
// fit in it, before any decoding can allocate for them.
func checkBody(body []byte) error {
	n, err := msgpackcheck.Check(body, 4)
	if err != nil {
		return fmt.Errorf("malformed msgpack: %w", err)
	}
	if n != len(body) {
		return fmt.Errorf("malformed msgpack: %d trailing bytes", len(body)-n)
	}
	return nil
}

// decodeRequest checks a request frame: a msgpack array whose first element is the magic.
func decodeRequest(body []byte) error {
	tag, _, err := decodeTagged(body)
	if err != nil {
		return err
	}
	if tag != handshakeMagic {
		return fmt.Errorf("unexpected request tag %q", clip(tag))
	}
	return nil
}

// decodeTagged splits a msgpack array whose first element is a bin or str tag.
func decodeTagged(body []byte) (string, []msgpack.RawMessage, error) {
	if err := checkBody(body); err != nil {
		return "", nil, err
	}
	var parts []msgpack.RawMessage
	if err := msgpack.Unmarshal(body, &parts); err != nil {
		return "", nil, fmt.Errorf("request is not a msgpack array: %w", err)
	}
	if len(parts) == 0 {
		return "", nil, errors.New("empty request")
	}
	var tag []byte
	if err := msgpack.Unmarshal(parts[0], &tag); err != nil {
		return "", nil, errors.New("request tag is not bytes")
	}
	return string(tag), parts[1:], nil
}

// sideChannelServer answers handshakes with a fixed payload.
type sideChannelServer struct {
	ln      net.Listener
	payload handshakePayload
	clock   func() float64
	log     *slog.Logger
	idle    time.Duration
	auth    *sideAuth // nil: no auth token

	refusals atomic.Int64   // connections refused for authentication
	wg       sync.WaitGroup // accept and serve

	// mu guards the fields below.
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

// listenSideChannel starts serving handshakes on addr; with auth, every connection must
// authenticate first.
func listenSideChannel(addr string, payload handshakePayload, clock func() float64, log *slog.Logger, auth *sideAuth) (*sideChannelServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("NIXL side channel: listen on %s: %w (set VLLM_NIXL_SIDE_CHANNEL_PORT to a free port; each engine on a host needs its own)", addr, err)
	}
	s := &sideChannelServer{ln: ln, payload: payload, clock: clock, log: log, idle: 30 * time.Second, auth: auth, conns: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

func (s *sideChannelServer) addr() net.Addr { return s.ln.Addr() }

func (s *sideChannelServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		if !s.track(c) {
			c.Close()
			return
		}
		go s.serve(c)
	}
}

// track records a new connection, counting its goroutine, and reports false once the server is
// closed.
func (s *sideChannelServer) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	return true
}

// untrack forgets a connection that ended.
func (s *sideChannelServer) untrack(c net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.conns, c)
}

func (s *sideChannelServer) serve(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.untrack(c)
		c.Close()
	}()
	r := bufio.NewReader(c)
	first := true
	for {
		_ = c.SetDeadline(time.Now().Add(s.idle))
		body, err := readFrame(r)
		if err != nil {
			return
		}
		if first {
			first = false
			var ok bool
			if body, ok = s.authenticate(c, r, body); !ok {
				return
			}
		}
		resp := s.payload
		if err := decodeRequest(body); err != nil {
			s.log.Warn("NIXL side channel: bad handshake request", "peer", c.RemoteAddr().String(), "err", err)
			resp = handshakePayload{Error: err.Error()}
		}
		if err := writeFrame(c, []any{resp, s.clock()}); err != nil {
			return
		}
	}
}

// authenticate runs the server's part of the authentication on a new connection whose first
// frame is body. It returns the first frame that follows (a get_meta_msg request), and false
// when the connection was refused (answered, logged and counted) or broke.
func (s *sideChannelServer) authenticate(c net.Conn, r io.Reader, body []byte) ([]byte, bool) {
	tag, parts, err := decodeTagged(body)
	hello := err == nil && tag == authHelloTag
	refuse := func(code, msg string) ([]byte, bool) {
		s.refusals.Add(1)
		s.log.Warn("NIXL side channel: connection refused", "peer", c.RemoteAddr().String(), "error_code", code, "err", msg)
		_ = writeFrame(c, []any{handshakePayload{Error: msg, ErrorCode: code}, s.clock()})
		return nil, false
	}
	switch {
	case s.auth == nil && !hello:
		return body, true
	case s.auth == nil:
		return refuse(codeAuthUnexpected, "this side channel has no auth_token configured but the client authenticates: configure the same kv_connector_extra_config.auth_token (or KVBRIDGE_KV_AUTH_TOKEN) on every engine")
	case !hello:
		return refuse(codeAuthRequired, "authentication required: this side channel requires kv_connector_extra_config.auth_token (or KVBRIDGE_KV_AUTH_TOKEN)")
	}
	var clientNonce []byte
	if len(parts) != 1 || msgpack.Unmarshal(parts[0], &clientNonce) != nil || len(clientNonce) != sideNonceBytes {
		return refuse(codeAuthFailed, "malformed kvbridge_auth_hello")
	}
	serverNonce, err := newNonce()
	if err != nil {
		return refuse(codeAuthFailed, "drawing a nonce failed")
	}
	if err := writeFrame(c, []any{[]byte(authChallengeTag), serverNonce, s.auth.proof(sideServer, clientNonce, serverNonce)}); err != nil {
		return nil, false
	}
	body, err = readFrame(r)
	if err != nil {
		return refuse(codeAuthFailed, fmt.Sprintf("the client did not answer the authentication challenge: %v", err))
	}
	tag, parts, err = decodeTagged(body)
	var proof []byte
	if err != nil || tag != authProofTag || len(parts) != 1 || msgpack.Unmarshal(parts[0], &proof) != nil {
		return refuse(codeAuthFailed, "expected kvbridge_auth_proof")
	}
	if !hmac.Equal(proof, s.auth.proof(sideClient, clientNonce, serverNonce)) {
		return refuse(codeAuthFailed, "authentication failed: the client's proof does not match this engine's auth_token (the tokens differ)")
	}
	body, err = readFrame(r)
	if err != nil {
		return nil, false
	}
	return body, true
}

// close stops the listener and every connection, and waits for their goroutines. Idempotent.
func (s *sideChannelServer) close() error {
	first, err := s.shut()
	if !first {
		return nil
	}
	s.wg.Wait()
	return err
}

// shut closes the listener and every connection, and reports whether this call did.
func (s *sideChannelServer) shut() (first bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false, nil
	}
	s.closed = true
	err = s.ln.Close()
	for c := range s.conns {
		c.Close()
	}
	return true, err
}

// decodeResponse parses a handshake response frame: [payload map, ts float].
func decodeResponse(body []byte) (handshakePayload, float64, error) {
	var payload handshakePayload
	if err := checkBody(body); err != nil {
		//lint:ignore ST1005 vLLM's own words, which operators grep for
		return payload, 0, fmt.Errorf("Failed to decode NixlHandshakePayload: %w", err)
	}
	var parts []msgpack.RawMessage
	if err := msgpack.Unmarshal(body, &parts); err != nil || len(parts) < 2 {
		//lint:ignore ST1005 vLLM's own words, which operators grep for
		return payload, 0, fmt.Errorf("Failed to decode NixlHandshakePayload: %v", err)
	}
	if err := msgpack.Unmarshal(parts[0], &payload); err != nil {
		//lint:ignore ST1005 vLLM's own words, which operators grep for
		return payload, 0, fmt.Errorf("Failed to decode NixlHandshakePayload: %w", err)
	}
	if payload.Error != "" {
		if isAuthCode(payload.ErrorCode) {
			return payload, 0, &authError{code: payload.ErrorCode, detail: clip(payload.Error)}
		}
		return payload, 0, errors.New("peer refused: " + payload.Error)
	}
	var ts float64
	if err := msgpack.Unmarshal(parts[1], &ts); err != nil {
		return payload, 0, fmt.Errorf("bad clock reading: %w", err)
	}
	return payload, ts, nil
}

// handshakeResult is what a consumer learns from a producer's side channel.
type handshakeResult struct {
	meta agentMetadata
	// offset is the producer's clock minus ours, in seconds.
	offset float64
	// kvCacheDType is the producer's KV dtype ("" from a peer that does not say), also set
	// when the hashes differ.
	kvCacheDType string
	// transferMode is the peer's transfer_mode ("pull" when it does not say), also set when
	// the hashes differ.
	transferMode string
}

// handshake fetches a producer's metadata from addr, checks the compatibility hash (unless
// enforce is false) and the engine id, and estimates the clock offset from the best of samples
// round trips. clock reads this engine's clock in seconds. With auth, the connection is
// authenticated first; an error that this side refused the server's proof wraps
// errServerProof.
func handshake(ctx context.Context, addr, wantEngine, localHash string, enforce bool, samples int, clock func() float64, auth *sideAuth) (handshakeResult, error) {
	fail := func(err error) (handshakeResult, error) {
		var ae *authError
		if errors.As(err, &ae) {
			ae.addr = addr
			return handshakeResult{}, fmt.Errorf("%w: %w", ErrHandshake, ae)
		}
		return handshakeResult{}, fmt.Errorf("%w with %s: %w", ErrHandshake, addr, err)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	r := bufio.NewReader(c)
	var payload handshakePayload
	bestRTT, offset := -1.0, 0.0
	for i := range max(samples, 1) {
		sent := clock()
		var proofErr error
		if i == 0 && auth != nil {
			if proofErr = authenticateClient(c, r, auth); proofErr != nil && !errors.Is(proofErr, errServerProof) {
				return fail(proofErr)
			}
			sent = clock()
		}
		if err := writeFrame(c, []any{[]byte(handshakeMagic), 0, 0}); err != nil {
			return fail(errors.Join(proofErr, err))
		}
		body, err := readFrame(r)
		if proofErr != nil {
			// The server's verdict on our proof was read (or the connection ended) only so
			// that both sides have decided before this one reports.
			return fail(proofErr)
		}
		if err != nil {
			return fail(err)
		}
		recv := clock()
		var ts float64
		if payload, ts, err = decodeResponse(body); err != nil {
			return fail(err)
		}
		if rtt := recv - sent; bestRTT < 0 || rtt < bestRTT {
			bestRTT, offset = rtt, ts-(sent+recv)/2
		}
	}
	if enforce && payload.CompatibilityHash != localHash {
		return handshakeResult{kvCacheDType: payload.KVCacheDType, transferMode: cmp.Or(payload.TransferMode, "pull")}, fmt.Errorf("%w: NIXL compatibility hash mismatch. Local: %s, Remote: %s (engines must serve the same model with the same --dtype, --quantization, --kv-cache-dtype and KV shape; set kv_connector_extra_config.enforce_handshake_compat=false to skip this check)",
			ErrIncompatible, localHash, payload.CompatibilityHash)
	}
	var meta agentMetadata
	if err := checkBody(payload.AgentMetadataBytes); err != nil {
		//lint:ignore ST1005 vLLM's own words, which operators grep for
		return fail(fmt.Errorf("Failed to decode NixlAgentMetadata: %w", err))
	}
	if err := msgpack.Unmarshal(payload.AgentMetadataBytes, &meta); err != nil {
		//lint:ignore ST1005 vLLM's own words, which operators grep for
		return fail(fmt.Errorf("Failed to decode NixlAgentMetadata: %w", err))
	}
	if meta.EngineID != wantEngine {
		return handshakeResult{}, fmt.Errorf("%w: Remote NIXL agent engine ID mismatch. Expected %s, received %s", ErrIncompatible, wantEngine, meta.EngineID)
	}
	return handshakeResult{meta: meta, offset: offset, kvCacheDType: payload.KVCacheDType, transferMode: cmp.Or(payload.TransferMode, "pull")}, nil
}
