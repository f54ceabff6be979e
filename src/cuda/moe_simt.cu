/*
 * f32 MoE GEMMs with FMA on the CUDA cores (f32 must not go through TF32
 * tensor cores: NUMERICS.md asks 1e-5 relative error of f32 results).
 *
 * Block: 256 threads as 16 x 16, tile BM slots x 64 weight rows, depth in
 * slabs of 16 staged in shared memory (double buffered, the next slab
 * loaded into registers while the current one is computed). Thread (tx, ty)
 * owns rows ty + 16 i and columns tx + 16 jj; each output is one fmaf chain
 * over the depth in order 0, 1, ... (the order the CPU backend uses too).
 * Gate: weight rows 0..31 are the gate rows of h columns nb * 32 + 0..31,
 * rows 32..63 their up rows (moe_epilogue's layout with one group of 64).
 */
#include "cuda/moe_tiles.cuh"

#include <limits.h>

#define SIMT_BN 64
#define SIMT_BK 16

template <int BM, bool GATE>
__global__ void __launch_bounds__(256, 3) moe_simt_kernel(const __grid_constant__ MoeGemm p)
{
    constexpr int RM = BM / 16;
    constexpr int CST = SIMT_BN + 4; /* epilogue tile row stride */
    constexpr int AS = 2 * SIMT_BK * (BM + 4), BS = 2 * SIMT_BK * (SIMT_BN + 4);
    static_assert(BM * CST <= AS + BS, "epilogue tile fits in the slabs");
    /* slabs as[2][BK][BM + 4], bs[2][BK][BN + 4]; after the loop the epilogue's f32 tile */
    __shared__ __align__(16) float sbuf[AS + BS];
    __shared__ MoeTileSmem t;
    float(*as)[SIMT_BK][BM + 4] = (float(*)[SIMT_BK][BM + 4])sbuf;
    float(*bs)[SIMT_BK][SIMT_BN + 4] = (float(*)[SIMT_BK][SIMT_BN + 4])(sbuf + AS);

    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const long long cols_per_block = GATE ? SIMT_BN / 2 : SIMT_BN;
    const long long KT = (p.depth + SIMT_BK - 1) / SIMT_BK;

    mf_exp_tab_fill(t.exp_tab, threadIdx.x); /* read after the loop's first barrier */
    for (long long lin = blockIdx.x;; lin += gridDim.x) {
        if (p.rt.direct ? lin != (long long)blockIdx.x : lin >= p.lin_bound)
            break;
        __syncthreads(); /* the previous tile is done with t, as and bs */
        const bool has = moe_fetch_tile<BM>(p, lin, t);
        if (t.zero_mask | t.zero_tok_mask)
            moe_zero_invalid(p, t, cols_per_block);
        if (!has)
            break;
        const long long e = t.e, nb = t.nb;

        /* loader: element (row ty + 16 i, depth tx) of each slab */
        const float *arow[RM];
        const float *brow[4];
#pragma unroll
        for (int i = 0; i < RM; i++) {
            const long long off = t.arow[ty + 16 * i];
            arow[i] = off >= 0 ? (const float *)p.a + off : nullptr;
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = ty + 16 * i;
            long long col, wrow;
            if (GATE) {
                col = nb * (SIMT_BN / 2) + (r & 31);
                wrow = (r < 32 ? p.gate_row : p.up_row) + col * p.row_step;
            } else {
                col = nb * SIMT_BN + r;
                wrow = col;
            }
            brow[i] = col < p.ncols ? (const float *)p.w + e * p.w_s0 + wrow * p.w_s1 : nullptr;
        }
        float ra[RM], rb[4];
        auto gload = [&](long long kt) {
            const long long k = kt * SIMT_BK + tx;
            const bool in = k < p.depth;
#pragma unroll
            for (int i = 0; i < RM; i++)
                ra[i] = (arow[i] && in) ? __ldg(arow[i] + k) : 0.0f;
#pragma unroll
            for (int i = 0; i < 4; i++)
                rb[i] = (brow[i] && in) ? __ldg(brow[i] + k) : 0.0f;
        };
        auto sstore = [&](int buf) {
#pragma unroll
            for (int i = 0; i < RM; i++)
                as[buf][tx][ty + 16 * i] = ra[i];
#pragma unroll
            for (int i = 0; i < 4; i++)
                bs[buf][tx][ty + 16 * i] = rb[i];
        };

        float acc[RM][4];
#pragma unroll
        for (int i = 0; i < RM; i++)
#pragma unroll
            for (int jj = 0; jj < 4; jj++)
                acc[i][jj] = 0.0f;

        gload(0);
        sstore(0);
        __syncthreads();
        for (long long kt = 0; kt < KT; kt++) {
            const int buf = (int)(kt & 1);
            if (kt + 1 < KT)
                gload(kt + 1); /* in flight while this slab is computed */
#pragma unroll
            for (int kk = 0; kk < SIMT_BK; kk++) {
                float a[RM], b[4];
#pragma unroll
                for (int i = 0; i < RM; i++)
                    a[i] = as[buf][kk][ty + 16 * i];
#pragma unroll
                for (int jj = 0; jj < 4; jj++)
                    b[jj] = bs[buf][kk][tx + 16 * jj];
#pragma unroll
                for (int i = 0; i < RM; i++)
#pragma unroll
                    for (int jj = 0; jj < 4; jj++)
                        acc[i][jj] = __fmaf_rn(a[i], b[jj], acc[i][jj]);
            }
            if (kt + 1 < KT)
                sstore(buf ^ 1); /* buf ^ 1 was last read before the previous barrier */
            __syncthreads();
        }

        /* epilogue through shared memory (the loop ended with a barrier): the accumulators are
         * dead before the activation runs. Column c of the tile is weight row c of the block. */
#pragma unroll
        for (int i = 0; i < RM; i++)
#pragma unroll
            for (int jj = 0; jj < 4; jj++)
                sbuf[(ty + 16 * i) * CST + tx + 16 * jj] = acc[i][jj];
        __syncthreads();
        moe_epilogue<BM, SIMT_BN, 256, SIMT_BN, CST, GATE>(p, t, sbuf);
        if (!GATE && p.fuse)
            moe_fused_reduce<BM, 256>(p, t, cols_per_block, sbuf, AS + BS);
    }
}

template <int BM, bool GATE>
static moefuse_status launch(moefuse_context *ctx, cuda_state *s, const char *op, const MoeGemm *p)
{
    const dim3 grid = moe_grid(p);
    moe_simt_kernel<BM, GATE><<<grid, 256, 0, s->stream>>>(*p);
    return mf_cuda_launched(ctx, op, GATE ? "moe_simt_kernel (gate)" : "moe_simt_kernel (final)");
}

moefuse_status moe_launch_simt(moefuse_context *ctx, cuda_state *s, const char *op, int cfg,
                               int gate, const MoeGemm *p)
{
    if (cfg == MOE_SIMT16)
        return gate ? launch<16, true>(ctx, s, op, p) : launch<16, false>(ctx, s, op, p);
    if (cfg == MOE_SIMT64)
        return gate ? launch<64, true>(ctx, s, op, p) : launch<64, false>(ctx, s, op, p);
    return mf_error(ctx, MOEFUSE_ERR_INTERNAL, "%s: configuration %d is not an f32 one", op, cfg);
}
