/*
 * Contexts used from several threads at once, one context per thread as the API
 * asks. The test's own thread first runs THREADS sets of calls serially, each
 * with its own shapes and dtypes and each calling every operation (act_quant in
 * each scale layout, act_quant_masked, act_mul, quant, dequant, topk_softmax,
 * moe_gate, moe_final reduced and un-reduced, moe_forward), and keeps the
 * results. Then THREADS threads, each with a context of its own on the backend
 * under test, run those sets at the same time, ROUNDS rounds, thread i taking
 * set (i + round) % THREADS, so that every kernel runs next to every other (on
 * CUDA the sets take the f32, decode, mid-size and large GEMM kernels). Every
 * output must equal the serial one bit for bit, with the canaries around every
 * operand and the inputs untouched; outputs are poisoned before every round, so
 * a call that writes nothing fails. State a backend shares between contexts,
 * such as a static flag or scratch, shows up as a wrong result, an error or a
 * crash (and as a report under ThreadSanitizer).
 *
 * On the cpu backend with OpenMP each thread's calls open OpenMP teams of their
 * own: oversubscribed on a small machine, and correct all the same.
 *
 * A second test breaks the rule on purpose: two threads on one context, where
 * the one that finds the other inside a call must get MOEFUSE_ERR_CONTEXT_BUSY.
 *
 * The harness's tbuf helpers keep one global list and one RNG, so this program
 * keeps its buffers per thread; only the test's own thread asserts.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"

enum { THREADS = 4, ROUNDS = 8, CANARY = 64 };

/* ------------------------------------------------------------ operands */

/* Every operand of one set of calls: the index of a workload's spec and of a thread's view. */
enum {
    AQ_X, AQ_RS,                           /* act_quant: one x, five scale layouts */
    AQ_Q0, AQ_Q1, AQ_Q2, AQ_Q3, AQ_Q4,
    AQ_S0, AQ_S1, AQ_S2, AQ_S3, AQ_S4,
    MK_X, MK_COUNTS, MK_RS, MK_ES, MK_Q, MK_S, /* act_quant_masked */
    AM_OUT,                                /* act_mul of AQ_X */
    QU_X, QU_Q, QU_S,                      /* quant */
    DQ_Q, DQ_S, DQ_OUT,                    /* dequant */
    TK_LOGITS, TK_IDS, TK_W,               /* topk_softmax */
    MO_X, MO_W1, MO_W2, MO_B1, MO_B2, MO_IDS, MO_WTS, MO_MAP, MO_H_IN, /* MoE inputs */
    MO_H, MO_OUT, MO_Y, MO_FWD,            /* gate; final reduced, un-reduced; forward */
    N_OPERANDS
};

static const char *const NAMES[] = {
    "act_quant x", "act_quant row_scale", "act_quant q (row-major)", "act_quant q (column-major)",
    "act_quant q (row-major ue8m0)", "act_quant q (column-major ue8m0)", "act_quant q (packed)",
    "act_quant scales (row-major)", "act_quant scales (column-major)",
    "act_quant scales (row-major ue8m0)", "act_quant scales (column-major ue8m0)",
    "act_quant scales (packed)", "masked x", "masked counts", "masked row_scale",
    "masked expert_scale", "masked q", "masked scales", "act_mul out", "quant x", "quant q",
    "quant scales", "dequant q", "dequant scales", "dequant out", "topk logits", "topk ids",
    "topk weights", "moe x", "moe w1", "moe w2", "moe b1", "moe b2", "moe topk_ids",
    "moe topk_weights", "moe expert_map", "moe_final h", "moe_gate h", "moe_final out",
    "moe_final y (un-reduced)", "moe_forward out",
};
_Static_assert(sizeof NAMES / sizeof NAMES[0] == N_OPERANDS, "a name for every operand");

