// Package transfer is kvbridge's KV-cache transfer engine, shaped like NVIDIA NIXL: expensive
// work happens once (register memory, exchange metadata, prepare descriptor lists, connect),
// and the per-transfer path is index arithmetic, descriptor merging and one asynchronous post
// with a single completion.
//
// # Model
//
//   - An Agent is one process's endpoint: a name, a random 64-bit incarnation drawn at start,
//     a TCP listener and (for same-host peers) a Unix socket.
//   - Memory lives in Arenas: off-heap memfd mappings (MAP_SHARED, pre-faulted, sealed
//     against shrinking and growing). Register exposes a slice of an arena as a Region with
//     read/write permissions for peers. Descriptors are (region id, offset, length) — never
//     addresses — so every check is a bounds check.
//   - LocalMetadata is a small msgpack blob (regions, not blocks; connection info; host boot
//     id). A peer passes it to LoadRemote. A new incarnation of a peer replaces the old one
//     atomically and everything bound to the old one fails with ErrStaleIncarnation.
//   - PrepareLocal / PrepareRemote validate descriptor lists once and pick the backend for
//     the remote list; MakeRequest pairs descriptors by index and merges runs that are
//     contiguous on both sides; Post starts the transfer without waiting for data movement;
//     Done, Wait and Status report completion. Every post has a deadline (ErrTimeout).
//   - A notification attached to a post is delivered by the engine itself once the data is
//     complete (READ: after it landed locally; WRITE: after the peer acknowledged it).
//     SendNotif sends standalone messages. Receivers read Notifications or DrainNotifs;
//     messages from one peer arrive in order.
//
// # Backends
//
// SHM (same host: same boot id, and the fd hand-over works): the target passes its arena
// memfds once over its Unix socket (SCM_RIGHTS; read-only unless a region in the arena grants
// PermWrite); the initiator maps them and copies with a worker pool (and the goroutine
// calling Wait). The end of the Unix connection (EOF when the peer exits) fails requests in
// flight with ErrRemoteDisconnect at once. TCP (any host): several connections per peer, a
// fixed little-endian frame header (package internal/wire), vectored writes from registered
// memory and vectored reads into it, large ranges striped over the connections, in-flight
// bytes bounded per peer; the target validates every range against its regions and
// permissions and refuses anything else (counted in Stats.Refused).
//
// Selection is automatic (SHM when usable, else TCP) or restricted by an ordered backend list
// as in NIXL ("SHM", "TCP"; NIXL plugin names such as "UCX" are reported as not available in
// this build). The backend used is always reported (PreparedList.Backend, Request.Backend),
// a fallback is explained (PreparedList.FallbackReason) and counted, and a list that allows no
// usable backend is an error — never a silent fallback.
//
// # Trust
//
// Over TCP the target checks every range. Over SHM the peer holds a mapping of the whole
// arena: the target limits it to same-user processes (SO_PEERCRED) and to read-only access
// unless some region of the arena is writable; per-region bounds and permissions are then
// enforced by the initiator. Deregistering a region does not revoke an existing SHM mapping.
// Config.Auth is the hook for authenticating connections (a shared-secret HMAC, for example).
//
// # Errors and telemetry
//
// Errors wrap one sentinel (ErrTimeout, ErrRemoteDisconnect, ErrStaleIncarnation,
// ErrPermission, ErrInvalidDescriptor, ErrNotFound, ErrNotSupported, ErrCanceled, …) in an
// *Error carrying the operation, peer, request id and descriptor index. Each finished post
// has RequestTelemetry (post and transfer durations measured by the engine, bytes,
// descriptors before and after merging, backend); Stats counts failures and refusals by
// kind.
package transfer
