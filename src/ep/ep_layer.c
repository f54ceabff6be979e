/*
 * The expert-parallel layer in one call: dispatch, this rank's experts, combine. The received
 * rows run as routed slots of one row each (k = 1, the local expert as the id), compact, with
 * no masked padding; the experts' outputs come back un-reduced in f32 and are summed on the
 * tokens' rank in slot order. On the CPU backend each slot's row is the same whatever the
 * batch around it (docs/NUMERICS.md, MoE), so the layer is bit for bit the one-device layer's.
 */
#include "core/core.h"
#include "core/ops_internal.h"
#include "ep/ep_internal.h"
#include "ep/ep_payload.h"

#include <stdlib.h>
#include <string.h>

/* The buffers of this rank's part of a layer. */
typedef struct layer_bufs {
    char *sent, *recv;  /* the rows out, the rows in */
    int32_t *ids;       /* [R]: each received row's local expert */
    void *h;            /* [R, 1, I]: the gate's h (x's dtype, or codes) */
    float *xs, *hs;     /* FP8: [R, K / 128] and [R, I / 128] row-major scales */
    float *y;           /* [R, 1, K]: the experts' outputs, un-reduced */
    float *back, *acc;  /* [n_sent, K]: the outputs of this rank's slots; [K] */
} layer_bufs;

static void bufs_free(layer_bufs *b)
{
    free(b->sent);
    free(b->recv);
    free(b->ids);
    free(b->h);
    free(b->xs);
    free(b->hs);
    free(b->y);
    free(b->back);
    free(b->acc);
}

static size_t at_least_1(int64_t n)
{
    return (size_t)(n > 0 ? n : 1);
}

/* This rank's weights hold its E_local experts at x's K (the rest the gate and final check). */
static moefuse_status check_weights(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                    const moefuse_tensor *w1, const moefuse_tensor *w2,
                                    int64_t K, int64_t *inter)
{
    if (!w1 || !w2)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: %s is NULL", op, !w1 ? "w1" : "w2");
    if (w1->rank != 3 || w2->rank != 3)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: %s has rank %d; it must be 3", op,
                        w1->rank != 3 ? "w1" : "w2", (int)(w1->rank != 3 ? w1->rank : w2->rank));
    if (w1->shape[0] != g->local_experts || w2->shape[0] != g->local_experts ||
        w1->shape[2] != K || w2->shape[1] != K)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: w1 and w2 must be [E_local = %d, 2I, K = %lld] and [E_local, K, I] "
                        "(this rank's experts)",
                        op, (int)g->local_experts, (long long)K);
    *inter = w2->shape[2];
    return MOEFUSE_OK;
}

static moefuse_status check_out(moefuse_context *ctx, const char *op, const moefuse_tensor *out,
                                const moefuse_tensor *x, const moefuse_routing *routing)
{
    MF_TRY(mf_check_tensor(ctx, op, "out", out, 2, MF_FLOATS));
    MF_TRY(mf_expect_shape(ctx, op, "out", out, x->shape, "[M, K] as x"));
    const mf_operand ops[] = {{"x", x, false},
                              {"routing.topk_ids", &routing->topk_ids, false},
                              {"routing.topk_weights", &routing->topk_weights, false},
                              {"out", out, true}};
    bool idle;
    return mf_check_outputs(ctx, op, ops, sizeof ops / sizeof ops[0], &idle);
}

/* The experts on the received rows: y [R, 1, K] f32. */
typedef struct layer_experts {
    const moefuse_tensor *w1, *w1_scales, *w2, *w2_scales, *b1, *b2;
    const moefuse_moe_options *opt;         /* bf16 */
    const moefuse_fp8_moe_options *fp8_opt; /* FP8 */
} layer_experts;