static const struct {
    moefuse_scale_layout layout;
    int ue8m0;
} LAYOUTS[5] = {
    {MOEFUSE_SCALE_ROW_MAJOR, 0},    {MOEFUSE_SCALE_COLUMN_MAJOR, 0}, {MOEFUSE_SCALE_ROW_MAJOR, 1},
    {MOEFUSE_SCALE_COLUMN_MAJOR, 1}, {MOEFUSE_SCALE_PACKED_UE8M0, 1},
};

typedef struct {
    moefuse_dtype dt;
    int rank;
    int64_t shape[3];
    int output;
    size_t bytes;        /* dense payload */
    unsigned char *host; /* an input's data; an output's result of the serial run */
} spec;

/* The shapes, options and data of one set of calls. */
typedef struct {
    moefuse_dtype dt;              /* activations and MoE weights */
    int64_t T, H, G;               /* act_quant, act_mul, quant, dequant */
    int64_t E, Tmax;               /* act_quant_masked (H and G as above) */
    int64_t M, K, I, Ex, k, Eg;    /* MoE and router; Eg > 0: an expert_map of Eg ids */
    moefuse_activation act;
    moefuse_scale_layout masked_layout;
    int zero_tail;
    spec op[N_OPERANDS];
} workload;

/* On CUDA: f32 (SIMT), bf16 decode (direct), f16 mid-size, bf16 large (wgmma on Hopper). */
static const struct {
    moefuse_dtype dt;
    int64_t T, H, G, E, Tmax, M, K, I, Ex, k, Eg;
    moefuse_activation act;
    moefuse_scale_layout masked_layout;
    int zero_tail;
} SHAPES[THREADS] = {
    /* dt, T, H, G, E, Tmax, M, K, I, Ex, k, Eg, activation, masked scale layout, zero_tail */
    {MOEFUSE_F32, 13, 256, 128, 3, 5, 9, 64, 48, 4, 2, 0, MOEFUSE_ACT_SILU, MOEFUSE_SCALE_ROW_MAJOR, 0},
    {MOEFUSE_BF16, 20, 512, 64, 4, 8, 2, 128, 64, 8, 2, 10, MOEFUSE_ACT_GELU, MOEFUSE_SCALE_COLUMN_MAJOR, 1},
    {MOEFUSE_F16, 7, 128, 32, 2, 3, 40, 64, 64, 4, 2, 0, MOEFUSE_ACT_GELU_TANH, MOEFUSE_SCALE_PACKED_UE8M0, 1},
    {MOEFUSE_BF16, 33, 384, 384, 5, 4, 128, 64, 32, 4, 2, 0, MOEFUSE_ACT_SILU, MOEFUSE_SCALE_COLUMN_MAJOR, 0},
};

static uint64_t next_random(uint64_t *state)
{ /* splitmix64: each workload has its own stream */
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *state, double a, double b)
{
    return a + (b - a) * ((double)(next_random(state) >> 11) * 0x1p-53);
}

static void define(workload *w, int i, moefuse_dtype dt, int rank, int64_t a, int64_t b, int64_t c,
                   int output)
{
    spec *s = &w->op[i];
    s->dt = dt;
    s->rank = rank;
    s->shape[0] = a, s->shape[1] = b, s->shape[2] = c;
    s->output = output;
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= s->shape[d];
    s->bytes = (size_t)n * moefuse_dtype_size(dt);
    s->host = output ? NULL : malloc(s->bytes);
}

static int64_t numel(const spec *s) { return (int64_t)(s->bytes / moefuse_dtype_size(s->dt)); }

