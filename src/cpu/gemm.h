/*
 * Blocked f32 GEMM tiles for the MoE kernels: C[ms, ncols] = A * B^T where the
 * ms rows of A are gathered activations and the ncols columns of B are weight
 * rows of one expert, both converted to f32 while packing.
 *
 * Every output element is one dot product accumulated with fmaf in the fixed
 * order k = 0, 1, ..., K-1 starting from 0.0f, whatever the blocking, the
 * vector width or the thread count; a dot product is never split between
 * threads. fmaf is exactly rounded everywhere, so the result is the same on
 * every machine (the CPU dispatch only changes speed).
 */
#ifndef MOEFUSE_CPU_GEMM_H
#define MOEFUSE_CPU_GEMM_H

#include "moefuse.h"

#include <stdint.h>

#define MF_GEMM_MR 6    /* rows of the register tile */
#define MF_GEMM_NR 16   /* columns of the register tile (vector lanes) */
#define MF_GEMM_KC 256  /* depth of one cache block */
#define MF_GEMM_MB 132  /* most rows of A per work item (multiple of MR) */
#define MF_GEMM_NB 128  /* columns of B per work item (multiple of NR) */
/*
 * Tiles of up to this many A rows stream the weights unpacked where the level has a stream tile
 * (gemm_stream_x86.h): for a few dozen rows, packing the weights costs more than the products.
 * The tile takes the level's rows in groups (AVX2 4, AVX-512 8: gemm_stream_x86.h's GS_MS),
 * 16 columns at a time; with more rows, every group multiplies one transposed
 * panel of those columns (gemm_stream_x86.h). With that panel, 64-row tiles stream faster than
 * they pack (2-core Zen 4, Mixtral M=256: bf16 -7 to -14%, f32 -5%); before it, 48-row tiles
 * were faster packed. An expert's slots go in tiles of near-equal size of at most MF_GEMM_MB
 * (moe_slots.c), so that 64 slots are one streamed tile and 128 one packed tile (132 rows:
 * 10-14% faster than 72 at 128 slots an expert).
 */
#define MF_GEMM_STREAM_TILE 64
/* Depth of one streamed block: long runs of each weight row, which the hardware prefetchers
 * follow (one thread, bf16 rows of 4096: 4.6 G weights a second at 256, 6.3 at 4096); the A
 * rows of a block fit the tile scratch's a_pack (MF_GEMM_A_PACK floats). */
#define MF_GEMM_STREAM_KC 2048
/*
 * Row stride of a streamed block's A rows in a_pack: a block of depth kc plus one cache line.
 * At kc floats apart, rows of 1024 or 2048 were a multiple of 4 KiB apart and fell in one set
 * of the 8-way L1 with the weight rows, which are often so too: one thread, 8 rows x 16
 * columns x 2048 f32 weights from L2, 28 -> 60 GFLOP/s (2-core EPYC, Zen 4).
 */
#define MF_GEMM_STREAM_LDA(kc) ((kc) + 16)

/* Floats of a_pack: a cache block of MB packed rows, or a streamed block of a tile's rows. */
#define MF_GEMM_A_PACK                                                                           \
    (MF_GEMM_MB * MF_GEMM_KC > MF_GEMM_STREAM_TILE * MF_GEMM_STREAM_LDA(MF_GEMM_STREAM_KC)        \
         ? MF_GEMM_MB * MF_GEMM_KC                                                                \
         : MF_GEMM_STREAM_TILE * MF_GEMM_STREAM_LDA(MF_GEMM_STREAM_KC))

/* Per-thread scratch of one tile computation. */
typedef struct mf_gemm_scratch {
    float *a_pack; /* MF_GEMM_A_PACK */
    float *b_pack; /* NB * KC */
    float *tmp;    /* NR * KC */
} mf_gemm_scratch;

/*
 * c[ms x ncols] (row stride round_up(ncols, NR)) = rows of A times the
 * ncols B rows of expert `lead` (b [E, N, depth]), over depth. A row ids are
 * slots s = m * topk + j: a_rank3 reads h [M, k, depth] at (m, j), otherwise
 * x [M, depth] at m.
 */
void mf_gemm_tile(const moefuse_tensor *a, int a_rank3, int64_t topk, const int64_t *a_rows,
                  int64_t ms, const moefuse_tensor *b, int64_t lead, const int64_t *b_rows,
                  int64_t ncols, int64_t depth, float *c, mf_gemm_scratch *s);

#endif /* MOEFUSE_CPU_GEMM_H */