static moefuse_status run_experts(moefuse_context *ctx, const char *op, const mf_ep_payload *pay,
                                  const layer_experts *ex, moefuse_dtype x_dtype, int64_t R,
                                  int64_t I, layer_bufs *b)
{
    const int64_t K = pay->model_dim;
    const int64_t xs_shape[2] = {R, K}, ids_shape[2] = {R, 1}, h_shape[3] = {R, 1, I},
                  y_shape[3] = {R, 1, K};
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = moefuse_tensor_dense(b->ids, MOEFUSE_I32, 2, ids_shape);
    const moefuse_tensor y = moefuse_tensor_dense(b->y, MOEFUSE_F32, 3, y_shape);
    if (!pay->fp8) {
        const moefuse_tensor xr = moefuse_tensor_dense(b->recv, x_dtype, 2, xs_shape);
        const moefuse_tensor h = moefuse_tensor_dense(b->h, x_dtype, 3, h_shape);
        MF_TRY(mf_moe_gate_call(ctx, op, &xr, ex->w1, ex->b1, &rt, &h, ex->opt, NULL));
        return mf_moe_final_call(ctx, op, &h, ex->w2, ex->b2, &rt, &y, ex->opt, NULL);
    }
    const int64_t xsc[2] = {R, K / 128}, hsc[2] = {R, I / 128};
    const moefuse_tensor xr = moefuse_tensor_dense(b->recv, MOEFUSE_F8_E4M3, 2, xs_shape);
    const moefuse_tensor xs = moefuse_tensor_dense(b->xs, MOEFUSE_F32, 2, xsc);
    const moefuse_tensor h = moefuse_tensor_dense(b->h, MOEFUSE_F8_E4M3, 3, h_shape);
    const moefuse_tensor hs = moefuse_tensor_dense(b->hs, MOEFUSE_F32, 2, hsc);
    moefuse_fp8_moe_options o;
    memset(&o, 0, sizeof o);
    if (ex->fp8_opt)
        o = *ex->fp8_opt;
    o.act = pay->act; /* normalised: its ue8m0 and eps; the scales here are row-major f32 */
    o.act.scale_layout = MOEFUSE_SCALE_ROW_MAJOR;
    MF_TRY(mf_moe_gate_fp8_call(ctx, op, &xr, &xs, ex->w1, ex->w1_scales, ex->b1, &rt, &h, &hs,
                                &o, NULL));
    return mf_moe_final_fp8_call(ctx, op, &h, &hs, ex->w2, ex->w2_scales, ex->b2, &rt, &y, &o,
                                 NULL);
}

/* FP8: the received rows made compact in place, row i's codes at recv + i K (never past where
   row i began) and its scales in b->xs; before the codes move, the scales are read. */
static void compact_rows(const mf_ep_payload *pay, int64_t R, layer_bufs *b)
{
    if (!pay->fp8)
        return; /* x's rows as they arrived */
    const int64_t K = pay->model_dim, G = pay->groups;
    for (int64_t i = 0; i < R; i++) {
        const char *row = b->recv + (size_t)i * pay->row_bytes;
        memcpy(b->xs + i * G, row + K, sizeof(float) * (size_t)G);
        memmove(b->recv + i * K, row, (size_t)K);
    }
}