/* Input values: uniform in [a, b] in the spec's dtype, or integers in [a, b] for i32. */
static void fill(workload *w, int i, uint64_t *rng, double a, double b)
{
    spec *s = &w->op[i];
    for (int64_t e = 0; e < numel(s); e++) {
        double v = uniform(rng, a, b);
        unsigned char *p = s->host + e * (int64_t)moefuse_dtype_size(s->dt);
        if (s->dt == MOEFUSE_I32) {
            int32_t iv = (int32_t)a + (int32_t)(next_random(rng) % (uint64_t)(b - a + 1));
            memcpy(p, &iv, 4);
        } else if (s->dt == MOEFUSE_F32) {
            float f = (float)v;
            memcpy(p, &f, 4);
        } else if (s->dt == MOEFUSE_F8_E4M3) {
            *p = or_f8_code(v);
        } else {
            uint16_t h = (uint16_t)or_encode(h_dt_or(s->dt), v);
            memcpy(p, &h, 2);
        }
    }
}

static void workload_init(workload *w, int which)
{
    memset(w, 0, sizeof *w);
    w->dt = SHAPES[which].dt;
    w->T = SHAPES[which].T, w->H = SHAPES[which].H, w->G = SHAPES[which].G;
    w->E = SHAPES[which].E, w->Tmax = SHAPES[which].Tmax;
    w->M = SHAPES[which].M, w->K = SHAPES[which].K, w->I = SHAPES[which].I;
    w->Ex = SHAPES[which].Ex, w->k = SHAPES[which].k, w->Eg = SHAPES[which].Eg;
    w->act = SHAPES[which].act;
    w->masked_layout = SHAPES[which].masked_layout;
    w->zero_tail = SHAPES[which].zero_tail;
    const moefuse_dtype dt = w->dt;
    const int64_t T = w->T, H = w->H, Gn = H / w->G, Ta = (T + 3) / 4 * 4;
    const int64_t E = w->E, Tm = w->Tmax, Tma = (Tm + 3) / 4 * 4;
    const int64_t M = w->M, K = w->K, I = w->I, Ex = w->Ex, k = w->k;

    define(w, AQ_X, dt, 2, T, 2 * H, 0, 0);
    define(w, AQ_RS, MOEFUSE_F32, 1, T, 0, 0, 0);
    for (int l = 0; l < 5; l++) {
        /* int8 codes where the layout allows them, FP8 elsewhere */
        define(w, AQ_Q0 + l, l == 1 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3, 2, T, H, 0, 1);
        if (LAYOUTS[l].layout == MOEFUSE_SCALE_ROW_MAJOR)
            define(w, AQ_S0 + l, LAYOUTS[l].ue8m0 ? MOEFUSE_U8 : MOEFUSE_F32, 2, T, Gn, 0, 1);
        else if (LAYOUTS[l].layout == MOEFUSE_SCALE_COLUMN_MAJOR)
            define(w, AQ_S0 + l, LAYOUTS[l].ue8m0 ? MOEFUSE_U8 : MOEFUSE_F32, 2, Gn, Ta, 0, 1);
        else
            define(w, AQ_S0 + l, MOEFUSE_I32, 2, (Gn + 3) / 4, Ta, 0, 1);
    }
    define(w, MK_X, dt, 3, E, Tm, 2 * H, 0);
    define(w, MK_COUNTS, MOEFUSE_I32, 1, E, 0, 0, 0);
    define(w, MK_RS, MOEFUSE_F32, 2, E, Tm, 0, 0);
    define(w, MK_ES, dt == MOEFUSE_F32 ? MOEFUSE_F32 : MOEFUSE_BF16, 1, E, 0, 0, 0);
    define(w, MK_Q, MOEFUSE_F8_E4M3, 3, E, Tm, H, 1);
    if (w->masked_layout == MOEFUSE_SCALE_ROW_MAJOR)
        define(w, MK_S, MOEFUSE_F32, 3, E, Tm, Gn, 1);
    else if (w->masked_layout == MOEFUSE_SCALE_COLUMN_MAJOR)
        define(w, MK_S, MOEFUSE_F32, 3, E, Gn, Tma, 1);
    else
        define(w, MK_S, MOEFUSE_I32, 3, E, (Gn + 3) / 4, Tma, 1);
    define(w, AM_OUT, dt, 2, T, H, 0, 1);
    define(w, QU_X, dt, 2, T, H, 0, 0);
    define(w, QU_Q, MOEFUSE_I8, 2, T, H, 0, 1);
    define(w, QU_S, MOEFUSE_F32, 2, T, Gn, 0, 1);
    define(w, DQ_Q, MOEFUSE_F8_E4M3, 2, T, H, 0, 0);
    define(w, DQ_S, MOEFUSE_F32, 2, T, Gn, 0, 0);
    define(w, DQ_OUT, dt, 2, T, H, 0, 1);
    define(w, TK_LOGITS, dt, 2, M, Ex, 0, 0);
    define(w, TK_IDS, MOEFUSE_I32, 2, M, k, 0, 1);
    define(w, TK_W, MOEFUSE_F32, 2, M, k, 0, 1);
    define(w, MO_X, dt, 2, M, K, 0, 0);
    define(w, MO_W1, dt, 3, Ex, 2 * I, K, 0);
    define(w, MO_W2, dt, 3, Ex, K, I, 0);
    define(w, MO_B1, dt, 2, Ex, 2 * I, 0, 0);
    define(w, MO_B2, MOEFUSE_F32, 2, Ex, K, 0, 0);
    define(w, MO_IDS, MOEFUSE_I32, 2, M, k, 0, 0);
    define(w, MO_WTS, MOEFUSE_F32, 2, M, k, 0, 0);
    define(w, MO_MAP, MOEFUSE_I32, 1, w->Eg > 0 ? w->Eg : 1, 0, 0, 0);
    define(w, MO_H_IN, dt, 3, M, k, I, 0);
    define(w, MO_H, dt, 3, M, k, I, 1);
    define(w, MO_OUT, dt, 2, M, K, 0, 1);
    define(w, MO_Y, MOEFUSE_F32, 3, M, k, K, 1);
    define(w, MO_FWD, dt, 2, M, K, 0, 1);

    uint64_t rng = g_seed ^ (0x51ED270B27ull * (uint64_t)(which + 1));
    fill(w, AQ_X, &rng, -4, 4);
    fill(w, AQ_RS, &rng, 0.5, 2);
    fill(w, MK_X, &rng, -4, 4);
    fill(w, MK_COUNTS, &rng, -1, (double)Tm + 1); /* clamped by the kernels */
    const int32_t full = (int32_t)Tm;               /* at least one expert has rows */
    memcpy(w->op[MK_COUNTS].host, &full, 4);
    fill(w, MK_RS, &rng, 0.5, 2);
    fill(w, MK_ES, &rng, 0.25, 4);
    fill(w, QU_X, &rng, -3, 3);
    fill(w, DQ_Q, &rng, -400, 400);
    fill(w, DQ_S, &rng, 1e-3, 1);
    fill(w, TK_LOGITS, &rng, -5, 5);
    fill(w, MO_X, &rng, -1, 1);
    fill(w, MO_W1, &rng, -0.25, 0.25);
    fill(w, MO_W2, &rng, -0.25, 0.25);
    fill(w, MO_B1, &rng, -0.5, 0.5);
    fill(w, MO_B2, &rng, -0.5, 0.5);
    /* ids: mostly valid, some negative or past the last expert (they contribute nothing) */
    fill(w, MO_IDS, &rng, -1, (double)(w->Eg > 0 ? w->Eg : Ex));
    fill(w, MO_WTS, &rng, 0.05, 1);
    fill(w, MO_MAP, &rng, -1, (double)Ex - 1); /* -1: an expert of another rank */
    fill(w, MO_H_IN, &rng, -2, 2);
}

