/*
 * `moefuse bench`: times one operation on the selected backend and sets the
 * figure next to a ceiling measured in the same run on the same device, so that
 * the ratio means something on any machine: copy bandwidth for the memory-bound
 * ops, a dense GEMM of the same FLOPs for the MoE GEMMs (ceiling.h).
 */
#include "ceiling.h"
#include "convert.h"
#include "random.h"
#include "shape.h"
#include "median.h"
#include "timer.h"
#include "tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_DIM ((int64_t)1 << 40)

void help_bench(void)
{
    printf(
        "usage: moefuse bench --op OP --shape SPEC [--backend NAME] [--dtype bf16|f16|f32]\n"
        "                     [--iters N] [--warmup N] [--batch N] [--graph 0|1]\n"
        "\n"
        "Times OP (median of N runs after the warm-up runs, each bracketed by\n"
        "moefuse_synchronize) and prints the figure, a ceiling measured in the same run, and\n"
        "the ratio of the two.\n"
        "\n"
        "OP and the keys of SPEC (comma-separated key=value):\n"
        "  act_quant         T, H        [G=128, layout=row|col|packed, ue8m0=0|1, q=fp8|int8]\n"
        "  act_mul           T, H\n"
        "  quant, dequant    T, H        [G, layout, ue8m0, q as above]\n"
        "  act_quant_masked  E, Tmax, H  [G, layout, ue8m0, q, fill=full|skew|random, tokens=N]\n"
        "                    full: tokens (default E*Tmax) spread evenly over the experts;\n"
        "                    skew: half the tokens (default E*Tmax/2) on expert 0, the rest spread\n"
        "                    evenly over the others; random: each count uniform in [0, Tmax]\n"
        "                    (a fixed draw, the same every run)\n"
        "  topk_softmax      M, E, k\n"
        "  moe_gate, moe_final  M, E, k, K, I\n"
        "  moe_forward        M, E, k, K, I, router\n"
        "  moe_forward_fp8    M, E, k, K, I, xq (1: x given in FP8 with its scales), ue8m0,\n"
        "                     router\n"
        "  moe_masked_fp8     E, Tmax, K, I, valid (rows of each expert)\n"
        "router=1: each call is moefuse_topk_softmax (logits [M, E] in --dtype, renormalized)\n"
        "then the layer on its ids and weights, as an engine's step runs them; the logits\n"
        "pick the same experts as without it, so the weights read and the floors are the same.\n"
        "H is the output width: act_* read rows of 2H. Examples:\n"
        "  moefuse bench --op act_quant --shape T=4096,H=7168,layout=col\n"
        "  moefuse bench --op act_quant_masked --shape E=32,Tmax=256,H=2048,fill=skew,tokens=4096\n"
        "  moefuse bench --op moe_forward --dtype f32 --shape M=32,E=8,k=2,K=4096,I=14336\n"
        "  moefuse bench --op moe_forward --graph 1 --shape M=1,E=128,k=8,K=2048,I=768,router=1\n"
        "\n"
        "Figures: GB/s of bytes moved (each input byte read once, each output byte written\n"
        "once; valid rows only for masked) against the copy bandwidth (bytes read + written,\n"
        "best of 5); GFLOP/s for the MoE GEMMs (forward: 2*M*k*(2I*K + K*I)) against a dense\n"
        "GEMM of the same FLOPs ([M*k, K] x [K, 3I] for forward; FP8 for the FP8 ops where\n"
        "the backend has one), plus the bandwidth at which the routed experts' weights were\n"
        "read. The MoE ops also print two floors, max(the FLOPs at the GEMM's rate, the\n"
        "routed experts' weights read once): \"roofline floor\" at the copy bandwidth and\n"
        "\"read floor\" at the read bandwidth (a read-only stream, bytes read), each with the\n"
        "share of the op's time it is. Ceilings run on the backend's own device:\n"
        "  cpu     memcpy of 1 GiB; a sum over 2 GiB on the OpenMP threads (read); OpenBLAS\n"
        "          sgemm, best of 3 (sbgemm for bf16 where OpenBLAS has it)\n"
        "  cuda    cudaMemcpyAsync of 1 GiB and a sum kernel over 2 GiB (read), best of 5;\n"
        "          cublasGemmEx (cuBLASLt e4m3 for the FP8 ops), median of 5; all on the\n"
        "          context's stream, cuBLAS loaded at run time: without it the GEMM is n/a\n"
        "  opencl  clEnqueueCopyBuffer of 1 GiB (or CL_DEVICE_MAX_MEM_ALLOC_SIZE) and\n"
        "          CLBlastSgemm in f32, median of 5, both on the context's queue; CLBlast is\n"
        "          loaded at run time (libclblast.so.1): without it the GEMM ceiling is n/a;\n"
        "          no read ceiling (read floor: n/a)\n"
        "A backend without ceilings prints \"ceiling: n/a\" and no ratio.\n"
        "\n"
        "  --backend NAME  cpu, cuda, opencl or auto (default: MOEFUSE_BACKEND, else auto)\n"
        "  --dtype D       input dtype: bf16 (default), f16, f32\n"
        "  --iters N       timed runs (default 20; 5 for the MoE ops)\n"
        "  --warmup N      untimed runs first (default 2; 1 for the MoE ops)\n"
        "  --batch N       calls per timed run, enqueued back to back and timed together\n"
        "                  (default 10 on GPU backends, so the host's launch and\n"
        "                  synchronisation latency is not counted per call; 1 on the CPU)\n"
        "  --graph 1       cuda: capture the --batch calls once into one CUDA graph (on a\n"
        "                  workspace of the bench's, so the graph allocates nothing) and time\n"
        "                  its replays with events, as an engine runs a decode step; other\n"
        "                  backends say n/a and time the calls as without it (default 0)\n");
}

