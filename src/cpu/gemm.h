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
 * (gemm_stream_x86.h): packing every weight twice before the products costs more than the
 * stream's transposes. The tile takes the level's rows in groups (AVX2 4, AVX-512 8:
 * gemm_stream_x86.h's GS_MS), 16 columns at a time (AVX-512: 32 for tiles of more than 32 rows);
 * with more rows than a group, every group multiplies one transposed panel of those columns.
 * Equal to MF_GEMM_MB, so that at the vector levels every tile of f32 or bf16 weights streams:
 * on the 2-core Zen 5, Mixtral M=256 (tiles of 64 +- 10 slots) took 541-562 ms f32 and 474-476 ms
 * bf16 against 626 and 582 ms with the tiles of more than 64 packed. An expert's slots go in
 * tiles of near-equal size of at most MF_GEMM_MB (moe_slots.c).
 */
#define MF_GEMM_STREAM_TILE MF_GEMM_MB
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
    /* What a_pack holds for the stream tile: a's rows a_rows[0..a_ms) over the whole depth,
     * widened once for the next tiles of the same slots (NULL a_from: nothing). The caller
     * sets a_from to NULL whenever a's data may have changed since (a new call). */
    const moefuse_tensor *a_from;
    const int64_t *a_rows;
    int64_t a_ms, a_depth;
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
