/*
 * Helpers of bench/ep_bench.c: timing, tensors and buffers, the deterministic data every rank
 * can rebuild (tokens, routing, weights), a side channel of pipes between the ranks' processes
 * (barriers, agreeing on a status, gathering figures) that needs no GPU, bf16 comparison, a
 * rank's environment with NCCL's own send/recv (the ceilings), and the fork of the ranks.
 */
#ifndef EP_BENCH_UTIL_H
#define EP_BENCH_UTIL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* usleep, kill, prctl under -std=c11 */
#endif

#include "moefuse_ep.h"

#include <errno.h>
#include <signal.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* DeepSeek-V3's shapes (a test may compile smaller ones; K and INTER multiples of 128) */
#define W 2 /* ranks, one process and one GPU each */
#ifndef E_RANK
#define E_RANK 128 /* experts a rank */
#endif
#define E_ALL (W * E_RANK)
#ifndef K
#define K 7168 /* model dimension */
#endif
#ifndef KTOP
#define KTOP 8 /* experts a token */
#endif
#ifndef INTER
#define INTER 2048 /* the experts' intermediate size I (layer mode) */
#endif

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of n times (the upper one for even n), sorting them in place. */
static double median(double *t, int n)
{
    if (n <= 0)
        return 0.0;
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return t[n / 2];
}

static moefuse_tensor dense(void *p, moefuse_dtype dt, int rank, int64_t a, int64_t b, int64_t c)
{
    const int64_t shape[3] = {a, b, c};
    return moefuse_tensor_dense(p, dt, rank, shape);
}

/* The same starting `offset` bytes into p (a slice of a larger buffer). */
static moefuse_tensor dense_at(void *p, size_t offset, moefuse_dtype dt, int rank, int64_t a,
                               int64_t b, int64_t c)
{
    moefuse_tensor t = dense(p, dt, rank, a, b, c);
    t.offset = (int64_t)offset;
    return t;
}

/* A device buffer (with a copy of host when given); a rank that cannot get one stops here. */
static void *put(moefuse_context *ctx, const void *host, size_t bytes)
{
    void *b = NULL;
    if (moefuse_buffer_alloc(ctx, bytes ? bytes : 1, &b) != MOEFUSE_OK ||
        (host && bytes && moefuse_buffer_write(ctx, b, 0, host, bytes) != MOEFUSE_OK)) {
        fprintf(stderr, "buffer of %.1f MB: %s\n", (double)bytes / 1e6, moefuse_last_error(ctx));
        fflush(NULL);
        _exit(1);
    }
    return b;
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "host allocation of %.1f MB failed\n", (double)bytes / 1e6);
        fflush(NULL);
        _exit(1);
    }
    return p;
}

/* ------------------------------------------------------------ deterministic data */

static uint64_t mix64(uint64_t z) /* splitmix64's finalizer */
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rng_next(uint64_t *s) /* xorshift64* */
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

/* Each 64-bit word of random bits becomes 8 e4m3 codes (random sign and mantissa, exponent
   field 4..7: magnitudes 0.125 .. 1.875, never NaN) or 4 bf16 values (random sign and mantissa,
   magnitudes 2^(lo - 127) .. 2^(lo - 124) * 1.99 for exponent field lo .. lo + 3). */
static uint64_t fp8_word(uint64_t r)
{
    return (r & 0x8787878787878787ull) |
           ((((r >> 3) & 0x0303030303030303ull) + 0x0404040404040404ull) << 3);
}

static uint64_t bf16_word(uint64_t r, unsigned lo)
{
    return (r & 0x807F807F807F807Full) |
           ((((r >> 7) & 0x0003000300030003ull) + 0x0001000100010001ull * lo) << 7);
}

