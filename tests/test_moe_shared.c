/*
 * Shared experts (docs/NUMERICS.md "MoE"): a call with routing.n_shared = S equals, bit for bit,
 * the same call with the shared slots written out as ordinary ones (local ids, no expert map);
 * the layer equals the routed layer plus the shared experts' dense MLP by the float64 oracle;
 * and bad shared-expert arguments are refused with nothing written. A backend without shared
 * experts must say so (UNSUPPORTED) and write nothing.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

typedef struct {
    moefuse_dtype dt;
    int64_t M, K, I, E, k, S; /* E counts the shared experts: the last S */
    int use_map;              /* an expert map over 2E global ids */
    int per_token;            /* shared_weights given */
    float scale;              /* shared_scale as passed (0 means 1) */
    int nan_gate;             /* token 1's shared_weights is NaN (its NaN bits must carry) */
} cfg;

typedef struct {
    cfg c;
    int64_t Eg;
    tbuf *x, *w1, *w2, *b1, *b2;
    tbuf *ids, *wts, *map, *sw; /* the routing with shared experts */
    tbuf *ids2, *wts2;          /* the same slots written out */
    int32_t *local;             /* [M, k + S]: each slot's local expert, -1 invalid */
    moefuse_routing shared, plain;
} layer;

/* The local expert of a routed id, as the contract says (a shared expert's: invalid). */
static int32_t local_of(const layer *L, int64_t id)
{
    if (id < 0 || id >= L->Eg)
        return -1;
    int64_t e = id;
    if (L->map)
        e = (int64_t)tb_get(L->map, id, 0, 0);
    return e >= 0 && e < L->c.E - L->c.S ? (int32_t)e : -1;
}

static layer make_layer(cfg c)
{
    layer L;
    memset(&L, 0, sizeof L);
    L.c = c;
    L.Eg = c.use_map ? 2 * c.E : c.E;
    const int64_t M = c.M, K = c.K, I = c.I, E = c.E, k = c.k, S = c.S, slots = k + S;
    L.x = tb_new2("x", c.dt, M, K, 1, 1);
    tb_fill_unif(L.x, -1, 1);
    L.w1 = tb_new3("w1", c.dt, E, 2 * I, K, 0, 1);
    tb_fill_unif(L.w1, -2 / sqrt((double)K), 2 / sqrt((double)K));
    L.w2 = tb_new3("w2", c.dt, E, K, I, 0, 1);
    tb_fill_unif(L.w2, -2 / sqrt((double)I), 2 / sqrt((double)I));
    L.b1 = tb_new2("b1", c.dt, E, 2 * I, 0, 1);
    tb_fill_unif(L.b1, -0.5, 0.5);
    L.b2 = tb_new2("b2", c.dt, E, K, 0, 1);
    tb_fill_unif(L.b2, -0.5, 0.5);
    if (c.use_map) {
        L.map = tb_new1("expert_map", MOEFUSE_I32, L.Eg, 1);
        for (int64_t g = 0; g < L.Eg; g++) /* some -1, some on the shared experts, some past E */
            tb_set(L.map, g, 0, 0, (double)h_randint(-1, E));
    }
    L.ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 1, 1);
    L.wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++) {
            int64_t id = h_randint(0, L.Eg - 1);
            const int64_t r = h_randint(0, 7);
            if (r == 0)
                id = -1;
            else if (r == 1 && !c.use_map)
                id = E - 1 - h_randint(0, S - 1); /* a shared expert's id: invalid here */
            tb_set(L.ids, m, j, 0, (double)id);
            tb_set(L.wts, m, j, 0, h_unif(0.05, 1));
        }
    if (c.per_token) {
        L.sw = tb_new1("shared_weights", MOEFUSE_F32, M, 1);
        tb_fill_unif(L.sw, 0.0, 1.0);
        if (c.nan_gate && M > 1) {
            const uint32_t nan_bits = 0x7FA12345u; /* signalling, with a payload */
            memcpy(tb_el(L.sw, 1, 0, 0), &nan_bits, 4);
        }
    }
    tbuf *in[] = {L.x, L.w1, L.w2, L.b1, L.b2, L.map, L.ids, L.wts, L.sw};
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++)
        if (in[i])
            tb_upload(in[i]);
    /* the slots written out */
    L.local = malloc(sizeof(int32_t) * (size_t)(M * slots));
    L.ids2 = tb_new2("ids written out", MOEFUSE_I32, M, slots, 0, 1);
    L.wts2 = tb_new2("weights written out", MOEFUSE_F32, M, slots, 0, 1);
    const float sc = c.scale == 0.0f ? 1.0f : c.scale;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t j = 0; j < slots; j++) {
            const int32_t e = j < k ? local_of(&L, (int64_t)tb_get(L.ids, m, j, 0))
                                    : (int32_t)(E - S + (j - k));
            float w = j < k ? (float)tb_get(L.wts, m, j, 0) : sc;
            if (j >= k && L.sw) {
                float g;
                memcpy(&g, tb_el(L.sw, m, 0, 0), 4);
                w = sc * g; /* one f32 multiplication, x86's NaN bits */
            }
            L.local[m * slots + j] = e;
            tb_set(L.ids2, m, j, 0, e);
            memcpy(tb_el(L.wts2, m, j, 0), &w, 4);
        }
    }
    tb_upload(L.ids2);
    tb_upload(L.wts2);
    L.shared.topk_ids = L.ids->t;
    L.shared.topk_weights = L.wts->t;
    if (L.map)
        L.shared.expert_map = L.map->t;
    L.shared.n_shared = (int32_t)S;
    L.shared.shared_scale = c.scale;
    if (L.sw)
        L.shared.shared_weights = L.sw->t;
    L.plain.topk_ids = L.ids2->t;
    L.plain.topk_weights = L.wts2->t;
    return L;
}

