/*
 * The floor under a small call timed back to back: how long one launch of an empty kernel
 * takes on this machine, timed the way `moefuse bench` times calls (runs of 100 calls after a
 * synchronize, host clock, median of 20 runs), beside moefuse's one-launch routers on the same
 * context. When a call is near the empty launch, the host and the driver set its pace, not
 * its kernel. Also prints the per-call host cost of the driver queries a call makes.
 *
 *   nvcc -arch=sm_90a -O2 -Iinclude -o launch_floor bench/launch_floor.cu \
 *        -Lbuild/src -lmoefuse -lcuda && LD_LIBRARY_PATH=build/src ./launch_floor
 */
#include "moefuse.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

__global__ void empty_kernel(int x)
{
    if (x == -1)
        printf("never\n");
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median over 20 runs of 100 calls of f (after 5 warm-up runs), microseconds per call. */
#define RUNS 20
#define BATCH 100
#define FLOOR(name, ...)                                                                      \
    do {                                                                                      \
        double t[RUNS];                                                                       \
        for (int r = -5; r < RUNS; r++) {                                                     \
            cudaDeviceSynchronize();                                                          \
            const double t0 = now();                                                          \
            for (int i = 0; i < BATCH; i++) {                                                 \
                __VA_ARGS__;                                                                  \
            }                                                                                 \
            cudaDeviceSynchronize();                                                          \
            if (r >= 0)                                                                       \
                t[r] = (now() - t0) / BATCH * 1e6;                                            \
        }                                                                                     \
        qsort(t, RUNS, sizeof t[0], by_value);                                                \
        printf("%-44s %6.2f us per call (median of %d runs of %d)\n", name, t[RUNS / 2], RUNS, \
               BATCH);                                                                        \
    } while (0)

int main(void)
{
    moefuse_context *ctx;
    if (moefuse_context_create(&ctx, "cuda") != MOEFUSE_OK) {
        printf("launch_floor: no CUDA context: %s\n", moefuse_last_error(NULL));
        return 1;
    }
    void *stream = NULL;
    moefuse_get_stream(ctx, &stream);
    cudaStream_t st = (cudaStream_t)stream;
    void *lg, *cb, *ids, *w;
    moefuse_buffer_alloc(ctx, 64 * 256 * sizeof(float), &lg);
    moefuse_buffer_alloc(ctx, 256 * sizeof(float), &cb);
    moefuse_buffer_alloc(ctx, 64 * 8 * 4, &ids);
    moefuse_buffer_alloc(ctx, 64 * 8 * 4, &w);
    float *h = (float *)malloc(64 * 256 * sizeof(float));
    srand(1);
    for (int i = 0; i < 64 * 256; i++)
        h[i] = (float)rand() / (float)RAND_MAX * 8.0f - 4.0f; /* no ties */
    cudaMemcpy(lg, h, 64 * 256 * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemcpy(cb, h, 256 * sizeof(float), cudaMemcpyHostToDevice);
    free(h);

    FLOOR("empty kernel, <<<>>>", empty_kernel<<<1, 32, 0, st>>>(i));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(1);
    cfg.blockDim = dim3(32);
    cfg.stream = st;
    cudaLaunchAttribute at[1] = {};
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    FLOOR("empty kernel, programmatic dependent launch", cudaLaunchKernelEx(&cfg, empty_kernel, i));

    int64_t l1[2] = {1, 256}, l64[2] = {64, 256}, bs[1] = {256}, i1[2] = {1, 8}, i64[2] = {64, 8};
    const moefuse_tensor L1 = moefuse_tensor_dense(lg, MOEFUSE_F32, 2, l1);
    const moefuse_tensor L64 = moefuse_tensor_dense(lg, MOEFUSE_F32, 2, l64);
    const moefuse_tensor CB = moefuse_tensor_dense(cb, MOEFUSE_F32, 1, bs);
    const moefuse_tensor I1 = moefuse_tensor_dense(ids, MOEFUSE_I32, 2, i1);
    const moefuse_tensor W1 = moefuse_tensor_dense(w, MOEFUSE_F32, 2, i1);
    const moefuse_tensor I64 = moefuse_tensor_dense(ids, MOEFUSE_I32, 2, i64);
    const moefuse_tensor W64 = moefuse_tensor_dense(w, MOEFUSE_F32, 2, i64);
    moefuse_router_options o = {};
    o.scoring = MOEFUSE_ROUTER_SIGMOID;
    o.n_group = 8;
    o.topk_group = 4;
    o.renormalize = 1;
    o.scale = 2.5f;
    FLOOR("moefuse_topk_softmax M=1 E=256 k=8", moefuse_topk_softmax(ctx, &L1, 1, &I1, &W1));
    FLOOR("moefuse_topk_route DeepSeek-V3 M=1",
          moefuse_topk_route(ctx, &L1, NULL, &CB, &o, &I1, &W1));
    FLOOR("moefuse_topk_route DeepSeek-V3 M=64",
          moefuse_topk_route(ctx, &L64, NULL, &CB, &o, &I64, &W64));

    /* the driver queries of a call, each alone (host time, no device work) */
    int dev;
    FLOOR("cudaGetDevice", cudaGetDevice(&dev));
    enum cudaStreamCaptureStatus cs;
    FLOOR("cudaStreamIsCapturing", cudaStreamIsCapturing(st, &cs));
    struct cudaPointerAttributes pa;
    FLOOR("cudaPointerGetAttributes", cudaPointerGetAttributes(&pa, lg));
    moefuse_context_destroy(ctx);
    return 0;
}
