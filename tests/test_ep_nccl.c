/*
 * Expert parallelism over NCCL: one process per GPU (fork), rank 0's unique id passed through
 * a pipe, dispatch of bf16 rows and of FP8 rows quantized on the way, and combine, in both
 * modes, each rank checking its own outputs against what it computes from every rank's inputs
 * (all drawn from one seed). The low-latency mode's calls are then captured in a CUDA graph
 * and replayed over spoilt outputs, once with the same routing and once with new topk_ids
 * written into the same buffer, and checked again. Needs 2 GPUs and NCCL (libnccl.so.2, or
 * MOEFUSE_NCCL_LIBRARY): otherwise it prints why and exits 77 (Meson's SKIP). Not a Check
 * program: the ranks are processes.
 */
#include "moefuse_ep.h"

#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define W 2
#define E 8
#define K 256
#define KTOP 4
#define TMAX 256
#define MAX_TOKENS 48 /* the largest M_of */

static int M_of(int r)
{
    return 37 + 11 * r;
}

/* One seed for every rank's data, so that each process can compute every rank's. */
static uint64_t rng = 88172645463325252ull;
static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static uint16_t x_all[W][64 * K];
static int32_t ids_all[W][64 * KTOP];
static float w_all[W][64 * KTOP];

/* New topk_ids for every rank (each process draws the same from the seed). */
static void redraw_ids(uint64_t seed)
{
    rng = seed;
    for (int r = 0; r < W; r++)
        for (int s = 0; s < M_of(r) * KTOP; s++) {
            const uint64_t v = next() % 20;
            ids_all[r][s] = v == 0 ? -1 : v == 1 ? E + 2 : (int32_t)(next() % E);
        }
}

static void draw(void)
{
    for (int r = 0; r < W; r++)
        for (int i = 0; i < M_of(r) * K; i++)
            x_all[r][i] = (uint16_t)(0x3C00 + (next() % 0x700)) ^ (uint16_t)((next() & 1) << 15);
    for (int r = 0; r < W; r++)
        for (int s = 0; s < M_of(r) * KTOP; s++) {
            const uint64_t v = next() % 20;
            ids_all[r][s] = v == 0 ? -1 : v == 1 ? E + 2 : (int32_t)(next() % E);
            w_all[r][s] = 0.05f + (float)(next() % 1000) / 1000.0f;
        }
}

static float y_of(int r, int e, int t, int c)
{
    return (float)((r * 131 + e * 31 + t * 7 + c) % 97) / 97.0f - 0.5f;
}

static moefuse_tensor dense(void *p, moefuse_dtype dt, int rank, int64_t a, int64_t b, int64_t c)
{
    const int64_t shape[3] = {a, b, c};
    return moefuse_tensor_dense(p, dt, rank, shape);
}

static void *put(moefuse_context *ctx, const void *host, size_t bytes)
{
    void *b = NULL;
    if (moefuse_buffer_alloc(ctx, bytes ? bytes : 1, &b) != MOEFUSE_OK)
        return NULL;
    if (host && bytes)
        moefuse_buffer_write(ctx, b, 0, host, bytes);
    return b;
}

/* Rank r's received rows (bf16: the senders' rows themselves) and counts against the routing:
   each local expert's rows by source rank, token, slot. Prints the first difference. */
static int received_differs(int r, int quantize, int El, const int32_t *cnt,
                            const unsigned char *recv)
{
    for (int e = 0; e < El; e++) {
        int t = 0;
        for (int p = 0; p < W; p++)
            for (int s = 0; s < M_of(p) * KTOP; s++) {
                const int gid = ids_all[p][s];
                if (gid < 0 || gid >= E || gid / (E / W) != r || gid % (E / W) != e)
                    continue;
                if (!quantize &&
                    memcmp(recv + 2u * ((size_t)e * TMAX + t) * K, x_all[p] + (s / KTOP) * K,
                           2u * K) != 0) {
                    fprintf(stderr, "rank %d: expert %d row %d is not row %d of rank %d\n", r, e,
                            t, s / KTOP, p);
                    return 1;
                }
                t++;
            }
        if (cnt[e] != t) {
            fprintf(stderr, "rank %d: expert %d: count %d, expected %d\n", r, e, cnt[e], t);
            return 1;
        }
    }
    return 0;
}

