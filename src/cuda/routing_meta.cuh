/*
 * The pieces of routing_metadata's CUDA paths (routing_meta.cu: the reference and the span
 * path; routing_meta_cluster.cu: one cluster of blocks): the call's parameters, a slot's
 * expert, the lanes of a warp that share it, a block's scan, a slot's outputs and order's
 * padding. Integers only: the CPU's bytes by construction (docs/NUMERICS.md, "Routing
 * metadata").
 */
#ifndef MOEFUSE_CUDA_ROUTING_META_CUH
#define MOEFUSE_CUDA_ROUTING_META_CUH

#include "cuda/cuda_internal.h"
#include "cuda/moe_internal.h"
#include "cuda/moe_kernels.cuh"

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

#define RM_THREADS 1024
#define RM_WARPS (RM_THREADS / 32)
#define RM_SMEM_INTS (48 * 1024 / 4) /* the default dynamic shared-memory limit */
#define RM_FULL 0xFFFFFFFFu
#define RM_SPAN 2048      /* slots a block takes, at least */
#define RM_MAX_BLOCKS 256 /* past that the spans grow (the place kernel reads blocks x E sums) */
#define RM_BATCH 4        /* loads a thread issues together */

/* The local expert of slot s (32-bit slot arithmetic: the core keeps M * k in i32). */
static __device__ __forceinline__ int meta_expert32(const MetaParams &p, int64_t s)
{
    const uint32_t k = (uint32_t)p.rt.topk;
    const uint32_t m = (uint32_t)s / k, j = (uint32_t)s - m * k;
    return (int)moe_slot_expert(p.rt, m, j);
}

/*
 * The lanes whose e equals this lane's (e in [-2, E): -1 invalid, -2 past the end), from one
 * ballot per bit of e + 2 (bits: those of E + 1). It replaces __match_any_sync, which goes
 * through the MIO pipe (Nsight Compute, the cluster kernel at M = 4096: MIO stalls the largest
 * share; 21.6 -> 20.0 us with the ballots, one launch, cold caches).
 */
static __device__ __forceinline__ unsigned meta_peers(int e, int bits)
{
    const uint32_t u = (uint32_t)(e + 2);
    unsigned peers = RM_FULL;
#pragma unroll
    for (int b = 0; b < 13; b++) /* 13 bits: E + 1 < 8192 on every path that calls it */
        if (b < bits) {
            const bool one = (u >> b) & 1u;
            const unsigned set = __ballot_sync(RM_FULL, one);
            peers &= one ? set : ~set;
        }
    return peers;
}

/* The bits meta_peers compares for E experts. */
static __device__ __forceinline__ int meta_peer_bits(int64_t E)
{
    return 32 - __clz((int)E + 1);
}

/* Exclusive prefix sum of one value per thread over the block; the total in *total.
   warp_sums: RM_WARPS + 1 of T in shared memory. */
template <typename T>
static __device__ T meta_block_scan(T x, T *warp_sums, T *total)
{
    const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
    T inc = x;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const T o = __shfl_up_sync(RM_FULL, inc, d);
        inc += lane >= d ? o : 0;
    }
    if (lane == 31)
        warp_sums[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        T w = warp_sums[lane], wi = w;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const T o = __shfl_up_sync(RM_FULL, wi, d);
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

/* The padded size of an expert's list of n slots. */
static __device__ __forceinline__ int32_t meta_padded(const MetaParams &p, int32_t n)
{
    /* 32-bit: the core keeps M * k + E * (block - 1) below 2^31 */
    const uint32_t b = (uint32_t)p.block;
    return (int32_t)(((uint32_t)n + b - 1u) / b * b);
}

/* Slot s's position and masked row: place pos in the list of local expert e, which starts
 * at `first`; -1 for an invalid slot (e == -1); nothing for a lane past the end (e == -2). */
static __device__ __forceinline__ void meta_place_rows(const MetaParams &p, int64_t s, int e,
                                                       int32_t pos, int32_t first)
{
    const uint32_t k = (uint32_t)p.rt.topk, m = (uint32_t)s / k, j = (uint32_t)s - m * k;
    const int64_t at_p = m * p.ps0 + j, at_w = m * p.ws0 + j;
    const bool valid = e >= 0;
    if (e >= -1 && p.position)
        p.position[at_p] = valid ? pos : -1;
    if (e >= -1 && p.mrow)
        p.mrow[at_w] = valid ? pos - first : -1;
}

/* Slot s's outputs: meta_place_rows, and order[pos] = s for a valid slot. */
static __device__ __forceinline__ void meta_place(const MetaParams &p, int64_t s, int e,
                                                  int32_t pos, int32_t first)
{
    if (e >= 0 && p.order)
        p.order[pos] = (int32_t)s;
    meta_place_rows(p, s, e, pos, first);
}

/* -1 in order's padding of the experts e = part (mod parts) and in a share of the tail. */
static __device__ void meta_fill_padding(const MetaParams &p, const int32_t *cnt,
                                         const int32_t *off, int64_t part, int64_t parts)
{
    const int64_t E = p.rt.E, tid = threadIdx.x;
    for (int64_t e = part + parts * tid; e < E; e += parts * RM_THREADS)
        for (int64_t q = off[e] + cnt[e]; q < off[e + 1]; q++)
            p.order[q] = -1;
    for (int64_t q = off[E] + part * RM_THREADS + tid; q < p.length; q += parts * RM_THREADS)
        p.order[q] = -1;
}

/* routing_metadata's paths, fastest first; a forced one that cannot take a call gives way to
   the next (MOEFUSE_CUDA_META) */
enum meta_path { META_AUTO, META_CLUSTER16, META_CLUSTER8, META_SPANS, META_REFERENCE };

/* The cluster path (routing_meta_cluster.cu): launched when it fits, *taken = 1; otherwise
   nothing is launched and *taken = 0. */
moefuse_status mf_meta_cluster_launch(moefuse_context *ctx, cuda_state *s,
                                      const mf_meta_args *a, const MetaParams *p, int *taken);

/* Whether the cluster path takes these args (no scratch then). */
int mf_meta_cluster_fits(cuda_state *s, const mf_meta_args *a);

#endif
