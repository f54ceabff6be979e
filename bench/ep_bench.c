/*
 * Expert parallelism over NCCL, timed and checked: one process per GPU (fork), W = 2 ranks,
 * DeepSeek-V3's shapes (K = 7168, k = 8 distinct experts a token, uniform over 256 experts,
 * 128 a rank), M tokens a rank. Every rank draws every rank's tokens and routing from fixed
 * seeds (bench/ep_bench_util.h), so each knows what the others send.
 *
 *   gcc -std=c11 -O2 -Wall -Wextra -Iinclude -I/usr/local/cuda/include -o ep_bench \
 *      bench/ep_bench.c -Lbuild/src -lmoefuse -L/usr/local/cuda/lib64 -lcudart -ldl -lm
 *   NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=build/src ./ep_bench [M] [quantize 0|1] [iterations]
 *                                                         [--ll] [--layer[=fp8|bf16]]
 *
 * Default (dispatch mode, M = 4096, quantize 0, 10 iterations): moefuse_ep_dispatch then
 * moefuse_ep_combine (bf16 rows, or FP8 rows quantized on the way; f32 outputs back, bf16 out),
 * timed on the host around a synchronize after a barrier of the ranks, median of N; beside it,
 * in the same processes, NCCL's grouped send/recv moving the same bytes between the same ranks
 * (the ceiling of the bar: <= 1.3x at 4096 tokens a rank). Then each call apart, each ended by
 * a synchronize, beside NCCL moving its rows alone (the "apart" line: where the time goes).
 *  --y=bf16 combine's y (the experts' outputs) in bf16 rather than f32, as a masked GEMM
 *           with bf16 outputs hands it over (dispatch mode; the values are the same, rounded)
 *  --ll     then the low-latency mode (opt.max_tokens = M, Tmax = W M): its rows, counts and
 *           combine checked against the normal mode's, timed eagerly and as one CUDA graph
 *           captured on the context's stream (decode bar: <= 80 us at M = 128). A library
 *           without it (MOEFUSE_ERR_UNSUPPORTED) is reported and skipped.
 *  --layer  instead, the whole layer (I = 2048) over global weights of all 256 experts that
 *           every rank builds alike: moefuse_ep_moe_forward[_fp8] on the rank's M tokens against
 *           moefuse_moe_forward[_fp8] on one GPU over all W M tokens (each rank on its own GPU,
 *           comparing its rows byte for byte), then both timed (bar: one GPU's time / EP's time
 *           >= 1.6 for FP8 at 4096 tokens a rank; bf16 for information). quantize is ignored;
 *           =fp8 or =bf16 runs one of the two (FP8 weights take 11.3 GB a GPU, bf16 22.5 GB).
 * Lines starting "result:" (rank 0, over both ranks) are the summary; "rank N:" the detail.
 * Exit status 0, 1 on a failure, 77 when there are not W GPUs or no NCCL.
 */
#define _GNU_SOURCE
#include "ep_bench_util.h"

#include <cuda_runtime.h>

#include <dlfcn.h>

/* ------------------------------------------------------------ dispatch mode */

/* The outputs of a dispatch and combine: recv_x [E_RANK, tmax, K], recv_scales (FP8), counts,
   y [E_RANK, tmax, K] f32 (bf16 with --y=bf16), out [M, K] bf16. */
typedef struct disp_bufs {
    int tmax;
    void *recv, *scales, *counts, *y, *out;
    moefuse_tensor rx, rs, rc, ty, tout;
} disp_bufs;

static void disp_alloc(const rank_env *e, disp_bufs *b, int tmax)
{
    const int q = e->o->quantize;
    const size_t rows = (size_t)E_RANK * (size_t)tmax;
    memset(b, 0, sizeof *b);
    b->tmax = tmax;
    b->recv = put(e->ctx, NULL, (q ? 1u : 2u) * rows * K);
    b->scales = q ? put(e->ctx, NULL, 4u * rows * (K / 128)) : NULL;
    b->counts = put(e->ctx, NULL, 4u * E_RANK);
    b->y = put(e->ctx, NULL, 4u * rows * K);
    b->out = put(e->ctx, NULL, 2u * (size_t)e->o->M * K);
    b->rx = dense(b->recv, q ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16, 3, E_RANK, tmax, K);
    b->rs = q ? dense(b->scales, MOEFUSE_F32, 3, E_RANK, tmax, K / 128)
              : dense(NULL, MOEFUSE_F32, 3, 0, 0, 0);
    b->rc = dense(b->counts, MOEFUSE_I32, 1, E_RANK, 0, 0);
    b->ty = dense(b->y, e->o->y_bf16 ? MOEFUSE_BF16 : MOEFUSE_F32, 3, E_RANK, tmax, K);
    b->tout = dense(b->out, MOEFUSE_BF16, 2, e->o->M, K, 0);
}

static void disp_free(const rank_env *e, disp_bufs *b)
{
    void *all[] = {b->recv, b->scales, b->counts, b->y, b->out};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i])
            moefuse_buffer_free(e->ctx, all[i]);
    memset(b, 0, sizeof *b);
}

/* One dispatch and combine; the status of the first call that failed. */
static moefuse_status disp_once(const rank_env *e, const moefuse_tensor *x,
                                const moefuse_routing *rt, disp_bufs *b,
                                const moefuse_ep_dispatch_options *opt)
{
    moefuse_ep_handle *h = NULL;
    moefuse_status st = moefuse_ep_dispatch(e->ctx, e->g, x, NULL, rt, &b->rx, &b->rs, &b->rc,
                                            opt, &h);
    if (st == MOEFUSE_OK)
        st = moefuse_ep_combine(e->ctx, e->g, h, &b->ty, &b->tout);
    moefuse_ep_handle_destroy(h);
    return st;
}

