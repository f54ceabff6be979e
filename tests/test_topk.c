/* topk_softmax against the oracle: ids exact, weights within (E + 4 [+ k]) ulp. */
#include <math.h>
#include <stdlib.h>

#include "harness.h"

static void check_rows(tbuf *lg, tbuf *ids, tbuf *w, int64_t M, int64_t E, int64_t k, int renorm, const char *what)
{
    double *l = malloc(sizeof(double) * (size_t)E), *wr = malloc(sizeof(double) * (size_t)k);
    int32_t *ir = malloc(sizeof(int32_t) * (size_t)k);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t i = 0; i < E; i++) l[i] = tb_get(lg, m, i, 0);
        or_topk_row(l, E, k, renorm, ir, wr);
        for (int64_t j = 0; j < k; j++) {
            int32_t gi = (int32_t)tb_get(ids, m, j, 0);
            double gw = tb_get(w, m, j, 0);
            HCHECK(gi == ir[j], "%s: row %lld slot %lld: id %d, oracle %d (E=%lld k=%lld renorm=%d)", what,
                   (long long)m, (long long)j, gi, ir[j], (long long)E, (long long)k, renorm);
            double tol = (double)(E + 4 + (renorm ? k : 0)) * or_ulp32(wr[j]);
            HCHECK(fabs(gw - wr[j]) <= tol, "%s: row %lld slot %lld: weight %.9g, oracle %.12g (tol %.3g)", what,
                   (long long)m, (long long)j, gw, wr[j], tol);
        }
    }
    free(l);
    free(wr);
    free(ir);
}

static void run(moefuse_dtype dt, int64_t M, int64_t E, int64_t k, int renorm, int mode)
{
    tbuf *lg = tb_new2("logits", dt, M, E, 1, 1);
    for (int64_t m = 0; m < M; m++) {
        /* distinct logits: a random permutation of a spaced grid (no near-ties) */
        for (int64_t i = 0; i < E; i++) tb_set(lg, m, i, 0, (double)i * 0.25 - (double)E * 0.1);
        for (int64_t i = E - 1; i > 0; i--) {
            int64_t j = h_randint(0, i);
            double a = tb_get(lg, m, i, 0), b = tb_get(lg, m, j, 0);
            tb_set(lg, m, i, 0, b);
            tb_set(lg, m, j, 0, a);
        }
        if (mode == 1) { /* ties: equal values in pairs */
            for (int64_t i = 0; i < E; i++) tb_set(lg, m, i, 0, (double)((i * 7 + m) % (E / 2 + 1)) * 0.5);
        } else if (mode == 2) { /* NaN logits, incl. where a number would rank below */
            tb_set(lg, m, 0, 0, NAN);
            if (E > 3) tb_set(lg, m, E - 1, 0, -NAN);
        } else if (mode == 3) { /* +Inf (one or two) */
            tb_set(lg, m, m % E, 0, INFINITY);
            if (m & 1) tb_set(lg, m, (m + 3) % E, 0, INFINITY);
        } else if (mode == 4) { /* all -Inf with a NaN */
            for (int64_t i = 0; i < E; i++) tb_set(lg, m, i, 0, -INFINITY);
            tb_set(lg, m, 1, 0, NAN);
        }
    }
    tb_upload(lg);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, M, k, 2, 0);
    tbuf *w = tb_new2("weights", MOEFUSE_F32, M, k, 0, 0);
    moefuse_status st = CALL(moefuse_topk_softmax(g_ctx, T(lg), renorm, T(ids), T(w)));
    HCHECK(st == MOEFUSE_OK, "topk_softmax: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    char what[64];
    snprintf(what, sizeof what, "topk[dt=%d mode=%d]", dt, mode);
    check_rows(lg, ids, w, M, E, k, renorm, what);
    tb_free_all();
}

START_TEST(t_random)
{
    for (int d = 0; d < 3; d++)
        for (int rn = 0; rn < 2; rn++) {
            run(FLOATS[d], 17, 8, 2, rn, 0);
            run(FLOATS[d], 3, 32, 6, rn, 0);
            run(FLOATS[d], 1, 5, 5, rn, 0);
            run(FLOATS[d], 0, 4, 1, rn, 0);
            run(FLOATS[d], 3, 1, 1, rn, 0);
        }
}
END_TEST

START_TEST(t_ties)
{
    for (int rn = 0; rn < 2; rn++) {
        run(MOEFUSE_F32, 6, 8, 4, rn, 1);
        run(MOEFUSE_BF16, 6, 9, 9, rn, 1);
    }
}
END_TEST

START_TEST(t_nan)
{
    for (int rn = 0; rn < 2; rn++) {
        run(MOEFUSE_F32, 5, 6, 6, rn, 2);
        run(MOEFUSE_F16, 5, 3, 3, rn, 2);
        run(MOEFUSE_F32, 4, 4, 4, rn, 4);
    }
}
END_TEST

START_TEST(t_inf)
{
    for (int rn = 0; rn < 2; rn++) run(MOEFUSE_F32, 6, 7, 3, rn, 3);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("topk");
    TCase *tc = h_add_tcase(s, "topk", h_setup, 60);
    tcase_add_test(tc, t_random);
    tcase_add_test(tc, t_ties);
    tcase_add_test(tc, t_nan);
    tcase_add_test(tc, t_inf);
    return h_run(s);
}
