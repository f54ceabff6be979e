/*
 * Loads and stores of 8 consecutive channels for the CUDA row kernels
 * (rows.cu, dequant.cu): 16-byte vectors where the caller has checked the
 * alignment, element by element otherwise (rows may start anywhere the
 * element alignment allows, and the last vector of an odd row is partial).
 */
#ifndef MOEFUSE_CUDA_VEC_CUH
#define MOEFUSE_CUDA_VEC_CUH

#include "cuda/numerics.cuh"

static __device__ __forceinline__ float load_elem(const char *row, int64_t c, int dt)
{
    if (dt == MF_DT_F32)
        return ((const float *)row)[c];
    const uint32_t h = ((const uint16_t *)row)[c];
    return dt == MF_DT_BF16 ? mf_bf16_to_f32(h) : mf_f16_to_f32(h);
}

static __device__ __forceinline__ void unpack16(uint32_t w, int dt, float *lo, float *hi)
{
    if (dt == MF_DT_BF16) {
        *lo = mf_bits_f32(w << 16);
        *hi = mf_bits_f32(w & 0xFFFF0000u);
    } else {
        *lo = mf_f16_to_f32(w & 0xFFFFu);
        *hi = mf_f16_to_f32(w >> 16);
    }
}

/* Channels c..c+n-1 (n <= 8) of a row; 16-byte loads when vec and n == 8. */
static __device__ __forceinline__ void load8(const char *row, int64_t c, int dt, int vec, int n,
                                             float v[8])
{
    if (vec && n == 8) {
        if (dt == MF_DT_F32) {
            const float4 *p = (const float4 *)(row + c * 4);
            const float4 a = __ldg(p), b = __ldg(p + 1);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
            v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else {
            const uint4 w = __ldg((const uint4 *)(row + c * 2));
            unpack16(w.x, dt, &v[0], &v[1]);
            unpack16(w.y, dt, &v[2], &v[3]);
            unpack16(w.z, dt, &v[4], &v[5]);
            unpack16(w.w, dt, &v[6], &v[7]);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = i < n ? load_elem(row, c + i, dt) : 0.0f;
}

static __device__ __forceinline__ uint32_t pack16(float lo, float hi, int dt)
{
    if (dt == MF_DT_BF16)
        return mf_f32_to_bf16(lo) | (mf_f32_to_bf16(hi) << 16);
    return mf_f32_to_f16(lo) | (mf_f32_to_f16(hi) << 16);
}

/* act_mul's output: channels c..c+n-1 rounded to dt; 16-byte stores when vec and n == 8. */
static __device__ __forceinline__ void store8(char *row, int64_t c, int dt, int vec, int n,
                                              const float v[8])
{
    if (vec && n == 8) {
        if (dt == MF_DT_F32) {
            float4 *p = (float4 *)(row + c * 4);
            p[0] = make_float4(v[0], v[1], v[2], v[3]);
            p[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
            *(uint4 *)(row + c * 2) = make_uint4(pack16(v[0], v[1], dt), pack16(v[2], v[3], dt),
                                                 pack16(v[4], v[5], dt), pack16(v[6], v[7], dt));
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if (i < n) {
            if (dt == MF_DT_F32)
                ((float *)row)[c + i] = v[i];
            else if (dt == MF_DT_BF16)
                ((uint16_t *)row)[c + i] = (uint16_t)mf_f32_to_bf16(v[i]);
            else
                ((uint16_t *)row)[c + i] = (uint16_t)mf_f32_to_f16(v[i]);
        }
    }
}

#endif /* MOEFUSE_CUDA_VEC_CUH */
