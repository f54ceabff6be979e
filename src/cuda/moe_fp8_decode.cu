/*
 * The FP8 decode GEMM of the MoE layer (sm_90a): a few rows per expert, so the time is one
 * read of the routed experts' weights, and the kernel is a weight stream.
 *
 * Tile: up to DEC_NS rows (slots) of one expert x 128 h columns (gate: its 128 gate and 128
 * up weight rows, one h group) or 128 output columns (final). Roles (288 threads; the final
 * 320):
 *  - producer, warp 8: per 128-deep block (the block of the scales) one stage of a ring: the
 *    tile's weight rows by tensor copies (TMA, boxes of 128 rows x 128 bytes swizzled by 128
 *    bytes), the tile's activation codes by cp.async (zeros past the tile's rows), both
 *    completing on the stage's mbarrier. Nothing else: it runs ahead of the consumers by the
 *    ring, across tiles. (Rows no tensor map or cp.async can take go through its registers.)
 *  - consumers, warps 0..7, two warpgroups: warpgroup q takes weight rows [64 q, 64 q + 64)
 *    of each half (warp w: rows [16 w, 16 w + 16)): wgmma m64nNk32 e4m3 with the weights as
 *    A and the slots as B (N = 8 to 32, as many n8 columns as the tile needs), both read
 *    from the stage by descriptors, four k32 steps per block from 0, then main =
 *    fmaf(block, sa * sw, main), the products read from shared windows of DEC_SWIN blocks,
 *    each made while the one before streams. (mma.sync e4m3 has no sm_90 instruction: the
 *    compiler widened every operand to f16 first, and those conversions were most of the
 *    consumers' issue slots.)
 * The activation rows are 128 bytes of codes each, swizzled like the weights (chunk c of row r
 * at c ^ (r % 8)), so one descriptor form reads both. x of f32/f16/bf16 is quantized before,
 * as `quant` does, by fp8_dec_route.
 *
 * Split depth: a tile's blocks are shared by a cluster of `split` blocks, rank r taking
 * consecutive blocks from r * ceil(nkb / split), each share summed from 0; ranks r > 0 hand
 * their sums to rank 0 through L2 (mbarriers across the cluster say when), which adds them in
 * rank order and runs the epilogue. Persistent: the clusters walk the (tile, column block)
 * items with a stride of the cluster count; producer and consumers find each item's tile
 * themselves, so neither waits for the other but through the ring.
 *
 * Epilogues: gate: bias, clamp, activation, the group's amax over the 128 h columns of a
 * slot, the scale, the codes (fp8.cuh, as every FP8 path); final: bias and y, stored (un-
 * reduced, masked), or y in f32 and, by the last slot of a token to arrive at a column block,
 * the token's top-k sum in slot order (fp8_reduce_topk's arithmetic). The reduced final's
 * counting and sums are the sums warp's (warp 9): the consumers store y, arrive on epi_full
 * and take the next item.
 */
#include "cuda/moe_fp8_decode.h"
#include "cuda/moe_fp8_ws.h" /* the weights' tensor map */
#include "cuda/hopper.cuh"
#include "cuda/moe_math.cuh"
#include "cuda/moe_tiles.cuh" /* cp_async16 */
#include "cuda/pdl.cuh"
#include "cuda/wgmma.cuh" /* MOE_WGMMA_DEVICE: sm_90a device code */

#include <string.h>

#define DEC_CONSUMER_THREADS 256
#define DEC_PRODUCER 8 /* the producer's warp */
#define DEC_SUMS 9     /* the reduced final's sums warp */
#define DEC_BAR_CONSUMERS 1
#define DEC_HPITCH 132 /* floats between the slots' rows of h in the gate's epilogue */
#define DEC_BOX_ROWS 128 /* weight rows of one tensor copy */
#define DEC_FULL_ARRIVALS 33 /* the producer lanes' activation rows, and its lane 0 */
/* The consumers read a tile's scales from shared memory, DEC_SWIN depth blocks at a time,
 * each window loaded into registers while the one before streams: a scale read from memory
 * costs a DRAM latency, more than a stage takes to arrive, so reading it a block ahead
 * (as before) capped the stream at one stage per latency. A window holds the products
 * sa * sw (slot, half), each made once: the eight consumer warps made every one of them
 * again in every stage, and the stage's instructions, not the bytes, set the pace (ncu,
 * Mixtral M = 32 gate: the producer waited on free stages, the consumers on nothing). */
#define DEC_SWIN 16

