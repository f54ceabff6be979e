/*
 * Expert parallelism's low-latency steps on the GPU (src/core/backend.h, mf_ep_ll_args; the
 * blocks as ep/ep_ll_wire.h lays them out). The same bytes as the CPU's (src/cpu/ep_ll.c):
 * rows copied, scales decoded and encoded exactly, each sum's products and additions one
 * rounding each in a fixed order. Nothing here waits for the host, so the steps can be
 * captured in a graph; counts and indices from other ranks are clamped before use.
 *   pack:    a warp a token: its row in each rank's block numbered and copied there
 *   place:   a block a local expert numbers its slots in order (one scan a rank's block), then
 *            its warps copy the rows, every rank's at once
 *   partial: LL_KSPLIT blocks a received row sum its slots' outputs, 8 columns a thread
 *   sum:     LL_KSPLIT blocks a token sum what the ranks sent back, in rank order
 * Each step reads its rows' places once (into shared memory or a warp's registers) and moves
 * 16-byte vectors with several loads in flight: docs/PERFORMANCE.md has the profiles.
 */
#include "cuda/cuda_internal.h"
#include "cuda/ep_rows.cuh"

#include <string.h>

#define LL_WARPS (EP_THREADS / 32)

/* Exclusive prefix of v over the block's threads; *total gets the block's sum. Every thread
   calls it. */
static __device__ __forceinline__ int64_t ll_block_scan(int64_t v, int64_t *total,
                                                          int64_t *warp_sums)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int64_t incl = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int64_t u = __shfl_up_sync(0xffffffffu, incl, d);
        incl += lane >= d ? u : 0;
    }
    __syncthreads(); /* warp_sums is free */
    if (lane == 31)
        warp_sums[warp] = incl;
    __syncthreads();
    int64_t base = 0, sum = 0;
    for (int w = 0; w < LL_WARPS; w++) {
        base += w < warp ? warp_sums[w] : 0;
        sum += warp_sums[w];
    }
    *total = sum;
    return base + incl - v;
}

