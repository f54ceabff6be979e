/*
 * The expert-parallel layer in one call: dispatch, this rank's experts, combine. The received
 * rows run as routed slots of one row each (k = 1, the local expert as the id), compact, with
 * no masked padding; the experts' outputs come back un-reduced in f32 and are summed on the
 * tokens' rank in slot order. Shared experts (routing.n_shared) are every rank's own, after
 * its local experts in w1 and w2: a token's shared slots run where the token is, and their
 * outputs join the sum after the routed ones, as in the one-device layer. The experts run in
 * chunks (ep_chunks.h); a chunk's outputs travel back (all_to_all_beside, on a transport that
 * has it) while the next chunk runs. On the CPU backend
 * each slot's row is the same whatever the batch around it (docs/NUMERICS.md, MoE), so the
 * layer is bit for bit the one-device layer's.
 */
#include "core/core.h"
#include "core/ops_internal.h"
#include "ep/ep_chunks.h"
#include "ep/ep_internal.h"
#include "ep/ep_payload.h"

#include <stdlib.h>
#include <string.h>

#define LAYER_CHUNKS 4 /* FP8: chunks of experts whose outputs move while the next one runs */

/* The backend memory of this rank's part of a layer (the group's scratch). */
typedef struct layer_bufs {
    void *sent, *recv; /* the rows out, the rows in */
    void *ids;         /* [R] i32: each received row's local expert */
    void *xq, *xs;     /* FP8: the received codes [R, K] and scales [R, K / 128] f32 */
    void *h, *hs;      /* [R, 1, I]: the gate's h (x's dtype, or codes), FP8 its scales */
    void *y;           /* [R, 1, K] f32: the experts' outputs, un-reduced */
    void *back;        /* [n_sent + M S, K] f32: the outputs of this rank's slots, the routed
                          ones as they came back, then the shared ones */
} layer_bufs;

/* This rank's weights hold its E_local experts and the S shared ones at x's K (the rest the
   gate and final check). */
static moefuse_status check_weights(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                    const moefuse_tensor *w1, const moefuse_tensor *w2,
                                    int64_t K, int64_t S, int64_t *inter)
{
    if (!w1 || !w2)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: %s is NULL", op, !w1 ? "w1" : "w2");
    if (w1->rank != 3 || w2->rank != 3)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: %s has rank %d; it must be 3", op,
                        w1->rank != 3 ? "w1" : "w2", (int)(w1->rank != 3 ? w1->rank : w2->rank));
    const int64_t E = g->local_experts + S;
    if (w1->shape[0] != E || w2->shape[0] != E || w1->shape[2] != K || w2->shape[1] != K)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: w1 and w2 must be [E_local + n_shared = %lld, 2I, K = %lld] and "
                        "[E_local + n_shared, K, I] (this rank's experts, then the shared ones)",
                        op, (long long)E, (long long)K);
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

/* The experts on received rows r0 .. r0 + n - 1, their outputs into y ([n, 1, K] f32 in
   backend memory): each row's output is the same whatever rows run beside it. */
