/*
 * Public entry points of the block-scaled FP8 MoE: moe_gate_fp8, moe_final_fp8,
 * moe_forward_fp8 (routed) and moe_masked_fp8 (3-D expert-masked). Operands are validated
 * once here (docs/NUMERICS.md "FP8 MoE"); a whole-layer call falls back to the gate step then
 * the final step, with h and its scales in the caller's workspace or the context's scratch,
 * when the backend has no whole-layer kernel.
 */
#include "core/moe_checks.h"
#include "core/ops_internal.h"
#include "core/options.h"

#include <stdio.h>
#include <string.h>

#define FP8_BLOCK 128 /* rows and depth of a weight scale block; width of an activation group */

static moefuse_status check_fp8_options(moefuse_context *ctx, const char *op,
                                        const moefuse_fp8_moe_options *in, mf_moe_args *a)
{
    moefuse_fp8_moe_options opt = {0};
    if (in)
        opt = *in;
    MF_TRY(mf_moe_check_options(ctx, op, &opt.moe, &a->opt));
    MF_TRY(MF_CHECK_RESERVED(ctx, op, "fp8 moe options", opt.reserved));
    if (opt.act.group_size != 0 && opt.act.group_size != FP8_BLOCK)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: act.group_size is %lld; FP8 MoE activations take groups of 128 "
                        "(or 0 for the default)",
                        op, (long long)opt.act.group_size);
    /* group 128 divides both K and I (checked with the weights) */
    MF_TRY(mf_normalize_quant(ctx, op, &opt.act, MOEFUSE_F8_E4M3, FP8_BLOCK, &a->act));
    return MOEFUSE_OK;
}

/* w [E, N, D] f8_e4m3 with scales [E, N/128, D/128] f32 or u8; N and D multiples of 128. */
static moefuse_status check_fp8_weight(moefuse_context *ctx, const char *op, const char *name,
                                       const moefuse_tensor *w, const char *scales_name,
                                       const moefuse_tensor *scales, const int64_t want[3],
                                       const char *what)
{
    MF_TRY(mf_check_tensor(ctx, op, name, w, 3, MF_DT(MOEFUSE_F8_E4M3)));
    MF_TRY(mf_expect_shape(ctx, op, name, w, want, what));
    char sbuf[96];
    if (w->shape[0] == 0 || w->shape[1] % FP8_BLOCK != 0 || w->shape[2] % FP8_BLOCK != 0 ||
        w->shape[1] == 0 || w->shape[2] == 0)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: %s has shape %s; FP8 weights need E > 0 and rows and depth that are "
                        "non-zero multiples of 128 (the scale blocks)",
                        op, name, mf_shape_str(sbuf, sizeof sbuf, 3, w->shape));
    MF_TRY(mf_check_tensor(ctx, op, scales_name, scales, 3,
                           MF_DT(MOEFUSE_F32) | MF_DT(MOEFUSE_U8)));
    const int64_t blocks[3] = {w->shape[0], w->shape[1] / FP8_BLOCK, w->shape[2] / FP8_BLOCK};
    char what_scales[64];
    snprintf(what_scales, sizeof what_scales, "one per 128 x 128 block of %s", name);
    return mf_expect_shape(ctx, op, scales_name, scales, blocks, what_scales);
}

/* An operand given by the caller: non-NULL data, or an empty tensor (which torch and others
 * hand over with a NULL data pointer) of rank 1 or more; NULL and {0} are absent. */
static bool given(const moefuse_tensor *t)
{
    return t && (t->data || (t->rank > 0 && moefuse_tensor_numel(t) == 0));
}

/* The scales of an activation tensor of `rows` rows and `width` channels, in the act layout. */
static moefuse_status check_act_scales(moefuse_context *ctx, const char *op, const char *name,
                                       const moefuse_tensor *scales, const mf_moe_args *a,
                                       int64_t rows, int64_t width, moefuse_tensor *normalized)
{
    return mf_check_scales(ctx, op, name, scales, &a->act, a->masked, a->experts, rows,
                           width / FP8_BLOCK, normalized);
}

/*
 * x [M, K] (routed) or [E, Tmax, K] (masked), f32/f16/bf16 or f8_e4m3 with x_scales; w1 and
 * w1_scales; b1. Sets tokens, model_dim, experts, inter_dim.
 */
