/* Host side of topk_softmax: one work-item per token row. */
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
