/*
 * Public entry points of the MoE GEMMs: moe_gate, moe_final, moe_forward.
 * Operands are validated once here; moe_forward falls back to gate + final on
 * context-owned scratch when the backend has no fused whole-layer kernel.
 */
#include "core/core.h"
#include "core/fault.h"
#include "core/options.h"

#include <string.h>

static moefuse_status check_moe_options(moefuse_context *ctx, const char *op,
                                        const moefuse_moe_options *in, moefuse_moe_options *out)
{
    moefuse_moe_options opt = {0};
    if (in)
        opt = *in;
    if ((unsigned)opt.activation >= MOEFUSE_ACT_COUNT_)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: activation %d is not a moefuse_activation", op, (int)opt.activation);
    if ((unsigned)opt.order >= MOEFUSE_GATE_ORDER_COUNT_)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: order %d is not a moefuse_gate_order", op, (int)opt.order);
    if (!(opt.limit >= 0.0f))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: limit is %g; it must be > 0 to clamp, or 0 for no clamp", op,
                        (double)opt.limit);
    MF_TRY(MF_CHECK_RESERVED(ctx, op, "moe options", opt.reserved));
    *out = opt;
    return MOEFUSE_OK;
}

/* Weights must share the activations' dtype; FP8 weights are the project's next stage. */
static moefuse_status check_weight(moefuse_context *ctx, const char *op, const char *name,
                                   const moefuse_tensor *w, moefuse_dtype act_dtype,
                                   const char *act_name)
{
    if (mf_present(w) && w->dtype == MOEFUSE_F8_E4M3)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "%s: %s is f8_e4m3; FP8 MoE weights are not implemented yet", op, name);
    MF_TRY(mf_check_tensor(ctx, op, name, w, 3, MF_FLOATS));
    if (w->dtype != act_dtype)
        return mf_error(ctx, MOEFUSE_ERR_DTYPE, "%s: %s is %s but %s is %s; they must match", op,
                        name, moefuse_dtype_name(w->dtype), act_name, moefuse_dtype_name(act_dtype));
    if (w->shape[0] == 0 || w->shape[1] == 0 || w->shape[2] == 0) {
        char sbuf[96];
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: %s has shape %s; no dimension may be 0", op,
                        name, mf_shape_str(sbuf, sizeof sbuf, 3, w->shape));
    }
    return MOEFUSE_OK;
}

/* topk_ids [M, k], topk_weights [M, k] (when needed), expert_map [E_global]. */
static moefuse_status check_routing(moefuse_context *ctx, const char *op,
                                    const moefuse_routing *r, bool need_weights, mf_moe_args *a)
{
    if (!r)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: routing is NULL", op);
    MF_TRY(mf_check_tensor(ctx, op, "topk_ids", &r->topk_ids, 2, MF_DT(MOEFUSE_I32)));
    if (r->topk_ids.shape[0] != a->tokens)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: topk_ids has %lld rows but there are M = %lld tokens",
                        op, (long long)r->topk_ids.shape[0], (long long)a->tokens);
    a->topk = r->topk_ids.shape[1];
    a->topk_ids = r->topk_ids;
    a->topk_weights = mf_absent();
    if (need_weights) {
        MF_TRY(mf_check_tensor(ctx, op, "topk_weights", &r->topk_weights, 2, MF_DT(MOEFUSE_F32)));
        MF_TRY(mf_expect_shape(ctx, op, "topk_weights", &r->topk_weights, r->topk_ids.shape,
                               "topk_ids [M, k]"));
        a->topk_weights = r->topk_weights;
    }
    MF_TRY(mf_check_optional(ctx, op, "expert_map", &r->expert_map, 1, MF_DT(MOEFUSE_I32)));
    a->expert_map = mf_present(&r->expert_map) ? r->expert_map : mf_absent();
    a->global_experts = mf_present(&r->expert_map) ? r->expert_map.shape[0] : a->experts;
    return MOEFUSE_OK;
}

