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

#include <limits.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_WGMMA_DEVICE 1
#endif

#define WG_BM 128
#define WG_BN 256
#define WG_THREADS 256
#define WG_STAGES 4
#define WG_STAGE_BYTES ((WG_BM + WG_BN) * 128)
#define WG_CST (WG_BN + 8) /* epilogue tile row stride (floats) */
#define WG_SMEM (WG_STAGES * WG_STAGE_BYTES + 1024) /* + slack to align the stages to 1024 */

#ifdef MOE_WGMMA_DEVICE
/*
 * Shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte
 * swizzle, 8-row groups 1024 bytes apart (stride byte offset); the leading
 * byte offset is unused for swizzled K-major layouts (1 by convention).
 */
static __device__ __forceinline__ uint64_t wg_desc(uint32_t saddr)
{
    return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

/* The 128 accumulator operands of m64n256k16 (f32): %0..%127, then A and B descriptors. */
#define WG_DREGS                                                                                   \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, " \
    "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, " \
    "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, " \
    "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, " \
    "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, " \
    "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, " \
    "%120, %121, %122, %123, %124, %125, %126, %127"
#define WG_DOUTS(d)                                                                                \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
    "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
    "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
    "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
    "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
    "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
    "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), \
    "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
    "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), \
    "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), \
    "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
    "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), \
    "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), \
    "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), \
    "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), \
    "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), \
    "+f"(d[126]), "+f"(d[127])
#define WG_MMA(T)                                                                                  \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                 \
    "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {" WG_DREGS "}, %128, %129, p, 1, "  \
    "1, 0, 0;\n}\n"

/* d += A (64 x 16, smem descriptor da) * B (16 x 256, smem descriptor db), K-major both. */
template <bool F16>
static __device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db)
{
    if (F16)
        asm volatile(WG_MMA("f16") : WG_DOUTS(d) : "l"(da), "l"(db), "n"(1));
    else
        asm volatile(WG_MMA("bf16") : WG_DOUTS(d) : "l"(da), "l"(db), "n"(1));
}

static __device__ __forceinline__ void wgmma_fence(void)
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

static __device__ __forceinline__ void wgmma_commit(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N> static __device__ __forceinline__ void wgmma_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

static __device__ __forceinline__ void fence_proxy_async(void)
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Keeps the compiler from moving accumulator accesses across wgmma fences and waits. */
static __device__ __forceinline__ void pin(float (&d)[128])
{
#pragma unroll
    for (int i = 0; i < 128; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}
#endif

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
            fence_proxy_async();             /* and are visible to the tensor cores' proxy */
            __syncthreads();                 /* everyone's; wgmma of tile kt - 2 is complete */
            if (kt + WG_STAGES - 2 < KT)
                ld.load(p, sbase + (uint32_t)(((kt + WG_STAGES - 2) % WG_STAGES) * WG_STAGE_BYTES),
                        kt + WG_STAGES - 2);
            cp_async_commit();
            const uint32_t sa = sbase + (uint32_t)((kt % WG_STAGES) * WG_STAGE_BYTES);
            const uint32_t a0 = sa + (uint32_t)(wg * 64 * 128), b0 = sa + WG_BM * 128;
            uint64_t da[MOE_BK / 16], db[MOE_BK / 16]; /* k16 steps: 32 bytes along the rows */
#pragma unroll
            for (int kk = 0; kk < MOE_BK / 16; kk++) {
                da[kk] = wg_desc(a0 + kk * 32);
                db[kk] = wg_desc(b0 + kk * 32);
            }
            /* no padding skip here: a branch around wgmma makes ptxas serialize them (C7520) */
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < MOE_BK / 16; kk++)
                wgmma_m64n256k16<F16>(acc, da[kk], db[kk]);
            wgmma_commit();
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
    /* the dynamic shared-memory limit is raised once per context: no state shared by
     * threads; a bit per kernel in s->wgmma_smem_raised: (f16, bf16) x (gate, final) */
    const uint32_t bit = (uint32_t)1 << ((F16 ? 2 : 0) + (GATE ? 1 : 0));
    if (!(s->wgmma_smem_raised & bit)) {
        if ((size_t)WG_SMEM > s->smem_optin)
            return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                            "%s: the tile needs %d bytes of shared memory; the device allows %zu",
                            op, WG_SMEM, s->smem_optin);
        cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             WG_SMEM);
        if (e != cudaSuccess)
            return mf_cuda_fail(ctx, e, op, "cudaFuncSetAttribute(moe_wgmma_kernel)");
        s->wgmma_smem_raised |= bit;
    }
    if (!p)
        return MOEFUSE_OK; /* only made ready */
    dim3 grid;
    if (p->rt.direct) {
        const int64_t ranks = p->rt.E < p->rt.S ? p->rt.E : p->rt.S;
        grid = dim3((unsigned)p->nblk, (unsigned)(ranks > 0 ? ranks : 1));
    } else {
        grid = dim3((unsigned)(p->lin_bound < INT_MAX ? p->lin_bound : INT_MAX));
    }
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
