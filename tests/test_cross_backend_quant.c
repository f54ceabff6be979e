/* test_cross_backend: act_quant, act_quant_masked, quant and dequant, byte for byte. */
#include "test_cross_backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------- dequant */

/* Bit-equal floats; NaN signs must agree (an f32 NaN's payload is not specified). */
static void cmp_exact_float(pair out, int64_t a, int64_t b, const char *what)
{
    size_t es = moefuse_dtype_size(out.d->t.dtype);
    unsigned char *pd = tb_el(out.d, a, b, 0), *pc = tb_el(out.c, a, b, 0);
    if (memcmp(pd, pc, es) == 0) return;
    double vd = tb_get(out.d, a, b, 0), vc = tb_get(out.c, a, b, 0);
    int ok = out.d->t.dtype == MOEFUSE_F32 && isnan(vd) && isnan(vc) && signbit(vd) == signbit(vc);
    HCHECK(ok, "%s [%lld, %lld]: %a on cpu, %a on %s; must be bit-equal", what, (long long)a, (long long)b, vc,
           vd, h_backend());
}

/* dequant is one f32 multiplication, rounded once: bit-equal. */
static void run_dequant(pair q, pair sc, const moefuse_quant_options *o, int64_t Tn, int64_t H, int rp)
{
    for (int d = 0; d < 3; d++) {
        pair out = pair2("dequant_out", FLOATS[d], Tn, H, rp ? 2 : 0, 0);
        BOTH(moefuse_dequant(g_ctx, T(q.d), T(sc.d), T(out.d), o),
             moefuse_dequant(g_ref, T(q.c), T(sc.c), T(out.c), o), "dequant");
        const char *what =
            h_fmt("dequant[out=%s T=%lld H=%lld G=%lld layout=%d ue8m0=%d]", moefuse_dtype_name(FLOATS[d]),
                  (long long)Tn, (long long)H, (long long)o->group_size, o->scale_layout, o->ue8m0);
        unsigned char *j = judged_new(out);
        for (int64_t t = 0; t < Tn; t++)
            for (int64_t c = 0; c < H; c++) {
                judge(j, out.d, tb_el(out.d, t, c, 0), moefuse_dtype_size(FLOATS[d]));
                cmp_exact_float(out, t, c, what);
            }
        same_elsewhere(out, j, what);
    }
}

/* ----------------------------------------------- quantized outputs */
static int32_t count_of(const qcfg *c, int64_t e) { return c->many_counts ? c->many_counts[e] : c->counts[e]; }

static const char *qdesc(const qcfg *c)
{
    return h_fmt("%s[x=%s q=%s E=%lld T=%lld H=%lld G=%lld layout=%d ue8m0=%d act=%d alpha=%g "
                 "up_offset=%g order=%d round=%d limit=%g rs=%d es=%d zero_tail=%d eps=%g special=%d]",
                 c->quant_only ? "quant"
                 : c->E        ? "act_quant_masked"
                               : "act_quant",
                 moefuse_dtype_name(c->xdt), moefuse_dtype_name(c->qdt), (long long)c->E, (long long)c->T,
                 (long long)c->H, (long long)c->G, c->L.layout, c->L.ue8m0, c->act, (double)c->alpha,
                 (double)c->up_offset, c->order, c->rnd, (double)c->limit, c->use_rs, c->es_kind,
                 c->zero_tail, (double)c->eps, c->special);
}

/* where an element is, for failure messages only (h_fmt has four buffers) */
/* col: a channel, or -1 - g for the scale of group g */
static const char *at(const qcfg *c, int64_t e, int64_t t, int64_t col)
{
    return h_fmt("%s e=%lld t=%lld %s=%lld", qdesc(c), (long long)e, (long long)t,
                 col < 0 ? "group" : "channel", (long long)(col < 0 ? -1 - col : col));
}

