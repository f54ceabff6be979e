/*
 * moefuse_ep_dispatch and moefuse_ep_combine: rows out to the experts' ranks in the 3-D masked
 * layout, and their outputs back to the tokens' ranks as the top-k sum. docs/NUMERICS.md
 * "Expert parallelism" fixes the order of the rows and of the sum. Every refusal is voted on
 * (mf_ep_vote_on) before any rank moves a row, so that no rank waits for one that returned.
 */
#include "core/core.h"
#include "core/options.h"
#include "core/ops_internal.h"
#include "ep/ep_internal.h"
#include "ep/ep_payload.h"
#include "ep/ep_scales.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- dispatch */

typedef struct dispatch_call {
    mf_ep_payload pay;        /* what a row carries (ep_payload.h) */
    moefuse_tensor rs;        /* recv_scales, rank 3 (f8 rows) */
    int64_t local_experts, tmax;
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
    MF_TRY(mf_ep_backend_check(ctx, op));
    MF_TRY(MF_CHECK_RESERVED(ctx, op, "dispatch options", opt.reserved));
    if (opt.mode == MOEFUSE_EP_LOW_LATENCY)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "%s: the low-latency mode is not built yet; use MOEFUSE_EP_NORMAL", op);
    if (opt.mode != MOEFUSE_EP_NORMAL)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT, "%s: mode %d is not a moefuse_ep_mode",
                        op, (int)opt.mode);
    MF_TRY(mf_ep_payload_check(ctx, op, x, x_scales, routing, opt.quantize != 0, &opt.act,
                               &d->pay));
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

/* Each local expert's received rows; the first over Tmax (or -1) in *over. */
static void count_rows(const mf_ep_route *r, int64_t E, int64_t tmax, int64_t *cnt, int64_t *over)
{
    memset(cnt, 0, sizeof *cnt * (size_t)(E > 0 ? E : 1));
    for (int64_t i = 0; i < r->n_recv; i++)
        cnt[r->recv_expert[i]]++;
    *over = -1;
    for (int64_t e = 0; e < E && *over < 0; e++)
        if (cnt[e] > tmax)
            *over = e;
}

/* Zero what the layout pads: rows Tmax .. Ta - 1 of the column-major and packed layouts, and
   the words of the packed rows about to be written (their unused bytes stay 0). */
static void zero_scale_padding(const dispatch_call *d, const int64_t *cnt)
{
    const moefuse_tensor *s = &d->rs;
    const moefuse_scale_layout L = d->pay.act.scale_layout;
    if (L == MOEFUSE_SCALE_ROW_MAJOR)
        return;
    const int64_t words_or_groups = s->shape[1], ta = s->shape[2];
    const size_t es = moefuse_dtype_size(s->dtype);
    for (int64_t e = 0; e < d->local_experts; e++)
        for (int64_t w = 0; w < words_or_groups; w++) {
            const int64_t t0 = L == MOEFUSE_SCALE_PACKED_UE8M0 ? 0 : d->tmax;
            if (L == MOEFUSE_SCALE_PACKED_UE8M0)
                memset(mf_at3(s, e, w, 0), 0, es * (size_t)cnt[e]);
            if (ta > t0)
                memset(mf_at3(s, e, w, d->tmax), 0, es * (size_t)(ta - d->tmax));
        }
}

/* Agrees on one status: this rank's, or the first failing rank's (a full expert named). */
static moefuse_status agree_dispatch(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                     moefuse_status st, int64_t over, int64_t rows, int64_t tmax)
{
    mf_ep_vote me = {(int32_t)st, {(int32_t)over, (int32_t)rows, (int32_t)tmax}}, first;
    int32_t who = -1;
    MF_TRY(mf_ep_agree(ctx, op, g, &me, &first, &who));
    if (who < 0 || st != MOEFUSE_OK)
        return st; /* this rank's own message stands */
    if (first.status == MOEFUSE_ERR_SHAPE && first.detail[0] >= 0)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: local expert %d of rank %d receives %d rows, more than its Tmax = "
                        "%d; no rank wrote anything",
                        op, (int)first.detail[0], (int)who, (int)first.detail[1],
                        (int)first.detail[2]);
    return mf_error(ctx, (moefuse_status)first.status,
                    "%s: rank %d failed (%s); every rank of the group stops with it", op,
                    (int)who, moefuse_status_name((moefuse_status)first.status));
}