static moefuse_status check_fp8_gate_operands(moefuse_context *ctx, const char *op,
                                              const moefuse_tensor *x,
                                              const moefuse_tensor *x_scales,
                                              const moefuse_tensor *w1,
                                              const moefuse_tensor *w1_scales,
                                              const moefuse_tensor *b1, mf_moe_args *a)
{
    const int32_t rank = a->masked ? 3 : 2;
    MF_TRY(mf_check_tensor(ctx, op, "x", x, rank, MF_FLOATS | MF_DT(MOEFUSE_F8_E4M3)));
    a->tokens = x->shape[rank - 2];
    a->model_dim = x->shape[rank - 1];
    if (!w1 || w1->rank != 3)
        return mf_check_tensor(ctx, op, "w1", w1, 3, MF_DT(MOEFUSE_F8_E4M3));
    if (w1->shape[1] % 2 != 0)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: w1 has %lld rows; it must be [E, 2I, K]", op,
                        (long long)w1->shape[1]);
    const int64_t want[3] = {a->masked ? x->shape[0] : w1->shape[0], w1->shape[1], a->model_dim};
    MF_TRY(check_fp8_weight(ctx, op, "w1", w1, "w1_scales", w1_scales, want,
                            a->masked ? "[E, 2I, K] with E and K from x [E, Tmax, K]"
                                      : "[E, 2I, K] with K from x [M, K]"));
    a->experts = w1->shape[0];
    a->inter_dim = w1->shape[1] / 2;
    if (a->inter_dim % FP8_BLOCK != 0)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: I = %lld is not a multiple of 128 (the groups of h)", op,
                        (long long)a->inter_dim);
    if (x->dtype == MOEFUSE_F8_E4M3) {
        if (!given(x_scales))
            return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER,
                            "%s: x is f8_e4m3 but x_scales is absent; FP8 activations come with "
                            "their group scales",
                            op);
        MF_TRY(check_act_scales(ctx, op, "x_scales", x_scales, a, a->tokens, a->model_dim,
                                &a->x_scales));
    } else {
        if (given(x_scales))
            return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                            "%s: x is %s, which the call quantizes itself; x_scales must be "
                            "absent (give an f8_e4m3 x to pass scales)",
                            op, moefuse_dtype_name(x->dtype));
        a->x_scales = mf_absent();
    }
    MF_TRY(mf_moe_check_bias(ctx, op, "b1", b1, w1->shape, "w1 [E, 2I, K]", &a->b1));
    a->x = *x;
    a->w1 = *w1;
    a->w1_scales = *w1_scales;
    return MOEFUSE_OK;
}

/* w2 [E, K, I] with w2_scales, b2 [E, K], against the sizes already in a. */
static moefuse_status check_fp8_final_weights(moefuse_context *ctx, const char *op,
                                              const moefuse_tensor *w2,
                                              const moefuse_tensor *w2_scales,
                                              const moefuse_tensor *b2, mf_moe_args *a)
{
    const int64_t want[3] = {a->experts, a->model_dim, a->inter_dim};
    MF_TRY(check_fp8_weight(ctx, op, "w2", w2, "w2_scales", w2_scales, want,
                            "[E, K, I] from the other operands"));
    MF_TRY(mf_moe_check_bias(ctx, op, "b2", b2, want, "w2 [E, K, I]", &a->b2));
    a->w2 = *w2;
    a->w2_scales = *w2_scales;
    return MOEFUSE_OK;
}

/* h [M, k, I] f8_e4m3 and its scales (rows m * k + j), checked against a's sizes. */
static moefuse_status check_fp8_h(moefuse_context *ctx, const char *op, const moefuse_tensor *h,
                                  const moefuse_tensor *h_scales, const char *what,
                                  mf_moe_args *a)
{
    MF_TRY(mf_check_tensor(ctx, op, "h", h, 3, MF_DT(MOEFUSE_F8_E4M3)));
    const int64_t want[3] = {a->tokens, a->topk, a->inter_dim};
    MF_TRY(mf_expect_shape(ctx, op, "h", h, want, what));
    const int64_t rows = a->tokens * a->topk;
    MF_TRY(check_act_scales(ctx, op, "h_scales", h_scales, a, rows, a->inter_dim, &a->h_scales));
    a->h = *h;
    return MOEFUSE_OK;
}

