/*
 * moefuse_ep_dispatch and moefuse_ep_combine: rows out to the experts' ranks in the 3-D masked
 * layout, and their outputs back to the tokens' ranks as the top-k sum. docs/NUMERICS.md
 * "Expert parallelism" fixes the order of the rows and of the sum. In the normal mode each call
 * makes one small exchange in host memory before its rows, which agrees on one status for
 * every rank (a refusal, an expert over its Tmax), so that no rank waits for one that
 * returned. The low-latency mode (ep_ll.c) has no such exchange.
 */
#include "core/core.h"
#include "core/options.h"
#include "core/ops_internal.h"
#include "ep/ep_internal.h"
#include "ep/ep_ll.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- dispatch */

typedef struct dispatch_call {
    mf_ep_payload pay;        /* what a row carries (ep_payload.h) */
    moefuse_tensor rs;        /* recv_scales, rank 3 (f8 rows) */
    int64_t local_experts, tmax;
    bool low_latency;
    int64_t cap;              /* low-latency: max_tokens */
} dispatch_call;

static moefuse_status check_dispatch(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                     const moefuse_tensor *x, const moefuse_tensor *x_scales,
                                     const moefuse_routing *routing,
                                     const moefuse_tensor *recv_x,
                                     const moefuse_tensor *recv_scales,
                                     const moefuse_tensor *recv_counts,
                                     const moefuse_ep_dispatch_options *in, dispatch_call *d)
{
    moefuse_ep_dispatch_options opt = {0};
    if (in)
        opt = *in;
    MF_TRY(mf_ep_backend_check(ctx, op, g));
    MF_TRY(MF_CHECK_RESERVED(ctx, op, "dispatch options", opt.reserved));
    if (opt.mode != MOEFUSE_EP_NORMAL && opt.mode != MOEFUSE_EP_LOW_LATENCY)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT, "%s: mode %d is not a moefuse_ep_mode",
                        op, (int)opt.mode);
    if (opt.mode == MOEFUSE_EP_NORMAL && opt.max_tokens != 0)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: max_tokens is %d; it is the low-latency mode's (0 in the normal "
                        "mode)",
                        op, (int)opt.max_tokens);
    d->low_latency = opt.mode == MOEFUSE_EP_LOW_LATENCY;
    d->cap = opt.max_tokens;
    MF_TRY(mf_ep_payload_check(ctx, op, x, x_scales, routing, opt.quantize != 0, false,
                               &opt.act, &d->pay));
    const int64_t E = g->local_experts, K = d->pay.model_dim;
    const moefuse_dtype rdt = d->pay.fp8 ? MOEFUSE_F8_E4M3 : x->dtype;
    MF_TRY(mf_check_tensor(ctx, op, "recv_x", recv_x, 3, MF_DT(rdt)));
    d->local_experts = E;
    d->tmax = recv_x->shape[1];
    const int64_t want[3] = {E, d->tmax, K};
    MF_TRY(mf_expect_shape(ctx, op, "recv_x", recv_x, want,
                           "[E_local, Tmax, K] from the group and x"));
    if (d->pay.fp8)
        MF_TRY(mf_check_scales(ctx, op, "recv_scales", recv_scales, &d->pay.act, true, E,
                               d->tmax, K / 128, &d->rs));
    else if (mf_present(recv_scales))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: recv_scales is given but recv_x is %s, not f8_e4m3", op,
                        moefuse_dtype_name(rdt));
    MF_TRY(mf_check_tensor(ctx, op, "recv_counts", recv_counts, 1, MF_DT(MOEFUSE_I32)));
    MF_TRY(mf_expect_shape(ctx, op, "recv_counts", recv_counts, &E, "[E_local]"));
    if (d->low_latency)
        MF_TRY(mf_ep_ll_check(ctx, op, g, &d->pay, routing->topk_ids.shape[1], d->cap, d->tmax));
    const mf_operand ops[] = {
        {"x", x, false},
        {"x_scales", x_scales, false},
        {"routing.topk_ids", &routing->topk_ids, false},
        {"routing.topk_weights", &routing->topk_weights, false},
        {"recv_x", recv_x, true},
        {"recv_scales", recv_scales, true},
        {"recv_counts", recv_counts, true},
    };
    bool idle; /* a rank with nothing to write still sends its rows */
    return mf_check_outputs(ctx, op, ops, sizeof ops / sizeof ops[0], &idle);
}

