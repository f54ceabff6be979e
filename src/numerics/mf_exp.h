/*
 * moefuse's exp of an f32 (docs/NUMERICS.md, "The library's exp, erf and
 * tanh"): the one definition every backend runs, so silu, the gelu forms and
 * the router's softmax give the same bits on the CPU, OpenCL and CUDA.
 * Faithful: within 0.53 ulp of e^x for every normal result (tools/
 * check_numerics proves it for every f32), within 1 ulp for subnormal ones.
 *
 * x = (32 n + j) ln2/32 + r with k = 32 n + j = rint(x 32/ln2) (the
 * 1.5 * 2^23 trick), |r| <= ln2/64 (+ 2^-19): r0 = x - k L32H is exact in one
 * fmaf (L32H = RN(ln2/32) has 8 trailing zero bits), r = r0 - k L32L rounded
 * (error < 2^-31). e^r - 1 = q = r + r^2 (c2 + c3 r) (a fit; error 2^-34).
 * e^x = 2^n (T[j] + (T[j] q + T_lo[j])) with T[j] + T_lo[j] = 2^(j/32) to
 * 2^-48: one large rounding, the last addition. The 2^n is added to the
 * exponent field where the result is normal (|x| < 86.5); near overflow and
 * for subnormal results it is two exact-or-once-rounded multiplications.
 */
#ifndef MOEFUSE_NUMERICS_EXP_H
#define MOEFUSE_NUMERICS_EXP_H

#include "mf_portable.h"

/* 2^(j/32), j = 0..31, as (hi, lo) pairs: hi = RN(2^(j/32)), lo = RN(2^(j/32) - hi). */
#define MF_EXP_TABLE_INIT \
    { \
    0x1.000000p+0f, 0x0.0p+0f, 0x1.059b0ep+0f, -0x1.9d4f52p-25f, \
    0x1.0b5586p+0f, 0x1.9f3122p-25f, 0x1.11301ep+0f, -0x1.fdb496p-25f, \
    0x1.172b84p+0f, -0x1.c15742p-27f, 0x1.1d4874p+0f, -0x1.d2e8cap-25f, \
    0x1.2387a6p+0f, 0x1.ceac48p-25f, 0x1.29e9e0p+0f, -0x1.5c0424p-25f, \
    0x1.306fe0p+0f, 0x1.4636e2p-25f, 0x1.371a74p+0f, -0x1.18aac6p-25f, \
    0x1.3dea64p+0f, 0x1.824684p-25f, 0x1.44e086p+0f, 0x1.8624b4p-30f, \
    0x1.4bfdaep+0f, -0x1.593abcp-25f, 0x1.5342b6p+0f, -0x1.2c5610p-25f, \
    0x1.5ab07ep+0f, -0x1.5bd5ecp-27f, 0x1.6247ecp+0f, -0x1.f8b550p-25f, \
    0x1.6a09e6p+0f, 0x1.9fcef4p-26f, 0x1.71f75ep+0f, 0x1.1d8beep-25f, \
    0x1.7a1148p+0f, -0x1.829fd0p-25f, 0x1.82589ap+0f, -0x1.accc7cp-26f, \
    0x1.8ace54p+0f, 0x1.15506ep-27f, 0x1.93737cp+0f, -0x1.e64744p-25f, \
    0x1.9c4918p+0f, 0x1.51f848p-27f, 0x1.a5503cp+0f, -0x1.b83b54p-25f, \
    0x1.ae89fap+0f, -0x1.a94b14p-26f, 0x1.b7f770p+0f, -0x1.a09438p-25f, \
    0x1.c199bep+0f, -0x1.3d56b2p-27f, 0x1.cb720ep+0f, -0x1.8837ccp-27f, \
    0x1.d5818ep+0f, -0x1.822dbcp-27f, 0x1.dfc974p+0f, -0x1.908c94p-25f, \
    0x1.ea4afap+0f, 0x1.52486cp-27f, 0x1.f50766p+0f, -0x1.246eb0p-26f \
    }

#define MF_EXP_INV32 0x1.715476p+5f  /* RN(32 / ln2) */
#define MF_EXP_L32H 0x1.62e430p-6f   /* RN(ln2 / 32) */
#define MF_EXP_L32L -0x1.05c610p-34f /* RN(ln2 / 32 - L32H) */
#define MF_EXP_MAGIC 0x1.8p+23f      /* 1.5 * 2^23: adding it rounds to an integer */
#define MF_EXP_C2 0x1.000052p-1f     /* e^r - 1 - r ~ r^2 (C2 + C3 r) */
#define MF_EXP_C3 0x1.555596p-3f
#define MF_EXP_FAST_LIMIT 86.5f      /* |x| below: n in [-125, 125], result normal */
#define MF_EXP_OVERFLOW 0x1.62e42ep+6f /* above: e^x rounds to +Inf */
#define MF_EXP_UNDERFLOW -104.0f     /* below: e^x < 2^-150, rounds to +0 */

