/*
 * What the MoE files of the CUDA backend share: the kernel parameter blocks
 * (passed by value), the tile configurations, and the launchers that
 * moe_ops.cu strings together. Only .cu files include this (C++, C style).
 */
#ifndef MOEFUSE_CUDA_MOE_INTERNAL_H
#define MOEFUSE_CUDA_MOE_INTERNAL_H

#include "cuda/cuda_internal.h"

#include <stdint.h>
#include <string.h>

#define MOE_MAX_BM 128 /* largest tile height (slots per tile) of any configuration */
#define MOE_BK 64      /* elements of depth per stage: 128 bytes per row */

/* Where a block finds its slots; see moe_kernels.cuh. */
typedef struct MoeRoute {
    const int32_t *ids; /* topk_ids [M, k] */
    int64_t ids_s0;
    const int32_t *map; /* expert_map [E_global] or NULL */
    int64_t map_s0;
    int64_t topk, S, E, Eg; /* k, M * k, local and global experts */
    int direct;             /* 1: S <= 16 and blocks route themselves (no route kernels) */
    /* routed mode: what moe_route() wrote */
    const long long *offs;  /* [E + 1] first list entry of each expert */
    const long long *tiles; /* [E + 1] first tile of each expert (tiles of BM slots) */
    const int *tile_expert; /* [tiles bound] expert of each tile */
    const long long *list;  /* [S] valid slots grouped by expert */
} MoeRoute;

/* A MoeRoute of a's slots: ids, expert map, k, S = M * k and the expert counts; the routed
 * mode's buffers NULL, for the caller to set. */
static inline MoeRoute mf_route_of(const mf_moe_args *a)
{
    MoeRoute rt;
    memset(&rt, 0, sizeof rt);
    rt.ids = (const int32_t *)mf_cuda_base(&a->topk_ids);
    rt.ids_s0 = a->topk_ids.stride[0];
    rt.map = a->expert_map.data ? (const int32_t *)mf_cuda_base(&a->expert_map) : NULL;
    rt.map_s0 = a->expert_map.data ? a->expert_map.stride[0] : 0;
    rt.topk = a->topk;
    rt.S = a->tokens * a->topk;
    rt.E = a->experts;
    rt.Eg = a->global_experts;
    return rt;
}

/*
 * One GEMM of the layer: gate (out = h) or final (out = y f32 scratch, or the
 * un-reduced output). Offsets and strides are in elements.
 */
typedef struct MoeGemm {
    MoeRoute rt;
    const void *a;       /* activations: slot s = m * k + j reads a + m * a_s0 + j * a_s1 */
    int64_t a_s0, a_s1;  /* x: (stride, 0); h: (stride[0], stride[1]) */
    const void *w;       /* weights: row r of expert e at w + e * w_s0 + r * w_s1 */
    int64_t w_s0, w_s1;
    int64_t depth;       /* K (gate) or I (final) */
    int64_t ncols;       /* I (gate: h columns) or K (final) */
    int64_t nblk;        /* column blocks */
    int64_t gate_row, up_row; /* gate: w1 / b1 row of gate value 0 and of up value 0 */
    int64_t row_step;    /* gate: rows between values i and i + 1 (2 interleaved, else 1); final 1 */
    const void *bias;    /* b1 / b2 [E, rows] or NULL */
    int64_t bias_s0;
    int bias_dt;
    void *out;           /* row of slot s at out + m * o_s0 + j * o_s1 */
    int64_t o_s0, o_s1;
    int out_dt;
    int act;
    float alpha, limit, up_offset; /* the gate's activation (moefuse_moe_options) */
    int vec_a, vec_b;    /* rows and strides allow 16-byte cp.async */
    int vec_out;         /* out rows start 4-element aligned: the epilogue stores 4 at once */
    int zero_invalid;    /* direct mode: zero the out rows of invalid slots */
    /*
     * Direct mode on sm_90 (moe_mma.cu): each (expert, column block) is a cluster of split
     * blocks (blockIdx.x = nb * split + rank), rank r multiplying depth tiles
     * [r * ceil(KT / split), ...); rank 0 adds the others' f32 partial tiles to its own in
     * rank order and runs the epilogue. 0 or 1: the whole depth in one block.
     */
    int split;
    long long lin_bound; /* routed mode: tile indices to cover */
    /*
     * Reduced final (fuse = 1): out holds y in f32, and the last block to
     * write its rows of a (token, column block) sums them there in slot
     * order into rout. cnt counts the arrivals (zeroed before the launch);
     * tok_valid (routed) / the slot mask (direct) say how many to expect.
     */
    int fuse;
    unsigned *cnt;         /* [M, nblk] */
    const int *tok_valid;  /* routed: [M] valid slots of each token */
    const int *expert_of;  /* routed: [S] local expert of each slot, -1 invalid */
    const float *tw;       /* topk_weights [M, k] */
    int64_t tw_s0;
    void *rout;            /* out [M, K] */
    int64_t rout_s0;
    int rout_dt;
    unsigned *tile_ctr;    /* moe_ws.cu: next tile to hand out (zeroed before the launch) */
    unsigned *zero_cnt;    /* gate of a direct-mode forward: zero these counters first */
    long long zero_cnt_n;
    /*
     * Programmatic dependent launch (sm_90, moe_forward): the gate lets the
     * final launch early (trigger); the final (pdl) fetches its tile and
     * prefetches its weight stages, then waits for the gate before reading h
     * (moe_ws.cu's producer waits first, before its first tile).
     */
    int trigger, pdl;
} MoeGemm;

