/* act_mul: output within the justified interval of the output dtype. */
#include <math.h>
#include <stdlib.h>

#include "harness.h"

typedef struct {
    moefuse_dtype dt;
    int64_t Tn, H;
    int act, order, rnd, use_rs, rp;
    float limit, alpha, up_offset;
    int special; /* 1: NaN / Inf gates; 2: also the up values and the clamp's edges */
} cfg;

static cfg base(moefuse_dtype dt, int64_t Tn, int64_t H)
{
    cfg c = {dt, Tn, H, 0, 0, 0, 0, 0, 0.0f, 0.0f, 0.0f, 0};
    return c;
}

/* Edge values in row 0 (and row 1 when there is one), placed by the order. */
static void put_specials(tbuf *x, const cfg *c)
{
    const int64_t H = c->H;
#define G(i) or_gate_pos(c->order, H, (i) % H)
#define U(i) or_up_pos(c->order, H, (i) % H)
    tb_set(x, 0, G(0), 0, NAN);
    tb_set(x, 0, G(1), 0, INFINITY);
    tb_set(x, 0, G(2), 0, -INFINITY);
    tb_set(x, 0, U(3), 0, -INFINITY);
    tb_set(x, 0, G(3), 0, 1.5); /* act(g) clearly nonzero (in f32 gelu(-6) is exactly 0) */
    if (c->special < 2 || H < 16)
        return;
    /* up: NaN, +-Inf, -0.0 and +0.0 (the offset's add, or its absence, decides the sign of
     * h), values at and around +-limit, gates at and past the clamp */
    const double L = c->limit > 0 ? c->limit : 7.0;
    const double near[6] = {L, -L, nextafter(L, 1e9), nextafter(-L, -1e9), 2 * L, -2 * L};
    tb_set(x, 0, U(4), 0, NAN);
    tb_set(x, 0, U(5), 0, INFINITY);
    tb_set(x, 0, G(5), 0, -2.0);
    tb_set(x, 0, U(6), 0, -0.0);
    tb_set(x, 0, U(7), 0, 0.0);
    tb_set(x, 0, G(7), 0, -3.0);
    for (int i = 0; i < 6; i++) {
        tb_set(x, 0, G(8 + i), 0, near[i]);
        tb_set(x, 0, U(8 + i), 0, near[(i + 3) % 6]);
    }
    tb_set(x, 0, U(14), 0, -1.0); /* u + 1 = 0 exactly with the gpt-oss offset */
    tb_set(x, 0, G(15), 0, -0.0);
    if (c->Tn > 1) /* a whole row of -0.0 up values */
        for (int64_t i = 0; i < H; i++)
            tb_set(x, 1, U(i), 0, -0.0);
#undef G
#undef U
}

static void run_cfg(cfg c)
{
    const int64_t Tn = c.Tn, H = c.H;
    tbuf *x = tb_new2("x", c.dt, Tn, 2 * H, c.rp, 1);
    tb_fill_unif(x, c.limit > 0 ? -2.0 * c.limit : -6, c.limit > 0 ? 2.0 * c.limit : 6);
    if (c.special && Tn > 0)
        put_specials(x, &c);
    tb_upload(x);
    tbuf *rs = NULL;
    if (c.use_rs)
        rs = tb_upload_unif(tb_new1("row_scale", MOEFUSE_F32, Tn, 1), 0.1, 3);
    tbuf *out = tb_new2("out", c.dt, Tn, H, c.rp ? 3 : 0, 0);
    moefuse_act_options o = h_act_options(c.act, c.order, c.limit, c.rnd, c.alpha, c.up_offset);
    moefuse_status st = CALL(moefuse_act_mul(g_ctx, T(x), T(rs), T(out), &o));
    HCHECK(st == MOEFUSE_OK, "act_mul: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    size_t n = (size_t)(Tn * H + 1);
    double *hp = malloc(n * 8), *lo = malloc(n * 8), *hi = malloc(n * 8);
    or_act_opt ao = {c.act, c.order, c.limit, c.rnd, c.alpha, c.up_offset};
    h_ref_act(x, -1, Tn, H, rs, 1.0, &ao, hp, lo, hi);
    int odt = h_dt_or(c.dt);
    const char *what = h_fmt("act_mul dt=%d act=%d alpha=%g beta=%g ord=%d lim=%g rnd=%d", c.dt,
                             c.act, c.alpha, c.up_offset, c.order, c.limit, c.rnd);
    for (int64_t t = 0; t < Tn; t++)
        for (int64_t ch = 0; ch < H; ch++) {
            double p = hp[t * H + ch], l = lo[t * H + ch], u = hi[t * H + ch];
            double got = tb_get(out, t, ch, 0);
            if (!isfinite(p)) {
                HCHECK((isnan(p) && isnan(got)) || p == got, "%s t=%lld c=%lld: got %g want %g",
                       what, (long long)t, (long long)ch, got, p);
                continue;
            }
            if (p == 0.0) /* a zero's sign follows from the formula (u = -0.0 without offset) */
                HCHECK(got == 0.0 && !signbit(got) == !signbit(p),
                       "%s t=%lld c=%lld: got %g, oracle %g", what, (long long)t, (long long)ch,
                       got, p);
            if (c.dt == MOEFUSE_F32 && !c.rnd) { /* brief: relative 2^-22 band, unless the interval is wider */
                double w = fabs(p) * 0x1p-22;
                if (p - w < l) l = p - w;
                if (p + w > u) u = p + w;
            }
            double rl = or_round(odt, l), ru = or_round(odt, u);
            HCHECK(got >= rl && got <= ru,
                   "%s t=%lld c=%lld: got %.9g, oracle %.12g allows [%.9g, %.9g]", what,
                   (long long)t, (long long)ch, got, p, rl, ru);
        }
    free(hp);
    free(lo);
    free(hi);
    tb_free_all();
}

static void run(moefuse_dtype dt, int64_t Tn, int64_t H, int act, int order, float limit, int rnd,
                int use_rs, int rp, int special)
{
    cfg c = base(dt, Tn, H);
    c.act = act, c.order = order, c.limit = limit, c.rnd = rnd;
    c.use_rs = use_rs, c.rp = rp, c.special = special;
    run_cfg(c);
}

START_TEST(t_T_values)
{
    const int64_t Ts[] = {0, 1, 3, 129};
    for (int i = 0; i < 4; i++) run(MOEFUSE_F32, Ts[i], 96, 0, 0, 0, 0, 0, i & 1, 0);
}
END_TEST

START_TEST(t_dtypes_acts)
{
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 4; a++)
            for (int ord = 0; ord < 3; ord++) run(FLOATS[d], 7, 70, a, ord, 0, 0, ord & 1, 1, 0);
}
END_TEST