typedef enum op_kind { KIND_ROWS, KIND_MASKED, KIND_TOPK, KIND_MOE } op_kind;

typedef struct op_info {
    const char *name;
    op_kind kind;
    const char *keys;
} op_info;

static const op_info ops[] = {
    {"act_quant", KIND_ROWS, "T, H, G, layout, ue8m0, q"},
    {"act_quant_masked", KIND_MASKED, "E, Tmax, H, G, layout, ue8m0, q, fill, tokens"},
    {"act_mul", KIND_ROWS, "T, H"},
    {"quant", KIND_ROWS, "T, H, G, layout, ue8m0, q"},
    {"dequant", KIND_ROWS, "T, H, G, layout, ue8m0, q"},
    {"topk_softmax", KIND_TOPK, "M, E, k"},
    {"moe_gate", KIND_MOE, "M, E, k, K, I"},
    {"moe_final", KIND_MOE, "M, E, k, K, I"},
    {"moe_forward", KIND_MOE, "M, E, k, K, I, router"},
    {"moe_forward_fp8", KIND_MOE, "M, E, k, K, I, xq, ue8m0, router"},
    {"moe_masked_fp8", KIND_MOE, "E, Tmax, K, I, valid"},
};

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
} bench;

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

/* A new buffer of the context, remembered for release. */
static void *bench_alloc(bench *b, size_t bytes)
{
    void *p = NULL;
    moefuse_status st = moefuse_buffer_alloc(b->ctx, bytes ? bytes : 1, &p);
    if (st != MOEFUSE_OK) {
        report_failure(b->ctx, "buffer_alloc", st);
        return NULL;
    }
    b->buf[b->nbuf++] = p;
    return p;
}

/* A backend buffer of n floats of dtype dt, uniform in [-scale, scale), written in chunks. */
static void *bench_random(bench *b, moefuse_dtype dt, int64_t n, float scale, uint64_t seed)
{
    const size_t es = moefuse_dtype_size(dt);
    void *dev = bench_alloc(b, (size_t)n * es);
    if (!dev)
        return NULL;
    const int64_t chunk = (int64_t)1 << 22;
    void *host = malloc((size_t)(n < chunk ? n : chunk) * es);
    if (!host) {
        fprintf(stderr, "moefuse bench: out of host memory\n");
        return NULL;
    }
    rng r = rng_seed(seed);
    for (int64_t at = 0; at < n; at += chunk) {
        const int64_t len = n - at < chunk ? n - at : chunk;
        for (int64_t i = 0; i < len; i++)
            store_float(host, dt, i, scale * rng_uniform(&r));
        moefuse_status st =
            moefuse_buffer_write(b->ctx, dev, (size_t)at * es, host, (size_t)len * es);
        if (st != MOEFUSE_OK) {
            free(host);
            report_failure(b->ctx, "buffer_write", st);
            return NULL;
        }
    }
    free(host);
    return dev;
}

static void *bench_upload(bench *b, const void *src, size_t bytes)
{
    void *dev = bench_alloc(b, bytes);
    if (!dev)
        return NULL;
    moefuse_status st = moefuse_buffer_write(b->ctx, dev, 0, src, bytes);
    if (st != MOEFUSE_OK) {
        report_failure(b->ctx, "buffer_write", st);
        return NULL;
    }
    return dev;
}

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

/* Sets up operands; returns the bytes moved (memory-bound ops) or FLOPs (GEMMs) in *work. */
/*
 * Routing of M tokens: k distinct random experts each, positive weights summing to 1, and the
 * number of distinct experts routed to (whose weights a call must read at least once).
 */