/* The decode configuration (MOE_MMA_S): weight rows per block, warps, stages, blocks per SM. */
#ifndef MOE_S_BN
#define MOE_S_BN 64
#define MOE_S_WN 4
#define MOE_S_STAGES 6
#define MOE_S_MINB 3
#endif

/* Most blocks sharing a decode tile's depth (a cluster; 8 is the portable cluster size). */
#define MOE_SPLIT_MAX 8

/* Tile configurations; moe_ops.cu picks one per call from the shapes alone. */
enum moe_cfg {
    MOE_SIMT16 = 0, /* f32: 16 slots x 64 weight rows, FMA */
    MOE_SIMT64,     /* f32: 64 x 64 */
    MOE_MMA_S,      /* bf16/f16 decode: 16 x MOE_S_BN, MOE_S_WN warps, MOE_S_STAGES stages */
    MOE_MMA_M,      /* 64 x 128, 4 warps, 4 stages */
    MOE_MMA_L,      /* 128 x 128, 8 warps, 3 stages */
    MOE_WGMMA_L,    /* sm_90a: 128 x 256, 2 warpgroups, wgmma, 4 stages (moe_wgmma.cu) */
    MOE_WS_L,       /* sm_90a: the same tile, warp-specialised and persistent (moe_ws.cu) */
    MOE_CFG_COUNT
};

int moe_cfg_bm(int cfg);            /* slots per tile */
int moe_cfg_cols(int cfg, int gate); /* output columns per block (h columns for the gate) */

/* Launch one GEMM (grid from p->rt.direct, p->nblk and p->lin_bound). With p NULL, only
 * make the kernel ready (check and raise its shared-memory limit) and launch nothing: a call
 * does that before its first write, so that a refusal there leaves the outputs untouched. */
moefuse_status moe_launch_mma(moefuse_context *ctx, cuda_state *s, const char *op, int cfg,
                              int gate, int f16, const MoeGemm *p);
/* Hopper kernels: built (sm_90a in the targets) and the device is compute capability 9.0. */
int moe_wgmma_usable(const cuda_state *s);
moefuse_status moe_launch_wgmma(moefuse_context *ctx, cuda_state *s, const char *op, int gate,
                                int f16, const MoeGemm *p);
/* The warp-specialised kernel: also the tensor-map encoder and the shared memory it needs.
 * A launch it cannot take (unaligned A rows, weights TMA cannot describe, the interleaved
 * gate order, whose rows its 128-row boxes would mix) goes to moe_launch_wgmma: the same tile
 * and bits. */
int moe_ws_usable(const cuda_state *s);
moefuse_status moe_launch_ws(moefuse_context *ctx, cuda_state *s, const char *op, int gate,
                             int f16, const MoeGemm *p);
moefuse_status moe_launch_simt(moefuse_context *ctx, cuda_state *s, const char *op, int cfg,
                               int gate, const MoeGemm *p);
/* The reduced final's top-k sum of y [M * k, K] f32 into a->out, slot validity from expert_of
 * (moe_reduce.cu): routed bf16, f16 and f32 finals and every reduced FP8 final. */
moefuse_status moe_launch_reduce(moefuse_context *ctx, cuda_state *s, const char *op,
                                 const float *y, const int *expert_of, const mf_moe_args *a);

/* Route buffers inside the call's scratch (moe_ops.cu lays them out). */
typedef struct MoeRouteBufs {
    unsigned long long *count; /* [E] */
    unsigned long long *fill;  /* [E] */
    long long *offs;           /* [E + 1] */
    long long *tiles;          /* [E + 1] */
    int *tile_expert;          /* [tiles bound] */
    long long *list;           /* [S] */
    int *expert_of;            /* [S] */
    unsigned *cnt;             /* [M, nblk] fused-reduction arrivals (zeroed with count) */
    size_t cnt_n;              /* with the tile counters, when there are any */
    unsigned *tile_ctr;        /* [2] tile counters of moe_ws.cu, gate and final, or NULL:
                                * the last two of cnt, zeroed with it */
    int *tok_valid;            /* [M] valid slots per token */
} MoeRouteBufs;

/* A tensor whose rows of invalid slots the count kernel zeroes: [M, k, width]. */
typedef struct MoeZero {
    void *p; /* NULL: nothing to zero */
    int64_t s0, s1, width;
    int dt;
} MoeZero;

/*
 * count (zero invalid rows of zero; count valid slots per token, zero the
 * rows of zero_tok [M, width] of tokens without any), scan (tiles of bm
 * slots), fill: four stream operations.
 */
moefuse_status moe_route(moefuse_context *ctx, cuda_state *s, const char *op, const MoeRoute *rt,
                         const MoeRouteBufs *b, int bm, int64_t M, const MoeZero *zero,
                         const MoeZero *zero_tok);

#endif /* MOEFUSE_CUDA_MOE_INTERNAL_H */
