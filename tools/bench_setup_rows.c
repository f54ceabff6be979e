/*
 * `moefuse bench` setup of the row ops (act_quant, act_mul, quant, dequant) and of the
 * expert-masked act_quant_masked: their --shape keys, operands and bytes moved.
 */
#include "bench.h"
#include "tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Quantization keys shared by the row ops: G, layout, ue8m0, q. */
static int parse_quant_keys(bench *b, shape_spec *s)
{
    const char *name = b->op->name;
    if (shape_int(s, name, "G", 128, MAX_DIM, &b->G) != 0)
        return -1;
    if (b->H % b->G != 0) {
        fprintf(stderr, "moefuse bench: G=%lld does not divide H=%lld\n", (long long)b->G,
                (long long)b->H);
        return -1;
    }
    const char *lay = shape_get(s, "layout");
    b->layout = MOEFUSE_SCALE_ROW_MAJOR;
    if (lay && strcmp(lay, "col") == 0)
        b->layout = MOEFUSE_SCALE_COLUMN_MAJOR;
    else if (lay && strcmp(lay, "packed") == 0)
        b->layout = MOEFUSE_SCALE_PACKED_UE8M0;
    else if (lay && strcmp(lay, "row") != 0) {
        fprintf(stderr, "moefuse bench: layout must be row, col or packed, not '%s'\n", lay);
        return -1;
    }
    const char *u = shape_get(s, "ue8m0");
    if (u && strcmp(u, "0") != 0 && strcmp(u, "1") != 0) {
        fprintf(stderr, "moefuse bench: ue8m0 must be 0 or 1, not '%s'\n", u);
        return -1;
    }
    b->ue8m0 = (u && strcmp(u, "1") == 0) || b->layout == MOEFUSE_SCALE_PACKED_UE8M0;
    const char *q = shape_get(s, "q");
    if (q && strcmp(q, "fp8") != 0 && strcmp(q, "int8") != 0) {
        fprintf(stderr, "moefuse bench: q must be fp8 or int8, not '%s'\n", q);
        return -1;
    }
    b->int8 = q && strcmp(q, "int8") == 0;
    if (b->int8 && b->ue8m0) {
        fprintf(stderr, "moefuse bench: ue8m0 scales (and layout=packed) need q=fp8\n");
        return -1;
    }
    b->Gn = b->H / b->G;
    b->Ta = (b->T + 3) / 4 * 4;
    return 0;
}

/* Scales tensor for E experts (E = 0: the 2-D form) in b's layout; bytes in *bytes. */
static moefuse_tensor scales_tensor(bench *b, int64_t E, void *data, size_t *bytes)
{
    int64_t shape[3];
    moefuse_dtype dt = b->ue8m0 ? MOEFUSE_U8 : MOEFUSE_F32;
    if (b->layout == MOEFUSE_SCALE_ROW_MAJOR) {
        shape[1] = b->T;
        shape[2] = b->Gn;
    } else if (b->layout == MOEFUSE_SCALE_COLUMN_MAJOR) {
        shape[1] = b->Gn;
        shape[2] = b->Ta;
    } else {
        shape[1] = (b->Gn + 3) / 4;
        shape[2] = b->Ta;
        dt = MOEFUSE_I32;
    }
    shape[0] = E;
    const int64_t n = (E ? E : 1) * shape[1] * shape[2];
    *bytes = (size_t)n * moefuse_dtype_size(dt);
    return E ? moefuse_tensor_dense(data, dt, 3, shape) : moefuse_tensor_dense(data, dt, 2, shape + 1);
}

/*
 * Token counts of the masked layout: fill= and tokens= (help_bench says how each fill
 * spreads them), uploaded as b->counts; b->valid_rows gets their sum.
 */
static int masked_counts(bench *b, shape_spec *s, int64_t E1)
{
    const char *name = b->op->name;
    const char *fill = shape_get(s, "fill");
    const int skew = fill && strcmp(fill, "skew") == 0;
    const int random = fill && strcmp(fill, "random") == 0;
    if (fill && !skew && !random && strcmp(fill, "full") != 0) {
        fprintf(stderr, "moefuse bench: fill must be full, skew or random, not '%s'\n", fill);
        return -1;
    }
    if (random && shape_get(s, "tokens")) {
        fprintf(stderr, "moefuse bench: fill=random draws the counts; tokens= is not "
                        "taken with it\n");
        return -1;
    }
    int64_t tokens;
    if (shape_int(s, name, "tokens", skew ? E1 * b->T / 2 : E1 * b->T, MAX_DIM, &tokens) != 0)
        return -1;
    if (tokens > E1 * b->T) {
        fprintf(stderr, "moefuse bench: tokens=%lld exceeds E*Tmax=%lld\n", (long long)tokens,
                (long long)(E1 * b->T));
        return -1;
    }
    int32_t *n = calloc((size_t)E1, sizeof *n);
    if (!n)
        return -1;
    /*
     * full: tokens spread evenly over all experts. skew: half of them (at most Tmax) on
     * expert 0 and the rest spread evenly over the others, which always fits.
     */
    int64_t rest = tokens, from = 0;
    if (random) { /* each count uniform in [0, Tmax], the same draw every run */
        uint64_t state = 0x9E3779B97F4A7C15ull;
        for (int64_t e = 0; e < E1; e++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            n[e] = (int32_t)((state >> 33) % (uint64_t)(b->T + 1));
        }
        from = E1; /* nothing left to spread */
    } else if (skew && E1 > 1) {
        n[0] = (int32_t)(tokens / 2 < b->T ? tokens / 2 : b->T);
        rest -= n[0];
        from = 1;
    }
    const int64_t others = E1 - from;
    for (int64_t e = from; others > 0 && e < E1; e++)
        n[e] = (int32_t)(rest / others + (e - from < rest % others ? 1 : 0));
    b->valid_rows = 0;
    for (int64_t e = 0; e < E1; e++)
        b->valid_rows += n[e];
    printf("counts: %lld valid rows of %lld (n[0] = %d, n[%lld] = %d)\n", (long long)b->valid_rows,
           (long long)(E1 * b->T), n[0], (long long)(E1 - 1), n[E1 - 1]);
    void *dn = bench_upload(b, n, (size_t)E1 * 4);
    free(n);
    if (!dn)
        return -1;
    int64_t cs[1] = {E1};
    b->counts = moefuse_tensor_dense(dn, MOEFUSE_I32, 1, cs);
    return 0;
}

