/*
 * topk_softmax of the CUDA backend (src/cpu/topk.c, docs/NUMERICS.md): one
 * warp per token. Lane l holds logits l, l + 32, ... (in registers up to
 * E = 256, else read again from memory: every value is recomputed by the same
 * expression, so the bits do not change). The softmax denominator is summed
 * in index order i = 0..E-1, as the CPU does, by broadcasting each value
 * with a shuffle; every lane computes the same sum.
 *
 * Ranking: numbers before NaN, then p descending, then the lower id. It is a
 * strict total order, packed into a 64-bit key (larger ranks first):
 * bit 62 = not NaN, bits 61..31 = the bits of p (p >= 0, so they order as
 * p does), bits 30..0 = 2^31 - 1 - id. Pick j is the largest key below pick
 * j - 1's, so nothing needs marking as taken.
 */
#include "cuda/cuda_internal.h"
#include "cuda/numerics.cuh"
#include "cuda/vec.cuh"

#include <string.h>

#define TK_WARPS 4
#define TK_THREADS (TK_WARPS * 32)
#define TK_CACHE 8 /* logits per lane kept in registers: E <= 256 */
#define TK_FULL 0xFFFFFFFFu

typedef struct topk_params {
    const char *l;  /* logits [M, E] */
    int64_t ls0, les;
    int32_t *ids;   /* [M, k] */
    int64_t is0;
    float *w;       /* [M, k] */
    int64_t ws0;
    int64_t M, E, k;
    int ldt, renorm;
} topk_params;

/* 2^(j/32) of mf_exp_f32, in shared memory: lanes read it at any index without serialising
 * (the __device__ copy of mf_exp.h is in global memory, a long latency per read). */
__constant__ float mf_c_topk_exp_tab[64] = MF_EXP_TABLE_INIT;

/* mf_exp_f32(x), its fast path from the shared-memory table (the same bits: device_check.cu). */
static __device__ __forceinline__ float exp_shared(float x, uint32_t tabs)
{
    return fabsf(x) < MF_EXP_FAST_LIMIT ? mf_exp_tab_fast(x, tabs) : mf_exp_f32(x);
}

/* Probability of a non-NaN logit v with e = exp(v - mx) (mode 2): mode 0 (no number) 0,
 * 1 (+-Inf max) share, 2 softmax. */
static __device__ __forceinline__ float prob(float v, float e, int mode, float mx, float sum,
                                             float share)
{
    if (mode == 0)
        return 0.0f;
    if (mode == 1)
        return v == mx ? share : 0.0f;
    return e / sum;
}

static __device__ __forceinline__ uint64_t rank_key(float v, float e, int64_t i, int mode,
                                                    float mx, float sum, float share)
{
    const int nan = mf_is_nan(v);
    const float p = nan ? 0.0f : prob(v, e, mode, mx, sum, share);
    return ((uint64_t)(nan ? 0u : 1u) << 62) | ((uint64_t)mf_f32_bits(p) << 31) |
           (uint64_t)(0x7FFFFFFFu - (uint32_t)i);
}

