/*
 * Fault injection (src/core/fault.h): every allocation an operation or a
 * context makes fails in turn, at hit 1, 2, 3 ... of each kind, until a call
 * runs without reaching the armed hit. A failing call must return a status
 * and a message that names what failed, leave every byte of every tensor as
 * it was, and the context must then run the same call again and give the bits
 * of a clean run. Every attempt starts from a fresh context, so the scratch a
 * context keeps has to grow (and can fail to) in each of them.
 */
#include <dirent.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/fault.h"
#include "harness.h"

static const mf_fault_kind kinds[] = {MF_FAULT_HOST_ALLOC, MF_FAULT_DEVICE_ALLOC,
                                      MF_FAULT_SCRATCH_GROW, MF_FAULT_PROGRAM_BUILD};
enum { KINDS = sizeof kinds / sizeof kinds[0], MAX_HITS = 64, MAX_OUTS = 5 };

/* An environment variable set for the length of one test (CK_FORK=no runs them in one
 * process): put_env remembers the old value, restore_env puts it back. */
static char saved_value[1024];
static bool saved_set;

static void put_env(const char *name, const char *value)
{
    const char *old = getenv(name);
    saved_set = old != NULL;
    snprintf(saved_value, sizeof saved_value, "%s", old ? old : "");
    setenv(name, value, 1);
}

static void restore_env(const char *name)
{
    if (saved_set)
        setenv(name, saved_value, 1);
    else
        unsetenv(name);
}

/* ------------------------------------------------------------ messages */

/* Words of which a message naming a failure of this kind holds at least one. */
static bool names_failure(mf_fault_kind kind, const char *msg)
{
    static const char *const words[KINDS][4] = {
        [MF_FAULT_HOST_ALLOC] = {"allocate", "host memory", NULL},
        [MF_FAULT_DEVICE_ALLOC] = {"clCreateBuffer", "cudaMalloc", "allocate", NULL},
        [MF_FAULT_SCRATCH_GROW] = {"scratch", "workspace", NULL},
        [MF_FAULT_PROGRAM_BUILD] = {"clBuildProgram", NULL},
    };
    for (int i = 0; words[kind][i]; i++)
        if (strstr(msg, words[kind][i]))
            return true;
    return false;
}

/* "op: ..." */
static bool starts_with_op(const char *msg, const char *op)
{
    const size_t n = strlen(op);
    return strncmp(msg, op, n) == 0 && msg[n] == ':';
}

/* A failed call's status and message: what failed, under the call's name. */
static void check_failure(const char *op, mf_fault_kind kind, moefuse_status st, const char *msg,
                          const char *what)
{
    const moefuse_status want = kind == MF_FAULT_PROGRAM_BUILD ? MOEFUSE_ERR_BACKEND_FAILURE
                                                               : MOEFUSE_ERR_OUT_OF_MEMORY;
    HCHECK(st == want, "%s: status %s, want %s (%s)", what, moefuse_status_name(st),
           moefuse_status_name(want), msg);
    HCHECK(names_failure(kind, msg), "%s: the message does not say what failed: '%s'", what, msg);
    /* moe_forward without a fused kernel is the core's gate + final on a workspace from
     * buffer_alloc: there the step that failed names itself */
    const bool forward_step =
        strcmp(op, "moe_forward") == 0 &&
        (starts_with_op(msg, "moe_gate") || starts_with_op(msg, "moe_final") ||
         starts_with_op(msg, "buffer_alloc"));
    HCHECK(starts_with_op(msg, op) || forward_step,
           "%s: the message does not start with '%s: ': '%s'", what, op, msg);
}

/* -------------------------------------------------- outputs and their bits */

static tbuf *outs[MAX_OUTS];
static int n_outs;

static void add_out(tbuf *t)
{
    ck_assert(n_outs < MAX_OUTS);
    outs[n_outs++] = t;
}

/* The whole buffers of the outputs (canaries and padding included) after a clean run. */
typedef struct snapshot {
    unsigned char *bytes[MAX_OUTS];
    size_t size[MAX_OUTS];
    int count;
} snapshot;

static void snapshot_take(snapshot *s)
{
    s->count = n_outs;
    for (int i = 0; i < n_outs; i++) {
        s->size[i] = outs[i]->total;
        s->bytes[i] = malloc(outs[i]->total);
        memcpy(s->bytes[i], outs[i]->full, outs[i]->total);
    }
}

