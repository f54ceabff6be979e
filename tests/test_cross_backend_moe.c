/* test_cross_backend: the MoE GEMMs against the oracle and between the backends. */
#include "test_cross_backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ MoE */

typedef struct {
    moefuse_dtype dt, odt, b1dt;
    int64_t M, K, I, E, k, Eg; /* Eg: expert_map length (0: no map) */
    int bias, act, order, invalid;
    float limit, alpha, up_offset;
} ecfg;

static const char *edesc(const ecfg *c)
{
    return h_fmt("moe[dt=%s out=%s b1=%s M=%lld K=%lld I=%lld E=%lld k=%lld Eg=%lld bias=%d act=%d order=%d "
                 "limit=%g alpha=%g up_offset=%g invalid=%d]",
                 moefuse_dtype_name(c->dt), moefuse_dtype_name(c->odt), moefuse_dtype_name(c->b1dt),
                 (long long)c->M, (long long)c->K, (long long)c->I, (long long)c->E, (long long)c->k,
                 (long long)c->Eg, c->bias, c->act, c->order, (double)c->limit, (double)c->alpha,
                 (double)c->up_offset, c->invalid);
}

/* decoded values of a 3-D (or lower, unused dims 1) tensor */
static double *values(tbuf *tb, int64_t n0, int64_t n1, int64_t n2)
{
    double *v = doubles((size_t)(n0 * n1 * n2));
    for (int64_t a = 0; a < n0; a++)
        for (int64_t b = 0; b < n1; b++)
            for (int64_t c = 0; c < n2; c++) v[(a * n1 + b) * n2 + c] = tb_get(tb, a, b, c);
    return v;
}

/* The output's own elements were compared by a tolerance; every other byte must be equal. */
static void same_outside(pair out, const char *what)
{
    unsigned char *j = judged_new(out);
    for (size_t i = 0; i < out.d->total; i++) j[i] = out.d->logical[i];
    same_elsewhere(out, j, what);
}

/*
 * A GEMM output [n0, n1, n2] on both sides: each against the oracle, and the
 * two against each other, within the bound; rows of invalid slots (valid[]
 * < 0, when rows_are_slots) exactly 0 on both; other bytes equal.
 */
static void cmp_gemm(const ecfg *c, pair out, const double *ref, int64_t n0, int64_t n1, int64_t n2,
                     const int64_t *valid, int rows_are_slots, double bound, double floor,
                     const char *name)
{
    size_t n = (size_t)(n0 * n1 * n2);
    double *vd = values(out.d, n0, n1, n2), *vc = values(out.c, n0, n1, n2);
    const char *what = h_fmt("%s %s", name, edesc(c));
    for (size_t i = 0; i < n; i++) {
        HCHECK(isfinite(vd[i]) && isfinite(vc[i]), "%s: element %zu is %a on cpu, %a on %s", what, i, vc[i],
               vd[i], h_backend());
        if (rows_are_slots && valid[i / (size_t)n2] < 0)
            HCHECK(vd[i] == 0.0 && vc[i] == 0.0, "%s: invalid slot %zu: %a on cpu, %a on %s, want 0", what,
                   i / (size_t)n2, vc[i], vd[i], h_backend());
    }
    double e_cpu = h_rel_err_floor(vc, ref, n, floor), e_dev = h_rel_err_floor(vd, ref, n, floor),
           e_both = h_rel_err_floor(vd, vc, n, 2 * floor);
    if (e_both > seen.gemm_rel) seen.gemm_rel = e_both;
    HCHECK(e_cpu <= bound, "%s: cpu vs oracle: relative error %.3g > %.3g", what, e_cpu, bound);
    HCHECK(e_dev <= bound, "%s: %s vs oracle: relative error %.3g > %.3g", what, h_backend(), e_dev, bound);
    HCHECK(e_both <= bound, "%s: %s vs cpu: relative error %.3g > %.3g", what, h_backend(), e_both, bound);
    free(vd);
    free(vc);
    same_outside(out, what);
}

/* A token without a valid slot gets an output row of exact zeros, on both sides. */
static void check_empty_tokens(const ecfg *c, pair out, const int64_t *valid)
{
    for (int64_t m = 0; m < c->M; m++) {
        int any = 0;
        for (int64_t j = 0; j < c->k; j++) any |= valid[m * c->k + j] >= 0;
        for (int64_t r = 0; r < c->K && !any; r++)
            HCHECK(tb_get(out.c, m, r, 0) == 0.0 && tb_get(out.d, m, r, 0) == 0.0,
                   "%s: token %lld has no valid slot, out[%lld, %lld] is %a on cpu, %a on %s", edesc(c),
                   (long long)m, (long long)m, (long long)r, tb_get(out.c, m, r, 0), tb_get(out.d, m, r, 0),
                   h_backend());
    }
}

