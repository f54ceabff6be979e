/*
 * Hopper (sm_90a) MoE GEMM, warp-specialised and persistent: same tile and
 * same bits as moe_wgmma.cu, built so that the tensor cores never wait for a
 * copy the producer could have issued earlier. moe_ops.cu takes it for large
 * experts at any number of slots per expert: its TMA streams the weights at
 * copy bandwidth even where most of a tile is padding (decode-sized batches).
 *
 * Roles (384 threads, one block per SM):
 *  - producer, warpgroup 0 (56 registers a thread after setmaxnreg): fills a
 *    ring of WS_STAGES shared-memory stages. B (256 weight rows x 64 depth)
 *    comes by TMA from a 3-D tensor map [E, rows, depth], two 128-row boxes
 *    (gate: the gate rows and the up rows of the block's 128 h columns; a half
 *    tile's gate: four 64-row boxes, see ws_produce);
 *    A (the tile's 128 slots, gathered row by row from x or h through the
 *    route's slot list) by cp.async, since TMA cannot gather. Each stage has
 *    a "full" mbarrier (128 cp.async arrivals + the TMA bytes) and an "empty"
 *    one (8 consumer warps).
 *  - consumers, warpgroups 1 and 2 (224 registers): each 64 slots x 256 rows
 *    with wgmma m64n256k16, one wgmma group in flight while the next stage is
 *    waited for; a stage is released as soon as the wgmma that read it is done.
 *    A half tile (at most 64 slots: an expert's last rows, or all of a small
 *    expert's) is split by columns instead: each warpgroup the 64 slots x 128
 *    of the rows (m64n128k16), half the tensor work of a padded full tile.
 *    Epilogue from the accumulators (gate: activation; final: y, or y in f32
 *    for moe_reduce.cu's top-k sum), with no barrier among the consumers,
 *    while the producer already loads the next tile.
 *    Routed calls only: direct mode's launches go to moe_wgmma.cu.
 * Scheduler: grid = min(tiles, SMs); each block takes its next tile from a
 * counter (ws_take_tile), in the route's order (expert, column block, m-tile
 * fastest), so the blocks at work at any time share an expert's weight rows
 * through L2. The producer reads each tile's slot list for its gather anyway
 * and leaves the rows' output offsets in a ring of tile slots, where the
 * consumers read them in place until their epilogue is done: a tile starts
 * without a global load or a barrier.
 *
 * Numerics: the four k16 steps of a depth tile in order, tiles in order,
 * with the instruction of moe_wgmma.cu (m64n128 makes each output the same
 * sum as m64n256): the same bits (NUMERICS.md). Padding rows (past the
 * tile's slots) and depth past K are zeros in both operands, as there; a
 * half tile's rows 64..127 are not read, so not written.
 *
 * The host uses it for routed calls whose A rows are 16-byte aligned and
 * whose weights a tensor map can describe; otherwise moe_wgmma.cu.
 */
#include "cuda/moe_tiles.cuh"
#include "cuda/wgmma.cuh"

#include <cuda.h> /* CUtensorMap and its encoding enums (the function comes from the driver) */
#include <limits.h>
#include <string.h>

static_assert(MOE_BK == 16 * WG_K16_STEPS, "a stage holds the k16 steps of wgmma_tile");

#define WS_BM 128
#define WS_BN 256
#define WS_STAGES 4
#define WS_THREADS 384
#define WS_CONSUMERS 256
#define WS_HALF_ROWS (WS_BM / 2) /* a tile of at most this many slots is a half tile */
#define WS_A_BYTES (WS_BM * 128)
#define WS_BOX_BYTES (128 * 128)     /* one TMA box: 128 rows of 64 elements */
#define WS_HALF_BOX_BYTES (64 * 128) /* a half tile's gate box: 64 rows */
#define WS_STAGE_BYTES ((WS_BM + WS_BN) * 128)
#define WS_FULL_ARRIVALS (128 + 1) /* producer threads' cp.async, and the TMA announcement */
#define WS_CONSUMER_WARPS 8        /* arrivals that free a stage or a tile slot */
#define WS_BAR_PRODUCER 2          /* named barrier of the producer warpgroup */
#define WS_TILE_SLOTS 4            /* tiles taken ahead of the consumers */
#define WS_TILE_FILLERS 128        /* producer threads that write a slot */
/* the epilogue's chunks: WS_CHUNK floats a consumer thread */
#define WS_CHUNK 16
#define WS_BUF_FLOATS (WS_CHUNK * WS_CONSUMERS)
#define WS_SMEM (WS_STAGES * WS_STAGE_BYTES + 1024 + WS_BUF_FLOATS * 4)