/* f32 scales: bit-equal. */
static void cmp_scale(const qcfg *c, int64_t e, int64_t t, int64_t col, const float *cpu, const float *dev)
{
    seen.scales++;
    HCHECK(memcmp(cpu, dev, 4) == 0 || !exact_division(), "%s: scale %a on cpu, %a on %s: must be bit-equal", at(c, e, t, col),
           *cpu, *dev, h_backend());
}

/* Codes: equal; an f8 NaN code from two NaN operands may have either sign. */
static void cmp_code(const qcfg *c, int64_t e, int64_t t, int64_t col, uint8_t cpu, uint8_t dev,
                     int nan_sign_free)
{
    seen.codes++;
    if (cpu == dev)
        return;
    const int both_nan = c->qdt == MOEFUSE_F8_E4M3 && (cpu & 0x7F) == 0x7F && (dev & 0x7F) == 0x7F;
    HCHECK((both_nan && nan_sign_free) || !exact_division(), "%s: code 0x%02x on cpu, 0x%02x on %s: must be equal",
           at(c, e, t, col), cpu, dev, h_backend());
    seen.nan_either++;
}

/* Rows [0, n) of expert e (2-D: e = 0, rank-2 tensors). */
static void cmp_rows(const qcfg *c, pair x, pair q, pair sc, unsigned char *jq, unsigned char *js,
                     int64_t e, int64_t n)
{
    const int three = q.d->t.rank == 3, f32_scales = sc.d->t.dtype == MOEFUSE_F32;
    const int64_t H = c->H, G = c->G;
    or_act_opt ao = {c->act, c->order, c->limit, c->rnd, c->alpha, c->up_offset};
    for (int64_t t = 0; t < n; t++) {
        for (int64_t g = 0; g < H / G; g++) {
            if (f32_scales) {
                float *sd = h_scale_el(sc.d, c->L.layout, e, t, g),
                      *scp = h_scale_el(sc.c, c->L.layout, e, t, g);
                judge(js, sc.d, sd, 4);
                cmp_scale(c, e, t, -1 - g, scp, sd);
            }
            for (int64_t i = g * G; i < (g + 1) * G; i++) {
                uint8_t *cd = three ? tb_el(q.d, e, t, i) : tb_el(q.d, t, i, 0);
                uint8_t *cc = three ? tb_el(q.c, e, t, i) : tb_el(q.c, t, i, 0);
                judge(jq, q.d, cd, 1);
                int free_sign = 0;
                if (*cc != *cd && !c->quant_only) {
                    double gv, uv;
                    gate_up(x.d, e, t, i, H, c->order, &gv, &uv);
                    free_sign = nan_from_two_nans(gv, uv, &ao);
                }
                cmp_code(c, e, t, i, *cc, *cd, free_sign);
            }
        }
    }
}

static int64_t clamp_count(int32_t n, int64_t Tmax) { return n < 0 ? 0 : n > Tmax ? Tmax : n; }

static void compare_quant(const qcfg *c, pair x, pair q, pair sc)
{
    unsigned char *jq = judged_new(q), *js = judged_new(sc);
    for (int64_t e = 0; e < (c->E ? c->E : 1); e++) {
        int64_t n = c->E ? clamp_count(count_of(c, e), c->T) : c->T;
        cmp_rows(c, x, q, sc, jq, js, e, n);
    }
    /* UE8M0 and packed scales, tails, padding: bytes equal (see run_quant_case) */
    same_elsewhere(q, jq, qdesc(c));
    same_elsewhere(sc, js, qdesc(c));
}

/*
 * Value i of a group of G whose h must probe the quantizer's edges (kind =
 * the group's index mod 9): amax exactly 448, 464, 480 (f8) or 127 (i8);
 * amax 2^-30, and in the f32 denormals (below eps); scales just above and just
 * below a power of two (UE8M0 rounds one up, keeps the other); quotients on
 * the rounding ties of the code (with s a power of two, h / s lands exactly on
 * the midpoint of two f8 codes, f8 subnormals included, or on k + 0.5 for
 * i8); and NaN, +-Inf among finite values.
 */