static moefuse_status gate_fp8_step(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                    size_t *measure)
{
    return mf_moe_run_step(ctx, op, ctx->backend->moe_gate_fp8,
                           ctx->backend->moe_gate_fp8_workspace, a, measure);
}

static moefuse_status final_fp8_step(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                     size_t *measure)
{
    return mf_moe_run_step(ctx, op, ctx->backend->moe_final_fp8,
                           ctx->backend->moe_final_fp8_workspace, a, measure);
}

moefuse_status mf_moe_gate_fp8_call(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                    const moefuse_tensor *x_scales, const moefuse_tensor *w1,
                                    const moefuse_tensor *w1_scales, const moefuse_tensor *b1,
                                    const moefuse_routing *routing, const moefuse_tensor *h,
                                    const moefuse_tensor *h_scales,
                                    const moefuse_fp8_moe_options *opt, size_t *measure)
{
    mf_moe_args a = {0};
    MF_TRY(check_fp8_options(ctx, op, opt, &a));
    MF_TRY(check_fp8_gate_operands(ctx, op, x, x_scales, w1, w1_scales, b1, &a));
    mf_shared sh;
    MF_TRY(mf_moe_check_routing(ctx, op, routing, false, &a, &sh));
    MF_TRY(check_fp8_h(ctx, op, h, h_scales,
                       "[M, k, I] from x, topk_ids (plus routing.n_shared) and w1", &a));
    a.w2 = a.b2 = a.out = a.w2_scales = a.counts = mf_absent();
    mf_operand operands[7 + MF_ROUTING_OPERANDS] = {
        {"x", x, false},   {"x_scales", x_scales, false}, {"w1", w1, false},
        {"w1_scales", w1_scales, false}, {"b1", b1, false}, {"h", h, true},
        {"h_scales", h_scales, true}};
    /* the gate reads no router weights */
    return mf_moe_finish_routed(ctx, op, operands, 7, routing, false, &a, &sh, gate_fp8_step,
                                measure);
}

moefuse_status mf_moe_final_fp8_call(moefuse_context *ctx, const char *op, const moefuse_tensor *h,
                                     const moefuse_tensor *h_scales, const moefuse_tensor *w2,
                                     const moefuse_tensor *w2_scales, const moefuse_tensor *b2,
                                     const moefuse_routing *routing, const moefuse_tensor *out,
                                     const moefuse_fp8_moe_options *opt, size_t *measure)
{
    mf_moe_args a = {0};
    MF_TRY(check_fp8_options(ctx, op, opt, &a));
    MF_TRY(mf_check_tensor(ctx, op, "h", h, 3, MF_DT(MOEFUSE_F8_E4M3)));
    a.tokens = h->shape[0];
    a.inter_dim = h->shape[2];
    /* E and K come from w2 itself; the weight check then compares all three dims. */
    if (w2 && w2->rank == 3) {
        a.experts = w2->shape[0];
        a.model_dim = w2->shape[1];
    }
    MF_TRY(check_fp8_final_weights(ctx, op, w2, w2_scales, b2, &a));
    const bool reduce = out && out->rank == 2;
    mf_shared sh;
    MF_TRY(mf_moe_check_routing(ctx, op, routing, reduce, &a, &sh));
    MF_TRY(check_fp8_h(ctx, op, h, h_scales,
                       "[M, k, I] from topk_ids (plus routing.n_shared) and w2", &a));
    MF_TRY(mf_moe_check_final_out(ctx, op, out, reduce, &a));
    a.x = a.w1 = a.b1 = a.x_scales = a.w1_scales = a.counts = mf_absent();
    mf_operand operands[6 + MF_ROUTING_OPERANDS] = {
        {"h", h, false},   {"h_scales", h_scales, false}, {"w2", w2, false},
        {"w2_scales", w2_scales, false}, {"b2", b2, false}, {"out", out, true}};
    /* only the reduced output reads router weights */
    return mf_moe_finish_routed(ctx, op, operands, 6, routing, reduce, &a, &sh, final_fp8_step,
                                measure);
}

/* A dense tensor of the act layout for the group scales of `rows` rows of `width` channels
 * (leading dimension `lead`, 1 for the routed layout); data set later. */
