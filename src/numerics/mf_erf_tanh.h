/*
 * moefuse's erf and tanh of an f32 (docs/NUMERICS.md, "The library's exp,
 * erf and tanh"): the gelu forms' functions, one text for every backend.
 * Odd: f(-x) = -f(x) bit for bit, f(+-0) = +-0, NaN gives x quieted,
 * +-Inf gives +-1, and the value is exactly +-1 wherever the correctly
 * rounded one is. Accuracy over every f32 (src/numerics/tools/check_erf_tanh.c):
 * see NUMERICS.md.
 *
 * erf(t), t = |x|:
 *   t < 0.84375:  t + t P(t^2), one fmaf: P is a fit of erf(t) / t - 1;
 *   t < 3.9193:   1 - Q_i(t - c_i) on four intervals, Q_i a fit of erfc around the
 *                 interval's centre c_i (t - c_i is exact);
 *   beyond:       1 (erfc(t) < 2^-25: erf rounds to 1).
 * tanh(z), a = |z|:
 *   a < 0.55:     a + a^3 P(a^2), the last step one fmaf;
 *   a < 9.011:    1 - 2 / (e + 1), e = e^(2a) carried as e_hi + e_lo from the pieces
 *                 of mf_exp_f32 (2a < 18.1: normal), so that the rounding of e does not
 *                 reach the result: d = e + 1 as d_hi + d_lo (Fast2Sum, e >= 3),
 *                 t0 = 2 / d_hi, and 1 - 2 / d from 1 - t0, its exact error, and
 *                 first-order terms in d_lo and the residual of the division, rounded once;
 *   beyond:       1 (1 - tanh < 2^-25).
 */
#ifndef MOEFUSE_NUMERICS_ERF_TANH_H
#define MOEFUSE_NUMERICS_ERF_TANH_H

#include "mf_exp.h"
#include "mf_portable.h"

/* erfc fits Q_i(x) around c_i, highest degree first, 11 coefficients per interval */
#define MF_ERFC_TABLE_INIT \
    { \
    -0x1.4027c6p-10f, 0x1.56939ep-10f, 0x1.651f60p-8f, -0x1.b18198p-7f, -0x1.2ff480p-7f, \
    0x1.1351d8p-4f, -0x1.b39adcp-5f, -0x1.32dbb4p-3f, 0x1.944892p-2f, -0x1.822e66p-2f, \
    0x1.1c22f8p-3f, \
    0x1.4ece06p-14f, -0x1.b4d7dep-10f, 0x1.35c996p-9f, 0x1.36a9d6p-8f, -0x1.3ca3eep-6f, \
    0x1.e72412p-7f, 0x1.6d5a96p-5f, -0x1.1c2a02p-3f, 0x1.6d5a96p-3f, -0x1.e72372p-4f, \
    0x1.15aaa8p-5f, \
    0x1.0cbd74p-13f, 0x1.0a3e36p-12f, -0x1.6ad430p-10f, 0x1.eb53c8p-10f, 0x1.dd7bf0p-10f, \
    -0x1.997648p-7f, 0x1.afe552p-6f, -0x1.0ea472p-5f, 0x1.ada874p-6f, -0x1.94624ep-7f, \
    0x1.5bde72p-9f, \
    -0x1.1be2dap-19f, -0x1.5a6672p-16f, 0x1.84b06ep-14f, -0x1.a56d60p-13f, 0x1.4a640ap-12f, \
    -0x1.91a3c4p-12f, 0x1.76141cp-12f, -0x1.039f66p-12f, 0x1.fdf484p-14f, -0x1.3dc0a2p-15f, \
    0x1.7b134ep-18f \
    }
#define MF_ERFC_DEGREE 10

#if defined(__OPENCL_VERSION__)
__constant float mf_erfc_table[4 * (MF_ERFC_DEGREE + 1)] = MF_ERFC_TABLE_INIT;
#define MF_ERFC_TABLE mf_erfc_table
#elif defined(__CUDACC__)
static __device__ const float mf_erfc_table_dev[4 * (MF_ERFC_DEGREE + 1)] = MF_ERFC_TABLE_INIT;
static const float mf_erfc_table_host[4 * (MF_ERFC_DEGREE + 1)] = MF_ERFC_TABLE_INIT;
#if defined(__CUDA_ARCH__)
#define MF_ERFC_TABLE mf_erfc_table_dev
#else
#define MF_ERFC_TABLE mf_erfc_table_host
#endif
#else
static const float mf_erfc_table[4 * (MF_ERFC_DEGREE + 1)] = MF_ERFC_TABLE_INIT;
#define MF_ERFC_TABLE mf_erfc_table
#endif

#define MF_ERF_ONE 3.9193f   /* from here on erf rounds to 1 */
#define MF_TANH_ONE 9.0110f  /* from here on tanh rounds to 1 */

