/* 3-D expert-masked act_quant: oracle, count clamping, zero_tail, and
 * bitwise equality with the 2-D call on x[e, 0:n[e]]. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* The gated options besides activation and rounding (t_gpt_oss sets them; zero otherwise),
 * and whether row 0 of each expert gets edge values. */
static struct {
    int order, special;
    float limit, alpha, up_offset;
} gated;

/* NaN / Inf gates and up values, +-0.0 up values, values at the clamp, in row 0 of expert e. */
static void put_specials(tbuf *x, int64_t e, int64_t H)
{
#define GC(i) or_gate_pos(gated.order, H, i)
#define UC(i) or_up_pos(gated.order, H, i)
    const double L = gated.limit > 0 ? gated.limit : 7.0;
    tb_set(x, e, 0, GC(0), NAN);
    tb_set(x, e, 0, UC(1), NAN);
    tb_set(x, e, 0, GC(2), -INFINITY);
    tb_set(x, e, 0, UC(3), INFINITY);
    tb_set(x, e, 0, UC(4), -0.0);
    tb_set(x, e, 0, UC(5), -1.0);
    tb_set(x, e, 0, GC(6), L);
    tb_set(x, e, 0, UC(6), -2 * L);
    tb_set(x, e, 0, GC(7), 3 * L);
    tb_set(x, e, 0, UC(7), L);
#undef GC
#undef UC
}