static void snapshot_expect(const snapshot *s, const char *what)
{
    HCHECK(s->count == n_outs, "%s: %d outputs, the clean run had %d", what, n_outs, s->count);
    for (int i = 0; i < n_outs; i++) {
        HCHECK(s->size[i] == outs[i]->total, "%s: %s changed size", what, outs[i]->name);
        if (memcmp(s->bytes[i], outs[i]->full, s->size[i]) == 0)
            continue;
        size_t b = 0;
        while (s->bytes[i][b] == outs[i]->full[b])
            b++;
        HCHECK(0, "%s: %s differs from the clean run at byte %zu (0x%02x, clean 0x%02x)", what,
               outs[i]->name, b, outs[i]->full[b], s->bytes[i][b]);
    }
}

static void snapshot_free(snapshot *s)
{
    for (int i = 0; i < s->count; i++)
        free(s->bytes[i]);
    memset(s, 0, sizeof *s);
}

/* ------------------------------------------------------------ operations */

/* One call under test: its name, operands built in g_ctx, the call itself; warm: a
 * first call on half the tokens can come before it, so scratch grows from a smaller one. */
typedef struct op_case {
    const char *op;
    void (*build)(void);
    moefuse_status (*call)(void);
    bool warm;
} op_case;

static tbuf *X, *Q, *S, *OUT, *RS, *COUNTS;
static tbuf *W1, *W2, *B1, *B2, *H, *IDS, *WTS;
static moefuse_act_quant_options aq_opt;
static moefuse_quant_options q_opt;
static moefuse_act_options act_opt;
static moefuse_moe_options moe_opt;

static tbuf *input2(const char *name, moefuse_dtype dt, int64_t a, int64_t b, double lo, double hi)
{
    return tb_upload_unif(tb_new2(name, dt, a, b, 3, 1), lo, hi);
}

static tbuf *input3(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t c, double lo,
                    double hi)
{
    return tb_upload_unif(tb_new3(name, dt, a, b, c, 1, 1), lo, hi);
}

/* The same with rows packed: every row starts at a multiple of 8 elements (OpenCL's wide tiles
 * take it). */
static tbuf *input3_packed(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t c,
                           double lo, double hi)
{
    return tb_upload_unif(tb_new3(name, dt, a, b, c, 0, 1), lo, hi);
}

/* act_quant: x [5, 512] bf16 -> q f8 [5, 256], column-major scales [2, 8], row_scale. */
static void build_act_quant(void)
{
    X = input2("x", MOEFUSE_BF16, 5, 512, -3, 3);
    RS = tb_upload_unif(tb_new1("row_scale", MOEFUSE_F32, 5, 1), 0.5, 2);
    Q = tb_new2("q", MOEFUSE_F8_E4M3, 5, 256, 5, 0);
    S = h_new_scales("scales", MOEFUSE_SCALE_COLUMN_MAJOR, 0, 0, 5, 2, 1);
    add_out(Q);
    add_out(S);
    memset(&aq_opt, 0, sizeof aq_opt);
    aq_opt.quant.scale_layout = MOEFUSE_SCALE_COLUMN_MAJOR;
}
static moefuse_status call_act_quant(void)
{
    return moefuse_act_quant(g_ctx, T(X), T(RS), T(Q), T(S), &aq_opt);
}

/* Masked: E = 4100 experts (more than the CUDA backend keeps offsets of in shared
 * memory, so it takes scratch), Tmax = 2, counts in [-1, 3] (clamped), zero_tail. */
enum { MASKED_E = 4100 };
static void build_masked(void)
{
    X = input3("x", MOEFUSE_BF16, MASKED_E, 2, 256, -3, 3);
    COUNTS = tb_new1("counts", MOEFUSE_I32, MASKED_E, 1);
    for (int64_t e = 0; e < MASKED_E; e++)
        tb_set(COUNTS, e, 0, 0, (double)h_randint(-1, 3));
    tb_upload(COUNTS);
    Q = tb_new3("q", MOEFUSE_F8_E4M3, MASKED_E, 2, 128, 0, 0);
    S = h_new_scales("scales", MOEFUSE_SCALE_ROW_MAJOR, 0, MASKED_E, 2, 1, 0);
    add_out(Q);
    add_out(S);
    memset(&aq_opt, 0, sizeof aq_opt);
    aq_opt.zero_tail = 1;
}
static moefuse_status call_masked(void)
{
    return moefuse_act_quant_masked(g_ctx, T(X), T(COUNTS), NULL, NULL, T(Q), T(S), &aq_opt);
}