static double boundary_h(int64_t kind, int64_t i, int64_t G, int is_f8)
{
    static const double f8_ties[] = {1.0625, -1.1875, 2.125, 0x1.8p-9, -0x1p-10, 0x1.4p-8, 9.5 * 0x1p-9,
                                     17.0, -208.0, 0.0, -0.0, 1.0};
    static const double i8_ties[] = {0.5, -1.5, 2.5, 126.5, -126.5, 63.5, 0.0, -0.0, 1.0, 3.0, -7.5, 100.5};
    const double top = is_f8 ? 448.0 : 127.0;
    const double *ties = is_f8 ? f8_ties : i8_ties;
    const int nt = 12;
    if (i == G - 1) { /* the group's amax */
        switch (kind % 9) {
        case 0: return top;
        case 1: return is_f8 ? 464.0 : 127.0 * 0x1p-20;
        case 2: return is_f8 ? 480.0 : -127.0 * 0x1p+20;
        case 3: return 0x1p-30;
        case 4: return 0x1p-140; /* f32 denormal, below eps */
        case 5: return top * 0x1p-7 * (1.0 + 0x1p-23); /* s just above 2^-7 */
        case 6: return -top * 0x1p+5 * (1.0 - 0x1p-24); /* s just below 2^5 */
        case 7: return top * 0x1p-20;
        default: return 3.0;
        }
    }
    switch (kind % 9) {
    case 0: return ties[i % nt];                 /* s = 1 */
    case 7: return ties[i % nt] * 0x1p-20;       /* s = 2^-20 */
    case 8: return i == 0 ? NAN : i == 1 ? INFINITY : i == 2 ? -INFINITY : h_unif(-3, 3);
    default: return h_unif(-1, 1) * fabs(boundary_h(kind, G - 1, G, is_f8));
    }
}

/*
 * One act_quant / act_quant_masked / quant call on both sides. UE8M0 exponents
 * must be equal: the few ulps an f32 scale may differ by change the exponent
 * only when the scale lies that close to a power of two (a few random groups
 * in 2^22), and the codes of such a group would then differ by a factor 2.
 */