/* The routing tensors as inputs of the overlap check, at ops[0..2]. */
static void routing_operands(const moefuse_routing *r, mf_operand *ops)
{
    ops[0] = (mf_operand){"topk_ids", &r->topk_ids, false};
    ops[1] = (mf_operand){"topk_weights", &r->topk_weights, false};
    ops[2] = (mf_operand){"expert_map", &r->expert_map, false};
}

/* x [M, K], w1 [E, 2I, K], b1 [E, 2I]: sets tokens, model_dim, experts, inter_dim. */
static moefuse_status check_gate_operands(moefuse_context *ctx, const char *op,
                                          const moefuse_tensor *x, const moefuse_tensor *w1,
                                          const moefuse_tensor *b1, mf_moe_args *a)
{
    MF_TRY(mf_check_tensor(ctx, op, "x", x, 2, MF_FLOATS));
    a->tokens = x->shape[0];
    a->model_dim = x->shape[1];
    if (a->model_dim == 0)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: x has K = 0 channels", op);
    MF_TRY(check_weight(ctx, op, "w1", w1, x->dtype, "x"));
    char sbuf[96];
    if (w1->shape[2] != a->model_dim || w1->shape[1] % 2 != 0)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: w1 has shape %s but x has K = %lld (w1 must be [E, 2I, K])", op,
                        mf_shape_str(sbuf, sizeof sbuf, 3, w1->shape), (long long)a->model_dim);
    a->experts = w1->shape[0];
    a->inter_dim = w1->shape[1] / 2;
    MF_TRY(mf_check_optional(ctx, op, "b1", b1, 2, MF_FLOATS));
    if (mf_present(b1))
        MF_TRY(mf_expect_shape(ctx, op, "b1", b1, w1->shape, "w1 [E, 2I, K]"));
    a->x = *x;
    a->w1 = *w1;
    a->b1 = mf_present(b1) ? *b1 : mf_absent();
    return MOEFUSE_OK;
}

/* w2 [E, K, I] of `act_dtype`, b2 [E, K], against the sizes already in a. */
static moefuse_status check_final_weights(moefuse_context *ctx, const char *op,
                                          const moefuse_tensor *w2, const moefuse_tensor *b2,
                                          moefuse_dtype act_dtype, const char *act_name,
                                          mf_moe_args *a)
{
    MF_TRY(check_weight(ctx, op, "w2", w2, act_dtype, act_name));
    int64_t want[3] = {a->experts, a->model_dim, a->inter_dim};
    MF_TRY(mf_expect_shape(ctx, op, "w2", w2, want, "[E, K, I] from the other operands"));
    MF_TRY(mf_check_optional(ctx, op, "b2", b2, 2, MF_FLOATS));
    if (mf_present(b2))
        MF_TRY(mf_expect_shape(ctx, op, "b2", b2, want, "w2 [E, K, I]"));
    a->w2 = *w2;
    a->b2 = mf_present(b2) ? *b2 : mf_absent();
    return MOEFUSE_OK;
}

static moefuse_status moe_gate(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                               const moefuse_tensor *w1, const moefuse_tensor *b1,
                               const moefuse_routing *routing, const moefuse_tensor *h,
                               const moefuse_moe_options *opt)
{
    mf_moe_args a = {0};
    MF_TRY(check_moe_options(ctx, op, opt, &a.opt));
    MF_TRY(check_gate_operands(ctx, op, x, w1, b1, &a));
    MF_TRY(check_routing(ctx, op, routing, false, &a));
    MF_TRY(mf_check_tensor(ctx, op, "h", h, 3, MF_FLOATS));
    int64_t want[3] = {a.tokens, a.topk, a.inter_dim};
    MF_TRY(mf_expect_shape(ctx, op, "h", h, want, "[M, k, I] from x, topk_ids and w1"));
    a.h = *h;
    a.w2 = a.b2 = a.out = mf_absent();
    mf_operand operands[7] = {{"x", x, false}, {"w1", w1, false}, {"b1", b1, false},
                              {"h", h, true}};
    routing_operands(routing, operands + 4);
    operands[5].t = NULL; /* the gate reads no router weights */
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, 7, &idle));
    if (idle)
        return MOEFUSE_OK;
    if (!ctx->backend->moe_gate)
        return mf_unimplemented(ctx, op);
    return ctx->backend->moe_gate(ctx, ctx->state, &a);
}

