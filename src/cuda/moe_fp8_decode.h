/*
 * The FP8 decode GEMM of the MoE layer (moe_fp8_decode.cu) and the kernel before it
 * (moe_fp8_decode_route.cu): few rows per expert, so a GEMM is one read of the routed experts'
 * weights. What the host side (moe_fp8.cu) hands them beyond Fp8Gemm (fp8.cuh): where the tiles
 * come from, how the depth is split, the fused top-k sum of the reduced final, and the zeroing
 * both kernels do. Included by .cu files only (C++, C style).
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_DECODE_H
#define MOEFUSE_CUDA_MOE_FP8_DECODE_H

#include "cuda/fp8.cuh"

#define DEC_NS 32       /* rows (slots) of a tile at most: wgmma N = 32 */
#define DEC_DIRECT_S 32 /* routed calls of at most this many slots route themselves */
#define DEC_MAX_E 1024  /* local experts the route kernel counts in shared memory */
#define DEC_SPLIT_MAX 8 /* blocks of a cluster sharing a tile's depth (portable cluster size) */
/* Where auto takes the decode kernel (dec_for, moe_fp8_plan.cu): up to DEC_FEW_SLOTS slots
 * per busy expert; up to DEC_LARGE_SLOTS where an expert's final holds DEC_LARGE_EXPERT
 * weights (K x I) or more; masked calls of Tmax <= DEC_MASKED_TMAX */
#define DEC_FEW_SLOTS 3
#define DEC_LARGE_SLOTS 8
#define DEC_LARGE_EXPERT (32ll << 20)
#define DEC_MASKED_TMAX 8

/* A tile of the routed layout: `count` (<= DEC_NS) slots list[first ...] of local expert e
 * (16 bytes, read as one longlong2: first, then e in the low and count in the high word). */
typedef struct DecTile {
    long long first;
    int e, count;
} DecTile;

/*
 * Where a decode GEMM finds its tiles, and what it does besides the product.
 *  - direct (routed, S <= DEC_DIRECT_S): every block reads the S ids itself; tile i is the
 *    i-th distinct valid local expert in order of first appearance, with all its slots;
 *  - routed: the tiles fp8_dec_route wrote (ntiles, tiles, list);
 *  - masked: tile i = (expert i % E, rows from (i / E) * DEC_NS), tiles_bound = E * chunks,
 *    chunks = ceil(Tmax / DEC_NS); a tile starting past n[e] is skipped.
 */
typedef struct Fp8DecExtra {
    int mode; /* enum dec_mode */
    const int *ntiles;
    const DecTile *tiles;
    const long long *list;
    long long tiles_bound;   /* tiles the grid covers at most */
    int split;               /* blocks (a cluster) sharing each tile's depth, 1..DEC_SPLIT_MAX */
    int clusters;            /* persistent clusters in the grid */
    /* split > 1: the ranks' partial sums [clusters, split, ...] on their way to rank 0 */
    void *part;
    /* reduced final: y [S, K] f32 rows are summed into rout by the last slot of each token to
     * arrive (arrivals [M, nblk], zero at the launch) */
    unsigned *arrivals;
    const float *tw;
    long long tw_s0;
    void *rout;
    long long rout_s0;
    int rout_dt;
    /* direct / masked: block 0 zeroes these first (out rows no tile writes; the counters of
     * the final that follows a forward's gate) */
    MoeZero zero_slot;       /* un-reduced final: rows of invalid slots */
    MoeZero zero_tok;        /* reduced final: rows of tokens without a valid slot */
    unsigned *zero_arrivals; /* gate of a forward: the final's arrivals */
    long long zero_arrivals_n;
    int pdl;     /* launched with programmatic dependent launch (waits before reading) */
    int trigger; /* lets the next kernel launch once this one's inputs are known */
    /* the kernel before this one wrote neither the tiles nor the ids (a layer's final after
     * its gate; a direct gate after x's quantization): the first weights come before the wait */
    int early;
    int w_map;   /* set at the launch: the weights come by tensor map */
} Fp8DecExtra;

