/*
 * Hopper (sm_90a) FP8 GEMM of the MoE layer, warp-specialised and persistent, with the
 * DeepSeek-V3 block scaling (docs/NUMERICS.md "FP8 MoE"): e4m3 x e4m3 wgmma, and the f32
 * promotion of every 128-deep block, scaled by the A row's group scale times the weight
 * block's scale, into a second accumulator.
 *
 * Tile: 128 rows (slots) x 256 weight rows, one stage per 128-deep block (128 bytes of every
 * row: the block of the scales). Roles (384 threads, one block per SM):
 *  - producer, warpgroup 0: the weight rows by TMA (four boxes of 64 rows: the gate takes the
 *    gate and up rows of h columns nb * 128 + [0, 64), then of [64, 128)); the A rows by TMA
 *    too where they lie in rows of a tensor (masked, or routed rows copied into list order
 *    first, moe_fp8_plan.cu's fp8_ws_a_copied), with their scales by one bulk copy, else gathered by
 *    cp.async with each row's scale (TMA cannot gather; rows not 16-byte aligned by byte
 *    loads); and the two weight blocks' scales, read a stage ahead by one thread. All beside
 *    the stage in shared memory: loaded from global memory by the consumers a stage ahead,
 *    the scales cost 10-13% of the layer (docs/PERFORMANCE.md).
 *  - consumers, warpgroups 1 and 2: warpgroup w owns rows [64 w, 64 w + 64) of the tile and
 *    multiplies them by the 256 weight rows in two waves of 128 (wgmma m64n128k32, four per
 *    wave, the first overwriting the wave accumulator); after each wave it waits and promotes:
 *    main = fmaf(block, sa * sw, main). While one warpgroup promotes, the other's wgmma run.
 *    A wave accumulator of 64 registers and a main one of 128 per thread: a 256-wide single
 *    wave would need 256. A half tile (at most 64 slots: an expert's last rows, or all of a
 *    small expert's) is split by waves instead: both warpgroups take its rows 0..63, warpgroup
 *    w wave w only, the same wgmma and promotion for every output on half the tensor work and
 *    with neither warpgroup idle; the gate's two halves meet for each row's amax.
 * Epilogue: gate: bias, clamp and activation, the amax of each row's 128 h columns (a quad
 *    of threads holds a row in a full tile; in a half tile each warpgroup's quad holds 64 of
 *    them, and the two meet in shared memory), the scale, the codes, and the scale stored in
 *    the caller's layout; final: bias and y in the output dtype (or f32 for the reduction).
 *    With A by TMA, producer warps 2 and 3 have nothing to do: there the gate's consumers stop
 *    after the activation, leave h in shared memory and go on to the next tile, and those two
 *    warps (the coders, moe_fp8_ws_codes.cuh) take the amax, the scales and the codes while
 *    the tensor cores run. That costs the pipeline its fourth stage, which measured no loss
 *    (H200, stop 62: 3 stages within 1% of 4 on the routed FP8 layers, 3% faster masked).
 * Scheduler: as moe_ws.cu, tiles from a counter in the route's order.
 */
#include "cuda/moe_fp8_ws.h"
#include "cuda/moe_math.cuh"
#include "cuda/moe_tiles.cuh"
#include "cuda/pdl.cuh"
#include "cuda/wgmma.cuh"

#include <cuda.h>
#include <limits.h>
#include <string.h>

#define F8_BN 256
#ifndef F8_STAGES
#define F8_STAGES 4
#endif
#define F8_THREADS 384
#define F8_CONSUMERS 256
#define F8_A_BYTES (F8_BM * 128)
#define F8_BOX_ROWS 64
#define F8_BOX_BYTES (F8_BOX_ROWS * 128)
#define F8_B_BYTES (F8_BN * 128)
#define F8_STAGE_BYTES (F8_A_BYTES + F8_B_BYTES)
/* the producer threads' cp.async, the TMA bytes, and the weight scales' writer (F8_WSC_THREAD);
 * with A by TMA only the last two */
#define F8_FULL_ARRIVALS (128 + 1 + 1)
#define F8_FULL_ARRIVALS_TMA (1 + 1)
/* the A rows' scales of a stage: with A by TMA, a bulk copy from the 16-byte boundary at or
 * before the tile's first row (F8Tiles shift), so 4 more */
#define F8_SCA_FLOATS (F8_BM + 4)
#define F8_SCA_BYTES (F8_SCA_FLOATS * 4)
#define F8_WSC_THREAD 32 /* a producer thread of another warp than the TMA issuer's */
/* every consumer thread: each one reads the stage's scales (not only wgmma its operands), and
 * its own arrival orders those reads before the producer's next writes */
