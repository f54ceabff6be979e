/*
 * The valid rows of the masked layout [E, Tmax, ...], counted expert after expert: the
 * offsets of the clamped counts and the expert of a flattened valid row. Shared by the row
 * kernels (rows_walk.cuh) and the FP8 decode kernel's x quantization (moe_fp8_decode_route.cu).
 */
#ifndef MOEFUSE_CUDA_MASKED_OFFSETS_CUH
#define MOEFUSE_CUDA_MASKED_OFFSETS_CUH

#include <stdint.h>

/*
 * Clamped counts -> offs[0..E] (offs[0] = 0), by the whole block in chunks of
 * blockDim.x experts: warp scans by shuffles, then the warp totals. Every
 * thread must call it; offs is complete for every thread on return.
 */
static __device__ void block_prefix(const int32_t *counts, int64_t cs0, int64_t E, int64_t T,
                                    int64_t *offs)
{
    __shared__ int64_t wsum[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    if (tid == 0)
        offs[0] = 0;
    int64_t carry = 0;
    for (int64_t base = 0; base < E; base += blockDim.x) {
        const int64_t e = base + tid;
        int64_t v = 0;
        if (e < E) {
            const int64_t c = counts[e * cs0]; /* device data: never trusted */
            v = c < 0 ? 0 : (c > T ? T : c);
        }
        for (int off = 1; off < 32; off <<= 1) {
            const int64_t o = __shfl_up_sync(0xFFFFFFFFu, v, off);
            if (lane >= off)
                v += o;
        }
        if (lane == 31)
            wsum[warp] = v;
        __syncthreads();
        int64_t before = 0, total = 0;
        for (int w = 0; w < nw; w++) {
            const int64_t sw = wsum[w];
            before += w < warp ? sw : 0;
            total += sw;
        }
        if (e < E)
            offs[e + 1] = carry + before + v;
        carry += total;
        __syncthreads(); /* wsum is rewritten by the next chunk */
    }
    __syncthreads(); /* offs[0] when E = 0 */
}

/* Expert of flattened valid row `row`: the last e with offs[e] <= row (skips empty experts). */
static __device__ __forceinline__ int64_t find_expert(const int64_t *offs, int64_t E, int64_t row)
{
    int64_t lo = 0, hi = E - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) >> 1;
        if (offs[mid] <= row)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

#endif /* MOEFUSE_CUDA_MASKED_OFFSETS_CUH */