/* ids mostly valid; with c->invalid also -1 and >= Eg, and a token with no valid slot */
static void fill_routing(const ecfg *c, int64_t Eg, pair ids, pair wts, pair map)
{
    h_fill_random_routing(ids.d, wts.d, c->M, c->k, Eg, c->invalid, -1);
    if (!map.d) return;
    for (int64_t g = 0; g < Eg; g++)
        tb_set(map.d, g, 0, 0, (double)h_map_entry(g, Eg, c->E));
    tb_upload(map.d);
}

static void run_moe_case(ecfg c)
{
    const int64_t M = c.M, K = c.K, I = c.I, E = c.E, k = c.k, Eg = c.Eg ? c.Eg : E;
    pair x = pair2("x", c.dt, M, K, 1, 1), w1 = pair3("w1", c.dt, E, 2 * I, K, 0, 1);
    pair w2 = pair3("w2", c.dt, E, K, I, 1, 1), b1 = {NULL, NULL}, b2 = {NULL, NULL};
    tb_fill_unif(x.d, -1, 1);
    tb_fill_unif(w1.d, -2 / sqrt((double)K), 2 / sqrt((double)K));
    tb_fill_unif(w2.d, -2 / sqrt((double)I), 2 / sqrt((double)I));
    tb_upload(x.d);
    tb_upload(w1.d);
    tb_upload(w2.d);
    if (c.bias) {
        b1 = pair2("b1", c.b1dt, E, 2 * I, 1, 1);
        b2 = pair2("b2", c.dt, E, K, 0, 1);
        tb_fill_unif(b1.d, -0.5, 0.5);
        tb_fill_unif(b2.d, -0.5, 0.5);
        tb_upload(b1.d);
        tb_upload(b2.d);
    }
    pair ids = pair2("topk_ids", MOEFUSE_I32, M, k, 1, 1), wts = pair2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    pair map = c.Eg ? pair1("expert_map", MOEFUSE_I32, Eg, 1) : (pair){NULL, NULL};
    fill_routing(&c, Eg, ids, wts, map);
    moefuse_routing rd = {.topk_ids = ids.d->t, .topk_weights = wts.d->t,
                          .expert_map = map.d ? map.d->t : (moefuse_tensor){0}};
    moefuse_routing rc = {.topk_ids = ids.c->t, .topk_weights = wts.c->t,
                          .expert_map = map.c ? map.c->t : (moefuse_tensor){0}};
    moefuse_moe_options o = {.activation = c.act, .order = c.order, .limit = c.limit,
                             .alpha = c.alpha, .up_offset = c.up_offset};

    /* the oracle's h, from the inputs */
    double *xv = values(x.d, M, K, 1), *w1v = values(w1.d, E, 2 * I, K), *w2v = values(w2.d, E, K, I);
    double *b1v = c.bias ? values(b1.d, E, 2 * I, 1) : NULL, *b2v = c.bias ? values(b2.d, E, K, 1) : NULL;
    double *wv = values(wts.d, M, k, 1), *href = doubles((size_t)(M * k * I));
    int32_t *idv = malloc(sizeof(int32_t) * (size_t)(M * k + 1)), *mapv = NULL;
    int64_t *valid = malloc(sizeof(int64_t) * (size_t)(M * k + 1));
    for (int64_t i = 0; i < M * k; i++) idv[i] = (int32_t)tb_get(ids.d, i / k, i % k, 0);
    if (map.d) {
        mapv = malloc(sizeof(int32_t) * (size_t)Eg);
        for (int64_t g = 0; g < Eg; g++) mapv[g] = (int32_t)tb_get(map.d, g, 0, 0);
    }
    or_act_opt ao = {c.act, c.order, c.limit, 0, c.alpha, c.up_offset};
    or_moe_gate(M, K, I, E, k, xv, w1v, b1v, idv, mapv, Eg, &ao, href, valid);

    pair h = pair3("h", c.dt, M, k, I, 1, 0);
    BOTH(moefuse_moe_gate(g_ctx, T(x.d), T(w1.d), T(b1.d), &rd, T(h.d), &o),
         moefuse_moe_gate(g_ref, T(x.c), T(w1.c), T(b1.c), &rc, T(h.c), &o), edesc(&c));
    cmp_gemm(&c, h, href, M, k, I, valid, 1, h_gemm_bound(c.dt), h_gemm_floor(c.dt), "moe_gate h");

    /* final from the same h on both sides (the CPU's), so only the final kernel differs */
    memcpy(h.d->full, h.c->full, h.d->total);
    tb_upload(h.d);
    double *hv = values(h.c, M, k, I), *yref = doubles((size_t)(M * k * K)), *oref = doubles((size_t)(M * K));
    or_moe_final(M, K, I, E, k, hv, w2v, b2v, valid, wv, yref, oref);
    pair out = pair2("out", c.odt, M, K, 2, 0), y = pair3("y", c.odt, M, k, K, 0, 0);
    BOTH(moefuse_moe_final(g_ctx, T(h.d), T(w2.d), T(b2.d), &rd, T(out.d), &o),
         moefuse_moe_final(g_ref, T(h.c), T(w2.c), T(b2.c), &rc, T(out.c), &o), edesc(&c));
    cmp_gemm(&c, out, oref, M, K, 1, valid, 0, h_gemm_bound(c.odt), h_gemm_floor(c.odt), "moe_final out");
    check_empty_tokens(&c, out, valid);
    BOTH(moefuse_moe_final(g_ctx, T(h.d), T(w2.d), T(b2.d), &rd, T(y.d), &o),
         moefuse_moe_final(g_ref, T(h.c), T(w2.c), T(b2.c), &rc, T(y.c), &o), edesc(&c));
    cmp_gemm(&c, y, yref, M, k, K, valid, 1, h_gemm_bound(c.odt), h_gemm_floor(c.odt),
             "moe_final y (un-reduced)");

    /* whole layer from the oracle's h: h is rounded to x's dtype on the way (test_moe's bound) */
    or_moe_final(M, K, I, E, k, href, w2v, b2v, valid, wv, yref, oref);
    pair fwd = pair2("forward_out", c.odt, M, K, 0, 0);
    BOTH(moefuse_moe_forward(g_ctx, T(x.d), T(w1.d), T(w2.d), T(b1.d), T(b2.d), &rd, T(fwd.d), &o),
         moefuse_moe_forward(g_ref, T(x.c), T(w1.c), T(w2.c), T(b1.c), T(b2.c), &rc, T(fwd.c), &o), edesc(&c));
    cmp_gemm(&c, fwd, oref, M, K, 1, valid, 0, fmax(h_gemm_bound(c.odt), h_gemm_bound(c.dt)),
             fmax(h_gemm_floor(c.odt), h_gemm_floor(c.dt)), "moe_forward out");

    free(xv), free(w1v), free(w2v), free(b1v), free(b2v), free(wv), free(href), free(idv), free(mapv);
    free(valid), free(hv), free(yref), free(oref);
    tb_free_all();
}

