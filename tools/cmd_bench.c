/*
 * `moefuse bench`: times one operation on the selected backend and sets the
 * figure next to a ceiling measured in the same run on the same device, so that
 * the ratio means something on any machine: copy bandwidth for the memory-bound
 * ops, a dense GEMM of the same FLOPs for the MoE GEMMs (ceiling.h).
 *
 * This file reads the options and the op, and runs the steps bench.h lists, each in its
 * own file: the setup (bench_setup*.c), the timing (bench_time.c), the report
 * (bench_report.c); the help text is bench_help.c.
 */
#include "bench.h"
#include "tools.h"

#include <stdio.h>
#include <string.h>

/* Each op, its family (which setup file takes it) and the --shape keys it takes. */
static const op_info ops[] = {
    {"act_quant", KIND_ROWS, "T, H, G, layout, ue8m0, q"},
    {"act_quant_masked", KIND_MASKED, "E, Tmax, H, G, layout, ue8m0, q, fill, tokens"},
    {"act_mul", KIND_ROWS, "T, H"},
    {"quant", KIND_ROWS, "T, H, G, layout, ue8m0, q"},
    {"dequant", KIND_ROWS, "T, H, G, layout, ue8m0, q"},
    {"topk_softmax", KIND_TOPK, "M, E, k"},
    {"topk_route", KIND_TOPK, "M, E, k, n_group, topk_group, scoring, bias"},
    {"routing_metadata", KIND_TOPK, "M, E, k, block"},
    {"moe_gate", KIND_MOE, "M, E, k, K, I"},
    {"moe_final", KIND_MOE, "M, E, k, K, I"},
    {"moe_forward", KIND_MOE, "M, E, k, K, I, router"},
    {"moe_forward_fp8", KIND_MOE, "M, E, k, K, I, xq, ue8m0, router, shared"},
    {"moe_masked_fp8", KIND_MOE, "E, Tmax, K, I, valid"},
};

/* --dtype: the input dtype of the op. */
static int parse_dtype(const char *s, moefuse_dtype *dt)
{
    if (strcmp(s, "bf16") == 0)
        *dt = MOEFUSE_BF16;
    else if (strcmp(s, "f16") == 0)
        *dt = MOEFUSE_F16;
    else if (strcmp(s, "f32") == 0)
        *dt = MOEFUSE_F32;
    else {
        fprintf(stderr, "moefuse bench: --dtype must be bf16, f16 or f32, not '%s'\n", s);
        return -1;
    }
    return 0;
}

int cmd_bench(int argc, char **argv)
{
    const char *opname = NULL, *spec = NULL, *backend = NULL;
    moefuse_dtype dtype = MOEFUSE_BF16;
    int64_t iters = -1, warmup = -1, batch = -1, graph = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (is_help(a)) {
            help_bench();
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "moefuse bench: '%s' needs a value, or is unknown (see --help)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (strcmp(a, "--op") == 0)
            opname = v;
        else if (strcmp(a, "--shape") == 0)
            spec = v;
        else if (strcmp(a, "--backend") == 0)
            backend = v;
        else if (strcmp(a, "--dtype") == 0) {
            if (parse_dtype(v, &dtype) != 0)
                return 2;
        } else if (strcmp(a, "--iters") == 0) {
            if (parse_i64("--iters", v, &iters) != 0 || iters < 1) {
                fprintf(stderr, "moefuse bench: --iters must be at least 1\n");
                return 2;
            }
        } else if (strcmp(a, "--batch") == 0) {
            if (parse_i64("--batch", v, &batch) != 0 || batch < 1) {
                fprintf(stderr, "moefuse bench: --batch must be at least 1\n");
                return 2;
            }
        } else if (strcmp(a, "--warmup") == 0) {
            if (parse_i64("--warmup", v, &warmup) != 0)
                return 2;
        } else if (strcmp(a, "--graph") == 0) {
            if (parse_i64("--graph", v, &graph) != 0 || graph > 1) {
                fprintf(stderr, "moefuse bench: --graph must be 0 or 1\n");
                return 2;
            }
        } else {
            fprintf(stderr, "moefuse bench: unknown argument '%s' (see --help)\n", a);
            return 2;
        }
    }
    if (!opname || !spec) {
        fprintf(stderr, "moefuse bench: --op and --shape are required (see --help)\n");
        return 2;
    }
    bench b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
        if (strcmp(ops[i].name, opname) == 0)
            b.op = &ops[i];
    if (!b.op) {
        fprintf(stderr, "moefuse bench: unknown --op '%s'; one of:", opname);
        for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
            fprintf(stderr, " %s", ops[i].name);
        fprintf(stderr, "\n");
        return 2;
    }
    shape_spec s;
    if (shape_parse(spec, &s) != 0 || shape_check_keys(&s, b.op->name, b.op->keys) != 0)
        return 2;
    const int gemm = b.op->kind == KIND_MOE;
    if (iters < 0)
        iters = gemm ? 5 : 20;
    if (warmup < 0)
        warmup = gemm ? 1 : 2;
    b.dtype = dtype;

    moefuse_status st = moefuse_context_create(&b.ctx, backend);
    if (st != MOEFUSE_OK)
        return report_failure(NULL, "context_create", st);
    const ceiling_provider *ceiling = ceiling_provider_for(moefuse_backend_name(b.ctx));
    /* Many calls per timed run on GPU backends, so the host's latency is not counted per call. */
    if (batch < 0)
        batch = strcmp(moefuse_backend_name(b.ctx), "cpu") == 0 ? 1 : 10;
    bench_run run = {.iters = iters, .warmup = warmup, .batch = batch, .graph = graph};
    int rc = 1;
    double work = 0.0, med = 0.0;
    if (bench_setup(&b, &s, &work) != 0) {
        rc = 2;
        goto done;
    }
    if (shape_check_unused(&s, b.op->name, b.op->keys) != 0) {
        rc = 2;
        goto done;
    }
    printf("op: %s  shape: %s  dtype: %s  backend: %s (%s)\n", b.op->name, spec,
           moefuse_dtype_name(dtype), moefuse_backend_name(b.ctx), moefuse_device_name(b.ctx));
    if (bench_time(&b, ceiling, &run, &med) != 0)
        goto done;
    bench_report(&b, ceiling, &run, work, med);
    rc = 0;

done:
    for (int i = 0; i < b.nbuf; i++)
        moefuse_buffer_free(b.ctx, b.buf[i]);
    moefuse_context_destroy(b.ctx);
    return rc;
}