void run_quant_case(qcfg c)
{
    const int64_t E = c.E, Tn = c.T, H = c.H, Gn = H / c.G;
    const int64_t width = c.quant_only ? H : 2 * H;
    pair x = E ? pair3("x", c.xdt, E, Tn, width, c.rp, 1) : pair2("x", c.xdt, Tn, width, c.rp, 1);
    if (c.boundary) {
        /* quant: x = h; the activations: g = 32 and u = h / 32, since act(32) = 32 exactly in every
         * form (exp(-32) vanishes next to 1, erf and tanh are 1), so h = 32 * (h / 32) */
        const int is_f8 = c.qdt == MOEFUSE_F8_E4M3;
        for (int64_t e = 0; e < (E ? E : 1); e++)
            for (int64_t t = 0; t < Tn; t++)
                for (int64_t i = 0; i < H; i++) {
                    const double h = boundary_h(t * Gn + i / c.G, i % c.G, c.G, is_f8);
                    const int64_t gc = or_gate_pos(c.order, H, i), uc = or_up_pos(c.order, H, i);
                    if (c.quant_only) {
                        if (E) tb_set(x.d, e, t, i, h); else tb_set(x.d, t, i, 0, h);
                    } else if (E) {
                        tb_set(x.d, e, t, gc, 32.0);
                        tb_set(x.d, e, t, uc, h / 32.0);
                    } else {
                        tb_set(x.d, t, gc, 0, 32.0);
                        tb_set(x.d, t, uc, 0, h / 32.0);
                    }
                }
    } else if (c.quant_only) {
        for (int64_t t = 0; t < Tn; t++)
            for (int64_t i = 0; i < H; i++)
                tb_set(x.d, t, i, 0, act_input(c.special) * ldexp(1.0, (int)h_randint(-12, 12)));
    } else if (c.special == 2) {
        fill_every_bf16_gate(x.d, H, c.order);
    } else {
        fill_act(x.d, c.special);
    }
    if (c.special && Tn > 0 && Gn > 1) /* an all-zero group: x, or u, = 0 over group 1 of row 0 */
        for (int64_t i = c.G; i < 2 * c.G; i++) {
            int64_t col = c.quant_only ? i : or_up_pos(c.order, H, i);
            if (E)
                tb_set(x.d, 0, 0, col, 0.0);
            else
                tb_set(x.d, 0, col, 0, 0.0);
        }
    tb_upload(x.d);
    pair rs = {NULL, NULL}, es = {NULL, NULL}, cn = {NULL, NULL};
    if (c.use_rs) {
        rs = E ? pair2("row_scale", MOEFUSE_F32, E, Tn, 0, 1) : pair1("row_scale", MOEFUSE_F32, Tn, 1);
        tb_upload_unif(rs.d, 0.05, 2);
    }
    if (c.es_kind) {
        es = pair1("expert_scale", c.es_kind == 1 ? MOEFUSE_F32 : MOEFUSE_BF16, E, 1);
        tb_upload_unif(es.d, 0.25, 4);
    }
    if (E) {
        cn = pair1("counts", MOEFUSE_I32, E, 1);
        for (int64_t e = 0; e < E; e++) tb_set(cn.d, e, 0, 0, count_of(&c, e));
        tb_upload(cn.d);
    }
    pair q = E ? pair3("q", c.qdt, E, Tn, H, c.rp ? 3 : 0, 0) : pair2("q", c.qdt, Tn, H, c.rp ? 3 : 0, 0);
    pair sc = pair_of(h_new_scales_of("scales", c.L, E, Tn, Gn, c.rp ? 1 : 0));
    moefuse_act_quant_options o = {0};
    o.act = h_act_options(c.act, c.order, c.limit, c.rnd, c.alpha, c.up_offset);
    o.quant.group_size = c.G;
    o.quant.scale_layout = c.L.layout;
    o.quant.ue8m0 = c.L.ue8m0;
    o.quant.eps = c.eps;
    o.zero_tail = c.zero_tail;
    if (c.quant_only)
        BOTH(moefuse_quant(g_ctx, T(x.d), T(q.d), T(sc.d), &o.quant),
             moefuse_quant(g_ref, T(x.c), T(q.c), T(sc.c), &o.quant), qdesc(&c));
    else if (E)
        BOTH(moefuse_act_quant_masked(g_ctx, T(x.d), T(cn.d), T(rs.d), T(es.d), T(q.d), T(sc.d), &o),
             moefuse_act_quant_masked(g_ref, T(x.c), T(cn.c), T(rs.c), T(es.c), T(q.c), T(sc.c), &o),
             qdesc(&c));
    else
        BOTH(moefuse_act_quant(g_ctx, T(x.d), T(rs.d), T(q.d), T(sc.d), &o),
             moefuse_act_quant(g_ref, T(x.c), T(rs.c), T(q.c), T(sc.c), &o), qdesc(&c));
    compare_quant(&c, x, q, sc);
    if (c.quant_only) {
        /* dequant of the CPU's codes and scales, given to both sides */
        memcpy(q.d->full, q.c->full, q.d->total);
        memcpy(sc.d->full, sc.c->full, sc.d->total);
        tb_upload(q.d);
        tb_upload(sc.d);
        run_dequant(q, sc, &o.quant, Tn, H, c.rp);
    }
    tb_free_all();
}

/* ---------------------------------------------------------------- tests */

qcfg qbase(int64_t E, int64_t T, int64_t H, int64_t G)
{
    qcfg c;
    memset(&c, 0, sizeof c);
    c.xdt = MOEFUSE_F32;
    c.qdt = MOEFUSE_F8_E4M3;
    c.E = E, c.T = T, c.H = H, c.G = G;
    return c;
}

