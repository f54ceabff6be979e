/*
 * The kernel before an FP8 decode GEMM (moe_fp8_decode.cu): in routed mode it lists the valid
 * slots by expert in tiles of at most DEC_NS and zeroes what no tile writes; in any mode it
 * quantizes an f32/f16/bf16 x as `quant` does, so that the GEMM's producer only issues copies.
 */
#include "cuda/moe_fp8_decode.h"
#include "cuda/masked_offsets.cuh"
#include "cuda/moe_math.cuh"
#include "cuda/pdl.cuh"

/* ------------------------------------------------------------ x, quantized */

/*
 * The 128 values of one row's block b of x as e4m3 codes at dst and its scale, exactly as
 * `quant` forms them (fp8.cuh); a warp, four values a lane.
 */
static __device__ __forceinline__ float dec_quant_block(const void *x, int dt, long long at,
                                                        float eps, int ue8m0, uint8_t *dst,
                                                        int lane)
{
    float v[4];
#pragma unroll
    for (int q = 0; q < 4; q++)
        v[q] = mfm_load(x, dt, at + 4 * lane + q);
    uint32_t codes, ue;
    const float s = fp8_quant_warp4(v, eps, ue8m0, &codes, &ue);
    *(uint32_t *)(dst + 4 * lane) = codes;
    return s;
}

/*
 * Masked x: the valid rows' blocks only, the rows numbered expert after expert (offs), so that
 * the warps share those and not every row's (E * Tmax rows, most of them past their expert's
 * count: each a count read and a skip).
 */
static __device__ __forceinline__ void dec_quant_masked(const Fp8DecRoute &r, int64_t *offs,
                                                        long long first, long long warps,
                                                        int lane)
{
    const long long groups = r.K / FP8_BLOCK, E = r.rt.E;
    block_prefix(r.counts, r.counts_s0, E, r.tmax, offs); /* counts clamped to [0, Tmax] */
    const long long items = offs[E] * groups;
    for (long long it = first; it < items; it += warps) {
        const long long v = it / groups, gi = it - v * groups; /* valid row v, block gi */
        const long long e = find_expert(offs, E, v), t = v - offs[e];
        const long long row = e * r.tmax + t; /* of xq and xs: e * Tmax + t */
        const float sc = dec_quant_block(r.x, r.x_dt, e * r.x_s0 + t * r.x_s1 + gi * FP8_BLOCK,
                                         r.q_eps, r.q_ue8m0, r.xq + row * r.K + gi * FP8_BLOCK,
                                         lane);
        if (lane == 0)
            r.xs[row * groups + gi] = sc;
    }
}

/* ------------------------------------------------------------- the route */

/*
 * Before a decode GEMM. Routed mode (r.route), block 0: count the valid slots per expert, list
 * them by expert, and cut each expert's list into tiles of at most DEC_NS; zero what no tile
 * writes. The other blocks (all, without routing): x's rows quantized as `quant` does (a warp
 * per 128-group; masked: the valid rows only) into xq [rows, K] and row-major f32 xs.
 */
__global__ void __launch_bounds__(512) fp8_dec_route(const Fp8DecRoute r)
{
    __shared__ int cnt[DEC_MAX_E], fill[DEC_MAX_E];
    __shared__ int64_t offs[DEC_MAX_E + 1]; /* + 1: the masked rows' total */
    __shared__ long long tst[DEC_MAX_E];
    __shared__ unsigned long long wsum[16];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (r.pdl)
        mf_pdl_wait();
    mf_pdl_trigger(); /* the GEMM waits for this grid before it reads anything */
    const MoeRoute &rt = r.rt;
    const unsigned qb = r.route ? 1u : 0u; /* the first quantizing block */
    if (blockIdx.x >= qb) {
        if (!r.x)
            return;
        const long long first = (long long)(blockIdx.x - qb) * 16 + warp;
        const long long warps = (long long)(gridDim.x - qb) * 16;
        if (r.counts) {
            dec_quant_masked(r, offs, first, warps, lane);
            return;
        }
        const long long groups = r.K / FP8_BLOCK, items = r.rows * groups;
        for (long long it = first; it < items; it += warps) {
            const long long row = it / groups, gi = it - row * groups;
            const float sc =
                dec_quant_block(r.x, r.x_dt, row * r.x_s0 + gi * FP8_BLOCK, r.q_eps, r.q_ue8m0,
                                r.xq + row * r.K + gi * FP8_BLOCK, lane);
            if (lane == 0)
                r.xs[row * groups + gi] = sc;
        }
        return;
    }
    const int E = (int)rt.E;
    for (int e = tid; e < E; e += 512)
        cnt[e] = 0, fill[e] = 0;
    __syncthreads();
    for (long long s = tid; s < rt.S; s += 512) {
        const long long e = moe_slot_expert(rt, s / rt.topk, s % rt.topk);
        if (e >= 0)
            atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    /* exclusive scans of the counts and of the tiles, packed in one word: count << 32 | tiles */
    const int per = (E + 511) / 512, e0 = tid * per;
    unsigned long long mine = 0;
    for (int e = e0; e < e0 + per && e < E; e++)
        mine += ((unsigned long long)cnt[e] << 32) | (unsigned)((cnt[e] + DEC_NS - 1) / DEC_NS);
    unsigned long long inc = mine;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned long long o = __shfl_up_sync(0xFFFFFFFFu, inc, off);
        if (lane >= off)
            inc += o;
    }
    if (lane == 31)
        wsum[warp] = inc;
    __syncthreads();
    unsigned long long before = inc - mine;
    for (int w = 0; w < warp; w++)
        before += wsum[w];
    for (int e = e0; e < e0 + per && e < E; e++) {
        offs[e] = (long long)(before >> 32);
        tst[e] = (long long)(before & 0xFFFFFFFFu);
        before += ((unsigned long long)cnt[e] << 32) | (unsigned)((cnt[e] + DEC_NS - 1) / DEC_NS);
    }
    if (tid == 511)
        *r.ntiles = (int)(before & 0xFFFFFFFFu);
    __syncthreads();
    for (long long s = tid; s < rt.S; s += 512) {
        const long long e = moe_slot_expert(rt, s / rt.topk, s % rt.topk);
        if (e >= 0)
            r.list[offs[e] + atomicAdd(&fill[e], 1)] = s; /* slot order in a tile changes no bit */
    }
    for (int e = tid; e < E; e += 512)
        for (int i = 0; i * DEC_NS < cnt[e]; i++) {
            DecTile t;
            t.first = offs[e] + (long long)i * DEC_NS;
            t.e = e;
            t.count = cnt[e] - i * DEC_NS < DEC_NS ? cnt[e] - i * DEC_NS : DEC_NS;
            r.tiles[tst[e] + i] = t;
        }
    dec_zero(rt, r.M, r.zero_slot, r.zero_tok, r.arrivals, r.arrivals_n, tid, 512);
}

moefuse_status moe_fp8_dec_route(moefuse_context *ctx, cuda_state *s, const char *op,
                                 const Fp8DecRoute *r)
{
    unsigned grid = r->route ? 1u : 0u;
    if (r->x) {
        const long long need = (r->rows * (r->K / FP8_BLOCK) + 15) / 16;
        const long long cap = 2LL * s->sm_count;
        grid += (unsigned)(need < cap ? need : cap);
    }
    if (grid == 0)
        return MOEFUSE_OK;
    mf_launch_pdl(fp8_dec_route, dim3(grid), 512, 0, s->stream, r->pdl, *r);
    return mf_cuda_launched(ctx, op, "fp8_dec_route");
}

