/*
 * Device-side checks of the CUDA numerics (not part of the build; for the GPU
 * machine). check_numerics.c proves the host versions; this shows the device
 * computes the same bits, and that the hardware shortcuts the kernels take
 * agree with the integer reference code:
 *  1. cvt.rn.satfinite.e4m3x2.f32 (sm_89+) against mf_f32_to_e4m3 for every
 *     finite float (2^32 patterns less Inf/NaN), and the i8 shortcut
 *     (__float2int_rn after clamping) against mf_f32_to_i8 for every non-NaN;
 *     cvt.rn.bf16x2.f32 (mf_bf16x2_rn) against mf_f32_to_bf16 for every non-NaN.
 *  2. mf_exp_f32 (src/numerics/mf_exp.h) on the device against the same
 *     function on the host, bit for bit, for every float, with the largest
 *     error of the device results against exp((double)x); and the kernels'
 *     branch-free mf_exp_tab_fast against mf_exp_f32 wherever it is taken.
 *  3. mf_div_scale against the device's IEEE division h / s.
 *  4. The kernels' branch-free silu (mf_silu_fast) against mf_silu_formula, bit for
 *     bit, for every float it takes (|g| < 64), and the branch-free division
 *     mf_div_fast against IEEE division on the scale computations' ranges.
 *
 *   nvcc -O2 -std=c++17 --fmad=false -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude \
 *        -Xcompiler -fopenmp src/cuda/tools/device_check.cu -o device_check && ./device_check
 */
#include "cuda/numerics.cuh"

#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CU(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));           \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

__constant__ float c_tab[64] = MF_EXP_TABLE_INIT;

static __device__ uint32_t hw_e4m3(float f)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
    return r & 0xFFu;
#else
    return mf_f32_to_e4m3(f);
#endif
}

static __device__ uint32_t fast_i8(float d)
{
    const float c = fminf(fmaxf(d, -127.0f), 127.0f);
    return (uint32_t)__float2int_rn(c) & 0xFFu;
}

__global__ void k_conv(unsigned long long *bad, uint32_t *first)
{
    for (uint64_t b = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; b < (1ull << 32);
         b += (uint64_t)gridDim.x * blockDim.x) {
        const float f = mf_bits_f32((uint32_t)b);
        if (mf_is_finite(f) && hw_e4m3(f) != mf_f32_to_e4m3(f)) {
            if (atomicAdd(&bad[0], 1ull) < 4)
                first[0] = (uint32_t)b;
        }
        if (!mf_is_nan(f) && fast_i8(f) != ((uint32_t)mf_f32_to_i8(f) & 0xFFu)) {
            if (atomicAdd(&bad[1], 1ull) < 4)
                first[1] = (uint32_t)b;
        }
        const uint32_t bf16_ref = mf_f32_to_bf16(f) | (mf_f32_to_bf16(-f) << 16);
        if (!mf_is_nan(f) && mf_bf16x2_rn(f, -f) != bf16_ref) {
            if (atomicAdd(&bad[4], 1ull) < 4)
                first[4] = (uint32_t)b;
        }
    }
}

/* mf_exp_f32 of n floats from bit pattern b0, and how often the fast form disagrees with it. */
__global__ void k_exp(uint32_t b0, uint32_t n, float *out, unsigned long long *bad_fast)
{
    __shared__ __align__(8) float tab[64]; /* read as pairs (ld.shared.v2) */
    if (threadIdx.x < 64)
        tab[threadIdx.x] = c_tab[threadIdx.x];
    __syncthreads();
    const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(tab);
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float x = mf_bits_f32(b0 + i);
        const float y = mf_exp_f32(x);
        out[i] = y;
        if (fabsf(x) < MF_EXP_FAST_LIMIT && mf_f32_bits(mf_exp_tab_fast(x, tabs)) != mf_f32_bits(y))
            atomicAdd(bad_fast, 1ull);
    }
}

/* The kernels' branch-free silu against mf_silu_formula (mf_exp_f32, IEEE division) for every
 * float the fast path takes (|g| < 64), bit for bit. */
