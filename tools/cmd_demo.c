/*
 * `moefuse demo`: one MoE layer of Qwen3-30B-A3B (E = 128 experts, top-8,
 * hidden K = 2048, expert width I = 768) on random bf16 data, routed by
 * moefuse_topk_softmax, run on the selected backend, and checked against the
 * CPU golden backend. When the selected backend is the CPU itself, a few rows
 * are also checked against a float64 loop here, so the check is never only a
 * comparison of the CPU backend with itself.
 */
#include "convert.h"
#include "random.h"
#include "timer.h"
#include "tools.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { DEMO_E = 128, DEMO_TOPK = 8, DEMO_K = 2048, DEMO_I = 768 };
/* NUMERICS.md, "Agreement between backends": bf16 GEMM results within 8e-3 relative error of the reference. */
#define DEMO_TOLERANCE 8e-3
#define DEMO_ORACLE_ROWS 4

void help_demo(void)
{
    printf("usage: moefuse demo [--backend NAME] [--tokens M]\n"
           "\n"
           "Runs one MoE layer shaped like Qwen3-30B-A3B (E=128, top-8, K=2048, I=768) on M\n"
           "tokens (default 32) of random bf16 data: router logits -> topk_softmax (renormalized)\n"
           "-> moe_forward, timed on the selected backend, then compared with the CPU golden\n"
           "backend (and, on the CPU backend, with a float64 loop over a few rows).\n"
           "Memory: about 1.2 GB of weights.\n"
           "\n"
           "  --backend NAME  cpu, cuda, opencl or auto (default: MOEFUSE_BACKEND, else auto)\n"
           "  --tokens M      number of tokens (default 32)\n"
           "\n"
           "Exit status: 0 on PASS, 1 on FAIL or error, 2 on a usage error.\n");
}

/* Host array of n bf16 values, uniform in [-scale, scale). */
static uint16_t *random_bf16(int64_t n, float scale, uint64_t seed)
{
    uint16_t *p = malloc((size_t)n * sizeof *p);
    if (!p)
        return NULL;
    rng r = rng_seed(seed);
    for (int64_t i = 0; i < n; i++)
        p[i] = f32_to_bf16(scale * rng_uniform(&r));
    return p;
}

/* Copy a host array into a new buffer of ctx. */
static moefuse_status upload(moefuse_context *ctx, const void *src, size_t bytes, void **buf)
{
    moefuse_status st = moefuse_buffer_alloc(ctx, bytes, buf);
    if (st != MOEFUSE_OK)
        return st;
    st = moefuse_buffer_write(ctx, *buf, 0, src, bytes);
    if (st != MOEFUSE_OK) {
        moefuse_buffer_free(ctx, *buf);
        *buf = NULL;
    }
    return st;
}

/*
 * One output row in float64, following the definition: a = x w1^T, h = silu(gate) * up
 * rounded to bf16 (moe_forward keeps h in x's dtype), y = h w2^T, out = sum_j w_j y_j.
 */
static void oracle_row(int64_t m, const uint16_t *x, const uint16_t *w1, const uint16_t *w2,
                       const int32_t *ids, const float *wts, double *out)
{
    static double a[2 * DEMO_I];
    static float h[DEMO_I];
    for (int64_t c = 0; c < DEMO_K; c++)
        out[c] = 0.0;
    for (int j = 0; j < DEMO_TOPK; j++) {
        int64_t e = ids[m * DEMO_TOPK + j];
        if (e < 0 || e >= DEMO_E)
            continue;
        for (int64_t r = 0; r < 2 * DEMO_I; r++) {
            const uint16_t *wr = w1 + (e * 2 * DEMO_I + r) * DEMO_K;
            double s = 0.0;
            for (int64_t c = 0; c < DEMO_K; c++)
                s += (double)bf16_to_f32(x[m * DEMO_K + c]) * (double)bf16_to_f32(wr[c]);
            a[r] = s;
        }
        for (int64_t i = 0; i < DEMO_I; i++) {
            double g = a[i], u = a[DEMO_I + i];
            h[i] = bf16_to_f32(f32_to_bf16((float)(g / (1.0 + exp(-g)) * u)));
        }
        for (int64_t c = 0; c < DEMO_K; c++) {
            const uint16_t *wr = w2 + (e * DEMO_K + c) * DEMO_I;
            double s = 0.0;
            for (int64_t i = 0; i < DEMO_I; i++)
                s += (double)h[i] * (double)bf16_to_f32(wr[i]);
            out[c] += (double)wts[m * DEMO_TOPK + j] * s;
        }
    }
}

