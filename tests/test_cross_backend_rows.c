/* test_cross_backend: act_mul's values and topk_softmax's routing, bit for bit. */
#include "test_cross_backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------- float outputs */

/* act_mul: bit-equal; a NaN from two NaN operands may have either sign. */
/* for failure messages only */
static const char *act_at(const char *what, int64_t t, int64_t c, double g, double u)
{
    return h_fmt("%s [%lld, %lld] g=%a u=%a", what, (long long)t, (long long)c, g, u);
}

static void cmp_act_value(pair x, pair out, int64_t t, int64_t c, int64_t H, const or_act_opt *o,
                          const char *what)
{
    const moefuse_dtype dt = out.d->t.dtype;
    seen.values++;
    if (memcmp(tb_el(out.d, t, c, 0), tb_el(out.c, t, c, 0), moefuse_dtype_size(dt)) == 0)
        return;
    double vd = tb_get(out.d, t, c, 0), vc = tb_get(out.c, t, c, 0), g, u;
    gate_up(x.d, 0, t, c, H, o->order, &g, &u);
    HCHECK((isnan(vc) && isnan(vd) && nan_from_two_nans(g, u, o)) || !exact_division(),
           "%s: %a on cpu, %a on %s: must be bit-equal",
           act_at(what, t, c, g, u), vc, vd, h_backend());
    seen.nan_either++;
}
void run_act_mul_case(mcfg c)
{
    pair x = pair2("x", c.dt, c.T, 2 * c.H, c.rp, 1);
    if (c.special == 2)
        fill_every_bf16_gate(x.d, c.H, c.order);
    else
        fill_act(x.d, c.special);
    tb_upload(x.d);
    pair rs = {NULL, NULL};
    if (c.use_rs) {
        rs = pair1("row_scale", MOEFUSE_F32, c.T, 1);
        tb_upload_unif(rs.d, 0.1, 3);
    }
    pair out = pair2("out", c.dt, c.T, c.H, c.rp ? 3 : 0, 0);
    moefuse_act_options o = h_act_options(c.act, c.order, c.limit, c.rnd, c.alpha, c.up_offset);
    const char *what = h_fmt("act_mul[dt=%s T=%lld H=%lld act=%d alpha=%g up_offset=%g order=%d round=%d "
                             "limit=%g rs=%d special=%d]",
                             moefuse_dtype_name(c.dt), (long long)c.T, (long long)c.H, c.act,
                             (double)c.alpha, (double)c.up_offset, c.order, c.rnd, (double)c.limit,
                             c.use_rs, c.special);
    BOTH(moefuse_act_mul(g_ctx, T(x.d), T(rs.d), T(out.d), &o),
         moefuse_act_mul(g_ref, T(x.c), T(rs.c), T(out.c), &o), what);
    or_act_opt ao = {c.act, c.order, c.limit, c.rnd, c.alpha, c.up_offset};
    unsigned char *j = judged_new(out);
    for (int64_t t = 0; t < c.T; t++)
        for (int64_t i = 0; i < c.H; i++) {
            judge(j, out.d, tb_el(out.d, t, i, 0), moefuse_dtype_size(c.dt));
            cmp_act_value(x, out, t, i, c.H, &ao, what);
        }
    same_elsewhere(out, j, what);
    tb_free_all();
}

/* --------------------------------------------------------------- router */

static double logit(int mode, int64_t m, int64_t i, int64_t E)
{
    switch (mode) {
    case 1:
        return (double)((i * 7 + m) % (E / 2 + 1)) * 0.5; /* ties in pairs */
    case 2: {                                             /* NaN, +-Inf, ties sprinkled in */
        int64_t r = h_randint(0, 39);
        if (r == 0) return NAN;
        if (r == 1) return INFINITY;
        if (r == 2) return -INFINITY;
        if (r < 6) return 1.0;
        return h_unif(-8, 8);
    }
    case 3:
        return i == 1 ? NAN : -INFINITY; /* every number -Inf */
    case 4: /* one large logit, the rest 80-120 below: exps near or under the subnormals */
        return i == m % E ? 0.0 : h_unif(-120, -80);
    case 5: /* neighbours an ulp or two apart (in f32): quotients that round together */
        return 1.0 + (double)h_randint(0, 12) * 0x1p-23;
    default:
        return h_unif(-8, 8);
    }
}

