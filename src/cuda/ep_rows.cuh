/*
 * What the expert-parallel kernels share (ep_rows.cu, ep_ll.cu): a scales tensor of any
 * layout seen from the device, the byte copy of a row by a block, and a float row's loads.
 */
#ifndef MOEFUSE_CUDA_EP_ROWS_CUH
#define MOEFUSE_CUDA_EP_ROWS_CUH

#include "cuda/numerics.cuh"

#define EP_THREADS 256

/* A scales tensor, rank 3 [E, ...] in one of the layouts (docs/NUMERICS.md). */
typedef struct EpScales {
    char *sc;
    int64_t s0, s1, s2;     /* element strides */
    int sdt, layout;        /* MF_DT_F32 / U8 / I32 (packed); MF_LAYOUT_* */
} EpScales;

/* Where the scale (e, t, g) lies: a float, or a byte (u8, or one of a packed word's). */
static __device__ __forceinline__ char *ep_scale_at(const EpScales &p, int64_t e, int64_t t,
                                                    int64_t g)
{
    if (p.layout == MF_LAYOUT_PACKED)
        return p.sc + (e * p.s0 + (g >> 2) * p.s1 + t * p.s2) * 4 + (g & 3);
    const int64_t i = p.layout == MF_LAYOUT_COL ? e * p.s0 + g * p.s1 + t * p.s2
                                                : e * p.s0 + t * p.s1 + g * p.s2;
    return p.sc + i * (p.sdt == MF_DT_F32 ? 4 : 1);
}

/* The exponent byte that mf_ue8m0_read turns back into v, a power of two or NaN. */
static __device__ __forceinline__ uint8_t ep_exponent_of(float v)
{
    const uint32_t b = (uint32_t)__float_as_int(v);
    return v != v ? 255 : b == 0x00400000u ? 0 : (uint8_t)(b >> 23);
}

/* The value of scale (e, t, g). */
static __device__ __forceinline__ float ep_scale_read(const EpScales &p, int64_t e, int64_t t,
                                                      int64_t g)
{
    const char *q = ep_scale_at(p, e, t, g);
    return p.sdt == MF_DT_F32 ? *(const float *)q : mf_ue8m0_read((uint8_t)*q);
}

/* n bytes from src to dst by the block's threads: 16 at a time where both and n allow. */
static __device__ __forceinline__ void ep_copy_bytes(char *dst, const char *src, int64_t n)
{
    if ((((uintptr_t)dst | (uintptr_t)src | (uintptr_t)n) & 15u) == 0) {
        for (int64_t v = threadIdx.x; v < n / 16; v += EP_THREADS)
            ((uint4 *)dst)[v] = ((const uint4 *)src)[v];
        return;
    }
    for (int64_t b = threadIdx.x; b < n; b += EP_THREADS)
        dst[b] = src[b];
}

static __device__ __forceinline__ float ep_load(const char *p, int dt, int64_t c)
{
    if (dt == MF_DT_F32)
        return ((const float *)p)[c];
    const uint16_t h = ((const uint16_t *)p)[c];
    return dt == MF_DT_BF16 ? mf_bf16_to_f32(h) : mf_f16_to_f32(h);
}

/* c of a row of f32, f16 or bf16 (MF_DT_*), from f32 with one rounding. */
static __device__ __forceinline__ void ep_store(char *p, int dt, int64_t c, float v)
{
    if (dt == MF_DT_F32)
        ((float *)p)[c] = v;
    else
        ((uint16_t *)p)[c] =
            (uint16_t)(dt == MF_DT_BF16 ? mf_f32_to_bf16(v) : mf_f32_to_f16(v));
}

/* 8 values of a row of f32, f16 or bf16 from column c (16-byte aligned), as f32. */
static __device__ __forceinline__ void ep_load8(const char *row, int dt, int64_t c, float v[8])
{
    if (dt == MF_DT_F32) {
        const float4 a = *(const float4 *)(row + c * 4), b = *(const float4 *)(row + c * 4 + 16);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
        v[7] = b.w;
        return;
    }
    const uint4 h = *(const uint4 *)(row + c * 2);
    const uint32_t w[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const uint32_t lo = w[q] & 0xFFFFu, hi = w[q] >> 16;
        v[2 * q] = dt == MF_DT_BF16 ? mf_bf16_to_f32(lo) : mf_f16_to_f32(lo);
        v[2 * q + 1] = dt == MF_DT_BF16 ? mf_bf16_to_f32(hi) : mf_f16_to_f32(hi);
    }
}

/* 4 f32 values into a row of f32, f16 or bf16 at column c (aligned for them). */
static __device__ __forceinline__ void ep_store4(char *row, int dt, int64_t c, const float v[4])
{
    if (dt == MF_DT_F32) {
        *(float4 *)(row + c * 4) = make_float4(v[0], v[1], v[2], v[3]);
        return;
    }
    uint32_t h[4];
    for (int q = 0; q < 4; q++)
        h[q] = dt == MF_DT_BF16 ? mf_f32_to_bf16(v[q]) : mf_f32_to_f16(v[q]);
    *(uint2 *)(row + c * 2) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

static inline int ep_dt_code(moefuse_dtype d)
{
    switch (d) {
    case MOEFUSE_F32: return MF_DT_F32;
    case MOEFUSE_F16: return MF_DT_F16;
    case MOEFUSE_BF16: return MF_DT_BF16;
    case MOEFUSE_I32: return MF_DT_I32;
    case MOEFUSE_U8: return MF_DT_U8;
    default: return MF_DT_F8;
    }
}

/* A scales tensor (rank 3) in layout l, for the kernels. */
static inline EpScales ep_scales_of(const moefuse_tensor *t, moefuse_scale_layout l)
{
    EpScales s;
    s.sc = mf_cuda_base(t);
    s.s0 = t->stride[0];
    s.s1 = t->stride[1];
    s.s2 = t->stride[2];
    s.sdt = ep_dt_code(t->dtype);
    s.layout = l == MOEFUSE_SCALE_COLUMN_MAJOR   ? MF_LAYOUT_COL
               : l == MOEFUSE_SCALE_PACKED_UE8M0 ? MF_LAYOUT_PACKED
                                                 : MF_LAYOUT_ROW;
    return s;
}

#endif
