/*
 * The timing of `moefuse bench`: runs of --batch calls bracketed by moefuse_synchronize and
 * timed on the host, or with --graph 1 one CUDA graph of those calls replayed and timed with
 * events by the ceiling provider; then the median per call, printed as the "time:" line.
 */
#include "bench.h"
#include "median.h"
#include "timer.h"
#include "tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* bench_call as a function of the pointer a graph's capture passes it. */
static moefuse_status bench_issue(void *b) { return bench_call(b); }

/*
 * --graph 1: the timed runs as replays of one graph of `batch` calls (ceiling.h, graph_times),
 * on a workspace of the bench's own, as an engine runs a captured step (the graph allocates
 * nothing). 1 when times[] is filled and `how` says how; 0 with the reason printed, for the
 * calls to be timed back to back instead; -1 when a call cannot run at all.
 */
static int bench_graph(bench *b, const ceiling_provider *ceiling, int64_t batch, int64_t warmup,
                       int64_t iters, double *times, char *how, size_t how_size)
{
    if (!ceiling || !ceiling->graph_times) {
        printf("graph: n/a (none on the %s backend); the calls are timed back to back\n",
               moefuse_backend_name(b->ctx));
        return 0;
    }
    size_t bytes = 0;
    moefuse_status st = bench_workspace_size(b, &bytes);
    if (st != MOEFUSE_OK) {
        report_failure(b->ctx, b->op->name, st);
        return -1;
    }
    if (bytes > 0) {
        const int64_t n = (int64_t)bytes;
        void *p = bench_alloc(b, bytes);
        if (!p)
            return -1;
        const moefuse_tensor ws = moefuse_tensor_dense(p, MOEFUSE_U8, 1, &n);
        st = moefuse_set_workspace(b->ctx, &ws);
        if (st != MOEFUSE_OK) {
            report_failure(b->ctx, "set_workspace", st);
            return -1;
        }
    }
    const int timed =
        ceiling->graph_times(b->ctx, bench_issue, b, batch, warmup, iters, times, how, how_size);
    if (bytes > 0)
        moefuse_set_workspace(b->ctx, NULL); /* its buffer goes before the context */
    if (timed != 0) {
        printf("graph: n/a (%s); the calls are timed back to back\n", how);
        return 0;
    }
    return 1;
}

/*
 * Runs of `batch` calls timed on the host, after the warm-up runs: times[i] gets run i's
 * seconds per call. -1 when a call failed (reported).
 */
static int host_times(bench *b, bench_run *run, double *times)
{
    const int64_t iters = run->iters, warmup = run->warmup, batch = run->batch;
    for (int64_t i = -warmup; i < iters; i++) {
        moefuse_synchronize(b->ctx);
        const double t0 = now_seconds();
        moefuse_status st = MOEFUSE_OK;
        for (int64_t c = 0; c < batch && st == MOEFUSE_OK; c++)
            st = bench_call(b);
        const double te = now_seconds();
        if (st == MOEFUSE_OK)
            st = moefuse_synchronize(b->ctx);
        const double t1 = now_seconds();
        if (st != MOEFUSE_OK) {
            if (run->progress)
                fprintf(stderr, "\n");
            report_failure(b->ctx, b->op->name, st);
            return -1;
        }
        if (i >= 0) {
            times[i] = (t1 - t0) / (double)batch;
            run->enqueue[i] = (te - t0) / (double)batch;
        }
        if (run->tty || t1 - run->start > 2.0) {
            run->progress = 1;
            if (i < 0)
                fprintf(stderr, "\r[bench] warm-up %lld/%lld   ", (long long)(i + warmup + 1),
                        (long long)warmup);
            else
                fprintf(stderr, "\r[bench] iter %lld/%lld      ", (long long)(i + 1),
                        (long long)iters);
            fflush(stderr);
        }
    }
    return 0;
}

int bench_time(bench *b, const ceiling_provider *ceiling, bench_run *run, double *med)
{
    const int64_t iters = run->iters, batch = run->batch;
    double *times = malloc((size_t)iters * sizeof *times);
    run->enqueue = malloc((size_t)iters * sizeof *run->enqueue);
    if (!times || !run->enqueue) {
        free(times);
        free(run->enqueue);
        run->enqueue = NULL;
        return -1;
    }
    run->tty = isatty(2);
    run->start = now_seconds();
    run->progress = 0;
    char how[256] = "";
    const int graphed = run->graph ? bench_graph(b, ceiling, batch, run->warmup, iters, times,
                                                 how, sizeof how)
                                   : 0;
    if (graphed < 0 || (!graphed && host_times(b, run, times) != 0)) {
        free(times);
        free(run->enqueue);
        run->enqueue = NULL;
        return -1;
    }
    if (run->progress)
        fprintf(stderr, "\r%40s\r", "");
    *med = median_sort(times, (size_t)iters);
    printf("time: %.4f ms median of %lld (min %.4f ms, max %.4f ms)", *med * 1e3,
           (long long)iters, times[0] * 1e3, times[iters - 1] * 1e3);
    if (graphed)
        printf(", per call of %s", how);
    else if (batch > 1)
        printf(", per call of runs of %lld back-to-back calls", (long long)batch);
    printf("\n");
    if (!graphed) /* when it is near the time, the host sets the pace, not the device */
        printf("enqueue: %.4f ms per call on the host, median (the calls before the sync)\n",
               median_sort(run->enqueue, (size_t)iters) * 1e3);
    free(times);
    free(run->enqueue);
    run->enqueue = NULL;
    return 0;
}