static ecfg ebase(moefuse_dtype dt)
{
    ecfg c;
    memset(&c, 0, sizeof c);
    c.dt = c.odt = c.b1dt = dt;
    c.M = 5, c.K = 37, c.I = 45, c.E = 4, c.k = 2;
    return c;
}

/* 0 and 1 tokens, odd sizes, empty experts, invalid ids, unmapped experts, biases, dtypes. */
START_TEST(t_moe_edges)
{
    for (int d = 0; d < 3; d++) {
        ecfg c = ebase(FLOATS[d]);
        c.M = 0;
        run_moe_case(c);
        c.M = 1, c.E = 8, c.k = 2; /* six experts get no token */
        c.bias = 1;
        c.b1dt = MOEFUSE_F32;
        run_moe_case(c);
        c = ebase(FLOATS[d]);
        c.M = 9, c.k = 3, c.invalid = 1, c.Eg = 10, c.bias = d != 1;
        c.act = d, c.order = 1;
        run_moe_case(c);
        c.Eg = 0;
        c.limit = 0.3f;
        run_moe_case(c);
        c = ebase(FLOATS[d]);
        c.K = 1, c.I = 1, c.E = 1, c.k = 1, c.M = 3, c.act = 2 - d;
        run_moe_case(c);
    }
    ecfg c = ebase(MOEFUSE_BF16);
    c.odt = MOEFUSE_F32, c.b1dt = MOEFUSE_F16, c.bias = 1, c.invalid = 1;
    run_moe_case(c);
    finish("moe edges");
}
END_TEST

