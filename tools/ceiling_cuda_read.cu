/*
 * The kernel of the CUDA read ceiling (ceiling_cuda.c): a sum over a buffer that reads every
 * byte once and writes one word per block, so that its time is the time of reading alone.
 * Each thread keeps READ_UNROLL independent 16-byte loads in flight, the blocks stride over the
 * whole buffer (a few blocks per SM), and the sum is kept so that no load can be left out.
 */
#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>

#define READ_UNROLL 4
#define READ_THREADS 256

/* The launch's shape, for ceiling_cuda.c to say how it measured. */
extern "C" const int ceiling_cuda_read_unroll = READ_UNROLL;
extern "C" const int ceiling_cuda_read_threads = READ_THREADS;

__global__ void __launch_bounds__(READ_THREADS) ceiling_read_kernel(const uint4 *__restrict__ src,
                                                           size_t n, unsigned int *partial)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc[READ_UNROLL] = {0};
    for (; i + (READ_UNROLL - 1) * stride < n; i += READ_UNROLL * stride) {
        uint4 v[READ_UNROLL];
#pragma unroll
        for (int u = 0; u < READ_UNROLL; u++) /* all the loads first: they are in flight together */
            v[u] = __ldcs(src + i + (size_t)u * stride);
#pragma unroll
        for (int u = 0; u < READ_UNROLL; u++)
            acc[u] += v[u].x + v[u].y + v[u].z + v[u].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = __ldcs(src + i);
        acc[0] += v.x + v.y + v.z + v.w;
    }
    unsigned int s = 0;
#pragma unroll
    for (int u = 0; u < READ_UNROLL; u++)
        s += acc[u];
    for (int off = 16; off > 0; off >>= 1)
        s += __shfl_xor_sync(0xFFFFFFFFu, s, off);
    __shared__ unsigned int warp_sums[32];
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
 * Sums `bytes` (a multiple of 16) from src on `stream` with `blocks` blocks of READ_THREADS,
 * one word per block into partial[blocks]. Returns the launch's error.
 */
extern "C" cudaError_t ceiling_cuda_read_launch(const void *src, size_t bytes,
                                                unsigned int *partial, int blocks,
                                                cudaStream_t stream)
{
    ceiling_read_kernel<<<blocks, READ_THREADS, 0, stream>>>((const uint4 *)src, bytes / 16, partial);
    return cudaGetLastError();
}
