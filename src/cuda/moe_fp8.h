/*
 * What the FP8 MoE files of the CUDA backend share: the launchers of the portable kernel
 * (moe_fp8_portable.cu) that the host side (moe_fp8.cu) strings together, and the choice of
 * FP8 GEMM. Only .cu files include this (C++, C style); the parameter blocks are in fp8.cuh.
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_H
#define MOEFUSE_CUDA_MOE_FP8_H

#include "cuda/fp8.cuh"

/* FP8 GEMM kernels; s->fp8_gemm holds the one MOEFUSE_CUDA_FP8 forces, or FP8_GEMM_AUTO. */
enum fp8_gemm_kind {
    FP8_GEMM_AUTO = 0,     /* by device and shape: decode or wgmma on sm_90a, else portable */
    FP8_GEMM_PORTABLE = 1, /* moe_fp8_portable.cu: exact, any sm_80+ */
    FP8_GEMM_WGMMA = 2,    /* the Hopper kernel (moe_fp8_ws.cu) */
    FP8_GEMM_DECODE = 3    /* the decode kernel (moe_fp8_decode.cu) wherever it can run */
};

/* How the Hopper kernel loads A; s->fp8_a holds the one MOEFUSE_CUDA_FP8_A forces, or AUTO. */
enum fp8_a_load {
    FP8_A_AUTO = 0,   /* TMA where A lies in place (masked) or its copy pays (fp8_ws_a_copied) */
    FP8_A_GATHER = 1, /* every row by cp.async through the slot list */
    FP8_A_TMA = 2     /* TMA wherever the rows are 16-byte aligned, routed rows copied first */
};

/* One GEMM on the portable kernel: tiles of bm rows (8 or 32; the final also 64), gate or
 * final epilogue as p->epi says. */
extern "C" moefuse_status fp8_launch_portable(moefuse_context *ctx, cuda_state *s, const char *op,
                                              int bm, int gate, const Fp8Gemm *p);
/* The gate's rows no tile writes: invalid slots (rt->ids non-NULL) and the scales' padding
 * rows [rows, rows_padded) of `blocks` expert blocks. hq: h [M, k, I] or [E, Tmax, I]. */
extern "C" moefuse_status fp8_launch_gate_fill(moefuse_context *ctx, cuda_state *s,
                                               const char *op, const MoeRoute *rt,
                                               const moefuse_tensor *hq, const Fp8HOut *h,
                                               long long rows, long long rows_padded,
                                               long long blocks);

#endif /* MOEFUSE_CUDA_MOE_FP8_H */