__global__ void __launch_bounds__(TK_THREADS) mf_k_topk(topk_params p)
{
    __shared__ float tab[64];
    if (threadIdx.x < 64)
        tab[threadIdx.x] = mf_c_topk_exp_tab[threadIdx.x];
    __syncthreads();
    const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(tab);
    const int lane = threadIdx.x & 31;
    const int cached = p.E <= 32 * TK_CACHE;
    for (int64_t m = (int64_t)blockIdx.x * TK_WARPS + (threadIdx.x >> 5); m < p.M;
         m += (int64_t)gridDim.x * TK_WARPS) {
        const char *row = p.l + m * p.ls0 * p.les;
        float lv[TK_CACHE];
#pragma unroll
        for (int c = 0; c < TK_CACHE; c++) {
            const int64_t i = (int64_t)c * 32 + lane;
            lv[c] = cached && i < p.E ? load_elem(row, i, p.ldt) : 0.0f;
        }
        /* the largest number (NaN skipped), and whether there is one; the order of a
         * max does not matter (+0 and -0 give the same exp(l - mx)) */
        float mx = -INFINITY;
        int any = 0;
        if (cached) {
#pragma unroll
            for (int c = 0; c < TK_CACHE; c++) {
                if ((int64_t)c * 32 + lane < p.E && !mf_is_nan(lv[c])) {
                    mx = fmaxf(mx, lv[c]);
                    any = 1;
                }
            }
        } else {
            for (int64_t i = lane; i < p.E; i += 32) {
                const float v = load_elem(row, i, p.ldt);
                if (!mf_is_nan(v)) {
                    mx = fmaxf(mx, v);
                    any = 1;
                }
            }
        }
        for (int off = 16; off > 0; off >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(TK_FULL, mx, off));
        any = __any_sync(TK_FULL, any);
        int mode = 2;
        float sum = 0.0f, share = 0.0f;
        float ev[TK_CACHE]; /* exp(l - mx) of the cached logits (mode 2), computed once */
#pragma unroll
        for (int c = 0; c < TK_CACHE; c++)
            ev[c] = 0.0f;
        if (!any) {
            mode = 0;
        } else if (!mf_is_finite(mx)) {
            /* every +Inf (or, when all numbers are -Inf, every number) shares equally */
            unsigned cnt = 0;
            if (cached) {
#pragma unroll
                for (int c = 0; c < TK_CACHE; c++)
                    cnt += (int64_t)c * 32 + lane < p.E && lv[c] == mx;
            } else {
                for (int64_t i = lane; i < p.E; i += 32)
                    cnt += load_elem(row, i, p.ldt) == mx;
            }
            for (int off = 16; off > 0; off >>= 1)
                cnt += __shfl_xor_sync(TK_FULL, cnt, off);
            share = 1.0f / (float)cnt;
            mode = 1;
        } else {
            /* sum = p_0 + p_1 + ... in index order: each p_i broadcast in turn */
            for (int64_t base = 0; base < p.E; base += 32) { /* uniform: every lane shuffles */
                const int64_t i = base + lane;
                float x = 0.0f;
                if (i < p.E) {
                    float v = 0.0f;
                    if (cached) {
#pragma unroll
                        for (int c = 0; c < TK_CACHE; c++)
                            v = (int64_t)c * 32 == base ? lv[c] : v;
                    } else {
                        v = load_elem(row, i, p.ldt);
                    }
                    x = mf_is_nan(v) ? 0.0f : exp_shared(v - mx, tabs);
                }
                if (cached) {
#pragma unroll
                    for (int c = 0; c < TK_CACHE; c++)
                        ev[c] = (int64_t)c * 32 == base ? x : ev[c];
                }
                const int64_t left = p.E - base;
                const int lim = left < 32 ? (int)left : 32;
                for (int l = 0; l < 32; l++) {
                    const float pl = __shfl_sync(TK_FULL, x, l);
                    if (l < lim)
                        sum = sum + pl;
                }
            }
        }
        /* keys of the cached candidates (0 for lanes past E: below every real key) */
        uint64_t key[TK_CACHE];
#pragma unroll
        for (int c = 0; c < TK_CACHE; c++) {
            const int64_t i = (int64_t)c * 32 + lane;
            key[c] = cached && i < p.E ? rank_key(lv[c], ev[c], i, mode, mx, sum, share) : 0ull;
        }
        /* k picks, each the best key below the previous pick's */
        uint64_t prev = ~0ull;
        float wsum = 0.0f;
        int32_t *ids = p.ids + m * p.is0;
        float *wr = p.w + m * p.ws0;
        for (int64_t j = 0; j < p.k; j++) {
            uint64_t best = 0;
            if (cached) {
#pragma unroll
                for (int c = 0; c < TK_CACHE; c++)
                    best = key[c] < prev && key[c] > best ? key[c] : best;
            } else {
                for (int64_t i = lane; i < p.E; i += 32) {
                    const float v = load_elem(row, i, p.ldt);
                    const float e = mode == 2 && !mf_is_nan(v) ? exp_shared(v - mx, tabs) : 0.0f;
                    const uint64_t k = rank_key(v, e, i, mode, mx, sum, share);
                    best = k < prev && k > best ? k : best;
                }
            }
            for (int off = 16; off > 0; off >>= 1) {
                const uint64_t o = __shfl_xor_sync(TK_FULL, best, off);
                best = o > best ? o : best;
            }
            prev = best;
            /* best > 0: k <= E is validated, so a candidate is always left */
            const int32_t id = (int32_t)(0x7FFFFFFFu - (uint32_t)(best & 0x7FFFFFFFu));
            const float pw = mf_bits_f32((uint32_t)(best >> 31) & 0x7FFFFFFFu);
            wsum = wsum + pw; /* in pick order j = 0..k-1, as the CPU */
            if (lane == 0) {
                ids[j] = id;
                wr[j] = pw;
            }
        }
        if (p.renorm && wsum > 0.0f && lane == 0)
            for (int64_t j = 0; j < p.k; j++)
                wr[j] = wr[j] / wsum; /* lane 0 reads back its own writes */
    }
}

moefuse_status mf_cuda_topk_softmax(moefuse_context *ctx, void *state, const mf_topk_args *a)
{
    cuda_state *s = (cuda_state *)state;
    if (a->tokens == 0)
        return MOEFUSE_OK;
    if (a->experts > 0x7FFFFFFF)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "topk_softmax: E = %lld experts do not fit the i32 ids",
                        (long long)a->experts);
    topk_params p;
    memset(&p, 0, sizeof p);
    p.l = mf_cuda_base(&a->logits);
    p.ls0 = a->logits.stride[0];
    p.ldt = (int)a->logits.dtype;
    p.les = a->logits.dtype == MOEFUSE_F32 ? 4 : 2;
    p.ids = (int32_t *)mf_cuda_base(&a->ids);
    p.is0 = a->ids.stride[0];
    p.w = (float *)mf_cuda_base(&a->weights);
    p.ws0 = a->weights.stride[0];
    p.M = a->tokens;
    p.E = a->experts;
    p.k = a->topk;
    p.renorm = a->renormalize;
    const unsigned grid = mf_cuda_grid(s, p.M, TK_WARPS, 16);
    mf_k_topk<<<grid, TK_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "topk_softmax", "mf_k_topk");
}
