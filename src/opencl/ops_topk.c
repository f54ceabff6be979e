/* Host side of topk_softmax: one work-item per token row. */
#include "opencl/ocl_internal.h"

moefuse_status mf_ocl_topk_softmax(moefuse_context *ctx, void *state, const mf_topk_args *a)
{
    ocl_state *s = state;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_TOPK_SOFTMAX]);
    mf_karg_tensor(&k, &a->logits);
    mf_karg_long(&k, a->logits.stride[0]);
    mf_karg_int(&k, (int32_t)a->logits.dtype);
    mf_karg_tensor(&k, &a->ids);
    mf_karg_long(&k, a->ids.stride[0]);
    mf_karg_tensor(&k, &a->weights);
    mf_karg_long(&k, a->weights.stride[0]);
    mf_karg_long(&k, a->tokens);
    mf_karg_long(&k, a->experts);
    mf_karg_long(&k, a->topk);
    mf_karg_int(&k, a->renormalize);
    const size_t local = 64;
    const size_t global = mf_round_up((size_t)a->tokens, local);
    return mf_ocl_launch(ctx, s, &k, "topk_softmax", 1, &global, &local);
}