/* n bytes from src to dst by one warp: 16 at a time where both and n allow. */
static __device__ __forceinline__ void ll_warp_copy(char *dst, const char *src, int64_t n)
{
    const int lane = threadIdx.x & 31;
    if ((((uintptr_t)dst | (uintptr_t)src | (uintptr_t)n) & 15u) == 0) {
        /* four loads in flight a lane before their stores: one at a time, a 7 KB row took
           14 round trips to memory */
        const int64_t nv = n / 16;
        int64_t v = lane;
        for (; v + 96 < nv; v += 128) {
            uint4 r[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                r[u] = ((const uint4 *)src)[v + 32 * u];
#pragma unroll
            for (int u = 0; u < 4; u++)
                ((uint4 *)dst)[v + 32 * u] = r[u];
        }
        for (; v < nv; v += 32)
            ((uint4 *)dst)[v] = ((const uint4 *)src)[v];
        return;
    }
    for (int64_t b = lane; b < n; b += 32)
        dst[b] = src[b];
}

typedef struct LlPack {
    mf_ep_ll_wire w;
    int W;
    int64_t M, K, groups;
    const char *x;             /* [1, M, K] rows (x's or FP8 codes) */
    int64_t x1;                /* element stride of m */
    int xes;                   /* element size */
    EpScales xs;               /* FP8: [1, M, G] */
    const char *ids, *weights; /* [M, k] i32, f32 */
    int64_t i0, i1, w0, w1;    /* element strides */
    const int32_t *owner, *local;
    int32_t E;
    char *send;
    int32_t *pos;              /* [C, W] */
} LlPack;

#define LL_SMEM_EXPERTS 2048 /* placements pack keeps in shared memory; more: read as it goes */

/* Whether token m has a valid slot on rank p: its k ids' loads issued together. */
static __device__ __forceinline__ bool ll_has_slot(const LlPack &a, const int32_t *owner,
                                                   int64_t m, int p)
{
    bool here = false;
    for (int64_t j0 = 0; j0 < a.w.topk; j0 += 8) {
        int32_t g[8];
#pragma unroll
        for (int u = 0; u < 8; u++)
            g[u] = j0 + u < a.w.topk ? *(const int32_t *)(a.ids + (m * a.i0 + (j0 + u) * a.i1) * 4)
                                     : -1;
#pragma unroll
        for (int u = 0; u < 8; u++)
            here |= g[u] >= 0 && g[u] < a.E && owner[g[u]] == p;
    }
    return here;
}

/*
 * Block (c, p), a warp a token of chunk c: the tokens with a slot on rank p, in token order,
 * get rows 0, 1, ... of block p. The block's threads count such tokens before its chunk (a
 * thread a token), the chunk's are numbered after them, and each warp writes its token's meta
 * and copies its row (codes and scales); pos records each token's row. The last chunk's block
 * writes the count.
 */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_ll_pack(const LlPack a)
{
    __shared__ int32_t s_owner[LL_SMEM_EXPERTS], s_local[LL_SMEM_EXPERTS];
    __shared__ int64_t warp_sums[LL_WARPS];
    __shared__ int chunk_flag[LL_WARPS];
    const int p = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t m0 = (int64_t)blockIdx.x * LL_WARPS, m = m0 + warp, k = a.w.topk;
    const bool cached = a.E <= LL_SMEM_EXPERTS;
    if (cached)
        for (int g = threadIdx.x; g < a.E; g += EP_THREADS) {
            s_owner[g] = a.owner[g];
            s_local[g] = a.local[g];
        }
    __syncthreads();
    const int32_t *owner = cached ? s_owner : a.owner, *local = cached ? s_local : a.local;
    int64_t mine = 0; /* tokens before the chunk with a slot here */
    for (int64_t q = threadIdx.x; q < m0; q += EP_THREADS)
        mine += ll_has_slot(a, owner, q, p);
    if (threadIdx.x < LL_WARPS)
        chunk_flag[threadIdx.x] = m0 + threadIdx.x < a.M && ll_has_slot(a, owner,
                                                                         m0 + threadIdx.x, p);
    int64_t before; /* the scan's total: the tokens before the chunk (the prefixes unused) */
    ll_block_scan(mine, &before, warp_sums); /* its barriers publish chunk_flag too */
    const bool flag = chunk_flag[warp];
    int64_t i = before;
    for (int w = 0; w < warp; w++)
        i += chunk_flag[w];
    const mf_ep_ll_block b = mf_ep_ll_block_at(&a.w, a.send, p);
    if (m < a.M && lane == 0)
        a.pos[m * a.W + p] = flag ? (int32_t)i : -1;
    if (flag) {
        if (lane == 0)
            b.token[i] = (int32_t)m;
        for (int64_t j = lane; j < k; j += 32) {
            const int32_t g = *(const int32_t *)(a.ids + (m * a.i0 + j * a.i1) * 4);
            const bool here = g >= 0 && g < a.E && owner[g] == p;
            b.expert[i * k + j] = here ? local[g] : -1;
            b.weight[i * k + j] = *(const float *)(a.weights + (m * a.w0 + j * a.w1) * 4);
        }
        char *row = b.rows + a.w.row_bytes * (size_t)i;
        ll_warp_copy(row, a.x + m * a.x1 * a.xes, a.K * a.xes);
        for (int64_t g = lane; g < a.groups; g += 32) {
            const float v = ep_scale_read(a.xs, 0, m, g);
            memcpy(row + a.K + g * 4, &v, 4);
        }
    }
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {
        int64_t n = before;
        for (int w = 0; w < LL_WARPS; w++)
            n += chunk_flag[w];
        *b.count = (int32_t)n;
    }
}

typedef struct LlPlace {
    mf_ep_ll_wire w;
    int W, rank;
    const char *own;           /* this rank's block to itself (in the send blocks) */
    int64_t K, T, groups;
    const char *recv;
    char *rx;                  /* recv_x [E, T, K] */
    int64_t r0, r1;
    int res;                   /* element size */
    EpScales rs;               /* FP8: rank 3 in its layout */
    int64_t inner, ta;         /* rs's middle extent and padded rows (col-major, packed) */
    int32_t *counts;           /* [E] */
    int64_t c0;
    int32_t *row_of;           /* [W, C, k] */
} LlPlace;

/* Row t of expert e, by one warp: the received row's codes and its scales, whole packed words
   at once (a row owns its words: 4 groups of one row), so no byte of them is left stale. */
static __device__ void ll_put_row(const LlPlace &a, int64_t e, int64_t t, const char *src)
{
    const int lane = threadIdx.x & 31;
    ll_warp_copy(a.rx + (e * a.r0 + t * a.r1) * a.res, src, a.K * a.res);
    if (a.groups == 0)
        return;
    if (a.rs.layout == MF_LAYOUT_PACKED) {
        for (int64_t w = lane; w < (a.groups + 3) / 4; w += 32) {
            uint32_t word = 0;
            for (int64_t q = 0; q < 4 && 4 * w + q < a.groups; q++) {
                float v;
                memcpy(&v, src + a.K + (4 * w + q) * 4, 4);
                word |= (uint32_t)ep_exponent_of(v) << (8 * q);
            }
            *(uint32_t *)(a.rs.sc + (e * a.rs.s0 + w * a.rs.s1 + t * a.rs.s2) * 4) = word;
        }
        return;
    }
    for (int64_t g = lane; g < a.groups; g += 32) {
        float v;
        memcpy(&v, src + a.K + g * 4, 4);
        char *q = ep_scale_at(a.rs, e, t, g);
        if (a.rs.sdt == MF_DT_F32)
            *(float *)q = v;
        else
            *(uint8_t *)q = ep_exponent_of(v);
    }
}

#define LL_LIST 1024 /* kept rows a place block lists for its copies; more: found again */

/*
 * Block e: expert e's slots in block order (p, then i, then j) become its rows 0, 1, ...
 * First the numbers, one scan a rank's block: a thread counts the slots of e in its run of
 * entries, the block numbers them, row_of records each slot's row (or -2 past Tmax), and the
 * first LL_LIST rows kept are listed. Then the warps copy the listed rows, every rank's at
 * once (any further rows are found again in row_of). Then the layout's padding rows T .. Ta - 1
 * are zeroed and the count written.
 */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_ll_place(const LlPlace a)
{
    __shared__ int64_t warp_sums[LL_WARPS];
    __shared__ const char *list[LL_LIST]; /* row t's source */
    const int64_t e = blockIdx.x, k = a.w.topk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int64_t t0 = 0;
    for (int p = 0; p < a.W; p++) {
        const mf_ep_ll_block b = mf_ep_ll_block_at(&a.w, p == a.rank ? a.own : a.recv, p);
        const int64_t slots = mf_ep_ll_rows_in(&a.w, &b) * k;
        const int64_t run = (slots + EP_THREADS - 1) / EP_THREADS;
        const int64_t q0 = threadIdx.x * run, q1 = q0 + run < slots ? q0 + run : slots;
        int64_t mine = 0;
        for (int64_t q = q0; q < q1; q++)
            mine += b.expert[q] == e;
        int64_t total;
        int64_t t = t0 + ll_block_scan(mine, &total, warp_sums);
        for (int64_t q = q0; q < q1; q++)
            if (b.expert[q] == e) {
                a.row_of[(int64_t)p * a.w.cap * k + q] = t < a.T ? (int32_t)t : -2;
                if (t < a.T && t < LL_LIST)
                    list[t] = b.rows + a.w.row_bytes * (size_t)(q / k);
                t++;
            }
        t0 += total;
    }
    __syncthreads();
    const int64_t kept = t0 < a.T ? t0 : a.T;
    for (int64_t t = warp; t < kept && t < LL_LIST; t += LL_WARPS)
        ll_put_row(a, e, t, list[t]);
    for (int p = 0; kept > LL_LIST && p < a.W; p++) { /* rows past the list: found again */
        const mf_ep_ll_block b = mf_ep_ll_block_at(&a.w, p == a.rank ? a.own : a.recv, p);
        const int64_t slots = mf_ep_ll_rows_in(&a.w, &b) * k;
        const int32_t *row_of = a.row_of + (int64_t)p * a.w.cap * k;
        for (int64_t q0 = 32 * (int64_t)warp; q0 < slots; q0 += 32 * LL_WARPS) {
            const int64_t q = q0 + lane;
            const bool more = q < slots && b.expert[q] == e && row_of[q] >= LL_LIST;
            for (unsigned bits = __ballot_sync(0xffffffffu, more); bits; bits &= bits - 1) {
                const int64_t qq = q0 + __ffs(bits) - 1;
                ll_put_row(a, e, row_of[qq], b.rows + a.w.row_bytes * (size_t)(qq / k));
            }
        }
    }
    if (a.groups > 0 && a.rs.layout != MF_LAYOUT_ROW && a.ta > a.T) {
        const int64_t es = a.rs.sdt == MF_DT_U8 ? 1 : 4;
        for (int64_t v = threadIdx.x; v < a.inner * (a.ta - a.T); v += EP_THREADS) {
            const int64_t w = v / (a.ta - a.T), t = a.T + v % (a.ta - a.T);
            char *z = a.rs.sc + (e * a.rs.s0 + w * a.rs.s1 + t * a.rs.s2) * es;
            for (int64_t byte = 0; byte < es; byte++)
                z[byte] = 0;
        }
    }
    if (threadIdx.x == 0)
        a.counts[e * a.c0] = (int32_t)(t0 < 0x7fffffff ? t0 : 0x7fffffff);
}

typedef struct LlCombine {
    mf_ep_ll_wire w;
    int W, rank;
    const char *own;           /* this rank's block to itself (in the send blocks) */
    int64_t M, K;
    const char *recv;
    const int32_t *row_of, *pos;
    const char *y;             /* [E, T, K] */
    int64_t y0, y1, E, T;
    int ydt;
    float *partial;
    const float *back;
    char *out;
    int64_t o0;
    int odt;
    int vec;                   /* rows 16-byte aligned and K % 8 == 0: vectors of 8 (4) */
} LlCombine;

#define LL_MAX_SLOTS 64 /* slots (ranks) a block keeps in shared memory; more: the plain loop */

#define LL_KSPLIT 4 /* blocks sharing a row's columns in partial and sum: more loads in flight */

/* Columns [*c0, *c1) of block z of LL_KSPLIT: multiples of 8 apart. */
static __device__ __forceinline__ void ll_columns(int64_t K, int64_t *c0, int64_t *c1)
{
    const int64_t part = ((K + LL_KSPLIT - 1) / LL_KSPLIT + 7) / 8 * 8;
    *c0 = part * blockIdx.z < K ? part * blockIdx.z : K;
    *c1 = *c0 + part < K ? *c0 + part : K;
}

/* Block (i, p, z): columns z of row i of rank p's block, the sum of its slots' outputs here,
   in slot order, each product and sum rounded once. Warp 0 lists the slots (rows, weights)
   in shared memory, its lanes loading them together. */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_ll_partial(const LlCombine a)
{
    __shared__ const char *slot_row[LL_MAX_SLOTS]; /* NULL: lost past Tmax */
    __shared__ float slot_w[LL_MAX_SLOTS];
    __shared__ int slots;
    const int64_t i = blockIdx.x, k = a.w.topk;
    const int p = blockIdx.y, lane = threadIdx.x & 31;
    const mf_ep_ll_block b = mf_ep_ll_block_at(&a.w, p == a.rank ? a.own : a.recv, p);
    if (i >= mf_ep_ll_rows_in(&a.w, &b))
        return;
    const int ysz = a.ydt == MF_DT_F32 ? 4 : 2;
    float *dst = a.partial + ((int64_t)p * a.w.cap + i) * a.K;
    int64_t cb, ce;
    ll_columns(a.K, &cb, &ce);
    if (k <= LL_MAX_SLOTS) {
        if (threadIdx.x < 32) {
            int n = 0;
            for (int64_t j0 = 0; j0 < k; j0 += 32) {
                const int64_t j = j0 + lane;
                const int32_t e = j < k ? b.expert[i * k + j] : -1;
                const bool valid = e >= 0 && e < a.E;
                const int32_t t = valid ? a.row_of[((int64_t)p * a.w.cap + i) * k + j] : -1;
                const int at = ep_warp_place(valid, lane, &n);
                if (valid) {
                    slot_row[at] = t >= 0 && t < a.T ? a.y + (e * a.y0 + t * a.y1) * ysz : NULL;
                    slot_w[at] = b.weight[i * k + j];
                }
            }
            if (lane == 0)
                slots = n;
        }
        __syncthreads();
        if (a.vec) {
            for (int64_t c = cb + 8 * threadIdx.x; c < ce; c += 8 * EP_THREADS) {
                float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                for (int s0 = 0; s0 < slots; s0 += 4) { /* four slots' loads in flight */
                    float v[4][8];
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        if (s0 + u < slots && slot_row[s0 + u])
                            load8(slot_row[s0 + u], c, a.ydt, 1, 8, v[u]);
                        else
                            for (int q = 0; q < 8; q++)
                                v[u][q] = __int_as_float(0x7fc00000);
                    }
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        if (s0 + u < slots)
#pragma unroll
                            for (int q = 0; q < 8; q++)
                                acc[q] = __fadd_rn(acc[q], __fmul_rn(slot_w[s0 + u], v[u][q]));
                }
                *(float4 *)(dst + c) = make_float4(acc[0], acc[1], acc[2], acc[3]);
                *(float4 *)(dst + c + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
            }
            return;
        }
        for (int64_t c = cb + threadIdx.x; c < ce; c += EP_THREADS) {
            float acc = 0.0f;
            for (int s = 0; s < slots; s++) {
                const float v = slot_row[s] ? load_elem(slot_row[s], c, a.ydt)
                                            : __int_as_float(0x7fc00000);
                acc = __fadd_rn(acc, __fmul_rn(slot_w[s], v));
            }
            dst[c] = acc;
        }
        return;
    }
    for (int64_t c = cb + threadIdx.x; c < ce; c += EP_THREADS) { /* many slots: as we go */
        float acc = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const int32_t e = b.expert[i * k + j];
            if (e < 0 || e >= a.E)
                continue;
            const int32_t t = a.row_of[((int64_t)p * a.w.cap + i) * k + j];
            const float v = t >= 0 && t < a.T
                                ? load_elem(a.y + (e * a.y0 + t * a.y1) * ysz, c, a.ydt)
                                : __int_as_float(0x7fc00000); /* lost past Tmax */
            acc = __fadd_rn(acc, __fmul_rn(b.weight[i * k + j], v));
        }
        dst[c] = acc;
    }
}

