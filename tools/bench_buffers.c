/*
 * Backend buffers of `moefuse bench`, filled from the host: random floats, random FP8 codes,
 * block scales, or bytes as given. Each is remembered in b->buf, for cmd_bench to free.
 */
#include "bench.h"
#include "convert.h"
#include "random.h"
#include "tools.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

/* A new buffer of the context, remembered for release. */
void *bench_alloc(bench *b, size_t bytes)
{
    void *p = NULL;
    moefuse_status st = moefuse_buffer_alloc(b->ctx, bytes ? bytes : 1, &p);
    if (st != MOEFUSE_OK) {
        report_failure(b->ctx, "buffer_alloc", st);
        return NULL;
    }
    b->buf[b->nbuf++] = p;
    return p;
}

/* host[0, bytes) into dev at `offset`; false, reported, when the write fails. */
static bool write_at(bench *b, void *dev, size_t offset, const void *host, size_t bytes)
{
    moefuse_status st = moefuse_buffer_write(b->ctx, dev, offset, host, bytes);
    if (st != MOEFUSE_OK)
        report_failure(b->ctx, "buffer_write", st);
    return st == MOEFUSE_OK;
}

/* A backend buffer of n floats of dtype dt, uniform in [-scale, scale), written in chunks. */
void *bench_random(bench *b, moefuse_dtype dt, int64_t n, float scale, uint64_t seed)
{
    const size_t es = moefuse_dtype_size(dt);
    void *dev = bench_alloc(b, (size_t)n * es);
    if (!dev)
        return NULL;
    const int64_t chunk = (int64_t)1 << 22;
    void *host = malloc((size_t)(n < chunk ? n : chunk) * es);
    if (!host) {
        fprintf(stderr, "moefuse bench: out of host memory\n");
        return NULL;
    }
    rng r = rng_seed(seed);
    for (int64_t at = 0; at < n; at += chunk) {
        const int64_t len = n - at < chunk ? n - at : chunk;
        for (int64_t i = 0; i < len; i++)
            store_float(host, dt, i, scale * rng_uniform(&r));
        if (!write_at(b, dev, (size_t)at * es, host, (size_t)len * es)) {
            free(host);
            return NULL;
        }
    }
    free(host);
    return dev;
}

/* A backend buffer holding a copy of the host's `bytes` at src. */
void *bench_upload(bench *b, const void *src, size_t bytes)
{
    void *dev = bench_alloc(b, bytes);
    if (!dev)
        return NULL;
    return write_at(b, dev, 0, src, bytes) ? dev : NULL;
}

/*
 * A backend buffer of n random e4m3 codes: random bytes with the exponent's top bit cleared
 * (|value| < 2, never a NaN code), made from one 64 MiB block uploaded again and again, so
 * that tens of GB of weights fill in seconds.
 */
void *bench_fp8_codes(bench *b, int64_t n, uint64_t seed)
{
    void *dev = bench_alloc(b, (size_t)n);
    if (!dev)
        return NULL;
    const int64_t chunk = (int64_t)64 << 20;
    uint8_t *host = malloc((size_t)(n < chunk ? n : chunk));
    if (!host) {
        fprintf(stderr, "moefuse bench: out of host memory\n");
        return NULL;
    }
    rng r = rng_seed(seed);
    const int64_t len0 = n < chunk ? n : chunk;
    for (int64_t i = 0; i < len0; i++)
        host[i] = (uint8_t)(rng_below(&r, 256u) & 0xBFu);
    for (int64_t at = 0; at < n; at += chunk) {
        const int64_t len = n - at < chunk ? n - at : chunk;
        if (!write_at(b, dev, (size_t)at, host, (size_t)len)) {
            free(host);
            return NULL;
        }
    }
    free(host);
    return dev;
}

/* f32 block scales in [0.5, 1.5) x 1e-3 of an [E, rows / 128, depth / 128] weight. */
moefuse_tensor bench_block_scales(bench *b, int64_t E, int64_t rows, int64_t depth,
                                  uint64_t seed)
{
    int64_t shape[3] = {E, rows / 128, depth / 128};
    const int64_t n = shape[0] * shape[1] * shape[2];
    float *host = malloc((size_t)n * sizeof *host);
    moefuse_tensor t = {0};
    if (!host)
        return t;
    rng r = rng_seed(seed);
    for (int64_t i = 0; i < n; i++)
        host[i] = 1e-3f * (1.0f + 0.5f * rng_uniform(&r));
    void *dev = bench_upload(b, host, (size_t)n * sizeof *host);
    free(host);
    if (dev)
        t = moefuse_tensor_dense(dev, MOEFUSE_F32, 3, shape);
    return t;
}
