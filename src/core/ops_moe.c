/*
 * Public entry points of the MoE GEMMs: moe_gate, moe_final, moe_forward.
 * Operands are validated once here; moe_forward falls back to gate + final, with h in the
 * caller's workspace or in context-owned scratch, when the backend has no whole-layer kernel.
 */
#include "core/moe_checks.h"
#include "core/ops_internal.h"
#include "core/options.h"

#include <math.h>
#include <string.h>

moefuse_status mf_moe_check_options(moefuse_context *ctx, const char *op,
                                        const moefuse_moe_options *in, moefuse_moe_options *out)
{
    moefuse_moe_options opt = {0};
    if (in)
        opt = *in;
    const mf_gated_fields f = {&opt.activation, &opt.order, &opt.limit, &opt.alpha,
                               &opt.up_offset};
    MF_TRY(mf_check_gated(ctx, op, f));
    MF_TRY(MF_CHECK_RESERVED(ctx, op, "moe options", opt.reserved));
    *out = opt;
    return MOEFUSE_OK;
}

/* Weights must share the activations' dtype (FP8 weights take the *_fp8 calls). */
static moefuse_status check_weight(moefuse_context *ctx, const char *op, const char *name,
                                   const moefuse_tensor *w, moefuse_dtype act_dtype,
                                   const char *act_name)
{
    if (mf_present(w) && w->dtype == MOEFUSE_F8_E4M3)
        return mf_error(ctx, MOEFUSE_ERR_DTYPE,
                        "%s: %s is f8_e4m3; FP8 weights need their block scales: use %s_fp8",
                        op, name, op);
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
moefuse_status mf_moe_check_routing(moefuse_context *ctx, const char *op,
                                    const moefuse_routing *r, bool need_weights, mf_moe_args *a,
                                    mf_shared *sh)
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
    if (!sh) {
        if (r->n_shared != 0)
            return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                            "%s: routing.n_shared is %d; shared experts have no part in this "
                            "call (0)",
                            op, (int)r->n_shared);
        return MOEFUSE_OK;
    }
    *sh = (mf_shared){0};
    if (r->n_shared < 0 || r->n_shared > a->experts)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: routing.n_shared is %d; it must be in 0..E = %lld (the last "
                        "n_shared experts of the weights are the shared ones)",
                        op, (int)r->n_shared, (long long)a->experts);
    if (r->n_shared == 0)
        return MOEFUSE_OK;
    if (!isfinite(r->shared_scale))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: routing.shared_scale is %g; it must be finite (0 means 1)", op,
                        (double)r->shared_scale);
    sh->n = r->n_shared;
    sh->routed = a->topk;
    sh->scale = r->shared_scale == 0.0f ? 1.0f : r->shared_scale;
    sh->weights = mf_absent();
    if (need_weights) {
        MF_TRY(mf_check_optional(ctx, op, "shared_weights", &r->shared_weights, 1,
                                 MF_DT(MOEFUSE_F32)));
        const int64_t want[1] = {a->tokens};
        if (mf_present(&r->shared_weights)) {
            MF_TRY(mf_expect_shape(ctx, op, "shared_weights", &r->shared_weights, want,
                                   "one per token, [M]"));
            sh->weights = r->shared_weights;
        }
    }
    a->topk += sh->n;
    return MOEFUSE_OK;
}

/* The routing tensors as inputs of the overlap check, at ops[0..3]. */
void mf_moe_routing_operands(const moefuse_routing *r, mf_operand *ops)
{
    ops[0] = (mf_operand){"topk_ids", &r->topk_ids, false};
    ops[1] = (mf_operand){"topk_weights", &r->topk_weights, false};
    ops[2] = (mf_operand){"expert_map", &r->expert_map, false};
    ops[3] = (mf_operand){"shared_weights", &r->shared_weights, false};
}

moefuse_status mf_moe_check_bias(moefuse_context *ctx, const char *op, const char *name,
                                 const moefuse_tensor *b, const int64_t *want, const char *what,
                                 moefuse_tensor *dst)
{
    MF_TRY(mf_check_optional(ctx, op, name, b, 2, MF_FLOATS));
    if (mf_present(b))
        MF_TRY(mf_expect_shape(ctx, op, name, b, want, what));
    *dst = mf_present(b) ? *b : mf_absent();
    return MOEFUSE_OK;
}