static moefuse_status run_experts(moefuse_context *ctx, const char *op, const mf_ep_payload *pay,
                                  const layer_experts *ex, moefuse_dtype x_dtype, int64_t r0,
                                  int64_t R, int64_t I, const layer_bufs *b, void *y_rows)
{
    if (R == 0)
        return MOEFUSE_OK;
    const int64_t K = pay->model_dim;
    const int64_t x_shape[2] = {R, K}, ids_shape[2] = {R, 1}, h_shape[3] = {R, 1, I},
                  y_shape[3] = {R, 1, K};
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = moefuse_tensor_dense((int32_t *)b->ids + r0, MOEFUSE_I32, 2, ids_shape);
    const moefuse_tensor y = moefuse_tensor_dense(y_rows, MOEFUSE_F32, 3, y_shape);
    if (!pay->fp8) {
        const size_t xs = moefuse_dtype_size(x_dtype);
        const moefuse_tensor xr = moefuse_tensor_dense((char *)b->recv + xs * (size_t)(r0 * K),
                                                       x_dtype, 2, x_shape);
        const moefuse_tensor h = moefuse_tensor_dense((char *)b->h + xs * (size_t)(r0 * I),
                                                      x_dtype, 3, h_shape);
        MF_TRY(mf_moe_gate_call(ctx, op, &xr, ex->w1, ex->b1, &rt, &h, ex->opt, NULL));
        return mf_moe_final_call(ctx, op, &h, ex->w2, ex->b2, &rt, &y, ex->opt, NULL);
    }
    const int64_t xsc[2] = {R, K / 128}, hsc[2] = {R, I / 128};
    const moefuse_tensor xr =
        moefuse_tensor_dense((char *)b->xq + r0 * K, MOEFUSE_F8_E4M3, 2, x_shape);
    const moefuse_tensor xs =
        moefuse_tensor_dense((float *)b->xs + r0 * (K / 128), MOEFUSE_F32, 2, xsc);
    const moefuse_tensor h =
        moefuse_tensor_dense((char *)b->h + r0 * I, MOEFUSE_F8_E4M3, 3, h_shape);
    const moefuse_tensor hs =
        moefuse_tensor_dense((float *)b->hs + r0 * (I / 128), MOEFUSE_F32, 2, hsc);
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

/* The received rows as the experts read them, in the chunks' order (ep_chunks.h): x's rows as
   they came (one chunk: that order), or FP8 rows split into compact codes [R, K] and row-major
   f32 scales [R, K / 128] (the backend's ep_scatter), and each row's local expert as its
   routing id. */
static moefuse_status received_rows(moefuse_context *ctx, const mf_ep_payload *pay,
                                    const mf_ep_route *r, const mf_ep_chunks *ch, layer_bufs *b)
{
    const int64_t R = r->n_recv, K = pay->model_dim;
    if (R == 0)
        return MOEFUSE_OK;
    MF_TRY(ctx->backend->buffer_write(ctx, ctx->state, b->ids, 0, ch->expert,
                                      sizeof(int32_t) * (size_t)R));
    if (!pay->fp8)
        return MOEFUSE_OK;
    const int64_t qshape[3] = {1, R, K}, sshape[3] = {1, R, pay->groups};
    const moefuse_tensor q = moefuse_tensor_dense(b->xq, MOEFUSE_F8_E4M3, 3, qshape);
    const moefuse_tensor s = moefuse_tensor_dense(b->xs, MOEFUSE_F32, 3, sshape);
    return mf_ep_payload_unpack(ctx, pay, b->recv, R, ch->order, &q, &s, MOEFUSE_SCALE_ROW_MAJOR,
                                NULL);
}

/* The rank's own tokens through its S shared experts (local ids E_local .. E_local + S - 1),
   as routed slots: y [M, S, K] f32 into back after the n_sent rows that come back. FP8 rows are
   formed as the routed ones are (packed for every token, then split into codes and scales). */
static moefuse_status run_shared(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                 const mf_ep_payload *pay, const layer_experts *ex,
                                 const moefuse_tensor *x, const mf_ep_route *r, int64_t S,
                                 int64_t I, layer_bufs *b)
{
    const int64_t M = r->tokens, K = pay->model_dim, El = g->local_experts;
    if (S == 0 || M == 0)
        return MOEFUSE_OK;
    int32_t *ids = malloc(sizeof *ids * (size_t)(M * S));
    int64_t *token = malloc(sizeof *token * (size_t)M);
    if (!ids || !token) {
        free(ids);
        free(token);
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate", op);
    }
    for (int64_t m = 0; m < M; m++) {
        token[m] = m;
        for (int64_t j = 0; j < S; j++)
            ids[m * S + j] = (int32_t)(El + j);
    }
    void *dids = NULL, *h = NULL;
    const size_t id_bytes = sizeof *ids * (size_t)(M * S);
    moefuse_status st = mf_ep_scratch(ctx, op, g, MF_EP_SIDS, id_bytes, &dids);
    if (st == MOEFUSE_OK)
        st = ctx->backend->buffer_write(ctx, ctx->state, dids, 0, ids, id_bytes);
    free(ids);
    const int64_t ids_shape[2] = {M, S}, h_shape[3] = {M, S, I}, y_shape[3] = {M, S, K};
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = moefuse_tensor_dense(dids, MOEFUSE_I32, 2, ids_shape);
    const moefuse_tensor y = moefuse_tensor_dense(
        (char *)b->back + sizeof(float) * (size_t)(r->n_sent * K), MOEFUSE_F32, 3, y_shape);
    if (st == MOEFUSE_OK && !pay->fp8) {
        st = mf_ep_scratch(ctx, op, g, MF_EP_SH,
                           moefuse_dtype_size(x->dtype) * (size_t)(M * S * I), &h);
        const moefuse_tensor th = moefuse_tensor_dense(h, x->dtype, 3, h_shape);
        if (st == MOEFUSE_OK)
            st = mf_moe_gate_call(ctx, op, x, ex->w1, ex->b1, &rt, &th, ex->opt, NULL);
        if (st == MOEFUSE_OK)
            st = mf_moe_final_call(ctx, op, &th, ex->w2, ex->b2, &rt, &y, ex->opt, NULL);
    } else if (st == MOEFUSE_OK) {
        mf_ep_route all;
        memset(&all, 0, sizeof all);
        all.topk = 1;
        all.n_sent = M;
        all.send_slot = token; /* row m: token m */
        void *rows = NULL, *xq = NULL, *xs = NULL, *hs = NULL;
        st = mf_ep_payload_pack(ctx, op, g, pay, x, &all, &rows);
        if (st == MOEFUSE_OK)
            st = mf_ep_scratch(ctx, op, g, MF_EP_SXQ, (size_t)(M * K), &xq);
        if (st == MOEFUSE_OK)
            st = mf_ep_scratch(ctx, op, g, MF_EP_SXS, sizeof(float) * (size_t)(M * (K / 128)),
                               &xs);
        if (st == MOEFUSE_OK)
            st = mf_ep_scratch(ctx, op, g, MF_EP_SH, (size_t)(M * S * I), &h);
        if (st == MOEFUSE_OK)
            st = mf_ep_scratch(ctx, op, g, MF_EP_SHS, sizeof(float) * (size_t)(M * S * (I / 128)),
                               &hs);
        const int64_t q3[3] = {1, M, K}, s3[3] = {1, M, K / 128}, q2[2] = {M, K},
                      s2[2] = {M, K / 128}, hs2[2] = {M * S, I / 128};
        if (st == MOEFUSE_OK) {
            const moefuse_tensor q = moefuse_tensor_dense(xq, MOEFUSE_F8_E4M3, 3, q3);
            const moefuse_tensor sc = moefuse_tensor_dense(xs, MOEFUSE_F32, 3, s3);
            st = mf_ep_payload_unpack(ctx, pay, rows, M, token, &q, &sc, MOEFUSE_SCALE_ROW_MAJOR,
                                      NULL);
        }
        moefuse_fp8_moe_options o;
        memset(&o, 0, sizeof o);
        if (ex->fp8_opt)
            o = *ex->fp8_opt;
        o.act = pay->act;
        o.act.scale_layout = MOEFUSE_SCALE_ROW_MAJOR;
        const moefuse_tensor tx = moefuse_tensor_dense(xq, MOEFUSE_F8_E4M3, 2, q2);
        const moefuse_tensor txs = moefuse_tensor_dense(xs, MOEFUSE_F32, 2, s2);
        const moefuse_tensor th = moefuse_tensor_dense(h, MOEFUSE_F8_E4M3, 3, h_shape);
        const moefuse_tensor ths = moefuse_tensor_dense(hs, MOEFUSE_F32, 2, hs2);
        if (st == MOEFUSE_OK)
            st = mf_moe_gate_fp8_call(ctx, op, &tx, &txs, ex->w1, ex->w1_scales, ex->b1, &rt, &th,
                                      &ths, &o, NULL);
        if (st == MOEFUSE_OK)
            st = mf_moe_final_fp8_call(ctx, op, &th, &ths, ex->w2, ex->w2_scales, ex->b2, &rt,
                                       &y, &o, NULL);
    }
    free(token);
    return st;
}

/* The sum over a token's routed slots, then its shared ones (weight shared_scale, times its
   shared_weights entry when given: one f32 multiplication, as the one-device layer's). */
static moefuse_status reduce_with_shared(moefuse_context *ctx, const char *op,
                                         const moefuse_routing *routing, const mf_ep_route *r,
                                         const void *back, int64_t K, const moefuse_tensor *out)
{
    const int64_t S = routing->n_shared, M = r->tokens, k = r->topk, slots = k + S;
    if (S == 0)
        return mf_ep_reduce(ctx, r, back, K, out);
    int64_t *row = malloc(sizeof *row * (size_t)(M * slots > 0 ? M * slots : 1));
    float *w = malloc(sizeof *w * (size_t)(M * slots > 0 ? M * slots : 1));
    void *sw_host = NULL;
    moefuse_tensor sw;
    moefuse_status st = row && w ? MOEFUSE_OK
                                 : mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate",
                                            op);
    const bool per_token = mf_present(&routing->shared_weights);
    if (st == MOEFUSE_OK && per_token)
        st = mf_ep_to_host(ctx, op, &routing->shared_weights, &sw_host, &sw);
    const float scale = routing->shared_scale == 0.0f ? 1.0f : routing->shared_scale;
    for (int64_t m = 0; st == MOEFUSE_OK && m < M; m++) {
        const float f =
            per_token ? scale * *(const float *)((const char *)sw.data +
                                                 m * sw.stride[0] * (int64_t)sizeof(float))
                      : scale;
        for (int64_t j = 0; j < slots; j++) {
            row[m * slots + j] = j < k ? r->slot_row[m * k + j] : r->n_sent + m * S + (j - k);
            w[m * slots + j] = j < k ? r->weight[m * k + j] : f;
        }
    }
    if (st == MOEFUSE_OK)
        st = mf_ep_reduce_slots(ctx, row, w, M, slots, back, K, out);
    free(row);
    free(w);
    free(sw_host);
    return st;
}

