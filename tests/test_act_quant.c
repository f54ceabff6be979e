/* 2-D fused activation + quantization against the interval oracle. */
#include <math.h>
#include <stdlib.h>

#include "harness.h"

typedef struct {
    moefuse_dtype xdt, qdt;
    int64_t Tn, H, G;
    lay L;
    int act, order, rnd;
    float limit;
    int use_rs, rp, special;
    float alpha, up_offset;
} cfg;

static void run(cfg c)
{
    int64_t H = c.H, Tn = c.Tn, Gn = H / c.G;
    tbuf *x = tb_new2("x", c.xdt, Tn, 2 * H, c.rp, 1);
    tb_fill_unif(x, -5, 5);
    if (c.special && Tn > 0) {
        /* NaN / Inf in gate and up, overflow, all-zero group, +-0.0 up values (with and
         * without an offset), values at the clamp */
#define GC(i) or_gate_pos(c.order, H, i)
#define UC(i) or_up_pos(c.order, H, i)
        tb_set(x, 0, GC(0), 0, NAN);
        tb_set(x, 0, GC(1), 0, INFINITY);
        tb_set(x, 0, GC(2), 0, -INFINITY);
        tb_set(x, 0, UC(3), 0, INFINITY);
        tb_set(x, 0, GC(3), 0, -1.25); /* act(g) clearly nonzero */
        tb_set(x, 0, UC(4), 0, NAN);
        tb_set(x, 0, GC(5), 0, INFINITY);
        tb_set(x, 0, UC(5), 0, 0.0);
        tb_set(x, 0, UC(6), 0, -0.0);
        tb_set(x, 0, UC(7), 0, -1.0);
        const double L = c.limit > 0 ? c.limit : 7.0;
        tb_set(x, 0, GC(8), 0, L);
        tb_set(x, 0, UC(8), 0, -L);
        tb_set(x, 0, GC(9), 0, 2 * L);
        tb_set(x, 0, UC(9), 0, 2 * L);
        if (Gn > 1)
            for (int64_t i = 0; i < c.G; i++) tb_set(x, 0, UC(c.G + i), 0, 0.0);
#undef GC
#undef UC
    }
    tb_upload(x);
    tbuf *rs = NULL;
    if (c.use_rs)
        rs = tb_upload_unif(tb_new1("row_scale", MOEFUSE_F32, Tn, 1), 0.05, 2);
    tbuf *q = tb_new2("q", c.qdt, Tn, H, c.rp ? 5 : 0, 0);
    tbuf *sc = h_new_scales_of("scales", c.L, 0, Tn, Gn, c.rp ? 2 : 0);
    moefuse_act_quant_options o = {0};
    o.act = h_act_options(c.act, c.order, c.limit, c.rnd, c.alpha, c.up_offset);
    o.quant.group_size = c.G;
    o.quant.scale_layout = c.L.layout;
    o.quant.ue8m0 = c.L.ue8m0;
    o.zero_tail = c.special; /* ignored in 2-D */
    moefuse_status st = CALL(moefuse_act_quant(g_ctx, T(x), T(rs), T(q), T(sc), &o));
    HCHECK(st == MOEFUSE_OK, "act_quant T=%lld H=%lld: %s (%s)", (long long)Tn, (long long)H,
           moefuse_status_name(st), moefuse_last_error(g_ctx));
    size_t n = (size_t)(Tn * H + 1);
    double *hp = malloc(n * 8), *lo = malloc(n * 8), *hi = malloc(n * 8);
    or_act_opt ao = {c.act, c.order, c.limit, c.rnd, c.alpha, c.up_offset};
    h_ref_act(x, -1, Tn, H, rs, 1.0, &ao, hp, lo, hi);
    char what[200];
    snprintf(what, sizeof what, "act_quant[xdt=%d q=%d T=%lld H=%lld G=%lld lay=%d ue=%d act=%d alpha=%g beta=%g ord=%d rnd=%d lim=%g rs=%d]",
             c.xdt, c.qdt, (long long)Tn, (long long)H, (long long)c.G, c.L.layout, c.L.ue8m0, c.act,
             c.alpha, c.up_offset, c.order, c.rnd, c.limit, c.use_rs);
    h_check_quant(q, sc, 0, Tn, Tn, H, c.G, c.L.layout, c.L.ue8m0, 1e-10f, hp, lo, hi, what);
    free(hp);
    free(lo);
    free(hi);
    tb_free_all();
}

static cfg base(void)
{
    cfg c = {MOEFUSE_F32, MOEFUSE_F8_E4M3, 3, 256, 128, {0, 0}, 0, 0, 0, 0.0f, 0, 0, 0, 0.0f, 0.0f};
    return c;
}

START_TEST(t_T_values)
{
    const int64_t Ts[] = {0, 1, 3, 129};
    for (int i = 0; i < 4; i++) {
        cfg c = base();
        c.Tn = Ts[i];
        c.rp = i & 1;
        run(c);
        c.qdt = MOEFUSE_I8;
        run(c);
    }
}
END_TEST

