/*
 * topk_softmax of the CUDA backend (src/cpu/topk.c, docs/NUMERICS.md), in two kernels:
 * mf_k_topk_rows for the routers of MoE models (E <= 256, k <= 32; described at it) and
 * mf_k_topk for any other E and k: one warp per token, lane l holding logits l, l + 32, ...
 * (in registers up to E = 256, else read again from memory: every value is recomputed by the
 * same expression, so the bits do not change). Both sum the softmax denominator in index
 * order i = 0..E-1, as the CPU does; mf_k_topk broadcasts each value with a shuffle, every
 * lane computing the same sum.
 *
 * mf_k_topk's ranking: numbers before NaN, then p descending, then the lower id. It is a
 * strict total order, packed into a 64-bit key (larger ranks first):
 * bit 62 = not NaN, bits 61..31 = the bits of p (p >= 0, so they order as
 * p does), bits 30..0 = 2^31 - 1 - id. Pick j is the largest key below pick
 * j - 1's, so nothing needs marking as taken.
 */
#include "cuda/cuda_internal.h"
#include "cuda/numerics.cuh"
#include "cuda/pdl.cuh"
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

/* Both kernels' copy of that table to shared memory, published to the block. */
static __device__ __forceinline__ void load_exp_table(float *tab)
{
    if (threadIdx.x < 64)
        tab[threadIdx.x] = mf_c_topk_exp_tab[threadIdx.x];
    __syncthreads();
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
    __shared__ __align__(8) float tab[64]; /* read as pairs (ld.shared.v2) */
    load_exp_table(tab);
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
                    x = mf_is_nan(v) ? 0.0f : mf_exp_shared(v - mx, tabs);
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
                    const float e = mode == 2 && !mf_is_nan(v) ? mf_exp_shared(v - mx, tabs) : 0.0f;
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

/*
 * E <= 256 and k <= 32, the routers of MoE models: a block takes a few rows, a warp per
 * row, lane l holding logits 8l..8l+7 (one 16-byte load of bf16), so that lane order is id
 * order. Three phases per row:
 *  - exps: e = exp(l - max) (in the +-Inf case e is 1 for the maxima and 0 else, and the
 *    "sum" is their count, so p = e / sum gives the shares too);
 *  - the index-order sum, a chain of E dependent additions: the warps leave their exps in
 *    shared memory and lane r of warp 0 sums row r, so a block's chains run side by side;
 *  - the picks. p = RN(e / sum) never decreases with e, so only candidates near the top by
 *    e can rank among the k best by p: the k-th largest of the lanes' best e is a floor
 *    that at least k candidates reach, and every candidate whose p can reach the floor's p
 *    is within a few ulps of it in e. Those few candidates (one per lane) get their p
 *    divided out and are sorted across the warp by p, then id: lane j holds pick j. More
 *    than 32 of them (wide ties, rows of NaN, a floor so small that p is subnormal) take
 *    every candidate instead, picked one by one.
 * The floor and the picks are warp sorts (15 shuffle steps each), not k rounds of
 * reductions; at small M the call is one row's latency.
 */
#define TKR_ROWS 8 /* rows per block for large M */
#define TKR_E 256
/* floats per row of exps: lanes 0..7 read 16 bytes each without a bank conflict */
#define TKR_STRIDE (TKR_E + 4)

/* A candidate's rank key, larger first (equal keys: lower id first): 0 = past E or already
 * picked, 1 = NaN logit (p = 0, after every number), 2 + bits(x) for a number with p or e
 * = x in [0, 1] (bits order as values do there). */
static __device__ __forceinline__ uint32_t number_key(float x) { return 2u + mf_f32_bits(x); }
static __device__ __forceinline__ float key_value(uint32_t key)
{
    return key >= 2u ? mf_bits_f32(key - 2u) : 0.0f;
}

/* Floats in an order-preserving u32 (0 is below -Inf: NaN and absent logits map there). */
static __device__ __forceinline__ uint32_t ordered(float v)
{
    const uint32_t b = mf_f32_bits(v);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
static __device__ __forceinline__ float unordered(uint32_t o)
{
    return mf_bits_f32((o & 0x80000000u) ? o & 0x7FFFFFFFu : ~o);
}

/* The key of p = e / sum for an e-key. */
static __device__ __forceinline__ uint32_t p_key(uint32_t ekey, float sum)
{
    return ekey >= 2u ? number_key(key_value(ekey) / sum) : ekey;
}

/* The largest key of a lane and its lowest c among equals. */
static __device__ __forceinline__ void lane_best(const uint32_t key[8], uint32_t *best, int *at)
{
    uint32_t b = key[7];
    int c0 = 7;
#pragma unroll
    for (int c = 6; c >= 0; c--) {
        const bool ge = key[c] >= b;
        b = ge ? key[c] : b;
        c0 = ge ? c : c0;
    }
    *best = b;
    *at = c0;
}

/* Pick j's id and weight go to lane j (k <= 32); wsum adds the weights in pick order. */
static __device__ __forceinline__ void record_pick(int lane, int j, int32_t id, float pw,
                                                   int32_t *my_id, float *my_w, float *wsum)
{
    *wsum = *wsum + pw;
    if (lane == j) {
        *my_id = id;
        *my_w = pw;
    }
}

/* Bitonic sort of one value per lane across the warp, largest at lane 0 (T: 32 or 64 bits). */
template <typename T>
static __device__ __forceinline__ T warp_sort_desc(T x, int lane)
{
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1)
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            const T o = __shfl_xor_sync(TK_FULL, x, j);
            /* the lower lane of a pair keeps the larger in blocks sorted downwards */
            const bool keep_max = ((lane & j) == 0) == ((lane & k) == 0);
            x = (o > x) == keep_max ? o : x;
        }
    return x;
}

