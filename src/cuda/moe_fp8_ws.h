/*
 * The Hopper FP8 GEMM of the MoE layer (moe_fp8_ws.cu): what the host fills in and the launch.
 * One GEMM: the gate (x @ w1^T, activation and the FP8 quantization of h in the epilogue) or
 * the final (h @ w2^T into y). Included by .cu files only (C++, C style).
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_WS_H
#define MOEFUSE_CUDA_MOE_FP8_WS_H

#include "cuda/cuda_internal.h"

#include <stdint.h>

#define F8_BM 64   /* rows (slots) of a tile */
#define F8_BK 128  /* depth of a stage: one scale block, 128 bytes of every row */

/* Where a group scale goes (the gate's h scales) or comes from. */
typedef struct Fp8ScaleView {
    void *p;
    int kind;              /* 0: f32, 1: u8 exponent, 2: packed i32 (byte g % 4 of word g / 4) */
    int column_major;      /* element [g, t] (column-major and packed) rather than [t, g] */
    int64_t s0, s1, s2;    /* element strides of the rank-3 view [lead, ., .] */
} Fp8ScaleView;

typedef struct MoeFp8Ws {
    /*
     * Tiles: expert e owns list entries [row_start[e], row_end[e]) and m-tiles
     * [tiles[e], tiles[e + 1]) of F8_BM entries; tile_expert[t] is the expert of m-tile t.
     * Linear tile lin covers m-tile lin / nblk's expert ... (the route's order: expert, column
     * block, m-tile fastest), taken from *tile_ctr (zeroed before the launch).
     */
    const long long *tiles;
    const int *tile_expert;
    const long long *row_start, *row_end; /* routed: the route's offs and offs + 1 */
    const long long *list;                /* routed: the slot of each entry; NULL: entry = row */
    long long E, nblk, lin_bound;
    long long div;                        /* row id = p * div + q: k (routed), Tmax (masked) */
    unsigned *tile_ctr;
    /* A: codes of row (p, q) at a + p * a_s0 + q * a_s1 (bytes), scales f32 at
     * a_sc[(p * sc_s0 + q * sc_s1) * nkb + block] */
    const uint8_t *a;
    long long a_s0, a_s1;
    const float *a_sc;
    long long sc_s0, sc_s1;
    long long nkb; /* depth / 128 */
    /* B: weights as a tensor map (moe_fp8_ws.cu), block scales f32 or u8 at [e, row/128, kb] */
    const uint8_t *w;
    long long w_s0, w_s1; /* bytes */
    const void *w_sc;
    int w_sc_u8;
    long long wsc_s0, wsc_s1; /* elements; the innermost stride is 1 */
    long long ncols;          /* gate: I (h columns); final: K */
    long long gate_row, up_row;
    const void *bias;
    int bias_dt;
    long long bias_s0;
    int act;
    float limit;
    /* gate: h codes of row (p, q) at h + p * h_s0 + q * h_s1 (bytes); scale of (row, group)
     * in hs at lead p (masked) or 0 with row p * div + q (routed) or q (masked) */
    uint8_t *h;
    long long h_s0, h_s1;
    Fp8ScaleView hs;
    int masked;
    int ue8m0;
    float eps;
    /* final: y of row (p, q) at out + p * o_s0 + q * o_s1 (elements), dtype out_dt */
    void *out;
    int out_dt;
    long long o_s0, o_s1;
} MoeFp8Ws;

/* The kernel is built (sm_90a) and this device and driver can run it. */
int moe_fp8_ws_usable(const cuda_state *s);
/* Launch one GEMM; with p NULL only make the kernel ready (its shared-memory limit). */
moefuse_status moe_fp8_ws_launch(moefuse_context *ctx, cuda_state *s, const char *op, int gate,
                                 const MoeFp8Ws *p);

#endif /* MOEFUSE_CUDA_MOE_FP8_WS_H */
