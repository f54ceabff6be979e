/*
 * Number formats and activations of docs/NUMERICS.md for the CUDA backend,
 * bit exact with the CPU reference (src/cpu/numerics.h, activation.h):
 * every rounding is integer code on the bits or one IEEE operation, so the
 * results do not depend on the compiler. The build passes --fmad=false: no
 * a * b + c is contracted unless written as fmaf.
 *
 * Everything here is __host__ __device__ and also compiles as plain C (gcc,
 * -ffp-contract=off), so the host program src/cuda/tools/check_numerics.c
 * can verify mf_expf and the scale division against double precision.
 */
#ifndef MOEFUSE_CUDA_NUMERICS_CUH
#define MOEFUSE_CUDA_NUMERICS_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MF_HD static __host__ __device__ __forceinline__
#else
#define MF_HD static inline
#endif

/* moefuse_dtype / layout / activation values, as plain ints (moefuse.h) */
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

#define MF_ACT_SILU 0
#define MF_ACT_GELU 1
#define MF_ACT_GELU_TANH 2

/* ------------------------------------------------------------------ bits */

MF_HD uint32_t mf_f32_bits(float f)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

MF_HD float mf_bits_f32(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* Bit tests, immune to any finite-math assumption. */
MF_HD int mf_is_nan(float v) { return (mf_f32_bits(v) & 0x7FFFFFFFu) > 0x7F800000u; }
MF_HD int mf_is_finite(float v) { return (mf_f32_bits(v) & 0x7F800000u) != 0x7F800000u; }

/* ------------------------------------------------------------------ bf16 */

MF_HD float mf_bf16_to_f32(uint32_t h) { return mf_bits_f32((h & 0xFFFFu) << 16); }

MF_HD uint32_t mf_f32_to_bf16(float f)
{
    uint32_t u = mf_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return ((u >> 16) & 0x8000u) | 0x7FC0u;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return u >> 16;
}

MF_HD float mf_round_bf16(float f) { return mf_bf16_to_f32(mf_f32_to_bf16(f)); }

/* ------------------------------------------------------------------- f16 */

MF_HD float mf_f16_to_f32(uint32_t h)
{
    uint32_t sign = (h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu)
        return mf_bits_f32(sign | 0x7F800000u | (m << 13));
    if (e != 0u)
        return mf_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
    float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
    return sign ? -v : v;
}

/* Round to nearest even of m >> shift (shift in 1..31). */
MF_HD uint32_t mf_round_shift(uint32_t m, uint32_t shift)
{
    uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u)))
        r++;
    return r;
}

MF_HD uint32_t mf_f32_to_f16(float f)
{
    uint32_t u = mf_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)
        return sign | 0x7E00u;
    if (ax >= 0x47800000u) /* >= 2^16 (or Inf): overflow */
        return sign | 0x7C00u;
    if (ax >= 0x38800000u) { /* normal half; the carry may reach Inf, as IEEE does */
        uint32_t v = ax - 0x38000000u;
        v = (v + 0xFFFu + ((v >> 13) & 1u)) >> 13;
        return sign | v;
    }
    uint32_t e = ax >> 23;
    if (e < 102u) /* below 2^-25: rounds to zero */
        return sign;
    return sign | mf_round_shift((ax & 0x7FFFFFu) | 0x800000u, 126u - e);
}

/* --------------------------------------------------------------- f8 e4m3 */

