/* The CPU backend's ceilings: host memcpy bandwidth and an OpenBLAS dense GEMM of equal FLOPs. */
#include "ceiling.h"

#include "convert.h"
#include "random.h"
#include "timer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOEFUSE_HAVE_BLAS
#include <cblas.h>
/* OpenBLAS's own (its cblas.h declares it too; another cblas.h beside libopenblas may not) */
char *openblas_get_corename(void);
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Host copy bandwidth in GB/s (bytes read + bytes written), best of 5 memcpy runs. */
static double cpu_copy_gbs(moefuse_context *ctx, char *what, size_t what_size)
{
    (void)ctx; /* host memory: the context plays no part */
    /*
     * 1 GiB each way: beyond the last-level cache even of server parts with
     * hundreds of MiB of L3, so this is DRAM bandwidth.
     */
    const size_t bytes = (size_t)CEILING_COPY_MIB << 20;
    char *src = malloc(bytes), *dst = malloc(bytes);
    if (!src || !dst) {
        free(src);
        free(dst);
        snprintf(what, what_size, "out of host memory for two %d MiB buffers", CEILING_COPY_MIB);
        return 0.0;
    }
    memset(src, 1, bytes); /* fault the pages in before timing */
    memset(dst, 2, bytes);
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        const double t0 = now_seconds();
        memcpy(dst, src, bytes);
        const double t = now_seconds() - t0;
        if (t < best)
            best = t;
        src[r] = dst[bytes - 1 - (size_t)r]; /* keep the copies observable */
    }
    free(src);
    free(dst);
    snprintf(what, what_size, "memcpy of %d MiB, read + write, best of 5", CEILING_COPY_MIB);
    return 2.0 * (double)bytes / best / 1e9;
}

/*
 * Host read bandwidth in GB/s (bytes read), best of 5: a sum of the 64-bit words of one
 * buffer as large as the copy's two, on the OpenMP threads the CPU backend runs its MoE
 * layers on (omp_get_max_threads), each summing the same static share it wrote first, so
 * that its pages lie in its own NUMA node as a layer's weights would after a parallel load.
 */
static double cpu_read_gbs(moefuse_context *ctx, char *what, size_t what_size)
{
    (void)ctx; /* host memory: the context plays no part */
    const size_t bytes = (size_t)CEILING_READ_MIB << 20, n = bytes / sizeof(uint64_t);
    uint64_t *buf = malloc(bytes);
    if (!buf) {
        snprintf(what, what_size, "out of host memory for a %d MiB buffer", CEILING_READ_MIB);
        return 0.0;
    }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    for (size_t i = 0; i < n; i++)
        buf[i] = 0x3C3C3C3C3C3C3C3Cull ^ i; /* non-zero, and faults the pages in */
    double best = 1e30;
    uint64_t seen = 0;
    for (int r = -1; r < 5; r++) { /* r = -1: warm-up (the threads start) */
        uint64_t sum = 0;
        const double t0 = now_seconds();
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : sum)
        for (size_t i = 0; i < n; i++)
            sum += buf[i];
        const double t = now_seconds() - t0;
        if (r >= 0 && t < best)
            best = t;
        seen ^= sum;
        buf[(size_t)(r + 1)] = seen; /* the sums are used: no run can be left out */
    }
    free(buf);
    snprintf(what, what_size, "sum of %d MiB on %d OpenMP thread%s, bytes read, best of 5",
             CEILING_READ_MIB, threads, threads == 1 ? "" : "s");
    return (double)bytes / best / 1e9;
}

/*
 * C[rows, n] = A[rows, inner] B[inner, n] through OpenBLAS in GFLOP/s, best of 3 after one
 * warm-up; bf16 through cblas_sbgemm where this OpenBLAS exports it, else f32.
 */