/*
 * The steps, each rank in step with the others: the arguments (voted); the route (counts and
 * experts exchanged); every expert's rows against Tmax, and the rows to send, packed (voted);
 * the rows; the outputs, written. (A rank that runs out of host memory inside an exchange
 * leaves the others waiting, as a rank leaving an NCCL collective does.)
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
    moefuse_ep_handle *h = st == MOEFUSE_OK ? calloc(1, sizeof *h) : NULL;
    if (st == MOEFUSE_OK && !h)
        st = mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate the handle", op);
    st = mf_ep_vote_on(ctx, op, g, st);
    if (st != MOEFUSE_OK) {
        free(h);
        return st;
    }
    st = mf_ep_route_make(ctx, op, g, &routing->topk_ids, &routing->topk_weights, &h->route);
    if (st != MOEFUSE_OK) {
        free(h);
        return st;
    }
    const int64_t E = d.local_experts, n = h->route.n_recv;
    int64_t *cnt = malloc(sizeof *cnt * (size_t)(E > 0 ? E : 1)), over = -1;
    int64_t *fill = calloc((size_t)(E > 0 ? E : 1), sizeof *fill);
    char *rows = NULL, *recv = malloc(d.pay.row_bytes * (size_t)(n > 0 ? n : 1));
    h->recv_row = malloc(sizeof *h->recv_row * (size_t)(n > 0 ? n : 1));
    if (!cnt || !fill || !recv || !h->recv_row)
        st = mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate %lld received rows",
                      op, (long long)n);
    if (st == MOEFUSE_OK) {
        count_rows(&h->route, E, d.tmax, cnt, &over);
        if (over >= 0)
            st = mf_error(ctx, MOEFUSE_ERR_SHAPE,
                          "%s: local expert %lld of rank %d receives %lld rows; recv_x holds "
                          "Tmax = %lld",
                          op, (long long)over, (int)g->rank, (long long)cnt[over],
                          (long long)d.tmax);
    }
    if (st == MOEFUSE_OK)
        st = mf_ep_payload_pack(ctx, op, &d.pay, x, &h->route, &rows);
    st = agree_dispatch(ctx, op, g, st, over, over >= 0 ? cnt[over] : 0, d.tmax);
    if (st == MOEFUSE_OK)
        st = mf_ep_exchange_rows(ctx, op, g, &h->route, 0, rows, d.pay.row_bytes, recv);
    if (st == MOEFUSE_OK) {
        /* by source rank, then as sent: each expert's rows in that order */
        if (d.pay.fp8)
            zero_scale_padding(&d, cnt);
        for (int64_t i = 0; i < n; i++) {
            const int64_t e = h->route.recv_expert[i], t = fill[e]++;
            h->recv_row[i] = e * d.tmax + t;
            mf_ep_payload_unpack(&d.pay, recv + (size_t)i * d.pay.row_bytes,
                                 mf_at3(recv_x, e, t, 0), &d.rs, d.pay.act.scale_layout, e, t);
        }
        for (int64_t e = 0; e < E; e++)
            *(int32_t *)mf_at1(recv_counts, e) = (int32_t)cnt[e];
    }
    free(rows);
    free(recv);
    free(cnt);
    free(fill);
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
    MF_TRY(mf_ep_backend_check(ctx, op));
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
    MF_TRY(mf_ep_vote_on(ctx, op, g, check_combine(ctx, op, g, h, y, out)));
    const int64_t K = h->model_dim;
    const mf_ep_route *r = &h->route;
    const size_t row = sizeof(float) * (size_t)K;
    float *send = malloc(row * (size_t)(r->n_recv > 0 ? r->n_recv : 1));
    float *back = malloc(row * (size_t)(r->n_sent > 0 ? r->n_sent : 1));
    float *acc = malloc(row > 0 ? row : 1);
    moefuse_status st = send && back && acc
                            ? MOEFUSE_OK
                            : mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate", op);
    st = mf_ep_vote_on(ctx, op, g, st);
    if (st == MOEFUSE_OK) {
        for (int64_t i = 0; i < r->n_recv; i++) {
            const int64_t e = h->recv_row[i] / h->tmax, t = h->recv_row[i] % h->tmax;
            mf_load_row(send + i * K, mf_at3(y, e, t, 0), y->dtype, K);
        }
        st = mf_ep_exchange_rows(ctx, op, g, r, 1, send, row, back);
    }
    if (st == MOEFUSE_OK)
        mf_ep_reduce(r, back, K, acc, out);
    free(send);
    free(back);
    free(acc);
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
