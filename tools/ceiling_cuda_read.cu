/*
 * The kernel of the CUDA read ceiling (ceiling_cuda.c): a sum over a buffer that reads every
 * byte once and writes one word per block, so that its time is the time of reading alone.
 * The blocks stride over the whole buffer, and the sum is kept so that no load can be left out.
 * ceiling_cuda.c tries a few launch shapes and keeps the fastest: the ceiling is the machine's
 * read rate, not one shape's.
 */
#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>

/* Each thread keeps UNROLL independent 16-byte loads in flight. */
template <int UNROLL>
__global__ void __launch_bounds__(512) ceiling_read_kernel(const uint4 *__restrict__ src, size_t n,
                                                           unsigned int *partial)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc[UNROLL] = {0};
    for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) /* all the loads first: they are in flight together */
            v[u] = __ldcs(src + i + (size_t)u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            acc[u] += v[u].x + v[u].y + v[u].z + v[u].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = __ldcs(src + i);
        acc[0] += v.x + v.y + v.z + v.w;
    }
    unsigned int s = 0;
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
        s += acc[u];
    for (int off = 16; off > 0; off >>= 1)
        s += __shfl_xor_sync(0xFFFFFFFFu, s, off);
    __shared__ unsigned int warp_sums[16];
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0)
        warp_sums[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int total = 0;
        for (unsigned int w = 0; w < (blockDim.x + 31u) / 32u; w++)
            total += warp_sums[w];
        partial[blockIdx.x] = total;
    }
}

/*
 * Sums `bytes` (a multiple of 16) from src on `stream` with `blocks` blocks of `threads` (at
 * most 512), each thread `unroll` (4 or 8) loads in flight, one word per block into
 * partial[blocks]. Returns the launch's error.
 */
extern "C" cudaError_t ceiling_cuda_read_launch(const void *src, size_t bytes,
                                                unsigned int *partial, int blocks, int threads,
                                                int unroll, cudaStream_t stream)
{
    if (unroll == 8)
        ceiling_read_kernel<8><<<blocks, threads, 0, stream>>>((const uint4 *)src, bytes / 16,
                                                               partial);
    else
        ceiling_read_kernel<4><<<blocks, threads, 0, stream>>>((const uint4 *)src, bytes / 16,
                                                               partial);
    return cudaGetLastError();
}
