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
//     Done, Wait and Err report completion. Every post has a deadline (ErrTimeout).
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
// permissions (and READs against Config.AuthorizeRead) and refuses anything else (counted in
// Stats.Refused).
//
// UCX (binaries built with -tags ucx, cgo against libucx, UCX 1.12 or newer; offered only
// when listed in Config.Backends): one-sided ucp_get_nbx / ucp_put_nbx on whatever transport
// UCX selects — RDMA verbs on InfiniBand or RoCE, TCP, shared memory — configured by the
// usual UCX_* environment variables (UCX_TLS, UCX_NET_DEVICES, …) and Config.UCX. The agent
// registers each arena once (ucp_mem_map) and publishes its remote key and the worker
// addresses in the metadata (format 3). Workers are driven by goroutines of their own that
// park in the network poller when there is nothing to do; a request's pieces are posted back
// to back with one endpoint flush per worker, and its notification is an active message sent
// after the flush completed. An agent answers a peer that connected to it over UCX (SendNotif
// without its metadata loaded) from one more, unpublished worker started on first use:
// UCX 1.13 joins an endpoint a worker creates to a worker that created endpoints towards it
// to one of those, open or long closed (a timeout closes a link), and an answer from a
// published worker could go to a closed endpoint and be lost. Two agents that have each
// loaded the other's metadata still have their links joined that way; a notification whose
// endpoint UCX joined to a closed one fails (ErrRemoteDisconnect, after DialTimeout or the
// notification's deadline) rather than vanish (TestUCXStalledPeerOwnLink).
// Endpoints use UCX's peer error handling, so a dead peer fails
// the requests in flight with ErrRemoteDisconnect; a peer on this host is also watched
// through a pidfd. UCX 1.13 selects only transports with peer-failure support for such
// endpoints, which on TCP and shared memory means UCX emulates gets and puts with active
// messages (PeerInfo.UCXLanes shows the lanes in use; the agent warns when a link has no RMA
// lane). That emulation is slower than the SHM and TCP backends, and in UCX 1.13 it is not
// robust against a reader that dies mid-transfer: the target, which answers the emulated
// gets, can be aborted by UCX (TCP) or have its worker stall on the dead reader's queue
// (shared memory). UCX pays off, and is meant for, RDMA networks. Only arena memory can be
// the local side of a UCX request.
//
// Selection is automatic (SHM when usable, else TCP) or restricted by an ordered backend list
// as in NIXL ("SHM", "TCP", "UCX"; UCX without -tags ucx and the other NIXL plugins are
// reported as not available in this build). The backend used is always reported (PreparedList.Backend, Request.Backend),
// a fallback is explained (PreparedList.FallbackReason) and counted, and a list that allows no
// usable backend is an error — never a silent fallback.
//
// # Trust
//
// Authentication (Config.Auth, NewHMACAuth): with a shared secret every connection — TCP and
// Unix, control, data, metadata and arena fds — starts with a mutual challenge-response before
// the listener answers anything else: HELLO carries the dialer's fresh random nonce, the
// listener answers CHALLENGE (its own fresh nonce and its proof), the dialer answers AUTH (its
// proof), then HELLO_ACK or ERROR. A proof is HMAC-SHA256(secret, context ‖ side ‖ both nonces
// ‖ hello fields ‖ listener identity), compared with hmac.Equal; it is bound to both nonces, so
// a captured proof opens no other connection. A secret on one side only, or different
// secrets, are refused at once with a message saying so, and counted by the refusing side
// (Stats.AuthRefused). Authentication does not encrypt: the bytes of a transfer cross the
// network in the clear, and an attacker who can rewrite traffic can take over an
// authenticated TCP connection.
//
// Authorization. Over TCP the target checks every range against its regions and their
// permissions, then asks Config.AuthorizeRead, with the tag the reader attached to its request
// (RequestOptions.Tag), whether this peer may read these ranges now; kvbridge's connector
// answers from its lease table (a reader names the request whose blocks it reads). WRITEs into a
// writable region ask Config.AuthorizeWrite likewise (no tag; kvbridge's push connector allows
// only the blocks a waiting request registered with the writing agent). Refusals are answered
// with ErrPermission and counted (Stats.Refused, Stats.ReadsDenied, Stats.WritesDenied).
//
// SHM is the exception, by construction: the peer holds a mapping of the whole arena, so no
// per-read check is possible (and AuthorizeRead is never called). The target offers SHM only
// to processes on the same host running as the same user id (SO_PEERCRED on the Unix socket,
// checked after authentication) — processes that can read each other's memory anyway
// (ptrace, /proc/PID/mem) — and maps it read-only unless some region of the arena is
// writable; per-region bounds and permissions are then enforced by the initiator.
// Deregistering a region does not revoke an existing SHM mapping. Where per-read enforcement
// matters between same-user processes, restrict the backends to TCP.
//
// UCX has no authentication and no per-read check at all: a peer holding an arena's remote
// key reads (and, if the arena is writable, writes) it directly, and UCX's emulated gets and
// puts over TCP and shared memory act on whatever address the peer names. An agent with UCX
// among its backends therefore refuses Config.Auth, and the initiator enforces region bounds
// and permissions itself. Run UCX only between trusted hosts, and restrict UCX_NET_DEVICES to
// the fabric meant to carry the KV.
//
// # Errors and telemetry
//
// Errors wrap one sentinel (ErrTimeout, ErrRemoteDisconnect, ErrStaleIncarnation,
// ErrPermission, ErrInvalidDescriptor, ErrNotFound, ErrNotSupported, ErrCanceled, …) in an
// *Error carrying the operation, peer, request id and descriptor index. Each finished post
// has RequestTelemetry (post and transfer durations measured by the engine, bytes,
// descriptors before and after merging, backend); Stats counts failures and refusals by
// kind.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package transfer