#define F8_EMPTY_ARRIVALS F8_CONSUMERS
#define F8_BAR 1                   /* named barrier of the consumers */
#define F8_BAR_PRODUCER 2          /* and of the producer warpgroup */
#define F8_TILE_SLOTS 2
/* the epilogue's chunks: F8_CHUNK floats a consumer thread, its own column of the buffer */
#define F8_CHUNK 16
#define F8_BUF_BYTES (F8_CHUNK * F8_CONSUMERS * 4)
#define F8_SMEM (F8_STAGES * F8_STAGE_BYTES + 1024 + F8_BUF_BYTES)
/* the gate with coders (A by TMA): 3 stages and the staging buffer of moe_fp8_ws_codes.cuh,
 * F8_STG_SLOTS floats a consumer thread */
#define F8_STAGES_CODERS 3
#define F8_STG_SLOTS 72
#define F8_STG_BYTES (F8_STG_SLOTS * F8_CONSUMERS * 4)
#define F8_SMEM_CODERS (F8_STAGES_CODERS * F8_STAGE_BYTES + 1024 + F8_STG_BYTES)
#define F8_CODERS 64 /* producer warps 2 and 3 */

/* Whether a kernel has coders, and its dynamic shared memory. */
static constexpr bool f8_coders_on(bool gate, bool atma) { return gate && atma; }
static constexpr size_t f8_smem(bool gate, bool atma)
{
    return f8_coders_on(gate, atma) ? F8_SMEM_CODERS : F8_SMEM;
}

/* Tiles taken by the producer for the consumers, with each row's id (-1 past the tile). */
struct F8Tiles {
    uint64_t full[F8_TILE_SLOTS];  /* an arrival a producer thread: tile and rows written */
    uint64_t empty[F8_TILE_SLOTS]; /* 1 arrival: the consumers have read the slot */
    long long e[F8_TILE_SLOTS], nb[F8_TILE_SLOTS];
    int shift[F8_TILE_SLOTS]; /* A by TMA: the first row's scale at [shift] of a stage's */
    long long row[F8_TILE_SLOTS][F8_BM];
};

/* A tile's h handed from the consumers to the coders (moe_fp8_ws_codes.cuh). */
struct F8Handoff {
    uint64_t full;  /* F8_CONSUMERS arrivals: a tile's h, rows and column block staged */
    uint64_t empty; /* F8_CODERS arrivals: the coders are done with them */
    long long nb;
    int half; /* a half tile: warpgroup w's slots hold h columns 64 w + [0, 64) of rows 0..63 */
    int done; /* no tile is left */
    long long row[F8_BM]; /* each tile row's slot row, -1: none */
};

typedef struct F8Params {
    CUtensorMap map_w;  /* the weights as [E, rows, depth] bytes */
    CUtensorMap map_a;  /* A by TMA: codes [blocks, rows, depth] bytes (Fp8WsExtra tma_*) */
    Fp8Gemm g;
    Fp8WsExtra x;
} F8Params;

#define F8_STATIC_SMEM                                                                           \
    (sizeof(F8Tiles) + sizeof(F8Handoff) + 2 * F8_STAGES * 8 + 64 * 4 +                           \
     F8_STAGES * (F8_SCA_BYTES + 8) + 2 * 64 * 4 + 384)

#ifdef MOE_WGMMA_DEVICE
/* A kernel's stages and producer threads. */
static constexpr int f8_stages(bool gate, bool atma)
{
    return f8_coders_on(gate, atma) ? F8_STAGES_CODERS : F8_STAGES;
}
static constexpr int f8_producers(bool gate, bool atma)
{
    return f8_coders_on(gate, atma) ? 128 - F8_CODERS : 128;
}

/* One stage: d = A (64 rows at a0) x B (128 rows at b0) over 128 bytes of depth, in order. */
static __device__ __forceinline__ void f8_block(float (&d)[64], uint32_t a0, uint32_t b0)
{
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        wgmma_e4m3_m64n128k32(d, wg_desc(a0 + kk * 32), wg_desc(b0 + kk * 32), kk > 0);
    wgmma_commit();
}

/* The tile of linear index lin: expert (-1 when none is left), column block, first list
 * entry and entries (1..F8_BM). */
static __device__ __forceinline__ void f8_tile_at(const Fp8WsExtra &p, long long E,
                                                  long long nblk, long long lin, long long *e,
                                                  long long *nb, long long *first,
                                                  long long *count)
{
    *e = -1, *nb = 0, *first = 0, *count = 0;
    if (lin >= p.tiles[E] * nblk)
        return;
    const long long ee = p.tile_expert[lin / nblk];
    const long long t0 = p.tiles[ee], mtc = p.tiles[ee + 1] - t0;
    const long long r = lin - t0 * nblk, mt = r % mtc;
    *e = ee;
    *nb = r / mtc;
    *first = p.row_start[ee] + mt * F8_BM;
    const long long c = p.row_end[ee] - *first;
    *count = c < F8_BM ? c : F8_BM;
}