static moefuse_status moe_final(moefuse_context *ctx, const char *op, const moefuse_tensor *h,
                                const moefuse_tensor *w2, const moefuse_tensor *b2,
                                const moefuse_routing *routing, const moefuse_tensor *out,
                                const moefuse_moe_options *opt)
{
    mf_moe_args a = {0};
    MF_TRY(check_moe_options(ctx, op, opt, &a.opt));
    MF_TRY(mf_check_tensor(ctx, op, "h", h, 3, MF_FLOATS));
    a.tokens = h->shape[0];
    a.inter_dim = h->shape[2];
    if (a.inter_dim == 0)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: h has I = 0 channels", op);
    /* E and K come from w2 itself; check_final_weights then compares all three dims. */
    if (mf_present(w2) && w2->rank == 3) {
        a.experts = w2->shape[0];
        a.model_dim = w2->shape[1];
    }
    MF_TRY(check_final_weights(ctx, op, w2, b2, h->dtype, "h", &a));
    bool reduce = out && out->rank == 2;
    MF_TRY(check_routing(ctx, op, routing, reduce, &a));
    if (h->shape[1] != a.topk)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: h has k = %lld slots but topk_ids has k = %lld",
                        op, (long long)h->shape[1], (long long)a.topk);
    MF_TRY(mf_check_tensor(ctx, op, "out", out, reduce ? 2 : 3, MF_FLOATS));
    int64_t want_reduced[2] = {a.tokens, a.model_dim};
    int64_t want_slots[3] = {a.tokens, a.topk, a.model_dim};
    MF_TRY(mf_expect_shape(ctx, op, "out", out, reduce ? want_reduced : want_slots,
                           reduce ? "the reduced output [M, K]" : "the un-reduced output [M, k, K]"));
    a.reduce = reduce;
    a.h = *h;
    a.out = *out;
    a.x = a.w1 = a.b1 = mf_absent();
    mf_operand operands[7] = {{"h", h, false}, {"w2", w2, false}, {"b2", b2, false},
                              {"out", out, true}};
    routing_operands(routing, operands + 4);
    if (!reduce)
        operands[5].t = NULL; /* the un-reduced output reads no router weights */
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, 7, &idle));
    if (idle)
        return MOEFUSE_OK;
    if (!ctx->backend->moe_final)
        return mf_unimplemented(ctx, op);
    return ctx->backend->moe_final(ctx, ctx->state, &a);
}

size_t moefuse_moe_forward_workspace_bytes(moefuse_context *ctx, int64_t M, int64_t topk,
                                           int64_t I, moefuse_dtype act_dtype)
{
    (void)ctx;
    size_t esize = moefuse_dtype_size(act_dtype);
    if (M < 0 || topk < 0 || I < 0 || esize == 0)
        return 0;
    size_t bytes;
    if (__builtin_mul_overflow((size_t)M, (size_t)topk, &bytes) ||
        __builtin_mul_overflow(bytes, (size_t)I, &bytes) ||
        __builtin_mul_overflow(bytes, esize, &bytes))
        return SIZE_MAX;
    return bytes;
}

moefuse_status mf_workspace(moefuse_context *ctx, size_t bytes, void **buffer)
{
    if (bytes > ctx->workspace_bytes || !ctx->workspace) {
        if (ctx->workspace)
            ctx->backend->buffer_free(ctx->state, ctx->workspace);
        ctx->workspace = NULL;
        ctx->workspace_bytes = 0;
        if (mf_fault_hit(MF_FAULT_SCRATCH_GROW)) /* test hook: a growth that fails */
            return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                            "moe_forward: growing the workspace to %zu bytes failed (injected)",
                            bytes);
        MF_TRY(ctx->backend->buffer_alloc(ctx, ctx->state, bytes, &ctx->workspace));
        ctx->workspace_bytes = bytes;
    }
    *buffer = ctx->workspace;
    return MOEFUSE_OK;
}

/* A step of the gate + final fallback failed: its message names the step ("moe_gate: ...");
 * put the call the user made in front of it. */