START_TEST(t_limit_round)
{
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 4; a++) {
            run(FLOATS[d], 5, 64, a, 0, 2.5f, 0, 1, 0, 0);
            run(FLOATS[d], 5, 64, a, 1, 0, MOEFUSE_ROUND_BF16, 1, 0, 0);
            run(FLOATS[d], 5, 64, a, 2, 1.0f, MOEFUSE_ROUND_BF16, 0, 1, 0);
        }
}
END_TEST

START_TEST(t_nonfinite)
{
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 4; a++) run(FLOATS[d], 2, 32, a, a % 3, 0, 0, 0, 0, 1);
}
END_TEST

/*
 * gpt-oss's activation: silu_alpha (alpha left 0, written as 1.702, or another), up offset 1
 * (and others: -1, 0.25), limit 7, every order, on fresh data across the clamp and on the
 * edge values (NaN, +-Inf, +-0.0 up values with and without an offset, values at +-limit).
 */
START_TEST(t_gpt_oss)
{
    const float alphas[3] = {0.0f, 1.702f, 0.5f}, offsets[4] = {1.0f, 0.0f, -1.0f, 0.25f};
    for (int d = 0; d < 3; d++)
        for (int ord = 0; ord < 3; ord++)
            for (int v = 0; v < 4; v++) {
                cfg c = base(FLOATS[d], 6, 80);
                c.act = MOEFUSE_ACT_SILU_ALPHA;
                c.alpha = alphas[v % 3];
                c.up_offset = offsets[v];
                c.limit = v == 3 ? 0.0f : 7.0f;
                c.order = ord;
                c.rnd = v == 2 ? MOEFUSE_ROUND_BF16 : 0;
                c.use_rs = v & 1;
                c.rp = ord & 1;
                c.special = 2;
                run_cfg(c);
            }
}
END_TEST

/* The up offset with the other activations, and the edge values of every activation. */
START_TEST(t_up_offset)
{
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 3; a++)
            for (int ord = 0; ord < 3; ord++) {
                cfg c = base(FLOATS[d], 3, 48);
                c.act = a;
                c.order = ord;
                c.up_offset = ord == 1 ? -2.5f : 1.0f;
                c.limit = a == 1 ? 3.0f : 0.0f;
                c.special = 2;
                run_cfg(c);
            }
}
END_TEST

/* Row widths around the kernels' vector steps: 4 mod 8 (f32 rows of 16-byte multiples that
 * are not whole 8-channel vectors; the CUDA staged kernel once wrote past them), odd, tiny,
 * dense and padded. The canary after the last row catches a write past the end. */
START_TEST(t_row_widths)
{
    const int64_t Hs[] = {4, 12, 228, 1028, 1, 7, 261};
    for (int d = 0; d < 3; d++)
        for (int i = 0; i < 7; i++)
            for (int rp = 0; rp < 2; rp++) {
                run(FLOATS[d], 3, Hs[i], 0, 0, 0, 0, 0, rp, 0);
                run(FLOATS[d], 3, Hs[i], MOEFUSE_ACT_SILU_ALPHA, MOEFUSE_GATE_INTERLEAVED, 7.0f, 0,
                    0, rp, 0);
            }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("act_mul");
    TCase *tc = h_add_tcase(s, "act_mul", h_setup, 120);
    tcase_add_test(tc, t_T_values);
    tcase_add_test(tc, t_dtypes_acts);
    tcase_add_test(tc, t_limit_round);
    tcase_add_test(tc, t_nonfinite);
    tcase_add_test(tc, t_gpt_oss);
    tcase_add_test(tc, t_up_offset);
    tcase_add_test(tc, t_row_widths);
    return h_run(s);
}
