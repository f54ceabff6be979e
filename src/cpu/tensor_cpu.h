/* Strided host-tensor addressing and row conversion for the CPU backend. */
#ifndef MOEFUSE_CPU_TENSOR_H
#define MOEFUSE_CPU_TENSOR_H

#include "cpu/numerics.h"
#include "cpu/omp_compat.h"
#include "moefuse.h"

#include <stddef.h>
#include <stdint.h>

static inline size_t mf_cpu_elem_size(moefuse_dtype dt)
{
    switch (dt) {
    case MOEFUSE_F32:
    case MOEFUSE_I32: return 4;
    case MOEFUSE_F16:
    case MOEFUSE_BF16: return 2;
    default: return 1;
    }
}

/* Address of element (i0, i1) / (i0, i1, i2) of a rank-2 / rank-3 tensor. */
static inline char *mf_at1(const moefuse_tensor *t, int64_t i0)
{
    return (char *)t->data + t->offset + i0 * t->stride[0] * (int64_t)mf_cpu_elem_size(t->dtype);
}

static inline char *mf_at2(const moefuse_tensor *t, int64_t i0, int64_t i1)
{
    return (char *)t->data + t->offset +
           (i0 * t->stride[0] + i1 * t->stride[1]) * (int64_t)mf_cpu_elem_size(t->dtype);
}

static inline char *mf_at3(const moefuse_tensor *t, int64_t i0, int64_t i1, int64_t i2)
{
    return (char *)t->data + t->offset +
           (i0 * t->stride[0] + i1 * t->stride[1] + i2 * t->stride[2]) *
               (int64_t)mf_cpu_elem_size(t->dtype);
}

/* dst[0..n) = f32(src[0..n)) for a contiguous run of f32/f16/bf16 values. */
static inline void mf_load_row(float *restrict dst, const void *restrict src, moefuse_dtype dt,
                               int64_t n)
{
    if (dt == MOEFUSE_F32) {
        const float *s = (const float *)src;
MF_OMP(simd)
        for (int64_t i = 0; i < n; i++)
            dst[i] = s[i];
    } else if (dt == MOEFUSE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
MF_OMP(simd)
        for (int64_t i = 0; i < n; i++)
            dst[i] = mf_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = mf_f16_to_f32(s[i]);
    }
}

/* dst[0..n) = round(src[0..n)) to dt (f32/f16/bf16). */
static inline void mf_store_row(void *restrict dst, const float *restrict src, moefuse_dtype dt,
                                int64_t n)
{
    if (dt == MOEFUSE_F32) {
        float *d = (float *)dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = src[i];
    } else if (dt == MOEFUSE_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = (uint16_t)mf_f32_to_bf16(src[i]);
    } else {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = (uint16_t)mf_f32_to_f16(src[i]);
    }
}

#endif /* MOEFUSE_CPU_TENSOR_H */
