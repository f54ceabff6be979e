/*
 * routing_metadata of the CUDA backend: integers only, so the CPU's bytes by construction
 * (docs/NUMERICS.md, "Routing metadata"). Two paths:
 *  - mf_k_meta_grid, for E up to a few thousand: block b places a span of the slots. It counts
 *    every slot into a shared histogram (before its span, after it, or the row of the warp
 *    whose part of the span holds it); a block scan turns the padded counts into offsets and
 *    each warp's row into its first positions; then each warp walks its part 32 slots at a
 *    time, a slot's rank among the lanes of the same expert from __match_any_sync, so that the
 *    order is ascending in the slot as the contract asks and no atomic decides it. The
 *    counting is repeated in every block (the ids are read from L2 once per block) so that
 *    the call is one launch with no grid-wide wait: what an engine's graph wants.
 *  - the reference, for larger E: a thread per expert scanning every slot in order.
 */
#include "cuda/cuda_internal.h"
#include "cuda/moe_internal.h"
#include "cuda/moe_kernels.cuh"

#include <string.h>

/* -------------------------------------------------------- the reference, any E */


typedef struct MetaParams {
    MoeRoute rt;
    int64_t M, block, length;
    int32_t *counts, *offsets, *order, *position, *mrow;
    int64_t ps0, ws0;
} MetaParams;

static __device__ __forceinline__ int64_t meta_expert(const MetaParams &p, int64_t s)
{
    return moe_slot_expert(p.rt, s / p.rt.topk, s % p.rt.topk);
}

__global__ void mf_k_meta_count(const MetaParams p)
{
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= p.rt.E)
        return;
    int64_t n = 0;
    for (int64_t s = 0; s < p.rt.S; s++)
        n += meta_expert(p, s) == e;
    p.counts[e] = (int32_t)n;
}

__global__ void mf_k_meta_place(const MetaParams p)
{
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e > p.rt.E)
        return;
    int64_t start = 0;
    for (int64_t f = 0; f < e; f++)
        start += (p.counts[f] + p.block - 1) / p.block * p.block;
    if (p.offsets)
        p.offsets[e] = (int32_t)start;
    if (e == p.rt.E) {
        if (p.order)
            for (int64_t q = start; q < p.length; q++)
                p.order[q] = -1;
        return;
    }
    const int64_t k = p.rt.topk;
    int64_t n = 0;
    for (int64_t s = 0; s < p.rt.S; s++) {
        if (meta_expert(p, s) != e)
            continue;
        if (p.order)
            p.order[start + n] = (int32_t)s;
        if (p.position)
            p.position[(s / k) * p.ps0 + s % k] = (int32_t)(start + n);
        if (p.mrow)
            p.mrow[(s / k) * p.ws0 + s % k] = (int32_t)n;
        n++;
    }
    if (p.order)
        for (int64_t q = start + n; q < start + (n + p.block - 1) / p.block * p.block; q++)
            p.order[q] = -1;
}

__global__ void mf_k_meta_invalid(const MetaParams p)
{
    const int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= p.rt.S || meta_expert(p, s) >= 0)
        return;
    const int64_t k = p.rt.topk;
    if (p.position)
        p.position[(s / k) * p.ps0 + s % k] = -1;
    if (p.mrow)
        p.mrow[(s / k) * p.ws0 + s % k] = -1;
}

/* ------------------------------------------------ a grid of blocks, E <= about 3000 */

#define RM_THREADS 1024
#define RM_WARPS (RM_THREADS / 32)
#define RM_SMEM_INTS (48 * 1024 / 4) /* the default dynamic shared-memory limit */
#define RM_FULL 0xFFFFFFFFu
#define RM_SPAN 2048      /* slots a block places, at least */
#define RM_MAX_BLOCKS 128 /* past that the spans grow: each block reads every id */
#define RM_BATCH 16       /* ids a thread loads together, their latencies overlapped */

/* Warps with a histogram row of their own that fit beside the block's other arrays (pre,
   post, offsets, the scan's warp sums); 0: too many experts, the reference's case. */
static int64_t meta_chunks(int64_t E)
{
    if (E <= 0)
        return 0;
    const int64_t w = (RM_SMEM_INTS - 3 * E - 1 - (RM_WARPS + 1)) / E;
    return w < 0 ? 0 : (w > RM_WARPS ? RM_WARPS : w);
}

/* The local expert of slot s (32-bit slot arithmetic: the core keeps M * k in i32). */
static __device__ __forceinline__ int meta_expert32(const MetaParams &p, int64_t s)
{
    const uint32_t k = (uint32_t)p.rt.topk;
    const uint32_t m = (uint32_t)s / k, j = (uint32_t)s - m * k;
    return (int)moe_slot_expert(p.rt, m, j);
}