/* Chunk c's outputs (y, in the experts' order) back to the tokens' ranks, into back (send
   order), queued beside the context's work. */
static moefuse_status chunk_back_beside(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                        const mf_ep_chunks *ch, int32_t c, const void *y,
                                        size_t row, void *back)
{
    const int32_t W = g->world;
    size_t *b = malloc(sizeof *b * 4 * (size_t)W);
    if (!b)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate", op);
    for (int32_t p = 0; p < W; p++) {
        const int64_t q = (int64_t)c * W + p;
        b[p] = (size_t)ch->rows[q] * row;
        b[W + p] = (size_t)ch->start[q] * row;
        b[2 * W + p] = (size_t)ch->back[q] * row;
        b[3 * W + p] = (size_t)ch->back_at[q] * row;
    }
    const moefuse_status st =
        mf_ep_all_to_all_beside(ctx, op, g, y, b, b + W, back, b + 2 * W, b + 3 * W);
    free(b);
    return st;
}

/* The experts chunk by chunk, each chunk's outputs sent back beside the next chunk's work, then
   the shared experts. The vote follows the first chunk, before any output moves; a rank whose
   later step fails stops there, and leaves the others waiting in the exchange as a rank that
   leaves an NCCL collective does (docs/API.md). */
static moefuse_status experts_and_back(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                       moefuse_status st, const mf_ep_payload *pay,
                                       const layer_experts *ex, const moefuse_tensor *x,
                                       const mf_ep_route *r, const mf_ep_chunks *ch, int64_t S,
                                       int64_t I, layer_bufs *b)
{
    const int32_t W = g->world, C = st == MOEFUSE_OK ? ch->count : 1;
    const int64_t R = r->n_recv;
    const size_t row = sizeof(float) * (size_t)pay->model_dim;
    bool sent = false;
    for (int32_t c = 0; c < C; c++) {
        if (st == MOEFUSE_OK) {
            const int64_t r0 = ch->start[(int64_t)c * W];
            const int64_t n = (c + 1 < C ? ch->start[(int64_t)(c + 1) * W] : R) - r0;
            st = run_experts(ctx, op, pay, ex, x->dtype, r0, n, I, b,
                             (char *)b->y + row * (size_t)r0);
        }
        if (c == 0) /* the steps so far: a failure on any rank stops every rank */
            st = mf_ep_vote_on(ctx, op, g, st);
        if (st == MOEFUSE_OK)
            st = chunk_back_beside(ctx, op, g, ch, c, b->y, row, b->back);
        if (st != MOEFUSE_OK)
            break;
        sent = true;
    }
    if (st == MOEFUSE_OK)
        st = run_shared(ctx, op, g, pay, ex, x, r, S, I, b);
    const moefuse_status joined = sent ? mf_ep_join(ctx, op, g) : MOEFUSE_OK;
    return st != MOEFUSE_OK ? st : joined;
}