MF_HD float mf_e4m3_to_f32(uint32_t b)
{
    uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    if ((b & 0x7Fu) == 0x7Fu)
        return mf_bits_f32((b & 0x80u) ? 0xFFC00000u : 0x7FC00000u);
    float v = e == 0u ? (float)m * 0.001953125f : mf_bits_f32(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

/* RNE, saturation to +-448 (Inf included), NaN -> 0x7F | sign: integer code. */
MF_HD uint32_t mf_f32_to_e4m3(float f)
{
    uint32_t u = mf_f32_bits(f);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) /* NaN */
        return sign | 0x7Fu;
    if (ax > 0x43E00000u) /* > 448, Inf included: saturate */
        return sign | 0x7Eu;
    if (ax >= 0x3C800000u) { /* normal e4m3 (>= 2^-6) */
        uint32_t v = ax - 0x3C000000u;
        v = (v + 0x7FFFFu + ((v >> 20) & 1u)) >> 20;
        return sign | v;
    }
    uint32_t e = ax >> 23;
    if (e < 117u) /* below 2^-10, zero included: rounds to zero */
        return sign;
    return sign | mf_round_shift((ax & 0x7FFFFFu) | 0x800000u, 141u - e);
}

/* -------------------------------------------------------------------- i8 */

/* Round half to even, clamp to [-127, 127], NaN -> 0 (as two's complement byte). */
MF_HD uint32_t mf_f32_to_i8(float f)
{
    if (mf_is_nan(f))
        return 0u;
    if (f >= 127.0f)
        return 127u;
    if (f <= -127.0f)
        return (uint32_t)(uint8_t)(int8_t)-127;
    float fl = floorf(f);
    float d = f - fl; /* exact: |f| < 2^7 */
    int r = (int)fl;
    if (d > 0.5f || (d == 0.5f && (r & 1)))
        r++;
    return (uint32_t)(uint8_t)(int8_t)r;
}

/* ----------------------------------------------------------------- UE8M0 */

/* Biased exponent e (1..254) of s rounded up to a power of two. */
MF_HD uint32_t mf_ue8m0_exponent(float s)
{
    uint32_t b = mf_f32_bits(s);
    uint32_t e = ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u ? 1u : 0u);
    e = e < 1u ? 1u : e;
    return e > 254u ? 254u : e;
}

/* Value of a stored exponent byte: 2^(e-127); 255 is NaN, 0 is 2^-127. */
MF_HD float mf_ue8m0_read(uint32_t e)
{
    if (e == 255u)
        return mf_bits_f32(0x7FC00000u);
    if (e == 0u)
        return mf_bits_f32(0x00400000u);
    return mf_bits_f32(e << 23);
}

/* -------------------------------------------------------- x86 NaN rules */

/*
 * The CPU reference runs on x86-64 (SSE): an operation with a NaN operand
 * returns the first NaN operand, quieted (sign and payload kept); an invalid
 * operation (0 * Inf, Inf / Inf) returns the default NaN 0xFFC00000, sign
 * SET. The GPU returns a canonical positive NaN instead, which would turn
 * the f8 code 0xFF into 0x7F. These rebuild the x86 bits (as numerics.cl).
 */
MF_HD float mf_quiet(float x) { return mf_bits_f32(mf_f32_bits(x) | 0x00400000u); }

MF_HD float mf_nan_of(float r, float x, float y)
{
    if (!mf_is_nan(r))
        return r;
    if (mf_is_nan(x))
        return mf_quiet(x);
    if (mf_is_nan(y))
        return mf_quiet(y);
    return mf_bits_f32(0xFFC00000u);
}

MF_HD float mf_mul(float x, float y) { return mf_nan_of(x * y, x, y); }

/* ------------------------------------------------------------------- exp */

/*
 * expf with an error below 0.6 ulp over the whole range (checked for every
 * float in [-104, 89] by src/cuda/tools/check_numerics.c), in f32 with
 * explicit fmaf, so host and device give the same bits.
 *
 * x = n ln2 + r + rl: n = rint(x log2e) by the 1.5 * 2^23 trick; r = x - n L2H
 * is exact in one fmaf (L2H = RN(ln2), |r| < 0.3466, and x and n L2H are
 * close); rl = -n (ln2 - L2H), |rl| < 2^-21.7, is too large to drop and is
 * applied as rl * e^r. e^r = 1 + r + r^2 (1/2 + r P(r)) with P a degree-4
 * fit of (e^r - 1 - r - r^2/2) / r^3 (error 8e-9). 1 + r is split exactly
 * into s_hi + s_lo and r^2 into p2 + p2l, so that the only large rounding
 * is the last addition s_hi + lo: 0.5 ulp plus about 0.05 ulp.
 */
