/*
 * Shared experts (docs/NUMERICS.md "MoE"): every token passes through the last n_shared
 * experts as slots after its routed ones. The core makes them ordinary slots once, for every
 * backend and every GEMM path: the backend writes the ids and weights of all k + n slots
 * (moe_shared_routing), and the MoE members run on those, with no expert map.
 */
#include "core/moe_checks.h"

moefuse_status mf_moe_run_shared(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                 const mf_shared *sh, mf_moe_runner run, size_t *measure)
{
    if (sh->n == 0)
        return run(ctx, op, a, measure);
    if (!ctx->backend->moe_shared_routing)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "%s: the %s backend has no shared experts yet (routing.n_shared is %lld)",
                        op, ctx->backend->name, (long long)sh->n);
    /* what the backend writes: from the routing as the caller gave it */
    mf_shared_args s = {0};
    s.route = *a;
    s.route.topk = sh->routed;
    s.n_shared = sh->n;
    s.scale = sh->scale;
    s.shared_weights = sh->weights;
    /* what the MoE members get: k + n slots of local ids */
    const bool weights = a->topk_weights.data != NULL;
    size_t cells;
    if (__builtin_mul_overflow((size_t)a->tokens, (size_t)a->topk, &cells) ||
        __builtin_mul_overflow(cells, sizeof(int32_t), &cells))
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: the [M, k + n_shared] slots overflow size_t",
                        op);
    const size_t ids_bytes = mf_workspace_align(cells);
    const size_t own =
        weights ? mf_size_add_sat(ids_bytes, mf_workspace_align(cells)) : ids_bytes;
    const int64_t shape[2] = {a->tokens, a->topk};
    mf_moe_args in = *a;
    in.topk_ids = moefuse_tensor_dense(NULL, MOEFUSE_I32, 2, shape);
    in.topk_weights = weights ? moefuse_tensor_dense(NULL, MOEFUSE_F32, 2, shape) : mf_absent();
    in.expert_map = mf_absent();
    in.global_experts = in.experts;
    /* the slots go in front of the workspace, the call's own scratch after them */
    mf_region ws;
    const bool given = mf_caller_workspace(ctx, &ws);
    if (measure || given) {
        size_t inner = 0;
        MF_TRY(run(ctx, op, &in, &inner)); /* sizes only: in's tensors have no data yet */
        bool go;
        MF_TRY(mf_workspace_step(ctx, op, mf_size_add_sat(own, inner), measure, &go));
        if (!go)
            return MOEFUSE_OK;
    }
    void *base;
    uint64_t at = 0;
    if (given) {
        base = ws.data;
        at = ws.offset;
    } else {
        MF_TRY(mf_shared_routing_scratch(ctx, own, &base));
    }
    in.topk_ids.data = base;
    in.topk_ids.offset = (int64_t)at;
    if (weights) {
        in.topk_weights.data = base;
        in.topk_weights.offset = (int64_t)(at + ids_bytes);
    }
    s.ids = in.topk_ids;
    s.weights = in.topk_weights;
    MF_TRY(ctx->backend->moe_shared_routing(ctx, ctx->state, &s));
    if (!given)
        return run(ctx, op, &in, NULL);
    ctx->caller_workspace.offset += own; /* the call's scratch: what follows the slots */
    ctx->caller_workspace.bytes -= own;
    const moefuse_status st = run(ctx, op, &in, NULL);
    ctx->caller_workspace = ws;
    return st;
}
