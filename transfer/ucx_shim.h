// The C side of the UCX backend (ucx_shim.c, built only with -tags ucx). Everything here runs
// on the thread of the worker's owning goroutine except kvb_context_*, kvb_mem_* and
// kvb_worker_create/destroy, which the Go side serialises. No function keeps a pointer into
// Go memory: RMA buffers are arena memory (mmap'd, never the Go heap), and messages are
// copied into malloc'd buffers before they are handed to UCX.
#ifndef KVB_UCX_SHIM_H
#define KVB_UCX_SHIM_H

#include <stdint.h>
#include <stddef.h>
#include <ucp/api/ucp.h>

// The oldest UCX this backend is built against: 1.12 brought ucp_config_modify for transport
// settings (UCX_TCP_*, UCX_POSIX_*) and the keep-alive fix for shared-memory transports that
// peer-failure detection depends on; the nbx RMA, flush and active-message calls are older.
#if !defined(UCP_API_VERSION) || UCP_API_VERSION < UCP_VERSION(1, 12)
#error "kvbridge's UCX backend needs UCX 1.12 or newer (Debian 12's libucx-dev is 1.13.1)"
#endif

#define KVB_MIN_MAJOR 1
#define KVB_MIN_MINOR 12

// AM ids.
#define KVB_AM_NOTIF 0x6b76 // "kv": a notification (header kvb_am_hdr, data = message)

// kvb_am_hdr heads every notification. kind 1 is a hello (data: the sender's worker address,
// so that the receiver can answer; seq: the sender's link id), kind 2 a notification (data:
// the message), kind 3 the receiver's acknowledgement of a hello (seq echoed; no name, no
// data), sent from the AM callback on the reply endpoint.
typedef struct kvb_am_hdr {
    uint64_t inc;     // sender incarnation
    uint64_t seq;     // per-link sequence number (notifications)
    uint32_t kind;
    uint32_t namelen; // sender name follows the header
} kvb_am_hdr;

#define KVB_AM_HELLO 1
#define KVB_AM_MSG 2
#define KVB_AM_HELLO_ACK 3

// kvb_piece is one RMA operation: len bytes between local address laddr and remote address
// raddr, with rkeys[rkey].
typedef struct kvb_piece {
    uint64_t laddr;
    uint64_t raddr;
    uint64_t len;
    uint32_t rkey;
    uint32_t pad;
} kvb_piece;

// kvb_msg is a received active message, queued on its worker in arrival order.
typedef struct kvb_msg {
    struct kvb_msg *next;
    void *req;        // ucp_am_recv_data_nbx request of a rendezvous message, or NULL
    int32_t status;   // UCS_OK once the data is complete; an error if receiving it failed
    int32_t pending;  // 1 while a rendezvous receive is in flight
    uint32_t hlen;
    uint32_t pad;
    uint64_t dlen;
    unsigned char buf[]; // header (hlen bytes) then data (dlen bytes)
} kvb_msg;

// kvb_errev is an endpoint error reported by UCX's error callback.
typedef struct kvb_errev {
    uint64_t link;
    int32_t status;
    int32_t pad;
} kvb_errev;

#define KVB_MAX_ERRS 1024

typedef struct kvb_worker {
    ucp_worker_h w;
    kvb_errev errs[KVB_MAX_ERRS];
    uint32_t nerrs;
    uint32_t lost_errs; // error events beyond KVB_MAX_ERRS (their links fail at their next use)
    kvb_msg *head, *tail;
} kvb_worker;

typedef struct kvb_ep {
    kvb_worker *kw;
    uint64_t link;
    ucp_ep_h ep;
} kvb_ep;

// kvb_config is one UCX configuration entry (name without the UCX_ prefix).
typedef struct kvb_kv {
    const char *key;
    const char *val;
} kvb_kv;

ucs_status_t kvb_context_create(const kvb_kv *kv, int n, ucp_context_h *out, char *err, size_t errlen);
void kvb_context_destroy(ucp_context_h ctx);
void kvb_version(unsigned *major, unsigned *minor, unsigned *release);

ucs_status_t kvb_worker_create(ucp_context_h ctx, kvb_worker **out, int *efd, void **addr, size_t *addrlen);
void kvb_worker_destroy(kvb_worker *kw);
void kvb_address_release(kvb_worker *kw, void *addr);
unsigned kvb_progress(kvb_worker *kw);
ucs_status_t kvb_arm(kvb_worker *kw);

ucs_status_t kvb_mem_map(ucp_context_h ctx, void *addr, size_t len, ucp_mem_h *memh, void **rkey, size_t *rkeylen);
void kvb_mem_unmap(ucp_context_h ctx, ucp_mem_h memh);
void kvb_rkey_buffer_release(void *rkey);

ucs_status_t kvb_ep_create(kvb_worker *kw, const void *addr, uint64_t link, kvb_ep **out);
void *kvb_ep_close(kvb_ep *e, int force);
void kvb_ep_free(kvb_ep *e);
void *kvb_flush(kvb_ep *e);
ucs_status_t kvb_rkey_unpack(kvb_ep *e, const void *buf, ucp_rkey_h *out);
void kvb_rkey_destroy(ucp_rkey_h rkey);
void *kvb_post(kvb_ep *e, int write, const kvb_piece *p, size_t n, const ucp_rkey_h *rkeys, ucs_status_t *first);
void *kvb_am_send(kvb_ep *e, const kvb_am_hdr *h, const char *name, const void *data, size_t dlen, int reply, void **buf);

int kvb_is_err(void *req);
ucs_status_t kvb_ptr_status(void *req);
ucs_status_t kvb_request_status(void *req);
void kvb_request_free(void *req);

kvb_msg *kvb_msg_pop(kvb_worker *kw);
void kvb_msg_free(kvb_msg *m);
unsigned char *kvb_msg_data(kvb_msg *m);
uint32_t kvb_errs_take(kvb_worker *kw, kvb_errev *out, uint32_t max, uint32_t *lost);
const char *kvb_status_string(ucs_status_t st);
char *kvb_ep_info(kvb_ep *e);

#endif