/* iters timed dispatch + combine (after 2 untimed), each started after a barrier of the ranks
   and ended by a synchronize; the median. */
static int time_disp(const rank_env *e, const moefuse_tensor *x, const moefuse_routing *rt,
                     disp_bufs *b, const moefuse_ep_dispatch_options *opt, double *med)
{
    const int iters = e->o->iters;
    double *t = xmalloc(sizeof(double) * (size_t)iters);
    for (int it = -2; it < iters; it++) {
        if (side_barrier(e->sc) != 0)
            return 1;
        const double t0 = now();
        if (disp_once(e, x, rt, b, opt) != MOEFUSE_OK)
            FAIL(e, opt->mode == MOEFUSE_EP_LOW_LATENCY ? "low-latency dispatch+combine"
                                                        : "dispatch+combine");
        moefuse_synchronize(e->ctx);
        if (it >= 0)
            t[it] = now() - t0;
    }
    *med = median(t, iters);
    free(t);
    return 0;
}

/* The two calls apart: iters dispatches and combines (after 2 untimed), each call ended by a
   synchronize, the ranks started together; the medians of each. */
static int time_disp_apart(const rank_env *e, const moefuse_tensor *x, const moefuse_routing *rt,
                           disp_bufs *b, const moefuse_ep_dispatch_options *opt, double *t_disp,
                           double *t_comb)
{
    const int iters = e->o->iters;
    double *t = xmalloc(sizeof(double) * 2 * (size_t)iters);
    for (int it = -2; it < iters; it++) {
        if (side_barrier(e->sc) != 0)
            return 1;
        moefuse_ep_handle *h = NULL;
        const double t0 = now();
        moefuse_status st = moefuse_ep_dispatch(e->ctx, e->g, x, NULL, rt, &b->rx, &b->rs,
                                                &b->rc, opt, &h);
        moefuse_synchronize(e->ctx);
        const double t1 = now();
        if (st == MOEFUSE_OK)
            st = moefuse_ep_combine(e->ctx, e->g, h, &b->ty, &b->tout);
        moefuse_synchronize(e->ctx);
        const double t2 = now();
        moefuse_ep_handle_destroy(h);
        if (st != MOEFUSE_OK)
            FAIL(e, "dispatch, combine");
        if (it >= 0) {
            t[it] = t1 - t0;
            t[iters + it] = t2 - t1;
        }
    }
    *t_disp = median(t, iters);
    *t_comb = median(t + iters, iters);
    free(t);
    return 0;
}

/* y's rows t < count of every local expert: the same values in both modes' layouts. */
static void fill_y(const rank_env *e, disp_bufs *b, const int32_t *cnt)
{
    int most = 0;
    for (int x = 0; x < E_RANK; x++)
        most = cnt[x] > most ? cnt[x] : most;
    most = most < b->tmax ? most : b->tmax;
    const size_t es = e->o->y_bf16 ? 2u : 4u;
    float *y = xmalloc(4u * (size_t)most * K);
    uint16_t *yh = (uint16_t *)y; /* bf16: the same values truncated, in place */
    for (int x = 0; x < E_RANK; x++) {
        const int n = cnt[x] < b->tmax ? cnt[x] : b->tmax;
        for (int t = 0; t < n; t++)
            for (int c = 0; c < K; c++) {
                const float v = (float)((e->r * 131 + x * 31 + t * 7 + c) % 97) / 97.0f - 0.5f;
                uint32_t bits;
                memcpy(&bits, &v, 4);
                if (es == 2)
                    yh[(size_t)t * K + c] = (uint16_t)(bits >> 16);
                else
                    y[(size_t)t * K + c] = v;
            }
        if (n > 0 && moefuse_buffer_write(e->ctx, b->y, es * (size_t)x * b->tmax * K, y,
                                          es * (size_t)n * K) != MOEFUSE_OK) {
            fprintf(stderr, "rank %d: y: %s\n", e->r, moefuse_last_error(e->ctx));
            fflush(NULL);
            _exit(1);
        }
    }
    free(y);
}

/* What a dispatch and combine wrote, on the host: counts, every expert's rows t < count (codes
   or values, then scales) back to back, and out. */
typedef struct snapshot {
    int32_t cnt[E_RANK];
    size_t rows;
    unsigned char *x;
    float *s;
    uint16_t *out;
} snapshot;

static void take_snapshot(const rank_env *e, const disp_bufs *b, snapshot *s)
{
    const int q = e->o->quantize;
    const size_t rb = (q ? 1u : 2u) * K, sb = 4u * (K / 128);
    moefuse_buffer_read(e->ctx, b->counts, 0, s->cnt, sizeof s->cnt);
    s->rows = 0;
    for (int x = 0; x < E_RANK; x++)
        s->rows += (size_t)(s->cnt[x] < 0 ? 0 : s->cnt[x] < b->tmax ? s->cnt[x] : b->tmax);
    s->x = xmalloc(rb * s->rows);
    s->s = q ? xmalloc(sb * s->rows) : NULL;
    s->out = xmalloc(2u * (size_t)e->o->M * K);
    size_t at = 0;
    for (int x = 0; x < E_RANK; x++) {
        const size_t n = (size_t)(s->cnt[x] < 0 ? 0 : s->cnt[x] < b->tmax ? s->cnt[x] : b->tmax);
        if (n == 0)
            continue;
        moefuse_buffer_read(e->ctx, b->recv, rb * (size_t)x * b->tmax, s->x + rb * at, rb * n);
        if (q)
            moefuse_buffer_read(e->ctx, b->scales, sb * (size_t)x * b->tmax,
                                (char *)s->s + sb * at, sb * n);
        at += n;
    }
    moefuse_buffer_read(e->ctx, b->out, 0, s->out, 2u * (size_t)e->o->M * K);
}