static void workload_free(workload *w)
{
    for (int i = 0; i < N_OPERANDS; i++) free(w->op[i].host);
}

/* ------------------------------------------------------------ the calls */

/* Every call of w on ctx, in order, then a wait; *failed names the call that failed. */
static moefuse_status issue(moefuse_context *ctx, const workload *w, const moefuse_tensor *v,
                            const char **failed)
{
#define TRY(call)                                                                                 \
    do {                                                                                          \
        moefuse_status st_ = (call);                                                              \
        if (st_ != MOEFUSE_OK) {                                                                  \
            *failed = #call;                                                                      \
            return st_;                                                                           \
        }                                                                                         \
    } while (0)
    moefuse_act_quant_options aq;
    memset(&aq, 0, sizeof aq);
    aq.act.activation = w->act;
    aq.quant.group_size = w->G;
    for (int l = 0; l < 5; l++) {
        aq.quant.scale_layout = LAYOUTS[l].layout;
        aq.quant.ue8m0 = LAYOUTS[l].ue8m0;
        TRY(moefuse_act_quant(ctx, &v[AQ_X], &v[AQ_RS], &v[AQ_Q0 + l], &v[AQ_S0 + l], &aq));
    }
    aq.quant.scale_layout = w->masked_layout;
    aq.quant.ue8m0 = 0;
    aq.zero_tail = w->zero_tail;
    TRY(moefuse_act_quant_masked(ctx, &v[MK_X], &v[MK_COUNTS], &v[MK_RS], &v[MK_ES], &v[MK_Q],
                                 &v[MK_S], &aq));
    TRY(moefuse_act_mul(ctx, &v[AQ_X], NULL, &v[AM_OUT], &aq.act));
    moefuse_quant_options qo;
    memset(&qo, 0, sizeof qo);
    qo.group_size = w->G;
    TRY(moefuse_quant(ctx, &v[QU_X], &v[QU_Q], &v[QU_S], &qo));
    TRY(moefuse_dequant(ctx, &v[DQ_Q], &v[DQ_S], &v[DQ_OUT], &qo));
    TRY(moefuse_topk_softmax(ctx, &v[TK_LOGITS], 1, &v[TK_IDS], &v[TK_W]));
    moefuse_routing r;
    memset(&r, 0, sizeof r);
    r.topk_ids = v[MO_IDS];
    r.topk_weights = v[MO_WTS];
    if (w->Eg > 0) r.expert_map = v[MO_MAP];
    moefuse_moe_options mo;
    memset(&mo, 0, sizeof mo);
    mo.activation = w->act;
    TRY(moefuse_moe_gate(ctx, &v[MO_X], &v[MO_W1], &v[MO_B1], &r, &v[MO_H], &mo));
    TRY(moefuse_moe_final(ctx, &v[MO_H_IN], &v[MO_W2], &v[MO_B2], &r, &v[MO_OUT], &mo));
    TRY(moefuse_moe_final(ctx, &v[MO_H_IN], &v[MO_W2], &v[MO_B2], &r, &v[MO_Y], &mo));
    TRY(moefuse_moe_forward(ctx, &v[MO_X], &v[MO_W1], &v[MO_W2], &v[MO_B1], &v[MO_B2], &r,
                            &v[MO_FWD], &mo));
    TRY(moefuse_synchronize(ctx));
#undef TRY
    return MOEFUSE_OK;
}