static moefuse_status layer(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                            const moefuse_tensor *x, const moefuse_tensor *x_scales,
                            const moefuse_routing *routing, const moefuse_tensor *out, bool fp8,
                            const moefuse_quant_options *act, const layer_experts *ex)
{
    if (!g)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: group is NULL", op);
    mf_ep_payload pay;
    memset(&pay, 0, sizeof pay);
    int64_t I = 0;
    moefuse_status st = mf_ep_backend_check(ctx, op, g);
    if (st == MOEFUSE_OK && !fp8 && x && x->dtype == MOEFUSE_F8_E4M3)
        st = mf_error(ctx, MOEFUSE_ERR_DTYPE,
                      "%s: x is f8_e4m3; moefuse_ep_moe_forward_fp8 takes FP8 layers", op);
    if (st == MOEFUSE_OK)
        st = mf_ep_payload_check(ctx, op, x, x_scales, routing,
                                 fp8 && x && x->dtype != MOEFUSE_F8_E4M3, true, act, &pay);
    if (st == MOEFUSE_OK)
        st = check_weights(ctx, op, g, ex->w1, ex->w2, pay.model_dim, routing->n_shared, &I);
    if (st == MOEFUSE_OK)
        st = check_out(ctx, op, out, x, routing);
    void *ids_host = NULL, *wts_host = NULL;
    moefuse_tensor ids, wts;
    mf_ep_route r;
    memset(&r, 0, sizeof r);
    layer_bufs b;
    memset(&b, 0, sizeof b);
    if (st == MOEFUSE_OK)
        st = mf_ep_to_host(ctx, op, &routing->topk_ids, &ids_host, &ids);
    if (st == MOEFUSE_OK)
        st = mf_ep_to_host(ctx, op, &routing->topk_weights, &wts_host, &wts);
    if (st == MOEFUSE_OK)
        st = mf_ep_route_local(ctx, op, g, &ids, &wts, &r);
    free(ids_host);
    free(wts_host);
    const int64_t S = routing ? routing->n_shared : 0;
    if (st == MOEFUSE_OK) /* this rank's rows out, and the outputs of its slots back */
        st = mf_ep_scratch(ctx, op, g, MF_EP_BACK,
                           sizeof(float) * (size_t)((r.n_sent + r.tokens * S) * pay.model_dim),
                           &b.back);
    if (st == MOEFUSE_OK)
        st = mf_ep_payload_pack(ctx, op, g, &pay, x, &r, &b.sent);
    st = mf_ep_route_agree(ctx, op, g, st, -1, &r); /* the call's one exchange of counts */
    const int64_t R = r.n_recv, K = pay.model_dim;
    const size_t hsize = fp8 ? 1 : (x ? moefuse_dtype_size(x->dtype) : 1);
    const size_t need[][2] = {
        {pay.row_bytes, (size_t)R},           {sizeof(int32_t), (size_t)R},
        {hsize, (size_t)(R * I)},             {sizeof(float), (size_t)(R * K)},
        {fp8 ? 1u : 0u, (size_t)(R * K)},     {fp8 ? sizeof(float) : 0u, (size_t)(R * (K / 128))},
        {fp8 ? sizeof(float) : 0u, (size_t)(R * (I / 128))},
    };
    void **where[] = {&b.recv, &b.ids, &b.h, &b.y, &b.xq, &b.xs, &b.hs};
    static const enum mf_ep_slot slot[] = {MF_EP_RECV, MF_EP_IDS, MF_EP_H, MF_EP_Y,
                                           MF_EP_XQ,   MF_EP_XS,  MF_EP_HS};
    for (size_t i = 0; i < sizeof where / sizeof where[0] && st == MOEFUSE_OK; i++)
        if (need[i][0] > 0)
            st = mf_ep_scratch(ctx, op, g, slot[i], need[i][0] * need[i][1], where[i]);
    if (st == MOEFUSE_OK)
        st = mf_ep_exchange_rows(ctx, op, g, &r, 0, b.sent, pay.row_bytes, b.recv);
    mf_ep_chunks ch;
    memset(&ch, 0, sizeof ch);
    if (st == MOEFUSE_OK) { /* every rank from here takes part in experts_and_back's vote */
        /* FP8: LAYER_CHUNKS chunks; bf16: one, the rows read where they came, in order */
        st = mf_ep_chunks_make(ctx, op, g, &r, pay.fp8 ? LAYER_CHUNKS : 1, &ch);
        if (st == MOEFUSE_OK)
            st = received_rows(ctx, &pay, &r, &ch, &b);
        st = experts_and_back(ctx, op, g, st, &pay, ex, x, &r, &ch, S, I, &b);
    }
    mf_ep_chunks_free(&ch);
    if (st == MOEFUSE_OK)
        st = reduce_with_shared(ctx, op, routing, &r, b.back, K, out);
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