static void free_snapshot(snapshot *s)
{
    free(s->x);
    free(s->s);
    free(s->out);
    memset(s, 0, sizeof *s);
}

/* The low-latency mode's graph; defined below. */
static int ll_graph(const rank_env *e, const moefuse_tensor *x, const moefuse_routing *rt,
                    disp_bufs *b, const moefuse_ep_dispatch_options *opt, double *t_rep,
                    double *t_b2b);

/* The low-latency mode: a first call (MOEFUSE_ERR_UNSUPPORTED: said, and skipped), a check
   against the normal mode's rows and out (ref), then times: eager, a captured graph replayed
   (each replay synchronized, and back to back), and NCCL moving the bytes of its fixed blocks
   (M rows of row_out bytes and their ids and weights to every rank, M f32 rows back). t_nccl:
   NCCL moving the normal mode's bytes. */
static int bench_ll(rank_env *e, const moefuse_tensor *x, const moefuse_routing *rt,
                    const snapshot *ref, double t_nccl, size_t row_out)
{
    const int r = e->r, M = e->o->M, q = e->o->quantize;
    disp_bufs b;
    disp_alloc(e, &b, W * M);
    moefuse_ep_dispatch_options o;
    memset(&o, 0, sizeof o);
    o.mode = MOEFUSE_EP_LOW_LATENCY;
    o.quantize = q;
    o.max_tokens = M;
    const moefuse_status st = disp_once(e, x, rt, &b, &o);
    if (st != MOEFUSE_OK)
        printf("rank %d: M=%d low-latency dispatch+combine: %s: %s%s\n", r, M,
               moefuse_status_name(st), moefuse_last_error(e->ctx),
               st == MOEFUSE_ERR_UNSUPPORTED ? " (not built yet): skipped" : "");
    if (!side_agree(e->sc, st == MOEFUSE_OK)) {
        if (r == 0)
            printf("result: M=%d low-latency: not measured (%s on a rank)\n", M,
                   st == MOEFUSE_OK ? "a failure" : moefuse_status_name(st));
        disp_free(e, &b);
        return st == MOEFUSE_OK || st == MOEFUSE_ERR_UNSUPPORTED ? 0 : 1;
    }
    /* the check: the same y values at the same places as the normal mode's */
    snapshot ll;
    memset(&ll, 0, sizeof ll);
    moefuse_buffer_read(e->ctx, b.counts, 0, ll.cnt, sizeof ll.cnt);
    fill_y(e, &b, ll.cnt);
    if (disp_once(e, x, rt, &b, &o) != MOEFUSE_OK)
        FAIL(e, "low-latency dispatch+combine");
    take_snapshot(e, &b, &ll);
    const int same_counts = memcmp(ll.cnt, ref->cnt, sizeof ll.cnt) == 0;
    const int same_rows = same_counts && memcmp(ll.x, ref->x, (q ? 1u : 2u) * K * ll.rows) == 0;
    const int same_scales =
        same_counts && (!q || memcmp(ll.s, ref->s, 4u * (K / 128) * ll.rows) == 0);
    const bf16_diff d = compare_bf16(ll.out, ref->out, (size_t)M, K);
    printf("rank %d: M=%d low-latency vs normal mode: counts %s, rows %s, scales %s; combine's "
           "bf16 out: %zu of %zu elements differ (%zu rows), max |diff| %.3g, non-finite %zu "
           "(LL adds a token's f32 partial sums by rank: some last-bit differences expected)\n",
           r, M, same_counts ? "equal" : "DIFFER", same_rows ? "equal" : "DIFFER",
           !q ? "n/a" : same_scales ? "equal" : "DIFFER", d.elems, (size_t)M * K, d.rows,
           d.max_abs, d.nonfinite_a);
    free_snapshot(&ll);
    const int correct =
        side_agree(e->sc, same_counts && same_rows && same_scales && d.nonfinite_a == 0);
    double t_eager = 0, t_rep = 0, t_b2b = 0, t_blocks = 0;
    if (time_disp(e, x, rt, &b, &o, &t_eager) != 0)
        return 1;
    const int graph = ll_graph(e, x, rt, &b, &o, &t_rep, &t_b2b);
    if (graph < 0)
        return 1;
    size_t rows_ll[W]; /* its blocks: M rows to every rank, this one too */
    for (int p = 0; p < W; p++)
        rows_ll[p] = (size_t)M;
    if (time_nccl(e, rows_ll, rows_ll, row_out + 4 + 8 * KTOP, 4u * K, &t_blocks) != 0)
        return 1;
    printf("rank %d: M=%d %s low-latency dispatch+combine: eager %.1f us; graph replay %s%.1f "
           "us, back to back %.1f us a replay; NCCL send/recv of its blocks' bytes %.1f us\n",
           r, M, q ? "FP8" : "bf16", t_eager * 1e6, graph ? "" : "(none) ", t_rep * 1e6,
           t_b2b * 1e6, t_blocks * 1e6);
    t_eager = side_max(e->sc, t_eager);
    t_rep = side_max(e->sc, t_rep);
    t_b2b = side_max(e->sc, t_b2b);
    t_blocks = side_max(e->sc, t_blocks);
    if (r == 0) {
        char bar[96] = "";
        if (M == 128)
            snprintf(bar, sizeof bar, "; decode bar <= 80 us: eager %s, graph %s",
                     t_eager <= 80e-6 ? "met" : "NOT met",
                     !graph ? "n/a" : t_rep <= 80e-6 ? "met" : "NOT met");
        printf("result: M=%d %s low-latency dispatch+combine: eager %.1f us, graph replay %.1f "
               "us, back to back %.1f us (slowest rank); NCCL: its blocks' bytes %.1f us, the "
               "normal mode's bytes %.1f us%s; rows and counts as the normal mode's: %s\n",
               M, q ? "FP8" : "bf16", t_eager * 1e6, graph ? t_rep * 1e6 : NAN,
               graph ? t_b2b * 1e6 : NAN, t_blocks * 1e6, t_nccl * 1e6, bar,
               correct ? "yes" : "NO");
    }
    disp_free(e, &b);
    return 0;
}

