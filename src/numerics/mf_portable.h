/*
 * The one dialect the shared numerics (mf_convert.h, mf_exp.h, mf_erf_tanh.h,
 * mf_activation.h) are written in: plain C11, CUDA C++ (host and device) and
 * OpenCL C 1.2 all compile it, so every backend runs the same text and gets
 * the same bits. Only IEEE f32 operations (+ - * / correctly rounded, fmaf
 * exact) and integer code on the bits are used; nothing is fused unless
 * written as fmaf (C: -ffp-contract=off, CUDA: --fmad=false, OpenCL:
 * FP_CONTRACT OFF).
 *
 * MF_FN        qualifies every function (static inline / __host__ __device__ /
 *              inline).
 * mf_u32/i32   32-bit integers (mf_i64 64-bit); mf_f32_bits/mf_bits_f32 the bit casts.
 * Constant tables are declared per language where they are used (mf_exp.h):
 * static const in C, a __device__ and a host copy in CUDA, __constant in OpenCL.
 */
#ifndef MOEFUSE_NUMERICS_PORTABLE_H
#define MOEFUSE_NUMERICS_PORTABLE_H

#if defined(__OPENCL_VERSION__)
#pragma OPENCL FP_CONTRACT OFF /* no a * b + c fused unless written as fma */
#define MF_FN inline
typedef uint mf_u32;
typedef int mf_i32;
typedef long mf_i64;
MF_FN mf_u32 mf_f32_bits(float f) { return as_uint(f); }
MF_FN float mf_bits_f32(mf_u32 u) { return as_float(u); }
#define mf_fmaf(a, b, c) fma((a), (b), (c))
#define mf_fabsf(a) fabs(a)
#define mf_floorf(a) floor(a)
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
typedef uint32_t mf_u32;
typedef int32_t mf_i32;
typedef int64_t mf_i64;
#if defined(__CUDACC__)
#define MF_FN static __host__ __device__ __forceinline__
#else
#define MF_FN static inline
#endif
MF_FN mf_u32 mf_f32_bits(float f)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    mf_u32 u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}
MF_FN float mf_bits_f32(mf_u32 u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}
#define mf_fmaf(a, b, c) fmaf((a), (b), (c))
#define mf_fabsf(a) fabsf(a)
#define mf_floorf(a) floorf(a)
#endif

/* Bit tests, immune to any finite-math assumption. */
MF_FN int mf_is_nan(float v) { return (mf_f32_bits(v) & 0x7FFFFFFFu) > 0x7F800000u; }
MF_FN int mf_is_finite(float v) { return (mf_f32_bits(v) & 0x7F800000u) != 0x7F800000u; }

/* NaN bits of the reference (x86-64 SSE): a NaN operand comes back quieted; an invalid
 * operation (Inf - Inf, 0 * Inf, Inf / Inf) gives the default NaN, sign set. */
#define MF_DEFAULT_NAN_BITS 0xFFC00000u
MF_FN float mf_quiet(float x) { return mf_bits_f32(mf_f32_bits(x) | 0x00400000u); }

#endif /* MOEFUSE_NUMERICS_PORTABLE_H */
