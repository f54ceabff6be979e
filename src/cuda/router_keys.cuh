/*
 * The pieces both fast topk_route kernels share (router_warp.cu: a warp per row;
 * router_block.cu: a block per row): the 64-bit rank keys, warp maxima of them, the groups'
 * top-2 and keys, the loads of a row, and the last steps (weights of the picks, the softmax
 * over the k, renormalisation, scale, stores). The order is route_ahead's in router.cu, the
 * CPU's (docs/NUMERICS.md, "Router (topk_route)").
 */
#ifndef MOEFUSE_CUDA_ROUTER_KEYS_CUH
#define MOEFUSE_CUDA_ROUTER_KEYS_CUH

#include "cuda/numerics.cuh"
#include "cuda/router.h"

#include <cuda_fp16.h>

#define RW_FULL 0xFFFFFFFFu

/* Floats in an order-preserving u32 (-0 is made +0 first: equal scores tie on the index). */
static __device__ __forceinline__ uint32_t rw_ordered(float v)
{
    const uint32_t b = mf_f32_bits(v == 0.0f ? 0.0f : v);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

static __device__ __forceinline__ float rw_unordered(uint32_t o)
{
    return mf_bits_f32((o & 0x80000000u) ? o & 0x7FFFFFFFu : ~o);
}

/*
 * An expert's (or a group's) rank, larger first: bits 63-62 the tier (2 ranked, 1 unranked,
 * 0 not a candidate), 61-30 the ordered choice score (ranked only), 29-0 the complemented
 * index. The order of route_ahead in router.cu.
 */
static __device__ __forceinline__ uint64_t rw_key(bool candidate, bool bad, float c, int i)
{
    const uint32_t oc = bad ? 0u : rw_ordered(c), tier = bad ? 1u : 2u;
    const uint32_t hi = (tier << 30) | (oc >> 2), lo = (oc << 30) | (uint32_t)(0x3FFFFFFF - i);
    return candidate ? ((uint64_t)hi << 32) | lo : 0ull;
}

static __device__ __forceinline__ int rw_index(uint64_t key)
{
    return 0x3FFFFFFF - (int)(key & 0x3FFFFFFFull);
}

/* The warp's largest key: the high words' max, then the low words' of the lanes that hold it. */
static __device__ __forceinline__ uint64_t rw_warp_max(uint64_t k)
{
    const unsigned hi = (unsigned)(k >> 32), lo = (unsigned)k;
    const unsigned mh = __reduce_max_sync(RW_FULL, hi);
    const unsigned ml = __reduce_max_sync(RW_FULL, hi == mh ? lo : 0u);
    return ((uint64_t)mh << 32) | ml;
}

/* (a1, a2): the two largest ordered scores of a set (0: none), merged with another set's. */
static __device__ __forceinline__ void rw_top2_merge(uint32_t *a1, uint32_t *a2, uint32_t b1,
                                                     uint32_t b2)
{
    const uint32_t lo = *a1 < b1 ? *a1 : b1, second = *a2 > b2 ? *a2 : b2;
    *a1 = *a1 > b1 ? *a1 : b1;
    *a2 = lo > second ? lo : second;
}

/* A group's key from its two best ordered choice scores (step 4; a1 = 0: none ranked). */
static __device__ __forceinline__ uint64_t rw_group_key(const RouteParams &p, uint32_t a1,
                                                        uint32_t a2, int g)
{
    float score = rw_unordered(a1);
    if (p.group_scoring == MOEFUSE_GROUP_TOP2_SUM && a2 != 0u)
        score = __fadd_rn(score, rw_unordered(a2));
    return rw_key(true, a1 == 0u || mf_is_nan(score), score, g);
}

/* A group's two best by a scan of its choice scores c (NaN: unranked). */
static __device__ uint64_t rw_group_scan(const RouteParams &p, const float *c, int g, int per)
{
    uint32_t a1 = 0u, a2 = 0u;
#pragma unroll 1
    for (int i = g * per; i < (g + 1) * per; i++)
        rw_top2_merge(&a1, &a2, mf_is_nan(c[i]) ? 0u : rw_ordered(c[i]), 0u);
    return rw_group_key(p, a1, a2, g);
}

/* Element off + t * 32 + lane of a row of dtype dt for t < NV; NaN past E. The hardware's
   f16 conversion: exact, and a NaN's payload means nothing to a router. */
template <int NV>
static __device__ __forceinline__ void rw_load(const void *base, int dt, int64_t off, int lane,
                                               int E, float x[NV])
{
    if (dt == MF_DT_F32) {
        const float *q = (const float *)base + off;
#pragma unroll
        for (int t = 0; t < NV; t++)
            x[t] = t * 32 + lane < E ? __ldg(q + t * 32 + lane) : NAN;
    } else {
        const unsigned short *q = (const unsigned short *)base + off;
        const bool bf = dt == MF_DT_BF16;
#pragma unroll
        for (int t = 0; t < NV; t++) {
            const uint32_t h = t * 32 + lane < E ? __ldg(q + t * 32 + lane) : 0x7FC0u;
            x[t] = bf ? mf_bf16_to_f32(h) : __half2float(__ushort_as_half((unsigned short)h));
        }
    }
}

/*
 * s[j] = sigmoid(x[j]) = 1 / (1 + e^-x), 0 for NaN: the CPU's bits. For -40 < x < 86.5 without
 * a branch: the table exp (mf_exp_shared's fast path) and mf_div_fast(1, d), which
 * device_check.cu proves equal to IEEE division for d in [1, 2^60] (d <= 1 + e^40 here); so
 * the compiler can interleave the experts. Any other x (NaN, very negative, past the exp's
 * fast range) takes the general path after, one by one.
 */
/* sigmoid(x) = 1 / (1 + e^-x), 0 for NaN: the CPU's formula as written (every x). */
static __device__ __noinline__ float rw_sigmoid_general(float x)
{
    return mf_is_nan(x) ? 0.0f : __fdiv_rn(1.0f, __fadd_rn(1.0f, mf_exp_f32(-x)));
}

template <int N>
static __device__ __forceinline__ void rw_sigmoid(const float x[N], float s[N], uint32_t tabs)
{
    bool edge = false;
#pragma unroll
    for (int j = 0; j < N; j++) {
        const bool fast = x[j] > -40.0f && x[j] < MF_EXP_FAST_LIMIT;
        edge |= !fast;
        const float y = fast ? x[j] : 0.0f;
        s[j] = mf_div_fast(1.0f, __fadd_rn(1.0f, mf_exp_tab_fast(-y, tabs)));
    }
    if (edge) /* unrolled, so that x and s stay in registers; the general path is a call */
#pragma unroll
        for (int j = 0; j < N; j++)
            if (!(x[j] > -40.0f && x[j] < MF_EXP_FAST_LIMIT))
                s[j] = rw_sigmoid_general(x[j]);
}

/* topk_softmax's steps 1-2 over the k picked logits in w (an id of -1 counts as NaN). */
static __device__ void rw_softmax_k(const int32_t *ids, float *w, int k)
{
    bool any = false;
    float mx = -INFINITY;
#pragma unroll 1
    for (int j = 0; j < k; j++) {
        w[j] = ids[j] < 0 ? NAN : w[j];
        if (!mf_is_nan(w[j])) {
            mx = !any || w[j] > mx ? w[j] : mx;
            any = true;
        }
    }
    int cnt = 0;
#pragma unroll 1
    for (int j = 0; j < k; j++)
        cnt += w[j] == mx;
    const float share = any && !mf_is_finite(mx) ? __fdiv_rn(1.0f, (float)cnt) : 0.0f;
    float sum = 0.0f;
#pragma unroll 1
    for (int j = 0; j < k; j++) {
        if (!any)
            w[j] = 0.0f;
        else if (!mf_is_finite(mx))
            w[j] = w[j] == mx ? share : 0.0f;
        else
            w[j] = mf_is_nan(w[j]) ? 0.0f : mf_exp_f32(__fsub_rn(w[j], mx));
        sum = __fadd_rn(sum, w[j]);
    }
    if (any && mf_is_finite(mx))
#pragma unroll 1
        for (int j = 0; j < k; j++)
            w[j] = __fdiv_rn(w[j], sum);
}

/*
 * Steps 7-8 with the picks in lanes: lane sub of a row's lanes (the first at warp lane first)
 * holds pick sub's id and score wj (sub < K, K at most the row's lanes). The renormalisation's
 * sum takes them by shuffles in pick order; then the scale, and each live pick's stores.
 */
static __device__ __forceinline__ void rw_weigh_lanes(const RouteParams &p, int64_t m, int sub,
                                                      int first, bool live, int32_t id, float wj,
                                                      int K)
{
    float sum = 0.0f;
    if (p.renorm)
#pragma unroll 8
        for (int j = 0; j < K; j++)
            sum = __fadd_rn(sum, __shfl_sync(RW_FULL, wj, first | j));
    if (live && sub < K) {
        if (p.renorm && sum > 0.0f)
            wj = __fdiv_rn(wj, sum);
        if (p.scale != 1.0f)
            wj = __fmul_rn(wj, p.scale);
        p.ids[m * p.is0 + sub] = id;
        p.w[m * p.ws0 + sub] = wj;
    }
}

/*
 * Steps 6-8 for row m on the LANES lanes of a row (lane sub of them, the first at warp lane
 * first), once ids[0..K) hold the picks (-1: none) and w[0..K) their scores s, in shared
 * memory: the softmax over the k (TOPK_SOFTMAX), the renormalisation and the scale, sums in
 * pick order (by shuffles when k <= LANES without the softmax, else on the row's first lane);
 * then the stores, where live. Every lane of the warp calls it (its rows together).
 */
template <int LANES>
static __device__ void rw_store_picks(const RouteParams &p, int64_t m, int sub, int first,
                                      bool live, const int32_t *ids, float *w, int K)
{
    if (K <= LANES && p.scoring != MOEFUSE_ROUTER_TOPK_SOFTMAX) {
        /* lane sub holds pick sub: the loads at once, then the sum by shuffles (a chain of
           shared loads on one lane was a tenth of the lanes kernel's stalls, Nsight Compute,
           DeepSeek-V3 M = 4096) */
        rw_weigh_lanes(p, m, sub, first, live, sub < K ? ids[sub] : -1, sub < K ? w[sub] : 0.0f,
                       K);
        return;
    }
    if (sub == 0 && p.scoring == MOEFUSE_ROUTER_TOPK_SOFTMAX)
        rw_softmax_k(ids, w, K);
    float sum = 0.0f;
    if (sub == 0 && p.renorm)
#pragma unroll 1
        for (int j = 0; j < K; j++)
            sum = __fadd_rn(sum, w[j]);
    __syncwarp(); /* the first lane's writes of w before the other lanes read them */
    sum = __shfl_sync(RW_FULL, sum, first);
    if (!live)
        return;
#pragma unroll 1
    for (int j = sub; j < K; j += LANES) {
        float wj = w[j];
        if (p.renorm && sum > 0.0f)
            wj = __fdiv_rn(wj, sum);
        if (p.scale != 1.0f)
            wj = __fmul_rn(wj, p.scale);
        p.ids[m * p.is0 + j] = ids[j];
        p.w[m * p.ws0 + j] = wj;
    }
}

/*
 * Steps 6-8 for row m on one warp, once ids[0..K) hold the picks in shared memory, sv the
 * row's scores: up to 32 picks without the softmax over the k, lane j holds pick j and the sum
 * gathers them by shuffles; otherwise w (K floats of shared memory the warp may overwrite)
 * takes the picks' scores for rw_store_picks.
 */
static __device__ void rw_finish(const RouteParams &p, int64_t m, int lane, const int32_t *ids,
                                 float *w, const float *sv, int K)
{
    if (K <= 32 && p.scoring != MOEFUSE_ROUTER_TOPK_SOFTMAX) {
        const int32_t id = lane < K ? ids[lane] : -1;
        rw_weigh_lanes(p, m, lane, 0, true, id, id >= 0 ? sv[id] : 0.0f, K);
        return;
    }
#pragma unroll 1
    for (int j = lane; j < K; j += 32)
        w[j] = ids[j] >= 0 ? sv[ids[j]] : 0.0f;
    __syncwarp();
    rw_store_picks<32>(p, m, lane, 0, true, ids, w, K);
}

#endif