static moefuse_tensor act_scales_tensor(const mf_moe_args *a, int64_t lead, int64_t rows,
                                        int64_t width)
{
    const int64_t groups = width / FP8_BLOCK, padded = (rows + 3) / 4 * 4;
    int64_t shape[3] = {lead, rows, groups};
    moefuse_dtype dt = a->act.ue8m0 ? MOEFUSE_U8 : MOEFUSE_F32;
    if (a->act.scale_layout == MOEFUSE_SCALE_COLUMN_MAJOR) {
        shape[1] = groups, shape[2] = padded;
    } else if (a->act.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0) {
        shape[1] = (groups + 3) / 4, shape[2] = padded;
        dt = MOEFUSE_I32;
    }
    return moefuse_tensor_dense(NULL, dt, 3, shape);
}

/* bytes of a dense tensor, SIZE_MAX on overflow */
static size_t dense_bytes(const moefuse_tensor *t)
{
    size_t n = moefuse_dtype_size(t->dtype);
    for (int32_t d = 0; d < t->rank; d++)
        if (__builtin_mul_overflow(n, (size_t)t->shape[d], &n))
            return SIZE_MAX;
    return n;
}

/*
 * A whole layer on a backend without a whole-layer kernel: the gate step into h (f8) and
 * h_scales, then the final step. With the caller's workspace, the steps' scratch comes first,
 * then h, then h_scales; else both are the context's own scratch.
 */
static moefuse_status gate_then_final_fp8(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                          size_t *measure)
{
    const moefuse_backend_i *be = ctx->backend;
    if (!be->moe_gate_fp8 || !be->moe_final_fp8)
        return mf_unimplemented(ctx, op);
    const int64_t lead = a->masked ? a->experts : 1;
    const int64_t rows = a->masked ? a->tokens : a->tokens * a->topk;
    const int64_t h_shape[3] = {a->masked ? a->experts : a->tokens,
                                a->masked ? a->tokens : a->topk, a->inter_dim};
    a->h = moefuse_tensor_dense(NULL, MOEFUSE_F8_E4M3, 3, h_shape);
    a->h_scales = act_scales_tensor(a, lead, rows, a->inter_dim);
    a->layer = true;
    const size_t h_bytes = dense_bytes(&a->h), s_bytes = dense_bytes(&a->h_scales);
    size_t gate_need, final_need;
    MF_TRY(mf_moe_step_workspace(ctx, be->moe_gate_fp8_workspace, a, measure, &gate_need));
    MF_TRY(mf_moe_step_workspace(ctx, be->moe_final_fp8_workspace, a, measure, &final_need));
    const size_t off_h = mf_workspace_align(gate_need > final_need ? gate_need : final_need);
    const size_t off_s = mf_workspace_align(mf_size_add_sat(off_h, h_bytes));
    const size_t need = mf_size_add_sat(off_s, s_bytes);
    bool run;
    MF_TRY(mf_workspace_step(ctx, op, need, measure, &run));
    if (!run)
        return MOEFUSE_OK;
    mf_region ws;
    if (mf_caller_workspace(ctx, &ws)) {
        a->h.data = a->h_scales.data = ws.data;
        a->h.offset = (int64_t)(ws.offset + off_h);
        a->h_scales.offset = (int64_t)(ws.offset + off_s);
    } else {
        void *scratch;
        MF_TRY(mf_moe_in_forward(ctx, op, mf_workspace(ctx, need - off_h, &scratch)));
        a->h.data = a->h_scales.data = scratch;
        a->h.offset = 0;
        a->h_scales.offset = (int64_t)(off_s - off_h);
    }
    mf_moe_args gate = *a, final = *a;
    gate.w2 = gate.b2 = gate.w2_scales = gate.out = mf_absent();
    gate.reduce = false;
    final.x = final.w1 = final.b1 = final.x_scales = final.w1_scales = mf_absent();
    MF_TRY(mf_moe_in_forward(ctx, op, be->moe_gate_fp8(ctx, ctx->state, &gate)));
    return mf_moe_in_forward(ctx, op, be->moe_final_fp8(ctx, ctx->state, &final));
}

/* The whole-layer member if the backend has one, else the gate then the final step. */
static moefuse_status run_layer_fp8(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                    size_t *measure)
{
    const moefuse_backend_i *be = ctx->backend;
    if (!be->moe_forward_fp8)
        return gate_then_final_fp8(ctx, op, a, measure);
    a->h = a->h_scales = mf_absent();
    return mf_moe_run_step(ctx, op, be->moe_forward_fp8, be->moe_forward_fp8_workspace, a,
                           measure);
}

