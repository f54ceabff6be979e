/*
 * The number formats of docs/NUMERICS.md, one text for every backend (the dialect of
 * mf_portable.h: the CPU, CUDA (host and device) and OpenCL C compile it). Every rounding is
 * integer code on the bits, so the results depend on neither the rounding mode nor the compiler.
 *
 * Codes travel as mf_u32 (the low 16 or 8 bits; the readers ignore the bits above), so a caller
 * may pass a loaded ushort, uchar or a packed word's low half, and narrows a result by storing it.
 */
#ifndef MOEFUSE_NUMERICS_CONVERT_H
#define MOEFUSE_NUMERICS_CONVERT_H

#include "mf_portable.h"

/* ------------------------------------------------------------------ bf16 */

MF_FN float mf_bf16_to_f32(mf_u32 h) { return mf_bits_f32((h & 0xFFFFu) << 16); }

/* Round to nearest even; NaN keeps its sign and becomes the quiet 0x7FC0. */
MF_FN mf_u32 mf_f32_to_bf16(float f)
{
    mf_u32 u = mf_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return ((u >> 16) & 0x8000u) | 0x7FC0u;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return u >> 16;
}

/* An f32 rounded to the nearest bf16 value, kept in f32. */
MF_FN float mf_round_bf16(float f) { return mf_bf16_to_f32(mf_f32_to_bf16(f)); }

/* ------------------------------------------------------------------- f16 */

MF_FN float mf_f16_to_f32(mf_u32 h)
{
    const mf_u32 sign = (h & 0x8000u) << 16;
    const mf_u32 e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu)
        return mf_bits_f32(sign | 0x7F800000u | (m << 13));
    if (e != 0u)
        return mf_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
    const float v = (float)m * 5.9604644775390625e-8f; /* zero or subnormal: m * 2^-24, exact */
    return sign ? -v : v;
}

/* m >> shift rounded to nearest even (shift in 1..31): the bits a narrower format drops. */
MF_FN mf_u32 mf_round_shift(mf_u32 m, mf_u32 shift)
{
    mf_u32 r = m >> shift;
    const mf_u32 rem = m & ((1u << shift) - 1u), mid = 1u << (shift - 1u); /* not "half": OpenCL's type */
    if (rem > mid || (rem == mid && (r & 1u)))
        r++;
    return r;
}

/* Round to nearest even; overflow to Inf; NaN keeps its sign and becomes 0x7E00. */
MF_FN mf_u32 mf_f32_to_f16(float f)
{
    const mf_u32 u = mf_f32_bits(f);
    const mf_u32 sign = (u >> 16) & 0x8000u, ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)
        return sign | 0x7E00u;
    if (ax >= 0x47800000u) /* >= 2^16, Inf included */
        return sign | 0x7C00u;
    if (ax >= 0x38800000u) { /* normal half (>= 2^-14); the rounding may carry to Inf */
        mf_u32 v = ax - 0x38000000u;
        v = (v + 0xFFFu + ((v >> 13) & 1u)) >> 13;
        return sign | v;
    }
    const mf_u32 e = ax >> 23;
    if (e < 102u) /* below 2^-25: zero */
        return sign;
    /* subnormal half: m * 2^(e - 150) in units of 2^-24 */
    return sign | mf_round_shift((ax & 0x7FFFFFu) | 0x800000u, 126u - e);
}

/* --------------------------------------------------------------- f8 e4m3 */

MF_FN float mf_e4m3_to_f32(mf_u32 b)
{
    const mf_u32 e = (b >> 3) & 0xFu, m = b & 7u;
    if ((b & 0x7Fu) == 0x7Fu)
        return mf_bits_f32((b & 0x80u) ? 0xFFC00000u : 0x7FC00000u);
    const float v = e == 0u ? (float)m * 0.001953125f /* m * 2^-9 */
                            : mf_bits_f32(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

/* Round to nearest even, saturate to +-448 (Inf included); NaN -> 0x7F with its sign. */
MF_FN mf_u32 mf_f32_to_e4m3(float f)
{
    const mf_u32 u = mf_f32_bits(f);
    const mf_u32 sign = (u >> 24) & 0x80u, ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)
        return sign | 0x7Fu;
    if (ax > 0x43E00000u)
        return sign | 0x7Eu;
    if (ax >= 0x3C800000u) { /* normal e4m3 (>= 2^-6) */
        mf_u32 v = ax - 0x3C000000u;
        v = (v + 0x7FFFFu + ((v >> 20) & 1u)) >> 20;
        return sign | v;
    }
    const mf_u32 e = ax >> 23;
    if (e < 117u) /* below 2^-10, zero included: zero */
        return sign;
    /* subnormal e4m3: m * 2^(e - 150) in units of 2^-9 */
    return sign | mf_round_shift((ax & 0x7FFFFFu) | 0x800000u, 141u - e);
}

/* -------------------------------------------------------------------- i8 */

/* Round half to even, clamp to [-127, 127]; NaN -> 0. The value, not its byte. */
MF_FN mf_i32 mf_f32_to_i8(float f)
{
    if (mf_is_nan(f))
        return 0;
    if (f >= 127.0f)
        return 127;
    if (f <= -127.0f)
        return -127;
    const float fl = mf_floorf(f);
    const float d = f - fl; /* exact: |f| < 2^7 */
    mf_i32 r = (mf_i32)fl;
    if (d > 0.5f || (d == 0.5f && (r & 1)))
        r++;
    return r;
}

/* ----------------------------------------------------------------- UE8M0 */

/* Biased exponent (1..254) of s rounded up to a power of two. */
MF_FN mf_u32 mf_ue8m0_exponent(float s)
{
    const mf_u32 b = mf_f32_bits(s);
    mf_u32 e = ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u ? 1u : 0u);
    e = e < 1u ? 1u : e;
    return e > 254u ? 254u : e;
}

/* A stored exponent byte's value, 2^(e - 127): 255 is NaN, 0 is 2^-127 (subnormal). */
MF_FN float mf_ue8m0_read(mf_u32 e)
{
    e &= 0xFFu;
    if (e == 255u)
        return mf_bits_f32(0x7FC00000u);
    if (e == 0u)
        return mf_bits_f32(0x00400000u);
    return mf_bits_f32(e << 23);
}

/* ------------------------------------------------------- the x86 NaN of a product */

/*
 * The CPU reference runs on x86-64 (SSE): an operation with a NaN operand returns the first
 * NaN operand, quieted (sign and payload kept); an invalid one (0 * Inf) the default NaN, sign
 * set (mf_portable.h). GPUs return a canonical positive NaN, which would turn the f8 code 0xFF
 * into 0x7F (NUMERICS.md: the NaN code carries h's sign). The GPU backends rebuild the x86 bits
 * wherever h can become NaN; on the CPU these are the plain product.
 */
MF_FN float mf_nan_of(float r, float x, float y)
{
    if (!mf_is_nan(r))
        return r;
    if (mf_is_nan(x))
        return mf_quiet(x);
    if (mf_is_nan(y))
        return mf_quiet(y);
    return mf_bits_f32(MF_DEFAULT_NAN_BITS);
}

MF_FN float mf_mul(float x, float y) { return mf_nan_of(x * y, x, y); }

#endif /* MOEFUSE_NUMERICS_CONVERT_H */