template <int GATE> struct DecCfg {
    static constexpr int ROWS = GATE ? 256 : 128; /* weight rows of a tile */
    static constexpr int FRAGS = GATE ? 2 : 1;    /* halves: the gate's gate and up rows */
    /* the gate: one block per multiprocessor (its ring of 36 KB stages and its h buffer take
     * 214 KB); the final fits two (105 KB and 96 registers each) */
    static constexpr int MINB = GATE ? 1 : 2;
    /* consumers and producer; the final also its sums warp */
    static constexpr int THREADS = GATE ? 288 : 320;
    static constexpr int STAGES = 5;
    /* weight rows, then activation rows, of 128 bytes swizzled (chunk c of row r at
     * c ^ (r % 8)): both 1024-aligned, as the swizzle and the descriptors want */
    static constexpr int W_BYTES = ROWS * FP8_BLOCK;
    static constexpr int STAGE = (W_BYTES + DEC_NS * FP8_BLOCK + 1023) / 1024 * 1024;
    /* the gate's h of a tile in its epilogue, beside the ring (the producer runs ahead); the
     * scales of two windows while the tile streams (the same bytes: never live together) */
    static constexpr int HBUF_H = GATE ? 2 * DEC_NS * DEC_HPITCH * 4 : 0;
    /* a scale window's row: the products of half 0's slots (then half 1's); its floats in
     * the registers of each consumer thread while it loads */
    static constexpr int SCOLS = FRAGS * DEC_NS;
    static constexpr int SWIN_BYTES = DEC_SWIN * SCOLS * 4;
    static constexpr int SREGS = DEC_SWIN * SCOLS / DEC_CONSUMER_THREADS;
    static_assert(DEC_SWIN * SCOLS % DEC_CONSUMER_THREADS == 0, "a window in whole registers");
    static constexpr int HBUF = HBUF_H > 2 * SWIN_BYTES ? HBUF_H : 2 * SWIN_BYTES;
    static constexpr int H_OFF = STAGES * STAGE;
    static constexpr int SMEM = H_OFF + HBUF + 1024; /* and the base's alignment */
    /* a rank's partial sums, float4 per consumer thread, fragment and n8 column */
    static constexpr int PART4 = FRAGS * 4 * DEC_CONSUMER_THREADS;
};

typedef struct DecParams {
    CUtensorMap map_w; /* the weights in boxes of 128 rows (x.w_map), else read by the warp */
    Fp8Gemm g;
    Fp8DecExtra x;
} DecParams;

/* The consumers' view of the current tile (consumer warp 0 writes it; they share a barrier). */
struct DecTileSmem {
    long long srow[DEC_NS]; /* the row's scale row (x: token, h: slot; masked: t) */
    long long orow[DEC_NS]; /* element offset of its output row */
    long long hrow[DEC_NS]; /* gate: its h scale row (slot; masked: t) */
    long long e, blk;       /* local expert; expert block of the scale views (masked: e) */
    int count;              /* rows, 0: no tile */
};

/* The direct mode's tiles: distinct valid experts of the S slots in order of appearance. */
struct DecDirect {
    int e[32];
    unsigned mask[32]; /* their slots */
    int n;
};

#ifdef MOE_WGMMA_DEVICE /* the GEMM's pieces exist in sm_90a device code only */
/* ---------------------------------------------------------- primitives */