/* Exclusive prefix sum of one value per thread over the block; the total in *total. */
static __device__ int32_t meta_block_scan(int32_t x, int32_t *warp_sums, int32_t *total)
{
    const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
    int32_t inc = x;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int32_t o = __shfl_up_sync(RM_FULL, inc, d);
        inc += lane >= d ? o : 0;
    }
    if (lane == 31)
        warp_sums[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int32_t w = warp_sums[lane], wi = w;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int32_t o = __shfl_up_sync(RM_FULL, wi, d);
            wi += lane >= d ? o : 0;
        }
        warp_sums[lane] = wi - w; /* exclusive */
        if (lane == 31)
            warp_sums[RM_WARPS] = wi;
    }
    __syncthreads();
    *total = warp_sums[RM_WARPS];
    return warp_sums[warp] + inc - x;
}

/*
 * Block b places the slots [b * span, (b + 1) * span), warp w of its chunks the part
 * [w * chunk, (w + 1) * chunk) of that. Every block counts every slot: before its span (pre),
 * in it (its warp's row) or after (post), which gives it the offsets and each warp's first
 * positions with no other block's help, in one launch and no grid-wide wait.
 */
__global__ void __launch_bounds__(RM_THREADS) mf_k_meta_grid(const MetaParams p, int chunks,
                                                             int64_t span)
{
    extern __shared__ int32_t sm[];
    const int64_t E = p.rt.E, S = p.rt.S, k = p.rt.topk;
    int32_t *hist = sm;                /* [chunks, E]: counts, then each row's next position */
    int32_t *pre = hist + chunks * E;  /* [E]: valid slots before the span */
    int32_t *post = pre + E;           /* [E]: after it */
    int32_t *off = post + E;           /* [E + 1] */
    int32_t *warp_sums = off + E + 1;  /* [RM_WARPS + 1] */
    const int tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int64_t lo = (int64_t)blockIdx.x * span, hi = lo + span < S ? lo + span : S;
    const int64_t chunk = span / chunks;
    for (int64_t q = tid; q < (chunks + 2) * E; q += RM_THREADS)
        hist[q] = 0;
    __syncthreads();
    for (int64_t s0 = 0; s0 < S; s0 += (int64_t)RM_THREADS * RM_BATCH) {
        int e[RM_BATCH];
#pragma unroll
        for (int r = 0; r < RM_BATCH; r++) {
            const int64_t s = s0 + (int64_t)r * RM_THREADS + tid;
            e[r] = s < S ? meta_expert32(p, s) : -1;
        }
#pragma unroll
        for (int r = 0; r < RM_BATCH; r++) {
            const int64_t s = s0 + (int64_t)r * RM_THREADS + tid;
            if (e[r] >= 0) /* 32-bit: a 64-bit division is a long loop */
                atomicAdd(s < lo    ? &pre[e[r]]
                          : s >= hi ? &post[e[r]]
                                    : &hist[(uint32_t)(s - lo) / (uint32_t)chunk * E + e[r]],
                          1);
        }
    }
    __syncthreads();
    /* counts and padded offsets: thread t takes experts [e0, e1) */
    const int64_t per = (E + RM_THREADS - 1) / RM_THREADS;
    const int64_t e0 = tid * per < E ? tid * per : E, e1 = e0 + per < E ? e0 + per : E;
    int32_t mine = 0;
    for (int64_t e = e0; e < e1; e++) {
        int32_t n = pre[e] + post[e];
        for (int w = 0; w < chunks; w++)
            n += hist[w * E + e];
        if (blockIdx.x == 0)
            p.counts[e] = n;
        mine += (int32_t)((n + p.block - 1) / p.block * p.block);
        post[e] = n; /* the count, from here on */
    }
    int32_t total;
    int32_t at = meta_block_scan(mine, warp_sums, &total);
    for (int64_t e = e0; e < e1; e++) {
        off[e] = at;
        int32_t next = at + pre[e];
        for (int w = 0; w < chunks; w++) { /* each row's first position */
            const int32_t n = hist[w * E + e];
            hist[w * E + e] = next;
            next += n;
        }
        at += (int32_t)((post[e] + p.block - 1) / p.block * p.block);
    }
    if (tid == 0)
        off[E] = total;
    __syncthreads();
    if (p.offsets && blockIdx.x == 0)
        for (int64_t e = tid; e <= E; e += RM_THREADS)
            p.offsets[e] = off[e];
    /* the span's slots, 32 at a time per warp: a slot's place is its row's next position
       plus its rank among the lanes of the same expert (ascending slots, as the contract) */
    const int64_t wlo = lo + warp * chunk, whi = wlo + chunk < hi ? wlo + chunk : hi;
    if (warp < chunks && (p.order || p.position || p.mrow))
        for (int64_t s0 = wlo; s0 < whi; s0 += 32 * RM_BATCH) {
            int ev[RM_BATCH];
#pragma unroll
            for (int r = 0; r < RM_BATCH; r++) {
                const int64_t s = s0 + 32 * r + lane;
                ev[r] = s < whi ? meta_expert32(p, s) : -2;
            }
#pragma unroll
            for (int r = 0; r < RM_BATCH; r++) {
                const int e = ev[r];
                const int64_t s = s0 + 32 * r + lane;
                const unsigned same = __match_any_sync(RM_FULL, e);
                const int rank = __popc(same & ((1u << lane) - 1u));
                const uint32_t m = (uint32_t)s / (uint32_t)k, j = (uint32_t)s - m * (uint32_t)k;
                const int64_t at_p = m * p.ps0 + j, at_w = m * p.ws0 + j;
                if (e >= 0) {
                    const int32_t pos = hist[warp * E + e] + rank;
                    if (p.order)
                        p.order[pos] = (int32_t)s;
                    if (p.position)
                        p.position[at_p] = pos;
                    if (p.mrow)
                        p.mrow[at_w] = pos - off[e];
                } else if (e == -1) {
                    if (p.position)
                        p.position[at_p] = -1;
                    if (p.mrow)
                        p.mrow[at_w] = -1;
                }
                __syncwarp();
                if (e >= 0 && rank == 0)
                    hist[warp * E + e] += __popc(same);
                __syncwarp();
            }
        }
    if (!p.order)
        return;
    /* -1 in the padding of the experts e = b (mod blocks) and in a share of the tail */
    for (int64_t e = blockIdx.x + (int64_t)gridDim.x * tid; e < E;
         e += (int64_t)gridDim.x * RM_THREADS)
        for (int64_t q = off[e] + post[e]; q < off[e + 1]; q++)
            p.order[q] = -1;
    for (int64_t q = off[E] + (int64_t)blockIdx.x * RM_THREADS + tid; q < p.length;
         q += (int64_t)gridDim.x * RM_THREADS)
        p.order[q] = -1;
}

