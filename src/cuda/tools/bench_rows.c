/*
 * Timing and CPU cross-check of the CUDA row operations (not part of the
 * build; for the GPU machine). Kernel time is taken with CUDA events around
 * `iters` back-to-back calls on the context's stream (no host round trip per
 * call, unlike `moefuse bench`), against the device-to-device copy bandwidth
 * measured in the same run. With --check, each shape's result is compared
 * with the CPU backend's on the same input: codes and scales bit for bit,
 * counting differences.
 *
 *   nvcc -O2 -Iinclude src/cuda/tools/bench_rows.c BUILD/src/libmoefuse.a \
 *        -Xcompiler -fopenmp -o bench_rows && ./bench_rows [--check] [--iters N]
 */
#include "moefuse.h"

#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x)                                                                                    \
    do {                                                                                         \
        moefuse_status st_ = (x);                                                                \
        if (st_ != MOEFUSE_OK) {                                                                 \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, moefuse_status_name(st_),      \
                    moefuse_last_error(ctx_err));                                                \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

static moefuse_context *ctx_err;
static moefuse_context *gpu, *cpu;
static int iters = 20, check = 0;
static double copy_gbs;

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static uint16_t bf16_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Device buffer filled with bytes from the host. */
static void *dev_copy(const void *src, size_t bytes)
{
    void *d;
    ctx_err = gpu;
    CK(moefuse_buffer_alloc(gpu, bytes ? bytes : 1, &d));
    if (bytes)
        CK(moefuse_buffer_write(gpu, d, 0, src, bytes));
    return d;
}

static void measure_copy(void)
{
    const size_t bytes = (size_t)1 << 30;
    void *a, *b;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc failed\n");
        exit(1);
    }
    cudaMemset(a, 1, bytes);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e0, 0);
    for (int i = 0; i < 10; i++)
        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0);
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    copy_gbs = 2.0 * 10.0 * (double)bytes / (ms * 1e-3) / 1e9;
    printf("copy ceiling: %.1f GB/s (read + write, 1 GiB cudaMemcpyAsync x10)\n", copy_gbs);
    cudaFree(a);
    cudaFree(b);
}

typedef struct {
    const char *op; /* act_quant, act_quant_masked, quant, act_mul */
    int64_t E, T, H, G;
    int layout, ue8m0, int8;
    const char *fill; /* masked: full, skew, one */
    int64_t tokens;
} bcase;

typedef struct {
    moefuse_tensor x, counts, q, sc;
    moefuse_act_quant_options o;
} operands;

static moefuse_status call(moefuse_context *c, const bcase *b, operands *d)
{
    if (strcmp(b->op, "act_quant") == 0)
        return moefuse_act_quant(c, &d->x, NULL, &d->q, &d->sc, &d->o);
    if (strcmp(b->op, "act_quant_masked") == 0)
        return moefuse_act_quant_masked(c, &d->x, &d->counts, NULL, NULL, &d->q, &d->sc, &d->o);
    if (strcmp(b->op, "quant") == 0)
        return moefuse_quant(c, &d->x, &d->q, &d->sc, &d->o.quant);
    return moefuse_act_mul(c, &d->x, NULL, &d->q, &d->o.act);
}