/*
 * The steps, each rank in step with the others: the arguments, the route's send side and the
 * rows packed, then the call's one host exchange, which every rank takes part in and which
 * agrees on one status (a refusal, an expert over its Tmax); then the rows; then the outputs.
 * (A rank that runs out of memory after that exchange leaves the others waiting, as a rank
 * leaving an NCCL collective does.)
 */
static moefuse_status dispatch(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                               const moefuse_tensor *x, const moefuse_tensor *x_scales,
                               const moefuse_routing *routing, const moefuse_tensor *recv_x,
                               const moefuse_tensor *recv_scales,
                               const moefuse_tensor *recv_counts,
                               const moefuse_ep_dispatch_options *opt, moefuse_ep_handle **handle)
{
    if (!handle || !g)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: %s is NULL", op,
                        !g ? "group" : "handle");
    *handle = NULL;
    dispatch_call d;
    memset(&d, 0, sizeof d);
    moefuse_status st = check_dispatch(ctx, op, g, x, x_scales, routing, recv_x, recv_scales,
                                       recv_counts, opt, &d);
    moefuse_ep_handle *h = calloc(1, sizeof *h);
    if (st == MOEFUSE_OK && !h)
        st = mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate the handle", op);
    if (opt && opt->mode == MOEFUSE_EP_LOW_LATENCY) { /* no vote: see ep_ll.c */
        if (st == MOEFUSE_OK)
            st = mf_ep_ll_dispatch(ctx, op, g, &d.pay, x, routing, recv_x, &d.rs, recv_counts,
                                   d.cap, h);
        if (st != MOEFUSE_OK) {
            moefuse_ep_handle_destroy(h);
            return st;
        }
        h->group = g;
        h->model_dim = d.pay.model_dim;
        h->local_experts = d.local_experts;
        h->tmax = d.tmax;
        *handle = h;
        return MOEFUSE_OK;
    }
    mf_ep_route none;
    memset(&none, 0, sizeof none);
    mf_ep_route *route = h ? &h->route : &none;
    void *ids_host = NULL, *wts_host = NULL, *rows = NULL, *recv = NULL;
    moefuse_tensor ids, wts;
    if (st == MOEFUSE_OK)
        st = mf_ep_to_host(ctx, op, &routing->topk_ids, &ids_host, &ids);
    if (st == MOEFUSE_OK)
        st = mf_ep_to_host(ctx, op, &routing->topk_weights, &wts_host, &wts);
    if (st == MOEFUSE_OK)
        st = mf_ep_route_local(ctx, op, g, &ids, &wts, route);
    free(ids_host);
    free(wts_host);
    if (st == MOEFUSE_OK)
        st = mf_ep_payload_pack(ctx, op, g, &d.pay, x, route, &rows);
    st = mf_ep_route_agree(ctx, op, g, st, d.tmax, route);
    const int64_t E = d.local_experts, n = route->n_recv;
    const int64_t *cnt = route->local_rows; /* each local expert's rows, from the exchange */
    int64_t *fill = NULL;
    int32_t *cnt32 = NULL;
    if (st == MOEFUSE_OK) {
        fill = calloc((size_t)(E > 0 ? E : 1), sizeof *fill);
        cnt32 = malloc(sizeof *cnt32 * (size_t)(E > 0 ? E : 1));
        h->recv_row = malloc(sizeof *h->recv_row * (size_t)(n > 0 ? n : 1));
        if (!fill || !cnt32 || !h->recv_row)
            st = mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                          "%s: cannot allocate %lld received rows", op, (long long)n);
    }
    if (st == MOEFUSE_OK)
        st = mf_ep_scratch(ctx, op, g, MF_EP_RECV, d.pay.row_bytes * (size_t)n, &recv);
    if (st == MOEFUSE_OK)
        st = mf_ep_exchange_rows(ctx, op, g, route, 0, rows, d.pay.row_bytes, recv);
    if (st == MOEFUSE_OK) {
        /* by source rank, then as sent: each expert's rows in that order */
        for (int64_t i = 0; i < n; i++) {
            const int64_t e = route->recv_expert[i];
            h->recv_row[i] = e * d.tmax + fill[e]++;
        }
        st = mf_ep_payload_unpack(ctx, &d.pay, recv, n, h->recv_row, recv_x, &d.rs,
                                  d.pay.act.scale_layout, cnt);
    }
    if (st == MOEFUSE_OK && E > 0) {
        for (int64_t e = 0; e < E; e++)
            cnt32[e] = (int32_t)cnt[e];
        st = ctx->backend->buffer_write(ctx, ctx->state, recv_counts->data,
                                        (size_t)recv_counts->offset, cnt32,
                                        sizeof *cnt32 * (size_t)E);
    }
    free(cnt32);
    free(fill);
    mf_ep_route_free(&none);
    if (st != MOEFUSE_OK) {
        moefuse_ep_handle_destroy(h);
        return st;
    }
    h->group = g;
    h->model_dim = d.pay.model_dim;
    h->local_experts = E;
    h->tmax = d.tmax;
    *handle = h;
    return MOEFUSE_OK;
}