/*
 * The weight scale blocks of column block nb: gate, the gate rows' and the up rows' (both
 * waves: h columns nb * 128 + [0, 128) lie in one block); final, wave w's rows nb * 256 +
 * 128 w, whose second block may lie past K (*live_b 0: no scale, its rows are zeros and no
 * column is stored).
 */
template <bool GATE>
static __device__ __forceinline__ void f8_w_blocks(const Fp8Gemm &p, long long nb, long long *rb_a,
                                                   long long *rb_b, bool *live_b)
{
    *rb_a = GATE ? (p.gate_row + nb * 128) / 128 : 2 * nb;
    *rb_b = GATE ? (p.up_row + nb * 128) / 128 : 2 * nb + 1;
    *live_b = GATE || (2 * nb + 1) * 128 < p.ncols;
}

/* The weight rows (the first of each TMA box) of column block nb. */
template <bool GATE>
static __device__ __forceinline__ int f8_box_row(const Fp8Gemm &p, long long nb, int box)
{
    if (GATE)
        return (int)((box & 1 ? p.up_row : p.gate_row) + nb * 128 + (box >> 1) * F8_BOX_ROWS);
    return (int)(nb * F8_BN + box * F8_BOX_ROWS);
}

template <bool GATE, bool ATMA>
static __device__ __forceinline__ void f8_produce(const F8Params &P, uint32_t sbase,
                                                  uint64_t *full, uint64_t *empty, F8Tiles &tl,
                                                  float *sca, float *scw)
{
    const Fp8Gemm &p = P.g;
    const Fp8WsExtra &x = P.x;
    const long long nkb = p.depth / F8_BK;
    constexpr int PT = f8_producers(GATE, ATMA); /* 128, or 64 beside the coders (A by TMA) */
    const int tid = threadIdx.x;                 /* 0..PT - 1 */
    const int crow = tid >> 3, chunk = tid & 7;
    const uint32_t dst = (uint32_t)crow * 128u + (uint32_t)((chunk ^ (crow & 7)) << 4);
    constexpr int ROWS = F8_BM / (PT / 8); /* A rows per thread: crow + PT / 8 i */
    HpPipe<f8_stages(GATE, ATMA)> ps = {0, 0u};
    HpPipe<F8_TILE_SLOTS> ts = {0, 0u};
    __shared__ long long first_s, count_s;
    for (;;) {
        const int slot = ts.stage;
        if (tid == 0) {
            hp_mbar_wait(smem_u32(&tl.empty[slot]), ts.phase ^ 1u);
            long long e, nb, first, count;
            f8_tile_at(x, p.rt.E, x.nblk, (long long)atomicAdd(x.tile_ctr, 1u), &e, &nb, &first,
                       &count);
            tl.e[slot] = e;
            tl.nb[slot] = nb;
            tl.shift[slot] = ATMA ? (int)(first % x.tma_rows) & 3 : 0;
            first_s = first;
            count_s = count;
        }
        moe_sync<F8_BAR_PRODUCER, PT>();
        const long long e = tl.e[slot], nb = tl.nb[slot], first = first_s, count = count_s;
        ts.advance();
        const uint8_t *arow[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int r = crow + PT / 8 * i;
            long long row = -1;
            if (r < count) {
                row = x.list ? x.list[first + r] : first + r;
                const long long pp = row / x.div, q = row % x.div;
                arow[i] = p.a + pp * p.a_s0 + q * p.a_s1;
            } else {
                arow[i] = nullptr;
            }
            if (chunk == 0)
                tl.row[slot][r] = row;
        }
        hp_mbar_arrive(smem_u32(&tl.full[slot])); /* release: this thread's rows are visible */
        moe_sync<F8_BAR_PRODUCER, PT>();          /* first_s, count_s read by all */
        if (e < 0)
            break;
        /* A by TMA: the tile's rows are rows q0.. of block pp of the map (a tile never spans
         * two blocks), past its count another expert's or zeros, which no epilogue stores */
        const int tma_pp = ATMA ? (int)(first / x.tma_rows) : 0;
        const int tma_q0 = ATMA ? (int)(first % x.tma_rows) : 0;
        /* the scales go with the stage, so that no consumer waits on a global load: row tid's
         * A scale by cp.async (0 past the tile), the weight blocks' read a stage ahead */
        const float *a_sc = nullptr;
        if (!ATMA && tid < count) {
            const long long row = tl.row[slot][tid];
            a_sc = x.a_sc + (row / x.div) * x.sc_p + (row % x.div) * x.sc_q;
        }
        long long rb_a, rb_b;
        bool live_b;
        f8_w_blocks<GATE>(p, nb, &rb_a, &rb_b, &live_b);
        float swa = 0.0f, swb = 0.0f;
        if (tid == F8_WSC_THREAD) {
            swa = fp8_w_scale(p.ws, e, rb_a, 0);
            swb = live_b ? fp8_w_scale(p.ws, e, rb_b, 0) : 0.0f;
        }
        for (long long kb = 0; kb < nkb; kb++) {
            const uint32_t stage = sbase + (uint32_t)(ps.stage * F8_STAGE_BYTES);
            const uint32_t fb = smem_u32(&full[ps.stage]);
            float *sc = sca + ps.stage * F8_SCA_FLOATS;
            hp_mbar_wait(smem_u32(&empty[ps.stage]), ps.phase ^ 1u);
            if (tid == F8_WSC_THREAD) {
                float swa_next = 0.0f, swb_next = 0.0f;
                if (kb + 1 < nkb) {
                    swa_next = fp8_w_scale(p.ws, e, rb_a, kb + 1);
                    swb_next = live_b ? fp8_w_scale(p.ws, e, rb_b, kb + 1) : 0.0f;
                }
                scw[2 * ps.stage] = swa;
                scw[2 * ps.stage + 1] = swb;
                hp_mbar_arrive(fb); /* release: the two stores */
                swa = swa_next;
                swb = swb_next;
            }
            if (tid == 0) {
                hp_mbar_arrive_tx(fb, ATMA ? F8_B_BYTES + F8_A_BYTES + F8_SCA_BYTES : F8_B_BYTES);
#pragma unroll
                for (int b = 0; b < 4; b++)
                    hp_tma_load_3d(stage + F8_A_BYTES + b * F8_BOX_BYTES, &P.map_w, fb,
                                   (int)(kb * F8_BK), f8_box_row<GATE>(p, nb, b), (int)e);
                if (ATMA) {
                    hp_tma_load_3d(stage, &P.map_a, fb, (int)(kb * F8_BK), tma_q0, tma_pp);
                    hp_bulk_load(smem_u32(sc),
                                 x.tma_sc + ((long long)tma_pp * nkb + kb) * x.tma_rows_pad +
                                     (tma_q0 & ~3),
                                 F8_SCA_BYTES, fb);
                }
            }
            if (ATMA) {
                /* the stage is the TMA's and the scales thread's */
            } else if (p.vec_a) {
#pragma unroll
                for (int i = 0; i < ROWS; i++)
                    cp_async16(stage + dst + (uint32_t)(i * 16 * 128),
                               arow[i] ? (const void *)(arow[i] + kb * F8_BK + chunk * 16)
                                       : (const void *)p.a,
                               arow[i] ? 16 : 0);
                cp_async4(smem_u32(sc + tid),
                          a_sc ? (const void *)(a_sc + kb) : (const void *)x.a_sc, a_sc ? 4 : 0);
                hp_cp_async_arrive(fb);
            } else {
                /* rows not 16-byte aligned: byte loads and shared stores, the same tile and
                 * bits; made visible to the tensor cores' proxy before the arrival */
#pragma unroll 1
                for (int i = 0; i < ROWS; i++) {
                    uint32_t v[4] = {0u, 0u, 0u, 0u};
                    if (arow[i])
                        for (int b = 0; b < 16; b++)
                            v[b >> 2] |= (uint32_t)arow[i][kb * F8_BK + chunk * 16 + b]
                                         << (8 * (b & 3));
                    st_shared16(stage + dst + (uint32_t)(i * 16 * 128),
                                make_uint4(v[0], v[1], v[2], v[3]));
                }
                sc[tid] = a_sc ? a_sc[kb] : 0.0f;
                hp_fence_proxy_async();
                hp_mbar_arrive(fb);
            }
            ps.advance();
        }
    }
    cp_async_wait<0>(); /* no copy of this thread outlives it */
}