static __device__ __forceinline__ uint32_t dec_smem(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void dec_bar_consumers(void)
{
    asm volatile("bar.sync %0, %1;\n" ::"n"(DEC_BAR_CONSUMERS), "n"(DEC_CONSUMER_THREADS)
                 : "memory");
}

/* 16 codes at src, one 16-byte load where src is aligned. */
static __device__ __forceinline__ uint4 dec_load16(const uint8_t *src)
{
    return fp8_load16(src, ((uintptr_t)src & 15u) == 0);
}

#endif /* MOE_WGMMA_DEVICE */

#ifdef MOE_WGMMA_DEVICE
/* ------------------------------------------------------------- the tile */

/*
 * Tile ti, as a warp finds it: its expert (and the expert block of the scale views), its rows,
 * and lane's row (lane < count): a slot s = m * k + j (routed, direct) or a row t (masked).
 */
static __device__ __forceinline__ int dec_tile(const Fp8Gemm &g, const Fp8DecExtra &x,
                                               const DecDirect &dd, long long ti, int lane,
                                               long long *e, long long *row)
{
    int count;
    *row = 0;
    if (x.mode == DEC_DIRECT) {
        unsigned m = dd.mask[ti];
        *e = dd.e[ti];
        count = __popc(m);
        for (int i = 0; i < lane && m; i++)
            m &= m - 1u; /* the lane-th slot of the expert */
        *row = m ? __ffs(m) - 1 : 0;
    } else if (x.mode == DEC_ROUTED) {
        /* past L1: the route kernel wrote it while this grid may already have run (PDL) */
        const longlong2 t = __ldcg((const longlong2 *)(x.tiles + ti));
        *e = (int)(t.y & 0xFFFFFFFFll);
        count = (int)(t.y >> 32);
        if (lane < count)
            *row = __ldcg(x.list + t.x + lane);
    } else {
        const long long chunks = (g.tmax + DEC_NS - 1) / DEC_NS;
        const long long ee = ti / chunks, t0 = (ti - ee * chunks) * DEC_NS;
        const long long n = fp8_masked_rows(g, ee) - t0;
        *e = ee;
        count = n <= 0 ? 0 : (n < DEC_NS ? (int)n : DEC_NS);
        *row = t0 + lane;
    }
    return count;
}

/* The activation row of row s of expert e: element offset (codes, or x's elements). */
static __device__ __forceinline__ long long dec_arow(const Fp8Gemm &g, long long s, long long e)
{
    if (g.masked)
        return e * g.a_s0 + s * g.a_s1;
    const long long m = s / g.rt.topk, j = s - m * g.rt.topk;
    return m * g.a_s0 + j * g.a_s1;
}

/* Consumer warp 0: the tile's rows for the consumers' scales and epilogues. */
static __device__ __forceinline__ void dec_rows(const Fp8Gemm &g, DecTileSmem &ts, int count,
                                                long long e, long long s, int lane)
{
    if (lane == 0) {
        ts.e = e;
        ts.blk = g.masked ? e : 0;
        ts.count = count;
    }
    if (lane >= count)
        return;
    if (g.masked) {
        ts.srow[lane] = s;
        ts.orow[lane] = e * g.o_s0 + s * g.o_s1;
        ts.hrow[lane] = s;
        return;
    }
    const long long m = s / g.rt.topk, j = s - m * g.rt.topk;
    ts.srow[lane] = g.a_scale_slot ? s : m;
    ts.orow[lane] = m * g.o_s0 + j * g.o_s1;
    ts.hrow[lane] = s;
}

/* ------------------------------------------------------------- producer */

/* The first weight row of half f (gate: gate / up rows) of column block nb. */
template <int GATE>
static __device__ __forceinline__ int dec_wrow(const Fp8Gemm &g, int f, long long nb)
{
    return (int)((GATE ? (f == 0 ? g.gate_row : g.up_row) : 0) + nb * 128);
}

/* Stage of depth block b, its weight rows: by tensor copies completing `full` (announced there
 * first), or through the warp's registers. */
template <int GATE>
static __device__ __forceinline__ void dec_produce_weights(const CUtensorMap *map, const Fp8Gemm &g,
                                                           const Fp8DecExtra &x, char *stage,
                                                           uint32_t full, long long e,
                                                           long long nb, long long b, int lane,
                                                           uint64_t policy)
{
    using C = DecCfg<GATE>;
    if (x.w_map) {
        if (lane == 0) {
            hp_mbar_expect_tx(full, C::ROWS * FP8_BLOCK);
            /* one tensor copy per 128 rows: small bulk copies (one per row) are issued far
             * slower than DRAM delivers them */
#pragma unroll
            for (int f = 0; f < C::FRAGS; f++)
                hp_tma_load_3d_hint(dec_smem(stage + f * DEC_BOX_ROWS * FP8_BLOCK), map, full,
                                    (int)(b * FP8_BLOCK), dec_wrow<GATE>(g, f, nb), (int)e,
                                    policy);
        }
    } else { /* rows no tensor map describes: through registers, swizzled as TMA would */
        const uint8_t *wb = g.w + e * g.w_s0 + b * FP8_BLOCK;
        for (int r = lane; r < C::ROWS; r += 32) {
            const long long wr =
                GATE ? (r < 128 ? g.gate_row : g.up_row) + nb * 128 + (r & 127) : nb * 128 + r;
#pragma unroll
            for (int q = 0; q < 8; q++)
                *(uint4 *)(stage + r * FP8_BLOCK + ((q ^ (r & 7)) * 16)) =
                    dec_load16(wb + wr * g.w_s1 + 16 * q);
        }
        hp_fence_proxy_async(); /* stores, read by the tensor cores' proxy */
    }
}

/*
 * Stage of depth block b: the weight rows (unless the early prologue issued them), the
 * activation rows (lane i: row i) by cp.async, every lane's and the tensor bytes completing
 * `full`.
 */
template <int GATE>
static __device__ __forceinline__ void dec_produce(const CUtensorMap *map, const Fp8Gemm &g,
                                                   const Fp8DecExtra &x, char *stage,
                                                   uint32_t full, long long e, int count,
                                                   long long arow, long long nb, long long b,
                                                   bool weights, int lane, uint64_t policy)
{
    using C = DecCfg<GATE>;
    if (weights)
        dec_produce_weights<GATE>(map, g, x, stage, full, e, nb, b, lane, policy);
    uint8_t *act = (uint8_t *)stage + C::W_BYTES + lane * FP8_BLOCK;
    const uint8_t *src = g.a + arow + b * FP8_BLOCK;
    if (g.vec_a) {
#pragma unroll
        for (int q = 0; q < 8; q++) /* rows past the tile's: zeros (no bytes read) */
            cp_async16(dec_smem(act + ((q ^ (lane & 7)) << 4)), lane < count ? src + 16 * q : g.a,
                       lane < count ? 16 : 0);
        hp_cp_async_arrive(full);
    } else {
#pragma unroll
        for (int q = 0; q < 8; q++)
            *(uint4 *)(act + ((q ^ (lane & 7)) << 4)) =
                lane < count ? dec_load16(src + 16 * q) : make_uint4(0u, 0u, 0u, 0u);
        hp_fence_proxy_async(); /* stores, read by the tensor cores' proxy */
        hp_mbar_arrive(full);
    }
    if (lane == 0)
        hp_mbar_arrive(full); /* with the expected bytes announced */
}

/* The tiles of the direct mode, by the producer warp: slot = lane, its local expert; tile i
 * = the i-th distinct valid one. */
static __device__ __forceinline__ void dec_direct_tiles(const Fp8Gemm &g, DecDirect &dd, int lane)
{
    long long ev = -1;
    if (lane < g.rt.S)
        ev = moe_slot_expert(g.rt, lane / g.rt.topk, lane % g.rt.topk);
    const int key = ev >= 0 ? (int)ev : -1 - lane;
    const unsigned same = __match_any_sync(0xFFFFFFFFu, key);
    const bool first = ev >= 0 && (__ffs(same) - 1) == lane;
    const unsigned firsts = __ballot_sync(0xFFFFFFFFu, first);
    if (first) {
        const int i = __popc(firsts & ((1u << lane) - 1u));
        dd.e[i] = (int)ev;
        dd.mask[i] = same;
    }
    if (lane == 0)
        dd.n = __popc(firsts);
    __syncwarp();
}

/* The tiles of the launch: distinct experts (direct), the route's list, or the masked bound. */
static __device__ __forceinline__ long long dec_ntiles(const Fp8DecExtra &x, const DecDirect &dd)
{
    return x.mode == DEC_DIRECT   ? dd.n
           : x.mode == DEC_ROUTED ? (long long)__ldcg(x.ntiles)
                                  : x.tiles_bound;
}

/*
 * Early (x.early, before the kernel waits for the one before it): the weight rows of the first
 * stages of the cluster's first item, whose tile the kernel before did not write (a layer's
 * final after its gate; a gate after the quantization of x in direct mode). The stream starts
 * while that kernel ends. Returns the stages issued.
 */
template <int GATE>
static __device__ __forceinline__ int dec_producer_early(const DecParams &p, const DecDirect &dd,
                                                         char *smem, uint64_t *full,
                                                         long long cluster, long long kb0,
                                                         long long kb1, int lane)
{
    using C = DecCfg<GATE>;
    const Fp8Gemm &g = p.g;
    if (!p.x.w_map || cluster >= dec_ntiles(p.x, dd) * g.nblk)
        return 0;
    const long long ti = cluster / g.nblk, nb = cluster - ti * g.nblk;
    long long e, s;
    if (dec_tile(g, p.x, dd, ti, lane, &e, &s) == 0)
        return 0;
    const int n = (int)(kb1 - kb0 < C::STAGES ? kb1 - kb0 : C::STAGES);
    const uint64_t policy = hp_policy_evict_first();
    if (lane == 0)
        hp_tma_prefetch(&p.map_w);
    for (int i = 0; i < n; i++)
        dec_produce_weights<GATE>(&p.map_w, g, p.x, smem + i * C::STAGE, dec_smem(&full[i]), e,
                                  nb, kb0 + i, lane, policy);
    return n;
}

/* The producer warp: for each item its tile, then its stages, ahead by the ring (the first
 * `pre` stages' weights already on their way). */
template <int GATE>
static __device__ __forceinline__ void dec_producer(const DecParams &p, const DecDirect &dd,
                                                   char *smem, uint64_t *full, uint64_t *empty,
                                                   long long cluster, long long items,
                                                   long long kb0, long long kb1, int pre,
                                                   int lane)
{
    using C = DecCfg<GATE>;
    const Fp8Gemm &g = p.g;
    HpPipe<C::STAGES> pipe = {0, 0u};
    const uint64_t policy = hp_policy_evict_first(); /* each weight is read once */
    if (p.x.w_map && lane == 0 && pre == 0)
        hp_tma_prefetch(&p.map_w);
    for (long long w = cluster; w < items; w += p.x.clusters) {
        const long long ti = w / g.nblk, nb = w - ti * g.nblk;
        long long e, s;
        const int count = dec_tile(g, p.x, dd, ti, lane, &e, &s);
        const long long arow = lane < count ? dec_arow(g, s, e) : 0;
        if (count > 0)
            for (long long b = kb0; b < kb1; b++) {
                hp_mbar_wait(dec_smem(&empty[pipe.stage]), pipe.phase ^ 1u);
                dec_produce<GATE>(&p.map_w, g, p.x, smem + pipe.stage * C::STAGE,
                                  dec_smem(&full[pipe.stage]), e, count, arow, nb, b,
                                  w != cluster || b - kb0 >= pre, lane, policy);
                pipe.advance();
            }
    }
}

/* ------------------------------------------------------------- consumers */

/*
 * The scales of window [b0, b0 + DEC_SWIN) (blocks below kb1) into registers: element i =
 * tid + q * 256 of the window is block b0 + i / SCOLS, half (i / DEC_NS) % FRAGS, slot
 * i % DEC_NS; ra its slot's activation scale, rw the half's weight scale (0 and 0 past the
 * tile's rows). Their product waits for dec_scales_store: made here, it waited for the loads
 * in the middle of the stream (ncu: DeepSeek-V3 M = 32 gate 5% slower).
 */
template <int GATE>
static __device__ __forceinline__ void dec_scales_load(const Fp8Gemm &g, const DecTileSmem &ts,
                                                       long long nb, long long b0, long long kb1,
                                                       int tid, float (&ra)[DecCfg<GATE>::SREGS],
                                                       float (&rw)[DecCfg<GATE>::SREGS])
{
    using C = DecCfg<GATE>;
#pragma unroll
    for (int q = 0; q < C::SREGS; q++) {
        const int i = tid + q * DEC_CONSUMER_THREADS, c = i % DEC_NS;
        const int f = (i / DEC_NS) % C::FRAGS;
        const long long b = b0 + i / C::SCOLS;
        ra[q] = rw[q] = 0.0f;
        if (b >= kb1 || c >= ts.count)
            continue;
        const long long rb = GATE ? (f == 0 ? g.gate_row : g.up_row) / FP8_BLOCK + nb : nb;
        ra[q] = fp8_act_scale(g.as, ts.blk, ts.srow[c], b);
        rw[q] = fp8_w_scale(g.ws, ts.e, rb, b);
    }
}

/* The window's products sa * sw, with the CPU's NaN bits, each made once. */
template <int N>
static __device__ __forceinline__ void dec_scales_store(float *win, const float (&ra)[N],
                                                        const float (&rw)[N], int tid)
{
#pragma unroll
    for (int q = 0; q < N; q++)
        win[tid + q * DEC_CONSUMER_THREADS] = fp8_scale_mul(ra[q], rw[q]);
}

/* d[f] = half f's 64 weight rows of the thread's warpgroup (at a0 + f * 128 rows) x the
 * stage's NC n8 columns of slots (at b0), over one block, its k32 steps from 0; one commit
 * group. */
template <int GATE, int NC>
static __device__ __forceinline__ void dec_block(float (&d)[2][16], uint32_t a0, uint32_t b0)
{
#pragma unroll
    for (int f = 0; f < DecCfg<GATE>::FRAGS; f++)
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_e4m3_narrow<NC>(d[f], wg_desc(a0 + f * 128 * FP8_BLOCK + kk * 32),
                                  wg_desc(b0 + kk * 32), kk > 0);
}

/* d's halves in use stay in registers across the wgmma (the final's second is never live). */
template <int FRAGS> static __device__ __forceinline__ void dec_pin(float (&d)[2][16])
{
#pragma unroll
    for (int f = 0; f < FRAGS; f++)
#pragma unroll
        for (int i = 0; i < 16; i++)
            asm volatile("" : "+f"(d[f][i])::"memory");
}

/*
 * One stage into acc[f][nt] (f: gate / up half, nt: n8 column of slots): the block's sums by
 * the tensor cores into d, then each promoted with its scale product from the window row sc.
 * d is the caller's (kept across stages: its values never matter, the first k32 step
 * overwrites them). The promotions are plain fmas, and one sum of each n8 column's says
 * whether any is NaN; only then are they made again with the CPU's NaN bits (fp8_fma).
 * Branching on each (as fp8_fma does) made a third of the stage's instructions.
 */
template <int GATE, int NC>
static __device__ __forceinline__ void dec_consume(uint32_t stage, int warp, int lane,
                                                   const float *sc, float (&d)[2][16],
                                                   float (&acc)[2][4][4])
{
    using C = DecCfg<GATE>;
    const int t = lane & 3;
    const uint32_t a0 = stage + (uint32_t)((warp >> 2) * 64 * FP8_BLOCK), b0 = stage + C::W_BYTES;
    dec_pin<C::FRAGS>(d);
    wgmma_fence();
    dec_block<GATE, NC>(d, a0, b0);
    wgmma_commit();
    wgmma_wait<0>();
    dec_pin<C::FRAGS>(d);
#pragma unroll
    for (int nt = 0; nt < NC; nt++) {
        float2 s[C::FRAGS];
        float next[C::FRAGS][4], probe = 0.0f;
#pragma unroll
        for (int f = 0; f < C::FRAGS; f++) {
            /* this block's products of the thread's two slots and the half */
            s[f] = *(const float2 *)(sc + f * DEC_NS + nt * 8 + 2 * t);
            next[f][0] = __fmaf_rn(d[f][4 * nt + 0], s[f].x, acc[f][nt][0]);
            next[f][1] = __fmaf_rn(d[f][4 * nt + 1], s[f].y, acc[f][nt][1]);
            next[f][2] = __fmaf_rn(d[f][4 * nt + 2], s[f].x, acc[f][nt][2]);
            next[f][3] = __fmaf_rn(d[f][4 * nt + 3], s[f].y, acc[f][nt][3]);
            /* NaN when any of them is (or two infinities cancel) */
            probe += (next[f][0] + next[f][1]) + (next[f][2] + next[f][3]);
        }
        const bool exact = __builtin_expect(mf_is_nan(probe), 0);
#pragma unroll
        for (int f = 0; f < C::FRAGS; f++)
#pragma unroll
            for (int v = 0; v < 4; v++)
                acc[f][nt][v] = exact ? fp8_fma(d[f][4 * nt + v], (v & 1) ? s[f].y : s[f].x,
                                                acc[f][nt][v])
                                      : next[f][v];
    }
}

/*
 * Rank r > 0 of a split tile hands its sums to rank 0 through L2: it waits until rank 0 has
 * read the previous ones (red_free), writes them, and arrives on rank 0's red_full; rank 0
 * waits for all and adds them in rank order, then frees each rank's buffer. mbarriers, not
 * cluster barriers, so that the producer warps never wait for this.
 */
template <int GATE>
static __device__ __forceinline__ void dec_split_sum(float (&acc)[2][4][4], float4 *part,
                                                     uint64_t *red_full, uint64_t *red_free,
                                                     int split, int rank, unsigned phase, int tid)
{
    using C = DecCfg<GATE>;
    if (rank != 0) {
        hp_mbar_wait(dec_smem(red_free), phase ^ 1u);
#pragma unroll
        for (int f = 0; f < C::FRAGS; f++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
                __stcg(part + rank * C::PART4 + (f * 4 + nt) * DEC_CONSUMER_THREADS + tid,
                       make_float4(acc[f][nt][0], acc[f][nt][1], acc[f][nt][2], acc[f][nt][3]));
        __threadfence();
        dec_bar_consumers();
        if (tid == 0)
            hp_mbar_arrive_cluster(hp_cluster_map(dec_smem(red_full), 0u));
        return;
    }
    hp_mbar_wait_cluster(dec_smem(red_full), phase);
    for (int r = 1; r < split; r++)
#pragma unroll
        for (int f = 0; f < C::FRAGS; f++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const float4 o =
                    __ldcg(part + r * C::PART4 + (f * 4 + nt) * DEC_CONSUMER_THREADS + tid);
                acc[f][nt][0] = fp8_add(acc[f][nt][0], o.x);
                acc[f][nt][1] = fp8_add(acc[f][nt][1], o.y);
                acc[f][nt][2] = fp8_add(acc[f][nt][2], o.z);
                acc[f][nt][3] = fp8_add(acc[f][nt][3], o.w);
            }
    dec_bar_consumers(); /* every rank's sums read */
    if (tid >= 1 && tid < split)
        hp_mbar_arrive_cluster(hp_cluster_map(dec_smem(red_free), (unsigned)tid));
}

#include "cuda/moe_fp8_decode_epi.cuh" /* the gate's and the final's epilogues */

#endif /* MOE_WGMMA_DEVICE */

/* ------------------------------------------------------------- the kernel */

template <int GATE>
__global__ void __launch_bounds__(DecCfg<GATE>::THREADS, DecCfg<GATE>::MINB)
    fp8_dec_gemm(const __grid_constant__ DecParams p)
{
#ifdef MOE_WGMMA_DEVICE
    using C = DecCfg<GATE>;
    extern __shared__ __align__(128) char smem_raw[];
    char *smem = smem_raw + ((1024 - (dec_smem(smem_raw) & 1023)) & 1023); /* swizzle atoms */
    __shared__ DecTileSmem ts;
    __shared__ DecDirect dd;
    __shared__ __align__(8) uint64_t full[C::STAGES], empty[C::STAGES], red_full, red_free;
    __shared__ __align__(8) uint64_t epi_full, epi_free; /* consumers -> the sums warp */
    const Fp8Gemm &g = p.g;
    const Fp8DecExtra &x = p.x;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int split = x.split;
    const int rank = (int)(blockIdx.x % split);
    const long long cluster = blockIdx.x / split;
    /* the producer's lane 0 creates the barriers: its early copies use them before any
     * block-wide barrier */
    if (tid == DEC_PRODUCER * 32) {
        for (int st = 0; st < C::STAGES; st++) {
            hp_mbar_init(dec_smem(&full[st]), DEC_FULL_ARRIVALS);
            hp_mbar_init(dec_smem(&empty[st]), 8);
        }
        hp_mbar_init(dec_smem(&red_full), split > 1 ? split - 1 : 1);
        hp_mbar_init(dec_smem(&red_free), 1);
        hp_mbar_init(dec_smem(&epi_full), 8); /* lane 0 of each consumer warp */
        hp_mbar_init(dec_smem(&epi_free), 1);
        hp_mbar_init_fence();
    }
    if (split > 1)
        hp_cluster_sync(); /* every block's barriers exist before another arrives on them */
    const long long nkb = g.depth / FP8_BLOCK, per = (nkb + split - 1) / split;
    const long long kb0 = rank * per < nkb ? rank * per : nkb;
    const long long kb1 = kb0 + per < nkb ? kb0 + per : nkb;
    const bool early = x.early && x.pdl; /* the tiles are known before the wait */
    int pre = 0;
    if (early && warp == DEC_PRODUCER) {
        if (x.mode == DEC_DIRECT)
            dec_direct_tiles(g, dd, lane);
        pre = dec_producer_early<GATE>(p, dd, smem, full, cluster, kb0, kb1, lane);
    }
    if (x.pdl)
        mf_pdl_wait(); /* everything below reads what earlier kernels wrote */
    if (x.trigger)
        mf_pdl_trigger();
    if (blockIdx.x == 0)
        dec_zero(g.rt, g.rt.S / (g.rt.topk > 0 ? g.rt.topk : 1), x.zero_slot, x.zero_tok,
                 x.zero_arrivals, x.zero_arrivals_n, tid, C::THREADS);
    if (!early && x.mode == DEC_DIRECT && warp == DEC_PRODUCER)
        dec_direct_tiles(g, dd, lane);
    __syncthreads();
    const long long items = dec_ntiles(x, dd) * g.nblk;
    if (warp == DEC_PRODUCER) {
        dec_producer<GATE>(p, dd, smem, full, empty, cluster, items, kb0, kb1, pre, lane);
        return;
    }
    const bool sums = !GATE && x.arrivals && rank == 0; /* the sums warp takes the items' y */
    if (warp == DEC_SUMS) {
        if (sums)
            dec_final_sums(g, x, dd, &epi_full, &epi_free, cluster, items, lane);
        return;
    }
    float4 *part = x.part ? (float4 *)x.part + cluster * split * C::PART4 : NULL;
    HpPipe<C::STAGES> pipe = {0, 0u};
    unsigned red_phase = 0, epi_phase = 0;
    for (long long w = cluster; w < items; w += x.clusters) {
        const long long ti = w / g.nblk, nb = w - ti * g.nblk;
        dec_bar_consumers(); /* the previous tile's rows are read */
        if (warp == 0) {
            long long e, s;
            const int count = dec_tile(g, x, dd, ti, lane, &e, &s);
            dec_rows(g, ts, count, e, s, lane);
        }
        dec_bar_consumers();
        const int count = ts.count; /* the same in every block of the cluster */
        if (count == 0)
            continue;
        float acc[2][4][4], d[2][16];
#pragma unroll
        for (int f = 0; f < 2; f++) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int v = 0; v < 4; v++)
                    acc[f][nt][v] = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; i++)
                d[f][i] = 0.0f;
        }
        const int ncols = (count + 7) / 8;
        float *win = (float *)(smem + C::H_OFF); /* two windows (the gate's h buffer) */
        float sa[C::SREGS], sw[C::SREGS];
        dec_scales_load<GATE>(g, ts, nb, kb0, kb1, tid, sa, sw);
        /* the block's window (0 or 1) and its row there: int counters, no 64-bit division */
        const int nblocks = (int)(kb1 - kb0);
        int wsel = 1, wb = DEC_SWIN;
        for (int i = 0; i < nblocks; i++, wb++) {
            if (wb == DEC_SWIN) {
                wb = 0;
                wsel ^= 1;
                /* the other window was last read before the previous window's barrier */
                dec_scales_store(win + wsel * (DEC_SWIN * C::SCOLS), sa, sw, tid);
                dec_bar_consumers();
                if (i + DEC_SWIN < nblocks) /* the next window's latency hides behind this one */
                    dec_scales_load<GATE>(g, ts, nb, kb0 + i + DEC_SWIN, kb1, tid, sa, sw);
            }
            const float *row = win + wsel * (DEC_SWIN * C::SCOLS) + wb * C::SCOLS;
            const uint32_t stage = dec_smem(smem + pipe.stage * C::STAGE);
            hp_mbar_wait(dec_smem(&full[pipe.stage]), pipe.phase);
            hp_fence_proxy_async(); /* the cp.async rows, for the tensor cores' proxy */
            switch (ncols) { /* the same in every thread of the block */
            case 1: dec_consume<GATE, 1>(stage, warp, lane, row, d, acc); break;
            case 2: dec_consume<GATE, 2>(stage, warp, lane, row, d, acc); break;
            case 3: dec_consume<GATE, 3>(stage, warp, lane, row, d, acc); break;
            default: dec_consume<GATE, 4>(stage, warp, lane, row, d, acc); break;
            }
            __syncwarp();
            if (lane == 0)
                hp_mbar_arrive(dec_smem(&empty[pipe.stage]));
            pipe.advance();
        }
        if (split > 1) {
            dec_split_sum<GATE>(acc, part, &red_full, &red_free, split, rank, red_phase, tid);
            red_phase ^= 1u;
        }
        if (rank == 0) {
            if (GATE) {
                dec_bar_consumers(); /* the scale windows (h's buffer) are read */
                dec_gate_epilogue(g, ts, nb, smem + C::H_OFF, acc, warp, lane);
            } else {
                dec_final_epilogue(g, ts, nb, acc, warp, lane);
                if (sums) {
                    __syncwarp(); /* the warp's y stores, before its arrival */
                    if (lane == 0) {
                        /* at most one item ahead of the sums warp, so that the phases match */
                        hp_mbar_wait(dec_smem(&epi_free), epi_phase ^ 1u);
                        hp_mbar_arrive(dec_smem(&epi_full));
                    }
                    __syncwarp(); /* converged again before the consumers' next barrier */
                    epi_phase ^= 1u;
                }
            }
        }
    }
    if (split > 1 && rank != 0) /* rank 0 has read this block's last sums: it may exit */
        hp_mbar_wait(dec_smem(&red_free), red_phase ^ 1u);