/* The experts' outputs y = y_of(r, e, t, c) for the rows each expert has (count[e]), NaN past
   them (combine must not read those). */
static void fill_y(int r, int El, const int32_t *cnt, float *y)
{
    for (int e = 0; e < El; e++)
        for (int t = 0; t < TMAX; t++)
            for (int c = 0; c < K; c++)
                y[((size_t)e * TMAX + t) * K + c] = t < cnt[e] ? y_of(r, e, t, c) : NAN;
}

/* Each local expert's rows under the current routing. */
static void count_rows(int r, int El, int32_t *cnt)
{
    for (int e = 0; e < El; e++) {
        cnt[e] = 0;
        for (int p = 0; p < W; p++)
            for (int s = 0; s < M_of(p) * KTOP; s++)
                cnt[e] += ids_all[p][s] == r * (E / W) + e;
    }
}

/* Rank r's combine against the contract's sum (the low-latency mode: each rank's slots, then
   the ranks in order); prints the first difference. */
static int combine_differs(int r, int ll, const float *got)
{
    for (int m = 0; m < M_of(r); m++)
        for (int c = 0; c < K; c++) {
            float acc = 0.0f;
            for (int q = 0; q < (ll ? W : 1); q++) {
                float part = 0.0f;
                int any = 0;
                for (int j = 0; j < KTOP; j++) {
                    const int gid = ids_all[r][m * KTOP + j];
                    if (gid < 0 || gid >= E || (ll && gid / (E / W) != q))
                        continue;
                    const int owner = gid / (E / W), e = gid % (E / W);
                    int t = 0; /* the slot's row at its expert */
                    for (int p = 0; p < W; p++)
                        for (int s = 0; s < M_of(p) * KTOP; s++) {
                            if (p == r && s == m * KTOP + j)
                                goto found;
                            t += ids_all[p][s] == gid;
                        }
                found:;
                    const float prod = w_all[r][m * KTOP + j] * y_of(owner, e, t, c);
                    part = part + prod;
                    any = 1;
                }
                acc = !ll ? part : any ? acc + part : acc;
            }
            if (got[(size_t)m * K + c] != acc) {
                fprintf(stderr, "rank %d: combine: token %d channel %d: %g, expected %g\n", r, m,
                        c, (double)got[(size_t)m * K + c], (double)acc);
                return 1;
            }
        }
    return 0;
}

#define FAIL(...)                                                                                \
    do {                                                                                         \
        fprintf(stderr, "rank %d: ", r);                                                         \
        fprintf(stderr, __VA_ARGS__);                                                            \
        fprintf(stderr, "\n");                                                                   \
        return 1;                                                                                \
    } while (0)

/* One rank's run; 0 when every check holds, 77 when its GPU or NCCL is missing. Rank 0 makes
   the unique id and writes it to the other ranks' pipe; the others read it. The parent never
   touches CUDA, which a forked child could not use after it. */
