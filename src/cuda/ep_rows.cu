/*
 * Expert parallelism's work on rows, on the GPU (src/core/backend.h, mf_ep_rows_args): pack
 * listed rows into a buffer, unpack a buffer into listed rows (with their scales in any
 * layout), the top-k sum of the rows sent back, and a device copy. The CPU's bytes
 * (src/cpu/ep_rows.c): copies, scale values decoded and encoded exactly, and the sum's
 * products and additions one rounding each in slot order. A block per row (or per token).
 */
#include "cuda/cuda_internal.h"
#include "cuda/ep_rows.cuh"

#include <string.h>

typedef struct EpRows {
    char *rows;             /* [E, T, K] */
    int64_t r0, r1;         /* element strides of e and t */
    int64_t T, K;
    int es, rdt;            /* element size, MF_DT_* */
    EpScales s;             /* f8 rows' scales */
    int64_t groups;
    const int64_t *index;   /* [n], device */
    int64_t n;
    char *buf;
    int64_t row_bytes;
    int to_f32;
    int vec8;               /* to_f32 of f16/bf16 rows: 16-byte aligned, K % 8 == 0 */
} EpRows;

__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_gather(const EpRows p)
{
    for (int64_t i = blockIdx.x; i < p.n; i += gridDim.x) {
        const int64_t e = p.index[i] / p.T, t = p.index[i] % p.T;
        const char *src = p.rows + (e * p.r0 + t * p.r1) * p.es;
        char *dst = p.buf + i * p.row_bytes;
        if (p.to_f32 && p.rdt == MF_DT_F32) { /* the rows as they are */
            ep_copy_bytes(dst, src, p.K * 4);
            continue;
        }
        if (p.to_f32 && p.vec8) {
            for (int64_t c = 8 * threadIdx.x; c < p.K; c += 8 * EP_THREADS) {
                float v[8];
                load8(src, c, p.rdt, 1, 8, v);
                *(float4 *)(dst + c * 4) = make_float4(v[0], v[1], v[2], v[3]);
                *(float4 *)(dst + c * 4 + 16) = make_float4(v[4], v[5], v[6], v[7]);
            }
            continue;
        }
        if (p.to_f32) {
            for (int64_t c = threadIdx.x; c < p.K; c += EP_THREADS)
                ((float *)dst)[c] = load_elem(src, c, p.rdt);
            continue;
        }
        ep_copy_bytes(dst, src, p.K * p.es);
        for (int64_t g = threadIdx.x; g < p.groups; g += EP_THREADS) {
            const float v = ep_scale_read(p.s, e, t, g);
            memcpy(dst + p.K + g * 4, &v, 4);
        }
    }
}

/* The padding of the column-major and packed layouts: rows T .. Ta - 1 of every expert, and
   the packed words of the rows about to be written (count[e] of them). */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_pad(const EpRows p, const int64_t *counts,
                                                        int64_t E, int64_t inner, int64_t ta)
{
    const int64_t es = p.s.sdt == MF_DT_F32 ? 4 : p.s.sdt == MF_DT_I32 ? 4 : 1;
    for (int64_t ew = blockIdx.x; ew < E * inner; ew += gridDim.x) {
        const int64_t e = ew / inner, w = ew % inner;
        char *col = p.s.sc + (e * p.s.s0 + w * p.s.s1) * es;
        const int64_t first = p.s.layout == MF_LAYOUT_PACKED ? 0 : p.T;
        for (int64_t t = threadIdx.x; t < ta; t += EP_THREADS)
            if (t >= p.T || (t >= first && t < counts[e]))
                for (int64_t b = 0; b < es; b++)
                    col[t * p.s.s2 * es + b] = 0;
    }
}

__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_scatter(const EpRows p)
{
    for (int64_t i = blockIdx.x; i < p.n; i += gridDim.x) {
        const int64_t e = p.index[i] / p.T, t = p.index[i] % p.T;
        char *dst = p.rows + (e * p.r0 + t * p.r1) * p.es;
        const char *src = p.buf + i * p.row_bytes;
        ep_copy_bytes(dst, src, p.K * p.es);
        for (int64_t g = threadIdx.x; g < p.groups; g += EP_THREADS) {
            float v;
            memcpy(&v, src + p.K + g * 4, 4);
            char *q = ep_scale_at(p.s, e, t, g);
            if (p.s.sdt == MF_DT_F32)
                *(float *)q = v;
            else
                *(uint8_t *)q = ep_exponent_of(v);
        }
    }
}

typedef struct EpReduce {
    const float *back;      /* [n, K] */
    const int64_t *slot_row; /* [M k], device */
    const float *weight;    /* [M k], device */
    int64_t M, k, K;
    char *out;
    int64_t o0;             /* element stride of a token */
    int odt;
    int vec;                /* K % 4 == 0, out's rows aligned for 4 values: vectors */
} EpReduce;