START_TEST(t_moe_random)
{
    for (int r = 0; r < 6; r++) {
        ecfg c = ebase(FLOATS[r % 3]);
        c.M = h_randint(1, 40);
        c.E = h_randint(1, 8);
        c.k = h_randint(1, c.E < 4 ? c.E : 4);
        c.K = h_randint(1, 200);
        c.I = h_randint(1, 160);
        c.bias = (int)h_randint(0, 1);
        c.b1dt = FLOATS[h_randint(0, 2)];
        c.act = (int)h_randint(0, 3);
        c.order = (int)h_randint(0, 2);
        c.up_offset = h_randint(0, 1) ? (float)h_unif(-1, 1) : 0.0f;
        c.invalid = (int)h_randint(0, 1);
        c.Eg = h_randint(0, 1) ? c.E + 3 : 0;
        c.limit = h_randint(0, 2) == 0 ? (float)h_unif(0.5, 4) : 0.0f;
        c.odt = r >= 3 ? FLOATS[(r + 1) % 3] : c.dt;
        run_moe_case(c);
    }
    finish("moe random");
}
END_TEST

/*
 * gpt-oss's activation (silu_alpha, alpha 1.702, up offset 1, limit 7, interleaved): act_mul,
 * act_quant (2-D and masked) on random, edge and every-bf16-gate inputs, and a MoE layer with
 * biases; then other alphas, offsets and orders.
 */
START_TEST(t_gpt_oss)
{
    for (int v = 0; v < 6; v++) {
        const int order = v < 3 ? MOEFUSE_GATE_INTERLEAVED : v - 3;
        const float alpha = v == 1 ? 1.702f : v == 4 ? 0.6f : 0.0f;
        const float offset = v == 5 ? -0.25f : v == 2 ? 0.0f : 1.0f;
        mcfg m = {FLOATS[v % 3], 9, v == 2 ? 61 : 96, MOEFUSE_ACT_SILU_ALPHA, order,
                  v == 3 ? MOEFUSE_ROUND_BF16 : 0, v & 1, v & 1, 1, 7.0f, alpha, offset};
        run_act_mul_case(m);
        qcfg c = qbase(v & 1 ? 3 : 0, 7, 256, (int64_t[]){32, 64, 128}[v % 3]);
        c.counts[0] = 7, c.counts[1] = 0, c.counts[2] = 4;
        c.xdt = FLOATS[(v + 1) % 3];
        c.L = LAYS[v % 5];
        c.qdt = !c.L.ue8m0 && v == 2 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
        c.act = MOEFUSE_ACT_SILU_ALPHA, c.alpha = alpha, c.up_offset = offset;
        c.order = order, c.limit = 7.0f, c.special = 1;
        c.use_rs = v & 1, c.es_kind = v % 3, c.zero_tail = v & 1;
        run_quant_case(c);
        /* every bf16 gate: the computed path (silu_alpha has no table) over all of them */
        mcfg every = {MOEFUSE_BF16, 64, 1024, MOEFUSE_ACT_SILU_ALPHA, order, 0, 0, 0, 2,
                      v & 1 ? 7.0f : 0.0f, alpha, offset};
        run_act_mul_case(every);
        ecfg e = ebase(FLOATS[v % 3]);
        e.M = 7, e.K = 64, e.I = 40, e.E = 5, e.k = 2, e.bias = 1, e.invalid = v & 1;
        e.act = MOEFUSE_ACT_SILU_ALPHA, e.alpha = alpha, e.up_offset = offset;
        e.order = order, e.limit = 7.0f;
        run_moe_case(e);
    }
    finish("gpt-oss activation");
}
END_TEST

/*
 * A final's output with NaN and Inf (NUMERICS.md, "Agreement between backends", MoE): both
 * backends give NaN in the same elements, the same infinities, and the rest within the GEMMs'
 * bound; bytes around the output untouched.
 */
