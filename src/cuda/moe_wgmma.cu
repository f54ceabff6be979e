/*
 * Hopper (sm_90a) MoE GEMM for the compute-bound shapes: wgmma.mma_async
 * m64n256k16 with f32 accumulators in registers, operands read by the tensor
 * cores straight from shared memory.
 *
 * Why: at 128 x 128 tiles the mma.sync kernel (moe_mma.cu) is bound by L2 ->
 * SM bandwidth (64 FLOP per byte staged), and mma.sync peaks well below
 * wgmma. Here a block computes 128 slots x 256 weight rows (85 FLOP per byte)
 * with two warpgroups, each 64 slots x all 256 rows (128 accumulators a
 * thread), and one block per SM: 4 stages of 48 KB in the 128-byte swizzle
 * that the wgmma descriptors name (the layout MoeStageLoader writes).
 *
 * Pipeline (all 256 threads copy, then both warpgroups compute):
 *   wait for tile kt (cp.async), fence.proxy.async (cp.async writes are
 *   generic-proxy, wgmma reads are async-proxy), barrier, copy tile kt + 2
 *   into the stage of tile kt - 2 (its wgmma finished: wait_group 1 in the
 *   previous iteration), issue 4 wgmma on tile kt, commit, wait_group 1.
 * Padding rows (the last tile of an expert) are computed like the others: a
 * branch around wgmma makes ptxas serialize every wgmma (C7520), which costs
 * more than the padding.
 * Epilogue and fused reduction go through the stage memory (moe_tiles.cuh).
 * Final in moe_forward (pdl): tile, weights of the first stages, then
 * griddepcontrol.wait for the gate, then h.
 *
 * Built only into sm_90a machine code (wgmma does not exist elsewhere): the
 * host calls it only on compute capability 9.0 when the build has sm_90a
 * (MOE_HAVE_SM90A from meson), else it uses moe_mma.cu.
 */
#include "cuda/moe_tiles.cuh"
#include "cuda/wgmma.cuh"

#include <limits.h>

static_assert(MOE_BK == 16 * WG_K16_STEPS, "a stage holds the k16 steps of wgmma_tile");

#define WG_BM 128
#define WG_BN 256
#define WG_THREADS 256
#define WG_STAGES 4
#define WG_STAGE_BYTES ((WG_BM + WG_BN) * 128)
#define WG_CST (WG_BN + 8) /* epilogue tile row stride (floats) */
#define WG_SMEM (WG_STAGES * WG_STAGE_BYTES + 1024) /* + slack to align the stages to 1024 */


