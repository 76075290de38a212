//go:build ucx && cgo

// The C side of the UCX backend; see ucx_shim.h. No callbacks reach Go: UCX's endpoint-error
// and active-message callbacks record what happened in the worker's own queues, which the
// owning goroutine drains after every progress call, and requests are polled with
// ucp_request_check_status.

#include "ucx_shim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ucs_status_t kvb_context_create(const kvb_kv *kv, int n, ucp_context_h *out, char *err, size_t errlen)
{
    ucp_config_t *cfg;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        snprintf(err, errlen, "reading the UCX configuration: %s", ucs_status_string(st));
        return st;
    }
    for (int i = 0; i < n; i++) {
        st = ucp_config_modify(cfg, kv[i].key, kv[i].val);
        if (st != UCS_OK) {
            snprintf(err, errlen, "UCX_%s=%s: %s", kv[i].key, kv[i].val, ucs_status_string(st));
            ucp_config_release(cfg);
            return st;
        }
    }
    ucp_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    p.mt_workers_shared = 1;
    p.name = "kvbridge";
    st = ucp_init(&p, cfg, out);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_init: %s", ucs_status_string(st));
    }
    return st;
}

void kvb_context_destroy(ucp_context_h ctx) { ucp_cleanup(ctx); }

void kvb_version(unsigned *major, unsigned *minor, unsigned *release)
{
    ucp_get_version(major, minor, release);
}

// kvb_ack_done frees an acknowledgement once sent.
static void kvb_ack_done(void *request, ucs_status_t status, void *user_data)
{
    (void)status;
    free(user_data);
    ucp_request_free(request);
}

// kvb_ack answers a hello on the endpoint it arrived on. It leaves after the wire-up messages
// of that endpoint, so that once the sender has it, an abrupt close of the sender's endpoint
// no longer finds a wire-up message of ours pending (UCX 1.13 asserts on that).
static void kvb_ack(const kvb_am_hdr *hello, const ucp_am_recv_param_t *param)
{
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || param->reply_ep == NULL) {
        return;
    }
    kvb_am_hdr *ack = calloc(1, sizeof(*ack));
    if (ack == NULL) {
        return;
    }
    ack->kind = KVB_AM_HELLO_ACK;
    ack->seq = hello->seq;
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_EAGER;
    p.cb.send = kvb_ack_done;
    p.user_data = ack;
    void *r = ucp_am_send_nbx(param->reply_ep, KVB_AM_NOTIF, ack, sizeof(*ack), NULL, 0, &p);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        free(ack); // completed (or failed) at once: the callback does not run
    }
}

// kvb_am_cb queues a received notification on its worker. Eager data is copied at once; a
// rendezvous message is received into the queued buffer and stays pending until done, so the
// queue keeps arrival order. A hello is answered (kvb_ack) before it is queued.
static ucs_status_t kvb_am_cb(void *arg, const void *header, size_t hlen, void *data, size_t dlen,
                              const ucp_am_recv_param_t *param)
{
    kvb_worker *kw = arg;
    if (hlen == sizeof(kvb_am_hdr) && ((const kvb_am_hdr *)header)->kind == KVB_AM_HELLO) {
        kvb_ack(header, param);
    }
    kvb_msg *m = malloc(sizeof(*m) + hlen + dlen);
    if (m == NULL) {
        return UCS_OK; // dropped; the sender's message is lost as if the queue overflowed
    }
    memset(m, 0, sizeof(*m));
    m->hlen = (uint32_t)hlen;
    m->dlen = dlen;
    memcpy(m->buf, header, hlen);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        ucp_request_param_t rp;
        memset(&rp, 0, sizeof(rp));
        void *r = ucp_am_recv_data_nbx(kw->w, data, m->buf + hlen, dlen, &rp);
        if (UCS_PTR_IS_ERR(r)) {
            m->status = UCS_PTR_STATUS(r);
        } else if (r != NULL) {
            m->req = r;
            m->pending = 1;
        }
    } else if (dlen > 0) {
        memcpy(m->buf + hlen, data, dlen);
    }
    if (kw->tail != NULL) {
        kw->tail->next = m;
    } else {
        kw->head = m;
    }
    kw->tail = m;
    return UCS_OK;
}

