package transfer

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"hash"
)

// Connection authentication is a challenge-response over a shared secret, run on every new
// connection (control, data, metadata and arena fds; TCP and Unix) before the listener
// answers anything else, when Config.Auth is set:
//
//	dialer   → listener  HELLO     {…, Nonce: 32 fresh random bytes}
//	listener → dialer    CHALLENGE {Name, Inc, Nonce: 32 fresh random bytes, Proof: P(listener)}
//	dialer   → listener  AUTH      {Proof: P(dialer)}
//	listener → dialer    HELLO_ACK | ERROR
//
// P(side) = Auth.proof(side, transcript), where the transcript holds the hello fields, the
// arenas asked for, the listener's name and incarnation and both nonces. Each side checks
// the other's proof with hmac.Equal against the one it computes itself; a proof is bound to
// both nonces, so one captured on a connection is worthless on any other. Both sides draw
// their nonce from crypto/rand, so neither depends on the other's randomness.
//
// A configuration mismatch fails at once on both sides, never waiting for a timeout: a
// listener with a secret answers a hello without a nonce with ERROR ("authentication
// required"), and a listener without one answers a hello with a nonce with ERROR ("no
// shared secret configured"). Every refusal is logged and counted on the refusing side
// (Stats.AuthRefused and Stats.Refused.Permission); the other side gets ErrPermission.

// authNonceBytes is the size of each side's nonce.
const authNonceBytes = 32

// maxAuthBytes bounds a CHALLENGE or AUTH payload.
const maxAuthBytes = 1024

// authSide names the side of a connection a proof is for.
type authSide uint8

const (
	// authDialer is the side that opened the connection.
	authDialer authSide = 1
	// authListener is the side that accepted it.
	authListener authSide = 2
)

// helloInfo is what the dialer announced in its hello.
type helloInfo struct {
	Role            string // "control", "data", "metadata" or "arenas"
	From            string // dialing agent
	FromIncarnation uint64
	To              string // listening agent ("" when fetching metadata by address)
	ToIncarnation   uint64 // 0 when fetching metadata by address
}

// authTranscript is everything a proof covers: what the dialer announced, the listener's
// identity, and the nonces both sides drew for this connection.
type authTranscript struct {
	Hello               helloInfo
	Arenas              []uint32 // arena ids whose fds the dialer asked for (Unix)
	Listener            string   // the listening agent's name
	ListenerIncarnation uint64   // the listening agent's incarnation
	DialerNonce         []byte
	ListenerNonce       []byte
}

// Authenticator authenticates every connection of an agent (Config.Auth); NewHMACAuth
// returns the shared-secret one. It computes the proofs of the connection handshake; the
// agent draws the nonces and compares proofs itself (with hmac.Equal).
type Authenticator interface {
	// proof returns the same proof for the same side and transcript, binds every field of
	// the transcript and the side, and is safe for concurrent use.
	proof(side authSide, t *authTranscript) ([]byte, error)
}

// hmacAuthenticator authenticates with a shared secret: a proof is HMAC-SHA256(secret,
// context ‖ side ‖ transcript), every field length-prefixed or fixed-size so that no two
// transcripts encode alike.
type hmacAuthenticator struct {
	key []byte
}

// errEmptySecret is returned by NewHMACAuth for an empty secret.
var errEmptySecret = errors.New("transfer: empty shared secret")

// NewHMACAuth returns an Authenticator keyed with secret (copied): a proof is
// HMAC-SHA256(secret, context ‖ side ‖ transcript). Both agents of a connection need the same
// secret. An empty secret is an error.
func NewHMACAuth(secret []byte) (Authenticator, error) {
	if len(secret) == 0 {
		return nil, errEmptySecret
	}
	return &hmacAuthenticator{key: append([]byte(nil), secret...)}, nil
}

// authContext separates these proofs from any other use of the secret.
const authContext = "kvbridge transfer connection auth v1"

// proof returns HMAC-SHA256 over the side and the transcript.
func (a *hmacAuthenticator) proof(side authSide, t *authTranscript) ([]byte, error) {
	m := hmac.New(sha256.New, a.key)
	writeField(m, []byte(authContext))
	m.Write([]byte{byte(side)})
	writeField(m, t.DialerNonce)
	writeField(m, t.ListenerNonce)
	writeField(m, []byte(t.Hello.Role))
	writeField(m, []byte(t.Hello.From))
	writeUint(m, t.Hello.FromIncarnation)
	writeField(m, []byte(t.Hello.To))
	writeUint(m, t.Hello.ToIncarnation)
	writeField(m, []byte(t.Listener))
	writeUint(m, t.ListenerIncarnation)
	writeUint(m, uint64(len(t.Arenas)))
	for _, id := range t.Arenas {
		writeUint(m, uint64(id))
	}
	return m.Sum(nil), nil
}

// writeField writes len(b) (8 bytes) then b.
func writeField(h hash.Hash, b []byte) {
	writeUint(h, uint64(len(b)))
	h.Write(b)
}

// writeUint writes v as 8 little-endian bytes.
func writeUint(h hash.Hash, v uint64) {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], v)
	h.Write(b[:])
}

// challenge is the listener's answer to an authenticating hello.
type challenge struct {
	//lint:ignore U1000 msgpack reads its tag (as_array)
	_msgpack struct{} `msgpack:",as_array"`
	Name     string
	Inc      uint64
	Nonce    []byte
	Proof    []byte
}

// authProof is the dialer's answer to a challenge.
type authProof struct {
	//lint:ignore U1000 msgpack reads its tag (as_array)
	_msgpack struct{} `msgpack:",as_array"`
	Proof    []byte
}

// transcript builds the transcript of a connection.
func transcript(h *hello, listener string, listenerInc uint64, listenerNonce []byte) *authTranscript {
	return &authTranscript{Hello: h.info(), Arenas: h.Arenas, Listener: listener, ListenerIncarnation: listenerInc,
		DialerNonce: h.Nonce, ListenerNonce: listenerNonce}
}

// checkProof computes side's proof over t and compares it with got in constant time.
func checkProof(auth Authenticator, side authSide, t *authTranscript, got []byte) bool {
	want, err := auth.proof(side, t)
	return err == nil && len(want) > 0 && hmac.Equal(want, got)
}

// countAuthRefusal counts and logs a connection this agent refused for authentication.
func (a *Agent) countAuthRefusal(side string, peer, remote, role, why string) {
	a.refuse(ErrPermission)
	a.stats.authRefused.Add(1)
	a.log.Warn("transfer connection refused: authentication", "side", side, "peer", peer, "peer_addr", remote, "role", role, "err", why)
}
