/*
 * Number formats of docs/NUMERICS.md in OpenCL C 1.2: every rounding is
 * integer code on the bits, so results match the CPU backend exactly and do
 * not depend on cl_khr_fp16 (bf16/f16 travel as ushort).
 * It follows the shared headers of src/numerics in the embedded program (see
 * meson.build; FP_CONTRACT OFF is set by prelude.cl, first of all); the
 * kernel files after it use its helpers.
 */

/* moefuse_dtype values (moefuse.h) */
#define MF_F32 0
#define MF_F16 1
#define MF_BF16 2
#define MF_F8 3
#define MF_I8 4
#define MF_I32 5
#define MF_U8 6

/* moefuse_scale_layout values */
#define MF_ROW_MAJOR 0
#define MF_COLUMN_MAJOR 1
#define MF_PACKED 2

/* mf_is_nan, mf_is_finite, mf_quiet and the activations come from src/numerics (the
 * shared headers embedded before this file). */

inline float mf_bf16_to_f32(ushort h) { return as_float((uint)h << 16); }

inline ushort mf_f32_to_bf16(float f)
{
    uint u = as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (ushort)(((u >> 16) & 0x8000u) | 0x7FC0u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (ushort)(u >> 16);
}

inline float mf_round_bf16(float f) { return mf_bf16_to_f32(mf_f32_to_bf16(f)); }

inline float mf_f16_to_f32(ushort h)
{
    uint sign = (uint)(h & 0x8000u) << 16;
    uint e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu)
        return as_float(sign | 0x7F800000u | (m << 13));
    if (e != 0u)
        return as_float(sign | ((e + 112u) << 23) | (m << 13));
    float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
    return sign ? -v : v;
}

/* Round-to-nearest-even on the mantissa bits that fall off: r = m >> shift. */
inline uint mf_round_shift(uint m, uint shift)
{
    uint r = m >> shift, rem = m & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
    if (rem > mid || (rem == mid && (r & 1u)))
        r++;
    return r;
}

inline ushort mf_f32_to_f16(float f)
{
    uint u = as_uint(f);
    ushort sign = (ushort)((u >> 16) & 0x8000u);
    uint ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)
        return (ushort)(sign | 0x7E00u);
    if (ax >= 0x47800000u) /* >= 2^16: overflow to Inf */
        return (ushort)(sign | 0x7C00u);
    if (ax >= 0x38800000u) { /* normal half; the carry may reach Inf, as IEEE does */
        uint v = ax - 0x38000000u;
        v = (v + 0xFFFu + ((v >> 13) & 1u)) >> 13;
        return (ushort)(sign | v);
    }
    uint e = ax >> 23;
    if (e < 102u) /* below 2^-25 */
        return sign;
    return (ushort)(sign | mf_round_shift((ax & 0x7FFFFFu) | 0x800000u, 126u - e));
}

inline float mf_e4m3_to_f32(uchar b)
{
    uint e = (b >> 3) & 0xFu, m = b & 7u;
    if ((b & 0x7Fu) == 0x7Fu)
        return as_float((b & 0x80u) ? 0xFFC00000u : 0x7FC00000u);
    float v = e == 0u ? (float)m * 0.001953125f : as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

inline uchar mf_f32_to_e4m3(float f)
{
    uint u = as_uint(f);
    uchar sign = (uchar)((u >> 24) & 0x80u);
    uint ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)
        return (uchar)(sign | 0x7Fu);
    if (ax > 0x43E00000u) /* above 448, Inf included: saturate */
        return (uchar)(sign | 0x7Eu);
    if (ax >= 0x3C800000u) { /* normal e4m3 */
        uint v = ax - 0x3C000000u;
        v = (v + 0x7FFFFu + ((v >> 20) & 1u)) >> 20;
        return (uchar)(sign | v);
    }
    uint e = ax >> 23;
    if (e < 117u) /* below 2^-10, zero included */
        return sign;
    return (uchar)(sign | mf_round_shift((ax & 0x7FFFFFu) | 0x800000u, 141u - e));
}

inline char mf_f32_to_i8(float f)
{
    if (mf_is_nan(f))
        return 0;
    if (f >= 127.0f)
        return 127;
    if (f <= -127.0f)
        return -127;
    float fl = floor(f);
    float d = f - fl; /* exact for |f| < 2^7 */
    int r = (int)fl;
    if (d > 0.5f || (d == 0.5f && (r & 1)))
        r++;
    return (char)r;
}

/* Biased exponent (1..254) of s rounded up to a power of two. */
inline uint mf_ue8m0_exponent(float s)
{
    uint b = as_uint(s);
    uint e = ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u ? 1u : 0u);
    return clamp(e, 1u, 254u);
}

inline float mf_ue8m0_read(uchar e)
{
    if (e == 255u)
        return as_float(0x7FC00000u);
    if (e == 0u)
        return as_float(0x00400000u);
    return as_float((uint)e << 23);
}

/* Element i (in elements, tensor offset included) of an f32/f16/bf16 buffer. */
inline float mf_load(__global const uchar *base, int dt, long i)
{
    if (dt == MF_F32)
        return ((__global const float *)base)[i];
    ushort h = ((__global const ushort *)base)[i];
    return dt == MF_BF16 ? mf_bf16_to_f32(h) : mf_f16_to_f32(h);
}

inline void mf_store(__global uchar *base, int dt, long i, float v)
{
    if (dt == MF_F32)
        ((__global float *)base)[i] = v;
    else
        ((__global ushort *)base)[i] = dt == MF_BF16 ? mf_f32_to_bf16(v) : mf_f32_to_f16(v);
}

/*
 * NaN bits as the CPU reference gets them on x86-64 (SSE): an operation with
 * a NaN operand returns the first NaN operand, quieted, payload and sign
 * kept; an invalid operation (0 * Inf, Inf / Inf) returns the "default NaN"
 * 0xFFC00000, whose sign bit is SET. GPUs return a canonical positive NaN
 * instead, which would turn the CPU's f8 code 0xFF into 0x7F (NUMERICS.md:
 * the NaN code carries h's sign). These helpers rebuild the x86 result from
 * the operands wherever h can become NaN. (aarch64 hosts differ again: their
 * default NaN is positive; NUMERICS.md may want to settle this.)
 */
inline float mf_nan_of(float r, float x, float y)
{
    if (!mf_is_nan(r))
        return r;
    if (mf_is_nan(x))
        return mf_quiet(x);
    if (mf_is_nan(y))
        return mf_quiet(y);
    return as_float(0xFFC00000u);
}

inline float mf_mul(float x, float y) { return mf_nan_of(x * y, x, y); }

/* Last e with offs[e] <= i: the expert of flattened valid row i. */
inline long mf_find_expert(__global const long *offs, long experts, long i)
{
    long lo = 0, hi = experts - 1;
    while (lo < hi) {
        long mid = (lo + hi + 1) / 2;
        if (offs[mid] <= i)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}
