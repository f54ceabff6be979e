/* Host side of the routers, topk_softmax and topk_route: one work-item per token row. */
#include "opencl/ocl_internal.h"

moefuse_status mf_ocl_topk_softmax(moefuse_context *ctx, void *state, const mf_topk_args *a)
{
    ocl_state *s = state;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_TOPK_SOFTMAX]);
    mf_karg_operand(&k, &a->logits, 1, true);
    mf_karg_operand(&k, &a->ids, 1, false);
    mf_karg_operand(&k, &a->weights, 1, false);
    mf_karg_long(&k, a->tokens);
    mf_karg_long(&k, a->experts);
    mf_karg_long(&k, a->topk);
    mf_karg_int(&k, a->renormalize);
    const size_t local = 64;
    const size_t global = mf_round_up((size_t)a->tokens, local);
    return mf_ocl_launch(ctx, s, &k, "topk_softmax", 1, &global, &local);
}

moefuse_status mf_ocl_topk_route(moefuse_context *ctx, void *state, const mf_topk_args *a)
{
    ocl_state *s = state;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_TOPK_ROUTE]);
    mf_karg_operand(&k, &a->logits, 1, true);
    mf_karg_operand(&k, &a->logit_bias, 0, true);
    mf_karg_operand(&k, &a->choice_bias, 0, true);
    mf_karg_operand(&k, &a->ids, 1, false);
    mf_karg_operand(&k, &a->weights, 1, false);
    mf_karg_long(&k, a->tokens);
    mf_karg_long(&k, a->experts);
    mf_karg_long(&k, a->topk);
    mf_karg_int(&k, (int32_t)a->scoring);
    mf_karg_int(&k, (int32_t)a->group_scoring);
    mf_karg_long(&k, a->groups);
    mf_karg_long(&k, a->groups_kept);
    mf_karg_int(&k, a->renormalize);
    mf_karg_float(&k, a->scale);
    mf_karg_int(&k, a->logit_bias.data != NULL);
    mf_karg_int(&k, a->choice_bias.data != NULL);
    const size_t local = 64;
    const size_t global = mf_round_up((size_t)a->tokens, local);
    return mf_ocl_launch(ctx, s, &k, "topk_route", 1, &global, &local);
}