/*
 * Tiles taken by the producer, waiting for the consumers (ws_take_tile), with
 * the output row of each of the tile's slots, which the producer reads anyway
 * for its gather: the consumers start a tile without a global load, and read
 * the slot until their epilogue is done.
 */
struct WsTiles {
    uint64_t full[WS_TILE_SLOTS];  /* WS_TILE_FILLERS arrivals: tile and rows written */
    uint64_t empty[WS_TILE_SLOTS]; /* WS_CONSUMER_WARPS arrivals: their epilogue is done */
    MoeTileAt at[WS_TILE_SLOTS];
    long long orow[WS_TILE_SLOTS][WS_BM];
};

/* Static shared memory of the kernel, bounded from above (barriers, slots, exp table). */
#define WS_STATIC_SMEM (sizeof(WsTiles) + 2 * WS_STAGES * 8 + 64 * 4 + 256)

typedef struct MoeWsParams {
    CUtensorMap map_w;      /* the expert weights as [E, rows, depth], boxes of 128 rows */
    CUtensorMap map_w_half; /* the same, boxes of 64 rows (a half tile's gate) */
    MoeGemm g;
} MoeWsParams;

#ifdef MOE_WGMMA_DEVICE
/*
 * Tile scheduler: blocks take tiles from a counter in the route's scratch
 * (atomicAdd), in the route's order, as they get free. Unlike a fixed stride
 * per block, the tiles at work stay a contiguous range of that order, so the
 * blocks reading an expert's weight rows run at the same time and share them
 * in L2 however unevenly blocks progress. Producer thread 0 takes each tile
 * and hands its description to the consumers through a ring of slots; once
 * the tiles are out, the end mark (e = -1).
 */
static __device__ __forceinline__ void ws_take_tile(const MoeGemm &p, WsTiles &sl,
                                                    const HpPipe<WS_TILE_SLOTS> &ts)
{
    hp_mbar_wait(smem_u32(&sl.empty[ts.stage]), ts.phase ^ 1u);
    const long long lin = (long long)atomicAdd(p.tile_ctr, 1u);
    sl.at[ts.stage] = moe_tile_at<WS_BM>(p, lin);
}

/*
 * Producer: for every tile of this block and every depth tile, wait for the
 * stage to be free, announce and issue the two weight boxes, gather the A
 * rows, and let the stage's full barrier count this thread's copies.
 */