/* 1 when the graph was captured and timed on every rank, 0 when a rank could not capture it
   (said why; nothing replayed), -1 on a failure. */
static int ll_graph(const rank_env *e, const moefuse_tensor *x, const moefuse_routing *rt,
                    disp_bufs *b, const moefuse_ep_dispatch_options *opt, double *t_rep,
                    double *t_b2b)
{
    void *sv = NULL;
    char why[512] = "";
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    moefuse_ep_handle *h = NULL;
    cudaError_t ce = cudaSuccess;
    if (moefuse_get_stream(e->ctx, &sv) != MOEFUSE_OK || !sv)
        snprintf(why, sizeof why, "no stream: %s", moefuse_last_error(e->ctx));
    cudaStream_t s = (cudaStream_t)sv;
    if (!why[0] &&
        (ce = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)) != cudaSuccess)
        snprintf(why, sizeof why, "cudaStreamBeginCapture: %s", cudaGetErrorString(ce));
    else if (!why[0]) {
        moefuse_status st = moefuse_ep_dispatch(e->ctx, e->g, x, NULL, rt, &b->rx, &b->rs, &b->rc,
                                                opt, &h);
        if (st == MOEFUSE_OK)
            st = moefuse_ep_combine(e->ctx, e->g, h, &b->ty, &b->tout);
        if (st != MOEFUSE_OK)
            snprintf(why, sizeof why, "captured call: %s: %s", moefuse_status_name(st),
                     moefuse_last_error(e->ctx));
        ce = cudaStreamEndCapture(s, &graph);
        if (!why[0] && ce != cudaSuccess)
            snprintf(why, sizeof why, "cudaStreamEndCapture: %s", cudaGetErrorString(ce));
    }
    if (!why[0] && (ce = cudaGraphInstantiateWithFlags(&exec, graph, 0)) != cudaSuccess)
        snprintf(why, sizeof why, "cudaGraphInstantiate: %s", cudaGetErrorString(ce));
    cudaGetLastError();
    int ok = side_agree(e->sc, !why[0]);
    if (why[0])
        printf("rank %d: M=%d low-latency graph: %s: not timed\n", e->r, e->o->M, why);
    const int iters = e->o->iters;
    double *t = xmalloc(sizeof(double) * (size_t)iters);
    for (int it = -3; ok == 1 && it < iters; it++) { /* each replay synchronized */
        if (side_barrier(e->sc) != 0) {
            ok = -1;
            break;
        }
        const double t0 = now();
        ce = cudaGraphLaunch(exec, s);
        if (ce == cudaSuccess)
            ce = cudaStreamSynchronize(s);
        if (ce != cudaSuccess) {
            fprintf(stderr, "rank %d: graph replay: %s\n", e->r, cudaGetErrorString(ce));
            ok = -1;
        } else if (it >= 0)
            t[it] = now() - t0;
    }
    if (ok == 1) {
        *t_rep = median(t, iters);
        if (side_barrier(e->sc) != 0)
            ok = -1;
        const double t0 = now();
        for (int it = 0; ok == 1 && it < iters; it++)
            if ((ce = cudaGraphLaunch(exec, s)) != cudaSuccess)
                ok = -1;
        if (ok == 1 && (ce = cudaStreamSynchronize(s)) != cudaSuccess)
            ok = -1;
        if (ok != 1)
            fprintf(stderr, "rank %d: graph replay: %s\n", e->r, cudaGetErrorString(ce));
        *t_b2b = (now() - t0) / iters;
    }
    free(t);
    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
    moefuse_ep_handle_destroy(h);
    return ok;
}

