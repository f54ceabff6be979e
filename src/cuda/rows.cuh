/*
 * The row kernels' shared definitions (rows.cu): their launch shapes and rows_params,
 * the arguments of every row kernel.
 */
#ifndef MOEFUSE_CUDA_ROWS_CUH
#define MOEFUSE_CUDA_ROWS_CUH


#include "cuda/act_table.cuh"
#include "cuda/cuda_internal.h"
#include "cuda/numerics.cuh"
#include "cuda/pdl.cuh"
#include "cuda/vec.cuh"

#include <float.h>
#include <string.h>

#define MF_WARPS 8 /* warps per block */
#define MF_THREADS (MF_WARPS * 32)
/*
 * Blocks per SM asked of ptxas (__launch_bounds__), which caps registers:
 * the silu and quant kernels fit 80 registers without spilling at 3 (24
 * warps per SM); the gelu forms (double-precision erf/tanh) get 2.
 */
#ifndef MF_BLOCKS_PER_SM
#define MF_BLOCKS_PER_SM 3
#endif
#define MF_BLOCKS_ANY 2
/*
 * The table kernels run one block per SM (its activation table, 32 KiB, is
 * shared by all its warps): MF_TAB_WARPS warps, each with a ring of
 * MF_STAGES items of 4 KiB (bf16 gate and up). The table's halves lie 128 KiB
 * apart (act_table.cuh) with rings between them (by default 14 of 20, 6 after:
 * 192 KiB) under the 227 KiB of an H100 with room for the row offsets of 4096
 * experts.
 */
#ifndef MF_TAB_WARPS
#define MF_TAB_WARPS 20
#endif
#define MF_TAB_THREADS (MF_TAB_WARPS * 32)
#define MF_ITEM 512           /* channels of one warp item of the direct kernels */
#define MF_SMEM_EXPERTS 4096  /* row offsets of up to this many experts in shared memory */
#define MF_SMEM_BYTES (46 * 1024) /* dynamic shared memory without opt-in, some left static */
#define MF_FULL 0xFFFFFFFFu

typedef struct rows_params {
    const char *x;          /* x[e, t, c] at x + (e xs0 + t xs1 + c) * xes */
    int64_t xs0, xs1, xes;
    int64_t goff, uoff;     /* channel of gate value 0 / up value 0 inside a row */
    int64_t cstep;          /* channels between values i and i + 1: 2 interleaved (only the
                               direct kernels, which load by channel, take it), else 1 */
    const char *rs;         /* row_scale[e, t] f32, or NULL */
    int64_t rss0, rss1;
    const char *es;         /* expert_scale[e] f32/bf16, or NULL */
    int64_t ess0;
    const int32_t *counts;  /* [E] or NULL (2-D: all T rows valid, E = 1) */
    int64_t cs0;
    const int64_t *offs_g;  /* row offsets in global memory when E > MF_SMEM_EXPERTS */
    char *q;                /* codes (or act_mul's out): q + (e qs0 + t qs1 + c) * qes */
    int64_t qs0, qs1, qes;
    char *sc;               /* scales: f32, u8 or i32 words, strides in elements */
    int64_t ss0, ss1;
    int64_t E, T, H, Gn, Gw, chunks;
    int glog;               /* log2 G (G in 32, 64, 128), else 0 */
    int lpg;                /* lanes per group: G / 8 */
    float limit, eps, alpha, beta; /* alpha: silu_alpha's; beta: the up offset (0: none) */
    int xdt, qdt, esdt, act, activate, round_bf16, has_rs, has_es;
    int fp8, ue8m0, layout, sc_f32;
    int vec_x, vec_q;       /* 16-byte x loads / 8-byte (quant) or 16-byte (act_mul) stores */
    const float *atab;      /* the activation's table (act_table.cuh) for the table kernels */
} rows_params;


#endif /* MOEFUSE_CUDA_ROWS_CUH */
