/*
 * How fast can two consumer warpgroups run the FP8 large tile's inner loop (src/cuda/moe_fp8_ws.cu)
 * when nothing else is in the way? Each stage is that kernel's: per warpgroup, two waves of
 * four e4m3 wgmma m64n128k32 over 128 bytes of depth, a wait after each wave, and (from the
 * second line on) the promotion of each wave into a second accumulator. The last line adds
 * the kernel's ring: a producer warpgroup (40 registers, the consumers 232) that re-arms each of
 * 4 stages' full barrier as soon as the consumers free it, and the consumers' proxy fence, with
 * no data loaded. Shared memory holds random e4m3 codes (no NaN), so the tensor cores draw
 * realistic power. Each line: SM cycles a stage (one block's clock64), multiply-adds a cycle an
 * SM (the tensor cores' peak is 4096), and the chip's TFLOP/s over the launch.
 *
 *   nvcc -O3 -std=c++17 -arch=sm_90a -Isrc bench/fp8_mma_probe.cu -o /tmp/probe && /tmp/probe
 */
#include "cuda/hopper.cuh"
#include "cuda/wgmma.cuh"
#include "probe_util.cuh"

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#define STAGES 4
#define SMEM_BYTES (96 * 1024)
#define ITERS 2000

#ifdef MOE_WGMMA_DEVICE
static __device__ __forceinline__ uint32_t saddr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* Random e4m3 codes without NaN (bit patterns 0x7f / 0xff cleared by the mask). */
static __device__ void fill(uint32_t *words, int n)
{
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u + blockIdx.x;
        x ^= x >> 13;
        x *= 0x5bd1e995u;
        x ^= x >> 15;
        words[i] = x & 0x7e7e7e7eu;
    }
    hp_fence_proxy_async();
}

static __device__ __forceinline__ void zero_accumulators(float (&acc)[64], float (&m)[128])
{
#pragma unroll
    for (int i = 0; i < 64; i++)
        acc[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < 128; i++)
        m[i] = 0.0f;
}

/* A store nobody takes, so that the compiler keeps the work that made acc and m. */
static __device__ __forceinline__ void keep(const float (&acc)[64], const float (&m)[128],
                                            float *sink)
{
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i++)
        s += acc[i] + m[i] + m[64 + i];
    if (s == 12345.0f)
        sink[threadIdx.x] = s;
}

/* One stage of one consumer warpgroup: two waves (B rows [0, 128), [128, 256)), each waited
 * for; PROMOTE: main += wave * factor, as the kernel's promotion. */
