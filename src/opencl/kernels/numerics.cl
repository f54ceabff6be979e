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

/* The conversions (mf_convert.h), mf_is_nan, mf_quiet and the activations come from
 * src/numerics (the shared headers embedded before this file). */

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
        ((__global ushort *)base)[i] =
            (ushort)(dt == MF_BF16 ? mf_f32_to_bf16(v) : mf_f32_to_f16(v));
}

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
