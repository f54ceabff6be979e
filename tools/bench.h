/*
 * What the files of `moefuse bench` share (cmd_bench.c drives them): the op table's entry,
 * the bench's state, and one function per step of a run. Internal to the tool.
 */
#ifndef MOEFUSE_TOOLS_BENCH_H
#define MOEFUSE_TOOLS_BENCH_H

#include "ceiling.h"
#include "shape.h"

#include <moefuse.h>

#include <stddef.h>
#include <stdint.h>

/* The largest size a --shape key may give (shape_int's bound). */
#define MAX_DIM ((int64_t)1 << 40)

/* The families of ops, each set up by a file of its own (bench_setup.c dispatches). */
typedef enum op_kind { KIND_ROWS, KIND_MASKED, KIND_TOPK, KIND_MOE } op_kind;

/* One row of cmd_bench.c's op table: the op, its family and the --shape keys it takes. */
typedef struct op_info {
    const char *name;
    op_kind kind;
    const char *keys;
} op_info;

/* Everything one benchmark run needs: the context, its buffers and the call's operands. */
typedef struct bench {
    moefuse_context *ctx;
    const op_info *op;
    moefuse_dtype dtype;
    /* row ops */
    int64_t E, T, H, G, Gn, Ta;
    moefuse_scale_layout layout;
    int ue8m0, int8;
    int64_t valid_rows;
    /* moe / topk */
    int64_t M, k, K, I;
    double weight_bytes; /* MoE: bytes of the experts the routing touches */
    /* buffers (backend memory) */
    void *buf[16];
    int nbuf;
    moefuse_tensor x, q, scales, out, counts, w1, w2, h;
    moefuse_routing route;
    moefuse_act_quant_options aq;
    moefuse_quant_options qo;
    moefuse_act_options ao;
    moefuse_moe_options mo;
    /* FP8 MoE: block scales of w1 / w2, x's scales (xq=1), the masked layout's valid rows */
    int fp8, masked;
    moefuse_tensor w1s, w2s, xs;
    moefuse_fp8_moe_options fo;
    int64_t valid;
    /* router=1: logits [M, E] that moefuse_topk_softmax turns into route before each layer */
    int64_t router;
    moefuse_tensor logits;
    /* topk_route: the router's options and its choice bias; routing_metadata's outputs */
    moefuse_router_options ro;
    moefuse_tensor choice_bias;
    int has_choice_bias;
    moefuse_routing_meta meta;
    int32_t block_size;
} bench;

/* How cmd_bench runs the op: the options, and the progress line it may show on stderr. */
typedef struct bench_run {
    int64_t iters, warmup, batch, graph;
    int tty;      /* stderr is a terminal: progress is shown from the start */
    double start; /* when the timing began: after 2 s progress is shown anyway */
    int progress; /* a progress line went to stderr, to be wiped before the results */
    double *enqueue; /* back to back: each run's host seconds per call before its sync */
} bench_run;

/* bench_buffers.c: backend buffers, each remembered in b->buf for release. */
void *bench_alloc(bench *b, size_t bytes);
void *bench_random(bench *b, moefuse_dtype dt, int64_t n, float scale, uint64_t seed);
void *bench_upload(bench *b, const void *src, size_t bytes);
void *bench_fp8_codes(bench *b, int64_t n, uint64_t seed);
moefuse_tensor bench_block_scales(bench *b, int64_t E, int64_t rows, int64_t depth,
                                  uint64_t seed);

/*
 * bench_setup.c: reads the op's --shape keys and sets up its operands; returns the bytes
 * moved (memory-bound ops) or FLOPs (GEMMs) in *work. -1 with a message on a bad shape.
 * One file per family of ops does the work:
 */
int bench_setup(bench *b, shape_spec *s, double *work);
int bench_setup_rows(bench *b, shape_spec *s, double *work); /* bench_setup_rows.c */
int bench_setup_moe(bench *b, shape_spec *s, double *work);  /* bench_setup_moe.c */
int bench_setup_fp8(bench *b, shape_spec *s, double *work);  /* bench_setup_fp8.c */
int bench_setup_route(bench *b, shape_spec *s, double *work); /* bench_setup_route.c */

/* bench_routing.c: the MoE ops' routing, drawn on the host, and the router=1 logits. */
int draw_routing(int64_t M, int64_t k, int64_t E, int32_t **ids_out, float **wts_out,
                 int64_t *distinct);
int bench_router(bench *b, shape_spec *s, const int32_t *ids);

/* bench_call.c: one call of the op as set up, and the workspace it takes. */
moefuse_status bench_call(bench *b);
moefuse_status bench_workspace_size(bench *b, size_t *bytes);

/*
 * bench_time.c: times run->iters runs of run->batch calls (or a graph's replays) and prints
 * the "time:" line; the median seconds per call in *med. -1 when a call failed (reported).
 */
int bench_time(bench *b, const ceiling_provider *ceiling, bench_run *run, double *med);

/* bench_report.c: the figure, then the ceiling measured now and the MoE ops' floors. */
void bench_report(bench *b, const ceiling_provider *ceiling, bench_run *run, double work,
                  double med);

#endif