static int rank_main(int r, int pipe_fd[2], int quantize, int ll)
{
    moefuse_ep_unique_id id;
    if (r == 0) {
        moefuse_context *c0;
        int ok = moefuse_context_create_on(&c0, "cuda", "0") == MOEFUSE_OK &&
                 moefuse_ep_unique_id_create(c0, &id) == MOEFUSE_OK;
        if (!ok)
            printf("SKIP: rank 0: %s\n", moefuse_last_error(NULL)[0]
                                              ? moefuse_last_error(NULL)
                                              : moefuse_last_error(c0));
        if (ok)
            moefuse_context_destroy(c0);
        for (int p = 1; p < W; p++) {
            const char flag = ok ? 1 : 0;
            if (write(pipe_fd[1], &flag, 1) != 1 || (ok && write(pipe_fd[1], &id, sizeof id) !=
                                                               (ssize_t)sizeof id))
                return 1;
        }
        if (!ok)
            return 77;
    } else {
        char flag = 0;
        if (read(pipe_fd[0], &flag, 1) != 1 || !flag ||
            read(pipe_fd[0], &id, sizeof id) != (ssize_t)sizeof id)
            return 77;
    }
    char dev[8];
    snprintf(dev, sizeof dev, "%d", r);
    moefuse_context *ctx;
    if (moefuse_context_create_on(&ctx, "cuda", dev) != MOEFUSE_OK) {
        printf("SKIP: rank %d: %s\n", r, moefuse_last_error(NULL));
        return 77;
    }
    moefuse_ep_config cfg = {r, W, E, NULL, {0}};
    moefuse_ep_group *g;
    if (moefuse_ep_group_create(ctx, &id, &cfg, &g) != MOEFUSE_OK)
        FAIL("group: %s", moefuse_last_error(ctx));
    const int M = M_of(r), El = moefuse_ep_local_experts(g);
    void *dx = put(ctx, x_all[r], 2u * M * K), *dids = put(ctx, ids_all[r], 4u * M * KTOP);
    void *dw = put(ctx, w_all[r], 4u * M * KTOP);
    const size_t rb = (quantize ? 1u : 2u) * El * TMAX * K;
    void *drecv = put(ctx, NULL, rb), *dcnt = put(ctx, NULL, 4u * El);
    void *dsc = quantize ? put(ctx, NULL, 4u * El * TMAX * (K / 128)) : NULL;
    moefuse_tensor x = dense(dx, MOEFUSE_BF16, 2, M, K, 0);
    moefuse_tensor rx = dense(drecv, quantize ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16, 3, El, TMAX, K);
    moefuse_tensor rc = dense(dcnt, MOEFUSE_I32, 1, El, 0, 0);
    moefuse_tensor rs = quantize ? dense(dsc, MOEFUSE_F32, 3, El, TMAX, K / 128)
                                 : dense(NULL, MOEFUSE_F32, 3, 0, 0, 0);
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = dense(dids, MOEFUSE_I32, 2, M, KTOP, 0);
    rt.topk_weights = dense(dw, MOEFUSE_F32, 2, M, KTOP, 0);
    moefuse_ep_dispatch_options o;
    memset(&o, 0, sizeof o);
    o.quantize = quantize;
    if (ll) {
        o.mode = MOEFUSE_EP_LOW_LATENCY;
        o.max_tokens = MAX_TOKENS;
    }
    moefuse_ep_handle *h = NULL;
    if (moefuse_ep_dispatch(ctx, g, &x, NULL, &rt, &rx, &rs, &rc, &o, &h) != MOEFUSE_OK)
        FAIL("dispatch: %s", moefuse_last_error(ctx));
    int32_t cnt[E];
    unsigned char *recv = malloc(rb);
    moefuse_buffer_read(ctx, dcnt, 0, cnt, 4u * El);
    moefuse_buffer_read(ctx, drecv, 0, recv, rb);
    if (received_differs(r, quantize, El, cnt, recv))
        return 1;
    float *y = malloc(4u * El * TMAX * K);
    fill_y(r, El, cnt, y);
    void *dy = put(ctx, y, 4u * El * TMAX * K), *dout = put(ctx, NULL, 4u * M * K);
    moefuse_tensor ty = dense(dy, MOEFUSE_F32, 3, El, TMAX, K);
    moefuse_tensor out = dense(dout, MOEFUSE_F32, 2, M, K, 0);
    if (moefuse_ep_combine(ctx, g, h, &ty, &out) != MOEFUSE_OK)
        FAIL("combine: %s", moefuse_last_error(ctx));
    float *got = malloc(4u * M * K);
    moefuse_buffer_read(ctx, dout, 0, got, 4u * M * K);
    if (combine_differs(r, ll, got))
        return 1;
    if (ll) { /* the same two calls captured in a graph, replayed over spoilt outputs */
        void *stream = NULL;
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        moefuse_ep_handle *h2 = NULL;
        if (moefuse_get_stream(ctx, &stream) != MOEFUSE_OK ||
            cudaStreamBeginCapture((cudaStream_t)stream, cudaStreamCaptureModeThreadLocal) !=
                cudaSuccess)
            FAIL("capture: %s", moefuse_last_error(ctx));
        const moefuse_status sd = moefuse_ep_dispatch(ctx, g, &x, NULL, &rt, &rx, &rs, &rc, &o,
                                                      &h2);
        const moefuse_status sc = sd == MOEFUSE_OK ? moefuse_ep_combine(ctx, g, h2, &ty, &out)
                                                   : sd;
        const cudaError_t ce = cudaStreamEndCapture((cudaStream_t)stream, &graph);
        if (sc != MOEFUSE_OK || ce != cudaSuccess)
            FAIL("captured calls: %s / %s", moefuse_last_error(ctx), cudaGetErrorString(ce));
        if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
            FAIL("graph instantiate");
        for (int replay = 0; replay < 2; replay++) {
            if (replay == 1) { /* new routing in the captured buffer, and y to match */
                redraw_ids(0x9E3779B97F4A7C15ull);
                moefuse_buffer_write(ctx, dids, 0, ids_all[r], 4u * M * KTOP);
                count_rows(r, El, cnt);
                fill_y(r, El, cnt, y);
                moefuse_buffer_write(ctx, dy, 0, y, 4u * El * TMAX * K);
            }
            cudaMemset(drecv, 0x5a, rb);
            cudaMemset(dcnt, 0x5a, 4u * El);
            cudaMemset(dout, 0x5a, 4u * M * K);
            cudaDeviceSynchronize();
            if (cudaGraphLaunch(exec, (cudaStream_t)stream) != cudaSuccess ||
                cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess)
                FAIL("graph launch");
            int32_t again[E];
            moefuse_buffer_read(ctx, dcnt, 0, again, 4u * El);
            moefuse_buffer_read(ctx, drecv, 0, recv, rb);
            moefuse_buffer_read(ctx, dout, 0, got, 4u * M * K);
            if (received_differs(r, quantize, El, again, recv) || combine_differs(r, ll, got))
                FAIL("graph replay %d differs", replay);
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        moefuse_ep_handle_destroy(h2);
    }
    moefuse_ep_handle_destroy(h);
    moefuse_ep_group_destroy(g);
    moefuse_context_destroy(ctx);
    printf("rank %d: %s dispatch and combine over NCCL, %s mode%s: ok\n", r,
           quantize ? "FP8" : "bf16", ll ? "low-latency" : "normal",
           ll ? " (and two graph replays, the second on new routing)" : "");
    return 0;
}

int main(void)
{
    draw();
    int failed = 0, skipped = 0;
    for (int run = 0; run < 4; run++) {
        const int quantize = run & 1, ll = run >> 1;
        int fd[2];
        if (pipe(fd) != 0)
            return 1;
        pid_t pid[W];
        for (int r = 0; r < W; r++) {
            pid[r] = fork();
            if (pid[r] == 0) {
                const int code = rank_main(r, fd, quantize, ll);
                fflush(NULL); /* _exit flushes no stdio buffer */
                _exit(code);
            }
        }
        close(fd[0]);
        close(fd[1]);
        for (int r = 0; r < W; r++) {
            int status = 0;
            waitpid(pid[r], &status, 0);
            const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
            skipped |= code == 77;
            failed |= code != 0 && code != 77;
        }
    }
    if (failed) {
        printf("FAILED\n");
        return 1;
    }
    printf(skipped ? "SKIP: two CUDA devices and NCCL needed\n" : "ok\n");
    return skipped ? 77 : 0;
}
