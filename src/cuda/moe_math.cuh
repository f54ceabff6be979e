/*
 * The MoE kernels' element helpers, on top of src/cuda/numerics.cuh (the
 * backend's bit-exact formats and activations of docs/NUMERICS.md): loads of
 * a float element of any dtype, one rounding on store, and the gate's
 * clamp + up offset + activation + product with the CPU's NaN bits
 * (mf_add_up_offset, mf_activate_f32, mf_mul).
 * Arithmetic the MoE kernels write themselves uses the _rn intrinsics, so no
 * a*b+c is ever contracted, whatever --fmad says.
 */
#ifndef MOEFUSE_CUDA_MOE_MATH_CUH
#define MOEFUSE_CUDA_MOE_MATH_CUH

#include "cuda/numerics.cuh"

#include <stdint.h>

/* Element i of a float tensor of dtype dt, as f32. */
static __device__ __forceinline__ float mfm_load(const void *p, int dt, int64_t i)
{
    if (dt == MF_DT_F32)
        return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return dt == MF_DT_BF16 ? mf_bf16_to_f32(h) : mf_f16_to_f32(h);
}

/* Round v once to dtype dt and store it as element i. */
static __device__ __forceinline__ void mfm_store(void *p, int dt, int64_t i, float v)
{
    if (dt == MF_DT_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = (uint16_t)(dt == MF_DT_BF16 ? mf_f32_to_bf16(v) : mf_f32_to_f16(v));
}

/* The gate's inputs before the activation (NUMERICS.md "Gated activation" steps 1-2): the
 * optional clamp (limit > 0), then the up offset beta (0: none). */
static __device__ __forceinline__ void mfm_gate_inputs(float limit, float beta, float &g, float &u)
{
    if (limit > 0.0f) {
        g = mf_clamp_gate(g, limit);
        u = mf_clamp_up(u, limit);
    }
    u = mf_add_up_offset(u, beta);
}

/* h = act(g) * (u + beta) with the optional clamp, in f32 (steps 1-3); alpha is silu_alpha's. */
static __device__ __forceinline__ float mfm_gated(int act, float alpha, float limit, float beta,
                                                  float g, float u)
{
    mfm_gate_inputs(limit, beta, g, u);
    return mf_mul(mf_activate_f32(act, alpha, g), u);
}

/* mfm_gated's bits, with silu by the exp table at shared-memory address tabs where
 * mf_silu_fast is proved the same: no global table load and no IEEE division's range check. */
static __device__ __forceinline__ float mfm_gated_tab(int act, float alpha, float limit,
                                                      float beta, float g, float u, uint32_t tabs)
{
    mfm_gate_inputs(limit, beta, g, u);
    const float a = act == MF_ACT_SILU && mf_silu_fast_ok(g) ? mf_silu_fast(g, tabs)
                                                             : mf_activate_f32(act, alpha, g);
    return mf_mul(a, u);
}

#endif /* MOEFUSE_CUDA_MOE_MATH_CUH */