ucs_status_t kvb_worker_create(ucp_context_h ctx, kvb_worker **out, int *efd, void **addr, size_t *addrlen)
{
    kvb_worker *kw = calloc(1, sizeof(*kw));
    if (kw == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    ucs_status_t st = ucp_worker_create(ctx, &wp, &kw->w);
    if (st != UCS_OK) {
        free(kw);
        return st;
    }
    st = ucp_worker_get_efd(kw->w, efd);
    if (st == UCS_OK) {
        ucp_am_handler_param_t hp;
        memset(&hp, 0, sizeof(hp));
        hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                        UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
        hp.id = KVB_AM_NOTIF;
        hp.flags = UCP_AM_FLAG_WHOLE_MSG;
        hp.cb = kvb_am_cb;
        hp.arg = kw;
        st = ucp_worker_set_am_recv_handler(kw->w, &hp);
    }
    if (st == UCS_OK) {
        ucp_address_t *a;
        st = ucp_worker_get_address(kw->w, &a, addrlen);
        *addr = a;
    }
    if (st != UCS_OK) {
        ucp_worker_destroy(kw->w);
        free(kw);
        return st;
    }
    *out = kw;
    return UCS_OK;
}

void kvb_address_release(kvb_worker *kw, void *addr)
{
    ucp_worker_release_address(kw->w, addr);
}

void kvb_worker_destroy(kvb_worker *kw)
{
    kvb_msg *m;
    while ((m = kw->head) != NULL) {
        kw->head = m->next;
        if (m->pending) {
            ucp_request_cancel(kw->w, m->req);
            ucp_request_free(m->req);
        }
        free(m);
    }
    ucp_worker_destroy(kw->w);
    free(kw);
}

unsigned kvb_progress(kvb_worker *kw) { return ucp_worker_progress(kw->w); }

ucs_status_t kvb_arm(kvb_worker *kw) { return ucp_worker_arm(kw->w); }

ucs_status_t kvb_mem_map(ucp_context_h ctx, void *addr, size_t len, ucp_mem_h *memh, void **rkey, size_t *rkeylen)
{
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = addr;
    mp.length = len;
    ucs_status_t st = ucp_mem_map(ctx, &mp, memh);
    if (st != UCS_OK) {
        return st;
    }
    st = ucp_rkey_pack(ctx, *memh, rkey, rkeylen);
    if (st != UCS_OK) {
        ucp_mem_unmap(ctx, *memh);
    }
    return st;
}

void kvb_mem_unmap(ucp_context_h ctx, ucp_mem_h memh) { ucp_mem_unmap(ctx, memh); }

void kvb_rkey_buffer_release(void *rkey) { ucp_rkey_buffer_release(rkey); }

// kvb_err_cb records an endpoint failure; the owning goroutine tears the link down.
static void kvb_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    kvb_ep *e = arg;
    kvb_worker *kw = e->kw;
    (void)ep;
    if (kw->nerrs < KVB_MAX_ERRS) {
        kw->errs[kw->nerrs].link = e->link;
        kw->errs[kw->nerrs].status = status;
        kw->nerrs++;
    } else {
        kw->lost_errs++;
    }
}

ucs_status_t kvb_ep_create(kvb_worker *kw, const void *addr, uint64_t link, kvb_ep **out)
{
    kvb_ep *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    e->kw = kw;
    e->link = link;
    ucp_ep_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = addr;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = kvb_err_cb;
    p.err_handler.arg = e;
    ucs_status_t st = ucp_ep_create(kw->w, &p, &e->ep);
    if (st != UCS_OK) {
        free(e);
        return st;
    }
    *out = e;
    return UCS_OK;
}

void *kvb_ep_close(kvb_ep *e, int force)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    return ucp_ep_close_nbx(e->ep, &p);
}

void kvb_ep_free(kvb_ep *e) { free(e); }

void *kvb_flush(kvb_ep *e)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    return ucp_ep_flush_nbx(e->ep, &p);
}

ucs_status_t kvb_rkey_unpack(kvb_ep *e, const void *buf, ucp_rkey_h *out)
{
    return ucp_ep_rkey_unpack(e->ep, buf, out);
}

void kvb_rkey_destroy(ucp_rkey_h rkey) { ucp_rkey_destroy(rkey); }