/* n bytes of FP8 codes (kind 0) or n / 2 bf16 values with exponent field lo (kind 1). */
static void fill_words(void *dst, size_t bytes, uint64_t seed, int kind, unsigned lo)
{
    uint64_t s = mix64(seed) | 1u;
    unsigned char *p = dst;
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
        const uint64_t r = rng_next(&s), v = kind == 0 ? fp8_word(r) : bf16_word(r, lo);
        memcpy(p + i, &v, 8);
    }
    if (i < bytes) { /* bytes is even for bf16, so a tail holds whole values */
        const uint64_t r = rng_next(&s), v = kind == 0 ? fp8_word(r) : bf16_word(r, lo);
        memcpy(p + i, &v, bytes - i);
    }
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
                e = rand() % E_ALL;
                dup = 0;
                for (int q = 0; q < j; q++)
                    dup |= ids[m * KTOP + q] == e;
            } while (dup);
            ids[m * KTOP + j] = e;
        }
}

/* Rank p's M tokens: routing ids [M, k], weights [M, k] in [0.02, 0.27], x [M, K] bf16 of
   random sign and magnitudes 0.125 .. 2. The same on every rank that draws them. */
static void draw_tokens(int p, int M, int32_t *ids, float *wt, uint16_t *x)
{
    draw_ids(p, M, ids);
    uint64_t s = mix64(0x5EED0000u + (uint64_t)p) | 1u;
    for (int i = 0; i < M * KTOP; i++)
        wt[i] = 0.02f + (float)(rng_next(&s) % 1000u) / 4000.0f;
    fill_words(x, 2u * (size_t)M * K, 0x7700u + (uint64_t)p, 1, 124);
}

