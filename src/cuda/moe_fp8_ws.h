/*
 * The Hopper FP8 GEMM of the MoE layer (moe_fp8_ws.cu): the launch, and what it needs beyond
 * Fp8Gemm (fp8.cuh): a persistent kernel's tile table and the A rows' scales as f32, which
 * moe_fp8_ws_prep.cu makes. Included by .cu files only (C++, C style).
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_WS_H
#define MOEFUSE_CUDA_MOE_FP8_WS_H

#include "cuda/fp8.cuh"

#include <cuda.h>

#define F8_BM 128 /* rows (slots) of a tile: the route's tile height on this path */
#define F8_BK 128 /* depth of a stage: one scale block, 128 bytes of every row */

typedef struct Fp8WsExtra {
    /*
     * Expert e owns list entries [row_start[e], row_end[e]) and m-tiles [tiles[e],
     * tiles[e + 1]) of F8_BM entries; tile_expert[t] is the expert of m-tile t. Routed: the
     * route's offs (offs and offs + 1), tiles and list; masked: moe_fp8_ws_masked_tiles's,
     * list NULL (entry = row e * Tmax + t).
     */
    const long long *tiles;
    const int *tile_expert;
    const long long *row_start, *row_end;
    const long long *list;
    long long nblk;      /* column tiles: I / 128 (gate, h columns), ceil(K / 256) (final) */
    long long lin_bound; /* linear tiles to cover (m-tiles bound x column blocks) */
    unsigned *tile_ctr;  /* zeroed before the launch */
    long long div;       /* entry row = p * div + q: (m, j) with div = k, or (e, t) with Tmax */
    /* the f32 scale of A row (p, q), depth block b: a_sc[p * sc_p + q * sc_q + b] */
    const float *a_sc;
    long long sc_p, sc_q;
    /*
     * A by TMA (a_tma 1): entry row r is row r % tma_rows of block r / tma_rows of a tensor
     * [tma_blocks, tma_rows, depth] of codes (row stride tma_row_s, block stride tma_block_s
     * bytes), its scales f32 [tma_blocks, depth / 128, tma_rows_pad] (a stage's 128 rows
     * consecutive; 128 floats readable past the end). Routed: the rows copied into list order
     * (moe_fp8_ws_a_copy); masked: x or h itself. a_tma 0: the rows gathered by cp.async with
     * the scales above.
     */
    int a_tma;
    const uint8_t *tma_a;
    long long tma_rows, tma_blocks, tma_row_s, tma_block_s;
    const float *tma_sc;
    long long tma_rows_pad;
} Fp8WsExtra;

/* What moe_fp8_ws_a_copy reads: A's codes and scales at entry (p, q) as the gather does. */
typedef struct Fp8WsASource {
    const uint8_t *a;
    long long a_s0, a_s1;
    Fp8ActScales as;
    long long div;     /* entry row = p * div + q */
    int scale_by_p;    /* scale row p (the gate's x: a token) rather than p * div + q */
} Fp8WsASource;

/* The kernel is built (sm_90a) and this device and driver can run it. */
int moe_fp8_ws_usable(const cuda_state *s);
/*
 * The weights of g as a 3-D byte tensor map [E, rows, depth] in boxes of box_rows rows x 128
 * bytes, swizzled by 128 bytes (16-byte chunk c of row r at c ^ (r % 8)); with map NULL only
 * whether the driver would take it (it cannot without 16-byte aligned rows).
 */
int moe_fp8_weights_map(const cuda_state *s, const Fp8Gemm *g, int gate, unsigned box_rows,
                        CUtensorMap *map);
/* The weights of g as a TMA tensor map: 0 when the driver cannot describe them. */
int moe_fp8_ws_weights_ok(const cuda_state *s, const Fp8Gemm *g, int gate);
/* Launch one GEMM (g->epi says which); with g NULL only make the kernel ready. */
moefuse_status moe_fp8_ws_launch(moefuse_context *ctx, cuda_state *s, const char *op, int gate,
                                 const Fp8Gemm *g, const Fp8WsExtra *x);
/* The masked layout's tile table from the counts (device data, clamped to [0, Tmax]). */
moefuse_status moe_fp8_ws_masked_tiles(moefuse_context *ctx, cuda_state *s, const char *op,
                                       const Fp8Gemm *g, long long *tiles, int *tile_expert,
                                       long long *row_start, long long *row_end);
/*
 * Whether A as x describes it (tma_* set, a_tma ignored) can be loaded by TMA: 16-byte aligned
 * rows and a driver that takes the two tensor maps.
 */
int moe_fp8_ws_a_tma_ok(const cuda_state *s, const Fp8WsExtra *x, long long depth);
/*
 * Prepares A for TMA. Routed (list non-NULL): the rows of list entries [0, *count) copied from
 * src into list order at x->tma_a, and their scales; masked (list NULL): only the scales of
 * every (e, t < Tmax), A being used in place. count: the route's offs + E (device data).
 */
moefuse_status moe_fp8_ws_a_copy(moefuse_context *ctx, cuda_state *s, const char *op,
                                 const Fp8WsExtra *x, const Fp8WsASource *src,
                                 const long long *count, long long depth);
/* A rows' scales of any act layout as dense f32 [blocks, rows, groups]. */
moefuse_status moe_fp8_ws_dense_scales(moefuse_context *ctx, cuda_state *s, const char *op,
                                       const Fp8ActScales *v, float *out, long long blocks,
                                       long long rows, long long groups);

#endif /* MOEFUSE_CUDA_MOE_FP8_WS_H */