template <bool GATE>
static __device__ __forceinline__ void ws_produce(const MoeWsParams &P, uint32_t sbase,
                                                  uint64_t *full, uint64_t *empty, WsTiles &sl,
                                                  long long KT)
{
    const MoeGemm &p = P.g;
    const int tid = threadIdx.x; /* 0..127 */
    const int crow = tid >> 3, chunk = tid & 7;
    const uint32_t dst = (uint32_t)crow * 128u + (uint32_t)((chunk ^ (crow & 7)) << 4);
    constexpr int ROWS = WS_BM / 16; /* A rows per thread: crow + 16 i */
    HpPipe<WS_STAGES> ps = {0, 0u};
    HpPipe<WS_TILE_SLOTS> ts = {0, 0u};
    if (p.pdl)
        mf_pdl_wait(); /* the final reads h, which the gate writes */
    for (;;) {
        if (tid == 0) /* the next tile for this block; the slot's full barrier announces it to
                       * the consumers once every producer thread has written its rows */
            ws_take_tile(p, sl, ts);
        moe_sync<WS_BAR_PRODUCER, 128>();
        const int slot = ts.stage;
        const MoeTileAt at = sl.at[slot];
        ts.advance();
        const char *arow[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int r = crow + 16 * i;
            long long ar = -1, orr = -1, m = -1;
            if (r < at.count) /* none past the last tile: e < 0 has count 0 */
                m = moe_row_offsets(p, p.rt.list[at.first + r], &ar, &orr);
            arow[i] = m >= 0 ? (const char *)p.a + ar * 2 : nullptr;
            if (chunk == 0)
                sl.orow[slot][r] = orr;
        }
        hp_mbar_arrive(smem_u32(&sl.full[slot])); /* release: this thread's writes are visible */
        if (at.e < 0)
            break;
        /* B: two boxes of 128 rows (gate: the gate rows, then the up rows of the block's 128
         * h columns). A half tile's gate takes four of 64 (gate and up rows of h columns 0..63,
         * then of 64..127), so that each warpgroup's half of the stage holds both rows of its
         * columns. A half tile's consumers read A's first 64 rows only. */
        const bool half = at.count <= WS_HALF_ROWS;
        const int arows = half ? ROWS / 2 : ROWS;
        const int b0 = (int)(GATE ? p.gate_row + at.nb * (WS_BN / 2) : at.nb * WS_BN);
        const int b1 = (int)(GATE ? p.up_row + at.nb * (WS_BN / 2) : at.nb * WS_BN + 128);
        for (long long kt = 0; kt < KT; kt++) {
            const uint32_t stage = sbase + (uint32_t)(ps.stage * WS_STAGE_BYTES);
            const uint32_t fb = smem_u32(&full[ps.stage]);
            hp_mbar_wait(smem_u32(&empty[ps.stage]), ps.phase ^ 1u);
            if (tid == 0) {
                hp_mbar_arrive_tx(fb, WS_BN * 128);
                const uint32_t sb = stage + WS_A_BYTES;
                const int kc = (int)(kt * MOE_BK), e = (int)at.e;
                if (GATE && half) {
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        hp_tma_load_3d(sb + q * WS_HALF_BOX_BYTES, &P.map_w_half, fb, kc,
                                       ((q & 1) ? b1 : b0) + (q >> 1) * 64, e);
                } else {
                    hp_tma_load_3d(sb, &P.map_w, fb, kc, b0, e);
                    hp_tma_load_3d(sb + WS_BOX_BYTES, &P.map_w, fb, kc, b1, e);
                }
            }
            const long long kcol = kt * MOE_BK + chunk * 8, rem = p.depth - kcol;
            const int bytes = rem >= 8 ? 16 : (rem > 0 ? (int)rem * 2 : 0);
#pragma unroll
            for (int i = 0; i < ROWS; i++)
                if (i < arows)
                    cp_async16(stage + dst + (uint32_t)(i * 16 * 128),
                               arow[i] && bytes ? arow[i] + kcol * 2 : (const char *)p.a,
                               arow[i] ? bytes : 0);
            hp_cp_async_arrive(fb);
            ps.advance();
        }
    }
    cp_async_wait<0>(); /* no copy of this thread outlives it */
}

/*
 * Epilogue from the accumulators. Accumulator 4 i + v of a thread: tile row
 * 64 cw + 16 warp + lane / 4 (+ 8 for v >= 2; a half tile: 16 warp + ...), B row
 * 8 i + 2 (lane % 4) + (v & 1) of the warpgroup's B rows. Gate: ws_up_block
 * says which accumulators make an h column pair.
 *
 * Fully unrolled, the activation and the stores of 128 accumulators are tens
 * of thousands of instructions, fetched once per tile and never again (the
 * exact activations are long). So the values go in chunks of 16 through this
 * thread's own column of `buf` (stride WS_CONSUMERS floats: no bank conflict,
 * no barrier), and out-of-line functions turn each chunk into outputs, its
 * values side by side so that their latencies overlap.
 */

/*
 * PAIRS value pairs side by side, pair j (v[2 j], v[2 j + 1]) of row j & 1 (output rows
 * orow0 / orow1, -1: none) at columns c0 + 8 (j >> 1) and the next; the final's bias added
 * (bb: the bias element of column c0); each value rounded once, a pair in one store where the
 * row allows it (vec).
 */