/* Whether the backend under test has shared experts; when it has not, a call says so. */
static int shared_here(layer *L)
{
    tbuf *h = tb_new3("h probe", L->c.dt, L->c.M, L->c.k + L->c.S, L->c.I, 0, 0);
    const moefuse_status st =
        CALL(moefuse_moe_gate(g_ctx, T(L->x), T(L->w1), T(L->b1), &L->shared, T(h), NULL));
    if (st == MOEFUSE_ERR_UNSUPPORTED) {
        HCHECK(strstr(moefuse_last_error(g_ctx), "shared experts") != NULL,
               "an unsupported shared-expert call must say why: %s", moefuse_last_error(g_ctx));
        return 0;
    }
    HCHECK(st == MOEFUSE_OK, "moe_gate with shared experts: %s (%s)", moefuse_status_name(st),
           moefuse_last_error(g_ctx));
    return 1;
}

/* A layer for c, when the backend under test has shared experts (else 0, everything freed). */
static int layer_here(cfg c, layer *L)
{
    *L = make_layer(c);
    if (shared_here(L))
        return 1;
    free(L->local);
    tb_free_all();
    return 0;
}

static void same(tbuf *a, tbuf *b, const char *what)
{
    h_check_all(0);
    HCHECK(a->total == b->total, "%s: sizes differ", what);
    for (size_t i = 0; i < a->total; i++)
        if (a->logical[i])
            HCHECK(a->full[i] == b->full[i],
                   "%s on %s: byte %zu is 0x%02x with shared experts, 0x%02x with the slots "
                   "written out",
                   what, h_backend(), i - a->pad, a->full[i], b->full[i]);
}

#define OK_CALL(expr, what)                                                                    \
    do {                                                                                       \
        const moefuse_status st_ = CALL(expr);                                                 \
        HCHECK(st_ == MOEFUSE_OK, "%s: %s (%s)", what, moefuse_status_name(st_),               \
               moefuse_last_error(g_ctx));                                                     \
    } while (0)