/* Block (m, z): columns z of token m's rows from the ranks, in rank order (warp 0 lists
   them, its lanes loading their places together). */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_ll_sum(const LlCombine a)
{
    __shared__ const float *src[LL_MAX_SLOTS];
    __shared__ int ranks;
    const int64_t m = blockIdx.x;
    const int osz = a.odt == MF_DT_F32 ? 4 : 2, lane = threadIdx.x & 31;
    char *row = a.out + m * a.o0 * osz;
    int64_t cb, ce;
    ll_columns(a.K, &cb, &ce);
    if (a.W <= LL_MAX_SLOTS) {
        if (threadIdx.x < 32) {
            int n = 0;
            for (int p0 = 0; p0 < a.W; p0 += 32) {
                const int p = p0 + lane;
                const int32_t q = p < a.W ? a.pos[m * a.W + p] : -1;
                const bool valid = q >= 0 && q < a.w.cap;
                const int at = ep_warp_place(valid, lane, &n);
                if (valid)
                    src[at] = (p == a.rank ? a.partial : a.back) + ((int64_t)p * a.w.cap + q) * a.K;
            }
            if (lane == 0)
                ranks = n;
        }
        __syncthreads();
        if (a.vec) {
            for (int64_t c = cb + 4 * threadIdx.x; c < ce; c += 4 * EP_THREADS) {
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int s0 = 0; s0 < ranks; s0 += 4) { /* four ranks' loads in flight */
                    float4 v[4];
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        v[u] = s0 + u < ranks ? *(const float4 *)(src[s0 + u] + c)
                                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        if (s0 + u < ranks) {
                            acc[0] = __fadd_rn(acc[0], v[u].x);
                            acc[1] = __fadd_rn(acc[1], v[u].y);
                            acc[2] = __fadd_rn(acc[2], v[u].z);
                            acc[3] = __fadd_rn(acc[3], v[u].w);
                        }
                }
                ep_store4(row, a.odt, c, acc);
            }
            return;
        }
        for (int64_t c = cb + threadIdx.x; c < ce; c += EP_THREADS) {
            float acc = 0.0f;
            for (int s = 0; s < ranks; s++)
                acc = __fadd_rn(acc, src[s][c]);
            ep_store(row, a.odt, c, acc);
        }
        return;
    }
    for (int64_t c = cb + threadIdx.x; c < ce; c += EP_THREADS) { /* many ranks: as we go */
        float acc = 0.0f;
        for (int p = 0; p < a.W; p++) {
            const int32_t q = a.pos[m * a.W + p];
            if (q >= 0 && q < a.w.cap)
                acc = __fadd_rn(acc, (p == a.rank ? a.partial : a.back)
                                         [((int64_t)p * a.w.cap + q) * a.K + c]);
        }
        ep_store(row, a.odt, c, acc);
    }
}