enum dec_mode { DEC_DIRECT = 0, DEC_ROUTED = 1, DEC_MASKED = 2 };

/*
 * The kernel before a decode GEMM: in routed mode, list the valid slots by expert in tiles of
 * at most DEC_NS, zero the final's counters and the rows no tile writes; in any mode,
 * quantize x (when x is set) into xq / xs as `quant` does (row-major f32).
 */
typedef struct Fp8DecRoute {
    MoeRoute rt;
    int *ntiles;
    DecTile *tiles;
    long long *list;
    unsigned *arrivals;
    long long arrivals_n;
    MoeZero zero_slot, zero_tok;
    int route;     /* list the tiles (block 0); else quantize x only */
    const void *x; /* NULL: x is f8 already */
    int x_dt;
    int64_t x_s0, x_s1;   /* row m at m * x_s0; masked: (e, t) at e * x_s0 + t * x_s1 */
    const int32_t *counts; /* masked: n [E] (device data); rows e * Tmax + t, t < n[e] */
    int64_t counts_s0, tmax;
    uint8_t *xq; /* [rows, K] */
    float *xs;   /* [rows, K / 128] */
    int64_t rows, M, K;
    float q_eps;
    int q_ue8m0;
    int pdl;
} Fp8DecRoute;

/* Rows no tile writes: un-reduced outputs of invalid slots, reduced rows of tokens without a
 * valid slot, and counters; threads tid of n of one block. */
static __device__ void dec_zero(const MoeRoute &rt, long long M, const MoeZero &zs,
                                const MoeZero &zt, unsigned *cnt, long long cnt_n, int tid,
                                int n)
{
    for (long long i = tid; i < cnt_n; i += n)
        cnt[i] = 0u;
    if (zs.p)
        for (long long s = 0; s < rt.S; s++) {
            const long long m = s / rt.topk, j = s - m * rt.topk;
            if (moe_slot_expert(rt, m, j) >= 0)
                continue;
            for (long long c = tid; c < zs.width; c += n)
                mfm_store(zs.p, zs.dt, m * zs.s0 + j * zs.s1 + c, 0.0f);
        }
    if (zt.p)
        for (long long m = 0; m < M; m++) {
            bool any = false;
            for (long long j = 0; j < rt.topk && !any; j++)
                any = moe_slot_expert(rt, m, j) >= 0;
            if (any)
                continue;
            for (long long c = tid; c < zt.width; c += n)
                mfm_store(zt.p, zt.dt, m * zt.s0 + c, 0.0f);
        }
}

/* The decode kernels exist (sm_90a built) and this device can run them (9.0, clusters). */
int moe_fp8_dec_usable(const cuda_state *s);
/* Blocks sharing the depth of each tile: from the shapes alone (gate and final alike). */
int moe_fp8_dec_split(cuda_state *s, int gate, long long tiles_est, long long nblk,
                      long long nkb);
/* Bytes of the split sums' buffer for `clusters` clusters of `split` blocks (0 unsplit). */
size_t moe_fp8_dec_part_bytes(int gate, int clusters, int split);
/* Persistent clusters for `items` work items of `split` blocks each: no more than fit. */
int moe_fp8_dec_clusters(cuda_state *s, int gate, long long items, int split);
moefuse_status moe_fp8_dec_route(moefuse_context *ctx, cuda_state *s, const char *op,
                                 const Fp8DecRoute *r);
/* One GEMM (g->epi says which); with g NULL only make the kernels ready. */
moefuse_status moe_fp8_dec_launch(moefuse_context *ctx, cuda_state *s, const char *op, int gate,
                                  const Fp8Gemm *g, const Fp8DecExtra *x);

#endif /* MOEFUSE_CUDA_MOE_FP8_DECODE_H */