moefuse_status mf_moe_check_final_out(moefuse_context *ctx, const char *op,
                                      const moefuse_tensor *out, bool reduce, mf_moe_args *a)
{
    MF_TRY(mf_check_tensor(ctx, op, "out", out, reduce ? 2 : 3, MF_FLOATS));
    const int64_t want_reduced[2] = {a->tokens, a->model_dim};
    const int64_t want_slots[3] = {a->tokens, a->topk, a->model_dim};
    MF_TRY(mf_expect_shape(ctx, op, "out", out, reduce ? want_reduced : want_slots,
                           reduce ? "the reduced output [M, K]" : "the un-reduced output [M, k, K]"));
    a->reduce = reduce;
    a->out = *out;
    return MOEFUSE_OK;
}

moefuse_status mf_moe_check_layer_out(moefuse_context *ctx, const char *op,
                                      const moefuse_tensor *out, mf_moe_args *a)
{
    MF_TRY(mf_check_tensor(ctx, op, "out", out, 2, MF_FLOATS));
    const int64_t want[2] = {a->tokens, a->model_dim};
    MF_TRY(mf_expect_shape(ctx, op, "out", out, want, "x [M, K]"));
    a->reduce = true;
    a->out = *out;
    return MOEFUSE_OK;
}

moefuse_status mf_moe_finish_routed(moefuse_context *ctx, const char *op, mf_operand *operands,
                                    size_t own, const moefuse_routing *routing,
                                    bool reads_weights, mf_moe_args *a, const mf_shared *sh,
                                    mf_moe_runner run, size_t *measure)
{
    mf_operand *route = operands + own;
    mf_moe_routing_operands(routing, route);
    if (!reads_weights)
        route[1].t = route[3].t = NULL; /* topk_weights, shared_weights */
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, own + MF_ROUTING_OPERANDS, &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    return mf_moe_run_shared(ctx, op, a, sh, run, measure);
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
    MF_TRY(mf_moe_check_bias(ctx, op, "b1", b1, w1->shape, "w1 [E, 2I, K]", &a->b1));
    a->x = *x;
    a->w1 = *w1;
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
    MF_TRY(mf_moe_check_bias(ctx, op, "b2", b2, want, "w2 [E, K, I]", &a->b2));
    a->w2 = *w2;
    return MOEFUSE_OK;
}


/* The scratch a GEMM step takes: its backend member's answer, or none; 0 as well when the size
 * does not matter to this call (mf_workspace_matters). */
moefuse_status mf_moe_step_workspace(moefuse_context *ctx, mf_moe_size_fn size, const mf_moe_args *a,
                                     size_t *measure, size_t *bytes)
{
    *bytes = 0;
    return size && mf_workspace_matters(ctx, measure) ? size(ctx, ctx->state, a, bytes)
                                                      : MOEFUSE_OK;
}

/* Run (or measure) moe_gate or moe_final, whose arguments are valid. */
moefuse_status mf_moe_run_step(moefuse_context *ctx, const char *op, mf_moe_fn fn, mf_moe_size_fn size,
                               const mf_moe_args *a, size_t *measure)
{
    if (!fn)
        return mf_unimplemented(ctx, op);
    size_t need;
    MF_TRY(mf_moe_step_workspace(ctx, size, a, measure, &need));
    bool run;
    MF_TRY(mf_workspace_step(ctx, op, need, measure, &run));
    return run ? fn(ctx, ctx->state, a) : MOEFUSE_OK;
}

static moefuse_status gate_step(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                size_t *measure)
{
    return mf_moe_run_step(ctx, op, ctx->backend->moe_gate, ctx->backend->moe_gate_workspace, a,
                           measure);
}

static moefuse_status final_step(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                 size_t *measure)
{
    return mf_moe_run_step(ctx, op, ctx->backend->moe_final, ctx->backend->moe_final_workspace,
                           a, measure);
}

moefuse_status mf_moe_gate_call(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                const moefuse_tensor *w1, const moefuse_tensor *b1,
                                const moefuse_routing *routing, const moefuse_tensor *h,
                                const moefuse_moe_options *opt, size_t *measure)
{
    mf_moe_args a = {0};
    MF_TRY(mf_moe_check_options(ctx, op, opt, &a.opt));
    MF_TRY(check_gate_operands(ctx, op, x, w1, b1, &a));
    mf_shared sh;
    MF_TRY(mf_moe_check_routing(ctx, op, routing, false, &a, &sh));
    MF_TRY(mf_check_tensor(ctx, op, "h", h, 3, MF_FLOATS));
    int64_t want[3] = {a.tokens, a.topk, a.inter_dim};
    MF_TRY(mf_expect_shape(ctx, op, "h", h, want,
                           "[M, k, I] from x, topk_ids (plus routing.n_shared) and w1"));
    a.h = *h;
    a.w2 = a.b2 = a.out = mf_absent();
    mf_operand operands[4 + MF_ROUTING_OPERANDS] = {
        {"x", x, false}, {"w1", w1, false}, {"b1", b1, false}, {"h", h, true}};
    /* the gate reads no router weights */
    return mf_moe_finish_routed(ctx, op, operands, 4, routing, false, &a, &sh, gate_step,
                                measure);
}