static moefuse_status forward_fp8(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                  const moefuse_tensor *x_scales, const moefuse_tensor *w1,
                                  const moefuse_tensor *w1_scales, const moefuse_tensor *w2,
                                  const moefuse_tensor *w2_scales, const moefuse_tensor *b1,
                                  const moefuse_tensor *b2, const moefuse_routing *routing,
                                  const moefuse_tensor *out, const moefuse_fp8_moe_options *opt,
                                  size_t *measure)
{
    mf_moe_args a = {0};
    MF_TRY(check_fp8_options(ctx, op, opt, &a));
    MF_TRY(check_fp8_gate_operands(ctx, op, x, x_scales, w1, w1_scales, b1, &a));
    MF_TRY(check_fp8_final_weights(ctx, op, w2, w2_scales, b2, &a));
    mf_shared sh;
    MF_TRY(mf_moe_check_routing(ctx, op, routing, true, &a, &sh));
    MF_TRY(mf_moe_check_layer_out(ctx, op, out, &a));
    a.counts = mf_absent();
    mf_operand operands[9 + MF_ROUTING_OPERANDS] = {
        {"x", x, false},   {"x_scales", x_scales, false}, {"w1", w1, false},
        {"w1_scales", w1_scales, false}, {"w2", w2, false}, {"w2_scales", w2_scales, false},
        {"b1", b1, false}, {"b2", b2, false}, {"out", out, true}};
    return mf_moe_finish_routed(ctx, op, operands, 9, routing, true, &a, &sh, run_layer_fp8,
                                measure);
}

static moefuse_status masked_fp8(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                 const moefuse_tensor *x_scales, const moefuse_tensor *counts,
                                 const moefuse_tensor *w1, const moefuse_tensor *w1_scales,
                                 const moefuse_tensor *w2, const moefuse_tensor *w2_scales,
                                 const moefuse_tensor *b1, const moefuse_tensor *b2,
                                 const moefuse_tensor *out, const moefuse_fp8_moe_options *opt,
                                 size_t *measure)
{
    mf_moe_args a = {0};
    a.masked = true;
    MF_TRY(check_fp8_options(ctx, op, opt, &a));
    MF_TRY(check_fp8_gate_operands(ctx, op, x, x_scales, w1, w1_scales, b1, &a));
    MF_TRY(check_fp8_final_weights(ctx, op, w2, w2_scales, b2, &a));
    MF_TRY(mf_check_tensor(ctx, op, "counts", counts, 1, MF_DT(MOEFUSE_I32)));
    MF_TRY(mf_expect_shape(ctx, op, "counts", counts, &a.experts, "x [E, Tmax, K]"));
    MF_TRY(mf_check_tensor(ctx, op, "out", out, 3, MF_FLOATS));
    MF_TRY(mf_expect_shape(ctx, op, "out", out, x->shape, "x [E, Tmax, K]"));
    a.counts = *counts;
    a.topk = 1;
    a.global_experts = a.experts;
    a.reduce = false;
    a.out = *out;
    a.topk_ids = a.topk_weights = a.expert_map = mf_absent();
    mf_operand operands[10] = {{"x", x, false},           {"x_scales", x_scales, false},
                               {"counts", counts, false}, {"w1", w1, false},
                               {"w1_scales", w1_scales, false}, {"w2", w2, false},
                               {"w2_scales", w2_scales, false}, {"b1", b1, false},
                               {"b2", b2, false},         {"out", out, true}};
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, 10, &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    return run_layer_fp8(ctx, op, &a, measure);
}

/* ------------------------------------------------------------ entry points */

moefuse_status moefuse_moe_gate_fp8(moefuse_context *ctx, const moefuse_tensor *x,
                                    const moefuse_tensor *x_scales, const moefuse_tensor *w1,
                                    const moefuse_tensor *w1_scales, const moefuse_tensor *b1,
                                    const moefuse_routing *routing, const moefuse_tensor *h,
                                    const moefuse_tensor *h_scales,
                                    const moefuse_fp8_moe_options *opt)
{
    static const char op[] = "moe_gate_fp8";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, mf_moe_gate_fp8_call(ctx, op, x, x_scales, w1, w1_scales, b1, routing,
                                              h, h_scales, opt, NULL));
}