template <int PAIRS, bool BIAS>
static __device__ __forceinline__ void ws_store_pairs(void *out, int out_dt, int vec,
                                                      long long ncols, const void *bias,
                                                      int bias_dt, long long bb, long long orow0,
                                                      long long orow1, long long c0,
                                                      float (&v)[2 * PAIRS])
{
    if (BIAS && bias) {
#pragma unroll
        for (int i = 0; i < 2 * PAIRS; i++) {
            const long long c = 8 * (i >> 2) + (i & 1);
            if (c0 + c < ncols)
                v[i] = __fadd_rn(v[i], mfm_load(bias, bias_dt, bb + c));
        }
    }
#pragma unroll
    for (int j = 0; j < PAIRS; j++) {
        const long long orow = (j & 1) ? orow1 : orow0, c = c0 + 8 * (j >> 1);
        if (orow < 0 || c >= ncols)
            continue;
        const long long at = orow + c;
        if (vec && c + 2 <= ncols) {
            if (out_dt == MF_DT_F32)
                *(float2 *)((float *)out + at) = make_float2(v[2 * j], v[2 * j + 1]);
            else if (out_dt == MF_DT_BF16)
                *(uint32_t *)((uint16_t *)out + at) =
                    mf_f32_to_bf16(v[2 * j]) | ((uint32_t)mf_f32_to_bf16(v[2 * j + 1]) << 16);
            else
                *(uint32_t *)((uint16_t *)out + at) =
                    mf_f32_to_f16(v[2 * j]) | ((uint32_t)mf_f32_to_f16(v[2 * j + 1]) << 16);
        } else {
            mfm_store(out, out_dt, at, v[2 * j]);
            if (c + 1 < ncols)
                mfm_store(out, out_dt, at + 1, v[2 * j + 1]);
        }
    }
}

/* Out of line: the final's chunk of 8 pairs from the thread's column of buf (mine). */
static __device__ __noinline__ void ws_final_chunk(void *out, int out_dt, int vec, long long ncols,
                                                   const void *bias, int bias_dt, long long bb,
                                                   long long orow0, long long orow1,
                                                   long long c0, const float *mine)
{
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; i++)
        v[i] = mine[i * WS_CONSUMERS];
    ws_store_pairs<8, true>(out, out_dt, vec, ncols, bias, bias_dt, bb, orow0, orow1, c0, v);
}

/*
 * Out of line: the gate's chunk from the thread's column of buf (mine: gate values at 0..7,
 * up values at 8..15), activated (mfm_gate_vals) and stored from the registers: h makes no
 * second trip through shared memory.
 */
static __device__ __noinline__ void ws_gate_chunk(const MoeGemm &p, long long gb, long long ub,
                                                  long long c0, uint32_t tabs, long long orow0,
                                                  long long orow1, const float *mine)
{
    float g[8], u[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        g[j] = mine[j * WS_CONSUMERS];
        u[j] = mine[(8 + j) * WS_CONSUMERS];
    }
    mfm_gate_vals(p.act, p.alpha, p.limit, p.up_offset, p.bias, p.bias_dt, gb, ub, c0, p.ncols,
                  tabs, g, u);
    ws_store_pairs<4, false>(p.out, p.out_dt, p.vec_out, p.ncols, nullptr, 0, 0, orow0, orow1, c0,
                             g);
}

/*
 * The gate's accumulator blocks (n8 column blocks: accumulators 4 i .. 4 i + 3) of h column
 * block c (columns 8 c .. 8 c + 7 of the tile's, or of the warpgroup's half): the gate values
 * are block c; the up values block c + 16 in a full tile (B rows 128.. are the up rows), c + 8
 * in a half tile (the warpgroup's 128 B rows are 64 gate rows, then their 64 up rows).
 */
template <bool HALF> static __device__ __forceinline__ int ws_up_block(int c)
{
    return c + (HALF ? 8 : 16);
}

