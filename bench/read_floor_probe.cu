/*
 * What fraction of the read floor can any decode layer reach? The floor prices a layer's routed
 * weights at the read-only rate of a 2 GiB stream; a layer reads far fewer bytes, and a kernel
 * that reads N bytes also pays its start (launch, first DRAM latency) and its tail. This probe
 * times the best a layer could ever do: one kernel that only reads the cell's bytes, nothing
 * else, no dependence between gate and final, replayed from a CUDA graph 20 calls to a replay
 * as the peers' script replays a layer. The best of several launch shapes is kept.
 *
 * Each call reads a window no earlier call of the replay read (`fresh`), as a model's next
 * layer does; `same` reads one window every call, which L2 (50 MB) may partly serve between
 * calls: a benchmark artefact, shown for what it would hide.
 *
 * The kernel is the bench's read ceiling's (tools/ceiling_cuda_read.cu), included here.
 *
 *   nvcc -O3 -std=c++17 -arch=sm_90a bench/read_floor_probe.cu -o /tmp/read_floor_probe
 */
#include "../tools/ceiling_cuda_read.cu"
#include "probe_util.cuh"

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define POOL_BYTES (24ll << 30)
#define CALLS 20

/* The bench's own read kernel (tools/ceiling_cuda_read.cu): the probe tries the shapes the
 * ceiling may pick from and more, with the same kernel. */
static void launch(int unroll, int grid, int threads, const char *src, long long bytes,
                   unsigned *sink, cudaStream_t s)
{
    check(ceiling_cuda_read_launch(src, (size_t)bytes, sink, grid, threads, unroll, s), "read");
}

static int by_value(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* Median µs of one call: `calls` calls (each at its own window when fresh) in one graph. */
static float time_calls(int unroll, int grid, int threads, const char *pool, long long bytes,
                        int fresh, unsigned *sink, cudaStream_t s)
{
    const long long window = (bytes + 4095) / 4096 * 4096;
    int calls = CALLS;
    if (fresh && window * calls > POOL_BYTES)
        calls = (int)(POOL_BYTES / window);
    if (calls < 1)
        calls = 1;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    check(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
    for (int c = 0; c < calls; c++)
        launch(unroll, grid, threads, pool + (fresh ? c * window : 0), bytes, sink, s);
    check(cudaStreamEndCapture(s, &g), "end capture");
    check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
    cudaEvent_t a, b;
    cudaEventCreate(&a), cudaEventCreate(&b);
    float t[15];
    for (int r = -3; r < 15; r++) {
        cudaEventRecord(a, s);
        cudaGraphLaunch(ge, s);
        cudaEventRecord(b, s);
        check(cudaEventSynchronize(b), "replay");
        if (r >= 0)
            cudaEventElapsedTime(&t[r], a, b);
    }
    cudaEventDestroy(a), cudaEventDestroy(b);
    cudaGraphExecDestroy(ge), cudaGraphDestroy(g);
    qsort(t, 15, sizeof t[0], by_value);
    return t[7] * 1e3f / calls;
}

/* Best over the launch shapes (blocks per SM, threads, loads in flight per thread). */
static float best_time(int sms, const char *pool, long long bytes, int fresh, unsigned *sink,
                       cudaStream_t s, char *how, size_t how_len)
{
    static const int shapes[][3] = {{1, 512, 8}, {2, 512, 4}, {2, 512, 8}, {4, 256, 8},
                                    {4, 512, 4}, {8, 256, 4}, {8, 512, 4}};
    float best = 1e30f;
    for (const auto &sh : shapes) {
        const float us = time_calls(sh[2], sms * sh[0], sh[1], pool, bytes, fresh, sink, s);
        if (us < best) {
            best = us;
            snprintf(how, how_len, "%d x %d/SM, %d loads", sh[1], sh[0], sh[2]);
        }
    }
    return best;
}

int main(void)
{
    /* The issue's twelve decode cells: routed experts (M=32: the expected distinct experts of
     * 32 tokens' top-k) x 3 I K weights, FP8 (1 byte) or bf16 (2 bytes). */
    struct Cell {
        const char *name;
        double experts, I, K;
    } cells[] = {
        {"mixtral M=1", 2, 14336, 4096},       {"mixtral M=32", 8, 14336, 4096},
        {"qwen3 M=1", 8, 768, 2048},           {"qwen3 M=32", 110, 768, 2048},
        {"deepseek-v3 M=1", 8, 2048, 7168},    {"deepseek-v3 M=32", 163, 2048, 7168},
    };
    char *pool;
    unsigned *sink;
    const int sms = probe_setup(POOL_BYTES, &pool, &sink);
    cudaStream_t s;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    char how[64];

    /* The ceiling as the floor takes it: one read of 2 GiB. */
    const long long big = 2ll << 30;
    const float big_us = best_time(sms, pool, big, 1, sink, s, how, sizeof how);
    const double read_tbps = big / (big_us * 1e6);
    printf("read ceiling: 2 GiB in %.1f us = %.3f TB/s (%s, %d SMs)\n", big_us, read_tbps, how, sms);

    printf("%-18s %5s %9s %9s %9s %7s %9s %7s  %s\n", "cell", "dtype", "MB", "floor_us", "fresh_us",
           "%floor", "same_us", "%floor", "best shape (fresh)");
    for (const Cell &c : cells)
        for (int width = 1; width <= 2; width++) {
            const long long bytes = (long long)(c.experts * 3 * c.I * c.K * width) / 16 * 16;
            const double floor_us = bytes / (read_tbps * 1e6);
            const float fresh = best_time(sms, pool, bytes, 1, sink, s, how, sizeof how);
            char unused[64];
            const float same = best_time(sms, pool, bytes, 0, sink, s, unused, sizeof unused);
            printf("%-18s %5s %9.1f %9.1f %9.1f %6.1f%% %9.1f %6.1f%%  %s\n", c.name,
                   width == 1 ? "fp8" : "bf16", bytes / 1e6, floor_us, fresh,
                   100 * floor_us / fresh, same, 100 * floor_us / same, how);
        }

    /* The read's fixed cost: time against bytes, fresh windows. */
    printf("\nsize sweep (fresh): MB, us, TB/s, %% of ceiling\n");
    for (long long mb = 4; mb <= 1024; mb *= 2) {
        const long long bytes = mb << 20;
        const float us = best_time(sms, pool, bytes, 1, sink, s, how, sizeof how);
        printf("%6lld MB %9.1f us %7.3f TB/s %6.1f%%  %s\n", mb, us, bytes / (us * 1e6),
               100 * bytes / (us * 1e6) / read_tbps, how);
    }
    return 0;
}