__global__ void k_silu(unsigned long long *bad, uint32_t *first)
{
    __shared__ __align__(8) float tab[64]; /* read as pairs (ld.shared.v2) */
    if (threadIdx.x < 64)
        tab[threadIdx.x] = c_tab[threadIdx.x];
    __syncthreads();
    const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(tab);
    for (uint64_t b = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; b < (1ull << 32);
         b += (uint64_t)gridDim.x * blockDim.x) {
        const float g = mf_bits_f32((uint32_t)b);
        if (!mf_silu_fast_ok(g))
            continue;
        const float a = mf_silu_fast(g, tabs), r = mf_silu_formula(g);
        if (mf_f32_bits(a) != mf_f32_bits(r) && atomicAdd(bad, 1ull) < 4)
            first[2] = (uint32_t)b;
    }
}

/* mf_div_fast against IEEE division: a / 448 and a / 127 for every a in [2^-100, 2^100],
 * 1 / s for every s in [2^-60, 2^60]. */
__global__ void k_divfast(unsigned long long *bad, uint32_t *first)
{
    const uint32_t lo = 0x0D800000u, hi = 0x71800000u; /* 2^-100, 2^100 */
    for (uint64_t b = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x + lo; b <= hi;
         b += (uint64_t)gridDim.x * blockDim.x) {
        const float a = mf_bits_f32((uint32_t)b);
        int differ = mf_f32_bits(mf_div_fast(a, 448.0f)) != mf_f32_bits(a / 448.0f) ||
                     mf_f32_bits(mf_div_fast(a, 127.0f)) != mf_f32_bits(a / 127.0f);
        if (mf_scale_fast_ok(a))
            differ |= mf_f32_bits(mf_div_fast(1.0f, a)) != mf_f32_bits(1.0f / a);
        if (differ && atomicAdd(bad, 1ull) < 4)
            first[3] = (uint32_t)b;
    }
}

__global__ void k_div(uint64_t seed, long long n, unsigned long long *bad, float *ex)
{
    uint64_t st = seed ^ ((uint64_t)(blockIdx.x * blockDim.x + threadIdx.x) * 0x9E3779B97F4A7C15ull);
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        const float s = mf_bits_f32((uint32_t)((st >> 40) % (120u << 23)) + (67u << 23));
        const float frac = (float)((st & 0xFFFFFF) | 1) / 16777216.0f;
        float h = s * 448.0f * ldexpf(frac, -(int)((st >> 24) % 40));
        h = fminf(h, 448.0f * s);
        if ((st >> 63) & 1)
            h = -h;
        const float y = 1.0f / s;
        const float q = mf_div_scale(h, s, y), r = h / s;
        const int differ = fabsf(r) >= 0x1p-24f ? mf_f32_bits(q) != mf_f32_bits(r)
                                                 : mf_f32_to_e4m3(q) != mf_f32_to_e4m3(r);
        if (differ && atomicAdd(bad, 1ull) == 0) {
            ex[0] = h;
            ex[1] = s;
        }
    }
}

static double ulp_of(double v)
{
    v = fabs(v);
    if (v < 0x1p-126)
        return 0x1p-149;
    int e;
    frexp(v, &e);
    return ldexp(1.0, e - 24);
}