/* act_mul: x [5, 512] f32 -> out f32 [5, 256], GELU (erf: the f64 path of OpenCL devices). */
static void build_act_mul(void)
{
    X = input2("x", MOEFUSE_F32, 5, 512, -4, 4);
    OUT = tb_new2("out", MOEFUSE_F32, 5, 256, 2, 0);
    add_out(OUT);
    memset(&act_opt, 0, sizeof act_opt);
    act_opt.activation = MOEFUSE_ACT_GELU;
}
static moefuse_status call_act_mul(void)
{
    return moefuse_act_mul(g_ctx, T(X), NULL, T(OUT), &act_opt);
}

/* quant: x [6, 256] f16 -> q i8, row-major scales, G = 64. */
static void build_quant(void)
{
    X = input2("x", MOEFUSE_F16, 6, 256, -5, 5);
    Q = tb_new2("q", MOEFUSE_I8, 6, 256, 1, 0);
    S = h_new_scales("scales", MOEFUSE_SCALE_ROW_MAJOR, 0, 0, 6, 4, 0);
    add_out(Q);
    add_out(S);
    memset(&q_opt, 0, sizeof q_opt);
    q_opt.group_size = 64;
}
static moefuse_status call_quant(void) { return moefuse_quant(g_ctx, T(X), T(Q), T(S), &q_opt); }

/* dequant: q f8 [6, 256] with row-major f32 scales [6, 2] -> out bf16. */
static void build_dequant(void)
{
    Q = input2("q", MOEFUSE_F8_E4M3, 6, 256, -400, 400);
    S = tb_upload_unif(tb_new2("scales", MOEFUSE_F32, 6, 2, 0, 1), 0.01, 2);
    OUT = tb_new2("out", MOEFUSE_BF16, 6, 256, 4, 0);
    add_out(OUT);
    memset(&q_opt, 0, sizeof q_opt);
}
static moefuse_status call_dequant(void)
{
    return moefuse_dequant(g_ctx, T(Q), T(S), T(OUT), &q_opt);
}

/* topk_softmax: logits [7, 16] f32 -> top 4, renormalized. */
static void build_topk(void)
{
    X = input2("logits", MOEFUSE_F32, 7, 16, -4, 4);
    IDS = tb_new2("ids", MOEFUSE_I32, 7, 4, 1, 0);
    WTS = tb_new2("weights", MOEFUSE_F32, 7, 4, 0, 0);
    add_out(IDS);
    add_out(WTS);
}
static moefuse_status call_topk(void)
{
    return moefuse_topk_softmax(g_ctx, T(X), 1, T(IDS), T(WTS));
}

/* topk_route: the same shapes, DeepSeek-V3's options, a choice bias. */
static tbuf *CBIAS;
static const moefuse_router_options route_opt = {.scoring = MOEFUSE_ROUTER_SIGMOID,
                                                 .n_group = 4,
                                                 .topk_group = 2,
                                                 .renormalize = 1,
                                                 .scale = 2.5f};
static void build_route(void)
{
    build_topk();
    CBIAS = tb_upload_unif(tb_new1("choice_bias", MOEFUSE_F32, 16, 1), -0.1, 0.1);
}
static moefuse_status call_route(void)
{
    return moefuse_topk_route(g_ctx, T(X), NULL, T(CBIAS), &route_opt, T(IDS), T(WTS));
}

/* routing_metadata: ids [7, 4] of 16 experts (some invalid) -> every output, blocks of 4. */
static tbuf *COUNTS, *OFFS, *ORDER, *POS, *MROW;
static void build_meta(void)
{
    IDS = tb_new2("topk_ids", MOEFUSE_I32, 7, 4, 1, 1);
    for (int64_t m = 0; m < 7; m++)
        for (int64_t j = 0; j < 4; j++)
            tb_set(IDS, m, j, 0, (double)((m * 5 + j * 3) % 18 - 1));
    tb_upload(IDS);
    COUNTS = tb_new1("counts", MOEFUSE_I32, 16, 0);
    OFFS = tb_new1("offsets", MOEFUSE_I32, 17, 0);
    ORDER = tb_new1("order", MOEFUSE_I32, 28 + 16 * 3, 0);
    POS = tb_new2("position", MOEFUSE_I32, 7, 4, 0, 0);
    MROW = tb_new2("masked_row", MOEFUSE_I32, 7, 4, 2, 0);
    add_out(COUNTS);
    add_out(OFFS);
    add_out(ORDER);
    add_out(POS);
    add_out(MROW);
}
static moefuse_status call_meta(void)
{
    moefuse_routing r;
    memset(&r, 0, sizeof r);
    r.topk_ids = *T(IDS);
    moefuse_routing_meta meta = {*T(COUNTS), *T(OFFS), *T(ORDER), *T(POS), *T(MROW)};
    return moefuse_routing_metadata(g_ctx, &r, 4, &meta);
}