/* x with the sign of s (both f32): integer code, so -0 and NaN signs carry. */
MF_FN float mf_copysign(float x, float s)
{
    return mf_bits_f32((mf_f32_bits(x) & 0x7FFFFFFFu) | (mf_f32_bits(s) & 0x80000000u));
}

/* erf of t = |x| >= 0, t not NaN. */
MF_FN float mf_erf_abs(float t)
{
    if (t < 0.84375f) {
        const float u = t * t;
        float p = 0x1.74dba0p-14f;
        p = mf_fmaf(p, u, -0x1.b0ce5cp-11f);
        p = mf_fmaf(p, u, 0x1.557350p-8f);
        p = mf_fmaf(p, u, -0x1.b81e9ep-6f);
        p = mf_fmaf(p, u, 0x1.ce2eb6p-4f);
        p = mf_fmaf(p, u, -0x1.812746p-2f);
        p = mf_fmaf(p, u, 0x1.06eba8p-3f);
        return mf_fmaf(t, p, t);
    }
    if (!(t < MF_ERF_ONE)) /* Inf included */
        return 1.0f;
    const int i = t < 1.25f ? 0 : t < 1.75f ? 1 : t < 2.5f ? 2 : 3;
    const float c = i == 0 ? 1.046875f : i == 1 ? 1.5f : i == 2 ? 2.125f : 0x1.9ad5d0p+1f;
    const float x = t - c; /* exact: c and t within a factor 2 */
    float q = MF_ERFC_TABLE[i * (MF_ERFC_DEGREE + 1)];
    for (int k = 1; k <= MF_ERFC_DEGREE; k++)
        q = mf_fmaf(q, x, MF_ERFC_TABLE[i * (MF_ERFC_DEGREE + 1) + k]);
    return 1.0f - q;
}

MF_FN float mf_erf_f32(float x)
{
    if (mf_is_nan(x))
        return mf_quiet(x);
    return mf_copysign(mf_erf_abs(mf_fabsf(x)), x);
}

/* tanh of a = |z| >= 0, a not NaN. */
MF_FN float mf_tanh_abs(float a)
{
    if (a < 0.55f) {
        const float u = a * a;
        float p = 0x1.4b239ap-9f;
        p = mf_fmaf(p, u, -0x1.176410p-7f);
        p = mf_fmaf(p, u, 0x1.657936p-6f);
        p = mf_fmaf(p, u, -0x1.ba142ep-5f);
        p = mf_fmaf(p, u, 0x1.111104p-3f);
        p = mf_fmaf(p, u, -0x1.555556p-2f);
        const float a3 = u * a;
        return mf_fmaf(a3, p, a);
    }
    if (!(a < MF_TANH_ONE)) /* Inf included */
        return 1.0f;
    /* e = e^(2a) = 2^n (T + s) with the pieces of mf_exp_f32: hi = 2^n T, lo = 2^n s, exact */
    const float x = a + a;
    const mf_u32 kb = mf_exp_kbits(x);
    const mf_u32 j = kb & 31u;
    const float q = mf_exp_poly(x, kb);
    const float T = MF_EXP_TABLE[2 * j];
    const float s = mf_fmaf(T, q, MF_EXP_TABLE[2 * j + 1]);
    const float p2n = mf_exp_pow2((mf_i32)((kb - 0x4B400000u - j) >> 5)); /* n in [0, 27] */
    const float hi = T * p2n, lo = s * p2n;
    /* e = e_hi + e_lo, then d = e + 1 = d_hi + d_lo, each by Fast2Sum (|hi| >= |lo|, e >= 3) */
    const float e_hi = hi + lo;
    const float e_lo = (hi - e_hi) + lo;
    const float d_hi = e_hi + 1.0f;
    const float d_lo = (1.0f - (d_hi - e_hi)) + e_lo;
    /*
     * 2 / d = t0 + (t0 / 2) (rem - t0 d_lo) to first order, with t0 = 2 / d_hi and its exact
     * residual rem = 2 - t0 d_hi; 1 - t0 = r0 + (z - t0) exactly, z = 1 - r0 (Sterbenz, both
     * differences). The result is r0 plus the small terms, rounded once.
     */
    const float t0 = 2.0f / d_hi;
    const float rem = mf_fmaf(-t0, d_hi, 2.0f);
    const float w = mf_fmaf(-t0, d_lo, rem);
    const float corr = (t0 * 0.5f) * w;
    const float r0 = 1.0f - t0;
    const float z = 1.0f - r0;
    return r0 + ((z - t0) - corr);
}

MF_FN float mf_tanh_f32(float z)
{
    if (mf_is_nan(z))
        return mf_quiet(z);
    return mf_copysign(mf_tanh_abs(mf_fabsf(z)), z);
}

#endif /* MOEFUSE_NUMERICS_ERF_TANH_H */