moefuse_status moefuse_moe_gate_fp8_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *x_scales,
    const moefuse_tensor *w1, const moefuse_tensor *w1_scales, const moefuse_tensor *b1,
    const moefuse_routing *routing, const moefuse_tensor *h, const moefuse_tensor *h_scales,
    const moefuse_fp8_moe_options *opt, size_t *bytes)
{
    static const char op[] = "moe_gate_fp8";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, mf_moe_gate_fp8_call(ctx, op, x, x_scales, w1, w1_scales, b1, routing,
                                              h, h_scales, opt, bytes));
}

moefuse_status moefuse_moe_final_fp8(moefuse_context *ctx, const moefuse_tensor *h,
                                     const moefuse_tensor *h_scales, const moefuse_tensor *w2,
                                     const moefuse_tensor *w2_scales, const moefuse_tensor *b2,
                                     const moefuse_routing *routing, const moefuse_tensor *out,
                                     const moefuse_fp8_moe_options *opt)
{
    static const char op[] = "moe_final_fp8";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx,
                    mf_moe_final_fp8_call(ctx, op, h, h_scales, w2, w2_scales, b2, routing, out,
                                          opt, NULL));
}

moefuse_status moefuse_moe_final_fp8_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *h, const moefuse_tensor *h_scales,
    const moefuse_tensor *w2, const moefuse_tensor *w2_scales, const moefuse_tensor *b2,
    const moefuse_routing *routing, const moefuse_tensor *out, const moefuse_fp8_moe_options *opt,
    size_t *bytes)
{
    static const char op[] = "moe_final_fp8";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx,
                    mf_moe_final_fp8_call(ctx, op, h, h_scales, w2, w2_scales, b2, routing, out,
                                          opt, bytes));
}

moefuse_status moefuse_moe_forward_fp8(moefuse_context *ctx, const moefuse_tensor *x,
                                       const moefuse_tensor *x_scales, const moefuse_tensor *w1,
                                       const moefuse_tensor *w1_scales, const moefuse_tensor *w2,
                                       const moefuse_tensor *w2_scales, const moefuse_tensor *b1,
                                       const moefuse_tensor *b2, const moefuse_routing *routing,
                                       const moefuse_tensor *out,
                                       const moefuse_fp8_moe_options *opt)
{
    static const char op[] = "moe_forward_fp8";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, forward_fp8(ctx, op, x, x_scales, w1, w1_scales, w2, w2_scales, b1, b2,
                                     routing, out, opt, NULL));
}

moefuse_status moefuse_moe_forward_fp8_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *x_scales,
    const moefuse_tensor *w1, const moefuse_tensor *w1_scales, const moefuse_tensor *w2,
    const moefuse_tensor *w2_scales, const moefuse_tensor *b1, const moefuse_tensor *b2,
    const moefuse_routing *routing, const moefuse_tensor *out, const moefuse_fp8_moe_options *opt,
    size_t *bytes)
{
    static const char op[] = "moe_forward_fp8";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, forward_fp8(ctx, op, x, x_scales, w1, w1_scales, w2, w2_scales, b1, b2,
                                     routing, out, opt, bytes));
}

moefuse_status moefuse_moe_masked_fp8(moefuse_context *ctx, const moefuse_tensor *x,
                                      const moefuse_tensor *x_scales,
                                      const moefuse_tensor *counts, const moefuse_tensor *w1,
                                      const moefuse_tensor *w1_scales, const moefuse_tensor *w2,
                                      const moefuse_tensor *w2_scales, const moefuse_tensor *b1,
                                      const moefuse_tensor *b2, const moefuse_tensor *out,
                                      const moefuse_fp8_moe_options *opt)
{
    static const char op[] = "moe_masked_fp8";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, masked_fp8(ctx, op, x, x_scales, counts, w1, w1_scales, w2, w2_scales,
                                    b1, b2, out, opt, NULL));
}

moefuse_status moefuse_moe_masked_fp8_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *x_scales,
    const moefuse_tensor *counts, const moefuse_tensor *w1, const moefuse_tensor *w1_scales,
    const moefuse_tensor *w2, const moefuse_tensor *w2_scales, const moefuse_tensor *b1,
    const moefuse_tensor *b2, const moefuse_tensor *out, const moefuse_fp8_moe_options *opt,
    size_t *bytes)
{
    static const char op[] = "moe_masked_fp8";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, masked_fp8(ctx, op, x, x_scales, counts, w1, w1_scales, w2, w2_scales,
                                    b1, b2, out, opt, bytes));
}