static int draw_routing(int64_t M, int64_t k, int64_t E, int32_t **ids_out, float **wts_out,
                        int64_t *distinct)
{
    int32_t *ids = malloc((size_t)(M * k) * sizeof *ids);
    float *wts = malloc((size_t)(M * k) * sizeof *wts);
    char *hit = calloc((size_t)E, 1);
    if (!ids || !wts || !hit) {
        free(ids), free(wts), free(hit);
        fprintf(stderr, "moefuse bench: out of host memory\n");
        return -1;
    }
    rng r = rng_seed(21);
    *distinct = 0;
    for (int64_t m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int32_t e;
            int fresh;
            do {
                e = (int32_t)rng_below(&r, (uint32_t)E);
                fresh = 1;
                for (int64_t i = 0; i < j; i++)
                    fresh &= ids[m * k + i] != e;
            } while (!fresh);
            ids[m * k + j] = e;
            wts[m * k + j] = 0.5f + 0.5f * rng_uniform(&r) + 0.5f;
            sum += wts[m * k + j];
            *distinct += !hit[e];
            hit[e] = 1;
        }
        for (int64_t j = 0; j < k; j++)
            wts[m * k + j] /= sum;
    }
    free(hit);
    *ids_out = ids;
    *wts_out = wts;
    return 0;
}

/*
 * router=1: logits [M, E] in the bench's dtype whose top k in each row are the drawn experts
 * (in [2.5, 3.5) against [-1, 1) for the rest), so that moefuse_topk_softmax, run before the
 * layer in every call, routes the tokens to the experts of the draw and the layer reads the
 * same weights, the floor's, as without the router. Its weights are the softmax's, renormalized
 * over the k (as Mixtral, Qwen3 and DeepSeek-V3 renormalize), not the draw's.
 */
static int bench_router(bench *b, shape_spec *s, const int32_t *ids)
{
    if (shape_int(s, b->op->name, "router", 0, 1, &b->router) != 0)
        return -1;
    if (!b->router)
        return 0;
    const int64_t M = b->M, E = b->E, k = b->k;
    const size_t es = moefuse_dtype_size(b->dtype);
    float *v = malloc((size_t)(M * E) * sizeof *v);
    void *host = malloc((size_t)(M * E) * es);
    if (!v || !host) {
        free(v), free(host);
        fprintf(stderr, "moefuse bench: out of host memory\n");
        return -1;
    }
    rng r = rng_seed(41);
    for (int64_t i = 0; i < M * E; i++)
        v[i] = rng_uniform(&r);
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++)
            v[m * E + ids[m * k + j]] = 3.0f + 0.5f * rng_uniform(&r);
    for (int64_t i = 0; i < M * E; i++)
        store_float(host, b->dtype, i, v[i]);
    void *dl = bench_upload(b, host, (size_t)(M * E) * es);
    free(v), free(host);
    if (!dl)
        return -1;
    int64_t ls[2] = {M, E};
    b->logits = moefuse_tensor_dense(dl, b->dtype, 2, ls);
    printf("router: moefuse_topk_softmax of logits [%lld, %lld] %s (renormalized) before each "
           "layer call, timed with it\n",
           (long long)M, (long long)E, moefuse_dtype_name(b->dtype));
    return 0;
}

/* The FP8 MoE ops' setup (below, beside their calls). */
static int bench_setup_fp8(bench *b, shape_spec *s, double *work);