static void run_same(cfg c)
{
    layer L;
    if (!layer_here(c, &L))
        return;
    const int64_t M = c.M, K = c.K, I = c.I, slots = c.k + c.S;
    moefuse_moe_options o = {.activation = MOEFUSE_ACT_SILU};
    tbuf *ha = tb_new3("h shared", c.dt, M, slots, I, 0, 0);
    tbuf *hb = tb_new3("h written out", c.dt, M, slots, I, 0, 0);
    OK_CALL(moefuse_moe_gate(g_ctx, T(L.x), T(L.w1), T(L.b1), &L.shared, T(ha), &o), "gate");
    OK_CALL(moefuse_moe_gate(g_ctx, T(L.x), T(L.w1), T(L.b1), &L.plain, T(hb), &o), "gate");
    same(ha, hb, "moe_gate h");
    tbuf *oa = tb_new2("out shared", c.dt, M, K, 0, 0), *ob = tb_new2("out plain", c.dt, M, K, 0, 0);
    OK_CALL(moefuse_moe_final(g_ctx, T(ha), T(L.w2), T(L.b2), &L.shared, T(oa), &o), "final");
    OK_CALL(moefuse_moe_final(g_ctx, T(ha), T(L.w2), T(L.b2), &L.plain, T(ob), &o), "final");
    same(oa, ob, "moe_final out");
    tbuf *ya = tb_new3("y shared", c.dt, M, slots, K, 0, 0);
    tbuf *yb = tb_new3("y plain", c.dt, M, slots, K, 0, 0);
    OK_CALL(moefuse_moe_final(g_ctx, T(ha), T(L.w2), T(L.b2), &L.shared, T(ya), &o), "final");
    OK_CALL(moefuse_moe_final(g_ctx, T(ha), T(L.w2), T(L.b2), &L.plain, T(yb), &o), "final");
    same(ya, yb, "moe_final un-reduced y");
    tbuf *fa = tb_new2("fwd shared", c.dt, M, K, 0, 0), *fb = tb_new2("fwd plain", c.dt, M, K, 0, 0);
    OK_CALL(moefuse_moe_forward(g_ctx, T(L.x), T(L.w1), T(L.w2), T(L.b1), T(L.b2), &L.shared,
                                T(fa), &o),
            "forward");
    OK_CALL(moefuse_moe_forward(g_ctx, T(L.x), T(L.w1), T(L.w2), T(L.b1), T(L.b2), &L.plain,
                                T(fb), &o),
            "forward");
    same(fa, fb, "moe_forward out");

    /* the caller's workspace: exactly the queried bytes give the same bits and nothing past
       them is written; one byte less is refused with nothing written */
    size_t need = 0;
    OK_CALL(moefuse_moe_forward_workspace_size(g_ctx, T(L.x), T(L.w1), T(L.w2), T(L.b1),
                                               T(L.b2), &L.shared, T(fa), &o, &need),
            "forward query");
    enum { GUARD = 256 };
    void *buf = NULL;
    HCHECK(moefuse_buffer_alloc(g_ctx, need + GUARD, &buf) == MOEFUSE_OK, "buffer_alloc");
    unsigned char *guard = malloc(need + GUARD), *back = malloc(need + GUARD);
    memset(guard, 0xA5, need + GUARD);
    HCHECK(moefuse_buffer_write(g_ctx, buf, 0, guard, need + GUARD) == MOEFUSE_OK, "write");
    tbuf *fw = tb_new2("fwd in the workspace", c.dt, M, K, 0, 0);
    int64_t wshape[1] = {(int64_t)need - 1};
    moefuse_tensor wst = moefuse_tensor_dense(buf, MOEFUSE_U8, 1, wshape);
    if (need > 0) {
        OK_CALL(moefuse_set_workspace(g_ctx, &wst), "set_workspace");
        /* not CALL: the outputs above hold results their uploads do not know */
        const moefuse_status st = moefuse_moe_forward(g_ctx, T(L.x), T(L.w1), T(L.w2), T(L.b1),
                                                      T(L.b2), &L.shared, T(fw), &o);
        HCHECK(st == MOEFUSE_ERR_WORKSPACE_TOO_SMALL, "a workspace one byte short: %s",
               moefuse_status_name(st));
        HCHECK(moefuse_buffer_read(g_ctx, buf, 0, back, need + GUARD) == MOEFUSE_OK, "read");
        HCHECK(memcmp(back, guard, need + GUARD) == 0, "a refused call wrote its workspace");
        HCHECK(moefuse_buffer_read(g_ctx, fw->buf, 0, back, fw->total) == MOEFUSE_OK, "read");
        HCHECK(memcmp(back, fw->shadow, fw->total) == 0, "a refused call wrote its output");
    }
    wst.shape[0] = (int64_t)need;
    OK_CALL(moefuse_set_workspace(g_ctx, &wst), "set_workspace");
    OK_CALL(moefuse_moe_forward(g_ctx, T(L.x), T(L.w1), T(L.w2), T(L.b1), T(L.b2), &L.shared,
                                T(fw), &o),
            "forward in the workspace");
    OK_CALL(moefuse_set_workspace(g_ctx, NULL), "set_workspace");
    HCHECK(moefuse_buffer_read(g_ctx, buf, 0, back, need + GUARD) == MOEFUSE_OK, "read");
    for (size_t i = need; i < need + GUARD; i++)
        HCHECK(back[i] == 0xA5, "byte %zu past the %zu bytes the query gave was written", i, need);
    moefuse_buffer_free(g_ctx, buf);
    free(guard), free(back);
    same(fw, fb, "moe_forward in the caller's workspace");
    free(L.local);
    tb_free_all();
}