/* ------------------------------------------------------------ one thread's run */

/* One thread's share: in round r, the workload (first + r) % THREADS, on a context of its own. */
typedef struct {
    workload *all;    /* THREADS workloads */
    int first, rounds;
    int record;       /* the serial run: keep the outputs as the workload's results */
    char error[1024]; /* the first failure, "" when none */
} job;

static int job_fail(job *j, const char *fmt, ...)
{
    if (j->error[0]) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->error, sizeof j->error, fmt, ap);
    va_end(ap);
    return -1;
}

static unsigned char canary_byte(size_t i) { return (unsigned char)(0xC3 ^ (i * 29)); }
static unsigned char poison_byte(size_t i) { return (unsigned char)(0xA5 ^ (i * 0x3B)); }

/* What an operand's buffer holds before a call: canaries, then the input or poison. */
static unsigned char *buffer_image(const spec *s)
{
    unsigned char *img = malloc(s->bytes + 2 * CANARY);
    for (size_t i = 0; i < s->bytes + 2 * CANARY; i++)
        img[i] = i < CANARY || i >= CANARY + s->bytes ? canary_byte(i) : poison_byte(i);
    if (!s->output) memcpy(img + CANARY, s->host, s->bytes);
    return img;
}

/* Checks one operand's buffer after a round; in the serial run, keeps an output's result. */
static int check_operand(job *j, workload *w, int i, const unsigned char *img, const unsigned char *now,
                         int round)
{
    spec *s = &w->op[i];
    const int which = (int)(w - j->all);
    const size_t total = s->bytes + 2 * CANARY;
    for (size_t b = 0; b < total; b++) {
        const int payload = b >= CANARY && b < CANARY + s->bytes;
        if ((!payload || !s->output) && now[b] != img[b])
            return job_fail(j, "round %d, workload %d: '%s': %s byte %zu changed (0x%02x -> 0x%02x)",
                            round, which, NAMES[i], payload ? "input" : "canary", b, img[b], now[b]);
    }
    if (!s->output) return 0;
    if (j->record) {
        if (memcmp(now + CANARY, img + CANARY, s->bytes) == 0)
            return job_fail(j, "serial run of workload %d: '%s' was not written", which, NAMES[i]);
        s->host = malloc(s->bytes);
        memcpy(s->host, now + CANARY, s->bytes);
        return 0;
    }
    for (size_t b = 0; b < s->bytes; b++)
        if (now[CANARY + b] != s->host[b])
            return job_fail(j, "round %d, workload %d: '%s' byte %zu is 0x%02x, the serial run wrote "
                               "0x%02x%s",
                            round, which, NAMES[i], b, now[CANARY + b], s->host[b],
                            now[CANARY + b] == poison_byte(CANARY + b) ? " (left unwritten)" : "");
    return 0;
}