moefuse_status mf_moe_final_call(moefuse_context *ctx, const char *op, const moefuse_tensor *h,
                                 const moefuse_tensor *w2, const moefuse_tensor *b2,
                                 const moefuse_routing *routing, const moefuse_tensor *out,
                                 const moefuse_moe_options *opt, size_t *measure)
{
    mf_moe_args a = {0};
    MF_TRY(mf_moe_check_options(ctx, op, opt, &a.opt));
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
    mf_shared sh;
    MF_TRY(mf_moe_check_routing(ctx, op, routing, reduce, &a, &sh));
    if (h->shape[1] != a.topk)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: h has k = %lld slots but topk_ids has k = %lld (and routing %lld "
                        "shared experts)",
                        op, (long long)h->shape[1], (long long)(a.topk - sh.n), (long long)sh.n);
    MF_TRY(mf_moe_check_final_out(ctx, op, out, reduce, &a));
    a.h = *h;
    a.x = a.w1 = a.b1 = mf_absent();
    mf_operand operands[4 + MF_ROUTING_OPERANDS] = {
        {"h", h, false}, {"w2", w2, false}, {"b2", b2, false}, {"out", out, true}};
    /* only the reduced output reads router weights */
    return mf_moe_finish_routed(ctx, op, operands, 4, routing, reduce, &a, &sh, final_step,
                                measure);
}

moefuse_status mf_moe_in_forward(moefuse_context *ctx, const char *op, moefuse_status status)
{
    if (status != MOEFUSE_OK) {
        char step[MF_MESSAGE_BYTES];
        memcpy(step, ctx->message, sizeof step);
        mf_error(ctx, status, "%s: %s", op, step);
    }
    return status;
}

/*
 * moe_forward for a backend without a whole-layer kernel: moe_gate into h [M, k, I] in x's
 * dtype, then moe_final. With the caller's workspace, the steps' scratch comes first and h
 * after it; else h is the context's own scratch and each step allocates as it would alone.
 */
static moefuse_status gate_then_final(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                      size_t *measure)
{
    const moefuse_dtype dt = a->x.dtype;
    size_t h_bytes;
    if (__builtin_mul_overflow((size_t)a->tokens, (size_t)a->topk, &h_bytes) ||
        __builtin_mul_overflow(h_bytes, (size_t)a->inter_dim, &h_bytes) ||
        __builtin_mul_overflow(h_bytes, moefuse_dtype_size(dt), &h_bytes))
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: the [M, k, I] intermediate overflows size_t",
                        op);
    const int64_t h_shape[3] = {a->tokens, a->topk, a->inter_dim};
    a->h = moefuse_tensor_dense(NULL, dt, 3, h_shape); /* the steps' sizes read its shape only */
    size_t gate_need, final_need;
    MF_TRY(mf_moe_step_workspace(ctx, ctx->backend->moe_gate_workspace, a, measure, &gate_need));
    MF_TRY(mf_moe_step_workspace(ctx, ctx->backend->moe_final_workspace, a, measure, &final_need));
    const size_t off_h = mf_workspace_align(gate_need > final_need ? gate_need : final_need);
    const size_t need = mf_size_add_sat(off_h, h_bytes);
    bool run;
    MF_TRY(mf_workspace_step(ctx, op, need, measure, &run));
    if (!run)
        return MOEFUSE_OK;
    mf_region ws;
    if (mf_caller_workspace(ctx, &ws)) {
        a->h.data = ws.data;
        a->h.offset = (int64_t)(ws.offset + off_h);
    } else {
        MF_TRY(mf_moe_in_forward(ctx, op, mf_workspace(ctx, h_bytes ? h_bytes : 1, &a->h.data)));
    }
    MF_TRY(mf_moe_in_forward(ctx, op, ctx->backend->moe_gate(ctx, ctx->state, a)));
    return mf_moe_in_forward(ctx, op, ctx->backend->moe_final(ctx, ctx->state, a));
}

