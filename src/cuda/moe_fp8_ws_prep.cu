/*
 * What the Hopper FP8 GEMM (moe_fp8_ws.cu) reads, made ready before its launch: the masked
 * layout's tile table, A's rows and scales for loading by TMA, and A's scales as dense f32.
 */
#include "cuda/moe_fp8_ws.h"

/* One block: the prefix of m-tiles per expert (thread 0), then each expert's tiles. */
__global__ void fp8_ws_masked_tiles_kernel(const int32_t *counts, long long counts_s0,
                                           long long E, long long tmax, long long *tiles,
                                           int *tile_expert, long long *row_start,
                                           long long *row_end)
{
    if (threadIdx.x == 0) {
        long long t = 0;
        for (long long e = 0; e < E; e++) {
            long long n = counts[e * counts_s0]; /* device data: clamped */
            n = n < 0 ? 0 : (n > tmax ? tmax : n);
            tiles[e] = t;
            row_start[e] = e * tmax;
            row_end[e] = e * tmax + n;
            t += (n + F8_BM - 1) / F8_BM;
        }
        tiles[E] = t;
    }
    __syncthreads();
    for (long long e = threadIdx.x; e < E; e += blockDim.x)
        for (long long t = tiles[e]; t < tiles[e + 1]; t++)
            tile_expert[t] = (int)e;
}

moefuse_status moe_fp8_ws_masked_tiles(moefuse_context *ctx, cuda_state *s, const char *op,
                                       const Fp8Gemm *g, long long *tiles, int *tile_expert,
                                       long long *row_start, long long *row_end)
{
    fp8_ws_masked_tiles_kernel<<<1, 256, 0, s->stream>>>(g->counts, g->counts_s0, g->rt.E,
                                                         g->tmax, tiles, tile_expert, row_start,
                                                         row_end);
    return mf_cuda_launched(ctx, op, "fp8_ws_masked_tiles_kernel");
}

/*
 * One warp a row: routed, list entry p's A row copied to row p of tma_a (16-byte chunks) and
 * its scales to column p; masked, the scales of row (e, t) to column t of block e (every
 * t < Tmax, as the dense scales' copy does: no tile stores a row past n[e]).
 */
__global__ void fp8_ws_a_copy_kernel(Fp8WsExtra x, Fp8WsASource src, const long long *count,
                                     long long depth)
{
    const long long nkb = depth / F8_BK;
    const long long rows = x.list ? x.tma_rows : x.tma_blocks * x.tma_rows;
    long long n = rows;
    if (x.list) {
        n = *count; /* device data: clamped */
        n = n < 0 ? 0 : (n > rows ? rows : n);
    }
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    for (long long r = blockIdx.x * (long long)(blockDim.x / 32) + threadIdx.x / 32; r < n;
         r += warps) {
        long long blk = 0, col = r, srow = 0;
        if (x.list) {
            long long slot = x.list[r];
            slot = slot < 0 ? 0 : (slot >= x.tma_rows ? x.tma_rows - 1 : slot); /* S slots */
            const long long pp = slot / src.div, q = slot % src.div;
            srow = src.scale_by_p ? pp : slot;
            const uint4 *from = (const uint4 *)(src.a + pp * src.a_s0 + q * src.a_s1);
            uint4 *to = (uint4 *)(x.tma_a + r * x.tma_row_s);
            for (long long c = lane; c < depth / 16; c += 32)
                to[c] = from[c];
        } else {
            blk = r / x.tma_rows;
            col = r % x.tma_rows;
            srow = col;
        }
        float *sc = (float *)x.tma_sc + blk * nkb * x.tma_rows_pad + col;
        for (long long b = lane; b < nkb; b += 32)
            sc[b * x.tma_rows_pad] = fp8_act_scale(src.as, blk, srow, b);
    }
}

moefuse_status moe_fp8_ws_a_copy(moefuse_context *ctx, cuda_state *s, const char *op,
                                 const Fp8WsExtra *x, const Fp8WsASource *src,
                                 const long long *count, long long depth)
{
    const long long rows = x->list ? x->tma_rows : x->tma_blocks * x->tma_rows;
    if (rows == 0)
        return MOEFUSE_OK;
    const long long want = (rows + 7) / 8;
    const unsigned grid = (unsigned)(want < 8L * s->sm_count ? want : 8L * s->sm_count);
    fp8_ws_a_copy_kernel<<<grid, 256, 0, s->stream>>>(*x, *src, count, depth);
    return mf_cuda_launched(ctx, op, "fp8_ws_a_copy_kernel");
}

__global__ void fp8_ws_dense_scales_kernel(Fp8ActScales v, float *out, long long blocks,
                                           long long rows, long long groups)
{
    const long long n = blocks * rows * groups;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long g = i % groups, t = (i / groups) % rows, b = i / (groups * rows);
        out[i] = fp8_act_scale(v, b, t, g);
    }
}

moefuse_status moe_fp8_ws_dense_scales(moefuse_context *ctx, cuda_state *s, const char *op,
                                       const Fp8ActScales *v, float *out, long long blocks,
                                       long long rows, long long groups)
{
    const long long n = blocks * rows * groups;
    if (n == 0)
        return MOEFUSE_OK;
    const long long want = (n + 255) / 256;
    const unsigned grid = (unsigned)(want < 4L * s->sm_count ? want : 4L * s->sm_count);
    fp8_ws_dense_scales_kernel<<<grid, 256, 0, s->stream>>>(*v, out, blocks, rows, groups);
    return mf_cuda_launched(ctx, op, "fp8_ws_dense_scales_kernel");
}