/* Writes every buffer's image (inputs, poisoned outputs), runs the calls, checks every buffer. */
static int run_calls(job *j, moefuse_context *ctx, workload *w, void *const *buf,
                     const moefuse_tensor *v, unsigned char *const *img, int round)
{
    for (int i = 0; i < N_OPERANDS; i++)
        if (moefuse_buffer_write(ctx, buf[i], 0, img[i], w->op[i].bytes + 2 * CANARY) != MOEFUSE_OK)
            return job_fail(j, "buffer_write: %s", moefuse_last_error(ctx));
    const char *failed = "";
    moefuse_status st = issue(ctx, w, v, &failed);
    if (st != MOEFUSE_OK)
        return job_fail(j, "round %d, workload %d: %s: %s: %s", round, (int)(w - j->all), failed,
                        moefuse_status_name(st), moefuse_last_error(ctx));
    for (int i = 0; i < N_OPERANDS; i++) {
        const size_t total = w->op[i].bytes + 2 * CANARY;
        unsigned char *now = malloc(total);
        int bad = moefuse_buffer_read(ctx, buf[i], 0, now, total) != MOEFUSE_OK
                      ? job_fail(j, "buffer_read: %s", moefuse_last_error(ctx))
                      : check_operand(j, w, i, img[i], now, round);
        free(now);
        if (bad) return -1;
    }
    return 0;
}

/* One round: the workload's buffers are allocated, used and freed within it. */
static int run_round(job *j, moefuse_context *ctx, int round)
{
    workload *w = &j->all[(j->first + round) % THREADS];
    void *buf[N_OPERANDS] = {0};
    unsigned char *img[N_OPERANDS] = {0};
    moefuse_tensor v[N_OPERANDS];
    int bad = 0;
    for (int i = 0; i < N_OPERANDS && !bad; i++) {
        const spec *s = &w->op[i];
        img[i] = buffer_image(s);
        if (moefuse_buffer_alloc(ctx, s->bytes + 2 * CANARY, &buf[i]) != MOEFUSE_OK)
            bad = job_fail(j, "buffer_alloc: %s", moefuse_last_error(ctx));
        v[i] = moefuse_tensor_dense(buf[i], s->dt, s->rank, s->shape);
        v[i].offset = CANARY;
    }
    if (!bad) bad = run_calls(j, ctx, w, buf, v, img, round);
    for (int i = 0; i < N_OPERANDS; i++) {
        if (buf[i]) moefuse_buffer_free(ctx, buf[i]);
        free(img[i]);
    }
    return bad;
}