int main(void)
{
    int fails = 0;
    cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);

    unsigned long long *bad;
    uint32_t *first;
    CU(cudaMallocManaged(&bad, 5 * sizeof *bad));
    CU(cudaMallocManaged(&first, 5 * sizeof *first));
    memset(bad, 0, 5 * sizeof *bad);
    k_conv<<<prop.multiProcessorCount * 8, 256>>>(bad, first);
    CU(cudaGetLastError());
    CU(cudaDeviceSynchronize());
    printf("e4m3 hardware vs integer: %llu mismatches over every finite float%s",
           bad[0], bad[0] ? "" : "\n");
    if (bad[0]) {
        const float f = mf_bits_f32(first[0]);
        printf(" (e.g. %a: int 0x%02X)\n", (double)f, mf_f32_to_e4m3(f));
        fails++;
    }
    printf("i8 shortcut vs integer: %llu mismatches over every non-NaN float\n", bad[1]);
    fails += bad[1] != 0;
    printf("bf16 hardware vs integer: %llu mismatches over every non-NaN float%s", bad[4],
           bad[4] ? "" : "\n");
    if (bad[4]) {
        printf(" (e.g. %a)\n", (double)mf_bits_f32(first[4]));
        fails++;
    }

    bad[3] = 0;
    k_silu<<<prop.multiProcessorCount * 8, 256>>>(&bad[3], first);
    CU(cudaGetLastError());
    CU(cudaDeviceSynchronize());
    printf("fast silu (branch-free exp and division) vs mf_silu_formula: %llu mismatches over every "
           "float with |g| < 64%s", bad[3], bad[3] ? "" : "\n");
    if (bad[3])
        printf(" (e.g. g = %a)\n", (double)mf_bits_f32(first[2]));
    fails += bad[3] != 0;

    bad[0] = 0;
    k_divfast<<<prop.multiProcessorCount * 8, 256>>>(&bad[0], first);
    CU(cudaGetLastError());
    CU(cudaDeviceSynchronize());
    printf("branch-free division vs IEEE (a/448, a/127 for a in [2^-100, 2^100], 1/s for s in "
           "[2^-60, 2^60]): %llu mismatches%s", bad[0], bad[0] ? "" : "\n");
    if (bad[0])
        printf(" (e.g. %a)\n", (double)mf_bits_f32(first[3]));
    fails += bad[0] != 0;

    /* exp, every float, in chunks */
    const uint32_t chunk = 1u << 27;
    float *dy, *hy;
    CU(cudaMalloc(&dy, chunk * 4ull));
    hy = (float *)malloc(chunk * 4ull);
    long long differ = 0;
    double worst = 0, worst_sub = 0;
    bad[1] = 0;
    const int skip_exp = getenv("DC_SKIP_EXP") != NULL; /* the slow part: host double exp */
    for (uint64_t b0 = 0; b0 < (1ull << 32) && !skip_exp; b0 += chunk) {
        k_exp<<<prop.multiProcessorCount * 8, 256>>>((uint32_t)b0, chunk, dy, &bad[1]);
        CU(cudaGetLastError());
        CU(cudaMemcpy(hy, dy, chunk * 4ull, cudaMemcpyDeviceToHost));
        long long d_ = 0;
        double w = 0, ws = 0;
#pragma omp parallel for reduction(+ : d_) reduction(max : w, ws)
        for (long long i = 0; i < (long long)chunk; i++) {
            const float x = mf_bits_f32((uint32_t)(b0 + i));
            d_ += mf_f32_bits(mf_exp_f32(x)) != mf_f32_bits(hy[i]);
            const double ref = exp((double)x);
            if (mf_is_finite(x) && ref < 0x1p128 * (1.0 - 0x1p-25)) {
                const double err = fabs((double)hy[i] - ref) / ulp_of(ref);
                if (ref >= 0x1p-126)
                    w = err > w ? err : w;
                else
                    ws = err > ws ? err : ws;
            }
        }
        differ += d_;
        worst = w > worst ? w : worst;
        worst_sub = ws > worst_sub ? ws : worst_sub;
    }
    printf("mf_exp_f32 on the device, every float: %lld differ from the host; max error %.4f ulp "
           "(normal results), %.4f ulp (subnormal); the fast form differs %llu times\n",
           differ, worst, worst_sub, bad[1]);
    fails += differ != 0 || bad[1] != 0 || (!skip_exp && (worst >= 0.53 || worst_sub >= 1.0));

    float *ex;
    CU(cudaMallocManaged(&ex, 2 * sizeof *ex));
    bad[2] = 0;
    const long long nd = 1ll << 33;
    k_div<<<prop.multiProcessorCount * 8, 256>>>(12345, nd, &bad[2], ex);
    CU(cudaGetLastError());
    CU(cudaDeviceSynchronize());
    printf("mf_div_scale vs h / s on the device: %llu of %lld random pairs differ", bad[2], nd);
    if (bad[2])
        printf(" (e.g. h = %a, s = %a)", (double)ex[0], (double)ex[1]);
    printf("\n");
    fails += bad[2] != 0;
    printf(fails ? "device_check: FAILED\n" : "device_check: all passed\n");
    return fails ? 1 : 0;
}