static void run_case(const bcase *b)
{
    const int masked = strcmp(b->op, "act_quant_masked") == 0;
    const int gated = strcmp(b->op, "quant") != 0;
    const int mul = strcmp(b->op, "act_mul") == 0;
    const int64_t E = masked ? b->E : 1, T = b->T, H = b->H, G = b->G ? b->G : 128;
    const int64_t xw = gated ? 2 * H : H, Ta = (T + 3) / 4 * 4, Gn = H / G;
    /* counts */
    int32_t *n = calloc((size_t)E, 4);
    int64_t valid = E * T;
    if (masked) {
        int64_t tokens = b->tokens ? b->tokens : E * T, rest = tokens, from = 0;
        if (strcmp(b->fill, "one") == 0) {
            n[0] = (int32_t)(tokens < T ? tokens : T);
        } else {
            if (strcmp(b->fill, "skew") == 0 && E > 1) {
                n[0] = (int32_t)(tokens / 2 < T ? tokens / 2 : T);
                rest -= n[0];
                from = 1;
            }
            for (int64_t e = from; e < E; e++)
                n[e] = (int32_t)(rest / (E - from) + (e - from < rest % (E - from) ? 1 : 0));
        }
        valid = 0;
        for (int64_t e = 0; e < E; e++)
            valid += n[e];
    }
    /* x: random bf16 in [-6, 6] */
    const size_t xn = (size_t)(E * T * xw);
    uint16_t *hx = malloc(xn * 2);
    for (size_t i = 0; i < xn; i++)
        hx[i] = bf16_of(((float)(rnd() & 0xFFFFFF) / 16777216.0f - 0.5f) * 12.0f);
    /* scales shape */
    int64_t ss[3];
    moefuse_dtype sdt = MOEFUSE_F32;
    if (b->layout == MOEFUSE_SCALE_ROW_MAJOR) {
        ss[0] = E, ss[1] = T, ss[2] = Gn;
        if (b->ue8m0)
            sdt = MOEFUSE_U8;
    } else if (b->layout == MOEFUSE_SCALE_COLUMN_MAJOR) {
        ss[0] = E, ss[1] = Gn, ss[2] = Ta;
        if (b->ue8m0)
            sdt = MOEFUSE_U8;
    } else {
        ss[0] = E, ss[1] = (Gn + 3) / 4, ss[2] = Ta;
        sdt = MOEFUSE_I32;
    }
    const size_t sbytes = (size_t)(ss[0] * ss[1] * ss[2]) * moefuse_dtype_size(sdt);
    const moefuse_dtype qdt = mul ? MOEFUSE_BF16 : (b->int8 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3);
    const size_t qbytes = (size_t)(E * T * H) * moefuse_dtype_size(qdt);
    const int r = masked ? 3 : 2, o = masked ? 0 : 1;
    int64_t xs[3] = {E, T, xw}, qs[3] = {E, T, H}, cs[1] = {E};

    operands d[2];
    moefuse_context *ctxs[2] = {gpu, cpu};
    void *qhost[2] = {NULL, NULL}, *shost[2] = {NULL, NULL};
    for (int k = 0; k < (check ? 2 : 1); k++) {
        moefuse_context *c = ctxs[k];
        ctx_err = c;
        memset(&d[k], 0, sizeof d[k]);
        void *px, *pq, *psc = NULL, *pn = NULL;
        CK(moefuse_buffer_alloc(c, xn * 2, &px));
        CK(moefuse_buffer_write(c, px, 0, hx, xn * 2));
        CK(moefuse_buffer_alloc(c, qbytes, &pq));
        if (!mul)
            CK(moefuse_buffer_alloc(c, sbytes, &psc));
        if (masked) {
            CK(moefuse_buffer_alloc(c, (size_t)E * 4, &pn));
            CK(moefuse_buffer_write(c, pn, 0, n, (size_t)E * 4));
        }
        d[k].x = moefuse_tensor_dense(px, MOEFUSE_BF16, r, xs + o);
        d[k].q = moefuse_tensor_dense(pq, qdt, r, qs + o);
        if (!mul)
            d[k].sc = moefuse_tensor_dense(psc, sdt, r, ss + o);
        if (masked)
            d[k].counts = moefuse_tensor_dense(pn, MOEFUSE_I32, 1, cs);
        d[k].o.quant.group_size = G;
        d[k].o.quant.scale_layout = (moefuse_scale_layout)b->layout;
        d[k].o.quant.ue8m0 = b->ue8m0;
        d[k].o.zero_tail = 0;
        CK(call(c, b, &d[k]));
        CK(moefuse_synchronize(c));
        qhost[k] = malloc(qbytes);
        CK(moefuse_buffer_read(c, pq, 0, qhost[k], qbytes));
        if (!mul) {
            shost[k] = malloc(sbytes);
            CK(moefuse_buffer_read(c, psc, 0, shost[k], sbytes));
        }
    }
    /* timing on the GPU */
    void *stream = NULL;
    ctx_err = gpu;
    CK(moefuse_get_stream(gpu, &stream));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < 3; i++)
        CK(call(gpu, b, &d[0]));
    cudaEventRecord(e0, (cudaStream_t)stream);
    for (int i = 0; i < iters; i++)
        CK(call(gpu, b, &d[0]));
    cudaEventRecord(e1, (cudaStream_t)stream);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    const double us = ms * 1e3 / iters;
    const double per_row_sc = mul ? 0.0 : (double)sbytes / (double)(E * (b->layout ? Ta : T));
    const double bytes = (double)valid * ((double)xw * 2.0 + (double)H * moefuse_dtype_size(qdt) +
                                          per_row_sc) + (masked ? 4.0 * E : 0.0);
    const double gbs = bytes / (us * 1e-6) / 1e9;
    printf("%-16s E=%-4lld T=%-5lld H=%-5lld G=%-4lld lay=%d ue=%d i8=%d %-4s rows=%-6lld "
           "%9.1f us %7.1f GB/s %5.1f%% of copy",
           b->op, (long long)E, (long long)T, (long long)H, (long long)G, b->layout, b->ue8m0,
           b->int8, masked ? b->fill : "", (long long)valid, us, gbs, 100.0 * gbs / copy_gbs);
    if (check) {
        /* compare only what the op writes: valid rows (masked tails are left alone) */
        long long qdiff = 0, qfar = 0, sdiff = 0, s1ulp = 0, total = 0;
        const size_t qes = moefuse_dtype_size(qdt);
        for (int64_t e = 0; e < E; e++)
            for (int64_t t = 0; t < (masked ? n[e] : T); t++) {
                const uint8_t *a = (const uint8_t *)qhost[0] + ((e * T + t) * H) * qes;
                const uint8_t *c = (const uint8_t *)qhost[1] + ((e * T + t) * H) * qes;
                if (mul) {
                    for (int64_t i = 0; i < H; i++) {
                        uint16_t x1, x2;
                        memcpy(&x1, a + 2 * i, 2);
                        memcpy(&x2, c + 2 * i, 2);
                        qdiff += x1 != x2;
                        qfar += abs((int)x1 - (int)x2) > 1;
                    }
                } else {
                    for (int64_t i = 0; i < H; i++) {
                        qdiff += a[i] != c[i];
                        int da = (a[i] & 0x80) ? -(a[i] & 0x7F) : (a[i] & 0x7F);
                        int dc = (c[i] & 0x80) ? -(c[i] & 0x7F) : (c[i] & 0x7F);
                        qfar += abs(da - dc) > 1;
                    }
                    for (int64_t g = 0; g < Gn; g++) {
                        int64_t idx = b->layout == MOEFUSE_SCALE_ROW_MAJOR ? (e * T + t) * Gn + g
                                      : b->layout == MOEFUSE_SCALE_COLUMN_MAJOR
                                          ? (e * Gn + g) * Ta + t
                                          : ((e * ss[1] + g / 4) * Ta + t) * 4 + g % 4;
                        if (sdt == MOEFUSE_F32) {
                            uint32_t s1, s2;
                            memcpy(&s1, (char *)shost[0] + idx * 4, 4);
                            memcpy(&s2, (char *)shost[1] + idx * 4, 4);
                            sdiff += s1 != s2;
                            s1ulp += s1 != s2 && (s1 > s2 ? s1 - s2 : s2 - s1) <= 1;
                        } else {
                            uint8_t s1 = ((uint8_t *)shost[0])[idx], s2 = ((uint8_t *)shost[1])[idx];
                            sdiff += s1 != s2;
                        }
                    }
                }
                total += H;
            }
        printf(" | vs cpu: %lld/%lld codes differ (%.5f%%, %lld by more than 1), %lld scales "
               "differ (%lld by 1 ulp)",
               qdiff, total, 100.0 * (double)qdiff / (double)(total ? total : 1), qfar, sdiff,
               s1ulp);
    }
    printf("\n");
    fflush(stdout);
    for (int k = 0; k < 2; k++) {
        free(qhost[k]);
        free(shost[k]);
    }
    free(hx);
    free(n);
    /* device buffers are freed with the contexts */
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--check") == 0)
            check = 1;
        else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
            iters = atoi(argv[++i]);
    }
    ctx_err = NULL;
    if (moefuse_context_create(&gpu, "cuda") != MOEFUSE_OK ||
        moefuse_context_create(&cpu, "cpu") != MOEFUSE_OK) {
        fprintf(stderr, "no cuda/cpu context\n");
        return 1;
    }
    printf("device: %s\n", moefuse_device_name(gpu));
    measure_copy();
    const bcase cases[] = {
        {"act_quant", 1, 4096, 2048, 128, 0, 0, 0, "", 0},
        {"act_quant", 1, 4096, 7168, 128, 0, 0, 0, "", 0},
        {"act_quant", 1, 8192, 7168, 128, 0, 0, 0, "", 0},
        {"act_quant", 1, 4096, 7168, 128, 1, 0, 0, "", 0},
        {"act_quant", 1, 4096, 7168, 128, 2, 1, 0, "", 0},
        {"act_quant", 1, 4096, 7168, 64, 0, 0, 0, "", 0},
        {"act_quant", 1, 4096, 7168, 32, 1, 1, 0, "", 0},
        {"act_quant", 1, 4096, 7168, 128, 0, 0, 1, "", 0},
        {"act_quant", 1, 4096, 7168, 7168, 0, 0, 0, "", 0},
        {"act_quant_masked", 256, 128, 7168, 128, 0, 0, 0, "full", 0},
        {"act_quant_masked", 32, 1024, 7168, 128, 0, 0, 0, "skew", 16384},
        {"act_quant_masked", 256, 128, 7168, 128, 0, 0, 0, "skew", 16384},
        {"act_quant_masked", 32, 1024, 7168, 128, 1, 0, 0, "skew", 16384},
        {"act_quant_masked", 32, 1024, 7168, 128, 2, 1, 0, "full", 8192},
        {"act_quant_masked", 8, 8192, 7168, 128, 0, 0, 0, "one", 8192},
        {"act_quant_masked", 8, 8192, 7168, 128, 0, 0, 0, "full", 8192},
        {"quant", 1, 4096, 7168, 128, 0, 0, 0, "", 0},
        {"act_mul", 1, 4096, 7168, 128, 0, 0, 0, "", 0},
    };
    const char *only = getenv("BENCH_ONLY"); /* case indices "1,9,10": for profilers */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int run = !only;
        for (const char *c = only; c && *c; c = strchr(c, ',') ? strchr(c, ',') + 1 : "")
            run |= atoi(c) == (int)i;
        if (run)
            run_case(&cases[i]);
    }
    moefuse_context_destroy(gpu);
    moefuse_context_destroy(cpu);
    return 0;
}
