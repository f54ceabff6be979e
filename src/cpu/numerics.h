/*
 * Scalar number-format conversions of docs/NUMERICS.md, bit exact and
 * independent of the FP rounding mode and of FMA contraction (integer code
 * wherever a rounding is made).
 */
#ifndef MOEFUSE_CPU_NUMERICS_H
#define MOEFUSE_CPU_NUMERICS_H

#include "moefuse.h"
#include "numerics/mf_portable.h" /* mf_f32_bits, mf_bits_f32: shared with every backend */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ bf16 */

static inline float mf_bf16_to_f32(uint16_t h) { return mf_bits_f32((uint32_t)h << 16); }

static inline uint16_t mf_f32_to_bf16(float f)
{
    uint32_t u = mf_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)(((u >> 16) & 0x8000u) | 0x7FC0u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Round an f32 to the nearest bf16 value, kept in f32. */
static inline float mf_round_bf16(float f) { return mf_bf16_to_f32(mf_f32_to_bf16(f)); }

/* ------------------------------------------------------------------- f16 */

static inline float mf_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F)
        return mf_bits_f32(sign | 0x7F800000u | (m << 13));
    if (e != 0)
        return mf_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
    /* zero or subnormal: m * 2^-24, exact in f32 */
    float v = (float)m * 5.9604644775390625e-8f;
    return sign ? -v : v;
}

static inline uint16_t mf_f32_to_f16(float f)
{
    uint32_t u = mf_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)
        return (uint16_t)(sign | 0x7E00u);
    if (ax >= 0x47800000u) /* >= 2^16 (or Inf): overflow */
        return (uint16_t)(sign | 0x7C00u);
    if (ax >= 0x38800000u) { /* normal half range (>= 2^-14), rounding may carry to Inf */
        uint32_t v = ax - 0x38000000u;
        v = (v + 0xFFFu + ((v >> 13) & 1u)) >> 13;
        return (uint16_t)(sign | v);
    }
    uint32_t e = ax >> 23;
    if (e < 102u) /* below 2^-25: rounds to zero */
        return sign;
    /* value = m * 2^(e-150); in units of 2^-24: m >> (126 - e) */
    uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14..24 */
    uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u)))
        r++;
    return (uint16_t)(sign | r);
}

/* --------------------------------------------------------------- f8 e4m3 */

static inline float mf_e4m3_to_f32(uint8_t b)
{
    uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    float v;
    if ((b & 0x7Fu) == 0x7Fu)
        return mf_bits_f32((b & 0x80u) ? 0xFFC00000u : 0x7FC00000u);
    if (e == 0)
        v = (float)m * 0.001953125f; /* m * 2^-9 */
    else
        v = mf_bits_f32(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

static inline uint8_t mf_f32_to_e4m3(float f)
{
    uint32_t u = mf_f32_bits(f);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) /* NaN */
        return (uint8_t)(sign | 0x7Fu);
    if (ax > 0x43E00000u) /* > 448, incl. Inf: saturate */
        return (uint8_t)(sign | 0x7Eu);
    if (ax >= 0x3C800000u) { /* normal e4m3 (>= 2^-6) */
        uint32_t v = ax - 0x3C000000u;
        v = (v + 0x7FFFFu + ((v >> 20) & 1u)) >> 20;
        return (uint8_t)(sign | v);
    }
    uint32_t e = ax >> 23;
    if (e < 117u) /* below 2^-10 (incl. zero): rounds to zero */
        return sign;
    /* value = m * 2^(e-150); in units of 2^-9: m >> (141 - e) */
    uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 141u - e; /* 21..24 */
    uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u)))
        r++;
    return (uint8_t)(sign | r);
}

/* -------------------------------------------------------------------- i8 */

static inline int8_t mf_f32_to_i8(float f)
{
    if (f != f)
        return 0;
    if (f >= 127.0f)
        return 127;
    if (f <= -127.0f)
        return -127;
    float fl = floorf(f);
    float d = f - fl; /* exact: |f| < 2^7 */
    int r = (int)fl;
    if (d > 0.5f || (d == 0.5f && (r & 1)))
        r++;
    return (int8_t)r;
}

/* ----------------------------------------------------------------- UE8M0 */

/* Biased exponent e (1..254) of s rounded up to a power of two. */
static inline uint32_t mf_ue8m0_exponent(float s)
{
    uint32_t b = mf_f32_bits(s);
    uint32_t e = ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u);
    if (e < 1u)
        e = 1u;
    if (e > 254u)
        e = 254u;
    return e;
}

static inline float mf_ue8m0_value(uint32_t e) { return mf_bits_f32(e << 23); }

/* Value of a stored exponent byte: 2^(e-127); 255 is NaN. */
static inline float mf_ue8m0_read(uint8_t e)
{
    if (e == 255u)
        return mf_bits_f32(0x7FC00000u);
    if (e == 0u)
        return mf_bits_f32(0x00400000u); /* 2^-127, subnormal */
    return mf_bits_f32((uint32_t)e << 23);
}

/* ------------------------------------------------------- generic element */

static inline float mf_load_elem(const void *p, moefuse_dtype dt)
{
    switch (dt) {
    case MOEFUSE_F32: return *(const float *)p;
    case MOEFUSE_F16: return mf_f16_to_f32(*(const uint16_t *)p);
    case MOEFUSE_BF16: return mf_bf16_to_f32(*(const uint16_t *)p);
    default: return 0.0f;
    }
}

static inline void mf_store_elem(void *p, moefuse_dtype dt, float v)
{
    switch (dt) {
    case MOEFUSE_F32: *(float *)p = v; break;
    case MOEFUSE_F16: *(uint16_t *)p = mf_f32_to_f16(v); break;
    case MOEFUSE_BF16: *(uint16_t *)p = mf_f32_to_bf16(v); break;
    default: break;
    }
}

#endif /* MOEFUSE_CPU_NUMERICS_H */