static moefuse_status layer(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                            const moefuse_tensor *x, const moefuse_tensor *x_scales,
                            const moefuse_routing *routing, const moefuse_tensor *out, bool fp8,
                            const moefuse_quant_options *act, const layer_experts *ex)
{
    if (!g)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: group is NULL", op);
    mf_ep_payload pay;
    int64_t I = 0;
    moefuse_status st = mf_ep_backend_check(ctx, op);
    if (st == MOEFUSE_OK && !fp8 && x && x->dtype == MOEFUSE_F8_E4M3)
        st = mf_error(ctx, MOEFUSE_ERR_DTYPE,
                      "%s: x is f8_e4m3; moefuse_ep_moe_forward_fp8 takes FP8 layers", op);
    if (st == MOEFUSE_OK)
        st = mf_ep_payload_check(ctx, op, x, x_scales, routing,
                                 fp8 && x && x->dtype != MOEFUSE_F8_E4M3, act, &pay);
    if (st == MOEFUSE_OK)
        st = check_weights(ctx, op, g, ex->w1, ex->w2, pay.model_dim, &I);
    if (st == MOEFUSE_OK)
        st = check_out(ctx, op, out, x, routing);
    MF_TRY(mf_ep_vote_on(ctx, op, g, st));

    mf_ep_route r;
    MF_TRY(mf_ep_route_make(ctx, op, g, &routing->topk_ids, &routing->topk_weights, &r));
    const int64_t R = r.n_recv, K = pay.model_dim;
    const size_t hsize = fp8 ? 1 : moefuse_dtype_size(x->dtype);
    layer_bufs b;
    memset(&b, 0, sizeof b);
    b.recv = malloc(pay.row_bytes * at_least_1(R));
    b.ids = malloc(sizeof *b.ids * at_least_1(R));
    b.h = malloc(hsize * at_least_1(R * I));
    b.y = malloc(sizeof *b.y * at_least_1(R * K));
    b.back = malloc(sizeof *b.back * at_least_1(r.n_sent * K));
    b.acc = malloc(sizeof *b.acc * at_least_1(K));
    if (fp8) {
        b.xs = malloc(sizeof *b.xs * at_least_1(R * (K / 128)));
        b.hs = malloc(sizeof *b.hs * at_least_1(R * (I / 128)));
    }
    st = b.recv && b.ids && b.h && b.y && b.back && b.acc && (!fp8 || (b.xs && b.hs))
             ? MOEFUSE_OK
             : mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                        "%s: cannot allocate the buffers of %lld received rows", op,
                        (long long)R);
    if (st == MOEFUSE_OK)
        st = mf_ep_payload_pack(ctx, op, &pay, x, &r, &b.sent);
    st = mf_ep_vote_on(ctx, op, g, st);
    if (st == MOEFUSE_OK)
        st = mf_ep_exchange_rows(ctx, op, g, &r, 0, b.sent, pay.row_bytes, b.recv);
    if (st == MOEFUSE_OK) {
        memcpy(b.ids, r.recv_expert, sizeof *b.ids * (size_t)R);
        compact_rows(&pay, R, &b);
        if (R > 0)
            st = run_experts(ctx, op, &pay, ex, x->dtype, R, I, &b);
        st = mf_ep_vote_on(ctx, op, g, st); /* an expert step that failed stops every rank */
    }
    if (st == MOEFUSE_OK)
        st = mf_ep_exchange_rows(ctx, op, g, &r, 1, b.y, sizeof(float) * (size_t)K, b.back);
    if (st == MOEFUSE_OK)
        mf_ep_reduce(&r, b.back, K, b.acc, out);
    bufs_free(&b);
    mf_ep_route_free(&r);
    return st;
}

moefuse_status moefuse_ep_moe_forward(moefuse_context *ctx, moefuse_ep_group *group,
                                      const moefuse_tensor *x, const moefuse_tensor *w1,
                                      const moefuse_tensor *w2, const moefuse_tensor *b1,
                                      const moefuse_tensor *b2, const moefuse_routing *routing,
                                      const moefuse_tensor *out, const moefuse_moe_options *opt)
{
    static const char op[] = "ep_moe_forward";
    MF_TRY(mf_enter(ctx, op));
    const layer_experts ex = {w1, NULL, w2, NULL, b1, b2, opt, NULL};
    return mf_leave(ctx, layer(ctx, op, group, x, NULL, routing, out, false, NULL, &ex));
}

moefuse_status moefuse_ep_moe_forward_fp8(
    moefuse_context *ctx, moefuse_ep_group *group, const moefuse_tensor *x,
    const moefuse_tensor *x_scales, const moefuse_tensor *w1, const moefuse_tensor *w1_scales,
    const moefuse_tensor *w2, const moefuse_tensor *w2_scales, const moefuse_tensor *b1,
    const moefuse_tensor *b2, const moefuse_routing *routing, const moefuse_tensor *out,
    const moefuse_fp8_moe_options *opt)
{
    static const char op[] = "ep_moe_forward_fp8";
    MF_TRY(mf_enter(ctx, op));
    const layer_experts ex = {w1, w1_scales, w2, w2_scales, b1, b2, NULL, opt};
    return mf_leave(ctx, layer(ctx, op, group, x, x_scales, routing, out, true,
                               opt ? &opt->act : NULL, &ex));
}