#define MF_EXP_L2E 0x1.715476p+0f    /* RN(log2 e) */
#define MF_EXP_L2H 0x1.62e430p-1f    /* RN(ln 2) */
#define MF_EXP_L2L -0x1.05c610p-29f  /* RN(ln 2 - L2H) */
#define MF_EXP_MAGIC 0x1.8p+23f      /* 1.5 * 2^23: adding it rounds to an integer */

/* The mantissa m = s_hi + lo (about e^(x - n ln2)) and the bits of j, whose low bits are n. */
MF_HD void mf_exp_core(float x, float *s_hi_out, float *lo_out, uint32_t *jbits)
{
    const float j = fmaf(x, MF_EXP_L2E, MF_EXP_MAGIC);
    const float nf = j - MF_EXP_MAGIC;
    const float r = fmaf(-nf, MF_EXP_L2H, x); /* exact */
    const float rl = -nf * MF_EXP_L2L;
    float P = 0x1.a0f86ap-13f;
    P = fmaf(P, r, 0x1.6d1106p-10f);
    P = fmaf(P, r, 0x1.1110f6p-7f);
    P = fmaf(P, r, 0x1.55551ap-5f);
    P = fmaf(P, r, 0x1.555556p-3f);
    const float U = fmaf(r, P, 0.5f); /* (e^r - 1 - r) / r^2 */
    const float s_hi = 1.0f + r;
    const float s_lo = r - (s_hi - 1.0f); /* exact (|r| < 1) */
    const float p2 = r * r;
    const float p2l = fmaf(r, r, -p2); /* exact */
    const float E1 = fmaf(p2, U, s_hi); /* ~e^r, scales rl */
    float lo = fmaf(p2l, 0.5f, s_lo);
    lo = fmaf(rl, E1, lo);
    lo = fmaf(p2, U, lo);
    *s_hi_out = s_hi;
    *lo_out = lo;
    *jbits = mf_f32_bits(j);
}

/* Results near overflow, subnormal results and non-finite input: rare, so out of line on
 * the device (it would cost registers in every caller). */
#if defined(__CUDACC__)
static __host__ __device__ __noinline__ float mf_expf_slow(float x)
#else
static float mf_expf_slow(float x)
#endif
{
    if (mf_is_nan(x))
        return x + x;
    if (x > 0x1.62e42ep+6f) /* 88.7228...: the result rounds to Inf */
        return mf_bits_f32(0x7F800000u);
    if (x < -104.0f) /* below 2^-150: rounds to 0 (-Inf included) */
        return 0.0f;
    float s_hi, lo;
    uint32_t jb;
    mf_exp_core(x, &s_hi, &lo, &jb);
    const int n = (int)(jb - 0x4B400000u); /* two's complement: j = 1.5 * 2^23 + n */
    /* one rounding, from a double in which 2^n and the sum are exact (n in [-151, 129]) */
    return (float)ldexp((double)s_hi + (double)lo, n);
}

MF_HD float mf_expf(float x)
{
    /* |x| < 86.5: n in [-125, 125], the result and 2^n are normal */
    if (fabsf(x) < 86.5f) {
        float s_hi, lo;
        uint32_t jb;
        mf_exp_core(x, &s_hi, &lo, &jb);
        const float m = s_hi + lo; /* in [0.70, 1.42] */
        /* m * 2^n by adding n to the exponent field: jb << 23 == n << 23 (mod 2^32) */
        return mf_bits_f32(mf_f32_bits(m) + (jb << 23));
    }
    return mf_expf_slow(x);
}