/* ------------------------------------------------------------------- host */

moefuse_status mf_cuda_ep_ll_pack(moefuse_context *ctx, void *state, const mf_ep_ll_args *a)
{
    cuda_state *s = (cuda_state *)state;
    LlPack p;
    memset(&p, 0, sizeof p);
    p.w = a->wire;
    p.W = a->world;
    p.M = a->tokens;
    p.K = a->model_dim;
    p.groups = a->groups;
    p.x = mf_cuda_base(&a->x);
    p.x1 = a->x.stride[1];
    p.xes = (int)moefuse_dtype_size(a->x.dtype);
    if (a->groups > 0)
        p.xs = ep_scales_of(&a->x_scales, a->x_layout);
    p.ids = mf_cuda_base(&a->ids);
    p.i0 = a->ids.stride[0];
    p.i1 = a->ids.stride[1];
    p.weights = mf_cuda_base(&a->weights);
    p.w0 = a->weights.stride[0];
    p.w1 = a->weights.stride[1];
    p.owner = a->owner;
    p.local = a->local;
    p.E = a->experts;
    p.send = (char *)a->send;
    p.pos = a->pos;
    const int64_t chunks = p.M > 0 ? (p.M + LL_WARPS - 1) / LL_WARPS : 1;
    mf_k_ep_ll_pack<<<dim3((unsigned)chunks, (unsigned)p.W), EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_ll_pack", "mf_k_ep_ll_pack");
}