START_TEST(t_same_as_slots_written_out)
{
    const cfg cases[] = {
        {MOEFUSE_BF16, 5, 40, 24, 6, 2, 1, 0, 0, 0.0f, 0},  /* DeepSeek's one, weight 1 */
        {MOEFUSE_BF16, 7, 32, 16, 9, 3, 2, 1, 1, 2.5f, 1}, /* a map, a per-token gate, NaN */
        {MOEFUSE_F32, 1, 24, 8, 5, 1, 4, 0, 1, 0.5f, 0},    /* Qwen2's 4I as 4 experts, M = 1 */
        {MOEFUSE_F16, 0, 16, 8, 4, 2, 1, 0, 0, 0.0f, 0},    /* no tokens */
        {MOEFUSE_BF16, 33, 48, 32, 12, 4, 1, 1, 0, 1.25f, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_same(cases[i]);
}
END_TEST

/* The layer against the oracle: the routed layer plus the shared experts' dense MLP. */
START_TEST(t_routed_plus_dense_mlp)
{
    const cfg c = {MOEFUSE_BF16, 6, 64, 32, 7, 2, 1, 0, 1, 2.0f, 0};
    layer L;
    if (!layer_here(c, &L))
        return;
    const int64_t M = c.M, K = c.K, I = c.I, E = c.E, k = c.k, S = c.S;
    tbuf *out = tb_new2("out", MOEFUSE_F32, M, K, 0, 0);
    OK_CALL(moefuse_moe_forward(g_ctx, T(L.x), T(L.w1), T(L.w2), T(L.b1), T(L.b2), &L.shared,
                                T(out), NULL),
            "forward");
    h_check_all(0);
    /* oracle: the routed slots alone, then each token through the shared expert */
    double *xd = malloc(sizeof(double) * (size_t)(M * K)), *w1d = malloc(sizeof(double) * (size_t)(E * 2 * I * K));
    double *w2d = malloc(sizeof(double) * (size_t)(E * K * I)), *b1d = malloc(sizeof(double) * (size_t)(E * 2 * I));
    double *b2d = malloc(sizeof(double) * (size_t)(E * K));
    for (int64_t m = 0; m < M; m++)
        for (int64_t q = 0; q < K; q++) xd[m * K + q] = tb_get(L.x, m, q, 0);
    for (int64_t e = 0; e < E; e++) {
        for (int64_t r = 0; r < 2 * I; r++) {
            b1d[e * 2 * I + r] = tb_get(L.b1, e, r, 0);
            for (int64_t q = 0; q < K; q++) w1d[(e * 2 * I + r) * K + q] = tb_get(L.w1, e, r, q);
        }
        for (int64_t r = 0; r < K; r++) {
            b2d[e * K + r] = tb_get(L.b2, e, r, 0);
            for (int64_t i = 0; i < I; i++) w2d[(e * K + r) * I + i] = tb_get(L.w2, e, r, i);
        }
    }
    double *ref = calloc((size_t)(M * K), sizeof(double));
    or_act_opt ao = {.act = MOEFUSE_ACT_SILU, .order = MOEFUSE_GATE_FIRST}; /* no limit, no offset */
    for (int pass = 0; pass < 2; pass++) { /* 0: routed, k slots; 1: the dense MLP, S slots */
        const int64_t n = pass == 0 ? k : S;
        int32_t *idv = malloc(sizeof(int32_t) * (size_t)(M * n));
        double *wd = malloc(sizeof(double) * (size_t)(M * n));
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < n; j++) {
                idv[m * n + j] = L.local[m * (k + S) + (pass == 0 ? j : k + j)];
                wd[m * n + j] = pass == 0 ? tb_get(L.wts, m, j, 0)
                                          : (double)c.scale * tb_get(L.sw, m, 0, 0);
            }
        double *h = malloc(sizeof(double) * (size_t)(M * n * I + 1));
        double *y = malloc(sizeof(double) * (size_t)(M * n * K + 1));
        double *o = malloc(sizeof(double) * (size_t)(M * K + 1));
        int64_t *valid = malloc(sizeof(int64_t) * (size_t)(M * n + 1));
        or_moe_gate(M, K, I, E, n, xd, w1d, b1d, idv, NULL, E, &ao, h, valid);
        or_moe_final(M, K, I, E, n, h, w2d, b2d, valid, wd, y, o);
        for (int64_t i = 0; i < M * K; i++)
            ref[i] += o[i];
        free(idv), free(wd), free(h), free(y), free(o), free(valid);
    }
    double *got = malloc(sizeof(double) * (size_t)(M * K));
    for (int64_t m = 0; m < M; m++)
        for (int64_t q = 0; q < K; q++) got[m * K + q] = tb_get(out, m, q, 0);
    const double rel = h_rel_err_floor(got, ref, (size_t)(M * K), h_gemm_floor(MOEFUSE_BF16));
    HCHECK(rel <= h_gemm_bound(MOEFUSE_BF16), "routed + dense MLP: rel err %.3g > %.3g", rel,
           h_gemm_bound(MOEFUSE_BF16));
    free(xd), free(w1d), free(w2d), free(b1d), free(b2d), free(ref), free(got), free(L.local);
    tb_free_all();
}
END_TEST

/* The FP8 layer: the same core path, with h's scale rows t = m (k + S) + j. */
START_TEST(t_fp8_same_as_slots_written_out)
{
    const cfg c = {MOEFUSE_BF16, 4, 256, 128, 4, 2, 1, 1, 1, 2.5f, 0};
    layer L;
    if (!layer_here(c, &L))
        return;
    const int64_t E = c.E, K = c.K, I = c.I;
    tbuf *w1 = tb_new3("w1 f8", MOEFUSE_F8_E4M3, E, 2 * I, K, 0, 1);
    tbuf *w2 = tb_new3("w2 f8", MOEFUSE_F8_E4M3, E, K, I, 0, 1);
    tbuf *w1s = tb_new3("w1_scales", MOEFUSE_F32, E, 2 * I / 128, K / 128, 0, 1);
    tbuf *w2s = tb_new3("w2_scales", MOEFUSE_F32, E, K / 128, I / 128, 0, 1);
    tb_fill_unif(w1, -4, 4);
    tb_fill_unif(w2, -4, 4);
    tb_fill_unif(w1s, 0.002, 0.004);
    tb_fill_unif(w2s, 0.002, 0.004);
    tbuf *in[] = {w1, w2, w1s, w2s};
    for (size_t i = 0; i < 4; i++)
        tb_upload(in[i]);
    tbuf *fa = tb_new2("fp8 shared", MOEFUSE_BF16, c.M, K, 0, 0);
    tbuf *fb = tb_new2("fp8 plain", MOEFUSE_BF16, c.M, K, 0, 0);
    OK_CALL(moefuse_moe_forward_fp8(g_ctx, T(L.x), NULL, T(w1), T(w1s), T(w2), T(w2s), T(L.b1),
                                    T(L.b2), &L.shared, T(fa), NULL),
            "forward_fp8");
    OK_CALL(moefuse_moe_forward_fp8(g_ctx, T(L.x), NULL, T(w1), T(w1s), T(w2), T(w2s), T(L.b1),
                                    T(L.b2), &L.plain, T(fb), NULL),
            "forward_fp8");
    same(fa, fb, "moe_forward_fp8 out");
    free(L.local);
    tb_free_all();
}
END_TEST

static void refused(layer *L, moefuse_status want, const char *word, const char *what)
{
    tbuf *out = tb_new2("out (refused)", L->c.dt, L->c.M, L->c.K, 0, 0);
    const moefuse_status st = moefuse_moe_forward(g_ctx, T(L->x), T(L->w1), T(L->w2), NULL, NULL,
                                                  &L->shared, T(out), NULL);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", moefuse_last_error(g_ctx)); /* before the checks' reads */
    h_check_all(1); /* nothing written */
    HCHECK(st == want, "%s: %s, want %s", what, moefuse_status_name(st), moefuse_status_name(want));
    HCHECK(strstr(msg, word) != NULL, "%s: the message names %s: %s", what, word, msg);
}

START_TEST(t_refusals)
{
    const cfg c = {MOEFUSE_F32, 3, 16, 8, 4, 2, 1, 0, 1, 0.0f, 0};
    layer L = make_layer(c);
    L.shared.n_shared = -1;
    refused(&L, MOEFUSE_ERR_INVALID_ARGUMENT, "n_shared", "n_shared < 0");
    L.shared.n_shared = 5;
    refused(&L, MOEFUSE_ERR_INVALID_ARGUMENT, "n_shared", "n_shared > E");
    L.shared.n_shared = 1;
    L.shared.shared_scale = NAN;
    refused(&L, MOEFUSE_ERR_INVALID_ARGUMENT, "shared_scale", "a NaN scale");
    L.shared.shared_scale = INFINITY;
    refused(&L, MOEFUSE_ERR_INVALID_ARGUMENT, "shared_scale", "an infinite scale");
    L.shared.shared_scale = 1.0f;
    tbuf *bad = tb_new1("shared_weights short", MOEFUSE_F32, c.M - 1, 1);
    L.shared.shared_weights = bad->t;
    refused(&L, MOEFUSE_ERR_SHAPE, "shared_weights", "shared_weights of M - 1");
    tbuf *badt = tb_new1("shared_weights i32", MOEFUSE_I32, c.M, 1);
    L.shared.shared_weights = badt->t;
    refused(&L, MOEFUSE_ERR_DTYPE, "shared_weights", "shared_weights in i32");
    L.shared.shared_weights = L.sw->t;
    /* h of k slots where k + S are needed */
    tbuf *h = tb_new3("h of k slots", c.dt, c.M, c.k, c.I, 0, 0);
    moefuse_status st = CALL(moefuse_moe_gate(g_ctx, T(L.x), T(L.w1), NULL, &L.shared, T(h), NULL));
    HCHECK(st == MOEFUSE_ERR_SHAPE, "h without the shared slots: %s", moefuse_status_name(st));
    /* routing_metadata has no place for shared experts */
    tbuf *counts = tb_new1("counts", MOEFUSE_I32, c.E, 0);
    moefuse_routing_meta meta;
    memset(&meta, 0, sizeof meta);
    meta.counts = counts->t;
    st = CALL(moefuse_routing_metadata(g_ctx, &L.shared, 1, &meta));
    HCHECK(st == MOEFUSE_ERR_INVALID_ARGUMENT, "routing_metadata with n_shared: %s",
           moefuse_status_name(st));
    free(L.local);
    tb_free_all();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("moe_shared");
    TCase *tc = h_add_tcase(s, "moe_shared", h_setup, 120);
    tcase_add_test(tc, t_same_as_slots_written_out);
    tcase_add_test(tc, t_routed_plus_dense_mlp);
    tcase_add_test(tc, t_fp8_same_as_slots_written_out);
    tcase_add_test(tc, t_refusals);
    return h_run(s);
}