static moefuse_status in_forward(moefuse_context *ctx, const char *op, moefuse_status status)
{
    if (status != MOEFUSE_OK) {
        char step[MF_MESSAGE_BYTES];
        memcpy(step, ctx->message, sizeof step);
        mf_error(ctx, status, "%s: %s", op, step);
    }
    return status;
}

static moefuse_status moe_forward(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                  const moefuse_tensor *w1, const moefuse_tensor *w2,
                                  const moefuse_tensor *b1, const moefuse_tensor *b2,
                                  const moefuse_routing *routing, const moefuse_tensor *out,
                                  const moefuse_moe_options *opt)
{
    mf_moe_args a = {0};
    MF_TRY(check_moe_options(ctx, op, opt, &a.opt));
    MF_TRY(check_gate_operands(ctx, op, x, w1, b1, &a));
    MF_TRY(check_final_weights(ctx, op, w2, b2, x->dtype, "x", &a));
    MF_TRY(check_routing(ctx, op, routing, true, &a));
    MF_TRY(mf_check_tensor(ctx, op, "out", out, 2, MF_FLOATS));
    int64_t want[2] = {a.tokens, a.model_dim};
    MF_TRY(mf_expect_shape(ctx, op, "out", out, want, "x [M, K]"));
    a.reduce = true;
    a.out = *out;
    mf_operand operands[9] = {{"x", x, false},   {"w1", w1, false}, {"w2", w2, false},
                              {"b1", b1, false}, {"b2", b2, false}, {"out", out, true}};
    routing_operands(routing, operands + 6);
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, 9, &idle));
    if (idle)
        return MOEFUSE_OK;
    if (ctx->backend->moe_forward) { /* it keeps h in scratch of its own */
        a.h = mf_absent();
        return ctx->backend->moe_forward(ctx, ctx->state, &a);
    }
    if (!ctx->backend->moe_gate || !ctx->backend->moe_final)
        return mf_unimplemented(ctx, op);

    size_t bytes = moefuse_moe_forward_workspace_bytes(ctx, a.tokens, a.topk, a.inter_dim, x->dtype);
    if (bytes == SIZE_MAX)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: the [M, k, I] intermediate overflows size_t", op);
    void *scratch;
    MF_TRY(in_forward(ctx, op, mf_workspace(ctx, bytes ? bytes : 1, &scratch)));
    int64_t h_shape[3] = {a.tokens, a.topk, a.inter_dim};
    a.h = moefuse_tensor_dense(scratch, x->dtype, 3, h_shape);

    MF_TRY(in_forward(ctx, op, ctx->backend->moe_gate(ctx, ctx->state, &a)));
    return in_forward(ctx, op, ctx->backend->moe_final(ctx, ctx->state, &a));
}

/* ------------------------------------------------------------ entry points */

moefuse_status moefuse_moe_gate(moefuse_context *ctx, const moefuse_tensor *x,
                                const moefuse_tensor *w1, const moefuse_tensor *b1,
                                const moefuse_routing *routing, const moefuse_tensor *h,
                                const moefuse_moe_options *opt)
{
    static const char op[] = "moe_gate";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, moe_gate(ctx, op, x, w1, b1, routing, h, opt));
}

moefuse_status moefuse_moe_final(moefuse_context *ctx, const moefuse_tensor *h,
                                 const moefuse_tensor *w2, const moefuse_tensor *b2,
                                 const moefuse_routing *routing, const moefuse_tensor *out,
                                 const moefuse_moe_options *opt)
{
    static const char op[] = "moe_final";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, moe_final(ctx, op, h, w2, b2, routing, out, opt));
}

moefuse_status moefuse_moe_forward(moefuse_context *ctx, const moefuse_tensor *x,
                                   const moefuse_tensor *w1, const moefuse_tensor *w2,
                                   const moefuse_tensor *b1, const moefuse_tensor *b2,
                                   const moefuse_routing *routing, const moefuse_tensor *out,
                                   const moefuse_moe_options *opt)
{
    static const char op[] = "moe_forward";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, moe_forward(ctx, op, x, w1, w2, b1, b2, routing, out, opt));
}