moefuse_status moefuse_ep_dispatch(moefuse_context *ctx, moefuse_ep_group *group,
                                   const moefuse_tensor *x, const moefuse_tensor *x_scales,
                                   const moefuse_routing *routing, const moefuse_tensor *recv_x,
                                   const moefuse_tensor *recv_scales,
                                   const moefuse_tensor *recv_counts,
                                   const moefuse_ep_dispatch_options *opt,
                                   moefuse_ep_handle **handle)
{
    static const char op[] = "ep_dispatch";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, dispatch(ctx, op, group, x, x_scales, routing, recv_x, recv_scales,
                                  recv_counts, opt, handle));
}

/* ----------------------------------------------------------------- combine */

static moefuse_status check_combine(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                    const moefuse_ep_handle *h, const moefuse_tensor *y,
                                    const moefuse_tensor *out)
{
    MF_TRY(mf_ep_backend_check(ctx, op, g));
    if (h->group != g)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: the handle comes from a dispatch on another group", op);
    MF_TRY(mf_check_tensor(ctx, op, "y", y, 3, MF_FLOATS));
    const int64_t wy[3] = {h->local_experts, h->tmax, h->model_dim};
    MF_TRY(mf_expect_shape(ctx, op, "y", y, wy, "[E_local, Tmax, K] of the dispatch's recv_x"));
    MF_TRY(mf_check_tensor(ctx, op, "out", out, 2, MF_FLOATS));
    const int64_t wo[2] = {h->route.tokens, h->model_dim};
    MF_TRY(mf_expect_shape(ctx, op, "out", out, wo, "[M, K] of the dispatch's x"));
    const mf_operand ops[] = {{"y", y, false}, {"out", out, true}};
    bool idle;
    return mf_check_outputs(ctx, op, ops, 2, &idle);
}

static moefuse_status combine(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                              const moefuse_ep_handle *h, const moefuse_tensor *y,
                              const moefuse_tensor *out)
{
    if (!g || !h)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: %s is NULL", op,
                        !g ? "group" : "handle");
    if (h->low_latency) {
        MF_TRY(check_combine(ctx, op, g, h, y, out));
        return mf_ep_ll_combine(ctx, op, g, h, y, out);
    }
    const int64_t K = h->model_dim;
    const mf_ep_route *r = &h->route;
    const size_t row = sizeof(float) * (size_t)K;
    void *send = NULL, *back = NULL;
    moefuse_status st = check_combine(ctx, op, g, h, y, out);
    if (st == MOEFUSE_OK)
        st = mf_ep_scratch(ctx, op, g, MF_EP_SEND, row * (size_t)r->n_recv, &send);
    if (st == MOEFUSE_OK)
        st = mf_ep_scratch(ctx, op, g, MF_EP_BACK, row * (size_t)r->n_sent, &back);
    if (st == MOEFUSE_OK && r->n_recv > 0) { /* the received rows' outputs, as f32 */
        mf_ep_rows_args a;
        memset(&a, 0, sizeof a);
        a.rows = *y;
        a.index = h->recv_row;
        a.n = r->n_recv;
        a.to_f32 = true;
        a.buffer = send;
        a.row_bytes = row;
        st = ctx->backend->ep_gather(ctx, ctx->state, &a);
    }
    st = mf_ep_vote_on(ctx, op, g, st); /* the call's one host exchange */
    if (st == MOEFUSE_OK)
        st = mf_ep_exchange_rows(ctx, op, g, r, 1, send, row, back);
    if (st == MOEFUSE_OK)
        st = mf_ep_reduce(ctx, r, back, K, out);
    return st;
}

moefuse_status moefuse_ep_combine(moefuse_context *ctx, moefuse_ep_group *group,
                                  const moefuse_ep_handle *handle, const moefuse_tensor *y,
                                  const moefuse_tensor *out)
{
    static const char op[] = "ep_combine";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, combine(ctx, op, group, handle, y, out));
}
