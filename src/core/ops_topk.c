/* Public entry points of the routers: topk_softmax and topk_route. */
#include "core/core.h"
#include "core/options.h"

#include <math.h>

/* logits [M, E], ids [M, k] with 1 <= k <= E, weights [M, k]: into a (both routers). */
static moefuse_status check_router_operands(moefuse_context *ctx, const char *op,
                                            const moefuse_tensor *logits,
                                            const moefuse_tensor *ids,
                                            const moefuse_tensor *weights, mf_topk_args *a)
{
    a->op = op;
    MF_TRY(mf_check_tensor(ctx, op, "logits", logits, 2, MF_FLOATS));
    a->tokens = logits->shape[0];
    a->experts = logits->shape[1];
    MF_TRY(mf_check_tensor(ctx, op, "ids", ids, 2, MF_DT(MOEFUSE_I32)));
    a->topk = ids->shape[1];
    if (ids->shape[0] != a->tokens || a->topk < 1 || a->topk > a->experts)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: ids is [%lld, %lld] but logits [%lld, %lld] needs [M, k] with M = %lld "
                        "and 1 <= k <= E = %lld",
                        op, (long long)ids->shape[0], (long long)a->topk, (long long)a->tokens,
                        (long long)a->experts, (long long)a->tokens, (long long)a->experts);
    MF_TRY(mf_check_tensor(ctx, op, "weights", weights, 2, MF_DT(MOEFUSE_F32)));
    MF_TRY(mf_expect_shape(ctx, op, "weights", weights, ids->shape, "ids [M, k]"));
    a->logits = *logits;
    a->ids = *ids;
    a->weights = *weights;
    return MOEFUSE_OK;
}

static moefuse_status topk_softmax(moefuse_context *ctx, const char *op,
                                   const moefuse_tensor *logits, int32_t renormalize,
                                   const moefuse_tensor *ids, const moefuse_tensor *weights,
                                   size_t *measure)
{
    mf_topk_args a = {0};
    MF_TRY(check_router_operands(ctx, op, logits, ids, weights, &a));
    a.renormalize = renormalize != 0;
    const mf_operand operands[] = {
        {"logits", logits, false}, {"ids", ids, true}, {"weights", weights, true}};
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, sizeof operands / sizeof operands[0], &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    a.logit_bias = a.choice_bias = mf_absent();
    a.scoring = MOEFUSE_ROUTER_SOFTMAX;
    a.group_scoring = MOEFUSE_GROUP_TOP2_SUM;
    a.groups = a.groups_kept = 1;
    a.scale = 1.0f;
    moefuse_status (*run_op)(moefuse_context *, void *, const mf_topk_args *) =
        ctx->backend->topk_softmax ? ctx->backend->topk_softmax : ctx->backend->topk_route;
    if (!run_op)
        return mf_unimplemented(ctx, op);
    size_t need = 0;
    if (ctx->backend->topk_workspace && mf_workspace_matters(ctx, measure))
        MF_TRY(ctx->backend->topk_workspace(ctx, ctx->state, &a, &need));
    bool run;
    MF_TRY(mf_workspace_step(ctx, op, need, measure, &run));
    return run ? run_op(ctx, ctx->state, &a) : MOEFUSE_OK;
}

/* The router options, checked against E and k: groups, scoring and scale into a. */
static moefuse_status route_options(moefuse_context *ctx, const char *op,
                                    const moefuse_router_options *in, mf_topk_args *a)
{
    moefuse_router_options opt = {0};
    if (in)
        opt = *in;
    if ((unsigned)opt.scoring > MOEFUSE_ROUTER_TOPK_SOFTMAX)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: scoring %d is not a moefuse_router_scoring", op, (int)opt.scoring);
    if ((unsigned)opt.group_scoring > MOEFUSE_GROUP_MAX)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: group_scoring %d is not a moefuse_group_scoring", op,
                        (int)opt.group_scoring);
    if (!isfinite(opt.scale))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: scale is %g; it must be finite (0 means 1)", op, (double)opt.scale);
    MF_TRY(MF_CHECK_RESERVED(ctx, op, "router options", opt.reserved));
    const int64_t E = a->experts;
    if (opt.n_group < 0 || opt.n_group > MOEFUSE_ROUTER_MAX_GROUPS ||
        (opt.n_group > 1 && E % opt.n_group != 0))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: n_group is %d; it must be 0 or 1 (no groups), or divide E = %lld and "
                        "be at most %d",
                        op, (int)opt.n_group, (long long)E, MOEFUSE_ROUTER_MAX_GROUPS);
    a->groups = opt.n_group > 1 ? opt.n_group : 1;
    a->groups_kept = a->groups;
    if (a->groups > 1) {
        if (opt.topk_group < 1 || opt.topk_group > opt.n_group)
            return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                            "%s: topk_group is %d; with n_group = %d it must be in 1..%d", op,
                            (int)opt.topk_group, (int)opt.n_group, (int)opt.n_group);
        a->groups_kept = opt.topk_group;
    } else if (opt.topk_group > 1) {
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: topk_group is %d but n_group is %d: there are no groups to keep", op,
                        (int)opt.topk_group, (int)opt.n_group);
    }
    const int64_t candidates = a->groups_kept * (E / a->groups);
    if (a->topk > candidates)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: k = %lld but the kept groups hold %lld experts (topk_group %lld of "
                        "%lld groups of %lld)",
                        op, (long long)a->topk, (long long)candidates, (long long)a->groups_kept,
                        (long long)a->groups, (long long)(E / a->groups));
    a->scoring = opt.scoring;
    a->group_scoring = opt.group_scoring;
    a->renormalize = opt.renormalize != 0;
    a->scale = opt.scale == 0.0f ? 1.0f : opt.scale;
    return MOEFUSE_OK;
}