int cmd_demo(int argc, char **argv)
{
    const char *backend = NULL;
    int64_t M = 32;
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) {
            help_demo();
            return 0;
        } else if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) {
            backend = argv[++i];
        } else if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
            if (parse_i64("--tokens", argv[++i], &M) != 0)
                return 2;
            if (M < 1 || M > 65536) {
                fprintf(stderr, "moefuse demo: --tokens must be in [1, 65536], got %lld\n",
                        (long long)M);
                return 2;
            }
        } else {
            fprintf(stderr, "moefuse demo: unknown or incomplete argument '%s' (see --help)\n",
                    argv[i]);
            return 2;
        }
    }

    moefuse_context *ctx = NULL, *gold = NULL;
    moefuse_status st = moefuse_context_create(&ctx, backend);
    if (st != MOEFUSE_OK)
        return report_failure(NULL, "context_create", st);
    st = moefuse_context_create(&gold, "cpu");
    if (st != MOEFUSE_OK) {
        moefuse_context_destroy(ctx);
        return report_failure(NULL, "context_create(cpu)", st);
    }
    const int on_cpu = strcmp(moefuse_backend_name(ctx), "cpu") == 0;
    const int64_t E = DEMO_E, k = DEMO_TOPK, K = DEMO_K, I = DEMO_I;
    printf("moefuse demo: Qwen3-30B-A3B MoE layer, E=%lld top-%lld K=%lld I=%lld, M=%lld tokens, "
           "bf16\n",
           (long long)E, (long long)k, (long long)K, (long long)I, (long long)M);
    printf("backend: %s (%s)\n", moefuse_backend_name(ctx), moefuse_device_name(ctx));

    int rc = 1;
    /* Host data. Weights ~ U(-1, 1) / sqrt(fan-in) keep a, h and out of order 1. */
    const double t_gen = now_seconds();
    uint16_t *x = random_bf16(M * K, 1.0f, 1);
    uint16_t *w1 = random_bf16(E * 2 * I * K, (float)(1.7320508 / sqrt((double)K)), 2);
    uint16_t *w2 = random_bf16(E * K * I, (float)(1.7320508 / sqrt((double)I)), 3);
    float *logits = malloc((size_t)(M * E) * sizeof *logits);
    int32_t *ids = malloc((size_t)(M * k) * sizeof *ids);
    float *wts = malloc((size_t)(M * k) * sizeof *wts);
    uint16_t *out = calloc((size_t)(M * K), sizeof *out);
    uint16_t *ref = calloc((size_t)(M * K), sizeof *ref);
    void *d_x = NULL, *d_w1 = NULL, *d_w2 = NULL, *d_ids = NULL, *d_wts = NULL, *d_out = NULL;
    if (!x || !w1 || !w2 || !logits || !ids || !wts || !out || !ref) {
        fprintf(stderr, "moefuse demo: out of host memory\n");
        goto done;
    }
    rng r = rng_seed(4);
    for (int64_t i = 0; i < M * E; i++)
        logits[i] = 2.0f * rng_uniform(&r);
    printf("random data: %.2f s (w1 %.0f MB, w2 %.0f MB)\n", now_seconds() - t_gen,
           (double)(E * 2 * I * K * 2) / 1e6, (double)(E * K * I * 2) / 1e6);

    /* Routing on the golden backend (host memory). */
    int64_t ls[2] = {M, E}, rs[2] = {M, k}, xs[2] = {M, K};
    int64_t w1s[3] = {E, 2 * I, K}, w2s[3] = {E, K, I};
    moefuse_tensor t_logits = moefuse_tensor_dense(logits, MOEFUSE_F32, 2, ls);
    moefuse_tensor t_ids = moefuse_tensor_dense(ids, MOEFUSE_I32, 2, rs);
    moefuse_tensor t_wts = moefuse_tensor_dense(wts, MOEFUSE_F32, 2, rs);
    st = moefuse_topk_softmax(gold, &t_logits, 1, &t_ids, &t_wts);
    if (st != MOEFUSE_OK) {
        rc = report_failure(gold, "topk_softmax", st);
        goto done;
    }

    /* The selected backend: its own memory, one warm-up call, then one timed call. */
    const size_t b_x = (size_t)(M * K) * 2, b_w1 = (size_t)(E * 2 * I * K) * 2,
                 b_w2 = (size_t)(E * K * I) * 2, b_r = (size_t)(M * k) * 4;
    if ((st = upload(ctx, x, b_x, &d_x)) != MOEFUSE_OK ||
        (st = upload(ctx, w1, b_w1, &d_w1)) != MOEFUSE_OK ||
        (st = upload(ctx, w2, b_w2, &d_w2)) != MOEFUSE_OK ||
        (st = upload(ctx, ids, b_r, &d_ids)) != MOEFUSE_OK ||
        (st = upload(ctx, wts, b_r, &d_wts)) != MOEFUSE_OK ||
        (st = moefuse_buffer_alloc(ctx, b_x, &d_out)) != MOEFUSE_OK) {
        rc = report_failure(ctx, "buffer upload", st);
        goto done;
    }
    moefuse_tensor dx = moefuse_tensor_dense(d_x, MOEFUSE_BF16, 2, xs);
    moefuse_tensor dw1 = moefuse_tensor_dense(d_w1, MOEFUSE_BF16, 3, w1s);
    moefuse_tensor dw2 = moefuse_tensor_dense(d_w2, MOEFUSE_BF16, 3, w2s);
    moefuse_tensor dout = moefuse_tensor_dense(d_out, MOEFUSE_BF16, 2, xs);
    moefuse_routing droute = {0};
    droute.topk_ids = moefuse_tensor_dense(d_ids, MOEFUSE_I32, 2, rs);
    droute.topk_weights = moefuse_tensor_dense(d_wts, MOEFUSE_F32, 2, rs);
    moefuse_moe_options opt = {0}; /* silu, gate rows first, no clamp */

    double ms = 0.0;
    for (int pass = 0; pass < 2; pass++) {
        moefuse_synchronize(ctx);
        const double t0 = now_seconds();
        st = moefuse_moe_forward(ctx, &dx, &dw1, &dw2, NULL, NULL, &droute, &dout, &opt);
        if (st == MOEFUSE_OK)
            st = moefuse_synchronize(ctx);
        if (st != MOEFUSE_OK) {
            rc = report_failure(ctx, "moe_forward", st);
            goto done;
        }
        ms = 1e3 * (now_seconds() - t0);
    }
    if ((st = moefuse_buffer_read(ctx, d_out, 0, out, b_x)) != MOEFUSE_OK) {
        rc = report_failure(ctx, "buffer_read", st);
        goto done;
    }

    /* The golden backend on host memory. */
    moefuse_tensor hx = moefuse_tensor_dense(x, MOEFUSE_BF16, 2, xs);
    moefuse_tensor hw1 = moefuse_tensor_dense(w1, MOEFUSE_BF16, 3, w1s);
    moefuse_tensor hw2 = moefuse_tensor_dense(w2, MOEFUSE_BF16, 3, w2s);
    moefuse_tensor href = moefuse_tensor_dense(ref, MOEFUSE_BF16, 2, xs);
    moefuse_routing hroute = {0};
    hroute.topk_ids = t_ids;
    hroute.topk_weights = t_wts;
    st = moefuse_moe_forward(gold, &hx, &hw1, &hw2, NULL, NULL, &hroute, &href, &opt);
    if (st != MOEFUSE_OK) {
        rc = report_failure(gold, "moe_forward (cpu golden)", st);
        goto done;
    }

    printf("token 0 routed to experts");
    for (int64_t j = 0; j < k; j++)
        printf(" %d(%.3f)", ids[j], wts[j]);
    printf("\nout[0, 0:6] =");
    for (int c = 0; c < 6; c++)
        printf(" %+.5f", bf16_to_f32(out[c]));
    printf("\n");

    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < M * K; i++) {
        double d = (double)bf16_to_f32(out[i]) - (double)bf16_to_f32(ref[i]);
        double v = bf16_to_f32(ref[i]);
        num += d * d;
        den += v * v;
    }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    int pass = rel <= DEMO_TOLERANCE && isfinite(rel) && den > 0;
    printf("vs cpu golden backend: relative error %.3e (limit %.0e)%s\n", rel, DEMO_TOLERANCE,
           on_cpu ? " [same backend: expected 0]" : "");

    if (on_cpu) {
        /* Independent check of a few rows in float64. */
        double *o = malloc((size_t)K * sizeof *o);
        if (!o) {
            fprintf(stderr, "moefuse demo: out of host memory\n");
            goto done;
        }
        const int64_t nrows = M < DEMO_ORACLE_ROWS ? M : DEMO_ORACLE_ROWS;
        double n2 = 0.0, d2 = 0.0;
        for (int64_t t = 0; t < nrows; t++) {
            const int64_t m = t * (M - 1) / (nrows > 1 ? nrows - 1 : 1); /* first .. last */
            oracle_row(m, x, w1, w2, ids, wts, o);
            for (int64_t c = 0; c < K; c++) {
                double d = (double)bf16_to_f32(out[m * K + c]) - o[c];
                n2 += d * d;
                d2 += o[c] * o[c];
            }
        }
        double rel64 = d2 > 0 ? sqrt(n2 / d2) : sqrt(n2);
        int ok64 = rel64 <= DEMO_TOLERANCE && isfinite(rel64) && d2 > 0;
        printf("vs float64 loop (%lld rows): relative error %.3e (limit %.0e)\n", (long long)nrows,
               rel64, DEMO_TOLERANCE);
        pass = pass && ok64;
        free(o);
    }

    const double flops = 2.0 * (double)M * (double)k * (3.0 * (double)I * (double)K);
    printf("moe_forward: %.3f ms, %.2f GFLOP/s (%.2f GFLOP)\n", ms, flops / (ms * 1e-3) / 1e9,
           flops / 1e9);
    printf("%s\n", pass ? "PASS" : "FAIL");
    rc = pass ? 0 : 1;

done:
    if (d_x) moefuse_buffer_free(ctx, d_x);
    if (d_w1) moefuse_buffer_free(ctx, d_w1);
    if (d_w2) moefuse_buffer_free(ctx, d_w2);
    if (d_ids) moefuse_buffer_free(ctx, d_ids);
    if (d_wts) moefuse_buffer_free(ctx, d_wts);
    if (d_out) moefuse_buffer_free(ctx, d_out);
    free(x);
    free(w1);
    free(w2);
    free(logits);
    free(ids);
    free(wts);
    free(out);
    free(ref);
    moefuse_context_destroy(gold);
    moefuse_context_destroy(ctx);
    return rc;
}