int bench_setup_rows(bench *b, shape_spec *s, double *work)
{
    const char *name = b->op->name;
    const size_t es = moefuse_dtype_size(b->dtype);
    const int is_rows = b->op->kind == KIND_ROWS;
    if (is_rows) {
        b->E = 0;
        if (shape_int(s, name, "T", -1, MAX_DIM, &b->T) != 0)
            return -1;
    } else if (shape_int(s, name, "E", -1, 1 << 20, &b->E) != 0 ||
               shape_int(s, name, "Tmax", -1, MAX_DIM, &b->T) != 0) {
        return -1;
    }
    if (shape_int(s, name, "H", -1, MAX_DIM, &b->H) != 0)
        return -1;
    const int quantizing = strcmp(name, "act_mul") != 0;
    const int activate = strcmp(name, "quant") != 0 && strcmp(name, "dequant") != 0;
    if (quantizing && parse_quant_keys(b, s) != 0)
        return -1;
    const int64_t E1 = b->E ? b->E : 1;
    const int64_t xw = activate ? 2 * b->H : b->H;
    const moefuse_dtype qdt = b->int8 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;

    /* Token counts of the masked layout. */
    b->valid_rows = E1 * b->T;
    if (b->op->kind == KIND_MASKED && masked_counts(b, s, E1) != 0)
        return -1;

    /* x, and q / scales or out. */
    int64_t xs[3] = {E1, b->T, xw}, os[3] = {E1, b->T, b->H};
    const int r = b->E ? 3 : 2, o = b->E ? 0 : 1;
    const moefuse_dtype xdt = strcmp(name, "dequant") == 0 ? qdt : b->dtype;
    void *dx;
    if (strcmp(name, "dequant") == 0)
        dx = bench_alloc(b, (size_t)(b->T * b->H)); /* q codes, filled by quant below */
    else
        dx = bench_random(b, b->dtype, E1 * b->T * xw, 3.0f, 7);
    if (!dx)
        return -1;
    b->x = moefuse_tensor_dense(dx, xdt, r, xs + o);
    size_t sbytes = 0;
    if (quantizing) {
        scales_tensor(b, b->E, NULL, &sbytes);
        void *dsc = bench_alloc(b, sbytes);
        if (!dsc)
            return -1;
        b->scales = scales_tensor(b, b->E, dsc, &sbytes);
        b->qo.group_size = b->G;
        b->qo.scale_layout = b->layout;
        b->qo.ue8m0 = b->ue8m0;
        b->aq.quant = b->qo;
    }
    const int64_t on = E1 * b->T * b->H;
    const size_t obytes = strcmp(name, "act_mul") == 0 || strcmp(name, "dequant") == 0
                              ? (size_t)on * es
                              : (size_t)on;
    void *dout = bench_alloc(b, obytes);
    if (!dout)
        return -1;
    const moefuse_dtype odt = strcmp(name, "act_mul") == 0 || strcmp(name, "dequant") == 0
                                  ? b->dtype
                                  : qdt;
    b->out = moefuse_tensor_dense(dout, odt, r, os + o);
    if (strcmp(name, "dequant") == 0) {
        /* Real codes and scales: quantize random data once, untimed. */
        void *src = bench_random(b, b->dtype, b->T * b->H, 3.0f, 8);
        if (!src)
            return -1;
        moefuse_tensor t_src = moefuse_tensor_dense(src, b->dtype, 2, os + 1);
        b->q = b->x;
        moefuse_status st = moefuse_quant(b->ctx, &t_src, &b->q, &b->scales, &b->qo);
        if (st != MOEFUSE_OK) {
            report_failure(b->ctx, "quant (dequant setup)", st);
            return -1;
        }
    }

    /* Bytes moved: inputs read once, outputs written once, valid rows only. */
    const double rows = (double)b->valid_rows;
    double moved = rows * (double)xw * (double)moefuse_dtype_size(xdt) +
                   rows * (double)b->H * (double)moefuse_dtype_size(odt);
    if (quantizing) {
        /* Scale bytes per valid row; whole tensors (padding included) for the 2-D form. */
        const double per_row = (double)sbytes / (double)(E1 * (b->layout ==
                               MOEFUSE_SCALE_ROW_MAJOR ? b->T : b->Ta));
        moved += b->E ? rows * per_row : (double)sbytes;
    }
    if (b->op->kind == KIND_MASKED)
        moved += 4.0 * (double)E1;
    *work = moved;
    return 0;
}