/* Every group size and layout, f8 and i8, 0 and 1 tokens, per-row groups of odd widths. */
START_TEST(t_act_quant_shapes)
{
    const int64_t Gs[4] = {32, 64, 128, 384};
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 5; l++) {
            qcfg c = qbase(0, 6, 384, Gs[g]);
            c.L = LAYS[l];
            c.rp = (g + l) & 1;
            c.act = (g + l) % 3;
            run_quant_case(c);
            if (!c.L.ue8m0) {
                c.qdt = MOEFUSE_I8;
                run_quant_case(c);
            }
        }
    const int64_t Ts[4] = {0, 1, 3, 37};
    for (int i = 0; i < 4; i++) {
        qcfg c = qbase(0, Ts[i], 256, 128);
        c.L = LAYS[i + 1];
        run_quant_case(c);
    }
    const int64_t odd[4] = {1, 3, 77, 301};
    for (int i = 0; i < 4; i++) {
        qcfg c = qbase(0, 5, odd[i], odd[i]);
        c.L = LAYS[i];
        c.xdt = FLOATS[i % 3];
        c.act = i % 3;
        c.use_rs = i & 1;
        run_quant_case(c);
    }
    finish("act_quant shapes");
}
END_TEST

/* Activations, order, clamp, bf16 rounding, row scale, dtypes, NaN / Inf / zeros. */
START_TEST(t_act_quant_options)
{
    for (int a = 0; a < 3; a++)
        for (int v = 0; v < 4; v++) {
            qcfg c = qbase(0, 9, 256, v == 3 ? 256 : 32 << v);
            c.xdt = FLOATS[(a + v) % 3];
            c.qdt = v == 1 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
            c.L = LAYS[v == 1 ? 1 : (a + v) % 5];
            c.act = a;
            c.order = v & 1;
            c.limit = v == 2 ? 1.75f : 0.0f;
            c.rnd = v >= 2 ? MOEFUSE_ROUND_BF16 : MOEFUSE_ROUND_NONE;
            c.use_rs = v != 0;
            c.special = 1;
            c.eps = v == 3 ? 1e-3f : 0.0f;
            run_quant_case(c);
        }
    finish("act_quant options");
}
END_TEST

START_TEST(t_act_quant_random)
{
    for (int r = 0; r < 14; r++) {
        int64_t G = (int64_t[]){32, 64, 128, 0}[h_randint(0, 3)];
        int64_t H = (G ? G : h_randint(1, 96)) * h_randint(1, 4);
        qcfg c = qbase(0, h_randint(0, 48), H, G ? G : H);
        c.xdt = FLOATS[h_randint(0, 2)];
        c.L = LAYS[h_randint(0, 4)];
        c.qdt = !c.L.ue8m0 && h_randint(0, 3) == 0 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
        c.act = (int)h_randint(0, 3);
        c.alpha = c.act == MOEFUSE_ACT_SILU_ALPHA && h_randint(0, 1) ? (float)h_unif(0.2, 3) : 0.0f;
        c.up_offset = h_randint(0, 2) == 0 ? (float)h_unif(-2, 2) : 0.0f;
        c.order = (int)h_randint(0, 2);
        c.rnd = (int)h_randint(0, 1);
        c.limit = h_randint(0, 2) == 0 ? (float)h_unif(0.5, 6) : 0.0f;
        c.use_rs = (int)h_randint(0, 1);
        c.rp = (int)h_randint(0, 1);
        c.special = (int)h_randint(0, 1);
        run_quant_case(c);
    }
    finish("act_quant random");
}
END_TEST