/* FULL: E = 256, every lane holds 8 logits (the checks of "past E" fold away). ROWS: rows
 * (warps) per block, at least 2 (64 threads copy the exp table); few rows, few blocks per SM:
 * small M spreads over more SMs, where warps of a block would only wait on each other. */
template <int FULL, int ROWS>
__global__ void __launch_bounds__(ROWS * 32, 4) mf_k_topk_rows(topk_params p)
{
    __shared__ __align__(8) float tab[64]; /* read as pairs (ld.shared.v2) */
    __shared__ __align__(16) float ex[ROWS][TKR_STRIDE];
    __shared__ float sums[ROWS];
    __shared__ uint2 cand[ROWS][32]; /* a warp's candidates: {e-key, id} in id order */
    load_exp_table(tab);
    mf_pdl_wait(); /* the logits may come from the kernel before */
    const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(tab);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t i0 = (int64_t)lane * 8;
    const int n = FULL || p.E - i0 >= 8 ? 8 : p.E > i0 ? (int)(p.E - i0) : 0; /* this lane's */
    /* the loop is uniform over the block: it syncs */
    for (int64_t m0 = (int64_t)blockIdx.x * ROWS; m0 < p.M; m0 += (int64_t)gridDim.x * ROWS) {
        const int64_t m = m0 + warp;
        const bool live = m < p.M; /* uniform over the warp */
        float v[8], e[8];
        int mode = 0; /* 0: no number, 1: +-Inf maximum (shares), 2: softmax */
        float msum = 0.0f; /* the sum of mode 1: the count of maxima */
#pragma unroll
        for (int c = 0; c < 8; c++)
            e[c] = 0.0f;
        if (live) {
            const char *row = p.l + m * p.ls0 * p.les;
            load8(row, i0, p.ldt, ((uintptr_t)row & 15) == 0, n, v);
            /* the largest number; its order does not matter (+0 and -0 give the same
             * exp(l - mx)) */
            uint32_t om = 0;
#pragma unroll
            for (int c = 0; c < 8; c++)
                om = max(om, c < n && !mf_is_nan(v[c]) ? ordered(v[c]) : 0u);
            om = __reduce_max_sync(TK_FULL, om);
            const float mx = unordered(om);
            if (om != 0 && mf_is_finite(mx)) {
                mode = 2;
                float x[8];
                int slow = 0;
#pragma unroll
                for (int c = 0; c < 8; c++) {
                    x[c] = c < n && !mf_is_nan(v[c]) ? v[c] - mx : 0.0f;
                    slow |= !(fabsf(x[c]) < MF_EXP_FAST_LIMIT);
                    e[c] = mf_exp_tab_fast(x[c], tabs);
                }
                if (__any_sync(TK_FULL, slow)) { /* differences beyond -86.5: rare */
#pragma unroll
                    for (int c = 0; c < 8; c++)
                        if (!(fabsf(x[c]) < MF_EXP_FAST_LIMIT))
                            e[c] = mf_exp_f32(x[c]);
                }
#pragma unroll
                for (int c = 0; c < 8; c++)
                    e[c] = c < n && !mf_is_nan(v[c]) ? e[c] : 0.0f;
            } else if (om != 0) { /* every +Inf (or, when all numbers are -Inf, every number) */
                mode = 1;
                unsigned cnt = 0;
#pragma unroll
                for (int c = 0; c < 8; c++) {
                    e[c] = c < n && v[c] == mx ? 1.0f : 0.0f;
                    cnt += c < n && v[c] == mx;
                }
                msum = (float)__reduce_add_sync(TK_FULL, cnt);
            }
        }
        if (n == 8) {
            float4 *dst = (float4 *)&ex[warp][i0];
            dst[0] = make_float4(e[0], e[1], e[2], e[3]);
            dst[1] = make_float4(e[4], e[5], e[6], e[7]);
        } else {
#pragma unroll
            for (int c = 0; c < 8; c++)
                if (c < n)
                    ex[warp][i0 + c] = e[c];
        }
        __syncthreads();
        if (warp == 0 && lane < ROWS && m0 + lane < p.M) {
            /* sum = e_0 + e_1 + ... + e_{E-1}, in index order (NaN logits add +0) */
            const float *r = ex[lane];
            const int64_t E = FULL ? TKR_E : p.E;
            float sum = 0.0f;
            int64_t i = 0;
            if (E >= 16) { /* 16 terms in flight: the next ones load while these add */
                float4 q[4], nq[4];
#pragma unroll
                for (int b = 0; b < 4; b++)
                    q[b] = *(const float4 *)(r + 4 * b);
                for (i = 16;; i += 16) {
                    const bool more = i + 16 <= E;
#pragma unroll
                    for (int b = 0; b < 4; b++)
                        nq[b] = more ? *(const float4 *)(r + i + 4 * b) : q[b];
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        sum = sum + q[b].x;
                        sum = sum + q[b].y;
                        sum = sum + q[b].z;
                        sum = sum + q[b].w;
                    }
                    if (!more)
                        break;
#pragma unroll
                    for (int b = 0; b < 4; b++)
                        q[b] = nq[b];
                }
            }
            for (; i < E; i++)
                sum = sum + r[i];
            sums[lane] = sum;
        }
        __syncthreads(); /* the next row's exps are written only after every sum is read */
        if (!live)
            continue;
        const float sum = mode == 2 ? sums[warp] : msum;
        uint32_t ekey[8];
#pragma unroll
        for (int c = 0; c < 8; c++)
            ekey[c] = c >= n ? 0u : mf_is_nan(v[c]) ? 1u : number_key(e[c]);
        /* the floor: the k-th largest of the lanes' best e-keys */
        uint32_t lbest = 0;
#pragma unroll
        for (int c = 0; c < 8; c++)
            lbest = max(lbest, ekey[c]);
        const uint32_t sorted = warp_sort_desc<uint32_t>(lbest, lane);
        const uint32_t floor_key = __shfl_sync(TK_FULL, sorted, (int)p.k - 1);
        /* a p equal to the floor's lies within 2 ulps of it in e (4 below a power of 2) while
         * the quotients are normal, so the floor less 16 ulps is safe; a floor below 2^-100
         * (its p may be subnormal: coarser steps) takes every number */
        const uint32_t thr = floor_key < 2u                       ? 1u
                             : floor_key < number_key(0x1p-100f) ? 2u
                                                                 : floor_key - 16u;
        /* candidate (lane, c) goes to slot: the candidates of the lanes below, then its own
         * below c (one ballot per c: no chain of shuffles) */
        const unsigned below = (1u << lane) - 1u;
        unsigned total = 0, pos = 0;
#pragma unroll
        for (int c = 0; c < 8; c++) {
            const unsigned b = __ballot_sync(TK_FULL, ekey[c] >= thr);
            total += __popc(b);
            pos += __popc(b & below);
        }
        int32_t my_id = 0;
        float my_w = 0.0f, wsum = 0.0f;
        if (total <= 32) {
#pragma unroll
            for (int c = 0; c < 8; c++)
                if (ekey[c] >= thr)
                    cand[warp][pos++] = make_uint2(ekey[c], (uint32_t)(i0 + c));
            __syncwarp();
            const uint2 cd = lane < (int)total ? cand[warp][lane] : make_uint2(0u, 0u);
            __syncwarp(); /* read before a later row of this warp writes again */
            /* sorted by p, then id: lane j holds pick j (empty slots, key 0, sort last) */
            const uint64_t top = warp_sort_desc<uint64_t>(
                ((uint64_t)p_key(cd.x, sum) << 32) | (uint64_t)(0xFFFFFFFFu - cd.y), lane);
            my_id = (int32_t)(0xFFFFFFFFu - (uint32_t)top);
            my_w = key_value((uint32_t)(top >> 32));
            for (int j = 0; j < (int)p.k; j++) /* in pick order j = 0..k-1, as the CPU */
                wsum = wsum + __shfl_sync(TK_FULL, my_w, j);
        } else { /* every candidate, each lane keeping its best: the winner looks again */
            uint32_t key[8];
#pragma unroll
            for (int c = 0; c < 8; c++)
                key[c] = p_key(ekey[c], sum);
            uint32_t best;
            int at;
            lane_best(key, &best, &at);
            for (int j = 0; j < (int)p.k; j++) {
                const uint32_t top = __reduce_max_sync(TK_FULL, best);
                const int wl = __ffs(__ballot_sync(TK_FULL, best == top)) - 1; /* lowest id */
                const int wc = __shfl_sync(TK_FULL, at, wl);
                record_pick(lane, j, wl * 8 + wc, key_value(top), &my_id, &my_w, &wsum);
                if (lane == wl) {
#pragma unroll
                    for (int c = 0; c < 8; c++)
                        key[c] = c == wc ? 0u : key[c];
                    lane_best(key, &best, &at);
                }
            }
        }
        if (lane < p.k) {
            if (p.renorm && wsum > 0.0f)
                my_w = my_w / wsum;
            p.ids[m * p.is0 + lane] = my_id;
            p.w[m * p.ws0 + lane] = my_w;
        }
    }
    mf_pdl_trigger();
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
    if (p.E <= TKR_E && p.k <= 32) {
        const bool full = p.E == TKR_E;
        if (p.M <= 2 * (int64_t)s->sm_count) { /* a block of 2 rows on each SM */
            const unsigned grid = mf_cuda_grid(s, p.M, 2, 1);
            mf_launch_pdl(full ? mf_k_topk_rows<1, 2> : mf_k_topk_rows<0, 2>, dim3(grid), 64, 0,
                          s->stream, s->pdl, p);
        } else {
            const unsigned grid = mf_cuda_grid(s, p.M, TKR_ROWS, 2048 / (TKR_ROWS * 32));
            mf_launch_pdl(full ? mf_k_topk_rows<1, TKR_ROWS> : mf_k_topk_rows<0, TKR_ROWS>,
                          dim3(grid), TKR_ROWS * 32, 0, s->stream, s->pdl, p);
        }
        return mf_cuda_launched(ctx, "topk_softmax", "mf_k_topk_rows");
    }
    const unsigned grid = mf_cuda_grid(s, p.M, TK_WARPS, 16);
    mf_k_topk<<<grid, TK_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "topk_softmax", "mf_k_topk");
}
