/*
 * What the expert-parallel kernels share (ep_rows.cu, ep_ll.cu): a scales tensor of any
 * layout seen from the device, the byte copy of a row by a block, a float row's stores (its
 * loads are vec.cuh's), and a warp's list of what its lanes add.
 */
#ifndef MOEFUSE_CUDA_EP_ROWS_CUH
#define MOEFUSE_CUDA_EP_ROWS_CUH

#include "cuda/numerics.cuh"
#include "cuda/vec.cuh" /* load_elem, load8: a row's values as f32 */

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

/* This lane's place in a list that n entries already fill, when it adds one (valid); *n grows
   by the warp's entries. Every lane of the warp calls it. */
static __device__ __forceinline__ int ep_warp_place(bool valid, int lane, int *n)
{
    const unsigned ballot = __ballot_sync(0xffffffffu, valid);
    const int at = *n + __popc(ballot & ((1u << lane) - 1u));
    *n += __popc(ballot);
    return at;
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

/* c of a row of f32, f16 or bf16 (MF_DT_*), from f32 with one rounding. */
static __device__ __forceinline__ void ep_store(char *p, int dt, int64_t c, float v)
{
    if (dt == MF_DT_F32)
        ((float *)p)[c] = v;
    else
        ((uint16_t *)p)[c] =
            (uint16_t)(dt == MF_DT_BF16 ? mf_f32_to_bf16(v) : mf_f32_to_f16(v));
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

/* A scales tensor (rank 3) in layout l, for the kernels. */
static inline EpScales ep_scales_of(const moefuse_tensor *t, moefuse_scale_layout l)
{
    EpScales s;
    s.sc = mf_cuda_base(t);
    s.s0 = t->stride[0];
    s.s1 = t->stride[1];
    s.s2 = t->stride[2];
    s.sdt = (int)t->dtype; /* MF_DT_* and MF_LAYOUT_* are moefuse.h's values */
    s.layout = (int)l;
    return s;
}

#endif