moefuse_status mf_cuda_ep_ll_place(moefuse_context *ctx, void *state, const mf_ep_ll_args *a)
{
    cuda_state *s = (cuda_state *)state;
    LlPlace p;
    memset(&p, 0, sizeof p);
    p.w = a->wire;
    p.W = a->world;
    p.K = a->model_dim;
    p.T = a->recv_x.shape[1];
    p.groups = a->groups;
    p.recv = (const char *)a->recv;
    p.rank = a->rank;
    p.own = (const char *)a->send;
    p.rx = mf_cuda_base(&a->recv_x);
    p.r0 = a->recv_x.stride[0];
    p.r1 = a->recv_x.stride[1];
    p.res = (int)moefuse_dtype_size(a->recv_x.dtype);
    if (a->groups > 0) {
        p.rs = ep_scales_of(&a->recv_scales, a->recv_layout);
        p.inner = a->recv_scales.shape[1];
        p.ta = a->recv_scales.shape[2];
    }
    p.counts = (int32_t *)mf_cuda_base(&a->recv_counts);
    p.c0 = a->recv_counts.stride[0];
    p.row_of = a->row_of;
    const int64_t E = a->recv_x.shape[0];
    if (E == 0)
        return MOEFUSE_OK;
    mf_k_ep_ll_place<<<(unsigned)E, EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_ll_place", "mf_k_ep_ll_place");
}

