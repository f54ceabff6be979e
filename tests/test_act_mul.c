/* act_mul: output within the justified interval of the output dtype. */
#include <math.h>
#include <stdlib.h>

#include "harness.h"

static void run(moefuse_dtype dt, int64_t Tn, int64_t H, int act, int order, float limit, int rnd,
                int use_rs, int rp, int special)
{
    tbuf *x = tb_new2("x", dt, Tn, 2 * H, rp, 1);
    tb_fill_unif(x, -6, 6);
    if (special && Tn > 0) {
        tb_set(x, 0, 0, 0, NAN);
        tb_set(x, 0, 1, 0, INFINITY);
        tb_set(x, 0, 2, 0, -INFINITY);
        tb_set(x, 0, H + 3, 0, -INFINITY);
        tb_set(x, 0, 3, 0, 1.5); /* act(g) clearly nonzero (in f32 gelu(-6) is exactly 0) */
    }
    tb_upload(x);
    tbuf *rs = NULL;
    if (use_rs) {
        rs = tb_new1("row_scale", MOEFUSE_F32, Tn, 1);
        tb_fill_unif(rs, 0.1, 3);
        tb_upload(rs);
    }
    tbuf *out = tb_new2("out", dt, Tn, H, rp ? 3 : 0, 0);
    moefuse_act_options o = {.activation = act, .order = order, .limit = limit, .intermediate = rnd};
    moefuse_status st = CALL(moefuse_act_mul(g_ctx, T(x), T(rs), T(out), &o));
    HCHECK(st == MOEFUSE_OK, "act_mul: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    size_t n = (size_t)(Tn * H + 1);
    double *hp = malloc(n * 8), *lo = malloc(n * 8), *hi = malloc(n * 8);
    or_act_opt ao = {act, order, limit, rnd};
    h_ref_act(x, -1, Tn, H, rs, 1.0, &ao, hp, lo, hi);
    int odt = h_dt_or(dt);
    for (int64_t t = 0; t < Tn; t++)
        for (int64_t c = 0; c < H; c++) {
            double p = hp[t * H + c], l = lo[t * H + c], u = hi[t * H + c];
            double got = tb_get(out, t, c, 0);
            if (!isfinite(p)) {
                HCHECK((isnan(p) && isnan(got)) || p == got, "act_mul dt=%d act=%d t=%lld c=%lld: got %g want %g",
                       dt, act, (long long)t, (long long)c, got, p);
                continue;
            }
            if (dt == MOEFUSE_F32 && !rnd) { /* brief: relative 2^-22 band, unless the interval is wider */
                double w = fabs(p) * 0x1p-22;
                if (p - w < l) l = p - w;
                if (p + w > u) u = p + w;
            }
            double rl = or_round(odt, l), ru = or_round(odt, u);
            HCHECK(got >= rl && got <= ru,
                   "act_mul dt=%d act=%d ord=%d lim=%g rnd=%d t=%lld c=%lld: got %.9g, oracle %.12g allows [%.9g, %.9g]",
                   dt, act, order, limit, rnd, (long long)t, (long long)c, got, p, rl, ru);
        }
    free(hp);
    free(lo);
    free(hi);
    tb_free_all();
}

START_TEST(t_T_values)
{
    const int64_t Ts[] = {0, 1, 3, 129};
    for (int i = 0; i < 4; i++) run(MOEFUSE_F32, Ts[i], 96, 0, 0, 0, 0, 0, i & 1, 0);
}
END_TEST

START_TEST(t_dtypes_acts)
{
    moefuse_dtype dts[3] = {MOEFUSE_F32, MOEFUSE_F16, MOEFUSE_BF16};
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 3; a++)
            for (int ord = 0; ord < 2; ord++) run(dts[d], 7, 70, a, ord, 0, 0, ord, 1, 0);
}
END_TEST

START_TEST(t_limit_round)
{
    moefuse_dtype dts[3] = {MOEFUSE_F32, MOEFUSE_F16, MOEFUSE_BF16};
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 3; a++) {
            run(dts[d], 5, 64, a, 0, 2.5f, 0, 1, 0, 0);
            run(dts[d], 5, 64, a, 1, 0, MOEFUSE_ROUND_BF16, 1, 0, 0);
            run(dts[d], 5, 64, a, 0, 1.0f, MOEFUSE_ROUND_BF16, 0, 1, 0);
        }
}
END_TEST

START_TEST(t_nonfinite)
{
    moefuse_dtype dts[3] = {MOEFUSE_F32, MOEFUSE_F16, MOEFUSE_BF16};
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 3; a++) run(dts[d], 2, 32, a, 0, 0, 0, 0, 0, 1);
}
END_TEST

/* Row widths around the kernels' vector steps: 4 mod 8 (f32 rows of 16-byte multiples that
 * are not whole 8-channel vectors; the CUDA staged kernel once wrote past them), odd, tiny,
 * dense and padded. The canary after the last row catches a write past the end. */
START_TEST(t_row_widths)
{
    moefuse_dtype dts[3] = {MOEFUSE_F32, MOEFUSE_F16, MOEFUSE_BF16};
    const int64_t Hs[] = {4, 12, 228, 1028, 1, 7, 261};
    for (int d = 0; d < 3; d++)
        for (int i = 0; i < 7; i++)
            for (int rp = 0; rp < 2; rp++) run(dts[d], 3, Hs[i], 0, 0, 0, 0, 0, rp, 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("act_mul");
    TCase *tc = tcase_create("act_mul");
    tcase_add_checked_fixture(tc, h_setup, h_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, t_T_values);
    tcase_add_test(tc, t_dtypes_acts);
    tcase_add_test(tc, t_limit_round);
    tcase_add_test(tc, t_nonfinite);
    tcase_add_test(tc, t_row_widths);
    suite_add_tcase(s, tc);
    return h_run(s);
}