static int run_dispatch(rank_env *e)
{
    const int r = e->r, M = e->o->M, q = e->o->quantize;
    uint16_t *x = xmalloc(2u * (size_t)M * K);
    int32_t *ids = xmalloc(4u * (size_t)M * KTOP);
    float *wt = xmalloc(4u * (size_t)M * KTOP);
    size_t rows_from[W] = {0}, rows_to[W] = {0}; /* what each rank sends here; I send there */
    for (int p = 0; p < W; p++) {
        draw_ids(p, M, ids);
        for (int s = 0; s < M * KTOP; s++)
            rows_from[p] += ids[s] / E_RANK == r;
    }
    draw_tokens(r, M, ids, wt, x);
    for (int s = 0; s < M * KTOP; s++)
        rows_to[ids[s] / E_RANK]++;
    void *dx = put(e->ctx, x, 2u * (size_t)M * K);
    void *dids = put(e->ctx, ids, 4u * (size_t)M * KTOP);
    void *dw = put(e->ctx, wt, 4u * (size_t)M * KTOP);
    moefuse_tensor tx = dense(dx, MOEFUSE_BF16, 2, M, K, 0);
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = dense(dids, MOEFUSE_I32, 2, M, KTOP, 0);
    rt.topk_weights = dense(dw, MOEFUSE_F32, 2, M, KTOP, 0);
    moefuse_ep_dispatch_options o;
    memset(&o, 0, sizeof o);
    o.quantize = q;
    disp_bufs nb;
    disp_alloc(e, &nb, 2 * M * KTOP * W / E_ALL + 256);
    double t_ep = 0, t_nc = 0;
    if (time_disp(e, &tx, &rt, &nb, &o, &t_ep) != 0)
        return 1;
    const size_t row_out = q ? K + 4 * (K / 128) : 2u * K, row_back = 4u * K;
    if (time_nccl(e, rows_to, rows_from, row_out, row_back, &t_nc) != 0)
        return 1;
    size_t bytes = 0;
    for (int p = 0; p < W; p++)
        bytes += rows_to[p] * (row_out + row_back);
    printf("rank %d: M=%d %s: dispatch+combine %.3f ms; NCCL send/recv of the same %.1f MB "
           "%.3f ms; ratio %.2f\n",
           r, M, q ? "FP8" : "bf16", t_ep * 1e3, (double)bytes / 1e6, t_nc * 1e3, t_ep / t_nc);
    double t_d = 0, t_c = 0, nc_d = 0, nc_c = 0; /* where the time goes: each call apart */
    if (time_disp_apart(e, &tx, &rt, &nb, &o, &t_d, &t_c) != 0 ||
        time_nccl(e, rows_to, rows_from, row_out, 0, &nc_d) != 0 ||
        time_nccl(e, rows_to, rows_from, 0, row_back, &nc_c) != 0)
        return 1;
    printf("rank %d: M=%d %s apart: dispatch %.3f ms (NCCL its rows out %.3f ms), combine %.3f "
           "ms (NCCL its rows back %.3f ms)\n",
           r, M, q ? "FP8" : "bf16", t_d * 1e3, nc_d * 1e3, t_c * 1e3, nc_c * 1e3);
    const double ep_all = side_max(e->sc, t_ep), nc_all = side_max(e->sc, t_nc);
    if (r == 0)
        printf("result: M=%d %s normal dispatch+combine %.3f ms, NCCL same bytes %.3f ms, ratio "
               "%.2f (slowest rank)%s\n",
               M, q ? "FP8" : "bf16", ep_all * 1e3, nc_all * 1e3, ep_all / nc_all,
               M >= 4096 ? (ep_all / nc_all <= 1.3 ? "; prefill bar <= 1.3: met"
                                                   : "; prefill bar <= 1.3: NOT met")
                         : "");
    int rc = 0;
    if (e->o->ll) { /* the normal mode's rows and out with known y, for the check */
        snapshot ref;
        memset(&ref, 0, sizeof ref);
        moefuse_buffer_read(e->ctx, nb.counts, 0, ref.cnt, sizeof ref.cnt);
        fill_y(e, &nb, ref.cnt);
        if (disp_once(e, &tx, &rt, &nb, &o) != MOEFUSE_OK)
            FAIL(e, "dispatch+combine");
        take_snapshot(e, &nb, &ref);
        disp_free(e, &nb);
        rc = bench_ll(e, &tx, &rt, &ref, nc_all, row_out);
        free_snapshot(&ref);
    } else {
        disp_free(e, &nb);
    }
    moefuse_buffer_free(e->ctx, dx);
    moefuse_buffer_free(e->ctx, dids);
    moefuse_buffer_free(e->ctx, dw);
    free(x);
    free(ids);
    free(wt);
    return rc;
}

/* ------------------------------------------------------------ layer mode */

/* The global weights of all E_ALL experts (every rank builds the same), and the call's
   operands: the EP layer's (this rank's tokens, its experts' slices) and the one-GPU layer's
   (every rank's tokens, rank 0's first, all experts). */
typedef struct layer_args {
    void *w1, *w1s, *w2, *w2s;
    moefuse_tensor x_ep, out_ep, w1_ep, w1s_ep, w2_ep, w2s_ep;
    moefuse_tensor x_1, out_1, w1_1, w1s_1, w2_1, w2s_1;
    moefuse_routing rt_ep, rt_1;
} layer_args;

/* w1 [E_ALL, 2I, K], w2 [E_ALL, K, I], FP8 with scales [E, 2I/128, K/128], [E, K/128, I/128]
   of 2^-5 (0.75 .. 1.25), or bf16: magnitudes about 0.004 .. 0.06, so that a layer's values
   stay near 1. Generated an expert at a time into a pinned buffer; seconds for 11-23 GB. */