/*
 * The hot path's expf (silu), cheaper and more accurate (< 0.53 ulp, checked
 * like mf_expf) thanks to a table of 2^(j/32) as hi + lo pairs, which the
 * kernels copy to shared memory (host code passes an array of MF_EXP2_TAB_INIT):
 * x = (32 n + j) ln2/32 + r, |r| < 0.01084; r = x - k L32H exact in one fmaf,
 * then r -= k L32L rounded (error < 2^-31); e^r - 1 = q = r + r^2 (c2 + c3 r);
 * m = hi + (hi q + lo) with one large rounding, then the exponent gets n.
 * The range and the slow path are mf_expf's.
 */
#define MF_EXP2_TAB_INIT \
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
#define MF_EXP_INV32 0x1.715476p+5f   /* RN(32 / ln2) */
#define MF_EXP_L32H 0x1.62e430p-6f    /* RN(ln2 / 32) */
#define MF_EXP_L32L -0x1.05c610p-34f  /* RN(ln2 / 32 - L32H) */

MF_HD float mf_expf_tab(float x, const float *tab)
{
    if (fabsf(x) < 86.5f) {
        const float kf = fmaf(x, MF_EXP_INV32, MF_EXP_MAGIC); /* 1.5 * 2^23 + k */
        const float k = kf - MF_EXP_MAGIC;
        const float r0 = fmaf(-k, MF_EXP_L32H, x); /* exact */
        const float r = fmaf(-k, MF_EXP_L32L, r0);
        const float p = fmaf(r, 0x1.555596p-3f, 0x1.000052p-1f);
        const float r2 = r * r;
        const float q = fmaf(r2, p, r);
        const uint32_t kb = mf_f32_bits(kf);
        const uint32_t j = kb & 31u;
        const float hi = tab[2 * j], lo = tab[2 * j + 1];
        const float m = hi + fmaf(hi, q, lo); /* in [0.98, 2.03] */
        /* n = k >> 5 (floor): kb = 0x4B400000 + k and 0x4B400000 / 32 << 23 == 0 (mod 2^32) */
        return mf_bits_f32(mf_f32_bits(m) + ((kb >> 5) << 23));
    }
    return mf_expf_slow(x);
}

/* ------------------------------------------------------ erf, tanh (gelu) */

/*
 * The gelu forms are not on the hot path: erf and tanh are evaluated in
 * double and rounded once (correctly rounded in practice; glibc's erff/tanhf
 * miss that on ~5% of inputs, tanhf by up to 2 ulp: NUMERICS.md allows it), pinned to
 * +-1 where f32 rounds them there anyway (as numerics.cl explains).
 */
MF_HD float mf_erf(float t)
{
    if (fabsf(t) > 3.9193f)
        return t > 0.0f ? 1.0f : -1.0f;
    return (float)erf((double)t);
}

MF_HD float mf_tanh(float z)
{
    if (fabsf(z) > 9.0110f)
        return z > 0.0f ? 1.0f : -1.0f;
    return (float)tanh((double)z);
}

/* ------------------------------------------------------------ activation */

/* Comparisons, so that NaN passes through. */
MF_HD float mf_clamp_gate(float g, float limit) { return (g > limit) ? limit : g; }

MF_HD float mf_clamp_up(float u, float limit)
{
    return (u > limit) ? limit : (u < -limit ? -limit : u);
}

MF_HD float mf_silu(float g)
{
    const float d = 1.0f + mf_expf(-g);
    return g / d;
}

/* The same with the table exp: the kernels' silu (h of act_quant and act_mul alike). */
MF_HD float mf_silu_tab(float g, const float *tab)
{
    const float d = 1.0f + mf_expf_tab(-g, tab);
    return g / d;
}

MF_HD float mf_gelu(float g)
{
    const float t = g * 0.70710678118654752f;
    const float a = 0.5f * g;
    const float b = 1.0f + mf_erf(t);
    return a * b;
}