START_TEST(t_groups_layouts)
{
    const int64_t Gs[] = {32, 64, 128, 384};
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 5; l++) {
            cfg c = base();
            c.Tn = 5;
            c.H = 384;
            c.G = Gs[g];
            c.L = LAYS[l];
            c.rp = (g + l) & 1;
            run(c);
            if (!c.L.ue8m0) {
                c.qdt = MOEFUSE_I8;
                run(c);
            }
        }
}
END_TEST

START_TEST(t_activations)
{
    for (int a = 0; a < 4; a++)
        for (int ord = 0; ord < 3; ord++)
            for (int li = 0; li < 2; li++) {
                cfg c = base();
                c.Tn = 9;
                c.act = a;
                c.order = ord;
                c.limit = li ? 1.75f : 0.0f;
                c.use_rs = li;
                run(c);
            }
}
END_TEST

START_TEST(t_round_bf16)
{
    moefuse_dtype dts[3] = {MOEFUSE_BF16, MOEFUSE_F32, MOEFUSE_F16};
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 3; a++) {
            cfg c = base();
            c.xdt = dts[d];
            c.Tn = 17;
            c.rnd = MOEFUSE_ROUND_BF16;
            c.act = a;
            c.use_rs = d == 1;
            c.L = LAYS[a == 2 ? 4 : 0];
            run(c);
        }
}
END_TEST

START_TEST(t_input_dtypes_rowscale)
{
    for (int d = 0; d < 3; d++) {
        cfg c = base();
        c.xdt = FLOATS[d];
        c.Tn = 33;
        c.use_rs = 1;
        c.rp = 1;
        run(c);
        c.qdt = MOEFUSE_I8;
        c.G = 64;
        run(c);
    }
}
END_TEST

START_TEST(t_nonfinite)
{
    for (int ord = 0; ord < 3; ord++)
        for (int qk = 0; qk < 2; qk++) {
            cfg c = base();
            c.Tn = 4;
            c.G = 32;
            c.H = 128;
            c.special = 1;
            c.order = ord;
            c.qdt = qk ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
            run(c);
            c.limit = 3.0f;
            run(c);
            c.up_offset = 1.0f; /* NaN up values through the offset */
            c.act = MOEFUSE_ACT_SILU_ALPHA;
            run(c);
        }
}
END_TEST

/* gpt-oss's activation (silu_alpha 1.702, up offset 1, limit 7, interleaved) into FP8 and
 * i8 codes, every layout, with fresh data across the clamp and the edge values; also the
 * other orders, another alpha and offset, and the intermediate bf16 rounding. */
START_TEST(t_gpt_oss)
{
    moefuse_dtype dts[3] = {MOEFUSE_BF16, MOEFUSE_F32, MOEFUSE_F16};
    for (int d = 0; d < 3; d++)
        for (int l = 0; l < 5; l++)
            for (int v = 0; v < 3; v++) {
                cfg c = base();
                c.xdt = dts[d];
                c.Tn = 7;
                c.H = 256;
                c.G = l == 3 ? 256 : 64;
                c.L = LAYS[l];
                c.act = MOEFUSE_ACT_SILU_ALPHA;
                c.alpha = v == 0 ? 0.0f : v == 1 ? 1.702f : 0.75f;
                c.up_offset = v == 2 ? -0.5f : 1.0f;
                c.limit = 7.0f;
                c.order = v == 2 ? (int)(l % 2) : MOEFUSE_GATE_INTERLEAVED;
                c.rnd = d == 0 && v == 1 ? MOEFUSE_ROUND_BF16 : 0;
                c.use_rs = l & 1;
                c.special = 1;
                c.rp = v & 1;
                c.qdt = !c.L.ue8m0 && v == 1 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
                run(c);
            }
}
END_TEST

/* ROUND_BF16 equals the unfused path bit for bit: act_mul (bf16 out, same
 * rounding option) followed by quant of that bf16 tensor. Likewise with
 * ROUND_NONE and f32 x: act_mul's f32 h is the fused h exactly. */
