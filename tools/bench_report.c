/*
 * What `moefuse bench` prints after the time: the figure (GB/s, or GFLOP/s and the weights'
 * read rate for the MoE ops), the ceiling measured now on the same device and the ratio,
 * and for the MoE ops the roofline floor (copy bandwidth) and the read floor.
 */
#include "bench.h"
#include "timer.h"

#include <stdio.h>
#include <string.h>

/*
 * A MoE op's floor against one bandwidth ("copy" or "read"): the op can be no faster than its
 * FLOPs at the dense GEMM's rate, nor than streaming its routed experts' weights once at that
 * bandwidth; then the share of the op's median time the floor is. n/a (why) without it.
 */
static void print_floor(const char *floor_label, const char *ratio_label, const char *kind,
                        double t_flops, double weight_bytes, double gbs, const char *what,
                        double med)
{
    if (gbs <= 0.0) {
        printf("%s: n/a (%s bandwidth: %s)\n", floor_label, kind, what);
        return;
    }
    const double t_bytes = weight_bytes / (gbs * 1e9);
    const double floor_s = t_flops > t_bytes ? t_flops : t_bytes;
    printf("%s: %.4f ms = max(FLOPs at the ceiling's rate %.4f ms, weights at %.2f GB/s %s "
           "bandwidth %.4f ms (%s))\n%s: %.1f%%\n",
           floor_label, floor_s * 1e3, t_flops * 1e3, gbs, kind, t_bytes * 1e3, what,
           ratio_label, 100.0 * floor_s / med);
}

/* "ceiling: ..." and the ratio, or "ceiling: n/a (why)" and no ratio. */
static void print_ceiling(double figure, double ceil, const char *unit, const char *what)
{
    if (ceil > 0.0)
        printf("ceiling: %.2f %s (%s)\nratio: %.1f%%\n", ceil, unit, what, 100.0 * figure / ceil);
    else
        printf("ceiling: n/a (%s)\n", what);
}

/*
 * The op's ceiling ("what" says how it was measured, or why there is none): a dense GEMM of
 * the MoE op's FLOPs, else the copy bandwidth.
 */
static double measure_ceiling(bench *b, const ceiling_provider *ceiling, char *what,
                              size_t what_size)
{
    if (!ceiling) {
        snprintf(what, what_size, "no ceiling for the %s backend in this build",
                 moefuse_backend_name(b->ctx));
        return 0.0;
    }
    if (b->op->kind != KIND_MOE)
        return ceiling->copy_gbs(b->ctx, what, what_size);
    /* Same FLOPs as one dense GEMM: [M*k, K] x [K, n] with n = 3I, 2I or I. */
    const int gate = strcmp(b->op->name, "moe_final") != 0;
    const int fin = strcmp(b->op->name, "moe_gate") != 0;
    const int64_t n = (gate ? 2 * b->I : 0) + (fin ? b->I : 0);
    const int64_t rows = b->masked ? b->E * b->valid : b->M * b->k;
    if (b->fp8 && ceiling->gemm_fp8_gflops)
        return ceiling->gemm_fp8_gflops(b->ctx, rows, b->K, n, what, what_size);
    return ceiling->gemm_gflops(b->ctx, b->fp8 ? MOEFUSE_BF16 : b->dtype, rows, b->K, n, what,
                                what_size);
}

void bench_report(bench *b, const ceiling_provider *ceiling, bench_run *run, double work,
                  double med)
{
    const int gemm = b->op->kind == KIND_MOE;
    const double figure = work / med / 1e9;
    if (gemm) {
        printf("work: %.3f GFLOP\n", work / 1e9);
        printf("figure: %.2f GFLOP/s\n", figure);
        printf("weights: %.3f GB of routed experts read -> at least %.2f GB/s\n",
               b->weight_bytes / 1e9, b->weight_bytes / med / 1e9);
    } else {
        printf("bytes moved: %.3f MB\n", work / 1e6);
        printf("figure: %.2f GB/s\n", figure);
    }
    fflush(stdout);

    /* The ceiling can take long too: 1 GiB copies, a GEMM library compiling its kernels. */
    if (run->tty || now_seconds() - run->start > 2.0) {
        fprintf(stderr, "[bench] measuring the ceiling on the %s backend...",
                moefuse_backend_name(b->ctx));
        fflush(stderr);
        run->progress = 1;
    }
    char what[256];
    const double ceil = measure_ceiling(b, ceiling, what, sizeof what);
    /*
     * MoE ops also get the roofline floor: a layer can be no faster than the same FLOPs at the
     * dense GEMM's rate, nor than streaming its routed experts' weights once; once at the copy
     * bandwidth, and once at the read bandwidth, which is what streaming weights needs (a copy
     * spends half its traffic on writes, so its floor is the lower, easier one).
     */
    char copy_what[256] = "", read_what[256] = "";
    double copy = 0.0, read = 0.0;
    const int floors = ceiling && gemm && ceil > 0.0;
    if (floors) {
        copy = ceiling->copy_gbs(b->ctx, copy_what, sizeof copy_what);
        if (ceiling->read_gbs)
            read = ceiling->read_gbs(b->ctx, read_what, sizeof read_what);
        else
            snprintf(read_what, sizeof read_what, "none measured on the %s backend",
                     moefuse_backend_name(b->ctx));
    }
    if (run->progress)
        fprintf(stderr, "\r%60s\r", "");
    print_ceiling(figure, ceil, gemm ? "GFLOP/s" : "GB/s", what);
    if (floors) {
        const double t_flops = work / (ceil * 1e9);
        print_floor("roofline floor", "roofline ratio", "copy", t_flops, b->weight_bytes, copy,
                    copy_what, med);
        print_floor("read floor", "read-floor ratio", "read", t_flops, b->weight_bytes, read,
                    read_what, med);
    }
}