static double cpu_gemm_gflops(moefuse_context *ctx, moefuse_dtype dtype, int64_t rows,
                              int64_t inner, int64_t n, char *what, size_t what_size)
{
    (void)ctx; /* host memory: the context plays no part */
#ifndef MOEFUSE_HAVE_BLAS
    (void)dtype;
    (void)rows;
    (void)inner;
    (void)n;
    snprintf(what, what_size, "built without OpenBLAS; configure with -Dblas=enabled");
    return 0.0;
#else
    const int reps = 3;
    const double flops = 2.0 * (double)rows * (double)inner * (double)n;
    float *c = malloc((size_t)(rows * n) * sizeof *c);
    void *a = NULL, *b = NULL;
    int use_bf16 = 0;
#ifdef MOEFUSE_HAVE_SBGEMM
    use_bf16 = dtype == MOEFUSE_BF16;
#endif
    const size_t esize = use_bf16 ? 2 : 4;
    a = malloc((size_t)(rows * inner) * esize);
    b = malloc((size_t)(inner * n) * esize);
    if (!a || !b || !c) {
        free(a);
        free(b);
        free(c);
        snprintf(what, what_size, "out of host memory for the dense GEMM");
        return 0.0;
    }
    rng r = rng_seed(99);
    for (int64_t i = 0; i < rows * inner; i++)
        use_bf16 ? (void)(((uint16_t *)a)[i] = f32_to_bf16(rng_uniform(&r)))
                 : (void)(((float *)a)[i] = rng_uniform(&r));
    for (int64_t i = 0; i < inner * n; i++)
        use_bf16 ? (void)(((uint16_t *)b)[i] = f32_to_bf16(rng_uniform(&r)))
                 : (void)(((float *)b)[i] = rng_uniform(&r));
    const char *fn = use_bf16 ? "cblas_sbgemm" : "cblas_sgemm";
    const char *note = "";
    if (dtype == MOEFUSE_BF16 && !use_bf16)
        note = " (f32: this OpenBLAS has no cblas_sbgemm)";
    else if (dtype == MOEFUSE_F16)
        note = " (f32: OpenBLAS has no f16 GEMM)";
    /* OpenBLAS picks its kernels by the CPU it recognizes; on one it does not know (0.3.21 on
     * Zen 5 takes the AVX2 Haswell kernels, half its AVX-512 ones' rate) the ceiling is low,
     * and OPENBLAS_CORETYPE names better ones: say which it ran */
    const char *core = openblas_get_corename();
    snprintf(what, what_size, "OpenBLAS %s %lldx%lldx%lld%s, %s kernels", fn, (long long)rows,
             (long long)inner, (long long)n, note, core ? core : "unknown");
    double best = 1e30;
    for (int rep = 0; rep < reps + 1; rep++) { /* the first run warms up OpenBLAS's threads */
        const double t0 = now_seconds();
#ifdef MOEFUSE_HAVE_SBGEMM
        if (use_bf16)
            cblas_sbgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)rows, (blasint)n,
                         (blasint)inner, 1.0f, (const bfloat16 *)a, (blasint)inner,
                         (const bfloat16 *)b, (blasint)n, 0.0f, c, (blasint)n);
        else
#endif
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)rows, (blasint)n,
                        (blasint)inner, 1.0f, (const float *)a, (blasint)inner,
                        (const float *)b, (blasint)n, 0.0f, c, (blasint)n);
        const double t = now_seconds() - t0;
        if (rep > 0 && t < best)
            best = t;
    }
    free(a);
    free(b);
    free(c);
    return flops / best / 1e9;
#endif
}

const ceiling_provider ceiling_cpu = {
    .backend = "cpu",
#ifdef MOEFUSE_HAVE_BLAS
    .summary = "memcpy + OpenMP read sum + OpenBLAS dense GEMM",
#else
    .summary = "memcpy + OpenMP read sum only (built without OpenBLAS)",
#endif
    .copy_gbs = cpu_copy_gbs,
    .read_gbs = cpu_read_gbs,
    .gemm_gflops = cpu_gemm_gflops,
};