START_TEST(t_round_bf16_equals_unfused)
{
    for (int mode = 0; mode < 2; mode++)
    for (int a = 0; a < 4; a++)
        for (int l = 0; l < 5; l++) {
            moefuse_dtype xdt = mode ? MOEFUSE_F32 : MOEFUSE_BF16;
            int64_t Tn = 13, H = 256, G = l == 3 ? 256 : 64, Gn = H / G;
            lay L = LAYS[l];
            tbuf *x = tb_upload_unif(tb_new2("x", xdt, Tn, 2 * H, 1, 1), -6, 6);
            tbuf *rs = tb_upload_unif(tb_new1("row_scale", MOEFUSE_F32, Tn, 1), 0.1, 2);
            tbuf *q1 = tb_new2("q_fused", MOEFUSE_F8_E4M3, Tn, H, 0, 0);
            tbuf *s1 = h_new_scales_of("s_fused", L, 0, Tn, Gn, 0);
            tbuf *hb = tb_new2("h_act_mul", xdt, Tn, H, 0, 0);
            tbuf *q2 = tb_new2("q_unfused", MOEFUSE_F8_E4M3, Tn, H, 0, 0);
            tbuf *s2 = h_new_scales_of("s_unfused", L, 0, Tn, Gn, 0);
            moefuse_act_quant_options o = {0};
            o.act.activation = a;
            o.act.limit = l == 1 ? 2.0f : 0.0f;
            o.act.order = (moefuse_gate_order)(l % 3);
            o.act.up_offset = a == MOEFUSE_ACT_SILU_ALPHA || l == 4 ? 1.0f : 0.0f;
            o.act.intermediate = mode ? MOEFUSE_ROUND_NONE : MOEFUSE_ROUND_BF16;
            o.quant.group_size = G;
            o.quant.scale_layout = L.layout;
            o.quant.ue8m0 = L.ue8m0;
            HCHECK(CALL(moefuse_act_quant(g_ctx, T(x), T(rs), T(q1), T(s1), &o)) == MOEFUSE_OK, "act_quant: %s", moefuse_last_error(g_ctx));
            HCHECK(CALL(moefuse_act_mul(g_ctx, T(x), T(rs), T(hb), &o.act)) == MOEFUSE_OK, "act_mul: %s", moefuse_last_error(g_ctx));
            HCHECK(CALL(moefuse_quant(g_ctx, T(hb), T(q2), T(s2), &o.quant)) == MOEFUSE_OK, "quant: %s", moefuse_last_error(g_ctx));
            for (int64_t t = 0; t < Tn; t++) {
                for (int64_t c = 0; c < H; c++)
                    HCHECK(*(uint8_t *)tb_el(q1, t, c, 0) == *(uint8_t *)tb_el(q2, t, c, 0),
                           "mode=%d (0 bf16, 1 f32) act=%d layout=%d: fused q[%lld,%lld]=0x%02x, act_mul+quant 0x%02x (h=%g)", mode, a, l,
                           (long long)t, (long long)c, *(uint8_t *)tb_el(q1, t, c, 0), *(uint8_t *)tb_el(q2, t, c, 0),
                           tb_get(hb, t, c, 0));
                for (int64_t g = 0; g < Gn; g++) {
                    int e1, e2;
                    double v1 = h_scale_at(s1, L.layout, 0, t, g, &e1), v2 = h_scale_at(s2, L.layout, 0, t, g, &e2);
                    HCHECK(v1 == v2 && e1 == e2, "mode=%d act=%d layout=%d: fused scale (t=%lld g=%lld) %a, unfused %a", mode, a,
                           l, (long long)t, (long long)g, v1, v2);
                }
            }
            tb_free_all();
        }
}
END_TEST

START_TEST(t_randomized)
{
    const int64_t Gs[4] = {32, 64, 128, 0};
    for (int r = 0; r < 12; r++) {
        cfg c = base();
        c.xdt = FLOATS[h_randint(0, 2)];
        c.Tn = h_randint(0, 70);
        int64_t G = Gs[h_randint(0, 3)];
        c.H = (G ? G : 32) * h_randint(1, 6);
        c.G = G ? G : c.H;
        c.L = LAYS[h_randint(0, 4)];
        c.qdt = (!c.L.ue8m0 && h_randint(0, 1)) ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
        c.act = (int)h_randint(0, 3);
        if (c.act == MOEFUSE_ACT_SILU_ALPHA)
            c.alpha = h_randint(0, 1) ? 0.0f : (float)h_unif(0.2, 3);
        c.up_offset = h_randint(0, 1) ? 0.0f : (float)h_unif(-2, 2);
        c.order = (int)h_randint(0, 2);
        c.rnd = (int)h_randint(0, 1);
        c.limit = h_randint(0, 1) ? (float)h_unif(0.5, 6) : 0.0f;
        c.use_rs = (int)h_randint(0, 1);
        c.rp = (int)h_randint(0, 1);
        run(c);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("act_quant");
    TCase *tc = h_add_tcase(s, "act_quant", h_setup, 120);
    tcase_add_test(tc, t_T_values);
    tcase_add_test(tc, t_groups_layouts);
    tcase_add_test(tc, t_activations);
    tcase_add_test(tc, t_round_bf16);
    tcase_add_test(tc, t_input_dtypes_rowscale);
    tcase_add_test(tc, t_nonfinite);
    tcase_add_test(tc, t_gpt_oss);
    tcase_add_test(tc, t_randomized);
    tcase_add_test(tc, t_round_bf16_equals_unfused);
    return h_run(s);
}