static int bench_setup(bench *b, shape_spec *s, double *work)
{
    const char *name = b->op->name;
    const size_t es = moefuse_dtype_size(b->dtype);
    const int is_rows = b->op->kind == KIND_ROWS;
    if (is_rows || b->op->kind == KIND_MASKED) {
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
        if (b->op->kind == KIND_MASKED) {
            const char *fill = shape_get(s, "fill");
            const int skew = fill && strcmp(fill, "skew") == 0;
            const int random = fill && strcmp(fill, "random") == 0;
            if (fill && !skew && !random && strcmp(fill, "full") != 0) {
                fprintf(stderr, "moefuse bench: fill must be full, skew or random, not '%s'\n",
                        fill);
                return -1;
            }
            if (random && shape_get(s, "tokens")) {
                fprintf(stderr, "moefuse bench: fill=random draws the counts; tokens= is not "
                                "taken with it\n");
                return -1;
            }
            int64_t tokens;
            if (shape_int(s, name, "tokens", skew ? E1 * b->T / 2 : E1 * b->T, MAX_DIM,
                          &tokens) != 0)
                return -1;
            if (tokens > E1 * b->T) {
                fprintf(stderr, "moefuse bench: tokens=%lld exceeds E*Tmax=%lld\n",
                        (long long)tokens, (long long)(E1 * b->T));
                return -1;
            }
            int32_t *n = calloc((size_t)E1, sizeof *n);
            if (!n)
                return -1;
            /*
             * full: tokens spread evenly over all experts. skew: half of them (at most Tmax)
             * on expert 0 and the rest spread evenly over the others, which always fits.
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
            printf("counts: %lld valid rows of %lld (n[0] = %d, n[%lld] = %d)\n",
                   (long long)b->valid_rows, (long long)(E1 * b->T), n[0], (long long)(E1 - 1),
                   n[E1 - 1]);
            void *dn = bench_upload(b, n, (size_t)E1 * 4);
            free(n);
            if (!dn)
                return -1;
            int64_t cs[1] = {E1};
            b->counts = moefuse_tensor_dense(dn, MOEFUSE_I32, 1, cs);
        }

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
            if (st != MOEFUSE_OK)
            {
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

    if (b->op->kind == KIND_TOPK) {
        if (shape_int(s, name, "M", -1, MAX_DIM, &b->M) != 0 ||
            shape_int(s, name, "E", -1, 1 << 20, &b->E) != 0 ||
            shape_int(s, name, "k", -1, 1 << 20, &b->k) != 0)
            return -1;
        if (b->k > b->E) {
            fprintf(stderr, "moefuse bench: k=%lld exceeds E=%lld\n", (long long)b->k,
                    (long long)b->E);
            return -1;
        }
        int64_t ls[2] = {b->M, b->E}, rs[2] = {b->M, b->k};
        void *dl = bench_random(b, b->dtype, b->M * b->E, 4.0f, 11);
        void *di = bench_alloc(b, (size_t)(b->M * b->k) * 4);
        void *dw = bench_alloc(b, (size_t)(b->M * b->k) * 4);
        if (!dl || !di || !dw)
            return -1;
        b->x = moefuse_tensor_dense(dl, b->dtype, 2, ls);
        b->route.topk_ids = moefuse_tensor_dense(di, MOEFUSE_I32, 2, rs);
        b->route.topk_weights = moefuse_tensor_dense(dw, MOEFUSE_F32, 2, rs);
        *work = (double)(b->M * b->E) * (double)es + (double)(b->M * b->k) * 8.0;
        return 0;
    }

    if (strstr(name, "_fp8"))
        return bench_setup_fp8(b, s, work);
    /* MoE GEMMs. */
    if (shape_int(s, name, "M", -1, MAX_DIM, &b->M) != 0 ||
        shape_int(s, name, "E", -1, 1 << 20, &b->E) != 0 ||
        shape_int(s, name, "k", -1, 1 << 20, &b->k) != 0 ||
        shape_int(s, name, "K", -1, MAX_DIM, &b->K) != 0 ||
        shape_int(s, name, "I", -1, MAX_DIM, &b->I) != 0)
        return -1;
    if (b->k > b->E) {
        fprintf(stderr, "moefuse bench: k=%lld exceeds E=%lld (each token takes k distinct "
                        "experts)\n", (long long)b->k, (long long)b->E);
        return -1;
    }
    const int gate = strcmp(name, "moe_final") != 0, final = strcmp(name, "moe_gate") != 0;
    const int64_t M = b->M, k = b->k, K = b->K, I = b->I, E = b->E;
    printf("weights: %.2f GB in %s\n",
           (double)((gate ? E * 2 * I * K : 0) + (final ? E * K * I : 0)) * (double)es / 1e9,
           moefuse_dtype_name(b->dtype));
    int32_t *ids;
    float *wts;
    int64_t distinct;
    if (draw_routing(M, k, E, &ids, &wts, &distinct) != 0)
        return -1;
    if (strcmp(name, "moe_forward") == 0 && bench_router(b, s, ids) != 0) {
        free(ids), free(wts);
        return -1;
    }
    b->weight_bytes = (double)distinct * (double)es *
                      ((gate ? 2.0 * (double)I * (double)K : 0.0) +
                       (final ? (double)K * (double)I : 0.0));
    int64_t rs[2] = {M, k};
    void *di = bench_upload(b, ids, (size_t)(M * k) * 4);
    void *dw = bench_upload(b, wts, (size_t)(M * k) * 4);
    free(ids);
    free(wts);
    if (!di || !dw)
        return -1;
    b->route.topk_ids = moefuse_tensor_dense(di, MOEFUSE_I32, 2, rs);
    b->route.topk_weights = moefuse_tensor_dense(dw, MOEFUSE_F32, 2, rs);
    int64_t xs[2] = {M, K}, w1s[3] = {E, 2 * I, K}, w2s[3] = {E, K, I}, hs[3] = {M, k, I};
    if (gate) {
        void *dx = bench_random(b, b->dtype, M * K, 1.0f, 31);
        void *dw1 = bench_random(b, b->dtype, E * 2 * I * K, 1.0f / 32.0f, 32);
        if (!dx || !dw1)
            return -1;
        b->x = moefuse_tensor_dense(dx, b->dtype, 2, xs);
        b->w1 = moefuse_tensor_dense(dw1, b->dtype, 3, w1s);
    }
    if (final) {
        void *dw2 = bench_random(b, b->dtype, E * K * I, 1.0f / 32.0f, 33);
        if (!dw2)
            return -1;
        b->w2 = moefuse_tensor_dense(dw2, b->dtype, 3, w2s);
    }
    if (strcmp(name, "moe_forward") != 0) {
        void *dh = strcmp(name, "moe_final") == 0 ? bench_random(b, b->dtype, M * k * I, 1.0f, 34)
                                                  : bench_alloc(b, (size_t)(M * k * I) * es);
        if (!dh)
            return -1;
        b->h = moefuse_tensor_dense(dh, b->dtype, 3, hs);
    }
    if (final) {
        void *dout = bench_alloc(b, (size_t)(M * K) * es);
        if (!dout)
            return -1;
        b->out = moefuse_tensor_dense(dout, b->dtype, 2, xs);
    }
    *work = 2.0 * (double)M * (double)k *
            ((gate ? 2.0 * (double)I * (double)K : 0.0) + (final ? (double)K * (double)I : 0.0));
    return 0;
}

/*
 * A backend buffer of n random e4m3 codes: random bytes with the exponent's top bit cleared
 * (|value| < 2, never a NaN code), made from one 64 MiB block uploaded again and again, so
 * that tens of GB of weights fill in seconds.
 */
static void *bench_fp8_codes(bench *b, int64_t n, uint64_t seed)
{
    void *dev = bench_alloc(b, (size_t)n);
    if (!dev)
        return NULL;
    const int64_t chunk = (int64_t)64 << 20;
    uint8_t *host = malloc((size_t)(n < chunk ? n : chunk));
    if (!host) {
        fprintf(stderr, "moefuse bench: out of host memory\n");
        return NULL;
    }
    rng r = rng_seed(seed);
    const int64_t len0 = n < chunk ? n : chunk;
    for (int64_t i = 0; i < len0; i++)
        host[i] = (uint8_t)(rng_below(&r, 256u) & 0xBFu);
    for (int64_t at = 0; at < n; at += chunk) {
        const int64_t len = n - at < chunk ? n - at : chunk;
        moefuse_status st = moefuse_buffer_write(b->ctx, dev, (size_t)at, host, (size_t)len);
        if (st != MOEFUSE_OK) {
            free(host);
            report_failure(b->ctx, "buffer_write", st);
            return NULL;
        }
    }
    free(host);
    return dev;
}

/* f32 block scales in [0.5, 1.5) x 1e-3 of an [E, rows / 128, depth / 128] weight. */
static moefuse_tensor bench_block_scales(bench *b, int64_t E, int64_t rows, int64_t depth,
                                         uint64_t seed)
{
    int64_t shape[3] = {E, rows / 128, depth / 128};
    const int64_t n = shape[0] * shape[1] * shape[2];
    float *host = malloc((size_t)n * sizeof *host);
    moefuse_tensor t = {0};
    if (!host)
        return t;
    rng r = rng_seed(seed);
    for (int64_t i = 0; i < n; i++)
        host[i] = 1e-3f * (1.0f + 0.5f * rng_uniform(&r));
    void *dev = bench_upload(b, host, (size_t)n * sizeof *host);
    free(host);
    if (dev)
        t = moefuse_tensor_dense(dev, MOEFUSE_F32, 3, shape);
    return t;
}

/* The FP8 MoE ops: FP8 weights with f32 block scales; bf16 x (or FP8 x with its scales). */
static int bench_setup_fp8(bench *b, shape_spec *s, double *work)
{
    const char *name = b->op->name;
    b->fp8 = 1;
    b->masked = strcmp(name, "moe_masked_fp8") == 0;
    int64_t xq = 0, ue8m0 = 0, T = 0;
    if (shape_int(s, name, "E", -1, 1 << 20, &b->E) != 0 ||
        shape_int(s, name, "K", -1, MAX_DIM, &b->K) != 0 ||
        shape_int(s, name, "I", -1, MAX_DIM, &b->I) != 0)
        return -1;
    if (b->masked) {
        if (shape_int(s, name, "Tmax", -1, MAX_DIM, &T) != 0 ||
            shape_int(s, name, "valid", T, T, &b->valid) != 0)
            return -1;
        b->M = T;
        b->k = 1;
    } else if (shape_int(s, name, "M", -1, MAX_DIM, &b->M) != 0 ||
               shape_int(s, name, "k", -1, 1 << 20, &b->k) != 0 ||
               shape_int(s, name, "xq", 0, 1, &xq) != 0 ||
               shape_int(s, name, "ue8m0", 0, 1, &ue8m0) != 0) {
        return -1;
    }
    if (b->K % 128 || b->I % 128 || (!b->masked && b->k > b->E)) {
        fprintf(stderr, "moefuse bench: FP8 MoE needs K and I multiples of 128 and k <= E\n");
        return -1;
    }
    const int64_t M = b->M, k = b->k, K = b->K, I = b->I, E = b->E;
    b->fo.act.ue8m0 = (int32_t)ue8m0;
    printf("weights: %.2f GB in f8_e4m3 with f32 128x128 block scales\n",
           (double)(E * 3 * I * K) / 1e9);
    void *dw1 = bench_fp8_codes(b, E * 2 * I * K, 32), *dw2 = bench_fp8_codes(b, E * K * I, 33);
    if (!dw1 || !dw2)
        return -1;
    int64_t w1s[3] = {E, 2 * I, K}, w2s[3] = {E, K, I};
    b->w1 = moefuse_tensor_dense(dw1, MOEFUSE_F8_E4M3, 3, w1s);
    b->w2 = moefuse_tensor_dense(dw2, MOEFUSE_F8_E4M3, 3, w2s);
    b->w1s = bench_block_scales(b, E, 2 * I, K, 34);
    b->w2s = bench_block_scales(b, E, K, I, 35);
    if (!b->w1s.data || !b->w2s.data)
        return -1;
    int64_t slots;
    if (b->masked) {
        int64_t xs[3] = {E, T, K}, cs[1] = {E};
        int32_t *counts = malloc((size_t)E * sizeof *counts);
        if (!counts)
            return -1;
        for (int64_t e = 0; e < E; e++)
            counts[e] = (int32_t)b->valid;
        void *dc = bench_upload(b, counts, (size_t)E * sizeof *counts);
        free(counts);
        void *dx = bench_random(b, MOEFUSE_BF16, E * T * K, 1.0f, 31);
        void *dout = bench_alloc(b, (size_t)(E * T * K) * 2);
        if (!dc || !dx || !dout)
            return -1;
        b->counts = moefuse_tensor_dense(dc, MOEFUSE_I32, 1, cs);
        b->x = moefuse_tensor_dense(dx, MOEFUSE_BF16, 3, xs);
        b->out = moefuse_tensor_dense(dout, MOEFUSE_BF16, 3, xs);
        slots = E * b->valid;
        b->weight_bytes = b->valid > 0 ? (double)(E * 3 * I * K) : 0.0;
    } else {
        int32_t *ids;
        float *wts;
        int64_t distinct;
        if (draw_routing(M, k, E, &ids, &wts, &distinct) != 0)
            return -1;
        if (bench_router(b, s, ids) != 0) {
            free(ids), free(wts);
            return -1;
        }
        int64_t rs[2] = {M, k}, xs[2] = {M, K}, ss[2] = {M, K / 128};
        void *di = bench_upload(b, ids, (size_t)(M * k) * 4);
        void *dw = bench_upload(b, wts, (size_t)(M * k) * 4);
        free(ids), free(wts);
        void *dout = bench_alloc(b, (size_t)(M * K) * 2);
        if (!di || !dw || !dout)
            return -1;
        b->route.topk_ids = moefuse_tensor_dense(di, MOEFUSE_I32, 2, rs);
        b->route.topk_weights = moefuse_tensor_dense(dw, MOEFUSE_F32, 2, rs);
        b->out = moefuse_tensor_dense(dout, MOEFUSE_BF16, 2, xs);
        void *dx = xq ? bench_fp8_codes(b, M * K, 31) : bench_random(b, MOEFUSE_BF16, M * K,
                                                                      1.0f, 31);
        if (!dx)
            return -1;
        b->x = moefuse_tensor_dense(dx, xq ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16, 2, xs);
        if (xq) {
            float *sc = malloc((size_t)(M * (K / 128)) * sizeof *sc);
            if (!sc)
                return -1;
            for (int64_t i = 0; i < M * (K / 128); i++)
                sc[i] = 0.01f;
            void *dsc = bench_upload(b, sc, (size_t)(M * (K / 128)) * sizeof *sc);
            free(sc);
            if (!dsc)
                return -1;
            b->xs = moefuse_tensor_dense(dsc, MOEFUSE_F32, 2, ss);
        }
        slots = M * k;
        b->weight_bytes = (double)distinct * (double)(3 * I * K);
    }
    *work = 2.0 * (double)slots * 3.0 * (double)I * (double)K;
    return 0;
}

static moefuse_status bench_call(bench *b)
{
    const char *n = b->op->name;
    moefuse_context *c = b->ctx;
    if (strcmp(n, "act_quant") == 0)
        return moefuse_act_quant(c, &b->x, NULL, &b->out, &b->scales, &b->aq);
    if (strcmp(n, "act_quant_masked") == 0)
        return moefuse_act_quant_masked(c, &b->x, &b->counts, NULL, NULL, &b->out, &b->scales,
                                        &b->aq);
    if (strcmp(n, "act_mul") == 0)
        return moefuse_act_mul(c, &b->x, NULL, &b->out, &b->ao);
    if (strcmp(n, "quant") == 0)
        return moefuse_quant(c, &b->x, &b->out, &b->scales, &b->qo);
    if (strcmp(n, "dequant") == 0)
        return moefuse_dequant(c, &b->x, &b->scales, &b->out, &b->qo);
    if (strcmp(n, "topk_softmax") == 0)
        return moefuse_topk_softmax(c, &b->x, 1, &b->route.topk_ids, &b->route.topk_weights);
    if (b->router) { /* the layer's routing from its logits, as an engine's step runs it */
        moefuse_status st = moefuse_topk_softmax(c, &b->logits, 1, &b->route.topk_ids,
                                                 &b->route.topk_weights);
        if (st != MOEFUSE_OK)
            return st;
    }
    if (strcmp(n, "moe_gate") == 0)
        return moefuse_moe_gate(c, &b->x, &b->w1, NULL, &b->route, &b->h, &b->mo);
    if (strcmp(n, "moe_final") == 0)
        return moefuse_moe_final(c, &b->h, &b->w2, NULL, &b->route, &b->out, &b->mo);
    if (strcmp(n, "moe_forward_fp8") == 0)
        return moefuse_moe_forward_fp8(c, &b->x, b->xs.data ? &b->xs : NULL, &b->w1, &b->w1s,
                                       &b->w2, &b->w2s, NULL, NULL, &b->route, &b->out, &b->fo);
    if (strcmp(n, "moe_masked_fp8") == 0)
        return moefuse_moe_masked_fp8(c, &b->x, NULL, &b->counts, &b->w1, &b->w1s, &b->w2,
                                      &b->w2s, NULL, NULL, &b->out, &b->fo);
    return moefuse_moe_forward(c, &b->x, &b->w1, &b->w2, NULL, NULL, &b->route, &b->out, &b->mo);
}

/* bench_call as a function of the pointer a graph's capture passes it. */
static moefuse_status bench_issue(void *b) { return bench_call(b); }

/* The workspace bench_call takes: the query of each call it makes, the larger of the two. */
static moefuse_status bench_workspace_size(bench *b, size_t *bytes)
{
    const char *n = b->op->name;
    moefuse_context *c = b->ctx;
    size_t router = 0;
    moefuse_status st = MOEFUSE_OK;
    if (b->router)
        st = moefuse_topk_softmax_workspace_size(c, &b->logits, 1, &b->route.topk_ids,
                                                 &b->route.topk_weights, &router);
    if (st != MOEFUSE_OK)
        return st;
    if (strcmp(n, "act_quant") == 0)
        st = moefuse_act_quant_workspace_size(c, &b->x, NULL, &b->out, &b->scales, &b->aq, bytes);
    else if (strcmp(n, "act_quant_masked") == 0)
        st = moefuse_act_quant_masked_workspace_size(c, &b->x, &b->counts, NULL, NULL, &b->out,
                                                     &b->scales, &b->aq, bytes);
    else if (strcmp(n, "act_mul") == 0)
        st = moefuse_act_mul_workspace_size(c, &b->x, NULL, &b->out, &b->ao, bytes);
    else if (strcmp(n, "quant") == 0)
        st = moefuse_quant_workspace_size(c, &b->x, &b->out, &b->scales, &b->qo, bytes);
    else if (strcmp(n, "dequant") == 0)
        st = moefuse_dequant_workspace_size(c, &b->x, &b->scales, &b->out, &b->qo, bytes);
    else if (strcmp(n, "topk_softmax") == 0)
        st = moefuse_topk_softmax_workspace_size(c, &b->x, 1, &b->route.topk_ids,
                                                 &b->route.topk_weights, bytes);
    else if (strcmp(n, "moe_gate") == 0)
        st = moefuse_moe_gate_workspace_size(c, &b->x, &b->w1, NULL, &b->route, &b->h, &b->mo,
                                             bytes);
    else if (strcmp(n, "moe_final") == 0)
        st = moefuse_moe_final_workspace_size(c, &b->h, &b->w2, NULL, &b->route, &b->out, &b->mo,
                                              bytes);
    else if (strcmp(n, "moe_forward_fp8") == 0)
        st = moefuse_moe_forward_fp8_workspace_size(c, &b->x, b->xs.data ? &b->xs : NULL, &b->w1,
                                                    &b->w1s, &b->w2, &b->w2s, NULL, NULL,
                                                    &b->route, &b->out, &b->fo, bytes);
    else if (strcmp(n, "moe_masked_fp8") == 0)
        st = moefuse_moe_masked_fp8_workspace_size(c, &b->x, NULL, &b->counts, &b->w1, &b->w1s,
                                                   &b->w2, &b->w2s, NULL, NULL, &b->out, &b->fo,
                                                   bytes);
    else
        st = moefuse_moe_forward_workspace_size(c, &b->x, &b->w1, &b->w2, NULL, NULL, &b->route,
                                                &b->out, &b->mo, bytes);
    if (st == MOEFUSE_OK && router > *bytes)
        *bytes = router;
    return st;
}

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
    int rc = 1;
    double work = 0.0;
    double *times = NULL;
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

    times = malloc((size_t)iters * sizeof *times);
    if (!times)
        goto done;
    const int tty = isatty(2);
    const double start = now_seconds();
    int progress = 0;
    if (batch < 0)
        batch = strcmp(moefuse_backend_name(b.ctx), "cpu") == 0 ? 1 : 10;
    char how[256] = "";
    const int graphed = graph ? bench_graph(&b, ceiling, batch, warmup, iters, times, how,
                                            sizeof how)
                              : 0;
    if (graphed < 0)
        goto done;
    /* Runs of `batch` calls timed on the host, unless the graph's replays timed them. */
    for (int64_t i = graphed ? iters : -warmup; i < iters; i++) {
        moefuse_synchronize(b.ctx);
        const double t0 = now_seconds();
        st = MOEFUSE_OK;
        for (int64_t c = 0; c < batch && st == MOEFUSE_OK; c++)
            st = bench_call(&b);
        if (st == MOEFUSE_OK)
            st = moefuse_synchronize(b.ctx);
        const double t1 = now_seconds();
        if (st != MOEFUSE_OK) {
            if (progress)
                fprintf(stderr, "\n");
            report_failure(b.ctx, b.op->name, st);
            goto done;
        }
        if (i >= 0)
            times[i] = (t1 - t0) / (double)batch;
        if (tty || t1 - start > 2.0) {
            progress = 1;
            if (i < 0)
                fprintf(stderr, "\r[bench] warm-up %lld/%lld   ", (long long)(i + warmup + 1),
                        (long long)warmup);
            else
                fprintf(stderr, "\r[bench] iter %lld/%lld      ", (long long)(i + 1),
                        (long long)iters);
            fflush(stderr);
        }
    }
    if (progress)
        fprintf(stderr, "\r%40s\r", "");
    const double med = median_sort(times, (size_t)iters);
    const double figure = work / med / 1e9;
    printf("time: %.4f ms median of %lld (min %.4f ms, max %.4f ms)", med * 1e3,
           (long long)iters, times[0] * 1e3, times[iters - 1] * 1e3);
    if (graphed)
        printf(", per call of %s", how);
    else if (batch > 1)
        printf(", per call of runs of %lld back-to-back calls", (long long)batch);
    printf("\n");

    if (gemm) {
        printf("work: %.3f GFLOP\n", work / 1e9);
        printf("figure: %.2f GFLOP/s\n", figure);
        printf("weights: %.3f GB of routed experts read -> at least %.2f GB/s\n",
               b.weight_bytes / 1e9, b.weight_bytes / med / 1e9);
    } else {
        printf("bytes moved: %.3f MB\n", work / 1e6);
        printf("figure: %.2f GB/s\n", figure);
    }
    fflush(stdout);

    /* The ceiling can take long too: 1 GiB copies, a GEMM library compiling its kernels. */
    if (tty || now_seconds() - start > 2.0) {
        fprintf(stderr, "[bench] measuring the ceiling on the %s backend...",
                moefuse_backend_name(b.ctx));
        fflush(stderr);
        progress = 1;
    }
    char what[256];
    double ceil = 0.0;
    if (!ceiling) {
        snprintf(what, sizeof what, "no ceiling for the %s backend in this build",
                 moefuse_backend_name(b.ctx));
    } else if (gemm) {
        /* Same FLOPs as one dense GEMM: [M*k, K] x [K, n] with n = 3I, 2I or I. */
        const int gate = strcmp(b.op->name, "moe_final") != 0;
        const int fin = strcmp(b.op->name, "moe_gate") != 0;
        const int64_t n = (gate ? 2 * b.I : 0) + (fin ? b.I : 0);
        const int64_t rows = b.masked ? b.E * b.valid : b.M * b.k;
        if (b.fp8 && ceiling->gemm_fp8_gflops)
            ceil = ceiling->gemm_fp8_gflops(b.ctx, rows, b.K, n, what, sizeof what);
        else
            ceil = ceiling->gemm_gflops(b.ctx, b.fp8 ? MOEFUSE_BF16 : dtype, rows, b.K, n, what,
                                        sizeof what);
    } else {
        ceil = ceiling->copy_gbs(b.ctx, what, sizeof what);
    }
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
        copy = ceiling->copy_gbs(b.ctx, copy_what, sizeof copy_what);
        if (ceiling->read_gbs)
            read = ceiling->read_gbs(b.ctx, read_what, sizeof read_what);
        else
            snprintf(read_what, sizeof read_what, "none measured on the %s backend",
                     moefuse_backend_name(b.ctx));
    }
    if (progress)
        fprintf(stderr, "\r%60s\r", "");
    print_ceiling(figure, ceil, gemm ? "GFLOP/s" : "GB/s", what);
    if (floors) {
        const double t_flops = work / (ceil * 1e9);
        print_floor("roofline floor", "roofline ratio", "copy", t_flops, b.weight_bytes, copy,
                    copy_what, med);
        print_floor("read floor", "read-floor ratio", "read", t_flops, b.weight_bytes, read,
                    read_what, med);
    }
    rc = 0;

done:
    free(times);
    for (int i = 0; i < b.nbuf; i++)
        moefuse_buffer_free(b.ctx, b.buf[i]);
    moefuse_context_destroy(b.ctx);
    return rc;
}
