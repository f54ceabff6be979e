/*
 * Expert parallelism's low-latency steps on the GPU (src/core/backend.h, mf_ep_ll_args; the
 * blocks as ep/ep_ll_wire.h lays them out). The same bytes as the CPU's (src/cpu/ep_ll.c):
 * rows copied, scales decoded and encoded exactly, each sum's products and additions one
 * rounding each in a fixed order. Nothing here waits for the host, so the steps can be
 * captured in a graph; counts and indices from other ranks are clamped before use.
 *   pack:    route (one block scans the tokens for every rank) then rows (a block a row sent)
 *   place:   a block a local expert walks every received slot in order and copies its rows
 *   partial: a block a received row sums its slots' outputs
 *   sum:     a block a token sums what the ranks sent back, in rank order
 */
#include "cuda/cuda_internal.h"
#include "cuda/ep_rows.cuh"

#include <string.h>

#define LL_WARPS (EP_THREADS / 32)

/* The parts of block p of a run of blocks. */
typedef struct LlBlock {
    int32_t *count, *token, *expert;
    float *weight;
    char *rows;
} LlBlock;

static __device__ __forceinline__ LlBlock ll_block(const mf_ep_ll_wire &w, const void *blocks,
                                                   int p)
{
    char *b = (char *)blocks + w.bytes * (size_t)p;
    LlBlock v = {(int32_t *)b, (int32_t *)(b + w.off_token), (int32_t *)(b + w.off_expert),
                 (float *)(b + w.off_weight), b + w.off_rows};
    return v;
}

static __device__ __forceinline__ int64_t ll_rows_in(const mf_ep_ll_wire &w, const LlBlock &b)
{
    const int64_t n = *b.count;
    return n < 0 ? 0 : n > w.cap ? w.cap : n;
}

/* Exclusive prefix of flag over the block's threads; *total gets the block's sum. Every
   thread calls it. */
static __device__ __forceinline__ int ll_block_scan(int flag, int *total, int *warp_sums)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int before = __popc(ballot & ((1u << lane) - 1u));
    __syncthreads(); /* warp_sums is free */
    if (lane == 0)
        warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int base = 0, sum = 0;
    for (int w = 0; w < LL_WARPS; w++) {
        base += w < warp ? warp_sums[w] : 0;
        sum += warp_sums[w];
    }
    *total = sum;
    return base + before;
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

/* One block: for each rank p in turn, the tokens that have a slot there, in token order, get
   rows 0, 1, ... of block p; their meta is written and pos records each token's row. */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_ll_route(const LlPack a)
{
    __shared__ int warp_sums[LL_WARPS];
    const int64_t k = a.w.topk;
    for (int p = 0; p < a.W; p++) {
        const LlBlock b = ll_block(a.w, a.send, p);
        int64_t base = 0;
        for (int64_t m0 = 0; m0 < a.M; m0 += EP_THREADS) {
            const int64_t m = m0 + threadIdx.x;
            int flag = 0;
            if (m < a.M)
                for (int64_t j = 0; j < k; j++) {
                    const int32_t g = *(const int32_t *)(a.ids + (m * a.i0 + j * a.i1) * 4);
                    flag |= g >= 0 && g < a.E && a.owner[g] == p;
                }
            int total;
            const int64_t i = base + ll_block_scan(flag, &total, warp_sums);
            if (m < a.M)
                a.pos[m * a.W + p] = flag ? (int32_t)i : -1;
            if (flag) {
                b.token[i] = (int32_t)m;
                for (int64_t j = 0; j < k; j++) {
                    const int32_t g = *(const int32_t *)(a.ids + (m * a.i0 + j * a.i1) * 4);
                    const bool here = g >= 0 && g < a.E && a.owner[g] == p;
                    b.expert[i * k + j] = here ? a.local[g] : -1;
                    b.weight[i * k + j] = *(const float *)(a.weights + (m * a.w0 + j * a.w1) * 4);
                }
            }
            base += total;
        }
        if (threadIdx.x == 0)
            *b.count = (int32_t)base;
    }
}

/* Block (m, p): x's row m into its row of block p, if it has one. */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_ll_rows(const LlPack a)
{
    const int64_t m = blockIdx.x;
    const int p = blockIdx.y;
    const int32_t i = a.pos[m * a.W + p];
    if (i < 0)
        return;
    char *row = ll_block(a.w, a.send, p).rows + a.w.row_bytes * (size_t)i;
    ep_copy_bytes(row, a.x + m * a.x1 * a.xes, a.K * a.xes);
    for (int64_t g = threadIdx.x; g < a.groups; g += EP_THREADS) {
        const float v = ep_scale_read(a.xs, 0, m, g);
        memcpy(row + a.K + g * 4, &v, 4);
    }
}