/* ids and weights: every byte equal (the library's exp, the sum in index order everywhere). */
static void run_topk_case_rp(moefuse_dtype dt, int64_t M, int64_t E, int64_t k, int renorm,
                             int mode, int64_t rp)
{
    pair lg = pair2("logits", dt, M, E, rp, 1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < E; i++) tb_set(lg.d, m, i, 0, logit(mode, m, i, E));
    tb_upload(lg.d);
    pair ids = pair2("ids", MOEFUSE_I32, M, k, 2, 0), w = pair2("weights", MOEFUSE_F32, M, k, 1, 0);
    const char *what = h_fmt("topk_softmax[logits=%s M=%lld E=%lld k=%lld renormalize=%d mode=%d]",
                             moefuse_dtype_name(dt), (long long)M, (long long)E, (long long)k, renorm, mode);
    BOTH(moefuse_topk_softmax(g_ctx, T(lg.d), renorm, T(ids.d), T(w.d)),
         moefuse_topk_softmax(g_ref, T(lg.c), renorm, T(ids.c), T(w.c)), what);
    same_elsewhere(ids, judged_new(ids), what);
    same_elsewhere(w, judged_new(w), what);
    tb_free_all();
}

/* Rows padded by one element: unaligned rows, read element by element. */
static void run_topk_case(moefuse_dtype dt, int64_t M, int64_t E, int64_t k, int renorm, int mode)
{
    run_topk_case_rp(dt, M, E, k, renorm, mode, 1);
}

START_TEST(t_act_mul)
{
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 3; a++)
            for (int v = 0; v < 3; v++) {
                mcfg c = {FLOATS[d], 7, v == 2 ? 33 : 70, a, v & 1, v == 1, v != 0, (a + v) & 1, v == 2, 0.0f, 0.0f, 0.0f};
                c.limit = v == 1 ? 2.5f : 0.0f;
                run_act_mul_case(c);
            }
    const int64_t Ts[3] = {0, 1, 129}, Hs[3] = {5, 1, 96};
    for (int i = 0; i < 3; i++) {
        mcfg c = {FLOATS[i], Ts[i], Hs[i], i, 0, 0, 0, 1, 1, 0.0f, 0.0f, 0.0f};
        run_act_mul_case(c);
    }
    for (int r = 0; r < 6; r++) {
        mcfg c = {FLOATS[h_randint(0, 2)],
                  h_randint(1, 40),
                  h_randint(1, 300),
                  (int)h_randint(0, 2),
                  (int)h_randint(0, 1),
                  (int)h_randint(0, 1),
                  (int)h_randint(0, 1),
                  (int)h_randint(0, 1),
                  1,
                  0.0f,
                  0.0f,
                  0.0f};
        c.limit = h_randint(0, 2) == 0 ? (float)h_unif(0.5, 6) : 0.0f;
        c.act = (int)h_randint(0, 3);
        c.order = (int)h_randint(0, 2);
        c.up_offset = h_randint(0, 2) == 0 ? (float)h_unif(-2, 2) : 0.0f;
        run_act_mul_case(c);
    }
    finish("act_mul");
}
END_TEST

/*
 * Every bf16 gate (65536 per call) through act_mul, act_quant and the masked call, each
 * activation and order, without options (CUDA: the table kernels, G = 32, 64 and 128) and
 * with them (the computed path).
 */