static LlCombine combine_params(const mf_ep_ll_args *a)
{
    LlCombine p;
    memset(&p, 0, sizeof p);
    p.w = a->wire;
    p.W = a->world;
    p.M = a->tokens;
    p.K = a->model_dim;
    p.recv = (const char *)a->recv;
    p.rank = a->rank;
    p.own = (const char *)a->send;
    p.row_of = a->row_of;
    p.pos = a->pos;
    p.partial = a->partial;
    p.back = a->back;
    return p;
}

moefuse_status mf_cuda_ep_ll_partial(moefuse_context *ctx, void *state, const mf_ep_ll_args *a)
{
    cuda_state *s = (cuda_state *)state;
    LlCombine p = combine_params(a);
    p.y = mf_cuda_base(&a->y);
    p.y0 = a->y.stride[0];
    p.y1 = a->y.stride[1];
    p.E = a->y.shape[0];
    p.T = a->y.shape[1];
    p.ydt = (int)a->y.dtype;
    const int ysz = p.ydt == MF_DT_F32 ? 4 : 2;
    p.vec = p.K % 8 == 0 && ((uintptr_t)p.y & 15u) == 0 && (p.y0 * ysz) % 16 == 0 &&
            (p.y1 * ysz) % 16 == 0 && ((uintptr_t)p.partial & 15u) == 0;
    if (p.w.cap == 0 || p.K == 0)
        return MOEFUSE_OK;
    const dim3 grid((unsigned)p.w.cap, (unsigned)p.W, LL_KSPLIT);
    mf_k_ep_ll_partial<<<grid, EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_ll_partial", "mf_k_ep_ll_partial");
}

moefuse_status mf_cuda_ep_ll_sum(moefuse_context *ctx, void *state, const mf_ep_ll_args *a)
{
    cuda_state *s = (cuda_state *)state;
    LlCombine p = combine_params(a);
    p.out = mf_cuda_base(&a->out);
    p.o0 = a->out.stride[0];
    p.odt = (int)a->out.dtype;
    const int osz = p.odt == MF_DT_F32 ? 4 : 2;
    p.vec = p.K % 4 == 0 && ((uintptr_t)p.out & (4u * osz - 1)) == 0 &&
            (p.o0 * osz) % (4 * osz) == 0 && ((uintptr_t)p.back & 15u) == 0 &&
            ((uintptr_t)p.partial & 15u) == 0; /* this rank's own rows are read there */
    if (p.M == 0 || p.K == 0)
        return MOEFUSE_OK;
    mf_k_ep_ll_sum<<<dim3((unsigned)p.M, 1, LL_KSPLIT), EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_ll_sum", "mf_k_ep_ll_sum");
}