#endif
}

/* ------------------------------------------------------------- host */

int moe_fp8_dec_usable(const cuda_state *s)
{
    return moe_wgmma_usable(s) && s->clusters &&
           (size_t)DecCfg<0>::SMEM <= s->smem_optin && (size_t)DecCfg<1>::SMEM <= s->smem_optin;
}

/*
 * Clusters of `split` blocks that can be resident at once (cudaOccupancyMaxActiveClusters,
 * cached per context; at least 1). The grid is persistent, so no more are launched.
 */
template <int GATE> static int resident_clusters(cuda_state *s, int split)
{
    int *cached = &s->dec_max_clusters[GATE][split];
    if (*cached == 0) {
        int n = 0;
        if (cudaFuncSetAttribute(fp8_dec_gemm<GATE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 DecCfg<GATE>::SMEM) == cudaSuccess) {
            cudaLaunchConfig_t cfg = {};
            cudaLaunchAttribute at = {};
            at.id = cudaLaunchAttributeClusterDimension;
            at.val.clusterDim.x = (unsigned)split;
            at.val.clusterDim.y = at.val.clusterDim.z = 1;
            cfg.gridDim = dim3((unsigned)split);
            cfg.blockDim = dim3(DecCfg<GATE>::THREADS);
            cfg.dynamicSmemBytes = DecCfg<GATE>::SMEM;
            cfg.attrs = &at;
            cfg.numAttrs = 1;
            if (cudaOccupancyMaxActiveClusters(&n, fp8_dec_gemm<GATE>, &cfg) != cudaSuccess)
                n = 0;
        }
        (void)cudaGetLastError(); /* a refusal here leaves no error for the next launch check */
        *cached = n > 0 ? n : (DecCfg<GATE>::MINB * s->sm_count / split > 0
                                   ? DecCfg<GATE>::MINB * s->sm_count / split
                                   : 1);
    }
    return *cached;
}

