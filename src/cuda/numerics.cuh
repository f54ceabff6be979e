/*
 * Number formats of docs/NUMERICS.md for the CUDA backend: the conversions, the activations
 * and exp are the shared text of src/numerics/ (the CPU and OpenCL backends compile the same),
 * plus the device's branch-free fast paths below, each proved equal to the shared text
 * (tools/device_check.cu): every rounding is integer code on the bits or one IEEE operation,
 * so the results do not depend on the compiler. The build passes --fmad=false: no a * b + c
 * is contracted unless written as fmaf.
 *
 * Everything here is __host__ __device__ and also compiles as plain C (gcc,
 * -ffp-contract=off), so the host program src/cuda/tools/check_numerics.c
 * can verify the scale division against double precision.
 */
#ifndef MOEFUSE_CUDA_NUMERICS_CUH
#define MOEFUSE_CUDA_NUMERICS_CUH

#include "numerics/mf_activation.h"
#include "numerics/mf_convert.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MF_HD static __host__ __device__ __forceinline__
#else
#define MF_HD static inline
#endif

/* moefuse_dtype / layout values, as plain ints (moefuse.h) */
#define MF_DT_F32 0
#define MF_DT_F16 1
#define MF_DT_BF16 2
#define MF_DT_F8 3
#define MF_DT_I8 4
#define MF_DT_I32 5
#define MF_DT_U8 6

#define MF_LAYOUT_ROW 0
#define MF_LAYOUT_COL 1
#define MF_LAYOUT_PACKED 2

/* ------------------------------------------------- device fast paths */

/* |q| with the sign of a: one lop3 on the device (nvcc makes two of the C expression). */
MF_HD float mf_with_sign_of(float q, float a)
{
#if defined(__CUDA_ARCH__)
    uint32_t r;
    asm("lop3.b32 %0, %1, 0x7FFFFFFF, %2, 0xE2;" : "=r"(r) : "r"(mf_f32_bits(q)), "r"(mf_f32_bits(a)));
    return mf_bits_f32(r);
#else
    return mf_bits_f32((mf_f32_bits(q) & 0x7FFFFFFFu) | (mf_f32_bits(a) & 0x80000000u));
#endif
}

#if defined(__CUDACC__)
/*
 * mf_exp_f32 (src/numerics/mf_exp.h) for |x| < MF_EXP_FAST_LIMIT: its very
 * pieces, with the table read from shared-memory address tabs (lanes index it
 * freely; constant memory would serialise them) and without the branch, so
 * the kernels can interleave the channels of a lane.
 */
static __device__ __forceinline__ float mf_exp_tab_fast(float x, uint32_t tabs)
{
    const uint32_t kb = mf_exp_kbits(x);
    const float q = mf_exp_poly(x, kb);
    float hi, lo;
    asm("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(hi), "=f"(lo) : "r"(tabs + ((kb & 31u) << 3)));
    /* mf_exp_scale_fast with n << 23 as (kb & ~31) * 2^18 (the same bits mod 2^32): one IMAD */
    return mf_bits_f32(mf_f32_bits(mf_exp_mantissa(q, hi, lo)) + (kb & ~31u) * 262144u);
}

/* Entry i < 64 of a shared-memory copy of MF_EXP_TABLE, for the table reads above; the copy
 * must be 8-byte aligned (__align__(8)): they load its (hi, lo) pairs with one ld.shared.v2. */
static __device__ __forceinline__ void mf_exp_tab_fill(float *tab, unsigned i)
{
    if (i < 64)
        tab[i] = MF_EXP_TABLE[i];
}

/* mf_exp_f32(x) with its fast path's table at shared-memory address tabs (a copy of
 * MF_EXP_TABLE, mf_exp_tab_fill): the same bits (device_check.cu). */
static __device__ __forceinline__ float mf_exp_shared(float x, uint32_t tabs)
{
    return fabsf(x) < MF_EXP_FAST_LIMIT ? mf_exp_tab_fast(x, tabs) : mf_exp_f32(x);
}

/*
 * Two bf16 (lo in the low half) of values that are not NaN, by the hardware conversion
 * (round to nearest even, no flush): mf_f32_to_bf16's bits for every such float
 * (device_check.cu). NaN needs the reference's own sign and quiet bit.
 */
static __device__ __forceinline__ uint32_t mf_bf16x2_rn(float lo, float hi)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return mf_f32_to_bf16(lo) | (mf_f32_to_bf16(hi) << 16);
#endif
}