static void make_weights(const rank_env *e, int fp8, layer_args *a)
{
    const size_t es = fp8 ? 1 : 2, w1e = es * 2 * INTER * K, w2e = es * (size_t)K * INTER;
    const double t0 = now();
    a->w1 = put(e->ctx, NULL, w1e * E_ALL);
    a->w2 = put(e->ctx, NULL, w2e * E_ALL);
    void *st = NULL;
    const int pinned = cudaMallocHost(&st, w1e) == cudaSuccess;
    if (!pinned) {
        cudaGetLastError();
        st = xmalloc(w1e);
    }
    for (int x = 0; x < E_ALL; x++)
        for (int m = 1; m <= 2; m++) {
            const size_t n = m == 1 ? w1e : w2e;
            fill_words(st, n, ((uint64_t)fp8 << 40) + ((uint64_t)m << 32) + (uint64_t)x,
                       fp8 ? 0 : 1, 119);
            if (moefuse_buffer_write(e->ctx, m == 1 ? a->w1 : a->w2, n * (size_t)x, st, n) !=
                MOEFUSE_OK) {
                fprintf(stderr, "rank %d: weights: %s\n", e->r, moefuse_last_error(e->ctx));
                fflush(NULL);
                _exit(1);
            }
        }
    if (pinned)
        cudaFreeHost(st);
    else
        free(st);
    a->w1s = a->w2s = NULL;
    const size_t n1 = (size_t)E_ALL * (2 * INTER / 128) * (K / 128),
                 n2 = (size_t)E_ALL * (K / 128) * (INTER / 128);
    if (fp8) {
        float *s = xmalloc(4u * (n1 > n2 ? n1 : n2));
        uint64_t seed = mix64(0x5CA1E) | 1u;
        for (size_t i = 0; i < n1; i++)
            s[i] = 0.03125f * (0.75f + (float)(rng_next(&seed) % 256u) / 512.0f);
        a->w1s = put(e->ctx, s, 4u * n1);
        for (size_t i = 0; i < n2; i++)
            s[i] = 0.03125f * (0.75f + (float)(rng_next(&seed) % 256u) / 512.0f);
        a->w2s = put(e->ctx, s, 4u * n2);
        free(s);
    }
    const moefuse_dtype wd = fp8 ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16;
    const size_t r0 = (size_t)e->r * E_RANK; /* this rank's first expert */
    a->w1_1 = dense(a->w1, wd, 3, E_ALL, 2 * INTER, K);
    a->w2_1 = dense(a->w2, wd, 3, E_ALL, K, INTER);
    a->w1_ep = dense_at(a->w1, r0 * w1e, wd, 3, E_RANK, 2 * INTER, K);
    a->w2_ep = dense_at(a->w2, r0 * w2e, wd, 3, E_RANK, K, INTER);
    if (fp8) {
        a->w1s_1 = dense(a->w1s, MOEFUSE_F32, 3, E_ALL, 2 * INTER / 128, K / 128);
        a->w2s_1 = dense(a->w2s, MOEFUSE_F32, 3, E_ALL, K / 128, INTER / 128);
        a->w1s_ep = dense_at(a->w1s, r0 * 4u * n1 / E_ALL, MOEFUSE_F32, 3, E_RANK,
                             2 * INTER / 128, K / 128);
        a->w2s_ep = dense_at(a->w2s, r0 * 4u * n2 / E_ALL, MOEFUSE_F32, 3, E_RANK, K / 128,
                             INTER / 128);
    }
    moefuse_synchronize(e->ctx);
    printf("rank %d: %s weights of %d experts: %.1f GB built in %.1f s\n", e->r,
           fp8 ? "FP8" : "bf16", E_ALL, (double)(w1e + w2e) * E_ALL / 1e9, now() - t0);
}

static void free_weights(const rank_env *e, layer_args *a)
{
    void *all[] = {a->w1, a->w1s, a->w2, a->w2s};
    for (size_t i = 0; i < 4; i++)
        if (all[i])
            moefuse_buffer_free(e->ctx, all[i]);
    a->w1 = a->w1s = a->w2 = a->w2s = NULL;
}

/* The EP layer (ep) or the one-GPU layer, FP8 or bf16, with default options. */
static moefuse_status layer_call(const rank_env *e, const layer_args *a, int fp8, int ep)
{
    moefuse_fp8_moe_options f;
    moefuse_moe_options b;
    memset(&f, 0, sizeof f);
    memset(&b, 0, sizeof b);
    if (fp8 && ep)
        return moefuse_ep_moe_forward_fp8(e->ctx, e->g, &a->x_ep, NULL, &a->w1_ep, &a->w1s_ep,
                                          &a->w2_ep, &a->w2s_ep, NULL, NULL, &a->rt_ep,
                                          &a->out_ep, &f);
    if (fp8)
        return moefuse_moe_forward_fp8(e->ctx, &a->x_1, NULL, &a->w1_1, &a->w1s_1, &a->w2_1,
                                       &a->w2s_1, NULL, NULL, &a->rt_1, &a->out_1, &f);
    if (ep)
        return moefuse_ep_moe_forward(e->ctx, e->g, &a->x_ep, &a->w1_ep, &a->w2_ep, NULL, NULL,
                                      &a->rt_ep, &a->out_ep, &b);
    return moefuse_moe_forward(e->ctx, &a->x_1, &a->w1_1, &a->w2_1, NULL, NULL, &a->rt_1,
                               &a->out_1, &b);
}

static int time_layer(const rank_env *e, const layer_args *a, int fp8, int ep, double *med)
{
    const int iters = e->o->iters;
    double *t = xmalloc(sizeof(double) * (size_t)iters);
    for (int it = -2; it < iters; it++) {
        if (side_barrier(e->sc) != 0)
            return 1;
        const double t0 = now();
        if (layer_call(e, a, fp8, ep) != MOEFUSE_OK)
            FAIL(e, ep ? "EP layer" : "one-GPU layer");
        moefuse_synchronize(e->ctx);
        if (it >= 0)
            t[it] = now() - t0;
    }
    *med = median(t, iters);
    free(t);
    return 0;
}

/* EP's out [M, K] and the one-GPU out's rows of this rank, read back. */
static void read_outs(const rank_env *e, const layer_args *a, uint16_t *ep, uint16_t *one)
{
    const size_t bytes = 2u * (size_t)e->o->M * K;
    moefuse_buffer_read(e->ctx, a->out_ep.data, 0, ep, bytes);
    moefuse_buffer_read(e->ctx, a->out_1.data, bytes * (size_t)e->r, one, bytes);
}