START_TEST(t_every_bf16_gate)
{
    for (int a = 0; a < 3; a++)
        for (int order = 0; order < 2; order++) {
            mcfg m = {MOEFUSE_BF16, 64, 1024, a, order, MOEFUSE_ROUND_NONE, 0, 0, 2, 0.0f, 0.0f, 0.0f};
            run_act_mul_case(m);
            qcfg c = qbase(0, 64, 1024, (int64_t[]){128, 64, 32}[a]);
            c.xdt = MOEFUSE_BF16;
            c.act = a;
            c.order = order;
            c.special = 2;
            c.L = LAYS[(a + 3 * order) % 5];
            run_quant_case(c);
        }
    mcfg m = {MOEFUSE_BF16, 64, 1024, MOEFUSE_ACT_SILU, 0, MOEFUSE_ROUND_BF16, 1, 0, 2, 3.0f, 0.0f, 0.0f};
    run_act_mul_case(m);
    qcfg c = qbase(4, 16, 1024, 128);
    for (int e = 0; e < 4; e++) c.counts[e] = 16;
    c.xdt = MOEFUSE_BF16;
    c.special = 2;
    run_quant_case(c);
    c.use_rs = 1;
    c.limit = 2.5f;
    run_quant_case(c);
    finish("every bf16 gate");
}
END_TEST

START_TEST(t_topk)
{
    for (int d = 0; d < 3; d++)
        for (int rn = 0; rn < 2; rn++) {
            run_topk_case(FLOATS[d], 17, 8, 2, rn, 0);
            run_topk_case(FLOATS[d], 5, 64, 8, rn, 0);
            run_topk_case(FLOATS[d], 1, 5, 5, rn, 0);
            run_topk_case(FLOATS[d], 0, 4, 1, rn, 0);
            run_topk_case(FLOATS[d], 3, 1, 1, rn, 0);
            run_topk_case(FLOATS[d], 6, 9, 4, rn, 1);
            run_topk_case(FLOATS[d], 30, 33, 6, rn, 2);
            run_topk_case(FLOATS[d], 4, 4, 4, rn, 3);
            /* router sizes (E <= 256, k <= 32: a block of rows, a warp per row), dense rows
             * read as vectors; past them (E > 256 or k > 32) the general kernel */
            run_topk_case_rp(FLOATS[d], 41, 256, 8, rn, 0, 0);
            run_topk_case_rp(FLOATS[d], 19, 256, 8, rn, 1, 0);
            run_topk_case_rp(FLOATS[d], 23, 256, 8, rn, 2, 0);
            run_topk_case_rp(FLOATS[d], 9, 256, 32, rn, 2, 0);
            run_topk_case_rp(FLOATS[d], 3, 256, 8, rn, 3, 0);
            run_topk_case_rp(FLOATS[d], 10, 128, 8, rn, 0, 0);
            run_topk_case(FLOATS[d], 13, 251, 7, rn, 2);
            run_topk_case_rp(FLOATS[d], 6, 300, 8, rn, 2, 0);
            run_topk_case_rp(FLOATS[d], 4, 64, 40, rn, 0, 0);
            run_topk_case_rp(FLOATS[d], 12, 256, 8, rn, 4, 0);
            run_topk_case_rp(FLOATS[d], 12, 256, 8, rn, 5, 0);
            run_topk_case_rp(FLOATS[d], 12, 40, 6, rn, 5, 0);
        }
    /* more rows than one wave of blocks holds (the blocks go round again), and row counts
     * past the small-M launch */
    run_topk_case_rp(MOEFUSE_BF16, 9001, 256, 8, 1, 0, 0);
    run_topk_case_rp(MOEFUSE_F32, 700, 200, 8, 0, 2, 0);
    run_topk_case(MOEFUSE_F16, 300, 256, 8, 1, 1);
    for (int r = 0; r < 6; r++) {
        int64_t E = h_randint(1, r < 3 ? 70 : 300);
        run_topk_case(FLOATS[h_randint(0, 2)], h_randint(1, 50), E, h_randint(1, E < 8 ? E : 8),
                      (int)h_randint(0, 1), (int)h_randint(0, 5));
    }
    finish("topk_softmax");
}
END_TEST

void cross_backend_rows_tests(TCase *tc)
{
    tcase_add_test(tc, t_act_mul);
    tcase_add_test(tc, t_every_bf16_gate);
    tcase_add_test(tc, t_topk);
}
