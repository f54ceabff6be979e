/*
 * How fast can a persistent kernel stream an expert's weight rows into shared memory by TMA,
 * for each way of cutting the rows into stages? The decode GEMMs are this stream plus a little
 * arithmetic, so the best cut here bounds them. Each line: the shape (rows of K bytes, experts
 * read), the stage (rows x bytes of depth, box rows, swizzle), the ring (stages, blocks per
 * SM), the depth split, and the rate, beside a plain read of the same bytes (the ceiling).
 * Every repetition reads bytes no earlier one read (a rotating window over 2 GiB), so L2
 * holds none of them, as in a model's layer.
 *
 *   nvcc -O3 -std=c++17 -arch=sm_90a -Isrc bench/tma_stream_probe.cu -lcuda -o /tmp/probe
 */
#include "cuda/hopper.cuh"
#include "probe_util.cuh"

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CONSUMER_WARPS 4
#define POOL_BYTES (2ll << 30)

struct Probe {
    const char *name;
    long long K, N, nexp; /* rows of K bytes, N per expert, nexp experts read */
    int rows, kbytes;     /* a stage: rows x kbytes */
    int box_rows, swizzle;
    int stages, per_sm, split;
};

struct Params {
    CUtensorMap map;
    long long items, row_blocks, nkst; /* items; row blocks per expert; stages per item */
    int rows, kbytes, box_rows, inner, stages, split;
    unsigned *sink;
};

static __device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

__global__ void __launch_bounds__(32 * (CONSUMER_WARPS + 1)) stream_kernel(const __grid_constant__ Params p)
{
    extern __shared__ __align__(1024) char raw[];
    char *smem = raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
    __shared__ __align__(8) uint64_t full[16], empty[16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int stage_bytes = p.rows * p.kbytes;
    if (threadIdx.x == 0) {
        for (int s = 0; s < p.stages; s++) {
            hp_mbar_init(smem_addr(&full[s]), 1);
            hp_mbar_init(smem_addr(&empty[s]), CONSUMER_WARPS);
        }
        hp_mbar_init_fence();
    }
    __syncthreads();
    const long long kper = p.nkst; /* stages of one item */
    if (warp == CONSUMER_WARPS) {
        if (lane != 0)
            return;
        int st = 0;
        unsigned ph = 0;
        for (long long w = blockIdx.x; w < p.items; w += gridDim.x) {
            const long long split_i = w % p.split, rest = w / p.split;
            const long long rb = rest % p.row_blocks, e = rest / p.row_blocks;
            for (long long s = 0; s < kper; s++) {
                hp_mbar_wait(smem_addr(&empty[st]), ph ^ 1u);
                const uint32_t bar = smem_addr(&full[st]);
                hp_mbar_arrive_tx(bar, (unsigned)stage_bytes);
                char *dst = smem + st * stage_bytes;
                const long long k0 = (split_i * kper + s) * p.kbytes;
                for (int kc = 0; kc < p.kbytes / p.inner; kc++)
                    for (int rg = 0; rg < p.rows / p.box_rows; rg++)
                        hp_tma_load_3d(smem_addr(dst), &p.map, bar, (int)(k0 + kc * p.inner),
                                       (int)(rb * p.rows + rg * p.box_rows), (int)e),
                            dst += p.box_rows * p.inner;
                if (++st == p.stages)
                    st = 0, ph ^= 1u;
            }
        }
        return;
    }
    unsigned acc = 0;
    int st = 0;
    unsigned ph = 0;
    for (long long w = blockIdx.x; w < p.items; w += gridDim.x)
        for (long long s = 0; s < kper; s++) {
            hp_mbar_wait(smem_addr(&full[st]), ph);
            const char *src = smem + st * stage_bytes;
            for (int o = (warp * 32 + lane) * 16; o < stage_bytes; o += 32 * CONSUMER_WARPS * 16)
                acc ^= ((const uint4 *)(src + o))->x;
            __syncwarp();
            if (lane == 0)
                hp_mbar_arrive(smem_addr(&empty[st]));
            if (++st == p.stages)
                st = 0, ph ^= 1u;
        }
    if (acc == 0x12345678u)
        p.sink[blockIdx.x] = acc;
}

__global__ void read_kernel(const uint4 *src, long long n, unsigned *sink)
{
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u)
        sink[blockIdx.x] = acc;
}

static float median(float *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            const float t = v[j];
            v[j] = v[j - 1], v[j - 1] = t;
        }
    return v[n / 2];
}