/* The whole layer on valid arguments: the backend's layer kernel, or gate then final. */
static moefuse_status forward_layer(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                    size_t *measure)
{
    if (ctx->backend->moe_forward) { /* it keeps h in scratch of its own */
        a->h = mf_absent();
        return mf_moe_run_step(ctx, op, ctx->backend->moe_forward,
                               ctx->backend->moe_forward_workspace, a, measure);
    }
    if (!ctx->backend->moe_gate || !ctx->backend->moe_final)
        return mf_unimplemented(ctx, op);
    return gate_then_final(ctx, op, a, measure);
}

static moefuse_status moe_forward(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                  const moefuse_tensor *w1, const moefuse_tensor *w2,
                                  const moefuse_tensor *b1, const moefuse_tensor *b2,
                                  const moefuse_routing *routing, const moefuse_tensor *out,
                                  const moefuse_moe_options *opt, size_t *measure)
{
    mf_moe_args a = {0};
    MF_TRY(mf_moe_check_options(ctx, op, opt, &a.opt));
    MF_TRY(check_gate_operands(ctx, op, x, w1, b1, &a));
    MF_TRY(check_final_weights(ctx, op, w2, b2, x->dtype, "x", &a));
    mf_shared sh;
    MF_TRY(mf_moe_check_routing(ctx, op, routing, true, &a, &sh));
    MF_TRY(mf_moe_check_layer_out(ctx, op, out, &a));
    mf_operand operands[6 + MF_ROUTING_OPERANDS] = {
        {"x", x, false},   {"w1", w1, false}, {"w2", w2, false},
        {"b1", b1, false}, {"b2", b2, false}, {"out", out, true}};
    return mf_moe_finish_routed(ctx, op, operands, 6, routing, true, &a, &sh, forward_layer,
                                measure);
}

/* ------------------------------------------------------------ entry points */

moefuse_status moefuse_moe_gate(moefuse_context *ctx, const moefuse_tensor *x,
                                const moefuse_tensor *w1, const moefuse_tensor *b1,
                                const moefuse_routing *routing, const moefuse_tensor *h,
                                const moefuse_moe_options *opt)
{
    static const char op[] = "moe_gate";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, mf_moe_gate_call(ctx, op, x, w1, b1, routing, h, opt, NULL));
}

moefuse_status moefuse_moe_gate_workspace_size(moefuse_context *ctx, const moefuse_tensor *x,
                                               const moefuse_tensor *w1, const moefuse_tensor *b1,
                                               const moefuse_routing *routing,
                                               const moefuse_tensor *h,
                                               const moefuse_moe_options *opt, size_t *bytes)
{
    static const char op[] = "moe_gate";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, mf_moe_gate_call(ctx, op, x, w1, b1, routing, h, opt, bytes));
}

moefuse_status moefuse_moe_final(moefuse_context *ctx, const moefuse_tensor *h,
                                 const moefuse_tensor *w2, const moefuse_tensor *b2,
                                 const moefuse_routing *routing, const moefuse_tensor *out,
                                 const moefuse_moe_options *opt)
{
    static const char op[] = "moe_final";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, mf_moe_final_call(ctx, op, h, w2, b2, routing, out, opt, NULL));
}

moefuse_status moefuse_moe_final_workspace_size(moefuse_context *ctx, const moefuse_tensor *h,
                                                const moefuse_tensor *w2, const moefuse_tensor *b2,
                                                const moefuse_routing *routing,
                                                const moefuse_tensor *out,
                                                const moefuse_moe_options *opt, size_t *bytes)
{
    static const char op[] = "moe_final";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, mf_moe_final_call(ctx, op, h, w2, b2, routing, out, opt, bytes));
}

moefuse_status moefuse_moe_forward(moefuse_context *ctx, const moefuse_tensor *x,
                                   const moefuse_tensor *w1, const moefuse_tensor *w2,
                                   const moefuse_tensor *b1, const moefuse_tensor *b2,
                                   const moefuse_routing *routing, const moefuse_tensor *out,
                                   const moefuse_moe_options *opt)
{
    static const char op[] = "moe_forward";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, moe_forward(ctx, op, x, w1, w2, b1, b2, routing, out, opt, NULL));
}

moefuse_status moefuse_moe_forward_workspace_size(moefuse_context *ctx, const moefuse_tensor *x,
                                                  const moefuse_tensor *w1,
                                                  const moefuse_tensor *w2,
                                                  const moefuse_tensor *b1,
                                                  const moefuse_tensor *b2,
                                                  const moefuse_routing *routing,
                                                  const moefuse_tensor *out,
                                                  const moefuse_moe_options *opt, size_t *bytes)
{
    static const char op[] = "moe_forward";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, moe_forward(ctx, op, x, w1, w2, b1, b2, routing, out, opt, bytes));
}