static void run(moefuse_dtype xdt, moefuse_dtype qdt, int64_t E, int64_t Tmax, int64_t H, int64_t G,
                lay L, const int32_t *counts, int zero_tail, int es_kind /*0 none 1 f32 2 bf16*/,
                int use_rs, int act, int rnd)
{
    int64_t Gn = H / G;
    tbuf *x = tb_new3("x", xdt, E, Tmax, 2 * H, 1, 1);
    tb_fill_unif(x, gated.limit > 0 ? -2 * gated.limit : -4, gated.limit > 0 ? 2 * gated.limit : 4);
    if (gated.special && H >= 8)
        for (int64_t e = 0; e < E; e++)
            put_specials(x, e, H);
    tb_upload(x);
    tbuf *cn = tb_new1("counts", MOEFUSE_I32, E, 1);
    for (int64_t e = 0; e < E; e++) tb_set(cn, e, 0, 0, counts[e]);
    tb_upload(cn);
    tbuf *rs = NULL, *es = NULL;
    if (use_rs)
        rs = tb_upload_unif(tb_new2("row_scale", MOEFUSE_F32, E, Tmax, 0, 1), 0.1, 2);
    if (es_kind)
        es = tb_upload_unif(tb_new1("expert_scale", es_kind == 1 ? MOEFUSE_F32 : MOEFUSE_BF16, E, 1),
                            0.25, 4);
    tbuf *q = tb_new3("q", qdt, E, Tmax, H, 0, 0);
    tbuf *sc = h_new_scales_of("scales", L, E, Tmax, Gn, 0);
    moefuse_act_quant_options o = {0};
    o.act.activation = act;
    o.act.intermediate = rnd;
    o.act.order = gated.order;
    o.act.limit = gated.limit;
    o.act.alpha = gated.alpha;
    o.act.up_offset = gated.up_offset;
    o.quant.group_size = G;
    o.quant.scale_layout = L.layout;
    o.quant.ue8m0 = L.ue8m0;
    o.zero_tail = zero_tail;
    moefuse_status st = CALL(moefuse_act_quant_masked(g_ctx, T(x), T(cn), T(rs), T(es), T(q), T(sc), &o));
    HCHECK(st == MOEFUSE_OK, "act_quant_masked: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));

    /* keep host copies of the 3-D result and its pristine (poisoned) state */
    unsigned char *q3 = malloc(q->total), *s3 = malloc(sc->total);
    memcpy(q3, q->full, q->total);
    memcpy(s3, sc->full, sc->total);
    size_t esq = 1, ess = sc->t.dtype == MOEFUSE_U8 ? 1 : 4;
    or_act_opt ao = {act, gated.order, gated.limit, rnd, gated.alpha, gated.up_offset};
    int64_t Ta = (Tmax + 3) / 4 * 4;
    for (int64_t e = 0; e < E; e++) {
        int64_t n = counts[e] < 0 ? 0 : counts[e] > Tmax ? Tmax : counts[e];
        double esv = es ? tb_get(es, e, 0, 0) : 1.0;
        size_t m = (size_t)(Tmax * H + 1);
        double *hp = malloc(m * 8), *lo = malloc(m * 8), *hi = malloc(m * 8);
        h_ref_act(x, e, n, H, rs, esv, &ao, hp, lo, hi);
        char what[200];
        snprintf(what, sizeof what, "masked[E=%lld Tmax=%lld H=%lld G=%lld lay=%d ue=%d n=%d zt=%d es=%d act=%d ord=%d alpha=%g beta=%g lim=%g]",
                 (long long)E, (long long)Tmax, (long long)H, (long long)G, L.layout, L.ue8m0, counts[e],
                 zero_tail, es_kind, act, gated.order, gated.alpha, gated.up_offset, gated.limit);
        h_check_quant(q, sc, e, n, Tmax, H, G, L.layout, L.ue8m0, 1e-10f, hp, lo, hi, what);
        /* tail rows n..Tmax-1 */
        for (int64_t t = n; t < Tmax; t++) {
            for (int64_t c = 0; c < H; c++) {
                size_t off = (unsigned char *)tb_el(q, e, t, c) - q->full;
                if (zero_tail) HCHECK(q->full[off] == 0, "%s: tail q[%lld,%lld,%lld] not zero", what, (long long)e, (long long)t, (long long)c);
                else HCHECK(q->full[off] == q->shadow[off], "%s: tail q[%lld,%lld,%lld] written without zero_tail", what, (long long)e, (long long)t, (long long)c);
            }
            for (int64_t g = 0; g < Gn; g++) {
                unsigned char *p;
                size_t nb = ess;
                if (L.layout == MOEFUSE_SCALE_ROW_MAJOR) p = tb_el(sc, e, t, g);
                else if (L.layout == MOEFUSE_SCALE_COLUMN_MAJOR) p = tb_el(sc, e, g, t);
                else {
                    if (g % 4) continue;
                    p = (unsigned char *)tb_el(sc, e, g / 4, t);
                    nb = 4; /* the whole word, unused bytes included */
                }
                size_t off = p - sc->full;
                for (size_t b = 0; b < nb; b++) {
                    if (zero_tail) HCHECK(sc->full[off + b] == 0, "%s: tail scale t=%lld g=%lld not zero", what, (long long)t, (long long)g);
                    else HCHECK(sc->full[off + b] == sc->shadow[off + b], "%s: tail scale t=%lld g=%lld written without zero_tail", what, (long long)t, (long long)g);
                }
            }
        }
        free(hp);
        free(lo);
        free(hi);

        /* bitwise equality with the 2-D call on the view x[e, 0:n] */
        moefuse_tensor xv = x->t;
        xv.rank = 2;
        xv.offset = x->t.offset + e * x->t.stride[0] * (int64_t)moefuse_dtype_size(xdt);
        xv.shape[0] = n;
        xv.shape[1] = 2 * H;
        xv.stride[0] = x->t.stride[1];
        xv.stride[1] = 1;
        moefuse_tensor rv, ev;
        tbuf *q2 = tb_new2("q2d", qdt, n, H, 0, 0);
        tbuf *s2 = h_new_scales_of("scales2d", L, 0, n, Gn, 0);
        tbuf *rs2 = NULL;
        if (rs) {
            rv = rs->t;
            rv.rank = 1;
            rv.offset = rs->t.offset + e * rs->t.stride[0] * 4;
            rv.shape[0] = n;
            rv.stride[0] = 1;
        }
        (void)ev;
        (void)rs2;
        moefuse_act_quant_options o2 = o;
        if (es) {
            /* the 2-D call has no expert_scale: compare only without it */
        }
        if (!es) {
            st = CALL(moefuse_act_quant(g_ctx, &xv, rs ? &rv : NULL, T(q2), T(s2), &o2));
            HCHECK(st == MOEFUSE_OK, "act_quant 2-D view: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
            for (int64_t t = 0; t < n; t++) {
                for (int64_t c = 0; c < H; c++) {
                    uint8_t a = q3[(unsigned char *)tb_el(q, e, t, c) - q->full];
                    uint8_t b = *(uint8_t *)tb_el(q2, t, c, 0);
                    HCHECK(a == b, "%s: 3-D q[%lld,%lld,%lld]=0x%02x but 2-D gives 0x%02x", what, (long long)e,
                           (long long)t, (long long)c, a, b);
                }
                for (int64_t g = 0; g < Gn; g++) {
                    int e3, e2;
                    memcpy(sc->full, s3, sc->total);
                    double v3 = h_scale_at(sc, L.layout, e, t, g, &e3);
                    double v2 = h_scale_at(s2, L.layout, 0, t, g, &e2);
                    HCHECK(e3 == e2 && memcmp(&v3, &v2, 8) == 0, "%s: 3-D scale (t=%lld g=%lld) %a/%d but 2-D %a/%d", what,
                           (long long)t, (long long)g, v3, e3, v2, e2);
                }
            }
        }
        (void)esq;
        (void)Ta;
        memcpy(q->full, q3, q->total);
        memcpy(sc->full, s3, sc->total);
    }
    free(q3);
    free(s3);
    tb_free_all();
}

START_TEST(t_counts)
{
    int32_t counts[6] = {0, 9, 15, -3, 4, 1};
    for (int zt = 0; zt < 2; zt++)
        for (int l = 0; l < 5; l++)
            run(MOEFUSE_F32, MOEFUSE_F8_E4M3, 6, 9, 128, 32 << (l % 3), LAYS[l], counts, zt, 0, l & 1, 0, 0);
}
END_TEST

START_TEST(t_random_counts)
{
    for (int r = 0; r < 12; r++) {
        int32_t counts[5];
        int64_t Tmax = h_randint(1, 20);
        for (int e = 0; e < 5; e++) counts[e] = (int32_t)h_randint(-2, Tmax + 3);
        run(r & 1 ? MOEFUSE_BF16 : MOEFUSE_F16, r & 2 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3, 5, Tmax, 256, 128,
            LAYS[r & 2 ? 1 : r % 5], counts, r & 1, (r / 4) % 3, 1, r % 3, r & 1);
    }
}
END_TEST

START_TEST(t_expert_scale)
{
    int32_t counts[3] = {3, 0, 7};
    for (int k = 1; k <= 2; k++)
        for (int zt = 0; zt < 2; zt++) {
            run(MOEFUSE_F32, MOEFUSE_F8_E4M3, 3, 7, 64, 64, LAYS[0], counts, zt, k, zt, 0, 0);
            run(MOEFUSE_BF16, MOEFUSE_F8_E4M3, 3, 7, 64, 32, LAYS[4], counts, zt, k, 1, 1, MOEFUSE_ROUND_BF16);
        }
}
END_TEST

/* gpt-oss's activation (silu_alpha 1.702, up offset 1, limit 7, interleaved) in the masked
 * layout, with expert scales and edge values; also another order, alpha and offset. */
START_TEST(t_gpt_oss)
{
    int32_t counts[4] = {5, 0, 9, 2};
    for (int v = 0; v < 4; v++) {
        gated.order = v == 3 ? MOEFUSE_UP_FIRST : MOEFUSE_GATE_INTERLEAVED;
        gated.limit = v == 2 ? 0.0f : 7.0f;
        gated.alpha = v == 1 ? 1.702f : v == 3 ? 2.5f : 0.0f;
        gated.up_offset = v == 3 ? -0.75f : 1.0f;
        gated.special = 1;
        run(v & 1 ? MOEFUSE_F32 : MOEFUSE_BF16, MOEFUSE_F8_E4M3, 4, 9, 256, 128, LAYS[v + 1],
            counts, v & 1, v % 3, v != 1, MOEFUSE_ACT_SILU_ALPHA, v == 2 ? MOEFUSE_ROUND_BF16 : 0);
        run(MOEFUSE_F16, MOEFUSE_I8, 4, 9, 128, 32, LAYS[v % 2], counts, 1, 0, 1,
            MOEFUSE_ACT_SILU_ALPHA, 0);
    }
    gated.order = gated.special = 0;
    gated.limit = gated.alpha = gated.up_offset = 0.0f;
}
END_TEST

START_TEST(t_all_empty)
{
    int32_t counts[2] = {0, -100};
    run(MOEFUSE_F32, MOEFUSE_F8_E4M3, 2, 5, 128, 128, LAYS[1], counts, 0, 0, 0, 0, 0);
    run(MOEFUSE_F32, MOEFUSE_F8_E4M3, 2, 5, 128, 128, LAYS[4], counts, 1, 0, 0, 0, 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("act_quant_masked");
    TCase *tc = h_add_tcase(s, "masked", h_setup, 180);
    tcase_add_test(tc, t_counts);
    tcase_add_test(tc, t_random_counts);
    tcase_add_test(tc, t_expert_scale);
    tcase_add_test(tc, t_gpt_oss);
    tcase_add_test(tc, t_all_empty);
    return h_run(s);
}