template <bool GATE, bool HALF>
static __device__ __forceinline__ void ws_epilogue(const MoeGemm &p, const MoeTileAt &at,
                                                   const long long *orow,
                                                   const float (&acc)[HALF ? 64 : 128],
                                                   float *buf, int ctid, uint32_t tabs)
{
    constexpr int BLOCKS = HALF ? 16 : 32; /* n8 accumulator blocks of the thread */
    const int cw = ctid >> 7, warp = (ctid >> 5) & 3, lane = ctid & 31;
    /* full tile: warpgroup w has rows 64 w.., all 256 columns; half tile: rows 0..63, and
     * the half of the columns from B row 128 w */
    const int r = (HALF ? 0 : cw * 64) + warp * 16 + (lane >> 2), cl = 2 * (lane & 3);
    const long long orow0 = orow[r], orow1 = orow[r + 8];
    /* a warp without a slot (the padding of a tile) has nothing to write */
    if (!__any_sync(0xFFFFFFFFu, orow0 >= 0 || orow1 >= 0))
        return;
    const long long ncols = p.ncols, be = at.e * p.bias_s0;
    const long long c0 = GATE ? at.nb * (WS_BN / 2) + (HALF ? 64 * cw : 0) + cl
                              : at.nb * WS_BN + (HALF ? 128 * cw : 0) + cl;
    /* final: the common case straight from the registers (vec_out: every pair aligned) */
    if (!GATE && p.vec_out && (p.out_dt == MF_DT_F32 || p.out_dt == MF_DT_BF16) &&
        (at.nb + 1) * WS_BN <= ncols) {
        bool nan = false;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const long long orow = h ? orow1 : orow0;
            if (orow < 0)
                continue;
            if (p.out_dt == MF_DT_BF16)
                nan |= mfm_y_row<true>(p.out, p.bias, p.bias_dt, be + c0, orow + c0, h, acc);
            else
                mfm_y_row<false>(p.out, p.bias, p.bias_dt, be + c0, orow + c0, h, acc);
        }
        if (!nan)
            return; /* else the chunks below store the rows again, NaN by mf_f32_to_bf16 */
    }
    float *mine = buf + ctid;
    constexpr int PER = GATE ? 2 : 4; /* column blocks per chunk */
    static_assert(PER * (GATE ? 8 : 4) == WS_CHUNK, "a chunk fills the thread's column of buf");
#pragma unroll
    for (int ch = 0; ch < (GATE ? BLOCKS / 2 : BLOCKS) / PER; ch++) {
        const long long cc = c0 + 8 * PER * ch;
#pragma unroll
        for (int q = 0; q < PER; q++) {
            const int c = ch * PER + q;
#pragma unroll
            for (int v = 0; v < 4; v++) {
                if (GATE) { /* ws_gate_chunk's layout: gate values at 0..7, up at 8..15 */
                    mine[(4 * q + v) * WS_CONSUMERS] = acc[4 * c + v];
                    mine[(8 + 4 * q + v) * WS_CONSUMERS] = acc[4 * ws_up_block<HALF>(c) + v];
                } else {
                    mine[(4 * q + v) * WS_CONSUMERS] = acc[4 * c + v];
                }
            }
        }
        if (GATE) /* (moe_ws.cu takes only weights whose gate and up rows are row_step 1) */
            ws_gate_chunk(p, be + p.gate_row + cc, be + p.up_row + cc, cc, tabs, orow0, orow1,
                          mine);
        else
            ws_final_chunk(p.out, p.out_dt, p.vec_out, ncols, p.bias, p.bias_dt, be + cc, orow0,
                           orow1, cc, mine);
    }
}

/*
 * One tile of the consumers: for each depth tile, wait for its stage, four wgmma on it,
 * release the stage the previous group read; then the epilogue. A full tile: warpgroup w
 * multiplies A rows 64 w.. by all of B (m64n256k16). A half tile (at most 64 slots): both
 * take A rows 0..63, warpgroup w B rows 128 w.. (m64n128k16), so a tile of few slots costs
 * half the tensor work and half the epilogue of a thread. Each output is the same sum either
 * way (the same k16 steps in order): the same bits.
 */
template <bool F16, bool GATE, bool HALF>
static __device__ __forceinline__ void ws_tile(const MoeGemm &p, const MoeTileAt &at,
                                               const long long *orow, uint32_t sbase,
                                               uint64_t *full, uint64_t *empty,
                                               HpPipe<WS_STAGES> &ps, float *buf, long long KT,
                                               uint32_t tabs)
{
    const int ctid = (int)threadIdx.x - 128; /* 0..255 */
    const int cw = ctid >> 7, lane = ctid & 31;
    const uint32_t a_off = HALF ? 0u : (uint32_t)(cw * 64 * 128);
    const uint32_t b_off = WS_A_BYTES + (HALF ? (uint32_t)(cw * 128 * 128) : 0u);
    float acc[HALF ? 64 : 128];
#pragma unroll
    for (int i = 0; i < (HALF ? 64 : 128); i++)
        acc[i] = 0.0f;
    pin(acc);
    int prev = -1;
    for (long long kt = 0; kt < KT; kt++) {
        hp_mbar_wait(smem_u32(&full[ps.stage]), ps.phase);
        hp_fence_proxy_async(); /* the cp.async rows, for the tensor cores' proxy */
        const uint32_t sa = sbase + (uint32_t)(ps.stage * WS_STAGE_BYTES);
        wgmma_tile<F16>(acc, sa + a_off, sa + b_off); /* m64n128 for a half tile's 64 */
        wgmma_wait<1>(); /* the group of depth tile kt - 1 is done: its stage is free */
        if (prev >= 0 && lane == 0)
            hp_mbar_arrive(smem_u32(&empty[prev]));
        prev = ps.stage;
        ps.advance();
    }
    wgmma_wait<0>();
    pin(acc);
    if (prev >= 0 && lane == 0)
        hp_mbar_arrive(smem_u32(&empty[prev]));
    ws_epilogue<GATE, HALF>(p, at, orow, acc, buf, ctid, tabs);
}