/* Counts below 0, 0 (empty experts), Tmax and beyond; zero_tail; expert scales. */
START_TEST(t_masked)
{
    const int32_t counts[6] = {0, 9, 15, -3, 4, 1};
    for (int l = 0; l < 5; l++)
        for (int zt = 0; zt < 2; zt++) {
            qcfg c = qbase(6, 9, 128, 32 << (l % 3));
            memcpy(c.counts, counts, sizeof counts);
            c.L = LAYS[l];
            c.zero_tail = zt;
            c.xdt = FLOATS[l % 3];
            c.qdt = l == 1 && zt ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
            c.act = (l + zt) % 3;
            c.use_rs = zt;
            c.es_kind = (l + zt) % 3;
            c.special = l & 1;
            c.rp = zt;
            run_quant_case(c);
        }
    for (int r = 0; r < 8; r++) {
        qcfg c = qbase(h_randint(1, 8), h_randint(1, 20), 64 * h_randint(1, 3), 64);
        for (int e = 0; e < c.E; e++) c.counts[e] = (int32_t)h_randint(-2, c.T + 3);
        c.G = h_randint(0, 1) ? 64 : c.H;
        c.L = LAYS[h_randint(0, 4)];
        c.qdt = !c.L.ue8m0 && h_randint(0, 2) == 0 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
        c.xdt = FLOATS[h_randint(0, 2)];
        c.act = (int)h_randint(0, 3);
        c.up_offset = h_randint(0, 2) == 0 ? 1.0f : 0.0f;
        c.order = (int)h_randint(0, 2);
        c.rnd = (int)h_randint(0, 1);
        c.limit = h_randint(0, 2) == 0 ? 3.5f : 0.0f;
        c.use_rs = (int)h_randint(0, 1);
        c.es_kind = (int)h_randint(0, 2);
        c.zero_tail = (int)h_randint(0, 1);
        c.special = (int)h_randint(0, 1);
        run_quant_case(c);
    }
    /* many experts, most of them empty: row offsets past what the device kernels keep in
     * local or shared memory (OpenCL 1024, CUDA 4096), and the first and last experts used */
    const int64_t manyE[2] = {1100, 4200};
    for (int r = 0; r < 2; r++) {
        int32_t *cnt = calloc((size_t)manyE[r], sizeof *cnt);
        ck_assert_ptr_nonnull(cnt);
        for (int64_t e = 0; e < manyE[r]; e++)
            cnt[e] = e == 0 || e == manyE[r] - 1 || h_randint(0, 9) == 0 ? (int32_t)h_randint(-1, 4) : 0;
        qcfg c = qbase(manyE[r], 3, 128, 128);
        c.many_counts = cnt;
        c.xdt = MOEFUSE_BF16; /* the table kernels where a backend has them */
        c.L = LAYS[r * 2];
        c.act = r;
        run_quant_case(c);
        free(cnt);
    }
    finish("act_quant_masked");
}
END_TEST

/* quant and dequant: bit-equal (no exp on the way). */
START_TEST(t_quant_dequant)
{
    for (int r = 0; r < 12; r++) {
        int64_t G = (int64_t[]){32, 64, 128, 0}[r % 4];
        int64_t H = G ? G * h_randint(1, 3) : h_randint(1, 200);
        qcfg c = qbase(0, r < 2 ? r : h_randint(2, 40), H, G ? G : H);
        c.quant_only = 1;
        c.xdt = FLOATS[r % 3];
        c.L = LAYS[r % 5];
        c.qdt = !c.L.ue8m0 && (r & 2) ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
        c.special = r & 1;
        c.eps = r == 7 ? 0.5f : 0.0f;
        c.rp = r & 1;
        run_quant_case(c);
    }
    finish("quant");
}
END_TEST