/* > 0 while warming up: the MoE calls see only the first tokens_limit tokens. */
static int64_t tokens_limit;

/* A tensor whose first dimension is the tokens, cut to tokens_limit. */
static moefuse_tensor *tok(tbuf *t)
{
    static moefuse_tensor views[8];
    static unsigned next;
    moefuse_tensor *v = &views[next++ % 8];
    *v = t->t;
    if (tokens_limit > 0 && v->shape[0] > tokens_limit)
        v->shape[0] = tokens_limit;
    return v;
}

/*
 * A MoE layer of M tokens, top-k of E experts, with invalid slots (-1, >= E)
 * and a token without any valid slot, so that the kernels zero rows too.
 * S = M * k above 16 takes the CUDA backend's routed mode, below its direct one.
 */
static int64_t moe_M, moe_k, moe_K, moe_I, moe_E;
static moefuse_dtype moe_dt;

static void moe_shape(int64_t M, int64_t k, int64_t K, int64_t I, int64_t E, moefuse_dtype dt)
{
    moe_M = M, moe_k = k, moe_K = K, moe_I = I, moe_E = E, moe_dt = dt;
}

static void build_routing(bool bias)
{
    IDS = tb_new2("topk_ids", MOEFUSE_I32, moe_M, moe_k, 1, 1);
    WTS = tb_new2("topk_weights", MOEFUSE_F32, moe_M, moe_k, 0, 1);
    for (int64_t m = 0; m < moe_M; m++)
        for (int64_t j = 0; j < moe_k; j++) {
            int64_t id = h_randint(0, moe_E - 1);
            if (h_randint(0, 6) == 0)
                id = h_randint(0, 1) ? -1 : moe_E;
            if (m == 0 && moe_M > 1)
                id = -1;
            tb_set(IDS, m, j, 0, (double)id);
            tb_set(WTS, m, j, 0, h_unif(0.05, 1));
        }
    tb_upload(IDS);
    tb_upload(WTS);
    B1 = B2 = NULL;
    if (bias) {
        B1 = input2("b1", moe_dt, moe_E, 2 * moe_I, -0.5, 0.5);
        B2 = input2("b2", moe_dt, moe_E, moe_K, -0.5, 0.5);
    }
    memset(&moe_opt, 0, sizeof moe_opt);
}

static moefuse_routing routing(void)
{
    moefuse_routing r;
    memset(&r, 0, sizeof r);
    r.topk_ids = *tok(IDS);
    r.topk_weights = *tok(WTS);
    return r;
}

static void build_gate(void)
{
    X = input2("x", moe_dt, moe_M, moe_K, -1, 1);
    W1 = input3("w1", moe_dt, moe_E, 2 * moe_I, moe_K, -0.25, 0.25);
    build_routing(true);
    H = tb_new3("h", moe_dt, moe_M, moe_k, moe_I, 2, 0);
    add_out(H);
}
static moefuse_status call_gate(void)
{
    moefuse_routing r = routing();
    return moefuse_moe_gate(g_ctx, tok(X), T(W1), T(B1), &r, tok(H), &moe_opt);
}

static void build_final(bool reduce)
{
    H = input3("h", moe_dt, moe_M, moe_k, moe_I, -1, 1);
    W2 = input3("w2", moe_dt, moe_E, moe_K, moe_I, -0.25, 0.25);
    build_routing(moe_K < 1024); /* no bias in the big chunked case: less to build */
    OUT = reduce ? tb_new2("out", MOEFUSE_F32, moe_M, moe_K, 1, 0)
                 : tb_new3("out", MOEFUSE_F32, moe_M, moe_k, moe_K, 1, 0);
    add_out(OUT);
}
static void build_final_reduced(void) { build_final(true); }
static void build_final_reduced_packed(void)
{
    H = input3_packed("h", moe_dt, moe_M, moe_k, moe_I, -1, 1);
    W2 = input3_packed("w2", moe_dt, moe_E, moe_K, moe_I, -0.25, 0.25);
    build_routing(false);
    OUT = tb_new2("out", MOEFUSE_F32, moe_M, moe_K, 1, 0);
    add_out(OUT);
}
static void build_final_slots(void) { build_final(false); }
static moefuse_status call_final(void)
{
    moefuse_routing r = routing();
    return moefuse_moe_final(g_ctx, tok(H), T(W2), T(B2), &r, tok(OUT), &moe_opt);
}