/*
 * What an item costs beyond its blocks, in blocks streamed: its tile's rows and first scales,
 * the split's sums and the epilogue. Fitted on the H200 (docs/PERFORMANCE.md) from the forced
 * splits 1, 2, 3, 4 and 8 of the Mixtral, DeepSeek-V3 and Qwen3-30B-A3B layers at M = 1: the
 * gate of Mixtral took 75, 93 and 126 us at splits 1, 2 and 4 (2, 4 and 7 waves of 32, 16, 8
 * blocks), about 10 blocks more per item than its blocks alone.
 */
#define DEC_ITEM_COST 10

/*
 * Shares of the depth: the fewest waves of the blocks that fit at once times the blocks each
 * streams plus DEC_ITEM_COST; ties to the smaller split. From the shapes and the device alone,
 * so a layer's steps and its workspace agree.
 */
int moe_fp8_dec_split(cuda_state *s, int gate, long long tiles_est, long long nblk,
                      long long nkb)
{
    if (s->forced_split > 0)
        return s->forced_split <= nkb ? s->forced_split : (int)(nkb > 0 ? nkb : 1);
    const long long items = tiles_est * nblk;
    int best = 1;
    long long best_cost = -1;
    for (int sp = 1; sp <= DEC_SPLIT_MAX && sp <= nkb; sp++) {
        const long long slots =
            (long long)sp * (gate ? resident_clusters<1>(s, sp) : resident_clusters<0>(s, sp));
        const long long waves = (items * sp + slots - 1) / slots;
        const long long cost = waves * ((nkb + sp - 1) / sp + DEC_ITEM_COST);
        if (best_cost < 0 || cost < best_cost)
            best = sp, best_cost = cost;
    }
    return best;
}

