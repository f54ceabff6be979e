/* f32 <-> bf16 / f16 conversions for filling inputs and reading outputs (host side). */
#ifndef MOEFUSE_TOOLS_CONVERT_H
#define MOEFUSE_TOOLS_CONVERT_H

#include <moefuse.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; NaN stays a quiet NaN. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* IEEE binary16, round to nearest even (via the value, exact for the range we use). */
static inline uint16_t f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    float a = fabsf(f);
    if (a != a)
        return (uint16_t)(sign | 0x7E00u);
    if (a >= 65520.0f)
        return (uint16_t)(sign | 0x7C00u);
    if (a < 6.103515625e-05f) { /* subnormal: multiples of 2^-24 */
        float m = nearbyintf(a * 16777216.0f);
        return (uint16_t)(sign | (uint16_t)m);
    }
    int e;
    float m = frexpf(a, &e);                        /* a = m * 2^e, m in [0.5, 1) */
    float mant = nearbyintf((m * 2.0f - 1.0f) * 1024.0f);
    if (mant >= 1024.0f) {
        mant = 0.0f;
        e++;
    }
    return (uint16_t)(sign | (uint16_t)((e - 1 + 15) << 10) | (uint16_t)mant);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (h & 0x8000u) ? 1u : 0u;
    int e = (h >> 10) & 0x1F;
    uint32_t m = h & 0x3FFu;
    float v;
    if (e == 0)
        v = ldexpf((float)m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexpf((float)(m | 0x400u), e - 25);
    return sign ? -v : v;
}

/* Store value v as element i of a buffer of dtype f32 / f16 / bf16. */
/* f32 to e4m3fn: nearest even, |v| > 448 saturates, NaN to 0x7F with v's sign. */
static inline uint8_t f32_to_e4m3(float f)
{
    const uint32_t u = f32_bits(f), sign = (u >> 24) & 0x80u, ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)
        return (uint8_t)(sign | 0x7Fu);
    if (ax > 0x43E00000u)
        return (uint8_t)(sign | 0x7Eu);
    if (ax >= 0x3C800000u) { /* normal e4m3: rebias the exponent, keep 3 mantissa bits */
        uint32_t v = ax - 0x3C000000u;
        v = (v + 0x7FFFFu + ((v >> 20) & 1u)) >> 20;
        return (uint8_t)(sign | v);
    }
    return (uint8_t)(sign | (uint32_t)nearbyintf(bits_f32(ax) * 512.0f)); /* k * 2^-9 */
}

static inline void store_float(void *buf, moefuse_dtype dt, int64_t i, float v)
{
    if (dt == MOEFUSE_F8_E4M3)
        ((uint8_t *)buf)[i] = f32_to_e4m3(v);
    else if (dt == MOEFUSE_F32)
        ((float *)buf)[i] = v;
    else if (dt == MOEFUSE_BF16)
        ((uint16_t *)buf)[i] = f32_to_bf16(v);
    else
        ((uint16_t *)buf)[i] = f32_to_f16(v);
}

static inline float load_float(const void *buf, moefuse_dtype dt, int64_t i)
{
    if (dt == MOEFUSE_F32)
        return ((const float *)buf)[i];
    if (dt == MOEFUSE_BF16)
        return bf16_to_f32(((const uint16_t *)buf)[i]);
    return f16_to_f32(((const uint16_t *)buf)[i]);
}

#endif