template <bool F16, bool GATE>
__global__ void __launch_bounds__(WG_THREADS, 1) moe_wgmma_kernel(const __grid_constant__ MoeGemm p)
{
#ifdef MOE_WGMMA_DEVICE
    extern __shared__ uint4 smem_raw[];
    __shared__ MoeTileSmem t;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    /* wgmma descriptors assume 1024-byte aligned swizzle atoms */
    const uint32_t sbase = (smem_u32(smem_raw) + 1023u) & ~1023u;
    float *cs = (float *)((char *)smem_raw + (sbase - smem_u32(smem_raw)));
    const long long cols_per_block = GATE ? WG_BN / 2 : WG_BN;
    const long long KT = (p.depth + MOE_BK - 1) / MOE_BK;

    if (p.trigger)
        mf_pdl_trigger(); /* the final may launch once every block of this grid started */
    mf_exp_tab_fill(t.exp_tab, threadIdx.x); /* read after the loop's first barrier */
    for (long long lin = blockIdx.x;; lin += gridDim.x) {
        if (p.rt.direct ? lin != (long long)blockIdx.x : lin >= p.lin_bound)
            break;
        __syncthreads(); /* the previous tile is done with t and the stages */
        MOE_TSTART(tclk);
        const bool has = moe_fetch_tile<WG_BM>(p, lin, t);
        if (t.zero_mask | t.zero_tok_mask)
            moe_zero_invalid(p, t, cols_per_block);
        if (!has)
            break;
        MoeStageLoader<WG_BM, WG_BN, WG_THREADS, WG_BN, GATE> ld;
        ld.init(p, t);
        const bool active = t.count > wg * 64; /* this warpgroup's rows hold slots */
        MOE_TMARK((GATE ? 2 : 3), 0, tclk);

        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; i++)
            acc[i] = 0.0f;
        pin(acc);

        /* prologue: tiles 0 and 1, one commit group each (empty past the end); the weights
         * first, then (pdl) wait for the gate, then h (as in moe_mma.cu) */
#pragma unroll
        for (int st = 0; st < WG_STAGES - 2; st++)
            if (st < KT)
                ld.load_b(p, sbase + (uint32_t)(st * WG_STAGE_BYTES), st);
        if (p.pdl)
            mf_pdl_wait();
#pragma unroll
        for (int st = 0; st < WG_STAGES - 2; st++) {
            if (st < KT)
                ld.load_a(p, sbase + (uint32_t)(st * WG_STAGE_BYTES), st);
            cp_async_commit();
        }
        for (long long kt = 0; kt < KT; kt++) {
            cp_async_wait<WG_STAGES - 3>(); /* this thread's copies of tile kt have landed */
            hp_fence_proxy_async();          /* and are visible to the tensor cores' proxy */
            __syncthreads();                 /* everyone's; wgmma of tile kt - 2 is complete */
            if (kt + WG_STAGES - 2 < KT)
                ld.load(p, sbase + (uint32_t)(((kt + WG_STAGES - 2) % WG_STAGES) * WG_STAGE_BYTES),
                        kt + WG_STAGES - 2);
            cp_async_commit();
            const uint32_t sa = sbase + (uint32_t)((kt % WG_STAGES) * WG_STAGE_BYTES);
            /* no padding skip here: a branch around wgmma makes ptxas serialize them (C7520) */
            wgmma_tile<F16>(acc, sa + (uint32_t)(wg * 64 * 128), sa + WG_BM * 128);
            wgmma_wait<1>();
        }
        wgmma_wait<0>();
        pin(acc);
        cp_async_wait<0>();
        __syncthreads(); /* no wgmma or copy touches the stages any more */
        MOE_TMARK((GATE ? 2 : 3), 1, tclk);

        /* accumulator 4 i + v of the warpgroup: row 16 (warp % 4) + lane / 4 (+ 8 for v >= 2),
         * column 8 i + 2 (lane % 4) + (v & 1) */
        if (active) {
            const int r = wg * 64 + (warp & 3) * 16 + (lane >> 2), c = (lane & 3) * 2;
#pragma unroll
            for (int i = 0; i < 32; i++) {
                *(float2 *)(cs + r * WG_CST + 8 * i + c) = make_float2(acc[4 * i], acc[4 * i + 1]);
                *(float2 *)(cs + (r + 8) * WG_CST + 8 * i + c) =
                    make_float2(acc[4 * i + 2], acc[4 * i + 3]);
            }
        }
        __syncthreads();
        moe_epilogue<WG_BM, WG_BN, WG_THREADS, WG_BN, WG_CST, GATE>(p, t, cs);
        MOE_TMARK((GATE ? 2 : 3), 2, tclk);
        if (!GATE && p.fuse)
            moe_fused_reduce<WG_BM, WG_THREADS>(p, t, cols_per_block, cs,
                                                WG_STAGES * WG_STAGE_BYTES / 4);
        MOE_TMARK((GATE ? 2 : 3), 3, tclk);
    }
#else
    (void)p; /* never launched: the host checks for sm_90a first */
#endif
}

template <bool F16, bool GATE>
static moefuse_status launch(moefuse_context *ctx, cuda_state *s, const char *op, const MoeGemm *p)
{
    void (*kern)(const MoeGemm) = moe_wgmma_kernel<F16, GATE>;
    /* a bit per kernel in s->wgmma_smem_raised: (f16, bf16) x (gate, final) */
    MF_TRY(moe_ready_smem(ctx, s, op, kern, WG_SMEM, WG_SMEM, &s->wgmma_smem_raised,
                          (uint32_t)1 << ((F16 ? 2 : 0) + (GATE ? 1 : 0)),
                          "cudaFuncSetAttribute(moe_wgmma_kernel)"));
    if (!p)
        return MOEFUSE_OK; /* only made ready */
    const dim3 grid = moe_grid(p);
    moe_launch(kern, grid, WG_THREADS, WG_SMEM, s->stream, p);
    return mf_cuda_launched(ctx, op, GATE ? "moe_wgmma_kernel (gate)" : "moe_wgmma_kernel (final)");
}

int moe_wgmma_usable(const cuda_state *s)
{
#ifdef MOE_HAVE_SM90A
    return s->cc_major == 9 && s->cc_minor == 0;
#else
    (void)s;
    return 0;
#endif
}

moefuse_status moe_launch_wgmma(moefuse_context *ctx, cuda_state *s, const char *op, int gate,
                                int f16, const MoeGemm *p)
{
    if (f16)
        return gate ? launch<true, true>(ctx, s, op, p) : launch<true, false>(ctx, s, op, p);
    return gate ? launch<false, true>(ctx, s, op, p) : launch<false, false>(ctx, s, op, p);
}

#ifdef MOE_TIMING
/* Development only: read and clear the phase cycles (kinds 0-1 mma gate/final, 2-3 wgmma). */
extern "C" void moe_timing_read_wg(unsigned long long out[4][8])
{
    cudaMemcpyFromSymbol(out, moe_timing, sizeof(moe_timing));
    static const unsigned long long zero[4][8] = {{0}};
    cudaMemcpyToSymbol(moe_timing, zero, sizeof(moe_timing));
}
#endif