int main(void)
{
    static const Probe probes[] = {
        /* Mixtral gate: 2 experts x (2 x 14336) rows of 4096 */
        {"mixtral-gate", 4096, 28672, 2, 256, 128, 128, 1, 5, 1, 4},
        {"mixtral-gate", 4096, 28672, 2, 128, 256, 128, 1, 5, 1, 4},
        {"mixtral-gate", 4096, 28672, 2, 64, 512, 64, 1, 5, 1, 4},
        {"mixtral-gate", 4096, 28672, 2, 128, 128, 128, 1, 12, 1, 4},
        {"mixtral-gate", 4096, 28672, 2, 128, 128, 128, 1, 6, 2, 4},
        {"mixtral-gate", 4096, 28672, 2, 128, 256, 128, 0, 5, 1, 4},
        {"mixtral-gate", 4096, 28672, 2, 256, 128, 128, 1, 5, 1, 1},
        {"mixtral-gate", 4096, 28672, 2, 64, 1024, 64, 1, 3, 1, 1},
        /* Mixtral final: 2 experts x 4096 rows of 14336 */
        {"mixtral-final", 14336, 4096, 2, 128, 128, 128, 1, 5, 2, 4},
        {"mixtral-final", 14336, 4096, 2, 64, 256, 64, 1, 5, 2, 4},
        {"mixtral-final", 14336, 4096, 2, 32, 512, 32, 1, 5, 2, 4},
        {"mixtral-final", 14336, 4096, 2, 128, 128, 128, 1, 8, 2, 4},
        {"mixtral-final", 14336, 4096, 2, 128, 128, 128, 1, 5, 2, 8},
        {"mixtral-final", 14336, 4096, 2, 64, 512, 64, 1, 3, 2, 8},
        /* DeepSeek-V3 gate and final: 8 experts */
        {"deepseek-gate", 7168, 4096, 8, 256, 128, 128, 1, 5, 1, 1},
        {"deepseek-gate", 7168, 4096, 8, 128, 256, 128, 1, 5, 1, 1},
        {"deepseek-gate", 7168, 4096, 8, 64, 512, 64, 1, 5, 1, 1},
        {"deepseek-gate", 7168, 4096, 8, 128, 128, 128, 1, 6, 2, 2},
        {"deepseek-final", 2048, 7168, 8, 128, 128, 128, 1, 5, 2, 1},
        {"deepseek-final", 2048, 7168, 8, 64, 256, 64, 1, 5, 2, 1},
        {"deepseek-final", 2048, 7168, 8, 128, 128, 128, 1, 5, 2, 2},
        /* Qwen3-30B-A3B: 8 experts, small */
        {"qwen3-gate", 2048, 1536, 8, 256, 128, 128, 1, 5, 1, 2},
        {"qwen3-gate", 2048, 1536, 8, 128, 128, 128, 1, 5, 2, 4},
        {"qwen3-gate", 2048, 1536, 8, 64, 256, 64, 1, 5, 2, 4},
        {"qwen3-final", 768, 2048, 8, 128, 128, 128, 1, 5, 2, 1},
        {"qwen3-final", 768, 2048, 8, 64, 256, 64, 1, 3, 2, 1},
        {"qwen3-final", 768, 2048, 8, 128, 128, 128, 1, 3, 2, 2},
    };
    char *pool;
    unsigned *sink;
    const int sms = probe_setup(POOL_BYTES, &pool, &sink);
    check(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               200 * 1024),
          "smem");
    cudaEvent_t a, b;
    cudaEventCreate(&a), cudaEventCreate(&b);
    const int reps = 20;
    float t[reps];

    /* the ceiling: a read of 1 GiB */
    for (int r = 0; r < reps; r++) {
        cudaEventRecord(a);
        read_kernel<<<sms * 8, 512>>>((const uint4 *)(pool + (r & 1) * (1ll << 30)),
                                      (1ll << 30) / 16, sink);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        cudaEventElapsedTime(&t[r], a, b);
    }
    printf("read ceiling: %.0f GB/s (1 GiB, %d SMs)\n", (1ll << 30) / (median(t, reps) * 1e6), sms);

    for (const Probe &q : probes) {
        Params p;
        memset(&p, 0, sizeof p);
        const long long bytes = q.K * q.N * q.nexp;
        p.rows = q.rows, p.kbytes = q.kbytes, p.box_rows = q.box_rows, p.stages = q.stages;
        p.inner = q.swizzle ? 128 : (q.kbytes < 256 ? q.kbytes : 256);
        p.split = q.split;
        p.row_blocks = q.N / q.rows;
        p.nkst = q.K / q.kbytes / q.split;
        p.items = q.nexp * p.row_blocks * q.split;
        p.sink = sink;
        const int smem = q.stages * q.rows * q.kbytes + 1024;
        const int grid = (int)(p.items < (long long)sms * q.per_sm ? p.items : sms * q.per_sm);
        if (smem > 200 * 1024 || smem * q.per_sm > 226 * 1024 || q.K % (q.kbytes * q.split)) {
            printf("%-15s skipped (shared memory or depth)\n", q.name);
            continue;
        }
        for (int r = -3; r < reps; r++) {
            const long long off = ((r + 3) * ((bytes + 4095) / 4096 * 4096)) % (POOL_BYTES - bytes) / 4096 * 4096;
            const cuuint64_t dims[3] = {(cuuint64_t)q.K, (cuuint64_t)q.N, (cuuint64_t)q.nexp};
            const cuuint64_t strides[2] = {(cuuint64_t)q.K, (cuuint64_t)(q.K * q.N)};
            const cuuint32_t box[3] = {(cuuint32_t)p.inner, (cuuint32_t)q.box_rows, 1};
            const cuuint32_t es[3] = {1, 1, 1};
            if (cuTensorMapEncodeTiled(&p.map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, pool + off, dims,
                                       strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                       q.swizzle ? CU_TENSOR_MAP_SWIZZLE_128B
                                                 : CU_TENSOR_MAP_SWIZZLE_NONE,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
                printf("%-15s tensor map refused\n", q.name);
                break;
            }
            cudaEventRecord(a);
            stream_kernel<<<grid, 32 * (CONSUMER_WARPS + 1), smem>>>(p);
            cudaEventRecord(b);
            check(cudaEventSynchronize(b), "stream_kernel");
            if (r >= 0)
                cudaEventElapsedTime(&t[r], a, b);
        }
        const float ms = median(t, reps);
        printf("%-15s %5lld MB  stage %3d x %4d B (box %3d, %s)  ring %2d x %d/SM  split %d  "
               "grid %4d  items %5lld  %7.1f us  %6.0f GB/s\n",
               q.name, bytes >> 20, q.rows, q.kbytes, q.box_rows, q.swizzle ? "swz128" : "plain",
               q.stages, q.per_sm, q.split, grid, p.items, ms * 1e3, bytes / (ms * 1e6));
    }
    return 0;
}
