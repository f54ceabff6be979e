/*
 * The plan of an FP8 MoE call (moe_fp8_plan.cu), which the host side (moe_fp8.cu) follows:
 * the kernel, the tile height, and the offsets of the call's buffers in its scratch. Only .cu
 * files include this.
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_PLAN_H
#define MOEFUSE_CUDA_MOE_FP8_PLAN_H

#include "cuda/moe_fp8.h"

typedef struct fp8_plan {
    int gate, bm, quant_x, reduce;
    int wgmma;     /* the Hopper kernel, when the call's operands also suit it (ws_suits) */
    int dense_a;   /* wgmma: A's scales are copied to f32 rows first (not row-major f32) */
    int64_t mtiles; /* wgmma, masked: bound of the m-tiles of F8_BM rows */
    size_t off_ws_tiles, off_ws_start, off_ws_end, off_ws_tile_expert, off_ws_ctr, off_ws_sc;
    int copy_a;      /* wgmma, routed: A's rows copied into list order for TMA (fp8_ws_a_copied) */
    size_t off_ws_a; /* and where */
    int64_t S, rows, blocks; /* slots (routed) or Tmax (masked); expert blocks of x (1 routed) */
    int64_t tiles_bound;
    size_t off_count, off_fill, off_offs, off_tiles, off_tile_expert, off_expert_of, off_list;
    size_t off_tok_valid, off_qscratch, off_xq, off_xs, off_y, bytes;
    size_t qscratch;
    mf_rows_args q; /* x's quantization (quant_x), data set at the call */
    /* the decode kernel: its mode, split and grid, its tiles and the reduced final's counters */
    int dec, dec_mode, dec_split, dec_clusters;
    long long dec_tiles_bound;
    size_t off_dec_ntiles, off_dec_tiles, off_dec_list, off_dec_arrivals, off_dec_part;
} fp8_plan;

/* The plan of a call of moe_gate_fp8 (gate 1) or moe_final_fp8 (gate 0) into *pl; with
 * a->layer, a gate's scratch is sized for its layer's final too. Fails only on a scratch size
 * that overflows size_t. */
moefuse_status fp8_plan_call(moefuse_context *ctx, cuda_state *s, const char *op,
                             const mf_moe_args *a, int gate, fp8_plan *pl);
/* Whether a routed GEMM on the Hopper kernel copies A's rows into list order for TMA. */
int fp8_ws_a_copied(const cuda_state *s, int gate, const mf_moe_args *a);
/* Rows of the A operand's scales: x's tokens (routed gate), slots (routed final), Tmax. */
int64_t fp8_a_rows(const mf_moe_args *a, const fp8_plan *pl);

#endif /* MOEFUSE_CUDA_MOE_FP8_PLAN_H */