#include "cuda/moe_fp8_ws_epi.cuh"
#include "cuda/moe_fp8_ws_codes.cuh"

/* main[64 w + i] += block[i] * the scale of its row and of wave w's weight rows. */
static __device__ __forceinline__ void f8_promote(float (&m)[128], const float (&acc)[64], int w,
                                                  float f_lo_a, float f_hi_a, float f_lo_b,
                                                  float f_hi_b, bool split)
{
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const bool up = split && i >= 8; /* gate: the up rows have their own weight block */
        const float flo = up ? f_lo_b : f_lo_a, fhi = up ? f_hi_b : f_hi_a;
        m[64 * w + 4 * i + 0] = __fmaf_rn(acc[4 * i + 0], flo, m[64 * w + 4 * i + 0]);
        m[64 * w + 4 * i + 1] = __fmaf_rn(acc[4 * i + 1], flo, m[64 * w + 4 * i + 1]);
        m[64 * w + 4 * i + 2] = __fmaf_rn(acc[4 * i + 2], fhi, m[64 * w + 4 * i + 2]);
        m[64 * w + 4 * i + 3] = __fmaf_rn(acc[4 * i + 3], fhi, m[64 * w + 4 * i + 3]);
    }
}

/*
 * One stage of a full tile: warpgroup cw's 64 rows (A at a0) by the 256 weight rows (B at b0)
 * in two waves of 128, each waited for and promoted into m[64 w ..]; the stage is released
 * before the second promotion.
 */
