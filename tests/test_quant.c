/* quant / dequant without activation: bit-exact against the oracle. */
#include <math.h>
#include <stdlib.h>

#include "harness.h"

/* run quant on x (already uploaded) and check exactly */
static void run_quant(tbuf *x, int64_t Tn, int64_t H, int64_t G, lay L, moefuse_dtype qdt, float eps,
                      int64_t rp)
{
    tbuf *q = tb_new2("q", qdt, Tn, H, rp, 0);
    int64_t Gn = H / G;
    tbuf *sc = h_new_scales_of("scales", L, 0, Tn, Gn, rp ? 1 : 0);
    moefuse_quant_options o = {0};
    o.group_size = (G == 128 && (Tn & 1)) ? 0 : G;
    o.scale_layout = L.layout;
    o.ue8m0 = L.ue8m0;
    o.eps = eps;
    moefuse_status st = CALL(moefuse_quant(g_ctx, T(x), T(q), T(sc), &o));
    HCHECK(st == MOEFUSE_OK, "quant T=%lld H=%lld G=%lld layout=%d ue8m0=%d: %s (%s)", (long long)Tn,
           (long long)H, (long long)G, L.layout, L.ue8m0, moefuse_status_name(st), moefuse_last_error(g_ctx));
    double *hp = malloc(sizeof(double) * (size_t)(Tn * H + 1));
    for (int64_t t = 0; t < Tn; t++)
        for (int64_t c = 0; c < H; c++) hp[t * H + c] = tb_get(x, t, c, 0);
    h_check_quant(q, sc, 0, Tn, Tn, H, G, L.layout, L.ue8m0, eps == 0 ? 1e-10f : eps, hp, hp, hp, "quant");

    /* dequant round trip: out = f32(q) * s, rounded once */
    moefuse_dtype odts[3] = {MOEFUSE_F32, MOEFUSE_BF16, MOEFUSE_F16};
    for (int k = 0; k < 3; k++) {
        tbuf *out = tb_new2("dq", odts[k], Tn, H, rp, 0);
        st = CALL(moefuse_dequant(g_ctx, T(q), T(sc), T(out), &o));
        HCHECK(st == MOEFUSE_OK, "dequant: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
        for (int64_t t = 0; t < Tn; t++)
            for (int64_t c = 0; c < H; c++) {
                int eb;
                double s = h_scale_at(sc, L.layout, 0, t, c / G, &eb);
                double qv = tb_get(q, t, c, 0);
                double want = or_round(h_dt_or(odts[k]), (double)or_f32(qv * s));
                double got = tb_get(out, t, c, 0);
                HCHECK((isnan(want) && isnan(got)) || want == got,
                       "dequant dt=%d t=%lld c=%lld: q=%g s=%g got %.9g want %.9g", odts[k], (long long)t,
                       (long long)c, qv, s, got, want);
            }
    }
    free(hp);
}

START_TEST(t_random_shapes)
{
    const int64_t Ts[] = {0, 1, 3, 129};
    for (int i = 0; i < 4; i++)
        for (int qk = 0; qk < 2; qk++) {
            int64_t H = 256;
            tbuf *x = tb_upload_unif(tb_new2("x", MOEFUSE_F32, Ts[i], H, 3, 1), -10, 10);
            run_quant(x, Ts[i], H, 128, LAYS[qk ? 1 : 0], qk ? MOEFUSE_I8 : MOEFUSE_F8_E4M3, 0, 0);
            tb_free_all();
        }
}
END_TEST

START_TEST(t_groups_layouts)
{
    const int64_t Gs[] = {32, 64, 128, 384};
    for (int gi = 0; gi < 4; gi++)
        for (int li = 0; li < 5; li++) {
            int64_t Tn = 5, H = 384;
            tbuf *x = tb_new2("x", MOEFUSE_F32, Tn, H, gi, 1);
            for (int64_t t = 0; t < Tn; t++)
                for (int64_t c = 0; c < H; c++)
                    tb_set(x, t, c, 0, h_unif(-1, 1) * ldexp(1.0, (int)h_randint(-20, 20)));
            tb_upload(x);
            run_quant(x, Tn, H, Gs[gi], LAYS[li], MOEFUSE_F8_E4M3, 0, gi & 1);
            if (!LAYS[li].ue8m0) run_quant(x, Tn, H, Gs[gi], LAYS[li], MOEFUSE_I8, 0, 0);
            tb_free_all();
        }
}
END_TEST

START_TEST(t_input_dtypes)
{
    for (int d = 0; d < 3; d++) {
        int64_t Tn = 7, H = 128;
        tbuf *x = tb_upload_unif(tb_new2("x", FLOATS[d], Tn, H, 2, 1), -300, 300);
        run_quant(x, Tn, H, 32, LAYS[d % 5], MOEFUSE_F8_E4M3, 0, 1);
        run_quant(x, Tn, H, 64, LAYS[0], MOEFUSE_I8, 0, 0);
        tb_free_all();
    }
}
END_TEST

/* NaN, +-Inf, all-zero groups, 448 boundary, ties, signed zero, subnormal codes */
START_TEST(t_special_values)
{
    int64_t Tn = 4, H = 128, G = 32;
    for (int qk = 0; qk < 2; qk++)
        for (int li = 0; li < (qk ? 2 : 5); li++) {
            tbuf *x = tb_new2("x", MOEFUSE_F32, Tn, H, 0, 1);
            for (int64_t t = 0; t < Tn; t++)
                for (int64_t c = 0; c < H; c++) tb_set(x, t, c, 0, h_unif(-2, 2));
            /* row 0: group 0 non-finite mix, group 1 all zero (incl. -0), group 2 max 448 */
            tb_set(x, 0, 0, 0, NAN);
            tb_set(x, 0, 1, 0, -NAN);
            tb_set(x, 0, 2, 0, INFINITY);
            tb_set(x, 0, 3, 0, -INFINITY);
            for (int64_t c = 32; c < 64; c++) tb_set(x, 0, c, 0, (c & 1) ? -0.0 : 0.0);
            const double b448[] = {448, 447, 440, 432, 17, 15, -0.0, 0x1p-10, 3 * 0x1p-10, -0x1p-10, 464, 0.5, 1.5, 2.5, -2.5};
            for (int i = 0; i < 15; i++) tb_set(x, 0, 64 + i, 0, b448[i] == 464 ? 100 : b448[i]);
            /* row 1: groups whose max is 449, 464, 465, huge */
            const double bigs[4] = {449, 464, 465, 3e38};
            for (int g = 0; g < 4; g++) {
                tb_set(x, 1, g * 32, 0, bigs[g]);
                tb_set(x, 1, g * 32 + 1, 0, -bigs[g]);
                tb_set(x, 1, g * 32 + 2, 0, bigs[g] / 3);
            }
            /* row 2: a group of only non-finite values, a group with only Inf */
            for (int64_t c = 0; c < 32; c++) tb_set(x, 2, c, 0, (c & 1) ? NAN : -INFINITY);
            for (int64_t c = 32; c < 64; c++) tb_set(x, 2, c, 0, INFINITY);
            /* row 3: int8 ties at s = 1 (amax 127), f8 ties at s = 1 (amax 448) */
            tb_set(x, 3, 0, 0, 127);
            tb_set(x, 3, 1, 0, 0.5);
            tb_set(x, 3, 2, 0, 1.5);
            tb_set(x, 3, 3, 0, -2.5);
            tb_set(x, 3, 4, 0, 126.5);
            tb_set(x, 3, 32, 0, 448);
            tb_set(x, 3, 33, 0, 17);
            tb_set(x, 3, 34, 0, 19);
            tb_set(x, 3, 35, 0, -432);
            tb_set(x, 3, 36, 0, 0x1p-10);
            tb_upload(x);
            run_quant(x, Tn, H, G, LAYS[li], qk ? MOEFUSE_I8 : MOEFUSE_F8_E4M3, 0, 0);
            tb_free_all();
        }
}
END_TEST

START_TEST(t_eps)
{
    int64_t Tn = 3, H = 64;
    tbuf *x = tb_new2("x", MOEFUSE_F32, Tn, H, 0, 1);
    tb_fill_unif(x, -1e-3, 1e-3);
    for (int64_t c = 0; c < 32; c++) tb_set(x, 1, c, 0, 0.0);
    tb_upload(x);
    run_quant(x, Tn, H, 32, LAYS[0], MOEFUSE_F8_E4M3, 0.5f, 0);
    run_quant(x, Tn, H, 32, LAYS[0], MOEFUSE_F8_E4M3, 0, 0);
    run_quant(x, Tn, H, 32, LAYS[4], MOEFUSE_F8_E4M3, 1e-30f, 0);
}
END_TEST

/* dequant of hand-made codes and scales: every f8 code (NaN codes too), UE8M0
 * bytes 1..255 (255 reads as NaN), f32 scales from tiny to huge */
START_TEST(t_dequant_handmade)
{
    const int64_t Tn = 8, H = 256, G = 32, Gn = H / G;
    moefuse_dtype odts[3] = {MOEFUSE_F32, MOEFUSE_BF16, MOEFUSE_F16};
    for (int qk = 0; qk < 2; qk++)
        for (int li = 0; li < 3; li++) {
            int layout = li == 2 ? MOEFUSE_SCALE_PACKED_UE8M0 : li == 1 ? MOEFUSE_SCALE_COLUMN_MAJOR : MOEFUSE_SCALE_ROW_MAJOR;
            int ue = li != 0 && !qk ? 1 : 0;
            if (qk && li == 2) continue;
            tbuf *q = tb_new2("q", qk ? MOEFUSE_I8 : MOEFUSE_F8_E4M3, Tn, H, 1, 1);
            for (int64_t t = 0; t < Tn; t++)
                for (int64_t c = 0; c < H; c++) *(uint8_t *)tb_el(q, t, c, 0) = (uint8_t)((t * H + c) & 0xFF);
            tb_upload(q);
            tbuf *sc = h_new_scales("scales", layout, ue && layout != MOEFUSE_SCALE_PACKED_UE8M0, 0, Tn, Gn, 0);
            h_fill_dequant_scales(sc, layout, ue, Tn, Gn);
            sc->is_input = 1;
            tb_upload(sc);
            moefuse_quant_options o = {0};
            o.group_size = G;
            o.scale_layout = layout;
            o.ue8m0 = ue;
            for (int d = 0; d < 3; d++) {
                tbuf *out = tb_new2("out", odts[d], Tn, H, 2, 0);
                moefuse_status st = CALL(moefuse_dequant(g_ctx, T(q), T(sc), T(out), &o));
                HCHECK(st == MOEFUSE_OK, "dequant: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
                for (int64_t t = 0; t < Tn; t++)
                    for (int64_t c = 0; c < H; c++) {
                        int eb;
                        double s = h_scale_at(sc, layout, 0, t, c / G, &eb);
                        double qv = tb_get(q, t, c, 0);
                        double want = or_round(h_dt_or(odts[d]), (double)or_f32(qv * s));
                        double got = tb_get(out, t, c, 0);
                        HCHECK((isnan(want) && isnan(got)) || (want == got && signbit(want) == signbit(got)),
                               "dequant(handmade) out dt=%d layout=%d ue=%d t=%lld c=%lld: q=0x%02x s=%g got %.9g want %.9g",
                               odts[d], layout, ue, (long long)t, (long long)c, *(uint8_t *)tb_el(q, t, c, 0), s, got, want);
                    }
            }
            tb_free_all();
        }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("quant");
    TCase *tc = h_add_tcase(s, "quant", h_setup, 120);
    tcase_add_test(tc, t_random_shapes);
    tcase_add_test(tc, t_groups_layouts);
    tcase_add_test(tc, t_input_dtypes);
    tcase_add_test(tc, t_special_values);
    tcase_add_test(tc, t_eps);
    tcase_add_test(tc, t_dequant_handmade);
    return h_run(s);
}