#if defined(__OPENCL_VERSION__)
__constant float mf_exp_table[64] = MF_EXP_TABLE_INIT;
#define MF_EXP_TABLE mf_exp_table
#elif defined(__CUDACC__)
static __device__ const float mf_exp_table_dev[64] = MF_EXP_TABLE_INIT;
static const float mf_exp_table_host[64] = MF_EXP_TABLE_INIT;
#if defined(__CUDA_ARCH__)
#define MF_EXP_TABLE mf_exp_table_dev
#else
#define MF_EXP_TABLE mf_exp_table_host
#endif
#else
static const float mf_exp_table[64] = MF_EXP_TABLE_INIT;
#define MF_EXP_TABLE mf_exp_table
#endif

/* The bits of 1.5 * 2^23 + k: k = rint(x * 32 / ln2) in the low bits (two's complement). */
MF_FN mf_u32 mf_exp_kbits(float x) { return mf_f32_bits(mf_fmaf(x, MF_EXP_INV32, MF_EXP_MAGIC)); }

/* q = e^r - 1 for the reduced argument of x, given kbits. */
MF_FN float mf_exp_poly(float x, mf_u32 kbits)
{
    const float k = mf_bits_f32(kbits) - MF_EXP_MAGIC;
    const float r0 = mf_fmaf(-k, MF_EXP_L32H, x); /* exact */
    const float r = mf_fmaf(-k, MF_EXP_L32L, r0);
    const float p = mf_fmaf(r, MF_EXP_C3, MF_EXP_C2);
    const float r2 = r * r;
    return mf_fmaf(r2, p, r);
}

/* The mantissa m = 2^(j/32) e^r in [0.98, 2.03], from q and the table pair of j = k mod 32. */
MF_FN float mf_exp_mantissa(float q, float hi, float lo) { return hi + mf_fmaf(hi, q, lo); }

/* m * 2^n for |x| < MF_EXP_FAST_LIMIT: n = k >> 5 (floor) added to the exponent field
 * (0x4B400000 / 32 << 23 vanishes mod 2^32). */
MF_FN float mf_exp_scale_fast(float m, mf_u32 kbits)
{
    return mf_bits_f32(mf_f32_bits(m) + ((kbits >> 5) << 23));
}

/* 2^n for n in [-126, 127]. */
MF_FN float mf_exp_pow2(mf_i32 n) { return mf_bits_f32((mf_u32)(n + 127) << 23); }

/* NaN, +-Inf, results near overflow and subnormal results. */
MF_FN float mf_exp_edge(float x)
{
    if (mf_is_nan(x))
        return mf_quiet(x);
    if (x > MF_EXP_OVERFLOW)
        return mf_bits_f32(0x7F800000u);
    if (x < MF_EXP_UNDERFLOW)
        return 0.0f;
    const mf_u32 kb = mf_exp_kbits(x);
    const mf_u32 j = kb & 31u;
    const float m = mf_exp_mantissa(mf_exp_poly(x, kb), MF_EXP_TABLE[2 * j], MF_EXP_TABLE[2 * j + 1]);
    /* n = floor(k / 32) in [-151, 128], split so that both powers are normal and m 2^n1 exact */
    const mf_i32 k = (mf_i32)(kb - 0x4B400000u);
    const mf_i32 n = (k - (mf_i32)j) / 32;
    const mf_i32 n1 = n / 2;
    return (m * mf_exp_pow2(n1)) * mf_exp_pow2(n - n1);
}

/* e^x. */
MF_FN float mf_exp_f32(float x)
{
    if (!(mf_fabsf(x) < MF_EXP_FAST_LIMIT))
        return mf_exp_edge(x);
    const mf_u32 kb = mf_exp_kbits(x);
    const mf_u32 j = kb & 31u;
    const float m = mf_exp_mantissa(mf_exp_poly(x, kb), MF_EXP_TABLE[2 * j], MF_EXP_TABLE[2 * j + 1]);
    return mf_exp_scale_fast(m, kb);
}

#endif /* MOEFUSE_NUMERICS_EXP_H */
