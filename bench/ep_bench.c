/*
 * Expert parallelism over NCCL, timed: one process per GPU (fork), DeepSeek-V3's shapes by
 * default (K = 7168, k = 8, 128 experts a rank), M tokens a rank. Each iteration is
 * moefuse_ep_dispatch then moefuse_ep_combine (bf16 rows, or FP8 rows quantized on the way,
 * and f32 outputs back), timed on the host around a synchronize, median of N; beside it, in the
 * same processes, NCCL's grouped send/recv moving the same bytes between the same ranks (the
 * ceiling the bars compare against).
 *
 *   cc -O2 -Iinclude -I/usr/local/cuda/include -o ep_bench bench/ep_bench.c -Lbuild/src \
 *      -lmoefuse -L/usr/local/cuda/lib64 -lcudart -ldl
 *   LD_LIBRARY_PATH=build/src ./ep_bench [M] [quantize 0|1] [iterations]
 */
#include "moefuse_ep.h"

#include <cuda_runtime.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define W 2
#define E_RANK 128
#define K 7168
#define KTOP 8

typedef struct {
    char b[128];
} nccl_id;
typedef int (*get_id_fn)(nccl_id *);
typedef int (*init_fn)(void **, int, nccl_id, int);
typedef int (*sendrecv_fn)(void *, size_t, int, int, void *, void *);
typedef int (*group_fn)(void);

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static moefuse_tensor dense(void *p, moefuse_dtype dt, int rank, int64_t a, int64_t b, int64_t c)
{
    const int64_t shape[3] = {a, b, c};
    return moefuse_tensor_dense(p, dt, rank, shape);
}

static void *put(moefuse_context *ctx, const void *host, size_t bytes)
{
    void *b = NULL;
    if (moefuse_buffer_alloc(ctx, bytes ? bytes : 1, &b) != MOEFUSE_OK) {
        fprintf(stderr, "alloc: %s\n", moefuse_last_error(ctx));
        exit(1);
    }
    if (host)
        moefuse_buffer_write(ctx, b, 0, host, bytes);
    return b;
}

/* Rank r's routing: k distinct experts a token, uniform over all ranks' experts (every rank can
   draw every rank's, so that each knows what the others send it). */
static void draw_ids(int r, int M, int32_t *ids)
{
    srand(1234u + (unsigned)r);
    for (int m = 0; m < M; m++)
        for (int j = 0; j < KTOP; j++) {
            int e, dup;
            do {
                e = rand() % (W * E_RANK);
                dup = 0;
                for (int q = 0; q < j; q++)
                    dup |= ids[m * KTOP + q] == e;
            } while (dup);
            ids[m * KTOP + j] = e;
        }
}

