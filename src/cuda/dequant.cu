/*
 * dequant of the CUDA backend: out = f32(q) * s, rounded once to out's dtype
 * (src/cpu/dequant.c), with the CPU's NaN bits. One warp item is a row and
 * 512 channels (two slots of 32 lanes x 8): an 8-byte load of codes and a
 * 16-byte store (bf16/f16; two for f32) per lane and slot where aligned.
 * The 8 channels of a lane share one group (G is a multiple of 8, or H).
 */
#include "cuda/cuda_internal.h"
#include "cuda/numerics.cuh"
#include "cuda/vec.cuh"

#include <string.h>

#define DQ_WARPS 8
#define DQ_THREADS (DQ_WARPS * 32)
#define DQ_BLOCKS_PER_SM 4
#define DQ_ITEM 512

typedef struct dq_params {
    const char *q;   /* codes [T, H] */
    int64_t qs0;
    const char *sc;  /* scales, rank 3 with E = 1: stride[1] */
    int64_t ss1;
    char *out;       /* [T, H] f32/f16/bf16 */
    int64_t os0, oes;
    int64_t T, H, chunks;
    int glog;        /* log2 G, or 0 when G = H (one group) */
    int odt, fp8, layout, sc_f32, vec_q, vec_o;
} dq_params;

static __device__ __forceinline__ float read_scale(const dq_params &p, int64_t t, int64_t g)
{
    if (p.layout == MF_LAYOUT_PACKED)
        return mf_ue8m0_read((uint8_t)p.sc[((g >> 2) * p.ss1 + t) * 4 + (g & 3)]);
    const int64_t i = p.layout == MF_LAYOUT_COL ? g * p.ss1 + t : t * p.ss1 + g;
    return p.sc_f32 ? ((const float *)p.sc)[i] : mf_ue8m0_read(((const uint8_t *)p.sc)[i]);
}

__global__ void __launch_bounds__(DQ_THREADS, DQ_BLOCKS_PER_SM) mf_k_dequant(dq_params p)
{
    const int lane = threadIdx.x & 31;
    const int64_t W = (int64_t)gridDim.x * DQ_WARPS;
    const int64_t it = (int64_t)blockIdx.x * DQ_WARPS + (threadIdx.x >> 5);
    int64_t t = it / p.chunks, ch = it % p.chunks;
    const int64_t Wq = W / p.chunks, Wr = W % p.chunks;
    while (t < p.T) {
        const char *qrow = p.q + t * p.qs0;
        char *orow = p.out + t * p.os0 * p.oes;
        uint32_t w[2][2];
        int64_t c0[2];
        int n[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            c0[k] = ch * DQ_ITEM + k * 256 + lane * 8;
            const int64_t left = p.H - c0[k];
            n[k] = left >= 8 ? 8 : (left > 0 ? (int)left : 0);
            w[k][0] = w[k][1] = 0u;
            if (p.vec_q && n[k] == 8) {
                const uint2 v = __ldg((const uint2 *)(qrow + c0[k]));
                w[k][0] = v.x;
                w[k][1] = v.y;
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i < n[k])
                        w[k][i >> 2] |= (uint32_t)(uint8_t)qrow[c0[k] + i] << ((i & 3) * 8);
            }
        }
#pragma unroll
        for (int k = 0; k < 2; k++) {
            if (n[k] == 0)
                continue;
            const float s = read_scale(p, t, p.glog ? c0[k] >> p.glog : 0);
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const uint32_t b = (w[k][i >> 2] >> ((i & 3) * 8)) & 0xFFu;
                const float f = p.fp8 ? mf_e4m3_to_f32(b) : (float)(int8_t)(uint8_t)b;
                v[i] = mf_mul(f, s); /* the NaN code's bits, as on x86 */
            }
            store8(orow, c0[k], p.odt, p.vec_o, n[k], v);
        }
        ch += Wr;
        t += Wq;
        if (ch >= p.chunks) {
            ch -= p.chunks;
            t++;
        }
    }
}

moefuse_status mf_cuda_dequant(moefuse_context *ctx, void *state, const mf_dequant_args *a)
{
    cuda_state *s = (cuda_state *)state;
    if (a->rows == 0 || a->hidden == 0)
        return MOEFUSE_OK;
    dq_params p;
    memset(&p, 0, sizeof p);
    p.q = mf_cuda_base(&a->q);
    p.qs0 = a->q.stride[0];
    p.sc = mf_cuda_base(&a->scales);
    p.ss1 = a->scales.stride[1];
    p.out = mf_cuda_base(&a->out);
    p.os0 = a->out.stride[0];
    p.oes = (int64_t)moefuse_dtype_size(a->out.dtype);
    p.T = a->rows;
    p.H = a->hidden;
    p.chunks = (a->hidden + DQ_ITEM - 1) / DQ_ITEM;
    const int64_t G = a->group;
    p.glog = G == a->hidden && G != 32 && G != 64 && G != 128 ? 0
             : (G == 32 ? 5 : (G == 64 ? 6 : 7));
    p.odt = (int)a->out.dtype;
    p.fp8 = a->q.dtype == MOEFUSE_F8_E4M3;
    p.layout = (int)a->quant.scale_layout;
    p.sc_f32 = a->scales.dtype == MOEFUSE_F32;
    p.vec_q = (uintptr_t)p.q % 8 == 0 && p.qs0 % 8 == 0;
    p.vec_o = (uintptr_t)p.out % 16 == 0 && (p.os0 * p.oes) % 16 == 0;
    const unsigned grid = mf_cuda_grid(s, p.T * p.chunks, DQ_WARPS, DQ_BLOCKS_PER_SM);
    mf_k_dequant<<<grid, DQ_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "dequant", "mf_k_dequant");
}