moefuse_status mf_cuda_routing_metadata(moefuse_context *ctx, void *state, const mf_meta_args *a)
{
    cuda_state *s = (cuda_state *)state;
    const mf_moe_args *r = &a->route;
    MetaParams p;
    memset(&p, 0, sizeof p);
    p.rt.ids = (const int32_t *)mf_cuda_base(&r->topk_ids);
    p.rt.ids_s0 = r->topk_ids.stride[0];
    p.rt.map = r->expert_map.data ? (const int32_t *)mf_cuda_base(&r->expert_map) : NULL;
    p.rt.map_s0 = r->expert_map.data ? r->expert_map.stride[0] : 0;
    p.rt.topk = r->topk;
    p.rt.S = r->tokens * r->topk;
    p.rt.E = r->experts;
    p.rt.Eg = r->global_experts;
    p.M = r->tokens;
    p.block = a->block;
    p.length = a->length;
    p.counts = (int32_t *)mf_cuda_base(&a->counts);
    p.offsets = a->offsets.data ? (int32_t *)mf_cuda_base(&a->offsets) : NULL;
    p.order = a->order.data ? (int32_t *)mf_cuda_base(&a->order) : NULL;
    p.position = a->position.data ? (int32_t *)mf_cuda_base(&a->position) : NULL;
    p.ps0 = a->position.data ? a->position.stride[0] : 0;
    p.mrow = a->masked_row.data ? (int32_t *)mf_cuda_base(&a->masked_row) : NULL;
    p.ws0 = a->masked_row.data ? a->masked_row.stride[0] : 0;
    const int64_t chunks = meta_chunks(p.rt.E);
    if (chunks > 0) {
        int64_t blocks = (p.rt.S + RM_SPAN - 1) / RM_SPAN;
        blocks = blocks < 1 ? 1 : (blocks > RM_MAX_BLOCKS ? RM_MAX_BLOCKS : blocks);
        const int64_t unit = 32 * chunks; /* a span is whole rounds of every warp */
        const int64_t span = ((p.rt.S + blocks - 1) / blocks + unit - 1) / unit * unit;
        blocks = span > 0 ? (p.rt.S + span - 1) / span : 1;
        blocks = blocks < 1 ? 1 : blocks;
        const size_t smem = (size_t)((chunks + 3) * p.rt.E + 1 + RM_WARPS + 1) * 4;
        mf_k_meta_grid<<<(unsigned)blocks, RM_THREADS, smem, s->stream>>>(p, (int)chunks,
                                                                          span > 0 ? span : unit);
        return mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_grid");
    }
    if (p.rt.E > 0) {
        mf_k_meta_count<<<(unsigned)((p.rt.E + 63) / 64), 64, 0, s->stream>>>(p);
        MF_TRY(mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_count"));
    }
    mf_k_meta_place<<<(unsigned)((p.rt.E + 64) / 64), 64, 0, s->stream>>>(p);
    MF_TRY(mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_place"));
    if ((p.position || p.mrow) && p.rt.S > 0) {
        mf_k_meta_invalid<<<(unsigned)((p.rt.S + 255) / 256), 256, 0, s->stream>>>(p);
        MF_TRY(mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_invalid"));
    }
    return MOEFUSE_OK;
}