static int layer_mode(rank_env *e, layer_args *a, int fp8, uint16_t *h_ep, uint16_t *h_1,
                      uint16_t *h_ep2, uint16_t *h_12)
{
    const int r = e->r, M = e->o->M;
    const char *name = fp8 ? "FP8" : "bf16";
    make_weights(e, fp8, a);
    moefuse_status st = layer_call(e, a, fp8, 1);
    if (st != MOEFUSE_OK)
        FAIL(e, fp8 ? "moefuse_ep_moe_forward_fp8" : "moefuse_ep_moe_forward");
    if ((st = layer_call(e, a, fp8, 0)) != MOEFUSE_OK)
        FAIL(e, fp8 ? "moefuse_moe_forward_fp8" : "moefuse_moe_forward");
    moefuse_synchronize(e->ctx);
    read_outs(e, a, h_ep, h_1);
    const bf16_diff d = compare_bf16(h_ep, h_1, (size_t)M, K);
    printf("rank %d: layer %s: EP out vs one-GPU out (rows %d..%d of %d): %zu of %zu elements "
           "differ (%zu of %d rows), max |diff| %.3g; EP out rms %.3g, non-finite %zu (one GPU: "
           "%zu)\n",
           r, name, r * M, (r + 1) * M - 1, W * M, d.elems, (size_t)M * K, d.rows, M, d.max_abs,
           sqrt(d.sum_sq_a / ((double)M * K)), d.nonfinite_a, d.nonfinite_b);
    if (!side_agree(e->sc, 1))
        return 1;
    double t_ep = 0, t_1 = 0;
    if (time_layer(e, a, fp8, 1, &t_ep) != 0 || time_layer(e, a, fp8, 0, &t_1) != 0)
        return 1;
    read_outs(e, a, h_ep2, h_12);
    const size_t bytes = 2u * (size_t)M * K;
    const int rep_ep = memcmp(h_ep, h_ep2, bytes) == 0, rep_1 = memcmp(h_1, h_12, bytes) == 0;
    printf("rank %d: layer %s time: EP %.3f ms (%d tokens here); one GPU %.3f ms (%d tokens); "
           "the outs after the timed runs: EP %s, one GPU %s\n",
           r, name, t_ep * 1e3, M, t_1 * 1e3, W * M, rep_ep ? "same bits" : "CHANGED",
           rep_1 ? "same bits" : "CHANGED");
    /* over the ranks: differing elements, largest diff, slowest EP rank, rank 0's one GPU,
       non-finite elements of either out, EP's sum of squares */
    double mine[6] = {(double)d.elems, d.max_abs, t_ep, t_1,
                      (double)(d.nonfinite_a + d.nonfinite_b), d.sum_sq_a},
           all[W][6];
    if (side_allgather(e->sc, mine, all, sizeof mine) != 0)
        return 1;
    if (r == 0) {
        double diffs = 0, maxd = 0, tep = 0, bad = 0, sq = 0;
        for (int p = 0; p < W; p++) {
            diffs += all[p][0];
            maxd = all[p][1] > maxd ? all[p][1] : maxd;
            tep = all[p][2] > tep ? all[p][2] : tep;
            bad += all[p][4];
            sq += all[p][5];
        }
        const double t1 = all[0][3], ratio = t1 / tep;
        printf("result: layer %s bitwise EP=%d vs one GPU: %s (%.0f of %zu elements differ, max "
               "|diff| %.3g; non-finite %.0f; out rms %.3g)\n",
               name, W, diffs == 0 && bad == 0 ? "EQUAL" : "NOT equal", diffs,
               (size_t)W * M * K, maxd, bad, sqrt(sq / ((double)W * M * K)));
        printf("result: layer %s time: EP=%d %.3f ms for %d tokens (%d a rank) = %.0f tokens/s; "
               "one GPU %.3f ms = %.0f tokens/s; one GPU / EP = %.2f%s\n",
               name, W, tep * 1e3, W * M, M, W * M / tep, t1 * 1e3, W * M / t1, ratio,
               !fp8 ? " (information)" : ratio >= 1.6 ? " (bar >= 1.6: met)"
                                                      : " (bar >= 1.6: NOT met)");
    }
    free_weights(e, a);
    return 0;
}

static int run_layer(rank_env *e)
{
    const int r = e->r, M = e->o->M, Mg = W * M;
    uint16_t *x = xmalloc(2u * (size_t)Mg * K);
    int32_t *ids = xmalloc(4u * (size_t)Mg * KTOP);
    float *wt = xmalloc(4u * (size_t)Mg * KTOP);
    for (int p = 0; p < W; p++)
        draw_tokens(p, M, ids + (size_t)p * M * KTOP, wt + (size_t)p * M * KTOP,
                    x + (size_t)p * M * K);
    layer_args a;
    memset(&a, 0, sizeof a);
    void *dx = put(e->ctx, x, 2u * (size_t)Mg * K);
    void *dids = put(e->ctx, ids, 4u * (size_t)Mg * KTOP);
    void *dw = put(e->ctx, wt, 4u * (size_t)Mg * KTOP);
    void *dout_ep = put(e->ctx, NULL, 2u * (size_t)M * K);
    void *dout_1 = put(e->ctx, NULL, 2u * (size_t)Mg * K);
    a.x_1 = dense(dx, MOEFUSE_BF16, 2, Mg, K, 0);
    a.out_1 = dense(dout_1, MOEFUSE_BF16, 2, Mg, K, 0);
    a.rt_1.topk_ids = dense(dids, MOEFUSE_I32, 2, Mg, KTOP, 0);
    a.rt_1.topk_weights = dense(dw, MOEFUSE_F32, 2, Mg, KTOP, 0);
    a.x_ep = dense_at(dx, 2u * (size_t)r * M * K, MOEFUSE_BF16, 2, M, K, 0);
    a.out_ep = dense(dout_ep, MOEFUSE_BF16, 2, M, K, 0);
    a.rt_ep.topk_ids = dense_at(dids, 4u * (size_t)r * M * KTOP, MOEFUSE_I32, 2, M, KTOP, 0);
    a.rt_ep.topk_weights = dense_at(dw, 4u * (size_t)r * M * KTOP, MOEFUSE_F32, 2, M, KTOP, 0);
    uint16_t *h[4];
    for (int i = 0; i < 4; i++)
        h[i] = xmalloc(2u * (size_t)M * K);
    int rc = 0;
    for (int fp8 = 1; rc == 0 && fp8 >= 0; fp8--)
        if (e->o->layer & (fp8 ? 1 : 2))
            rc = layer_mode(e, &a, fp8, h[0], h[1], h[2], h[3]);
    for (int i = 0; i < 4; i++)
        free(h[i]);
    free(x);
    free(ids);
    free(wt);
    return rc;
}