#define EP_REDUCE_SLOTS 64 /* slots a block lists in shared memory; more: read as it goes */

/* Block m (and on, a grid's stride apart): token m's sum. Warp 0 lists the valid slots' rows
   and weights, its lanes loading them together; then 4 columns a thread, four slots' loads in
   flight, each product and sum rounded once in slot order. */
__global__ void __launch_bounds__(EP_THREADS) mf_k_ep_reduce(const EpReduce p)
{
    __shared__ const float *row[EP_REDUCE_SLOTS];
    __shared__ float wt[EP_REDUCE_SLOTS];
    __shared__ int slots;
    const int lane = threadIdx.x & 31, osz = p.odt == MF_DT_F32 ? 4 : 2;
    for (int64_t m = blockIdx.x; m < p.M; m += gridDim.x) {
        char *out = p.out + m * p.o0 * osz;
        if (p.k > EP_REDUCE_SLOTS) {
            for (int64_t c = threadIdx.x; c < p.K; c += EP_THREADS) {
                float acc = 0.0f;
                for (int64_t j = 0; j < p.k; j++) {
                    const int64_t r = p.slot_row[m * p.k + j];
                    if (r >= 0)
                        acc = __fadd_rn(acc, __fmul_rn(p.weight[m * p.k + j], p.back[r * p.K + c]));
                }
                ep_store(out, p.odt, c, acc);
            }
            continue;
        }
        __syncthreads(); /* the previous token's list is read */
        if (threadIdx.x < 32) {
            int n = 0;
            for (int64_t j0 = 0; j0 < p.k; j0 += 32) {
                const int64_t j = j0 + lane;
                const int64_t r = j < p.k ? p.slot_row[m * p.k + j] : -1;
                const int at = ep_warp_place(r >= 0, lane, &n);
                if (r >= 0) {
                    row[at] = p.back + r * p.K;
                    wt[at] = p.weight[m * p.k + j];
                }
            }
            if (lane == 0)
                slots = n;
        }
        __syncthreads();
        if (!p.vec) {
            for (int64_t c = threadIdx.x; c < p.K; c += EP_THREADS) {
                float acc = 0.0f;
                for (int s = 0; s < slots; s++)
                    acc = __fadd_rn(acc, __fmul_rn(wt[s], row[s][c]));
                ep_store(out, p.odt, c, acc);
            }
            continue;
        }
        for (int64_t c = 4 * threadIdx.x; c < p.K; c += 4 * EP_THREADS) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int s0 = 0; s0 < slots; s0 += 4) {
                float4 v[4];
#pragma unroll
                for (int u = 0; u < 4; u++)
                    v[u] = s0 + u < slots ? *(const float4 *)(row[s0 + u] + c)
                                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int u = 0; u < 4; u++)
                    if (s0 + u < slots) {
                        const float w = wt[s0 + u];
                        acc[0] = __fadd_rn(acc[0], __fmul_rn(w, v[u].x));
                        acc[1] = __fadd_rn(acc[1], __fmul_rn(w, v[u].y));
                        acc[2] = __fadd_rn(acc[2], __fmul_rn(w, v[u].z));
                        acc[3] = __fadd_rn(acc[3], __fmul_rn(w, v[u].w));
                    }
            }
            ep_store4(out, p.odt, c, acc);
        }
    }
}

/* ------------------------------------------------------------------- host */

/* The kernel parameters of a, with its index (and counts) copied to device scratch. */
static moefuse_status ep_rows_params(moefuse_context *ctx, cuda_state *s, const char *op,
                                     const mf_ep_rows_args *a, EpRows *p, int64_t **counts)
{
    memset(p, 0, sizeof *p);
    const int64_t E = a->rows.shape[0];
    const size_t ib = sizeof(int64_t) * (size_t)a->n, cb = a->counts ? sizeof(int64_t) * E : 0;
    void *scratch = NULL;
    MF_TRY(mf_cuda_scratch(ctx, s, ib + cb > 0 ? ib + cb : 8, op, &scratch));
    cudaError_t e = ib ? cudaMemcpyAsync(scratch, a->index, ib, cudaMemcpyHostToDevice, s->stream)
                       : cudaSuccess;
    if (e == cudaSuccess && cb)
        e = cudaMemcpyAsync((char *)scratch + ib, a->counts, cb, cudaMemcpyHostToDevice,
                            s->stream);
    if (e != cudaSuccess)
        return mf_cuda_fail(ctx, e, op, "cudaMemcpyAsync");
    p->rows = mf_cuda_base(&a->rows);
    p->r0 = a->rows.stride[0];
    p->r1 = a->rows.stride[1];
    p->T = a->rows.shape[1];
    p->K = a->rows.shape[2];
    p->es = (int)moefuse_dtype_size(a->rows.dtype);
    p->rdt = (int)a->rows.dtype;
    if (a->groups > 0) {
        p->s = ep_scales_of(&a->scales, a->layout);
        p->groups = a->groups;
    }
    p->index = (const int64_t *)scratch;
    p->n = a->n;
    p->buf = (char *)a->buffer;
    p->row_bytes = (int64_t)a->row_bytes;
    p->to_f32 = a->to_f32;
    p->vec8 = p->K % 8 == 0 && ((uintptr_t)p->rows & 15u) == 0 && (p->r0 * p->es) % 16 == 0 &&
              (p->r1 * p->es) % 16 == 0 && ((uintptr_t)p->buf & 15u) == 0 &&
              p->row_bytes % 16 == 0;
    *counts = cb ? (int64_t *)((char *)scratch + ib) : NULL;
    return MOEFUSE_OK;
}