template <bool GATE>
static __device__ __forceinline__ void f8_stage_full(float (&m)[128], float (&acc)[64],
                                                     uint32_t a0, uint32_t b0, float s_lo,
                                                     float s_hi, float swa, float swb,
                                                     uint32_t empty_bar)
{
    /* wave 0: weight rows [0, 128) */
    pin(acc);
    f8_block(acc, a0, b0);
    wgmma_wait<0>();
    pin(acc);
    const float lo_a = __fmul_rn(s_lo, swa), hi_a = __fmul_rn(s_hi, swa);
    const float lo_b = __fmul_rn(s_lo, swb), hi_b = __fmul_rn(s_hi, swb);
    if (GATE)
        f8_promote(m, acc, 0, lo_a, hi_a, lo_b, hi_b, true);
    else
        f8_promote(m, acc, 0, lo_a, hi_a, lo_a, hi_a, false);
    /* wave 1: weight rows [128, 256) */
    f8_block(acc, a0, b0 + 128 * 128);
    wgmma_wait<0>();
    pin(acc);
    hp_mbar_arrive(empty_bar);
    if (GATE)
        f8_promote(m, acc, 1, lo_a, hi_a, lo_b, hi_b, true);
    else
        f8_promote(m, acc, 1, lo_b, hi_b, lo_b, hi_b, false);
}

/*
 * One stage of a half tile (at most 64 slots): warpgroup cw multiplies the tile's rows 0..63
 * (A at a0) by wave cw's 128 weight rows only, promoted into m[0, 64): each output the same
 * wgmma and the same promotion as in a full tile, on half the tensor work of a padded one and
 * with both warpgroups busy. Gate: every wave holds gate rows (scale swa) and up rows (swb);
 * final: wave 0 has block swa, wave 1 swb.
 */
template <bool GATE>
static __device__ __forceinline__ void f8_stage_half(float (&m)[128], float (&acc)[64], int cw,
                                                     uint32_t a0, uint32_t b0, float s_lo,
                                                     float s_hi, float swa, float swb,
                                                     uint32_t empty_bar)
{
    pin(acc);
    f8_block(acc, a0, b0 + (uint32_t)(cw * 128 * 128));
    wgmma_wait<0>();
    pin(acc);
    hp_mbar_arrive(empty_bar);
    if (GATE) {
        f8_promote(m, acc, 0, __fmul_rn(s_lo, swa), __fmul_rn(s_hi, swa), __fmul_rn(s_lo, swb),
                   __fmul_rn(s_hi, swb), true);
    } else {
        const float sw = cw ? swb : swa, lo = __fmul_rn(s_lo, sw), hi = __fmul_rn(s_hi, sw);
        f8_promote(m, acc, 0, lo, hi, lo, hi, false);
    }
}

/*
 * The gate's consumers beside coders: h of the tile (rows row[], full or half) staged for them
 * once they are done with the last tile's, and the rows and column block with it.
 */
static __device__ __forceinline__ void f8_gate_handoff(const Fp8Gemm &p, long long e, long long nb,
                                                       bool half, const long long (&row)[2],
                                                       const float (&m)[128], float *stg,
                                                       F8Handoff &ho, unsigned phase,
                                                       uint32_t tabs)
{
    const int ctid = (int)threadIdx.x - 128;
    const int cw = ctid >> 7, lane = ctid & 31, rw = ((ctid >> 5) & 3) * 16 + (lane >> 2);
    hp_mbar_wait(smem_u32(&ho.empty), phase ^ 1u);
    float *col = stg + f8_stg_col(ctid);
    if (half)
        f8_gate_stage<1>(p, e, nb, m, col, lane, tabs, cw);
    else
        f8_gate_stage<2>(p, e, nb, m, col, lane, tabs, 0);
    if ((lane & 3) == 0) { /* tile row cw * 64 + rw: a half tile has rows 0..63 only */
        ho.row[cw * 64 + rw] = half && cw ? -1 : row[0];
        ho.row[cw * 64 + rw + 8] = half && cw ? -1 : row[1];
    }
    if (ctid == 0) {
        ho.nb = nb;
        ho.half = half;
    }
    hp_mbar_arrive(smem_u32(&ho.full)); /* release: this thread's h and rows */
}