/* Consumers: each tile from its slot, full or half by its slots; then the slot goes back to
 * the producer. */
template <bool F16, bool GATE>
static __device__ __forceinline__ void ws_consume(const MoeGemm &p, uint32_t sbase,
                                                  uint64_t *full, uint64_t *empty, WsTiles &sl,
                                                  float *buf, long long KT, uint32_t tabs)
{
    const int lane = threadIdx.x & 31;
    HpPipe<WS_STAGES> ps = {0, 0u};
    HpPipe<WS_TILE_SLOTS> ts = {0, 0u};
    for (;;) {
        const int slot = ts.stage;
        hp_mbar_wait(smem_u32(&sl.full[slot]), ts.phase);
        ts.advance();
        const MoeTileAt at = sl.at[slot];
        if (at.e < 0)
            break;
        if (at.count <= WS_HALF_ROWS)
            ws_tile<F16, GATE, true>(p, at, sl.orow[slot], sbase, full, empty, ps, buf, KT, tabs);
        else
            ws_tile<F16, GATE, false>(p, at, sl.orow[slot], sbase, full, empty, ps, buf, KT,
                                      tabs);
        __syncwarp();
        if (lane == 0)
            hp_mbar_arrive(smem_u32(&sl.empty[slot])); /* this warp is done with the slot */
    }
}
#endif

template <bool F16, bool GATE>
__global__ void __launch_bounds__(WS_THREADS, 1) moe_ws_kernel(const __grid_constant__ MoeWsParams P)
{
#ifdef MOE_WGMMA_DEVICE
    extern __shared__ uint4 smem_raw[];
    __shared__ uint64_t full[WS_STAGES], empty[WS_STAGES];
    __shared__ WsTiles sl;
    __shared__ __align__(8) float exp_tab[64]; /* mf_exp_tab_fast's table, gate silu */
    const MoeGemm &p = P.g;
    /* TMA with the 128-byte swizzle and the wgmma descriptors want 1024-byte aligned stages */
    const uint32_t sbase = (smem_u32(smem_raw) + 1023u) & ~1023u;
    float *buf = (float *)((char *)smem_raw + (sbase - smem_u32(smem_raw)) +
                           WS_STAGES * WS_STAGE_BYTES);
    const long long KT = (p.depth + MOE_BK - 1) / MOE_BK;

    if (threadIdx.x == 0) {
        for (int st = 0; st < WS_STAGES; st++) {
            hp_mbar_init(smem_u32(&full[st]), WS_FULL_ARRIVALS);
            hp_mbar_init(smem_u32(&empty[st]), WS_CONSUMER_WARPS);
        }
        for (int st = 0; st < WS_TILE_SLOTS; st++) {
            hp_mbar_init(smem_u32(&sl.full[st]), WS_TILE_FILLERS);
            hp_mbar_init(smem_u32(&sl.empty[st]), WS_CONSUMER_WARPS);
        }
        hp_mbar_init_fence();
    }
    if (threadIdx.x == 32)
        hp_tma_prefetch(&P.map_w);
    if (threadIdx.x == 64)
        hp_tma_prefetch(&P.map_w_half);
    mf_exp_tab_fill(exp_tab, threadIdx.x);
    __syncthreads();
    if (p.trigger)
        mf_pdl_trigger(); /* the final may launch once every block of this grid started */
    if (threadIdx.x < 128) {
        hp_regs_dec<56>();
        ws_produce<GATE>(P, sbase, full, empty, sl, KT);
    } else {
        hp_regs_inc<224>();
        ws_consume<F16, GATE>(p, sbase, full, empty, sl, buf, KT,
                              (uint32_t)__cvta_generic_to_shared(exp_tab));
    }
#else
    (void)P; /* never launched: the host checks for sm_90a first */
#endif
}

typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                    const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                    const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                    CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/*
 * The weights as a 3-D tensor map [E, rows, depth] (rows: 2 I for the gate's
 * w1, K for the final's w2), boxes of box_rows rows x 64 elements in the 128-byte
 * swizzle. 0 when the driver refuses them (strides TMA cannot take).
 */
static int encode_weights(const cuda_state *s, const MoeGemm *p, int gate, int f16,
                          unsigned box_rows, CUtensorMap *map)
{
    const int64_t rows = gate ? 2 * p->ncols : p->ncols;
    /* the kernel's coordinates reach 255 rows and 63 elements past the tensor (zeros) */
    if (!s->tensor_map_encode || p->depth >= INT_MAX - 512 || rows >= INT_MAX - 512 ||
        p->rt.E >= INT_MAX ||
        p->w_s1 <= 0 || p->w_s0 <= 0)
        return 0;
    const cuuint64_t dims[3] = {(cuuint64_t)p->depth, (cuuint64_t)rows, (cuuint64_t)p->rt.E};
    const cuuint64_t strides[2] = {(cuuint64_t)p->w_s1 * 2, (cuuint64_t)p->w_s0 * 2};
    const cuuint32_t box[3] = {MOE_BK, box_rows, 1}, estride[3] = {1, 1, 1};
    encode_tiled_fn encode = (encode_tiled_fn)s->tensor_map_encode;
    return encode(map, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
                  (void *)p->w, dims, strides, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <bool F16, bool GATE>
static moefuse_status launch(moefuse_context *ctx, cuda_state *s, const char *op, const MoeGemm *p)
{
    void (*kern)(const MoeWsParams) = moe_ws_kernel<F16, GATE>;
    /* the fallback (moe_wgmma.cu) must be ready too: a call may need it */
    MF_TRY(moe_launch_wgmma(ctx, s, op, GATE, F16, NULL));
    MF_TRY(moe_ready_smem(ctx, s, op, kern, WS_SMEM, WS_SMEM + WS_STATIC_SMEM,
                          &s->ws_smem_raised, (uint32_t)1 << ((F16 ? 2 : 0) + (GATE ? 1 : 0)),
                          "cudaFuncSetAttribute(moe_ws_kernel)"));
    if (!p)
        return MOEFUSE_OK; /* only made ready */
    MoeWsParams P;
    memset(&P, 0, sizeof P);
    /* (the interleaved order: a 128-row box would hold gate and up rows alike) */
    if (p->rt.direct || p->fuse || !p->tile_ctr || !p->vec_a || !p->vec_b || p->row_step != 1 ||
        !encode_weights(s, p, GATE, F16, 128, &P.map_w) ||
        !encode_weights(s, p, GATE, F16, 64, &P.map_w_half))
        return moe_launch_wgmma(ctx, s, op, GATE, F16, p); /* same tile, same bits */
    P.g = *p;
    const long long tiles = p->lin_bound;
    const unsigned grid = (unsigned)(tiles < s->sm_count ? tiles : s->sm_count);
    mf_launch_pdl(kern, dim3(grid > 0 ? grid : 1), WS_THREADS, WS_SMEM, s->stream, p->pdl, P);
    return mf_cuda_launched(ctx, op, GATE ? "moe_ws_kernel (gate)" : "moe_ws_kernel (final)");
}

int moe_ws_usable(const cuda_state *s)
{
    /* the opt-in limit counts a block's static and dynamic shared memory together */
    return moe_wgmma_usable(s) && s->tensor_map_encode &&
           (size_t)WS_SMEM + WS_STATIC_SMEM <= s->smem_optin;
}

moefuse_status moe_launch_ws(moefuse_context *ctx, cuda_state *s, const char *op, int gate,
                             int f16, const MoeGemm *p)
{
    if (f16)
        return gate ? launch<true, true>(ctx, s, op, p) : launch<true, false>(ctx, s, op, p);
    return gate ? launch<false, true>(ctx, s, op, p) : launch<false, false>(ctx, s, op, p);
}