// kvb_post starts every piece as a one-sided get (or put) without per-operation completion
// objects, then flushes the endpoint: the flush completes once every operation issued before it
// has completed (for puts: remotely). It returns the flush request (NULL when everything
// completed inside the call, or an error pointer). A piece that fails to start stops the
// loop; the flush still covers the pieces already started.
void *kvb_post(kvb_ep *e, int write, const kvb_piece *pc, size_t n, const ucp_rkey_h *rkeys, ucs_status_t *first)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    *first = UCS_OK;
    size_t i;
    for (i = 0; i < n; i++) {
        void *r;
        if (write) {
            r = ucp_put_nbx(e->ep, (const void *)(uintptr_t)pc[i].laddr, pc[i].len, pc[i].raddr, rkeys[pc[i].rkey], &p);
        } else {
            r = ucp_get_nbx(e->ep, (void *)(uintptr_t)pc[i].laddr, pc[i].len, pc[i].raddr, rkeys[pc[i].rkey], &p);
        }
        if (UCS_PTR_IS_ERR(r)) {
            *first = UCS_PTR_STATUS(r);
            break;
        }
        if (r != NULL) {
            ucp_request_free(r); // completes silently; the flush reports it
        }
    }
    if (i == 0 && *first != UCS_OK) {
        return NULL;
    }
    return ucp_ep_flush_nbx(e->ep, &p);
}

// kvb_am_send sends a notification (header, then the sender's name and the message as data)
// eagerly. Header and data are copied into one malloc'd buffer, returned in *buf, which the
// caller frees once the returned request completes (NULL buf: nothing to free): UCX reads
// both until the send completes.
void *kvb_am_send(kvb_ep *e, const kvb_am_hdr *h, const char *name, const void *data, size_t dlen, int reply, void **buf)
{
    size_t total = sizeof(*h) + h->namelen + dlen;
    char *b = malloc(total);
    *buf = NULL;
    if (b == NULL) {
        return UCS_STATUS_PTR(UCS_ERR_NO_MEMORY);
    }
    memcpy(b, h, sizeof(*h));
    memcpy(b + sizeof(*h), name, h->namelen);
    if (dlen > 0) {
        memcpy(b + sizeof(*h) + h->namelen, data, dlen);
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER | (reply ? UCP_AM_SEND_FLAG_REPLY : 0);
    void *r = ucp_am_send_nbx(e->ep, KVB_AM_NOTIF, b, sizeof(*h), b + sizeof(*h), total - sizeof(*h), &p);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        free(b);
    } else {
        *buf = b;
    }
    return r;
}

int kvb_is_err(void *req) { return UCS_PTR_IS_ERR(req); }

ucs_status_t kvb_ptr_status(void *req) { return UCS_PTR_STATUS(req); }

ucs_status_t kvb_request_status(void *req) { return ucp_request_check_status(req); }

void kvb_request_free(void *req) { ucp_request_free(req); }

kvb_msg *kvb_msg_pop(kvb_worker *kw)
{
    kvb_msg *m = kw->head;
    if (m == NULL) {
        return NULL;
    }
    if (m->pending) {
        ucs_status_t st = ucp_request_check_status(m->req);
        if (st == UCS_INPROGRESS) {
            return NULL; // later messages wait for this one: arrival order is kept
        }
        ucp_request_free(m->req);
        m->req = NULL;
        m->pending = 0;
        m->status = st;
    }
    kw->head = m->next;
    if (kw->head == NULL) {
        kw->tail = NULL;
    }
    m->next = NULL;
    return m;
}

void kvb_msg_free(kvb_msg *m) { free(m); }

unsigned char *kvb_msg_data(kvb_msg *m) { return m->buf; }

uint32_t kvb_errs_take(kvb_worker *kw, kvb_errev *out, uint32_t max, uint32_t *lost)
{
    uint32_t n = kw->nerrs < max ? kw->nerrs : max;
    memcpy(out, kw->errs, n * sizeof(*out));
    memmove(kw->errs, kw->errs + n, (kw->nerrs - n) * sizeof(*out));
    kw->nerrs -= n;
    *lost = kw->lost_errs;
    kw->lost_errs = 0;
    return n;
}

const char *kvb_status_string(ucs_status_t st) { return ucs_status_string(st); }

char *kvb_ep_info(kvb_ep *e)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) {
        return NULL;
    }
    ucp_ep_print_info(e->ep, f);
    fclose(f);
    return buf;
}