MF_HD float mf_gelu_tanh(float g)
{
    const float g2 = g * g;
    const float g3 = g2 * g;
    const float c = 0.044715f * g3;
    const float inner = g + c;
    const float th = mf_tanh(0.7978845608028654f * inner);
    const float a = 0.5f * g;
    const float b = 1.0f + th;
    return a * b;
}

/* The formulas of NUMERICS.md with the GPU's NaN bits (callers fix NaN results). */
MF_HD float mf_act_plain(int act, float g)
{
    if (act == MF_ACT_GELU)
        return mf_gelu(g);
    if (act == MF_ACT_GELU_TANH)
        return mf_gelu_tanh(g);
    return mf_silu(g);
}

/*
 * Same with the CPU's NaN bits: a NaN g comes back as itself, quieted (in
 * every form the first NaN operand of the last operation is g's); the only
 * invalid operations are at g = -Inf, giving the default NaN. The kernels
 * call it only where the result is NaN, whose bits do not depend on which
 * exp computed it.
 */
MF_HD float mf_activate(int act, float g)
{
    if (mf_is_nan(g))
        return mf_quiet(g);
    const float r = mf_act_plain(act, g);
    return mf_is_nan(r) ? mf_bits_f32(0xFFC00000u) : r;
}

/* ------------------------------------------------- device fast paths */

#if defined(__CUDACC__)
/*
 * mf_expf_tab's fast path for |x| < 86.5, the same operations (so the same
 * bits), with the table at shared-memory address tabs: no branch, so the
 * kernels can interleave the channels of a lane.
 */
static __device__ __forceinline__ float mf_exp_tab_fast(float x, uint32_t tabs)
{
    const float kf = fmaf(x, MF_EXP_INV32, MF_EXP_MAGIC);
    const float k = kf - MF_EXP_MAGIC;
    const float r0 = fmaf(-k, MF_EXP_L32H, x);
    const float r = fmaf(-k, MF_EXP_L32L, r0);
    const float p = fmaf(r, 0x1.555596p-3f, 0x1.000052p-1f);
    const float r2 = r * r;
    const float q = fmaf(r2, p, r);
    const uint32_t kb = mf_f32_bits(kf);
    float hi, lo;
    asm("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(hi), "=f"(lo) : "r"(tabs + ((kb & 31u) << 3)));
    const float m = hi + fmaf(hi, q, lo);
    return mf_bits_f32(mf_f32_bits(m) + ((kb >> 5) << 23));
}

/*
 * a / b correctly rounded by nvcc's own fast sequence (reciprocal, one
 * refinement, quotient, residual, correction) without its range check
 * (FCHK) and the branch to the slow path that goes with it; the sign is
 * copied from a (b > 0), so -0 stays -0. Only for the operands of silu with
 * |g| < 64 (b = 1 + e^-g in [1, 2^93]): device_check.cu compares the whole
 * fast silu with mf_silu_tab for every float.
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
    return mf_bits_f32((mf_f32_bits(q) & 0x7FFFFFFFu) | (mf_f32_bits(a) & 0x80000000u));
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

/* silu(g) = mf_silu_tab(g) for every g with mf_silu_fast_ok(g). */
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
 * callers take this path only for s in [2^-60, 2^60] and |h| <= 448 s, where
 * a quotient that could give a nonzero code keeps every term normal; a
 * smaller quotient gives code 0 either way. The sign is copied from h, so -0
 * stays -0 (NUMERICS.md: 0x80). check_numerics.c compares it with h / s.
 */
MF_HD int mf_scale_fast_ok(float s) { return s >= 0x1p-60f && s <= 0x1p+60f; }

MF_HD float mf_div_scale(float h, float s, float y)
{
    const float q0 = h * y;
    const float res = fmaf(-q0, s, h);
    const float q = fmaf(res, y, q0);
    return mf_bits_f32((mf_f32_bits(q) & 0x7FFFFFFFu) | (mf_f32_bits(h) & 0x80000000u));
}

#endif /* MOEFUSE_CUDA_NUMERICS_CUH */