/* Boundary inputs (boundary_h) through quant, act_quant and the masked call, every layout. */
START_TEST(t_boundaries)
{
    for (int r = 0; r < 30; r++) {
        const int64_t G = (int64_t[]){128, 32, 64}[r % 3];
        qcfg c = qbase(r % 3 == 2 && r >= 10 ? 2 : 0, 9, 2 * G, G); /* 9 rows x 2 groups: every kind */
        c.boundary = 1;
        c.quant_only = r < 10; /* quant has no 3-D form */
        c.L = LAYS[r % 5];
        c.qdt = !c.L.ue8m0 && (r & 4) ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
        c.act = r % 3;
        c.order = (r >> 1) & 1;
        c.eps = r == 13 ? 0x1p-32f : 0.0f;
        for (int e = 0; e < 2; e++) c.counts[e] = 9 - e;
        run_quant_case(c);
    }
    finish("boundaries");
}
END_TEST

/*
 * Rows of whole 1024-channel items and partial last items (H = 3072, 2560, 2816, 1280,
 * 2432) and a masked call (H = 2048): bf16 x, G = 128 and e4m3, where the CUDA table
 * kernels take their fast item path, in every layout, with and without activation; random inputs,
 * special ones (a NaN, an Inf, a zero gate or an all-zero group sends its item back to the
 * general path) and boundary ones.
 */
START_TEST(t_whole_items)
{
    /* last items of 4, 2, 3 and 1 whole slots, and one with half a slot (general path) */
    const int64_t widths[5] = {3072, 2560, 2816, 1280, 2432};
    for (int r = 0; r < 15; r++) {
        const int masked = r % 4 == 3;
        const int64_t H = masked ? 2048 : widths[r % 5];
        qcfg c = qbase(masked ? 3 : 0, masked ? 7 : h_randint(1, 12), H, 128);
        c.counts[0] = 7, c.counts[1] = 0, c.counts[2] = (int32_t)h_randint(1, 6);
        c.xdt = MOEFUSE_BF16;
        c.L = LAYS[(r + r / 5) % 5];
        c.act = r % 3;
        c.order = (r >> 2) & 1;
        c.quant_only = !masked && r % 4 == 1;
        c.special = r / 5 == 1;
        c.boundary = r / 5 == 2;
        run_quant_case(c);
    }
    finish("whole items");
}
END_TEST

/* Hand-made codes (every f8 code, NaN included) and scales (UE8M0 1..255, tiny to huge f32). */
START_TEST(t_dequant_handmade)
{
    const int64_t Tn = 8, H = 256, G = 32, Gn = H / G;
    for (int v = 0; v < 5; v++) {
        int layout = v < 2   ? MOEFUSE_SCALE_ROW_MAJOR
                     : v < 4 ? MOEFUSE_SCALE_COLUMN_MAJOR
                             : MOEFUSE_SCALE_PACKED_UE8M0;
        int ue = v == 1 || v == 3 || v == 4, is_i8 = v == 2;
        pair q = pair2("q", is_i8 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3, Tn, H, 1, 1);
        for (int64_t t = 0; t < Tn; t++)
            for (int64_t c = 0; c < H; c++) *(uint8_t *)tb_el(q.d, t, c, 0) = (uint8_t)((t * H + c) & 0xFF);
        pair sc =
            pair_of(h_new_scales("scales", layout, ue && layout != MOEFUSE_SCALE_PACKED_UE8M0, 0, Tn, Gn, 0));
        h_fill_dequant_scales(sc.d, layout, ue, Tn, Gn);
        tb_upload(q.d);
        tb_upload(sc.d);
        moefuse_quant_options o = {.group_size = G, .scale_layout = layout, .ue8m0 = ue};
        run_dequant(q, sc, &o, Tn, H, 1);
        tb_free_all();
    }
    finish("dequant");
}
END_TEST

void cross_backend_quant_tests(TCase *tc)
{
    tcase_add_test(tc, t_act_quant_shapes);
    tcase_add_test(tc, t_act_quant_options);
    tcase_add_test(tc, t_act_quant_random);
    tcase_add_test(tc, t_boundaries);
    tcase_add_test(tc, t_whole_items);
    tcase_add_test(tc, t_masked);
    tcase_add_test(tc, t_quant_dequant);
    tcase_add_test(tc, t_dequant_handmade);
}
