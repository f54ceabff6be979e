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
#include "cuda/moe_fp8_decode_trace.cuh" /* -DMOE_DEC_TRACE: the roles' timeline */

#include <string.h>
#ifdef MOE_DEC_TRACE
#include <stdio.h>
#include <stdlib.h>
#endif

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
    __align__(8) float exp_tab[64]; /* mf_exp_tab_fast's table, for the gate's silu */
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


#include "cuda/moe_fp8_decode_producer.cuh" /* the tile lookup and the producer warp */
#include "cuda/moe_fp8_decode_consumer.cuh" /* the consumer warps */
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
    mf_exp_tab_fill(ts.exp_tab, tid);
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
    int it = 0; /* the block's item, for the timeline */
    for (long long w = cluster; w < items; w += x.clusters, it++) {
        const long long ti = w / g.nblk, nb = w - ti * g.nblk;
        if (lane == 0 && (warp & 3) == 0)
            DEC_STAMP(GATE, it, DT_C_TOP + (warp >> 2));
        dec_bar_consumers(); /* the previous tile's rows are read */
        if (warp == 0) {
            long long e, s;
            const int count = dec_tile(g, x, dd, ti, lane, &e, &s);
            dec_rows(g, ts, count, e, s, lane);
        }
        dec_bar_consumers();
        if (tid == 0)
            DEC_STAMP(GATE, it, DT_C_TILE);
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
        float *win = (float *)(smem + C::H_OFF); /* two windows (the gate's h buffer) */
        DecStream<C::STAGES> st = {smem, win, full, empty, &pipe};
        switch ((count + 7) / 8) { /* n8 columns: the same in every thread of the block */
        case 1: dec_stream<GATE, 1>(g, ts, st, nb, kb0, kb1, tid, d, acc, it); break;
        case 2: dec_stream<GATE, 2>(g, ts, st, nb, kb0, kb1, tid, d, acc, it); break;
        case 3: dec_stream<GATE, 3>(g, ts, st, nb, kb0, kb1, tid, d, acc, it); break;
        default: dec_stream<GATE, 4>(g, ts, st, nb, kb0, kb1, tid, d, acc, it); break;
        }
        if (lane == 0 && (warp & 3) == 0)
            DEC_STAMP(GATE, it, DT_C_END + (warp >> 2));
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
            if (lane == 0 && (warp & 3) == 0)
                DEC_STAMP(GATE, it, DT_C_EPI + (warp >> 2));
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

#ifdef MOE_DEC_TRACE
/* The timeline of the 30th launch of each kernel (the first ones warm up) into
 * $MOEFUSE_DEC_TRACE.gate / .final: four ints (grid, split, clusters, gate), then the stamps. */
static void dec_trace_dump(cuda_state *s, int gate, unsigned grid, const Fp8DecExtra *x)
{
    static int launches[2];
    static unsigned long long h[DEC_TRACE_BLOCKS][DEC_TRACE_ITEMS][DT_EVENTS];
    const char *prefix = getenv("MOEFUSE_DEC_TRACE");
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (!prefix || ++launches[gate] != 30 || cudaStreamIsCapturing(s->stream, &cs) != cudaSuccess ||
        cs != cudaStreamCaptureStatusNone)
        return;
    char path[4096];
    snprintf(path, sizeof path, "%s.%s", prefix, gate ? "gate" : "final");
    FILE *f = fopen(path, "wb");
    if (!f || cudaStreamSynchronize(s->stream) != cudaSuccess ||
        cudaMemcpyFromSymbol(h, dec_trace, sizeof h, (size_t)gate * sizeof h) != cudaSuccess) {
        if (f)
            fclose(f);
        return;
    }
    const int hdr[4] = {(int)grid, x->split, x->clusters, gate};
    fwrite(hdr, sizeof hdr, 1, f);
    fwrite(h, sizeof h, 1, f);
    fclose(f);
}
#endif

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
#ifdef MOE_DEC_TRACE
    dec_trace_dump(s, gate, grid.x, x);
#endif
    return mf_cuda_launched(ctx, op, "fp8_dec_gemm");
}