static void cmp_special(pair out, int64_t n0, int64_t n1, int64_t n2, double bound, double floor,
                        const char *what)
{
    const size_t n = (size_t)(n0 * n1 * n2);
    double *vd = values(out.d, n0, n1, n2), *vc = values(out.c, n0, n1, n2);
    size_t special = 0;
    for (size_t i = 0; i < n; i++) {
        HCHECK(isnan(vd[i]) == isnan(vc[i]) && (isfinite(vc[i]) || isnan(vc[i]) || vd[i] == vc[i]),
               "%s: element %zu is %a on cpu, %a on %s", what, i, vc[i], vd[i], h_backend());
        if (!isfinite(vc[i]))
            special++, vd[i] = vc[i] = 0.0;
    }
    HCHECK(special > 0, "%s: no NaN or Inf reached the output", what);
    const double e = h_rel_err_floor(vd, vc, n, 2 * floor);
    if (e > seen.gemm_rel) seen.gemm_rel = e;
    HCHECK(e <= bound, "%s: %s vs cpu: relative error %.3g > %.3g", what, h_backend(), e, bound);
    free(vd);
    free(vc);
    same_outside(out, what);
}

/*
 * The final where its 256-column tiles lie whole inside K (K = 512), which the CUDA kernels
 * store straight from the registers (a row with NaN again, by the rounding that keeps the
 * CPU's NaN bits), un-reduced in bf16 and f32 and reduced, with NaN, +Inf and -Inf in three
 * slots' h. The rows of h and w2 start 16-byte aligned (pads of 8 elements) and those of the
 * outputs on multiples of 4 elements (pads of 4), so that moe_ws.cu takes the call when forced:
 * rows padded by one element send it to moe_wgmma.cu.
 */
START_TEST(t_moe_final_special)
{
    const int64_t M = 24, K = 512, I = 64, E = 4, k = 2;
    for (int v = 0; v < 2; v++) {
        ecfg c = ebase(MOEFUSE_BF16);
        c.M = M, c.K = K, c.I = I, c.E = E, c.k = k, c.bias = v == 0;
        c.odt = v == 0 ? MOEFUSE_BF16 : MOEFUSE_F32;
        pair h = pair3("h", c.dt, M, k, I, 8, 1), w2 = pair3("w2", c.dt, E, K, I, 8, 1);
        pair b2 = c.bias ? pair2("b2", c.dt, E, K, 0, 1) : (pair){NULL, NULL};
        tb_fill_unif(h.d, -1, 1);
        tb_set(h.d, 3, 0, 5, NAN);
        tb_set(h.d, 7, 1, 9, INFINITY);
        tb_set(h.d, 11, 0, 63, -INFINITY);
        tb_upload(h.d);
        tb_upload_unif(w2.d, -2 / sqrt((double)I), 2 / sqrt((double)I));
        if (c.bias)
            tb_upload_unif(b2.d, -0.5, 0.5);
        pair ids = pair2("topk_ids", MOEFUSE_I32, M, k, 1, 1);
        pair wts = pair2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
        fill_routing(&c, E, ids, wts, (pair){NULL, NULL});
        moefuse_routing rd = {.topk_ids = ids.d->t, .topk_weights = wts.d->t};
        moefuse_routing rc = {.topk_ids = ids.c->t, .topk_weights = wts.c->t};
        moefuse_moe_options o = {0};
        pair y = pair3("y", c.odt, M, k, K, 4, 0), out = pair2("out", c.odt, M, K, 4, 0);
        BOTH(moefuse_moe_final(g_ctx, T(h.d), T(w2.d), T(b2.d), &rd, T(y.d), &o),
             moefuse_moe_final(g_ref, T(h.c), T(w2.c), T(b2.c), &rc, T(y.c), &o), edesc(&c));
        cmp_special(y, M, k, K, h_gemm_bound(c.odt), h_gemm_floor(c.odt),
                    h_fmt("moe_final y (un-reduced, NaN and Inf in h) %s", edesc(&c)));
        BOTH(moefuse_moe_final(g_ctx, T(h.d), T(w2.d), T(b2.d), &rd, T(out.d), &o),
             moefuse_moe_final(g_ref, T(h.c), T(w2.c), T(b2.c), &rc, T(out.c), &o), edesc(&c));
        cmp_special(out, M, K, 1, h_gemm_bound(c.odt), h_gemm_floor(c.odt),
                    h_fmt("moe_final out (NaN and Inf in h) %s", edesc(&c)));
        tb_free_all();
    }
    finish("moe final special");
}
END_TEST

void cross_backend_moe_tests(TCase *tc)
{
    tcase_add_test(tc, t_moe_edges);
    tcase_add_test(tc, t_moe_random);
    tcase_add_test(tc, t_gpt_oss);
    tcase_add_test(tc, t_moe_final_special);
}
