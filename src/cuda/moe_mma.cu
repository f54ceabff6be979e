/*
 * bf16 / f16 MoE GEMMs on tensor cores: mma.sync m16n8k16 with f32
 * accumulation, operands staged by a multi-stage cp.async pipeline into
 * XOR-swizzled shared memory and read with ldmatrix.
 *
 * Block tile: BM slots (rows of A: x or h rows gathered by slot) x BN weight
 * rows (columns of the product), depth in stages of BK = 64 elements (one
 * 128-byte shared-memory row per tile row; the 16-byte chunk c of row r sits
 * at chunk c ^ (r & 7), so that cp.async writes and ldmatrix reads of eight
 * consecutive rows hit eight different bank groups).
 *
 * Gate: the BN weight rows are BN / 2 gate rows and the BN / 2 up rows of the
 * same h columns, arranged per warp so that each thread holds the gate and
 * the up accumulator of the same (slot, h column): the epilogue applies the
 * activation in registers and writes only h (BN / 2 columns per block).
 *
 * The depth is walked in the same 16-element steps in every configuration,
 * so a given output gets the same bits whatever configuration computed it.
 */
#include "cuda/hopper.cuh"
#include "cuda/moe_tiles.cuh"

#include <limits.h>

static __device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t &r0, uint32_t &r1,
                                                   uint32_t &r2, uint32_t &r3)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