template <bool GATE, bool ATMA>
static __device__ __forceinline__ void f8_consume(const Fp8Gemm &p, const Fp8WsExtra &x,
                                                  uint32_t sbase, uint64_t *full, uint64_t *empty,
                                                  F8Tiles &tl, const float *sca,
                                                  const float *scw, float *bufs, uint32_t tabs,
                                                  float (*amax_x)[64], F8Handoff &ho)
{
    const int ctid = (int)threadIdx.x - 128; /* 0..255 */
    float *buf = bufs + ctid;                /* the thread's column of the epilogue's chunks */
    const int cw = ctid >> 7, warp = (ctid >> 5) & 3, lane = ctid & 31;
    const int rw = warp * 16 + (lane >> 2); /* the thread's first row of its warpgroup's 64 */
    const long long nkb = p.depth / F8_BK, div = x.div;
    constexpr bool CODERS = f8_coders_on(GATE, ATMA);
    unsigned ho_phase = 0u; /* the handoff's, a tile staged */
    HpPipe<f8_stages(GATE, ATMA)> ps = {0, 0u};
    HpPipe<F8_TILE_SLOTS> ts = {0, 0u};
    float acc[64], m[128];
#pragma unroll
    for (int i = 0; i < 64; i++)
        acc[i] = 0.0f;
    for (;;) {
        const int slot = ts.stage;
        hp_mbar_wait(smem_u32(&tl.full[slot]), ts.phase);
        ts.advance();
        const long long e = tl.e[slot], nb = tl.nb[slot];
        const int shift = ATMA ? tl.shift[slot] : 0;
        /* a half tile: both warpgroups on rows 0..63, split by weight rows (so neither
         * warpgroup of a tile is ever without a slot: a tile has at least one) */
        const bool half = e >= 0 && tl.row[slot][F8_BM / 2] < 0;
        const int r0 = (half ? 0 : cw * 64) + rw;
        const long long row[2] = {e >= 0 ? tl.row[slot][r0] : -1,
                                  e >= 0 ? tl.row[slot][r0 + 8] : -1};
        moe_sync<F8_BAR, F8_CONSUMERS>(); /* every consumer has read the slot */
        if (ctid == 0)
            hp_mbar_arrive(smem_u32(&tl.empty[slot]));
        if (e < 0) {
            if (CODERS) { /* the coders' last handoff: done */
                hp_mbar_wait(smem_u32(&ho.empty), ho_phase ^ 1u);
                if (ctid == 0)
                    ho.done = 1;
                hp_mbar_arrive(smem_u32(&ho.full));
            }
            break;
        }
#pragma unroll
        for (int i = 0; i < 128; i++)
            m[i] = 0.0f;
        for (long long kb = 0; kb < nkb; kb++) {
            const uint32_t empty_bar = smem_u32(&empty[ps.stage]);
            hp_mbar_wait(smem_u32(&full[ps.stage]), ps.phase);
            if (!ATMA)
                hp_fence_proxy_async(); /* the cp.async rows, for the tensor cores' proxy */
            const uint32_t sa = sbase + (uint32_t)(ps.stage * F8_STAGE_BYTES);
            const uint32_t a0 = sa + (uint32_t)((r0 - rw) * 128), b0 = sa + F8_A_BYTES;
            /* this thread's two rows' A scales and the weight blocks', read before the stage
             * is released */
            const float *sc = sca + ps.stage * F8_SCA_FLOATS + shift;
            const float s_lo = sc[r0], s_hi = sc[r0 + 8];
            const float swa = scw[2 * ps.stage], swb = scw[2 * ps.stage + 1];
            if (half)
                f8_stage_half<GATE>(m, acc, cw, a0, b0, s_lo, s_hi, swa, swb, empty_bar);
            else
                f8_stage_full<GATE>(m, acc, a0, b0, s_lo, s_hi, swa, swb, empty_bar);
            ps.advance();
        }
        if (CODERS) {
            f8_gate_handoff(p, e, nb, half, row, m, bufs, ho, ho_phase, tabs);
            ho_phase ^= 1u;
        } else if (GATE) {
            if (half)
                f8_gate_out<1>(p, div, e, nb, row, m, buf, lane, tabs, cw, amax_x, rw);
            else
                f8_gate_out<2>(p, div, e, nb, row, m, buf, lane, tabs, 0, nullptr, rw);
        } else {
            if (half)
                f8_final_out<1>(p, div, e, nb, row, m, buf, lane, cw);
            else
                f8_final_out<2>(p, div, e, nb, row, m, buf, lane, 0);
        }
    }
}
#endif

/* ATMA: A by TMA (Fp8WsExtra a_tma); a template argument, so that neither producer pays for
 * the other's branches in its stage loop */
