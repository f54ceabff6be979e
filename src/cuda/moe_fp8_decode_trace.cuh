/*
 * Development timeline of the FP8 decode GEMM (-DMOE_DEC_TRACE only, never in a normal build):
 * one lane of each role stamps clock64() at the edges of each of its block's first
 * DEC_TRACE_ITEMS items, and the host writes the stamps of one launch of each kernel to a
 * file (moe_fp8_decode.cu; MOEFUSE_DEC_TRACE names it; tools/dec_trace.py reads it). The
 * stamps of one block share an SM clock, so each role's edges can be set against the others'.
 * Nothing clears them: blocks and items the dumped launch did not reach keep the stamps of
 * earlier launches, so a process traces one shape.
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_DECODE_TRACE_CUH
#define MOEFUSE_CUDA_MOE_FP8_DECODE_TRACE_CUH

#define DEC_TRACE_BLOCKS 512
#define DEC_TRACE_ITEMS 8
#define DEC_TRACE_STAGES 6 /* the first stages of an item stamped */

enum dec_trace_event {
    DT_C_TOP = 0,  /* consumers, warpgroup 0 (then 1): an item's loop top */
    DT_C_TILE = 2, /* the tile's rows known (after warp 0's lookup and the barrier) */
    DT_C_WIN0,     /* the first scale window stored */
    DT_C_END,      /* the stream done, warpgroup 0 (then 1) */
    DT_C_EPI = 6,  /* the epilogue done (the reduced final: y handed to the sums warp), 0 / 1 */
    DT_C_FULL = 8, /* stage i full, i < DEC_TRACE_STAGES */
    DT_P_START = DT_C_FULL + DEC_TRACE_STAGES, /* producer: an item's start */
    DT_P_TILE,                                  /* its tile looked up */
    DT_P_EMPTY,                                 /* stage i free, i < DEC_TRACE_STAGES */
    DT_S_START = DT_P_EMPTY + DEC_TRACE_STAGES, /* the reduced final's sums warp: item start */
    DT_S_WAIT,                                  /* counted, waiting for the consumers' y */
    DT_S_GOT,                                   /* y stored */
    DT_S_FREED,                                 /* counted the arrivals, slot given back */
    DT_S_END,                                   /* the top-k sums done */
    DT_EVENTS
};

#ifdef MOE_DEC_TRACE
/* [kernel: 0 final, 1 gate][block][item][event] */
__device__ unsigned long long dec_trace[2][DEC_TRACE_BLOCKS][DEC_TRACE_ITEMS][DT_EVENTS];
#define DEC_STAMP(gate, item, ev)                                                                  \
    do {                                                                                           \
        if ((item) < DEC_TRACE_ITEMS && blockIdx.x < DEC_TRACE_BLOCKS)                             \
            dec_trace[gate][blockIdx.x][item][ev] = (unsigned long long)clock64();                 \
    } while (0)
#else
#define DEC_STAMP(gate, item, ev) ((void)(gate), (void)(item), (void)(ev))
#endif

#endif /* MOEFUSE_CUDA_MOE_FP8_DECODE_TRACE_CUH */
