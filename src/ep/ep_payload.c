/* The rows of a dispatch: checked, packed for sending, unpacked where they arrive. */
#include "ep/ep_payload.h"

#include "core/core.h"
#include "core/moe_checks.h"
#include "core/ops_internal.h"
#include "core/options.h"

#include <stdlib.h>
#include <string.h>

/* The routing as the MoE calls check it (mf_moe_check_routing), with the router weights, and
   what expert parallelism adds: no expert_map (the group places the experts), and shared
   experts only in the layer calls, whose weights hold them after the rank's own. */
static moefuse_status check_routing(moefuse_context *ctx, const char *op,
                                    const moefuse_routing *routing, int64_t M, bool shared_ok)
{
    if (routing && !shared_ok && (routing->n_shared != 0 || mf_present(&routing->shared_weights)))
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "%s: shared experts run in the layer calls (moefuse_ep_moe_forward*), "
                        "not in dispatch (routing.n_shared is %d)",
                        op, (int)routing->n_shared);
    mf_moe_args a;
    memset(&a, 0, sizeof a);
    a.tokens = M;
    /* the bound on n_shared is the weights' (the layer's check_weights) */
    a.experts = routing && routing->n_shared > 0 ? routing->n_shared : 0;
    mf_shared sh;
    MF_TRY(mf_moe_check_routing(ctx, op, routing, true, &a, shared_ok ? &sh : NULL));
    if (mf_present(&routing->expert_map))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: routing.expert_map is given; the group places the experts "
                        "(moefuse_ep_config)",
                        op);
    return MOEFUSE_OK;
}

moefuse_status mf_ep_payload_check(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                   const moefuse_tensor *x_scales, const moefuse_routing *routing,
                                   bool quantize, bool shared_ok,
                                   const moefuse_quant_options *act, mf_ep_payload *pay)
{
    memset(pay, 0, sizeof *pay);
    MF_TRY(mf_check_tensor(ctx, op, "x", x, 2, MF_FLOATS | MF_DT(MOEFUSE_F8_E4M3)));
    const int64_t M = x->shape[0], K = x->shape[1];
    const bool f8 = x->dtype == MOEFUSE_F8_E4M3;
    if (f8 && quantize)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: quantize is set but x is f8_e4m3 already", op);
    pay->fp8 = f8 || quantize;
    pay->quantize = quantize;
    pay->tokens = M;
    pay->model_dim = K;
    if (pay->fp8) {
        if (act && act->group_size != 0 && act->group_size != 128)
            return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                            "%s: act.group_size is %lld; FP8 rows take groups of 128 (or 0 for "
                            "the default)",
                            op, (long long)act->group_size);
        if (K % 128 != 0)
            return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                            "%s: x has K = %lld; FP8 rows need a multiple of 128", op,
                            (long long)K);
        MF_TRY(mf_normalize_quant(ctx, op, act, MOEFUSE_F8_E4M3, 128, &pay->act));
        pay->groups = K / 128;
        pay->row_bytes = (size_t)K + sizeof(float) * (size_t)pay->groups;
    } else {
        pay->row_bytes = moefuse_dtype_size(x->dtype) * (size_t)K;
    }
    if (f8)
        MF_TRY(mf_check_scales(ctx, op, "x_scales", x_scales, &pay->act, false, 1, M,
                               pay->groups, &pay->xs));
    else if (mf_present(x_scales))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: x_scales is given but x is %s, not f8_e4m3", op,
                        moefuse_dtype_name(x->dtype));
    return check_routing(ctx, op, routing, M, shared_ok);
}

moefuse_status mf_ep_payload_quantize(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                      const mf_ep_payload *pay, const moefuse_tensor *x,
                                      enum mf_ep_slot codes_slot, moefuse_tensor *codes,
                                      moefuse_tensor *scales, moefuse_scale_layout *layout)
{
    const int64_t M = pay->tokens, K = pay->model_dim, G = pay->groups;
    void *c = NULL, *sc = NULL;
    moefuse_status st = mf_ep_scratch(ctx, op, g, codes_slot, (size_t)(M * K), &c);
    if (st == MOEFUSE_OK)
        st = mf_ep_scratch(ctx, op, g, (enum mf_ep_slot)(codes_slot + 1),
                           sizeof(float) * (size_t)(M * G), &sc);
    const int64_t qshape[2] = {M, K}, sshape[2] = {M, G};
    const moefuse_tensor q = moefuse_tensor_dense(c, MOEFUSE_F8_E4M3, 2, qshape);
    const moefuse_tensor qs = moefuse_tensor_dense(sc, MOEFUSE_F32, 2, sshape);
    moefuse_quant_options o = pay->act;
    o.scale_layout = MOEFUSE_SCALE_ROW_MAJOR;
    if (st == MOEFUSE_OK && M > 0) /* every row once, as moefuse_quant does */
        st = mf_quant_call(ctx, op, x, &q, &qs, &o, NULL);
    *codes = mf_tensor_lift3(&q);
    *scales = mf_with_leading_unit(&qs);
    *layout = MOEFUSE_SCALE_ROW_MAJOR;
    return st;
}

moefuse_status mf_ep_payload_pack(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                  const mf_ep_payload *pay, const moefuse_tensor *x,
                                  const mf_ep_route *r, void **rows)
{
    const int64_t G = pay->groups, k = r->topk;
    *rows = NULL;
    int64_t *index = malloc(sizeof *index * (size_t)(r->n_sent > 0 ? r->n_sent : 1));
    if (!index)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate", op);
    for (int64_t i = 0; i < r->n_sent; i++)
        index[i] = r->send_slot[i] / k; /* the row's token: row m of x lifted to [1, M, K] */
    mf_ep_rows_args a;
    memset(&a, 0, sizeof a);
    a.rows = mf_tensor_lift3(x);
    a.index = index;
    a.n = r->n_sent;
    a.row_bytes = pay->row_bytes;
    moefuse_status st = MOEFUSE_OK;
    if (pay->fp8) {
        a.groups = G;
        a.layout = pay->act.scale_layout;
        a.scales = pay->xs;
    }
    if (pay->quantize)
        st = mf_ep_payload_quantize(ctx, op, g, pay, x, MF_EP_CODES, &a.rows, &a.scales,
                                    &a.layout);
    if (st == MOEFUSE_OK)
        st = mf_ep_scratch(ctx, op, g, MF_EP_SEND, pay->row_bytes * (size_t)r->n_sent, rows);
    a.buffer = *rows;
    if (st == MOEFUSE_OK && r->n_sent > 0)
        st = ctx->backend->ep_gather(ctx, ctx->state, &a);
    free(index);
    if (st != MOEFUSE_OK)
        *rows = NULL;
    return st;
}

moefuse_status mf_ep_payload_unpack(moefuse_context *ctx, const mf_ep_payload *pay,
                                    const void *recv, int64_t n, const int64_t *index,
                                    const moefuse_tensor *rows, const moefuse_tensor *scales,
                                    moefuse_scale_layout layout, const int64_t *counts)
{
    mf_ep_rows_args a;
    memset(&a, 0, sizeof a);
    a.rows = *rows;
    a.index = index;
    a.n = n;
    a.buffer = (void *)recv;
    a.row_bytes = pay->row_bytes;
    if (pay->fp8) {
        a.scales = *scales;
        a.layout = layout;
        a.groups = pay->groups;
        a.counts = counts;
    }
    return ctx->backend->ep_scatter(ctx, ctx->state, &a);
}