static void *run_job(void *arg)
{
    job *j = arg;
    moefuse_context *ctx = NULL;
    if (moefuse_context_create(&ctx, h_backend()) != MOEFUSE_OK) {
        job_fail(j, "context_create(%s): %s", h_backend(), moefuse_last_error(NULL));
        return NULL;
    }
    for (int r = 0; r < j->rounds && run_round(j, ctx, r) == 0; r++) continue;
    moefuse_context_destroy(ctx);
    return NULL;
}

/* ------------------------------------------------------------ tests */

START_TEST(t_contexts_on_threads)
{
    static workload w[THREADS];
    for (int i = 0; i < THREADS; i++) workload_init(&w[i], i);
    for (int i = 0; i < THREADS; i++) { /* on this thread, one workload after another */
        job serial = {.all = w, .first = i, .rounds = 1, .record = 1};
        run_job(&serial);
        HCHECK(!serial.error[0], "serial run of workload %d on %s: %s", i, h_backend(), serial.error);
    }
    static job conc[THREADS];
    pthread_t tid[THREADS];
    for (int i = 0; i < THREADS; i++) {
        conc[i] = (job){.all = w, .first = i, .rounds = ROUNDS, .record = 0};
        HCHECK(pthread_create(&tid[i], NULL, run_job, &conc[i]) == 0, "pthread_create");
    }
    for (int i = 0; i < THREADS; i++) pthread_join(tid[i], NULL);
    for (int i = 0; i < THREADS; i++)
        HCHECK(!conc[i].error[0], "thread %d of %d on %s: %s", i, THREADS, h_backend(), conc[i].error);
    for (int i = 0; i < THREADS; i++) workload_free(&w[i]);
}
END_TEST

/* ------------------------------------------------------------ one context, two threads */

enum { HOLD_BYTES = 64 << 20, HOLD_READS = 400 };

/* The context shared by a holder, which keeps it inside long buffer reads, and an intruder. */
typedef struct {
    moefuse_context *ctx;
    void *buf;                 /* HOLD_BYTES of pattern */
    atomic_int intruder_refused, holder_done;
    int holder_ok, holder_busy, holder_bad_data, intruder_ok;
    moefuse_status holder_other, intruder_other; /* a status other than OK and BUSY, or OK */
    char message[512];         /* the intruder's moefuse_last_error(NULL) when refused */
} shared_ctx;

static unsigned char pattern_byte(size_t i) { return (unsigned char)(i * 131 + (i >> 12)); }

static void *holder(void *arg)
{
    shared_ctx *c = arg;
    unsigned char *host = calloc(HOLD_BYTES, 1);
    for (int r = 0; r < HOLD_READS && !atomic_load(&c->intruder_refused); r++) {
        moefuse_status st = moefuse_buffer_read(c->ctx, c->buf, 0, host, HOLD_BYTES);
        if (st == MOEFUSE_ERR_CONTEXT_BUSY) { /* the intruder's call was inside at that moment */
            c->holder_busy++;
            continue;
        }
        if (st != MOEFUSE_OK) {
            c->holder_other = st;
            break;
        }
        c->holder_ok++;
        for (size_t i = 0; i < HOLD_BYTES; i += 4093) {
            c->holder_bad_data += host[i] != pattern_byte(i);
            host[i] = (unsigned char)~pattern_byte(i); /* the next read must bring it back */
        }
    }
    free(host);
    atomic_store(&c->holder_done, 1);
    return NULL;
}

