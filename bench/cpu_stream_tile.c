/*
 * The CPU backend's AVX-512 weight-stream tile alone (src/cpu/gemm_stream_x86.h): MS A rows
 * times NCOLS weight rows of depth 2048, one thread, the whole depth block as the layer calls
 * it, best of 5 runs of REPS calls. Weights of 64 columns stay in L2; of 4096, they come from
 * DRAM. Set beside `moefuse bench`'s layer, it says how much of a layer's time is its tiles.
 *
 *   meson setup build-rel --buildtype=release -Dcuda=disabled -Dopencl=disabled -Dtests=disabled
 *   ninja -C build-rel && cc -O2 -Iinclude -o cpu_stream_tile bench/cpu_stream_tile.c \
 *       build-rel/src/libmoefuse.a -lm -fopenmp
 *   ./cpu_stream_tile MS BF16 NCOLS REPS      (e.g. 16 0 64 100; 16 1 4096 2)
 */
#include "moefuse.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* src/cpu/rows_isa.h: hidden in the shared library, reachable in the static one */
void mf_cpu_gemm_stream_avx512(const float *a, int64_t lda, int64_t ms, const char *wbase,
                               int64_t wrow_bytes, moefuse_dtype wdt, const int64_t *b_rows,
                               int64_t ncols, int64_t kc, float *c, int64_t ldc);

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const int64_t ms = argc > 1 ? atoll(argv[1]) : 16, bf16 = argc > 2 ? atoll(argv[2]) : 0;
    const int64_t ncols = argc > 3 ? atoll(argv[3]) : 64, reps = argc > 4 ? atoll(argv[4]) : 100;
    const int64_t kc = 2048, lda = kc + 16, ldc = ncols + 16, esz = bf16 ? 2 : 4;
    if (ms < 1 || ms > 132 || ncols < 1 || reps < 1) {
        fprintf(stderr, "usage: cpu_stream_tile MS(1..132) BF16(0|1) NCOLS REPS\n");
        return 2;
    }
    float *a = aligned_alloc(64, sizeof(float) * (size_t)(ms * lda));
    char *w = aligned_alloc(64, (size_t)(ncols * kc * esz));
    float *c = aligned_alloc(64, sizeof(float) * (size_t)(ms * ldc));
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)ncols);
    if (!a || !w || !c || !rows)
        return 1;
    for (int64_t i = 0; i < ms * lda; i++)
        a[i] = (float)(i % 7) * 0.01f;
    for (int64_t i = 0; i < ncols * kc; i++) {
        if (bf16)
            ((uint16_t *)w)[i] = (uint16_t)(0x3f80 + (i & 7)); /* 1.0 .. 1.05 */
        else
            ((float *)w)[i] = 1.0f + (float)(i & 7) * 0.01f;
    }
    for (int64_t j = 0; j < ncols; j++)
        rows[j] = j;
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        memset(c, 0, sizeof(float) * (size_t)(ms * ldc));
        const double t0 = seconds();
        for (int64_t i = 0; i < reps; i++)
            mf_cpu_gemm_stream_avx512(a, lda, ms, w, kc * esz, bf16 ? MOEFUSE_BF16 : MOEFUSE_F32,
                                      rows, ncols, kc, c, ldc);
        const double t = seconds() - t0;
        best = t < best ? t : best;
    }
    const double flop = 2.0 * (double)(ms * ncols * kc * reps);
    printf("MS=%lld %s NCOLS=%lld (weights %lld KiB): %.1f GFLOP/s, one thread (c[0] %g)\n",
           (long long)ms, bf16 ? "bf16" : "f32", (long long)ncols,
           (long long)(ncols * kc * esz / 1024), flop / best * 1e-9, c[0]);
    return 0;
}