typedef struct LlPlace {
    mf_ep_ll_wire w;
    int W;
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

/* Row t of expert e: the received row's codes and its scales, whole packed words at once
   (a row owns its words: 4 groups of one row), so no byte of them is left stale. */
static __device__ void ll_put_row(const LlPlace &a, int64_t e, int64_t t, const char *src)
{
    ep_copy_bytes(a.rx + (e * a.r0 + t * a.r1) * a.res, src, a.K * a.res);
    if (a.groups == 0)
        return;
    if (a.rs.layout == MF_LAYOUT_PACKED) {
        for (int64_t w = threadIdx.x; w < (a.groups + 3) / 4; w += EP_THREADS) {
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
    for (int64_t g = threadIdx.x; g < a.groups; g += EP_THREADS) {
        float v;
        memcpy(&v, src + a.K + g * 4, 4);
        char *q = ep_scale_at(a.rs, e, t, g);
        if (a.rs.sdt == MF_DT_F32)
            *(float *)q = v;
        else
            *(uint8_t *)q = ep_exponent_of(v);
    }
}

/* Block e: expert e's slots in block order (p, then i, then j) become its rows 0, 1, ...;
   then the layout's padding rows T .. Ta - 1 are zeroed and the count written. */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_ll_place(const LlPlace a)
{
    __shared__ int warp_sums[LL_WARPS];
    __shared__ int64_t found[EP_THREADS]; /* a tile's slots of e: their row, p C + i */
    __shared__ int64_t found_t[EP_THREADS]; /* and its t */
    const int64_t e = blockIdx.x, k = a.w.topk;
    int64_t t0 = 0;
    for (int p = 0; p < a.W; p++) {
        const LlBlock b = ll_block(a.w, a.recv, p);
        const int64_t slots = ll_rows_in(a.w, b) * k;
        for (int64_t q0 = 0; q0 < slots; q0 += EP_THREADS) {
            const int64_t q = q0 + threadIdx.x;
            const int flag = q < slots && b.expert[q] == e;
            int total;
            const int64_t r = ll_block_scan(flag, &total, warp_sums), t = t0 + r;
            if (flag) {
                a.row_of[(int64_t)p * a.w.cap * k + q] = t < a.T ? (int32_t)t : -2;
                found[r] = (int64_t)p * a.w.cap + q / k;
                found_t[r] = t;
            }
            __syncthreads();
            for (int f = 0; f < total; f++) {
                const int64_t t = found_t[f];
                if (t >= a.T)
                    break;
                const int pp = (int)(found[f] / a.w.cap);
                const int64_t i = found[f] % a.w.cap;
                ll_put_row(a, e, t, ll_block(a.w, a.recv, pp).rows + a.w.row_bytes * (size_t)i);
            }
            t0 += total;
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
    int W;
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
} LlCombine;

/* Block (i, p): row i of rank p's block, the sum of its slots' outputs here. */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_ll_partial(const LlCombine a)
{
    const int64_t i = blockIdx.x, k = a.w.topk;
    const int p = blockIdx.y;
    const LlBlock b = ll_block(a.w, a.recv, p);
    if (i >= ll_rows_in(a.w, b))
        return;
    const int ysz = a.ydt == MF_DT_F32 ? 4 : 2;
    float *dst = a.partial + ((int64_t)p * a.w.cap + i) * a.K;
    for (int64_t c = threadIdx.x; c < a.K; c += EP_THREADS) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const int32_t e = b.expert[i * k + j];
            if (e < 0 || e >= a.E)
                continue;
            const int32_t t = a.row_of[((int64_t)p * a.w.cap + i) * k + j];
            const float v = t >= 0 && t < a.T
                                ? ep_load(a.y + (e * a.y0 + t * a.y1) * ysz, a.ydt, c)
                                : __int_as_float(0x7fc00000); /* lost past Tmax */
            acc = __fadd_rn(acc, __fmul_rn(b.weight[i * k + j], v));
        }
        dst[c] = acc;
    }
}

/* Block m: token m's rows from the ranks, in rank order. */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_ll_sum(const LlCombine a)
{
    const int64_t m = blockIdx.x;
    const int osz = a.odt == MF_DT_F32 ? 4 : 2;
    for (int64_t c = threadIdx.x; c < a.K; c += EP_THREADS) {
        float acc = 0.0f;
        for (int p = 0; p < a.W; p++) {
            const int32_t q = a.pos[m * a.W + p];
            if (q >= 0 && q < a.w.cap)
                acc = __fadd_rn(acc, a.back[((int64_t)p * a.w.cap + q) * a.K + c]);
        }
        ep_store(a.out + m * a.o0 * osz, a.odt, c, acc);
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
    mf_k_ep_ll_route<<<1, EP_THREADS, 0, s->stream>>>(p);
    MF_TRY(mf_cuda_launched(ctx, "ep_ll_pack", "mf_k_ep_ll_route"));
    if (p.M == 0)
        return MOEFUSE_OK;
    mf_k_ep_ll_rows<<<dim3((unsigned)p.M, (unsigned)p.W), EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_ll_pack", "mf_k_ep_ll_rows");
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
    p.ydt = ep_dt_code(a->y.dtype);
    if (p.w.cap == 0 || p.K == 0)
        return MOEFUSE_OK;
    mf_k_ep_ll_partial<<<dim3((unsigned)p.w.cap, (unsigned)p.W), EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_ll_partial", "mf_k_ep_ll_partial");
}

moefuse_status mf_cuda_ep_ll_sum(moefuse_context *ctx, void *state, const mf_ep_ll_args *a)
{
    cuda_state *s = (cuda_state *)state;
    LlCombine p = combine_params(a);
    p.out = mf_cuda_base(&a->out);
    p.o0 = a->out.stride[0];
    p.odt = ep_dt_code(a->out.dtype);
    if (p.M == 0 || p.K == 0)
        return MOEFUSE_OK;
    mf_k_ep_ll_sum<<<(unsigned)p.M, EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_ll_sum", "mf_k_ep_ll_sum");
}