/* d += a * b on one 16x8x16 tile, f32 accumulators. */
template <bool F16>
static __device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4],
                                                uint32_t b0, uint32_t b1)
{
    if (F16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/*
 * Split depth (rank 0 of a cluster): cs += the partial tile of rank 1, then of rank 2, ...,
 * over the tile's `rows` slot rows, each element with one rounding per addition in rank
 * order, so the sum does not depend on which rank finished first.
 */
template <int BN, int THREADS, int CST>
static __device__ __forceinline__ void moe_split_sum(float *cs, long long rows, int split)
{
    constexpr int Q = BN / 4; /* float4 per row */
    const uint32_t base = smem_u32(cs);
    for (long long i = threadIdx.x; i < rows * Q; i += THREADS) {
        const long long off = (i / Q) * CST + (i % Q) * 4;
        float4 v = *(float4 *)(cs + off);
        for (int r = 1; r < split; r++) {
            const uint32_t theirs = hp_cluster_map(base + (uint32_t)(off * 4), (unsigned)r);
            const float4 w = hp_cluster_ld4(theirs);
            v.x = __fadd_rn(v.x, w.x);
            v.y = __fadd_rn(v.y, w.y);
            v.z = __fadd_rn(v.z, w.z);
            v.w = __fadd_rn(v.w, w.w);
        }
        *(float4 *)(cs + off) = v;
    }
}

template <int BM, int BN, int WM, int WN, int STAGES, int MINB, bool F16, bool GATE>
__global__ void __launch_bounds__(WM *WN * 32, MINB)
    moe_mma_kernel(const __grid_constant__ MoeGemm p)
{
    constexpr int THREADS = WM * WN * 32;
    constexpr int WTM = BM / WM, WTN = BN / WN; /* warp tile */
    constexpr int MT = WTM / 16, NT = WTN / 8;  /* mma tiles per warp */
    constexpr int STAGE_BYTES = (BM + BN) * 128;
    constexpr int CST = BN + 8; /* row stride (floats) of the epilogue's f32 tile */
    static_assert(BM * CST * 4 <= STAGES * STAGE_BYTES, "epilogue tile fits in the stages");
    static_assert(WTM % 16 == 0 && NT % 2 == 0, "warp tile: gate and up halves, x4 B loads");
    static_assert(BM <= MOE_MAX_BM, "tile height");

    extern __shared__ uint4 smem[];
    __shared__ MoeTileSmem t;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WM, wn = warp / WM;
    const uint32_t sbase = smem_u32(smem);
    /* ldmatrix row addresses (row & 7 == lane & 7 for every fragment row) */
    const uint32_t a_frag = (uint32_t)(wm * WTM + (lane & 15)) * 128u;
    const uint32_t b_frag = (uint32_t)(BM + wn * WTN + (lane & 7) + ((lane >> 4) << 3)) * 128u;
    const int a_hi = lane >> 4, b_hi = (lane >> 3) & 1, l7 = lane & 7;
    const long long cols_per_block = GATE ? BN / 2 : BN;
    /* this block's depth tiles: k0 .. k0 + KT - 1 (all of them unless the depth is split) */
    const int split = p.split > 1 ? p.split : 1;
    const int rank = (int)(blockIdx.x % (unsigned)split);
    long long k0 = 0, KT = (p.depth + MOE_BK - 1) / MOE_BK;
    if (split > 1) {
        const long long per = (KT + split - 1) / split;
        k0 = rank * per;
        KT = k0 >= KT ? 0 : (KT - k0 < per ? KT - k0 : per);
    }

    if (p.trigger)
        mf_pdl_trigger(); /* the final may launch once every block of this grid started */
    mf_exp_tab_fill(t.exp_tab, threadIdx.x); /* read after the loop's first barrier */
    for (long long lin = blockIdx.x;; lin += gridDim.x) {
        if (p.rt.direct ? lin != (long long)blockIdx.x : lin >= p.lin_bound)
            break;
        __syncthreads(); /* the previous tile is done with t and the stages */
        MOE_TSTART(tclk);
        const bool has = moe_fetch_tile<BM>(p, lin, t);
        if (t.zero_mask | t.zero_tok_mask)
            moe_zero_invalid(p, t, cols_per_block);
        if (!has)
            break;
        MoeStageLoader<BM, BN, THREADS, WTN, GATE> ld;
        ld.init(p, t);
        MOE_TMARK((GATE ? 0 : 1), 0, tclk);

        float acc[MT][NT][4];
#pragma unroll
        for (int mi = 0; mi < MT; mi++)
#pragma unroll
            for (int ni = 0; ni < NT; ni++)
#pragma unroll
                for (int v = 0; v < 4; v++)
                    acc[mi][ni][v] = 0.0f;

        /*
         * prologue: one commit group per stage, empty past the end (keeps the count uniform).
         * The weights (inputs) of every prologue stage first, then (pdl) wait for the gate,
         * then the activations: the first group holds all the early weight copies, which
         * changes nothing for the waits below.
         */
#pragma unroll
        for (int st = 0; st < STAGES - 1; st++)
            if (st < KT)
                ld.load_b(p, sbase + (uint32_t)(st * STAGE_BYTES), k0 + st);
        if (p.pdl)
            mf_pdl_wait();
#pragma unroll
        for (int st = 0; st < STAGES - 1; st++) {
            if (st < KT)
                ld.load_a(p, sbase + (uint32_t)(st * STAGE_BYTES), k0 + st);
            cp_async_commit();
        }
        /* m16 tiles of this warp that hold a slot (the slots are the first t.count rows):
         * the last tile of an expert is often mostly padding */
        const long long wrows = t.count - wm * WTM;
        const int mt_act = wrows <= 0 ? 0 : (wrows >= WTM ? MT : (int)((wrows + 15) / 16));
        int st_read = 0, st_write = STAGES - 1;
        for (long long kt = 0; kt < KT; kt++) {
            cp_async_wait<STAGES - 2>(); /* this thread's copies of tile kt have landed */
            __syncthreads();             /* everyone's have; and tile kt - 1 is consumed */
            if (kt + STAGES - 1 < KT)
                ld.load(p, sbase + (uint32_t)(st_write * STAGE_BYTES), k0 + kt + STAGES - 1);
            cp_async_commit();
            st_write = st_write + 1 == STAGES ? 0 : st_write + 1;

            const uint32_t sa = sbase + (uint32_t)(st_read * STAGE_BYTES);
            if (mt_act > 0) { /* warp-uniform: a warp whose rows are all padding has no work */
#pragma unroll
                for (int kk = 0; kk < MOE_BK / 16; kk++) {
                    uint32_t af[MT][4], bf[NT][2];
#pragma unroll
                    for (int mi = 0; mi < MT; mi++)
                        if (mi < mt_act)
                            ldmatrix_x4(sa + a_frag + (uint32_t)(mi * 16 * 128) +
                                            (uint32_t)(((kk * 2 + a_hi) ^ l7) << 4),
                                        af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
#pragma unroll
                    for (int nj = 0; nj < NT / 2; nj++)
                        ldmatrix_x4(sa + b_frag + (uint32_t)(nj * 16 * 128) +
                                        (uint32_t)(((kk * 2 + b_hi) ^ l7) << 4),
                                    bf[2 * nj][0], bf[2 * nj][1], bf[2 * nj + 1][0],
                                    bf[2 * nj + 1][1]);
#pragma unroll
                    for (int mi = 0; mi < MT; mi++)
                        if (mi < mt_act)
#pragma unroll
                            for (int ni = 0; ni < NT; ni++)
                                mma16816<F16>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
                }
            }
            st_read = st_read + 1 == STAGES ? 0 : st_read + 1;
        }
        /*
         * Epilogue through shared memory (the stages are free once every warp
         * is past its last ldmatrix): the accumulators are dead before the
         * activation runs, and consecutive threads write consecutive columns.
         * Accumulator v of mma tile (mi, ni) is row lane / 4 (+ 8 for v >= 2),
         * column (lane % 4) * 2 + (v & 1).
         */
        cp_async_wait<0>();
        __syncthreads();
        MOE_TMARK((GATE ? 0 : 1), 1, tclk);
        float *cs = (float *)smem; /* [BM][CST] f32, CST = BN + 8: float2 stores conflict-free */
#pragma unroll
        for (int mi = 0; mi < MT; mi++)
#pragma unroll
            for (int ni = 0; ni < NT; ni++) {
                const int r = wm * WTM + mi * 16 + (lane >> 2);
                const int c = wn * WTN + ni * 8 + (lane & 3) * 2;
                *(float2 *)(cs + r * CST + c) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
                *(float2 *)(cs + (r + 8) * CST + c) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
            }
        __syncthreads();
        if (split > 1) {
            /* every rank's partial is in its cs; rank 0 adds them in rank order, and the
             * others stay until it has read theirs (cluster shared memory) */
            hp_cluster_sync();
            if (rank == 0)
                moe_split_sum<BN, THREADS, CST>(cs, t.count, split);
            hp_cluster_sync();
            if (rank != 0)
                break; /* direct mode: one tile per block */
        }
        moe_epilogue<BM, BN, THREADS, WTN, CST, GATE>(p, t, cs);
        MOE_TMARK((GATE ? 0 : 1), 2, tclk);
        if (!GATE && p.fuse)
            moe_fused_reduce<BM, THREADS>(p, t, cols_per_block, (float *)smem,
                                      STAGES * STAGE_BYTES / 4);
        MOE_TMARK((GATE ? 0 : 1), 3, tclk);
    }
}

/* ---------------------------------------------------------------- launch */

/* A kernel's bit in s->mma_smem_raised: 3 tiles x (f16, bf16) x (gate, final). */
static_assert((MOE_MMA_L - MOE_MMA_S + 1) * 4 <= 32, "mma_smem_raised has a bit per kernel");
static uint32_t smem_bit(int cfg, bool f16, bool gate)
{
    return (uint32_t)1 << ((cfg - MOE_MMA_S) * 4 + (f16 ? 2 : 0) + (gate ? 1 : 0));
}

template <int BM, int BN, int WM, int WN, int STAGES, int MINB, bool F16, bool GATE>
static moefuse_status launch(moefuse_context *ctx, cuda_state *s, const char *op, int cfg,
                             const MoeGemm *p)
{
    void (*kern)(const MoeGemm) = moe_mma_kernel<BM, BN, WM, WN, STAGES, MINB, F16, GATE>;
    const size_t smem = (size_t)STAGES * (BM + BN) * 128;
    MF_TRY(moe_ready_smem(ctx, s, op, kern, smem, smem, &s->mma_smem_raised,
                          smem_bit(cfg, F16, GATE), "cudaFuncSetAttribute(moe_mma_kernel)"));
    if (!p)
        return MOEFUSE_OK; /* only made ready */
    const dim3 grid = moe_grid(p);
    moe_launch(kern, grid, WM * WN * 32, smem, s->stream, p);
    return mf_cuda_launched(ctx, op, GATE ? "moe_mma_kernel (gate)" : "moe_mma_kernel (final)");
}

template <bool F16, bool GATE>
static moefuse_status launch_cfg(moefuse_context *ctx, cuda_state *s, const char *op, int cfg,
                                 const MoeGemm *p)
{
    switch (cfg) {
    case MOE_MMA_S: /* the decode tile; its shape macros are in moe_internal.h */
        return launch<16, MOE_S_BN, 1, MOE_S_WN, MOE_S_STAGES, MOE_S_MINB, F16, GATE>(
            ctx, s, op, cfg, p);
    case MOE_MMA_M: return launch<64, 128, 2, 2, 4, 2, F16, GATE>(ctx, s, op, cfg, p);
    case MOE_MMA_L: return launch<128, 128, 2, 4, 3, 2, F16, GATE>(ctx, s, op, cfg, p);
    default:
        return mf_error(ctx, MOEFUSE_ERR_INTERNAL, "%s: configuration %d is not a tensor-core one",
                        op, cfg);
    }
}

moefuse_status moe_launch_mma(moefuse_context *ctx, cuda_state *s, const char *op, int cfg,
                              int gate, int f16, const MoeGemm *p)
{
    if (f16)
        return gate ? launch_cfg<true, true>(ctx, s, op, cfg, p)
                    : launch_cfg<true, false>(ctx, s, op, cfg, p);
    return gate ? launch_cfg<false, true>(ctx, s, op, cfg, p)
                : launch_cfg<false, false>(ctx, s, op, cfg, p);
}

#ifdef MOE_TIMING
/* Development only: read and clear the phase cycles (kinds 0-1 mma gate/final, 2-3 wgmma). */
extern "C" void moe_timing_read_mma(unsigned long long out[4][8])
{
    cudaMemcpyFromSymbol(out, moe_timing, sizeof(moe_timing));
    static const unsigned long long zero[4][8] = {{0}};
    cudaMemcpyToSymbol(moe_timing, zero, sizeof(moe_timing));
}
#endif