static void build_forward(void)
{
    X = input2("x", moe_dt, moe_M, moe_K, -1, 1);
    W1 = input3("w1", moe_dt, moe_E, 2 * moe_I, moe_K, -0.25, 0.25);
    W2 = input3("w2", moe_dt, moe_E, moe_K, moe_I, -0.25, 0.25);
    build_routing(true);
    OUT = tb_new2("out", MOEFUSE_BF16, moe_M, moe_K, 3, 0);
    add_out(OUT);
}
static moefuse_status call_forward(void)
{
    moefuse_routing r = routing();
    return moefuse_moe_forward(g_ctx, tok(X), T(W1), T(W2), T(B1), T(B2), &r, tok(OUT),
                               &moe_opt);
}

/* -------------------------------------------------------------- attempts */

/* A call on the first half of the tokens, then the outputs' poison back in place. */
static void warm_up(const op_case *c)
{
    tokens_limit = moe_M / 2 > 0 ? moe_M / 2 : 1;
    moefuse_status st = c->call();
    tokens_limit = 0;
    HCHECK(st == MOEFUSE_OK, "%s: the warm-up call failed: %s", c->op, moefuse_last_error(g_ctx));
    for (int i = 0; i < n_outs; i++)
        tb_upload(outs[i]); /* its host bytes are still the poison: nothing was read back */
}

/*
 * One call on a fresh context (warmed up first when `warm`) with `kind` armed
 * at hit `nth` (0: a clean run, which fills `clean`). Returns whether the fault
 * fired; *failures counts the calls it made fail.
 */
static bool attempt(const op_case *c, bool warm, mf_fault_kind kind, int64_t nth,
                    snapshot *clean, int *failures)
{
    h_setup(); /* also restarts the RNG: every attempt builds the same bytes */
    n_outs = 0;
    c->build();
    if (warm)
        warm_up(c);
    char what[200];
    snprintf(what, sizeof what, "%s on %s%s, %s failing at hit %lld", c->op, h_backend(),
             warm ? " after a smaller call" : "", mf_fault_kind_name(kind), (long long)nth);
    mf_fault_arm(kind, nth);
    moefuse_status st = c->call();
    const bool fired = nth > 0 && mf_fault_fired(kind);
    mf_fault_disarm_all();
    if (st != MOEFUSE_OK) {
        const char *msg = moefuse_last_error(g_ctx);
        HCHECK(fired, "%s: failed with no fault injected: %s: %s", what, moefuse_status_name(st),
               msg);
        check_failure(c->op, kind, st, msg, what);
        h_check_all(1); /* nothing written: every byte of every tensor as uploaded */
        (*failures)++;
        st = c->call(); /* the same call again, nothing armed: the context still works */
        HCHECK(st == MOEFUSE_OK, "%s: the next call failed: %s: %s", what, moefuse_status_name(st),
               moefuse_last_error(g_ctx));
    }
    h_check_all(0);
    if (nth == 0)
        snapshot_take(clean);
    else
        snapshot_expect(clean, what);
    h_teardown();
    return fired;
}

/* Every kind at hit 1, 2, ... until the call no longer reaches the armed hit; on a
 * fresh context, then (warm cases) after a smaller call. */
static void run_case(const op_case *c)
{
    snapshot clean = {0};
    int unused = 0;
    attempt(c, false, MF_FAULT_HOST_ALLOC, 0, &clean, &unused);
    for (int warm = 0; warm <= (int)c->warm; warm++)
        for (int k = 0; k < KINDS; k++) {
            int failures = 0;
            int64_t nth = 1;
            while (nth <= MAX_HITS && attempt(c, warm, kinds[k], nth, &clean, &failures))
                nth++;
            HCHECK(nth <= MAX_HITS, "%s: still reaching hit %d of %s", c->op, MAX_HITS,
                   mf_fault_kind_name(kinds[k]));
            fprintf(stderr, "%-16s %-6s %-5s %-18s %lld hit(s), %d failed cleanly\n", c->op,
                    h_backend(), warm ? "warm" : "fresh", mf_fault_kind_name(kinds[k]),
                    (long long)(nth - 1), failures);
        }
    snapshot_free(&clean);
}