template <bool PROMOTE>
static __device__ __forceinline__ void stage(float (&acc)[64], float (&m)[128], uint32_t a0,
                                             uint32_t b0)
{
#pragma unroll
    for (int w = 0; w < 2; w++) {
        pin(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_e4m3_m64n128k32(acc, wg_desc(a0 + kk * 32),
                                  wg_desc(b0 + w * 128 * 128 + kk * 32),
                                  PROMOTE ? kk > 0 : 1); /* unpromoted waves accumulate: none is dead code */
        wgmma_commit();
        wgmma_wait<0>();
        pin(acc);
        if (PROMOTE)
#pragma unroll
            for (int i = 0; i < 64; i++)
                m[64 * w + i] = __fmaf_rn(acc[i], 1.0001f, m[64 * w + i]);
    }
}
#endif

/* Two consumer warpgroups alone (256 threads). */
template <bool PROMOTE>
__global__ void __launch_bounds__(256, 1) alone(int iters, unsigned long long *cycles, float *sink)
{
#ifdef MOE_WGMMA_DEVICE
    extern __shared__ uint4 smem_raw[];
    const uint32_t base = (saddr(smem_raw) + 1023u) & ~1023u;
    fill((uint32_t *)smem_raw, SMEM_BYTES / 4 - 256);
    __syncthreads();
    float acc[64], m[128];
    zero_accumulators(acc, m);
    const uint32_t a0 = base + (threadIdx.x / 128) * 64 * 128, b0 = base + 128 * 128;
    const unsigned long long t0 = clock64();
    for (int it = 0; it < iters; it++)
        stage<PROMOTE>(acc, m, a0, b0);
    const unsigned long long t1 = clock64();
    if (threadIdx.x == 0)
        cycles[blockIdx.x] = t1 - t0;
    keep(acc, m, sink);
#else
    (void)iters, (void)cycles, (void)sink;
#endif
}

/* The same consumers behind the kernel's ring of STAGES full / empty barriers (384 threads). */
__global__ void __launch_bounds__(384, 1) ringed(int iters, unsigned long long *cycles, float *sink)
{
#ifdef MOE_WGMMA_DEVICE
    extern __shared__ uint4 smem_raw[];
    __shared__ uint64_t full[STAGES], empty[STAGES];
    const uint32_t base = (saddr(smem_raw) + 1023u) & ~1023u;
    fill((uint32_t *)smem_raw, SMEM_BYTES / 4 - 256);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            hp_mbar_init(saddr(&full[s]), 1);
            hp_mbar_init(saddr(&empty[s]), 256);
        }
        hp_mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        hp_regs_dec<40>();
        HpPipe<STAGES> ps = {0, 0u};
        if (threadIdx.x == 0)
            for (int it = 0; it < iters; it++) {
                hp_mbar_wait(saddr(&empty[ps.stage]), ps.phase ^ 1u);
                hp_mbar_arrive(saddr(&full[ps.stage]));
                ps.advance();
            }
        return;
    }
    hp_regs_inc<232>();
    float acc[64], m[128];
    zero_accumulators(acc, m);
    const uint32_t a0 = base + ((threadIdx.x - 128) / 128) * 64 * 128, b0 = base + 128 * 128;
    HpPipe<STAGES> ps = {0, 0u};
    const unsigned long long t0 = clock64();
    for (int it = 0; it < iters; it++) {
        hp_mbar_wait(saddr(&full[ps.stage]), ps.phase);
        hp_fence_proxy_async();
        stage<true>(acc, m, a0, b0);
        hp_mbar_arrive(saddr(&empty[ps.stage]));
        ps.advance();
    }
    const unsigned long long t1 = clock64();
    if (threadIdx.x == 128)
        cycles[blockIdx.x] = t1 - t0;
    keep(acc, m, sink);
#else
    (void)iters, (void)cycles, (void)sink;
#endif
}

static void run(const char *name, void (*kernel)(int, unsigned long long *, float *),
                int threads, int sms, unsigned long long *cycles, float *sink)
{
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES),
          "smem attribute");
    kernel<<<sms, threads, SMEM_BYTES>>>(10, cycles, sink); /* warm-up */
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "event");
    check(cudaEventCreate(&e1), "event");
    check(cudaEventRecord(e0), "record");
    kernel<<<sms, threads, SMEM_BYTES>>>(ITERS, cycles, sink);
    check(cudaEventRecord(e1), "record");
    check(cudaEventSynchronize(e1), name);
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    unsigned long long c = 0;
    check(cudaMemcpy(&c, cycles, sizeof c, cudaMemcpyDeviceToHost), "copy");
    const double macs = (double)ITERS * 2 * 4 * 2 * 64.0 * 128 * 32; /* per SM */
    printf("%-38s %6.0f cycles a stage  %5.0f MAC/cycle/SM  %7.1f TFLOP/s\n", name,
           (double)c / ITERS, macs / (double)c, 2.0 * macs * sms / (ms * 1e-3) / 1e12);
}

int main(void)
{
    char *pool;
    unsigned *sink;
    const int sms = probe_setup(1 << 20, &pool, &sink);
    unsigned long long *cycles;
    check(cudaMalloc(&cycles, sms * sizeof *cycles), "cycles");
    run("waves, each waited for", alone<false>, 256, sms, cycles, (float *)sink);
    run("waves and promotion", alone<true>, 256, sms, cycles, (float *)sink);
    run("waves, promotion and the ring", ringed, 384, sms, cycles, (float *)sink);
    return 0;
}
