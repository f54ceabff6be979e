/* Public entry point of the router: topk_softmax. */
#include "core/core.h"

static moefuse_status topk_softmax(moefuse_context *ctx, const char *op,
                                   const moefuse_tensor *logits, int32_t renormalize,
                                   const moefuse_tensor *ids, const moefuse_tensor *weights,
                                   size_t *measure)
{
    mf_topk_args a = {0};
    MF_TRY(mf_check_tensor(ctx, op, "logits", logits, 2, MF_FLOATS));
    a.tokens = logits->shape[0];
    a.experts = logits->shape[1];
    MF_TRY(mf_check_tensor(ctx, op, "ids", ids, 2, MF_DT(MOEFUSE_I32)));
    a.topk = ids->shape[1];
    if (ids->shape[0] != a.tokens || a.topk < 1 || a.topk > a.experts)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: ids is [%lld, %lld] but logits [%lld, %lld] needs [M, k] with M = %lld "
                        "and 1 <= k <= E = %lld",
                        op, (long long)ids->shape[0], (long long)a.topk, (long long)a.tokens,
                        (long long)a.experts, (long long)a.tokens, (long long)a.experts);
    MF_TRY(mf_check_tensor(ctx, op, "weights", weights, 2, MF_DT(MOEFUSE_F32)));
    MF_TRY(mf_expect_shape(ctx, op, "weights", weights, ids->shape, "ids [M, k]"));
    a.logits = *logits;
    a.ids = *ids;
    a.weights = *weights;
    a.renormalize = renormalize != 0;
    const mf_operand operands[] = {
        {"logits", logits, false}, {"ids", ids, true}, {"weights", weights, true}};
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, sizeof operands / sizeof operands[0], &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    if (!ctx->backend->topk_softmax)
        return mf_unimplemented(ctx, op);
    size_t need = 0;
    if (ctx->backend->topk_workspace && mf_workspace_matters(ctx, measure))
        MF_TRY(ctx->backend->topk_workspace(ctx, ctx->state, &a, &need));
    bool run;
    MF_TRY(mf_workspace_step(ctx, op, need, measure, &run));
    return run ? ctx->backend->topk_softmax(ctx, ctx->state, &a) : MOEFUSE_OK;
}

moefuse_status moefuse_topk_softmax(moefuse_context *ctx, const moefuse_tensor *logits,
                                    int32_t renormalize, const moefuse_tensor *ids,
                                    const moefuse_tensor *weights)
{
    static const char op[] = "topk_softmax";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, topk_softmax(ctx, op, logits, renormalize, ids, weights, NULL));
}

moefuse_status moefuse_topk_softmax_workspace_size(moefuse_context *ctx,
                                                   const moefuse_tensor *logits,
                                                   int32_t renormalize, const moefuse_tensor *ids,
                                                   const moefuse_tensor *weights, size_t *bytes)
{
    static const char op[] = "topk_softmax";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, topk_softmax(ctx, op, logits, renormalize, ids, weights, bytes));
}