size_t moe_fp8_dec_part_bytes(int gate, int clusters, int split)
{
    const size_t per = (size_t)(gate ? DecCfg<1>::PART4 : DecCfg<0>::PART4) * 16;
    return split > 1 ? per * (size_t)clusters * (size_t)split : 0;
}

int moe_fp8_dec_clusters(cuda_state *s, int gate, long long items, int split)
{
    const long long cap = gate ? resident_clusters<1>(s, split) : resident_clusters<0>(s, split);
    return (int)(items < cap ? (items > 0 ? items : 1) : cap);
}

template <int GATE>
static moefuse_status ready(moefuse_context *ctx, cuda_state *s, const char *op)
{
    return moe_ready_smem(ctx, s, op, fp8_dec_gemm<GATE>, DecCfg<GATE>::SMEM,
                          DecCfg<GATE>::SMEM + sizeof(DecTileSmem) + sizeof(DecDirect) + 256,
                          &s->dec_smem_raised, GATE ? 2u : 1u,
                          "cudaFuncSetAttribute(fp8_dec_gemm)");
}

moefuse_status moe_fp8_dec_launch(moefuse_context *ctx, cuda_state *s, const char *op, int gate,
                                  const Fp8Gemm *g, const Fp8DecExtra *x)
{
    MF_TRY(gate ? ready<1>(ctx, s, op) : ready<0>(ctx, s, op));
    if (!g)
        return MOEFUSE_OK;
    DecParams p;
    memset(&p, 0, sizeof p);
    p.g = *g;
    p.x = *x;
    p.x.w_map = moe_fp8_weights_map(s, g, gate, DEC_BOX_ROWS, &p.map_w);
    const dim3 grid((unsigned)(p.x.clusters * x->split));
    /* a final in clusters waits for the gate's end instead: launched early (PDL), its clusters
     * took the SMs as the gate's blocks left, and the layer ran longer than its gate and final
     * one after the other (H200, Mixtral M = 1, split 7: 174.5 against 141.0 us) */
    if (!gate && x->split > 1)
        p.x.pdl = 0;
    if (gate)
        mf_launch_pdl(fp8_dec_gemm<1>, grid, DecCfg<1>::THREADS, DecCfg<1>::SMEM, s->stream,
                      p.x.pdl, p, (unsigned)x->split);
    else
        mf_launch_pdl(fp8_dec_gemm<0>, grid, DecCfg<0>::THREADS, DecCfg<0>::SMEM, s->stream,
                      p.x.pdl, p, (unsigned)x->split);
    return mf_cuda_launched(ctx, op, "fp8_dec_gemm");
}