static unsigned ep_grid(const cuda_state *s, int64_t items)
{
    const int64_t cap = 8LL * s->sm_count;
    return (unsigned)(items < cap ? (items > 0 ? items : 1) : cap);
}

moefuse_status mf_cuda_ep_gather(moefuse_context *ctx, void *state, const mf_ep_rows_args *a)
{
    cuda_state *s = (cuda_state *)state;
    EpRows p;
    int64_t *counts = NULL;
    MF_TRY(ep_rows_params(ctx, s, "ep_gather", a, &p, &counts));
    if (a->n == 0)
        return MOEFUSE_OK;
    mf_k_ep_gather<<<ep_grid(s, a->n), EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_gather", "mf_k_ep_gather");
}

moefuse_status mf_cuda_ep_scatter(moefuse_context *ctx, void *state, const mf_ep_rows_args *a)
{
    cuda_state *s = (cuda_state *)state;
    EpRows p;
    int64_t *counts = NULL;
    MF_TRY(ep_rows_params(ctx, s, "ep_scatter", a, &p, &counts));
    if (a->groups > 0 && counts && a->layout != MOEFUSE_SCALE_ROW_MAJOR) {
        const int64_t E = a->scales.shape[0], inner = a->scales.shape[1];
        mf_k_ep_pad<<<ep_grid(s, E * inner), EP_THREADS, 0, s->stream>>>(p, counts, E, inner,
                                                                        a->scales.shape[2]);
        MF_TRY(mf_cuda_launched(ctx, "ep_scatter", "mf_k_ep_pad"));
    }
    if (a->n == 0)
        return MOEFUSE_OK;
    mf_k_ep_scatter<<<ep_grid(s, a->n), EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_scatter", "mf_k_ep_scatter");
}

moefuse_status mf_cuda_ep_reduce(moefuse_context *ctx, void *state, const mf_ep_reduce_args *a)
{
    cuda_state *s = (cuda_state *)state;
    const size_t S = (size_t)(a->tokens * a->topk);
    void *scratch = NULL;
    MF_TRY(mf_cuda_scratch(ctx, s, S * (sizeof(int64_t) + sizeof(float)) + 8, "ep_reduce",
                           &scratch));
    if (S > 0) {
        cudaError_t e = cudaMemcpyAsync(scratch, a->slot_row, S * sizeof(int64_t),
                                        cudaMemcpyHostToDevice, s->stream);
        if (e == cudaSuccess)
            e = cudaMemcpyAsync((char *)scratch + S * sizeof(int64_t), a->weight,
                                S * sizeof(float), cudaMemcpyHostToDevice, s->stream);
        if (e != cudaSuccess)
            return mf_cuda_fail(ctx, e, "ep_reduce", "cudaMemcpyAsync");
    }
    if (a->tokens == 0 || a->model_dim == 0)
        return MOEFUSE_OK;
    EpReduce p;
    p.back = (const float *)a->back;
    p.slot_row = (const int64_t *)scratch;
    p.weight = (const float *)((char *)scratch + S * sizeof(int64_t));
    p.M = a->tokens;
    p.k = a->topk;
    p.K = a->model_dim;
    p.out = mf_cuda_base(&a->out);
    p.o0 = a->out.stride[0];
    p.odt = (int)a->out.dtype;
    const int osz = p.odt == MF_DT_F32 ? 4 : 2;
    p.vec = p.K % 4 == 0 && ((uintptr_t)p.out & (4u * osz - 1)) == 0 &&
            (p.o0 * osz) % (4 * osz) == 0 && ((uintptr_t)p.back & 15u) == 0;
    mf_k_ep_reduce<<<ep_grid(s, a->tokens), EP_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, "ep_reduce", "mf_k_ep_reduce");
}

moefuse_status mf_cuda_ep_copy(moefuse_context *ctx, void *state, void *dst, const void *src,
                               size_t bytes)
{
    cuda_state *s = (cuda_state *)state;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(s->stream);
    return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, "ep_copy", "cudaMemcpyAsync");
}
