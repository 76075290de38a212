package transfer

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors. Every error returned by this package wraps exactly one of them (check with
// errors.Is); most are *Error values that add the operation, peer, request and descriptor.
var (
	// ErrTimeout: a request's deadline passed before it completed.
	ErrTimeout = errors.New("transfer: timeout")
	// ErrRemoteDisconnect: the connection to the peer broke or the peer process exited.
	ErrRemoteDisconnect = errors.New("transfer: remote disconnected")
	// ErrStaleIncarnation: the request or list is bound to a peer incarnation that has been
	// replaced (the peer restarted and its new metadata was loaded).
	ErrStaleIncarnation = errors.New("transfer: stale peer incarnation")
	// ErrPermission: the memory is registered but not with the permission the operation needs,
	// or a connection was refused by authentication.
	ErrPermission = errors.New("transfer: permission denied")
	// ErrInvalidDescriptor: a descriptor lies outside its region or is malformed.
	ErrInvalidDescriptor = errors.New("transfer: invalid descriptor")
	// ErrInvalidParam: an argument is invalid (bad index, unknown backend name, nil list, …).
	ErrInvalidParam = errors.New("transfer: invalid parameter")
	// ErrMismatch: local and remote lists or descriptors do not pair up (count or length).
	ErrMismatch = errors.New("transfer: local/remote mismatch")
	// ErrNotFound: unknown or invalidated peer, unknown region.
	ErrNotFound = errors.New("transfer: not found")
	// ErrNotSupported: a feature or backend that this build or this peer does not provide.
	ErrNotSupported = errors.New("transfer: not supported")
	// ErrCanceled: the request was released or its context was canceled.
	ErrCanceled = errors.New("transfer: canceled")
	// ErrRepostActive: Post on a request that is still in progress.
	ErrRepostActive = errors.New("transfer: request still active")
	// ErrInUse: a region, arena or list is still referenced (e.g. deregistering a region that
	// a prepared list uses).
	ErrInUse = errors.New("transfer: in use")
	// ErrClosed: the agent (or arena) is closed.
	ErrClosed = errors.New("transfer: closed")
	// ErrProtocol: a peer sent a truncated, corrupt or out-of-limit frame or metadata blob.
	ErrProtocol = errors.New("transfer: protocol violation")
	// ErrBackend: a backend failed in a way not covered by the other errors (e.g. mmap).
	ErrBackend = errors.New("transfer: backend failure")
)

// Error carries the context of a failure. Kind is one of the sentinel errors above; Cause is an
// optional underlying error (a net or syscall error). errors.Is matches both.
type Error struct {
	Op      string  // "register", "load", "prepare", "make", "post", "READ", "WRITE", "notify", "connect", …
	Peer    string  // remote agent name, if any
	Request uint64  // request id, 0 if none
	Desc    int     // descriptor index, -1 if not about one descriptor
	Backend Backend // backend in use, if known
	Kind    error   // the sentinel
	Detail  string  // human-readable specifics
	Cause   error   // underlying error, may be nil
}

// Error formats as "transfer: OP peer=P req=N desc=I backend=B: kind: detail: cause".
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("transfer: ")
	b.WriteString(e.Op)
	if e.Peer != "" {
		fmt.Fprintf(&b, " peer=%s", e.Peer)
	}
	if e.Request != 0 {
		fmt.Fprintf(&b, " req=%d", e.Request)
	}
	if e.Desc >= 0 {
		fmt.Fprintf(&b, " desc=%d", e.Desc)
	}
	if e.Backend != 0 {
		fmt.Fprintf(&b, " backend=%s", e.Backend)
	}
	b.WriteString(": ")
	if e.Kind != nil {
		b.WriteString(strings.TrimPrefix(e.Kind.Error(), "transfer: "))
	}
	if e.Detail != "" {
		b.WriteString(": ")
		b.WriteString(e.Detail)
	}
	if e.Cause != nil {
		b.WriteString(": ")
		b.WriteString(e.Cause.Error())
	}
	return b.String()
}

// Unwrap returns the sentinel and the cause.
func (e *Error) Unwrap() []error {
	if e.Cause == nil {
		return []error{e.Kind}
	}
	return []error{e.Kind, e.Cause}
}

// newErr builds an *Error without descriptor context.
func newErr(op, peer string, kind error, detail string, cause error) *Error {
	return &Error{Op: op, Peer: peer, Desc: -1, Kind: kind, Detail: detail, Cause: cause}
}

// descErr builds an *Error about descriptor i.
func descErr(op, peer string, i int, kind error, format string, args ...any) *Error {
	return &Error{Op: op, Peer: peer, Desc: i, Kind: kind, Detail: fmt.Sprintf(format, args...)}
}

// withRequest returns a copy of err annotated with the request context, unless it already is.
func withRequest(err error, op string, peer string, id uint64, b Backend) error {
	var e *Error
	if errors.As(err, &e) {
		c := *e
		if c.Request == 0 {
			c.Request = id
		}
		if c.Peer == "" {
			c.Peer = peer
		}
		if c.Backend == 0 {
			c.Backend = b
		}
		if c.Op == "" {
			c.Op = op
		}
		return &c
	}
	return &Error{Op: op, Peer: peer, Request: id, Desc: -1, Backend: b, Kind: kindOf(err), Cause: err}
}

// wire error codes carried in ERROR frames (the Count field).
const (
	codeInvalid    = 1
	codePermission = 2
	codeNotFound   = 3
	codeStale      = 4
	codeProtocol   = 5
	codeAuth       = 6
	codeNotSupp    = 7
	codeInternal   = 8
)

// codeFor maps a sentinel to a wire error code.
func codeFor(kind error) uint32 {
	switch {
	case errors.Is(kind, ErrInvalidDescriptor):
		return codeInvalid
	case errors.Is(kind, ErrPermission):
		return codePermission
	case errors.Is(kind, ErrNotFound):
		return codeNotFound
	case errors.Is(kind, ErrStaleIncarnation):
		return codeStale
	case errors.Is(kind, ErrProtocol):
		return codeProtocol
	case errors.Is(kind, ErrNotSupported):
		return codeNotSupp
	}
	return codeInternal
}

// kindForCode maps a wire error code back to a sentinel.
func kindForCode(c uint32) error {
	switch c {
	case codeInvalid:
		return ErrInvalidDescriptor
	case codePermission, codeAuth:
		return ErrPermission
	case codeNotFound:
		return ErrNotFound
	case codeStale:
		return ErrStaleIncarnation
	case codeProtocol:
		return ErrProtocol
	case codeNotSupp:
		return ErrNotSupported
	}
	return ErrBackend
}

// kindOf returns the sentinel err wraps, or ErrBackend.
func kindOf(err error) error {
	for _, k := range [...]error{
		ErrTimeout, ErrStaleIncarnation, ErrRemoteDisconnect, ErrPermission, ErrInvalidDescriptor,
		ErrInvalidParam, ErrMismatch, ErrNotFound, ErrNotSupported, ErrCanceled, ErrRepostActive,
		ErrInUse, ErrClosed, ErrProtocol, ErrBackend,
	} {
		if errors.Is(err, k) {
			return k
		}
	}
	return ErrBackend
}