/*
 * Two e4m3 codes (lo in the low byte) of finite values, round to nearest even with saturation
 * to +-448: mf_f32_to_e4m3's bits for every finite float (device_check.cu), in one
 * instruction on sm_89+.
 */
static __device__ __forceinline__ uint32_t mf_e4m3x2(float lo, float hi)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return mf_f32_to_e4m3(lo) | (mf_f32_to_e4m3(hi) << 8);
#endif
}

/*
 * a / b correctly rounded by nvcc's own fast sequence (reciprocal, one
 * refinement, quotient, residual, correction) without its range check
 * (FCHK) and the branch to the slow path that goes with it; the sign is
 * copied from a (b > 0), so -0 stays -0. Only for the operands of silu with
 * |g| < 64 (b = 1 + e^-g in [1, 2^93]): device_check.cu compares the whole
 * fast silu with mf_silu_formula for every float.
 */
static __device__ __forceinline__ float mf_div_fast(float a, float b)
{
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
    const float e = fmaf(-b, r, 1.0f);
    const float r1 = fmaf(r, e, r);
    const float q0 = a * r1;
    const float res = fmaf(-b, q0, a);
    const float q = fmaf(r1, res, q0);
    return mf_with_sign_of(q, a);
}

/*
 * Operands mf_div_fast is proved on besides silu's (device_check.cu, every
 * float): a / 448 and a / 127 for a in [2^-100, 2^100], and 1 / s for s in
 * [2^-60, 2^60] (mf_scale_fast_ok).
 */
static __device__ __forceinline__ int mf_div_fast_ok(float a)
{
    return a >= 0x1p-100f && a <= 0x1p+100f;
}

/* Does the fast silu cover g? (NaN: no.) */
static __device__ __forceinline__ int mf_silu_fast_ok(float g) { return fabsf(g) < 64.0f; }

/* mf_silu_formula(g) for every g with mf_silu_fast_ok(g) (device_check.cu). */
static __device__ __forceinline__ float mf_silu_fast(float g, uint32_t tabs)
{
    return mf_div_fast(g, 1.0f + mf_exp_tab_fast(-g, tabs));
}
#endif

/* --------------------------------------------------- quantization scale */

/*
 * h / s for a whole group with one IEEE division (y = 1 / s) and, per element,
 * Markstein's correction: q0 = RN(h y) is within 1 ulp of h / s, the residual
 * h - q0 s is exact in an fmaf, and RN(q0 + res y) with y = RN(1 / s) is the
 * correctly rounded quotient when nothing underflows or overflows. The
 * callers take this path only for s in [2^-60, 2^60] and |h| at most the
 * group's amax (448 s, or an ulp or two above when s rounded down), where
 * a quotient that could give a nonzero code keeps every term normal; a
 * smaller quotient gives code 0 either way. The residual is formed negated
 * (q0 s - h, the same magnitude) so that h = -0 gives -0 + -0 = -0 in the
 * last fmaf, not +0 (NUMERICS.md: code 0x80), with no instruction to copy the
 * sign; a nonzero h gives a nonzero sum or one that rounds to zero with its
 * own sign. check_numerics.c compares it with h / s, bit for bit.
 */
MF_HD int mf_scale_fast_ok(float s) { return s >= 0x1p-60f && s <= 0x1p+60f; }

MF_HD float mf_div_scale(float h, float s, float y)
{
    const float q0 = h * y;
    const float nres = fmaf(q0, s, -h);
    return fmaf(-nres, y, q0);
}

#endif /* MOEFUSE_CUDA_NUMERICS_CUH */