/* ------------------------------------------------------------ the ranks */

static int rank_main(int r, const side_channel *sc, const void *arg)
{
    const options *o = arg;
    rank_env env;
    memset(&env, 0, sizeof env);
    env.r = r;
    env.o = o;
    env.sc = sc;
    char dev[16], why[512] = "";
    snprintf(dev, sizeof dev, "%d", r);
    if (moefuse_context_create_on(&env.ctx, "cuda", dev) != MOEFUSE_OK)
        snprintf(why, sizeof why, "no CUDA context on device %d: %s", r, moefuse_last_error(NULL));
    else if (cudaSetDevice(r) != cudaSuccess) /* the bench's own CUDA calls (NCCL, pinned) */
        snprintf(why, sizeof why, "cudaSetDevice(%d) failed", r);
    const char *lib = getenv("MOEFUSE_NCCL_LIBRARY") ? getenv("MOEFUSE_NCCL_LIBRARY")
                                                     : "libnccl.so.2";
    void *nccl = why[0] ? NULL : dlopen(lib, RTLD_NOW);
    if (!why[0] && !nccl)
        snprintf(why, sizeof why, "no NCCL: %s", dlerror());
    if (nccl) {
        env.get_id = (get_id_fn)dlsym(nccl, "ncclGetUniqueId");
        env.init = (init_fn)dlsym(nccl, "ncclCommInitRank");
        env.send = (sendrecv_fn)dlsym(nccl, "ncclSend");
        env.recv = (sendrecv_fn)dlsym(nccl, "ncclRecv");
        env.start = (group_fn)dlsym(nccl, "ncclGroupStart");
        env.end = (group_fn)dlsym(nccl, "ncclGroupEnd");
        if (!env.get_id || !env.init || !env.send || !env.recv || !env.start || !env.end)
            snprintf(why, sizeof why, "%s lacks the NCCL functions", lib);
    }
    struct hello {
        int ok;
        moefuse_ep_unique_id id;
        nccl_id raw;
    } mine, all[W];
    memset(&mine, 0, sizeof mine);
    if (!why[0] && r == 0 && moefuse_ep_unique_id_create(env.ctx, &mine.id) != MOEFUSE_OK)
        snprintf(why, sizeof why, "unique id: %s", moefuse_last_error(env.ctx));
    if (!why[0] && r == 0 && env.get_id(&mine.raw) != 0)
        snprintf(why, sizeof why, "ncclGetUniqueId failed");
    mine.ok = !why[0];
    if (why[0])
        fprintf(stderr, "rank %d: %s\n", r, why);
    int ok = side_allgather(sc, &mine, all, sizeof mine) == 0;
    for (int p = 0; ok && p < W; p++)
        ok = all[p].ok;
    if (!ok) {
        if (env.ctx)
            moefuse_context_destroy(env.ctx);
        return 77;
    }
    env.raw = all[0].raw;
    moefuse_ep_config cfg = {r, W, E_ALL, NULL, {0}};
    if (moefuse_ep_group_create(env.ctx, &all[0].id, &cfg, &env.g) != MOEFUSE_OK)
        FAIL(&env, "group");
    if (moefuse_ep_local_experts(env.g) != E_RANK) {
        fprintf(stderr, "rank %d: %d local experts, expected %d\n", r,
                (int)moefuse_ep_local_experts(env.g), E_RANK);
        return 1;
    }
    if (r == 0)
        printf("ep_bench: %s, %d ranks, M=%d tokens a rank, %d iterations, %s%s\n",
               moefuse_device_name(env.ctx), W, o->M, o->iters,
               o->layer ? "layer mode" : o->ll ? "dispatch mode, normal and low-latency"
                                               : "dispatch mode",
               !o->layer && o->y_bf16 ? ", combine's y in bf16" : "");
    const int rc = o->layer ? run_layer(&env) : run_dispatch(&env);
    moefuse_ep_group_destroy(env.g);
    moefuse_context_destroy(env.ctx);
    return rc;
}

static int usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [M] [quantize 0|1] [iterations] [--ll] [--y=bf16] [--layer[=fp8|bf16]]\n"
            "  M tokens a rank (default 4096), quantize: FP8 rows in dispatch mode (default 0),\n"
            "  iterations timed (default 10); --ll adds the low-latency mode; --layer times and\n"
            "  checks the whole layer instead (see the header of bench/ep_bench.c)\n",
            argv0);
    return 2;
}

int main(int argc, char **argv)
{
    options o = {4096, 0, 10, 0, 0, 0};
    int pos = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--ll") == 0)
            o.ll = 1;
        else if (strcmp(argv[i], "--y=bf16") == 0)
            o.y_bf16 = 1;
        else if (strcmp(argv[i], "--layer") == 0)
            o.layer = 3;
        else if (strcmp(argv[i], "--layer=fp8") == 0)
            o.layer = 1;
        else if (strcmp(argv[i], "--layer=bf16") == 0)
            o.layer = 2;
        else if (argv[i][0] >= '0' && argv[i][0] <= '9' && pos < 3) {
            int *field = pos == 0 ? &o.M : pos == 1 ? &o.quantize : &o.iters;
            *field = atoi(argv[i]);
            pos++;
        } else
            return usage(argv[0]);
    }
    if (o.M < 1 || o.M > (1 << 20) || o.iters < 1 || (o.quantize != 0 && o.quantize != 1))
        return usage(argv[0]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    return run_ranks(rank_main, &o);
}
