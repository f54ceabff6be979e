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

/* The activation of a gate the fast silu does not cover, or of another activation. */
static __device__ __noinline__ float mfm_act_slow(int act, float alpha, float g)
{
    return mf_activate_f32(act, alpha, g);
}

/*
 * The gate's epilogue for one chunk of a Hopper tile, its eight values side by side so that
 * their latencies overlap (a rolled loop of one value at a time left the tensor cores idle
 * for a quarter of a Mixtral gate tile): g[j] and u[j], value j of h column
 * c0 + 8 (j >> 2) + (j & 1), and h comes back in g. gb and ub: the bias elements of column
 * c0 (gate, up), read for columns below ncols only. mfm_gated's steps and bits, silu by the
 * shared-table exp where it is proved the same.
 */
static __device__ __forceinline__ void mfm_gate_vals(int act, float alpha, float limit, float beta,
                                                     const void *bias, int bias_dt, long long gb,
                                                     long long ub, long long c0, long long ncols,
                                                     uint32_t tabs, float (&g)[8], float (&u)[8])
{
    float a[8];
    if (bias) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int c = 8 * (j >> 2) + (j & 1);
            if (c0 + c < ncols) {
                g[j] = __fadd_rn(g[j], mfm_load(bias, bias_dt, gb + c));
                u[j] = __fadd_rn(u[j], mfm_load(bias, bias_dt, ub + c));
            }
        }
    }
    if (limit > 0.0f) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            g[j] = mf_clamp_gate(g[j], limit);
            u[j] = mf_clamp_up(u[j], limit);
        }
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
        u[j] = mf_add_up_offset(u[j], beta);
    if (act == MF_ACT_SILU) {
        bool ok = true;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            ok &= mf_silu_fast_ok(g[j]) != 0;
            a[j] = mf_silu_fast(g[j], tabs);
        }
        if (!ok) {
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (!mf_silu_fast_ok(g[j]))
                    a[j] = mfm_act_slow(act, alpha, g[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++)
            a[j] = mfm_act_slow(act, alpha, g[j]);
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
        g[j] = mf_mul(a[j], u[j]);
}

/*
 * mfm_gate_vals out of line, on a chunk in the calling thread's column of shared memory,
 * STRIDE floats apart: gate values at 0..7 and their up values at 8..15; h comes back over
 * the gate values.
 */
template <int STRIDE>
static __device__ __noinline__ void mfm_gate_chunk(int act, float alpha, float limit, float beta,
                                                   const void *bias, int bias_dt, long long gb,
                                                   long long ub, long long c0, long long ncols,
                                                   uint32_t tabs, float *buf)
{
    float g[8], u[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        g[j] = buf[j * STRIDE];
        u[j] = buf[(8 + j) * STRIDE];
    }
    mfm_gate_vals(act, alpha, limit, beta, bias, bias_dt, gb, ub, c0, ncols, tabs, g, u);
#pragma unroll
    for (int j = 0; j < 8; j++)
        buf[j * STRIDE] = g[j];
}

/* Out of line: a bias pair (elements i, i + 1), which inline would double a kernel's code. */
static __device__ __noinline__ float2 mfm_bias_pair(const void *bias, int bias_dt, long long i)
{
    return make_float2(mfm_load(bias, bias_dt, i), mfm_load(bias, bias_dt, i + 1));
}

/*
 * A final's row of a Hopper tile straight from a thread's m64nN accumulators (m[4 i + 2 h]
 * and the next: row h's pair at column 8 i), plus the bias (bb: its element of the thread's
 * first column), a pair a store at out + at0 + 8 i: some six instructions a pair, where a
 * chunk through shared memory spends twenty. bf16 by the hardware's pair conversion, which
 * gives mf_f32_to_bf16's bits but for NaN: returns whether any value was NaN, and then the
 * caller stores the row again by mfm_store. The caller checks that the pairs are aligned
 * and inside the output.
 */
template <bool BF16, int N>
static __device__ __forceinline__ bool mfm_y_row(void *out, const void *bias, int bias_dt,
                                                 long long bb, long long at0, int h,
                                                 const float (&m)[N])
{
    bool nan = false;
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
        float lo = m[4 * i + 2 * h], hi = m[4 * i + 2 * h + 1];
        if (bias) { /* no +0 without a bias: it would turn -0 into +0 */
            const float2 b = mfm_bias_pair(bias, bias_dt, bb + 8 * i);
            lo = __fadd_rn(lo, b.x);
            hi = __fadd_rn(hi, b.y);
        }
        if (BF16) {
            nan |= (lo != lo) | (hi != hi);
            *(uint32_t *)((uint16_t *)out + at0 + 8 * i) = mf_bf16x2_rn(lo, hi);
        } else {
            *(float2 *)((float *)out + at0 + 8 * i) = make_float2(lo, hi);
        }
    }
    return nan;
}

#endif /* MOEFUSE_CUDA_MOE_MATH_CUH */