static int run(int r, int fd[2], int M, int quantize, int iters)
{
    void *nccl = dlopen(getenv("MOEFUSE_NCCL_LIBRARY") ? getenv("MOEFUSE_NCCL_LIBRARY")
                                                      : "libnccl.so.2",
                        RTLD_NOW);
    if (!nccl) {
        fprintf(stderr, "rank %d: no NCCL: %s\n", r, dlerror());
        return 77;
    }
    get_id_fn get_id = (get_id_fn)dlsym(nccl, "ncclGetUniqueId");
    init_fn init = (init_fn)dlsym(nccl, "ncclCommInitRank");
    sendrecv_fn nsend = (sendrecv_fn)dlsym(nccl, "ncclSend");
    sendrecv_fn nrecv = (sendrecv_fn)dlsym(nccl, "ncclRecv");
    group_fn gstart = (group_fn)dlsym(nccl, "ncclGroupStart");
    group_fn gend = (group_fn)dlsym(nccl, "ncclGroupEnd");
    char dev[4];
    snprintf(dev, sizeof dev, "%d", r);
    moefuse_context *ctx;
    if (moefuse_context_create_on(&ctx, "cuda", dev) != MOEFUSE_OK) {
        fprintf(stderr, "rank %d: %s\n", r, moefuse_last_error(NULL));
        return 77;
    }
    moefuse_ep_unique_id id;
    nccl_id raw;
    if (r == 0) {
        if (moefuse_ep_unique_id_create(ctx, &id) != MOEFUSE_OK || get_id(&raw) != 0) {
            fprintf(stderr, "rank 0: unique id: %s\n", moefuse_last_error(ctx));
            return 1;
        }
        for (int p = 1; p < W; p++)
            if (write(fd[1], &id, sizeof id) != sizeof id ||
                write(fd[1], &raw, sizeof raw) != sizeof raw)
                return 1;
    } else if (read(fd[0], &id, sizeof id) != sizeof id ||
               read(fd[0], &raw, sizeof raw) != sizeof raw) {
        return 1;
    }
    moefuse_ep_config cfg = {r, W, W * E_RANK, NULL, {0}};
    moefuse_ep_group *g;
    if (moefuse_ep_group_create(ctx, &id, &cfg, &g) != MOEFUSE_OK) {
        fprintf(stderr, "group: %s\n", moefuse_last_error(ctx));
        return 1;
    }
    uint16_t *x = malloc(2u * M * K);
    int32_t *ids = malloc(4u * M * KTOP);
    float *wt = malloc(4u * M * KTOP);
    size_t rows_from[W] = {0}; /* what each rank sends here */
    for (int p = 0; p < W; p++) {
        draw_ids(p, M, ids);
        for (int s = 0; s < M * KTOP; s++)
            rows_from[p] += ids[s] / E_RANK == r;
    }
    draw_ids(r, M, ids);
    for (size_t i = 0; i < (size_t)M * K; i++)
        x[i] = (uint16_t)(0x3C00 + rand() % 0x700);
    for (int s = 0; s < M * KTOP; s++)
        wt[s] = 0.125f;
    const int tmax = 2 * M * KTOP * W / (W * E_RANK) + 256;
    void *dx = put(ctx, x, 2u * M * K), *dids = put(ctx, ids, 4u * M * KTOP);
    void *dw = put(ctx, wt, 4u * M * KTOP);
    const size_t rb = (size_t)(quantize ? 1 : 2) * E_RANK * tmax * K;
    void *drecv = put(ctx, NULL, rb), *dcnt = put(ctx, NULL, 4u * E_RANK);
    void *dsc = put(ctx, NULL, 4u * E_RANK * tmax * (K / 128));
    void *dy = put(ctx, NULL, 4u * E_RANK * tmax * K), *dout = put(ctx, NULL, 2u * M * K);
    moefuse_tensor tx = dense(dx, MOEFUSE_BF16, 2, M, K, 0);
    moefuse_tensor rx = dense(drecv, quantize ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16, 3, E_RANK, tmax, K);
    moefuse_tensor rc = dense(dcnt, MOEFUSE_I32, 1, E_RANK, 0, 0);
    moefuse_tensor rs = quantize ? dense(dsc, MOEFUSE_F32, 3, E_RANK, tmax, K / 128)
                                 : dense(NULL, MOEFUSE_F32, 3, 0, 0, 0);
    moefuse_tensor ty = dense(dy, MOEFUSE_F32, 3, E_RANK, tmax, K);
    moefuse_tensor out = dense(dout, MOEFUSE_BF16, 2, M, K, 0);
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = dense(dids, MOEFUSE_I32, 2, M, KTOP, 0);
    rt.topk_weights = dense(dw, MOEFUSE_F32, 2, M, KTOP, 0);
    moefuse_ep_dispatch_options o;
    memset(&o, 0, sizeof o);
    o.quantize = quantize;
    /* the bytes each rank sends to each rank: its rows out, and their outputs back */
    size_t rows_to[W] = {0};
    for (int s = 0; s < M * KTOP; s++)
        rows_to[ids[s] / E_RANK]++;
    double *t_ep = malloc(sizeof(double) * (size_t)iters);
    double *t_nc = malloc(sizeof(double) * (size_t)iters);
    for (int it = -2; it < iters; it++) {
        moefuse_synchronize(ctx);
        const double t0 = now();
        moefuse_ep_handle *h = NULL;
        if (moefuse_ep_dispatch(ctx, g, &tx, NULL, &rt, &rx, &rs, &rc, &o, &h) != MOEFUSE_OK ||
            moefuse_ep_combine(ctx, g, h, &ty, &out) != MOEFUSE_OK) {
            fprintf(stderr, "rank %d: %s\n", r, moefuse_last_error(ctx));
            return 1;
        }
        moefuse_synchronize(ctx);
        if (it >= 0)
            t_ep[it] = now() - t0;
        moefuse_ep_handle_destroy(h);
    }
    /* NCCL alone: the same rows out (from x's buffer) and back (from y's) */
    void *comm;
    cudaSetDevice(r); /* NCCL's comm lives on the thread's current device */
    if (init(&comm, W, raw, r) != 0) {
        fprintf(stderr, "rank %d: ncclCommInitRank failed\n", r);
        return 1;
    }
    void *stream = NULL;
    moefuse_get_stream(ctx, &stream);
    const size_t row_out = quantize ? K + 4 * (K / 128) : 2u * K, row_back = 4u * K;
    void *nsend_buf = put(ctx, NULL, row_back * (size_t)M * KTOP * 2);
    void *nrecv_buf = put(ctx, NULL, row_back * (size_t)M * KTOP * 2);
    for (int it = -2; it < iters; it++) {
        moefuse_synchronize(ctx);
        const double t0 = now();
        for (int pass = 0; pass < 2; pass++) {
            const size_t row = pass == 0 ? row_out : row_back;
            size_t so = 0, ro = 0;
            gstart();
            for (int p = 0; p < W; p++) { /* out: my rows; back: the rows I received */
                const size_t ns = pass == 0 ? rows_to[p] : rows_from[p];
                const size_t nr = pass == 0 ? rows_from[p] : rows_to[p];
                nsend((char *)nsend_buf + so, ns * row, 1, p, comm, stream);
                nrecv((char *)nrecv_buf + ro, nr * row, 1, p, comm, stream);
                so += ns * row;
                ro += nr * row;
            }
            gend();
        }
        moefuse_synchronize(ctx);
        if (it >= 0)
            t_nc[it] = now() - t0;
    }
    qsort(t_ep, (size_t)iters, sizeof *t_ep, cmp);
    qsort(t_nc, (size_t)iters, sizeof *t_nc, cmp);
    size_t bytes = 0;
    for (int p = 0; p < W; p++)
        bytes += rows_to[p] * (row_out + row_back);
    printf("rank %d: M=%d %s: dispatch+combine %.3f ms; NCCL send/recv of the same %.1f MB "
           "%.3f ms; ratio %.2f\n",
           r, M, quantize ? "FP8" : "bf16", t_ep[iters / 2] * 1e3, (double)bytes / 1e6,
           t_nc[iters / 2] * 1e3, t_ep[iters / 2] / t_nc[iters / 2]);
    moefuse_ep_group_destroy(g);
    moefuse_context_destroy(ctx);
    return 0;
}

int main(int argc, char **argv)
{
    const int M = argc > 1 ? atoi(argv[1]) : 4096;
    const int quantize = argc > 2 ? atoi(argv[2]) : 0;
    const int iters = argc > 3 ? atoi(argv[3]) : 10;
    int fd[2];
    if (pipe(fd) != 0)
        return 1;
    pid_t pid[W];
    for (int r = 0; r < W; r++)
        if ((pid[r] = fork()) == 0) {
            const int code = run(r, fd, M, quantize, iters);
            fflush(NULL); /* _exit flushes no stdio buffer */
            _exit(code);
        }
    int rc = 0;
    for (int r = 0; r < W; r++) {
        int st = 0;
        waitpid(pid[r], &st, 0);
        rc |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            fprintf(stderr, "rank %d: exit %d (signal %d)\n", r,
                    WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    }
    return rc;
}