static float bf16_value(uint16_t v)
{
    const uint32_t b = (uint32_t)v << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* ------------------------------------------------------------ the ranks' side channel */

/* Pipes between the ranks' processes: rd[q] reads what rank q wrote to this rank, wr[q] writes
   to rank q (-1 for q == r). A rank that exits closes its ends, so the others read EOF rather
   than wait for ever. */
typedef struct side_channel {
    int r;
    int rd[W], wr[W];
} side_channel;

static int full_write(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n > 0) {
        const ssize_t k = write(fd, c, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

static int full_read(int fd, void *p, size_t n)
{
    char *c = p;
    while (n > 0) {
        const ssize_t k = read(fd, c, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1; /* EOF: that rank has gone */
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Every rank's n bytes (n < PIPE_BUF, so writing first cannot block) into all [W][n]; 0 when
   every rank answered. */
static int side_allgather(const side_channel *sc, const void *mine, void *all, size_t n)
{
    memcpy((char *)all + (size_t)sc->r * n, mine, n);
    for (int q = 0; q < W; q++)
        if (q != sc->r && full_write(sc->wr[q], mine, n) != 0)
            return -1;
    for (int q = 0; q < W; q++)
        if (q != sc->r && full_read(sc->rd[q], (char *)all + (size_t)q * n, n) != 0)
            return -1;
    return 0;
}

static int side_barrier(const side_channel *sc)
{
    char c = 1, all[W];
    return side_allgather(sc, &c, all, 1);
}

/* 1 when ok holds on every rank (and every rank answered). */
static int side_agree(const side_channel *sc, int ok)
{
    int all[W];
    if (side_allgather(sc, &ok, all, sizeof ok) != 0)
        return 0;
    for (int q = 0; q < W; q++)
        ok &= all[q] != 0;
    return ok;
}

/* The largest of the ranks' values (0 on a broken channel). */
static double side_max(const side_channel *sc, double v)
{
    double all[W];
    if (side_allgather(sc, &v, all, sizeof v) != 0)
        return 0.0;
    for (int q = 0; q < W; q++)
        v = all[q] > v ? all[q] : v;
    return v;
}

/* Elements of two bf16 arrays that differ in their bits, the rows holding them, the largest
   |a - b| over pairs of numbers, and the non-finite elements of a and of b. */
typedef struct bf16_diff {
    size_t elems, rows, nonfinite_a, nonfinite_b;
    double max_abs, sum_sq_a;
} bf16_diff;

static bf16_diff compare_bf16(const uint16_t *a, const uint16_t *b, size_t rows, size_t cols)
{
    bf16_diff d;
    memset(&d, 0, sizeof d);
    for (size_t i = 0; i < rows; i++) {
        size_t row_diffs = 0;
        for (size_t c = 0; c < cols; c++) {
            const float x = bf16_value(a[i * cols + c]), y = bf16_value(b[i * cols + c]);
            d.nonfinite_a += !isfinite(x);
            d.nonfinite_b += !isfinite(y);
            if (isfinite(x))
                d.sum_sq_a += (double)x * x;
            if (a[i * cols + c] == b[i * cols + c])
                continue;
            row_diffs++;
            if (isfinite(x) && isfinite(y) && fabs((double)x - y) > d.max_abs)
                d.max_abs = fabs((double)x - y);
        }
        d.elems += row_diffs;
        d.rows += row_diffs > 0;
    }
    return d;
}


/* ------------------------------------------------------------ a rank's environment */

/* NCCL's own calls (dlopen'ed, as the library loads it), for the ceilings. */
typedef struct {
    char b[128];
} nccl_id;
typedef int (*get_id_fn)(nccl_id *);
typedef int (*init_fn)(void **, int, nccl_id, int);
typedef int (*sendrecv_fn)(void *, size_t, int, int, void *, void *);
typedef int (*group_fn)(void);

typedef struct options {
    int M, quantize, iters, ll, layer; /* layer: bit 0 FP8, bit 1 bf16 */
    int y_bf16;                        /* dispatch mode: combine's y in bf16, not f32 */
} options;

typedef struct rank_env {
    int r;
    const options *o;
    const side_channel *sc;
    moefuse_context *ctx;
    moefuse_ep_group *g;
    nccl_id raw; /* for the bench's own communicator (the ceilings), made once and kept */
    void *comm;
    get_id_fn get_id;
    init_fn init;
    sendrecv_fn send, recv;
    group_fn start, end;
} rank_env;

#define FAIL(e, what)                                                                            \
    do {                                                                                         \
        fprintf(stderr, "rank %d: %s: %s\n", (e)->r, what, moefuse_last_error((e)->ctx));        \
        return 1;                                                                                \
    } while (0)

/* NCCL alone, the ceiling: the same rows out (row_out bytes each) and back (row_back), between
   the same ranks, grouped send/recv on the context's stream; median of iters. */
static int time_nccl(rank_env *e, const size_t *rows_to, const size_t *rows_from, size_t row_out,
                     size_t row_back, double *med)
{
    void *stream = NULL;
    if (!e->comm && e->init(&e->comm, W, e->raw, e->r) != 0) {
        e->comm = NULL;
        fprintf(stderr, "rank %d: ncclCommInitRank failed\n", e->r);
        return 1;
    }
    void *comm = e->comm;
    moefuse_get_stream(e->ctx, &stream);
    size_t most = 0;
    for (int p = 0; p < W; p++)
        most += rows_to[p] > rows_from[p] ? rows_to[p] : rows_from[p];
    const size_t bytes = most * (row_out > row_back ? row_out : row_back);
    void *sbuf = put(e->ctx, NULL, bytes), *rbuf = put(e->ctx, NULL, bytes);
    double *t = xmalloc(sizeof(double) * (size_t)e->o->iters);
    int rc = 0;
    for (int it = -2; rc == 0 && it < e->o->iters; it++) {
        if (side_barrier(e->sc) != 0) {
            rc = 1;
            break;
        }
        const double t0 = now();
        for (int pass = 0; pass < 2; pass++) {
            const size_t row = pass == 0 ? row_out : row_back;
            size_t so = 0, ro = 0;
            int bad = e->start();
            for (int p = 0; p < W; p++) { /* out: my rows; back: the rows I received */
                const size_t ns = pass == 0 ? rows_to[p] : rows_from[p];
                const size_t nr = pass == 0 ? rows_from[p] : rows_to[p];
                bad |= e->send((char *)sbuf + so, ns * row, 1, p, comm, stream);
                bad |= e->recv((char *)rbuf + ro, nr * row, 1, p, comm, stream);
                so += ns * row;
                ro += nr * row;
            }
            bad |= e->end();
            if (bad) {
                fprintf(stderr, "rank %d: NCCL send/recv failed\n", e->r);
                rc = 1;
            }
        }
        moefuse_synchronize(e->ctx);
        if (it >= 0)
            t[it] = now() - t0;
    }
    *med = median(t, e->o->iters);
    free(t);
    moefuse_buffer_free(e->ctx, sbuf);
    moefuse_buffer_free(e->ctx, rbuf);
    return rc;
}


/* Runs fn(r, channel, arg) in W forked processes, one a rank, joined by the side channel; the
   parent touches no GPU. 0 when every rank returned 0; 77 when ranks returned 77 (no GPU or
   NCCL: they said why) and none failed; else 1. */
typedef int (*rank_fn)(int r, const side_channel *sc, const void *arg);

static int run_ranks(rank_fn fn, const void *arg)
{
    int pp[W][W][2]; /* pp[from][to]: from's writes to `to` */
    for (int a = 0; a < W; a++)
        for (int b = 0; b < W; b++)
            if (a != b && pipe(pp[a][b]) != 0) {
                perror("pipe");
                return 1;
            }
    const pid_t parent = getpid();
    pid_t pid[W];
    for (int r = 0; r < W; r++) {
        pid[r] = fork();
        if (pid[r] < 0) {
            perror("fork");
            return 1;
        }
        if (pid[r] == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL); /* a killed parent (timeout) takes the ranks */
            if (getppid() != parent)
                _exit(1);
            signal(SIGPIPE, SIG_IGN); /* a gone rank: EPIPE, not death */
            side_channel sc;
            sc.r = r;
            for (int a = 0; a < W; a++)
                for (int b = 0; b < W; b++) {
                    if (a == b)
                        continue;
                    if (a == r)
                        sc.wr[b] = pp[a][b][1];
                    else
                        close(pp[a][b][1]);
                    if (b == r)
                        sc.rd[a] = pp[a][b][0];
                    else
                        close(pp[a][b][0]);
                }
            sc.rd[r] = sc.wr[r] = -1;
            const int code = fn(r, &sc, arg);
            fflush(NULL); /* _exit flushes no stdio buffer */
            _exit(code);
        }
    }
    for (int a = 0; a < W; a++)
        for (int b = 0; b < W; b++)
            if (a != b) {
                close(pp[a][b][0]);
                close(pp[a][b][1]);
            }
    /* wait; once a rank has stopped with a non-zero status, the others get 30 s to finish
       before they are killed (one left inside an NCCL call would wait for ever) */
    int left = W, failed = 0, skipped = 0, done[W] = {0}, killed[W] = {0};
    double failed_at = 0; /* when a rank first exited with a non-zero status */
    while (left > 0) {
        int st = 0;
        const pid_t p = waitpid(-1, &st, failed_at > 0 ? WNOHANG : 0);
        if (p < 0 && errno == EINTR)
            continue;
        if (p < 0)
            break;
        if (p == 0) {
            if (now() - failed_at > 30.0)
                for (int r = 0; r < W; r++)
                    if (!done[r] && !killed[r]) {
                        fprintf(stderr, "ep_bench: rank %d still running 30 s after another "
                                        "rank stopped: killed\n", r);
                        kill(pid[r], SIGKILL);
                        killed[r] = 1;
                    }
            usleep(100000);
            continue;
        }
        for (int r = 0; r < W; r++)
            if (pid[r] == p) {
                done[r] = 1;
                left--;
                const int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
                skipped |= code == 77;
                if (code != 0 && failed_at == 0)
                    failed_at = now();
                if (code != 0 && code != 77) {
                    failed = 1;
                    fprintf(stderr, "ep_bench: rank %d: exit %d (signal %d)\n", r, code,
                            WIFSIGNALED(st) ? WTERMSIG(st) : 0);
                }
            }
    }
    if (!failed && skipped)
        fprintf(stderr, "ep_bench: needs %d CUDA devices and NCCL (the ranks said why above); "
                        "nothing measured\n", W);
    return failed ? 1 : skipped ? 77 : 0;
}

#endif /* EP_BENCH_UTIL_H */