START_TEST(t_rows)
{
    const op_case cases[] = {
        {"act_quant", build_act_quant, call_act_quant, false},
        {"act_quant_masked", build_masked, call_masked, false},
        {"act_mul", build_act_mul, call_act_mul, false},
        {"quant", build_quant, call_quant, false},
        {"dequant", build_dequant, call_dequant, false},
        {"topk_softmax", build_topk, call_topk, false},
        {"topk_route", build_route, call_route, false},
        {"routing_metadata", build_meta, call_meta, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
}
END_TEST

static void run_moe_cases(void)
{
    const op_case cases[] = {
        {"moe_gate", build_gate, call_gate, true},
        {"moe_final", build_final_reduced, call_final, true},
        {"moe_final", build_final_slots, call_final, true},
        {"moe_forward", build_forward, call_forward, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
}

START_TEST(t_moe_routed)
{
    moe_shape(12, 2, 64, 32, 4, MOEFUSE_BF16);
    run_moe_cases();
}
END_TEST

START_TEST(t_moe_decode)
{
    moe_shape(2, 2, 64, 32, 4, MOEFUSE_F32);
    run_moe_cases();
}
END_TEST

/*
 * The reduced final in more than one chunk: its f32 y rows exceed the 64 MiB a
 * chunk may use (1030 tokens x 8 slots x 2048 channels), so the output is
 * written chunk by chunk. On OpenCL the tiled GEMMs are forced: they chunk.
 */
START_TEST(t_final_chunked)
{
    put_env("MOEFUSE_OPENCL_GEMM", "tiled"); /* read by each new context */
    moe_shape(1030, 8, 2048, 16, 8, MOEFUSE_F32);
    const op_case c = {"moe_final", build_final_reduced, call_final, true};
    run_case(&c);
    restore_env("MOEFUSE_OPENCL_GEMM");
}
END_TEST

/*
 * The same with the wide tiles forced on OpenCL (rows packed, so that they take them), whose
 * chunk grows past 64 MiB until it averages 128 slots an expert (128 experts, 2048 channels:
 * 2048 tokens a chunk, 134 MB of y), so the grown chunk and the last, short one are both failed
 * in turn.
 */
START_TEST(t_final_chunked_wide)
{
    put_env("MOEFUSE_OPENCL_GEMM", "wide");
    moe_shape(2100, 8, 2048, 16, 128, MOEFUSE_F32);
    const op_case c = {"moe_final", build_final_reduced_packed, call_final, true};
    run_case(&c);
    restore_env("MOEFUSE_OPENCL_GEMM");
}
END_TEST

/* ---------------------------------------------------------------- buffers */

START_TEST(t_buffer_alloc)
{
    h_setup();
    void *buf = (void *)1;
    mf_fault_arm(MF_FAULT_DEVICE_ALLOC, 1);
    moefuse_status st = moefuse_buffer_alloc(g_ctx, 4096, &buf);
    HCHECK(mf_fault_fired(MF_FAULT_DEVICE_ALLOC), "buffer_alloc never reached a device allocation");
    mf_fault_disarm_all();
    check_failure("buffer_alloc", MF_FAULT_DEVICE_ALLOC, st, moefuse_last_error(g_ctx),
                  "buffer_alloc with a device allocation failing");
    HCHECK(buf == NULL, "a failed buffer_alloc left a pointer behind");

    /* Host allocations inside buffer_alloc (the OpenCL table of handles) fail
     * too, at each growth; the buffers allocated before stay usable. */
    enum { N = 100 };
    void *bufs[N];
    int n = 0, failed = 0;
    for (int i = 0; i < N; i++) {
        mf_fault_arm(MF_FAULT_HOST_ALLOC, 1);
        void *b = NULL;
        st = moefuse_buffer_alloc(g_ctx, 64, &b);
        const bool fired = mf_fault_fired(MF_FAULT_HOST_ALLOC);
        mf_fault_disarm_all();
        if (fired) {
            check_failure("buffer_alloc", MF_FAULT_HOST_ALLOC, st, moefuse_last_error(g_ctx),
                          "buffer_alloc with a host allocation failing");
            HCHECK(b == NULL, "a failed buffer_alloc left a pointer behind");
            failed++;
            st = moefuse_buffer_alloc(g_ctx, 64, &b); /* nothing armed now */
        }
        HCHECK(st == MOEFUSE_OK, "buffer_alloc %d: %s", i, moefuse_last_error(g_ctx));
        unsigned char v[64];
        memset(v, i, sizeof v);
        HCHECK(moefuse_buffer_write(g_ctx, b, 0, v, sizeof v) == MOEFUSE_OK, "write %d: %s", i,
               moefuse_last_error(g_ctx));
        bufs[n++] = b;
    }
    for (int i = 0; i < n; i++) {
        unsigned char v[64];
        HCHECK(moefuse_buffer_read(g_ctx, bufs[i], 0, v, sizeof v) == MOEFUSE_OK, "read %d: %s",
               i, moefuse_last_error(g_ctx));
        HCHECK(v[0] == (unsigned char)i && v[63] == (unsigned char)i, "buffer %d lost its bytes",
               i);
        moefuse_buffer_free(g_ctx, bufs[i]);
    }
    fprintf(stderr, "buffer_alloc %-8s %d host allocation(s) failed cleanly\n", h_backend(),
            failed);
    h_teardown();
}
END_TEST

/* ------------------------------------------------------------ contexts */

/* An act_mul with GELU and a small moe_forward through the buffer calls, whose
 * bytes (malloc'd, *bytes long) say whether two contexts compute alike. */
static unsigned char *context_bits(moefuse_context *ctx, size_t *bytes)
{
    enum { T_ = 4, H_ = 256, M_ = 3, K_ = 32, I_ = 16, E_ = 3, KK = 2 };
    static float x[T_][2 * H_], xm[M_][K_], w1[E_][2 * I_][K_], w2[E_][K_][I_], wts[M_][KK];
    static int32_t ids[M_][KK] = {{0, 2}, {1, -1}, {2, 1}};
    uint64_t r = 0x9E3779B97F4A7C15ull;
#define NEXT() ((r = r * 6364136223846793005ull + 1442695040888963407ull) >> 40)
    float *all[5] = {&x[0][0], &xm[0][0], &w1[0][0][0], &w2[0][0][0], &wts[0][0]};
    const size_t counts[5] = {sizeof x / 4, sizeof xm / 4, sizeof w1 / 4, sizeof w2 / 4,
                              sizeof wts / 4};
    for (int a = 0; a < 5; a++)
        for (size_t i = 0; i < counts[a]; i++)
            all[a][i] = (float)((double)NEXT() / (double)(1 << 24) - 0.5) * (a == 0 ? 8.0f : 1.0f);
#undef NEXT
    const size_t out1 = sizeof(float) * T_ * H_, out2 = sizeof(float) * M_ * K_;
    unsigned char *res = calloc(1, out1 + out2);
    void *b[8] = {0};
    const void *src[6] = {x, xm, w1, w2, ids, wts};
    const size_t size[8] = {sizeof x, sizeof xm, sizeof w1, sizeof w2, sizeof ids, sizeof wts,
                            out1, out2};
    for (int i = 0; i < 8; i++) {
        HCHECK(moefuse_buffer_alloc(ctx, size[i], &b[i]) == MOEFUSE_OK, "alloc: %s",
               moefuse_last_error(ctx));
        if (i < 6)
            HCHECK(moefuse_buffer_write(ctx, b[i], 0, src[i], size[i]) == MOEFUSE_OK, "write: %s",
                   moefuse_last_error(ctx));
    }
    int64_t xs[2] = {T_, 2 * H_}, os[2] = {T_, H_}, ms[2] = {M_, K_}, w1s[3] = {E_, 2 * I_, K_},
            w2s[3] = {E_, K_, I_}, rs[2] = {M_, KK};
    moefuse_tensor tx = moefuse_tensor_dense(b[0], MOEFUSE_F32, 2, xs);
    moefuse_tensor to = moefuse_tensor_dense(b[6], MOEFUSE_F32, 2, os);
    moefuse_act_options gelu = {0};
    gelu.activation = MOEFUSE_ACT_GELU;
    HCHECK(moefuse_act_mul(ctx, &tx, NULL, &to, &gelu) == MOEFUSE_OK, "act_mul: %s",
           moefuse_last_error(ctx));
    moefuse_tensor txm = moefuse_tensor_dense(b[1], MOEFUSE_F32, 2, ms);
    moefuse_tensor tw1 = moefuse_tensor_dense(b[2], MOEFUSE_F32, 3, w1s);
    moefuse_tensor tw2 = moefuse_tensor_dense(b[3], MOEFUSE_F32, 3, w2s);
    moefuse_tensor tout = moefuse_tensor_dense(b[7], MOEFUSE_F32, 2, ms);
    moefuse_routing route = {0};
    route.topk_ids = moefuse_tensor_dense(b[4], MOEFUSE_I32, 2, rs);
    route.topk_weights = moefuse_tensor_dense(b[5], MOEFUSE_F32, 2, rs);
    moefuse_moe_options tanh_gelu = {0};
    tanh_gelu.activation = MOEFUSE_ACT_GELU_TANH;
    HCHECK(moefuse_moe_forward(ctx, &txm, &tw1, &tw2, NULL, NULL, &route, &tout, &tanh_gelu) ==
               MOEFUSE_OK,
           "moe_forward: %s", moefuse_last_error(ctx));
    HCHECK(moefuse_buffer_read(ctx, b[6], 0, res, out1) == MOEFUSE_OK, "read: %s",
           moefuse_last_error(ctx));
    HCHECK(moefuse_buffer_read(ctx, b[7], 0, res + out1, out2) == MOEFUSE_OK, "read: %s",
           moefuse_last_error(ctx));
    for (int i = 0; i < 8; i++)
        moefuse_buffer_free(ctx, b[i]);
    *bytes = out1 + out2;
    return res;
}

/*
 * context_create with each kind failing at hit 1, 2, ...: it fails with a
 * message and leaves *out NULL, and the next creation works; or, where a
 * failure has a fallback (the binary cache), the context computes exactly as
 * one created without a fault.
 */
static void create_with_faults(const char *cache_note)
{
    const char *be = h_backend();
    moefuse_context *ref = NULL;
    HCHECK(moefuse_context_create(&ref, be) == MOEFUSE_OK, "context_create(%s): %s", be,
           moefuse_last_error(NULL));
    size_t ref_bytes;
    unsigned char *ref_bits = context_bits(ref, &ref_bytes);
    moefuse_context_destroy(ref);
    for (int k = 0; k < KINDS; k++) {
        int64_t nth = 1;
        int failures = 0;
        for (; nth <= MAX_HITS; nth++) {
            char what[160];
            snprintf(what, sizeof what, "context_create(%s)%s, %s failing at hit %lld", be,
                     cache_note, mf_fault_kind_name(kinds[k]), (long long)nth);
            moefuse_context *ctx = (moefuse_context *)1;
            mf_fault_arm(kinds[k], nth);
            moefuse_status st = moefuse_context_create(&ctx, be);
            const bool fired = mf_fault_fired(kinds[k]);
            mf_fault_disarm_all();
            if (st != MOEFUSE_OK) {
                HCHECK(fired, "%s: failed with no fault injected: %s", what,
                       moefuse_last_error(NULL));
                check_failure("context_create", kinds[k], st, moefuse_last_error(NULL), what);
                HCHECK(ctx == NULL, "%s: *out is not NULL after a failure", what);
                failures++;
                st = moefuse_context_create(&ctx, be);
                HCHECK(st == MOEFUSE_OK, "%s: the next context_create failed: %s", what,
                       moefuse_last_error(NULL));
            }
            size_t n;
            unsigned char *bits = context_bits(ctx, &n);
            HCHECK(n == ref_bytes && memcmp(bits, ref_bits, n) == 0,
                   "%s: the context computes differently from one created without a fault", what);
            free(bits);
            moefuse_context_destroy(ctx);
            if (!fired)
                break;
        }
        HCHECK(nth <= MAX_HITS, "context_create still reaching hit %d", MAX_HITS);
        fprintf(stderr, "context_create%-11s %-6s %-18s %lld hit(s), %d failed cleanly\n",
                cache_note, be, mf_fault_kind_name(kinds[k]), (long long)(nth - 1), failures);
    }
    free(ref_bits);
}

START_TEST(t_context_create)
{
    put_env("MOEFUSE_OPENCL_CACHE", "off"); /* every OpenCL context builds from source */
    create_with_faults(" (no cache)");
    restore_env("MOEFUSE_OPENCL_CACHE");
}
END_TEST

/* A folder of plain files, and the folder. */
static void remove_folder(const char *dir)
{
    DIR *d = opendir(dir);
    ck_assert(d != NULL);
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        char path[512];
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    }
    closedir(d);
    ck_assert(rmdir(dir) == 0);
}

/* OpenCL with a binary cache (a new folder): a load that fails falls back to a build. */
START_TEST(t_context_create_cached)
{
    if (strcmp(h_backend(), "opencl") != 0)
        return;
    char dir[] = "/tmp/moefuse-faults-XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    put_env("MOEFUSE_OPENCL_CACHE", dir);
    create_with_faults(" (cache)");
    restore_env("MOEFUSE_OPENCL_CACHE");
    remove_folder(dir);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("faults");
    TCase *tc = h_add_tcase(s, "faults", NULL, 300);
    tcase_add_test(tc, t_buffer_alloc);
    tcase_add_test(tc, t_context_create);
    tcase_add_test(tc, t_context_create_cached);
    tcase_add_test(tc, t_rows);
    tcase_add_test(tc, t_moe_routed);
    tcase_add_test(tc, t_moe_decode);
    tcase_add_test(tc, t_final_chunked);
    tcase_add_test(tc, t_final_chunked_wide);
    return h_run(s);
}
