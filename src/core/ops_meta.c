/* Public entry point of routing_metadata: the checks, then the backend. */
#include "core/core.h"
#include "core/moe_checks.h"

#include <limits.h>

/* An optional i32 output of `rank` with shape `want`. */
static moefuse_status check_out(moefuse_context *ctx, const char *op, const char *name,
                                const moefuse_tensor *t, int32_t rank, const int64_t *want,
                                const char *what)
{
    MF_TRY(mf_check_optional(ctx, op, name, t, rank, MF_DT(MOEFUSE_I32)));
    if (mf_present(t) && want)
        MF_TRY(mf_expect_shape(ctx, op, name, t, want, what));
    return MOEFUSE_OK;
}

static moefuse_status routing_metadata(moefuse_context *ctx, const char *op,
                                       const moefuse_routing *routing, int32_t block_size,
                                       const moefuse_routing_meta *meta, size_t *measure)
{
    if (!meta)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: meta is NULL", op);
    if (!routing)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: routing is NULL", op);
    mf_meta_args a = {0};
    MF_TRY(mf_check_tensor(ctx, op, "meta.counts", &meta->counts, 1, MF_DT(MOEFUSE_I32)));
    a.route.experts = meta->counts.shape[0];
    MF_TRY(mf_check_tensor(ctx, op, "topk_ids", &routing->topk_ids, 2, MF_DT(MOEFUSE_I32)));
    a.route.tokens = routing->topk_ids.shape[0];
    MF_TRY(mf_moe_check_routing(ctx, op, routing, false, &a.route, NULL));
    if (block_size < 1)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: block_size is %d; it must be at least 1 (1: no padding)", op,
                        (int)block_size);
    a.block = block_size;
    const int64_t M = a.route.tokens, k = a.route.topk, E = a.route.experts;
    /* every index the outputs hold is an i32: the slots, and the padded total */
    int64_t need = 0, pad = 0;
    if (__builtin_mul_overflow(M, k, &need) ||
        __builtin_mul_overflow(E, (int64_t)(block_size - 1), &pad) ||
        __builtin_add_overflow(need, pad, &need) || need > INT32_MAX)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: M * k + E * (block_size - 1) is above 2^31 - 1 (M = %lld, k = %lld, "
                        "E = %lld, block_size = %d): the outputs hold i32 indices",
                        op, (long long)M, (long long)k, (long long)E, (int)block_size);
    const int64_t offsets_shape[1] = {E + 1};
    MF_TRY(check_out(ctx, op, "meta.offsets", &meta->offsets, 1, offsets_shape, "counts [E]: [E + 1]"));
    MF_TRY(check_out(ctx, op, "meta.order", &meta->order, 1, NULL, NULL));
    if (mf_present(&meta->order) && meta->order.shape[0] < need)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: meta.order has %lld entries; it needs M * k + E * (block_size - 1) "
                        "= %lld",
                        op, (long long)meta->order.shape[0], (long long)need);
    MF_TRY(check_out(ctx, op, "meta.position", &meta->position, 2, routing->topk_ids.shape,
                     "topk_ids [M, k]"));
    MF_TRY(check_out(ctx, op, "meta.masked_row", &meta->masked_row, 2, routing->topk_ids.shape,
                     "topk_ids [M, k]"));
    a.counts = meta->counts;
    a.offsets = mf_present(&meta->offsets) ? meta->offsets : mf_absent();
    a.order = mf_present(&meta->order) ? meta->order : mf_absent();
    a.length = mf_present(&meta->order) ? meta->order.shape[0] : 0;
    a.position = mf_present(&meta->position) ? meta->position : mf_absent();
    a.masked_row = mf_present(&meta->masked_row) ? meta->masked_row : mf_absent();
    mf_operand operands[MF_ROUTING_OPERANDS + 5];
    mf_moe_routing_operands(routing, operands);
    operands[1].t = operands[3].t = NULL; /* no router weights are read */
    mf_operand *outs = operands + MF_ROUTING_OPERANDS;
    outs[0] = (mf_operand){"meta.counts", &meta->counts, true};
    outs[1] = (mf_operand){"meta.offsets", &meta->offsets, true};
    outs[2] = (mf_operand){"meta.order", &meta->order, true};
    outs[3] = (mf_operand){"meta.position", &meta->position, true};
    outs[4] = (mf_operand){"meta.masked_row", &meta->masked_row, true};
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, sizeof operands / sizeof operands[0], &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    if (!ctx->backend->routing_metadata)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "%s: the %s backend has no routing metadata",
                        op, ctx->backend->name);
    size_t scratch = 0;
    if (ctx->backend->meta_workspace && mf_workspace_matters(ctx, measure))
        MF_TRY(ctx->backend->meta_workspace(ctx, ctx->state, &a, &scratch));
    bool run;
    MF_TRY(mf_workspace_step(ctx, op, scratch, measure, &run));
    return run ? ctx->backend->routing_metadata(ctx, ctx->state, &a) : MOEFUSE_OK;
}

moefuse_status moefuse_routing_metadata(moefuse_context *ctx, const moefuse_routing *routing,
                                        int32_t block_size, const moefuse_routing_meta *meta)
{
    static const char op[] = "routing_metadata";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, routing_metadata(ctx, op, routing, block_size, meta, NULL));
}

moefuse_status moefuse_routing_metadata_workspace_size(moefuse_context *ctx,
                                                       const moefuse_routing *routing,
                                                       int32_t block_size,
                                                       const moefuse_routing_meta *meta,
                                                       size_t *bytes)
{
    static const char op[] = "routing_metadata";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, routing_metadata(ctx, op, routing, block_size, meta, bytes));
}