template <bool GATE, bool ATMA>
__global__ void __launch_bounds__(F8_THREADS, 1)
    moe_fp8_ws_kernel(const __grid_constant__ F8Params P)
{
#ifdef MOE_WGMMA_DEVICE
    extern __shared__ uint4 smem_raw[];
    __shared__ uint64_t full[F8_STAGES], empty[F8_STAGES];
    __shared__ F8Tiles tl;
    __shared__ __align__(8) float exp_tab[64]; /* the gate's silu: mf_exp_tab_fast's table */
    __shared__ __align__(16) float sca[F8_STAGES * F8_SCA_FLOATS]; /* stages' A rows' scales */
    __shared__ __align__(8) float scw[F8_STAGES * 2];       /* and weight blocks' */
    __shared__ float amax_x[2][64]; /* a half tile's gate: each warpgroup's rows' amax */
    __shared__ F8Handoff ho;        /* the gate's coders (A by TMA) */
    constexpr bool CODERS = f8_coders_on(GATE, ATMA);
    constexpr int STAGES = f8_stages(GATE, ATMA);
    /* TMA with the 128-byte swizzle and the wgmma descriptors want 1024-byte aligned stages */
    const uint32_t sbase = (smem_u32(smem_raw) + 1023u) & ~1023u;
    /* the epilogue's chunks, or the coders' staging buffer */
    float *buf = (float *)((char *)smem_raw + (sbase - smem_u32(smem_raw)) +
                           STAGES * F8_STAGE_BYTES);
    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; st++) {
            hp_mbar_init(smem_u32(&full[st]), ATMA ? F8_FULL_ARRIVALS_TMA : F8_FULL_ARRIVALS);
            hp_mbar_init(smem_u32(&empty[st]), F8_EMPTY_ARRIVALS);
        }
        for (int st = 0; st < F8_TILE_SLOTS; st++) {
            hp_mbar_init(smem_u32(&tl.full[st]), f8_producers(GATE, ATMA));
            hp_mbar_init(smem_u32(&tl.empty[st]), 1);
        }
        hp_mbar_init(smem_u32(&ho.full), F8_CONSUMERS);
        hp_mbar_init(smem_u32(&ho.empty), F8_CODERS);
        ho.done = 0;
        hp_mbar_init_fence();
    }
    if (threadIdx.x == 32) {
        hp_tma_prefetch(&P.map_w);
        if (ATMA)
            hp_tma_prefetch(&P.map_a);
    }
    if (threadIdx.x >= 64 && threadIdx.x < 128)
        exp_tab[threadIdx.x - 64] = MF_EXP_TABLE[threadIdx.x - 64];
    __syncthreads();
    /* 128 x 40 + 256 x 232 of the 64K registers. At 224 the final's consumers spilled five
     * values that every stage reloads (LDL in the stage loop); at 232 the stage loop keeps
     * them in registers, and the producer, idle most of the time, spills a few instead. */
    if (threadIdx.x < 128) {
        hp_regs_dec<40>();
        if (CODERS && threadIdx.x >= 128 - F8_CODERS)
            f8_coders(P.g, P.x.div, buf, ho, (int)threadIdx.x - (128 - F8_CODERS));
        else
            f8_produce<GATE, ATMA>(P, sbase, full, empty, tl, sca, scw);
    } else {
        hp_regs_inc<232>();
        f8_consume<GATE, ATMA>(P.g, P.x, sbase, full, empty, tl, sca, scw, buf,
                               (uint32_t)__cvta_generic_to_shared(exp_tab), amax_x, ho);
    }
#else
    (void)P; /* never launched: the host checks for sm_90a first */
#endif
}