static moefuse_status topk_route(moefuse_context *ctx, const char *op,
                                 const moefuse_tensor *logits, const moefuse_tensor *logit_bias,
                                 const moefuse_tensor *choice_bias,
                                 const moefuse_router_options *opt, const moefuse_tensor *ids,
                                 const moefuse_tensor *weights, size_t *measure)
{
    mf_topk_args a = {0};
    MF_TRY(check_router_operands(ctx, op, logits, ids, weights, &a));
    const int64_t bias_shape[1] = {a.experts};
    MF_TRY(mf_check_optional(ctx, op, "logit_bias", logit_bias, 1, MF_FLOATS));
    if (mf_present(logit_bias))
        MF_TRY(mf_expect_shape(ctx, op, "logit_bias", logit_bias, bias_shape, "logits [M, E]: [E]"));
    MF_TRY(mf_check_optional(ctx, op, "choice_bias", choice_bias, 1, MF_FLOATS));
    if (mf_present(choice_bias))
        MF_TRY(mf_expect_shape(ctx, op, "choice_bias", choice_bias, bias_shape,
                               "logits [M, E]: [E]"));
    MF_TRY(route_options(ctx, op, opt, &a));
    a.logit_bias = mf_present(logit_bias) ? *logit_bias : mf_absent();
    a.choice_bias = mf_present(choice_bias) ? *choice_bias : mf_absent();
    const mf_operand operands[] = {{"logits", logits, false},
                                   {"logit_bias", logit_bias, false},
                                   {"choice_bias", choice_bias, false},
                                   {"ids", ids, true},
                                   {"weights", weights, true}};
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, sizeof operands / sizeof operands[0], &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    if (!ctx->backend->topk_route)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "%s: the %s backend has no grouped or biased router (topk_softmax may "
                        "run here)",
                        op, ctx->backend->name);
    size_t need = 0;
    if (ctx->backend->topk_workspace && mf_workspace_matters(ctx, measure))
        MF_TRY(ctx->backend->topk_workspace(ctx, ctx->state, &a, &need));
    bool run;
    MF_TRY(mf_workspace_step(ctx, op, need, measure, &run));
    return run ? ctx->backend->topk_route(ctx, ctx->state, &a) : MOEFUSE_OK;
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

moefuse_status moefuse_topk_route(moefuse_context *ctx, const moefuse_tensor *logits,
                                  const moefuse_tensor *logit_bias,
                                  const moefuse_tensor *choice_bias,
                                  const moefuse_router_options *opt, const moefuse_tensor *ids,
                                  const moefuse_tensor *weights)
{
    static const char op[] = "topk_route";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, topk_route(ctx, op, logits, logit_bias, choice_bias, opt, ids, weights,
                                    NULL));
}

moefuse_status moefuse_topk_route_workspace_size(moefuse_context *ctx,
                                                 const moefuse_tensor *logits,
                                                 const moefuse_tensor *logit_bias,
                                                 const moefuse_tensor *choice_bias,
                                                 const moefuse_router_options *opt,
                                                 const moefuse_tensor *ids,
                                                 const moefuse_tensor *weights, size_t *bytes)
{
    static const char op[] = "topk_route";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, topk_route(ctx, op, logits, logit_bias, choice_bias, opt, ids, weights,
                                    bytes));
}
