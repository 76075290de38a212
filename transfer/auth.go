package transfer

// HelloInfo is what both sides of a new connection know about it when the authenticator runs.
type HelloInfo struct {
	Role            string // "control", "data", "metadata" or "arenas"
	From            string // dialing agent
	FromIncarnation uint64
	To              string // listening agent ("" when fetching metadata by address)
	ToIncarnation   uint64 // 0 when fetching metadata by address
}

// Authenticator is the hook point for authenticating transfer connections (for example an
// HMAC over a shared secret, keyed on the hello fields). The dialing agent calls Prove and
// sends the proof in its hello; the listening agent calls Verify before it answers anything,
// and a non-nil error refuses the connection (ErrPermission at the dialer, counted as a
// refusal at the listener). Implementations must be safe for concurrent use.
type Authenticator interface {
	Prove(h HelloInfo) ([]byte, error)
	Verify(h HelloInfo, proof []byte) error
}