typedef CUresult (*f8_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                 const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                 const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

int moe_fp8_weights_map(const cuda_state *s, const Fp8Gemm *g, int gate, unsigned box_rows,
                        CUtensorMap *map)
{
    const int64_t rows = gate ? 2 * g->ncols : g->ncols;
    if (!s->tensor_map_encode || !g->vec_w || g->depth >= INT_MAX - 256 ||
        rows >= INT_MAX - 512 || g->rt.E >= INT_MAX || g->w_s1 <= 0 || g->w_s0 <= 0)
        return 0;
    CUtensorMap scratch_map;
    const cuuint64_t dims[3] = {(cuuint64_t)g->depth, (cuuint64_t)rows, (cuuint64_t)g->rt.E};
    const cuuint64_t strides[2] = {(cuuint64_t)g->w_s1, (cuuint64_t)g->w_s0};
    const cuuint32_t box[3] = {F8_BK, box_rows, 1}, estride[3] = {1, 1, 1};
    f8_encode_fn encode = (f8_encode_fn)s->tensor_map_encode;
    return encode(map ? map : &scratch_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)g->w, dims,
                  strides, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/*
 * A's map (Fp8WsExtra tma_*): codes in boxes of 128 rows x 128 bytes, swizzled as the
 * weights' are; NULL map: only whether. The scales need 16-byte aligned columns for their
 * bulk copies (a multiple of 4 rows).
 */
static int a_map(const cuda_state *s, const Fp8WsExtra *x, long long depth, CUtensorMap *map)
{
    if (!s->tensor_map_encode || !x->tma_a || !x->tma_sc || depth % F8_BK != 0 ||
        depth >= INT_MAX || x->tma_rows <= 0 || x->tma_rows >= INT_MAX || x->tma_blocks <= 0 ||
        x->tma_blocks >= INT_MAX || x->tma_rows_pad < x->tma_rows || x->tma_rows_pad % 4 != 0 ||
        ((uintptr_t)x->tma_a & 15u) != 0 || ((uintptr_t)x->tma_sc & 15u) != 0 ||
        x->tma_row_s % 16 != 0 || x->tma_block_s % 16 != 0 || x->tma_row_s <= 0 ||
        (x->tma_blocks > 1 && x->tma_block_s <= 0))
        return 0;
    f8_encode_fn encode = (f8_encode_fn)s->tensor_map_encode;
    CUtensorMap scratch_map;
    const long long block_s = x->tma_blocks > 1 ? x->tma_block_s : x->tma_row_s * x->tma_rows;
    const cuuint64_t dims[3] = {(cuuint64_t)depth, (cuuint64_t)x->tma_rows,
                                (cuuint64_t)x->tma_blocks};
    const cuuint64_t strides[2] = {(cuuint64_t)x->tma_row_s, (cuuint64_t)block_s};
    const cuuint32_t box[3] = {F8_BK, F8_BM, 1}, estride[3] = {1, 1, 1};
    return encode(map ? map : &scratch_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)x->tma_a,
                  dims, strides, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int moe_fp8_ws_a_tma_ok(const cuda_state *s, const Fp8WsExtra *x, long long depth)
{
    return a_map(s, x, depth, NULL);
}

int moe_fp8_ws_usable(const cuda_state *s)
{
    return moe_wgmma_usable(s) && s->tensor_map_encode &&
           (size_t)F8_SMEM + F8_STATIC_SMEM <= s->smem_optin &&
           (size_t)F8_SMEM_CODERS + F8_STATIC_SMEM <= s->smem_optin;
}

int moe_fp8_ws_weights_ok(const cuda_state *s, const Fp8Gemm *g, int gate)
{
    return moe_fp8_weights_map(s, g, gate, F8_BOX_ROWS, NULL);
}

template <bool GATE, bool ATMA>
static moefuse_status launch(moefuse_context *ctx, cuda_state *s, const char *op,
                             const Fp8Gemm *g, const Fp8WsExtra *x)
{
    void (*kern)(const F8Params) = moe_fp8_ws_kernel<GATE, ATMA>;
    const size_t smem = f8_smem(GATE, ATMA);
    MF_TRY(moe_ready_smem(ctx, s, op, kern, smem, smem + F8_STATIC_SMEM,
                          &s->ws_smem_raised, 1u << (4 + (GATE ? 1 : 0) + (ATMA ? 2 : 0)),
                          "cudaFuncSetAttribute(moe_fp8_ws_kernel)"));
    if (!g)
        return MOEFUSE_OK;
    F8Params P;
    memset(&P, 0, sizeof P);
    if (!moe_fp8_weights_map(s, g, GATE, F8_BOX_ROWS, &P.map_w))
        return mf_error(ctx, MOEFUSE_ERR_INTERNAL,
                        "%s: internal error: the driver refused the FP8 weights' tensor map "
                        "after accepting them",
                        op);
    if (x->a_tma && !a_map(s, x, g->depth, &P.map_a))
        return mf_error(ctx, MOEFUSE_ERR_INTERNAL,
                        "%s: internal error: the driver refused A's tensor map after "
                        "accepting it",
                        op);
    P.g = *g;
    P.x = *x;
    const long long tiles = x->lin_bound;
    const unsigned grid = (unsigned)(tiles < s->sm_count ? tiles : s->sm_count);
    kern<<<grid > 0 ? grid : 1, F8_THREADS, smem, s->stream>>>(P);
    return mf_cuda_launched(ctx, op,
                            GATE ? "moe_fp8_ws_kernel (gate)" : "moe_fp8_ws_kernel (final)");
}

moefuse_status moe_fp8_ws_launch(moefuse_context *ctx, cuda_state *s, const char *op, int gate,
                                 const Fp8Gemm *g, const Fp8WsExtra *x)
{
    const bool tma = x && x->a_tma;
    if (gate)
        return tma ? launch<true, true>(ctx, s, op, g, x) : launch<true, false>(ctx, s, op, g, x);
    return tma ? launch<false, true>(ctx, s, op, g, x) : launch<false, false>(ctx, s, op, g, x);
}