static void *intruder(void *arg)
{
    shared_ctx *c = arg;
    while (!atomic_load(&c->holder_done)) {
        void *stream;
        moefuse_status st = moefuse_get_stream(c->ctx, &stream);
        if (st == MOEFUSE_ERR_CONTEXT_BUSY) {
            snprintf(c->message, sizeof c->message, "%s", moefuse_last_error(NULL));
            atomic_store(&c->intruder_refused, 1);
            break;
        }
        if (st != MOEFUSE_OK) {
            c->intruder_other = st;
            break;
        }
        c->intruder_ok++;
        /* a pause, so that the holder finds the context free most of the time */
        nanosleep(&(struct timespec){.tv_nsec = 50000}, NULL);
    }
    return NULL;
}

/*
 * Against the API's rule, two threads call into one context. The one that
 * finds the other inside a call is refused with MOEFUSE_ERR_CONTEXT_BUSY, its
 * message in its own moefuse_last_error(NULL); every call let in works, and the
 * context works afterwards. The holder reads 64 MB at a time and the intruder
 * calls every 50 us, so the intruder finds the holder inside a call within a
 * few reads.
 */
START_TEST(t_context_busy)
{
    static shared_ctx c;
    memset(&c, 0, sizeof c);
    HCHECK(moefuse_context_create(&c.ctx, h_backend()) == MOEFUSE_OK, "context_create: %s",
           moefuse_last_error(NULL));
    unsigned char *host = malloc(HOLD_BYTES);
    for (size_t i = 0; i < HOLD_BYTES; i++) host[i] = pattern_byte(i);
    HCHECK(moefuse_buffer_alloc(c.ctx, HOLD_BYTES, &c.buf) == MOEFUSE_OK, "buffer_alloc: %s",
           moefuse_last_error(c.ctx));
    HCHECK(moefuse_buffer_write(c.ctx, c.buf, 0, host, HOLD_BYTES) == MOEFUSE_OK, "buffer_write: %s",
           moefuse_last_error(c.ctx));
    free(host);
    pthread_t a, b;
    HCHECK(pthread_create(&a, NULL, holder, &c) == 0 && pthread_create(&b, NULL, intruder, &c) == 0,
           "pthread_create");
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    fprintf(stderr, "context_busy on %s: the holder read %d times (refused %d times); the intruder got in "
            "%d times, then was refused: %s\n", h_backend(), c.holder_ok, c.holder_busy, c.intruder_ok,
            atomic_load(&c.intruder_refused) ? "yes" : "no");
    HCHECK(c.holder_other == MOEFUSE_OK && c.intruder_other == MOEFUSE_OK,
           "a call on the shared context failed with %s (holder) / %s (intruder), not with "
           "MOEFUSE_ERR_CONTEXT_BUSY",
           moefuse_status_name(c.holder_other), moefuse_status_name(c.intruder_other));
    HCHECK(atomic_load(&c.intruder_refused),
           "the intruder was never refused: %d of its calls went through while the holder read "
           "64 MB %d times (%d times refused itself)", c.intruder_ok, c.holder_ok, c.holder_busy);
    HCHECK(strstr(c.message, "get_stream") && strstr(c.message, "another thread"),
           "the refusal's message \"%s\" should name the call and say why", c.message);
    HCHECK(c.holder_bad_data == 0, "%d sampled bytes of the holder's reads were wrong", c.holder_bad_data);
    HCHECK(moefuse_synchronize(c.ctx) == MOEFUSE_OK && moefuse_buffer_free(c.ctx, c.buf) == MOEFUSE_OK,
           "the context after the refusals: %s", moefuse_last_error(c.ctx));
    moefuse_context_destroy(c.ctx);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("threads");
    TCase *tc = h_add_tcase(s, "threads", NULL, 120);
    tcase_add_test(tc, t_contexts_on_threads);
    tcase_add_test(tc, t_context_busy);
    return h_run(s);
}
