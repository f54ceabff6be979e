/*
 * FP8 MoE (moe_gate_fp8, moe_final_fp8, moe_forward_fp8, moe_masked_fp8) against a float64
 * oracle written here from docs/NUMERICS.md "FP8 MoE": codes and scales decoded exactly,
 * block sums exact, the activation and the quantization of h in double. Every backend meets
 * the 2e-2 bound of "Agreement between backends"; the CPU backend, the reference, is held to
 * much tighter ones (see CPU_H_BOUND); backends that form p_b exactly (opencl, and cuda with
 * MOEFUSE_CUDA_FP8=portable) must equal the CPU backend bit for bit, CUDA's Hopper paths (the
 * wgmma kernel, the decode kernel) within the documented tolerances. A backend without FP8 MoE makes the program exit with SKIP.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define BLK 128
/* NUMERICS.md: relative 2-norm error of out (and of dequantized h) of any backend */
#define FP8_BOUND 2e-2
/*
 * The CPU backend's dequantized h against the oracle's: a code may differ only where the f32
 * gate and the double one round to neighbouring codes, the oracle's value within TIE_REL of
 * their midpoint (h_tie_flip, checked code by code); past those, the relative error (the scales'
 * f32 rounding) stays below CPU_H_BOUND. Measured: below 1e-4 on every configuration here. A
 * clamp makes many h equal, so one tie can flip many codes at once: a norm alone cannot tell
 * that from an error.
 */
#define CPU_H_BOUND 1e-3
#define TIE_REL 1e-5

typedef struct {
    int64_t M, K, I, E, k, Eg;
    int use_map, invalid, empty_expert;
    int bias; /* 0 none, 1 f32, 2 bf16 */
    int act, order;
    float limit, eps, alpha, up_offset;
    moefuse_dtype xdt; /* f32, f16, bf16, or f8_e4m3 with x_scales */
    int layout, ue8m0; /* activation scales */
    moefuse_dtype wsdt; /* weight scales f32 or u8 */
    moefuse_dtype odt;
    int unreduced; /* also the un-reduced final */
    int nan_w, nan_x, inf_x, zero_groups;
} cfg;

static double f8val[256];

static void init_f8(void)
{
    for (int c = 0; c < 256; c++) f8val[c] = or_decode(OR_F8, (uint32_t)c);
}

static int is_nan_code(uint8_t c) { return (c & 0x7F) == 0x7F; }

static const char *desc(const cfg *c)
{
    return h_fmt("[M=%lld K=%lld I=%lld E=%lld k=%lld xdt=%d layout=%d ue8m0=%d wsdt=%d odt=%d "
                 "act=%d alpha=%g beta=%g ord=%d lim=%g bias=%d map=%d inv=%d nanw=%d nanx=%d infx=%d]",
                 (long long)c->M, (long long)c->K, (long long)c->I, (long long)c->E, (long long)c->k,
                 c->xdt, c->layout, c->ue8m0, c->wsdt, c->odt, c->act, c->alpha, c->up_offset,
                 c->order, c->limit, c->bias, c->use_map, c->invalid, c->nan_w, c->nan_x, c->inf_x);
}

/* ------------------------------------------------------------- operands */

/* w [E, N, D] codes of values in about [-200, 200]; scales [E, N/128, D/128] of ~1/(200 sqrt D) */
static void fill_weight(tbuf *w, tbuf *ws, int64_t E, int64_t N, int64_t D, int nan_w)
{
    for (int64_t e = 0; e < E; e++)
        for (int64_t n = 0; n < N; n++)
            for (int64_t d = 0; d < D; d++)
                *(uint8_t *)tb_el(w, e, n, d) = or_f8_code(h_unif(-200, 200));
    if (nan_w)
        for (int i = 0; i < 3; i++)
            *(uint8_t *)tb_el(w, h_randint(0, E - 1), h_randint(0, N - 1), h_randint(0, D - 1)) =
                (i & 1) ? 0xFF : 0x7F;
    const double base = 1.0 / (200.0 * sqrt((double)D));
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < N / BLK; r++)
            for (int64_t b = 0; b < D / BLK; b++) {
                if (ws->t.dtype == MOEFUSE_U8)
                    *(uint8_t *)tb_el(ws, e, r, b) =
                        (uint8_t)(127 + (int)floor(log2(base)) + (int)h_randint(0, 1));
                else
                    tb_set(ws, e, r, b, base * h_unif(0.5, 1.5));
            }
    tb_upload(w);
    tb_upload(ws);
}

static double weight_scale(tbuf *ws, int64_t e, int64_t r, int64_t b)
{
    return ws->t.dtype == MOEFUSE_U8 ? or_decode(OR_U8, *(uint8_t *)tb_el(ws, e, r, b))
                                     : tb_get(ws, e, r, b);
}

/* store an activation group scale (f32 value s, or exponent byte eb) at (e, t, g) */
static void put_act_scale(tbuf *sc, int layout, int64_t e, int64_t t, int64_t g, float s, int eb)
{
    const int three = sc->t.rank == 3;
    if (layout == MOEFUSE_SCALE_PACKED_UE8M0) {
        unsigned char *p = three ? tb_el(sc, e, g / 4, t) : tb_el(sc, g / 4, t, 0);
        p[g % 4] = (unsigned char)eb;
        return;
    }
    void *p = h_scale_el(sc, layout, e, t, g);
    if (sc->t.dtype == MOEFUSE_U8) *(uint8_t *)p = (uint8_t)eb;
    else memcpy(p, &s, 4);
}

/* zero every byte of a scales tensor (padding and unused packed bytes included) */
static void zero_logical(tbuf *tb)
{
    for (size_t i = 0; i < tb->total; i++)
        if (tb->logical[i]) tb->full[i] = 0;
}

/*
 * One activation row (x[e, t] masked with e >= 0, else x[t]) of K values: random f32/f16/bf16
 * values with specials as c asks, or f8 codes with scales written to xs (layout's row t).
 */
static void fill_x_row(const cfg *c, tbuf *x, tbuf *xs, int64_t e, int64_t t)
{
    const int64_t K = c->K;
#define XEL(d) (e >= 0 ? tb_el(x, e, t, d) : tb_el(x, t, d, 0))
    if (c->xdt == MOEFUSE_F8_E4M3) {
        for (int64_t d = 0; d < K; d++)
            *(uint8_t *)XEL(d) = or_f8_code(h_unif(-448, 448));
        if (c->nan_x && h_randint(0, 3) == 0) *(uint8_t *)XEL(h_randint(0, K - 1)) = 0x7F;
        for (int64_t g = 0; g < K / BLK; g++) {
            const int eb = 127 - 9 + (int)h_randint(0, 1);
            const float s = c->ue8m0 || c->layout == MOEFUSE_SCALE_PACKED_UE8M0
                                ? (float)ldexp(1.0, eb - 127)
                                : (float)h_unif(1e-3, 3e-3);
            put_act_scale(xs, c->layout, e >= 0 ? e : 0, t, g, s, eb);
        }
        return;
    }
    for (int64_t d = 0; d < K; d++) {
        double v = h_unif(-1, 1);
        if (c->zero_groups && (t % 3 == 1) && (d / BLK) % 2 == 0) v = 0.0; /* all-zero groups */
        const uint32_t bits = or_encode(h_dt_or(c->xdt), v);
        if (c->xdt == MOEFUSE_F32) { float f = (float)v; memcpy(XEL(d), &f, 4); }
        else { uint16_t b = (uint16_t)bits; memcpy(XEL(d), &b, 2); }
    }
    if ((c->nan_x || c->inf_x) && h_randint(0, 3) == 0) {
        const double sp = c->nan_x ? NAN : (h_randint(0, 1) ? INFINITY : -INFINITY);
        const int64_t d = h_randint(0, K - 1);
        if (c->xdt == MOEFUSE_F32) { float f = (float)sp; memcpy(XEL(d), &f, 4); }
        else { uint16_t b = (uint16_t)or_encode(h_dt_or(c->xdt), sp); memcpy(XEL(d), &b, 2); }
    }
#undef XEL
}

/* ------------------------------------------------------------------ oracle */

/* The codes and group scales of activation row (e, t) of x as the library must use them. */
static void oracle_x_row(const cfg *c, tbuf *x, tbuf *xs, int64_t e, int64_t t, uint8_t *q, double *s)
{
    const int64_t K = c->K;
    for (int64_t g = 0; g < K / BLK; g++) {
        if (c->xdt == MOEFUSE_F8_E4M3) {
            for (int64_t d = 0; d < BLK; d++)
                q[g * BLK + d] = *(uint8_t *)(e >= 0 ? tb_el(x, e, t, g * BLK + d) : tb_el(x, t, g * BLK + d, 0));
            int eb;
            s[g] = h_scale_at(xs, c->layout, e >= 0 ? e : 0, t, g, &eb);
            continue;
        }
        double v[BLK];
        for (int64_t d = 0; d < BLK; d++)
            v[d] = e >= 0 ? tb_get(x, e, t, g * BLK + d) : tb_get(x, t, g * BLK + d, 0);
        s[g] = or_quant_group(v, BLK, 1, c->ue8m0 || c->layout == MOEFUSE_SCALE_PACKED_UE8M0,
                              c->eps > 0 ? c->eps : 1e-10f, q + g * BLK, NULL);
    }
}

/* Step 2 of NUMERICS.md in double: sum over blocks of exact block sum * sa * sw, + bias. */
static double oracle_dot(const uint8_t *qa, const double *sa, tbuf *w, tbuf *ws, int64_t e, int64_t r,
                         int64_t D, tbuf *bias)
{
    double acc = 0.0;
    for (int64_t b = 0; b < D / BLK; b++) {
        double p = 0.0;
        for (int64_t d = b * BLK; d < (b + 1) * BLK; d++)
            p += f8val[qa[d]] * f8val[*(uint8_t *)tb_el(w, e, r, d)];
        acc += p * sa[b] * weight_scale(ws, e, r / BLK, b);
    }
    return bias ? acc + tb_get(bias, e, r, 0) : acc;
}

/* Gate of one slot of expert e in double, then h quantized in double: codes hq[I], scales hs. */
static void oracle_gate(const cfg *c, const uint8_t *qa, const double *sa, tbuf *w1, tbuf *w1s, tbuf *b1,
                        int64_t e, uint8_t *hq, double *hs, double *hraw)
{
    const int64_t I = c->I, K = c->K;
    or_act_opt ao = {c->act, c->order, c->limit, 0, c->alpha, c->up_offset};
    double h[BLK];
    for (int64_t g = 0; g < I / BLK; g++) {
        for (int64_t i = 0; i < BLK; i++) {
            const int64_t ch = g * BLK + i;
            const double gv = oracle_dot(qa, sa, w1, w1s, e, or_gate_pos(c->order, I, ch), K, b1);
            const double uv = oracle_dot(qa, sa, w1, w1s, e, or_up_pos(c->order, I, ch), K, b1);
            double lo, hi;
            or_act_elem(gv, uv, 1.0, 1.0, &ao, &h[i], &lo, &hi);
            if (hraw)
                hraw[ch] = h[i];
        }
        hs[g] = or_quant_group(h, BLK, 1, c->ue8m0 || c->layout == MOEFUSE_SCALE_PACKED_UE8M0,
                               c->eps > 0 ? c->eps : 1e-10f, hq + g * BLK, NULL);
    }
}

/*
 * Whether the library's code got for a value the oracle computed as raw (before its scale s)
 * and coded as want is a rounding tie decided the other way: neighbouring codes of one sign,
 * raw / s within TIE_REL of their midpoint.
 */
static int h_tie_flip(uint8_t got, uint8_t want, double raw, double s)
{
    if ((got ^ want) & 0x80 || abs((int)(got & 0x7F) - (int)(want & 0x7F)) != 1 || !(s > 0))
        return 0;
    const double mid = 0.5 * (f8val[got] + f8val[want]);
    return fabs(raw / s - mid) <= TIE_REL * fabs(mid);
}

/* Final of one slot of expert e from codes hq and scales hs: y[K]. */
static void oracle_final(const cfg *c, const uint8_t *hq, const double *hs, tbuf *w2, tbuf *w2s, tbuf *b2,
                         int64_t e, double *y)
{
    for (int64_t r = 0; r < c->K; r++) y[r] = oracle_dot(hq, hs, w2, w2s, e, r, c->I, b2);
}

/* ------------------------------------------------------------ comparisons */

/*
 * Relative 2-norm error of got against ref over the values where ref is a number; where ref
 * is NaN, got must be NaN too, and where ref is a number, got must be one.
 */
static double rel_err_nan(const char *what, const cfg *c, const double *got, const double *ref, size_t n,
                          double floor)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        HCHECK(isnan(ref[i]) == isnan(got[i]), "%s %s: element %zu is %g, the oracle's %g", what, desc(c), i,
               got[i], ref[i]);
        if (isnan(ref[i])) continue;
        const double e = fmax(fabs(got[i] - ref[i]) - floor, 0.0);
        num += e * e;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static int is_cpu(void) { return strcmp(h_backend(), "cpu") == 0; }

/* Backends whose p_b are exact: bit for bit equal to the CPU backend. */
static int exact_backend(void)
{
    const char *be = h_backend(), *path = getenv("MOEFUSE_CUDA_FP8");
    if (strcmp(be, "opencl") == 0) return 1;
    return strcmp(be, "cuda") == 0 && path && strcmp(path, "portable") == 0;
}

/* byte-equal, or both NaN codes */
static void same_codes(const char *what, const cfg *c, tbuf *a, tbuf *b)
{
    for (size_t i = 0; i < a->total; i++) {
        if (!a->logical[i]) continue;
        const uint8_t x = a->full[i], y = b->full[i];
        HCHECK(x == y || (is_nan_code(x) && is_nan_code(y)), "%s %s: byte %zu is 0x%02x, the CPU's 0x%02x", what,
               desc(c), i, x, y);
    }
}

static void same_bytes(const char *what, const cfg *c, tbuf *a, tbuf *b)
{
    for (size_t i = 0; i < a->total; i++)
        if (a->logical[i])
            HCHECK(a->full[i] == b->full[i], "%s %s: byte %zu is 0x%02x, the CPU's 0x%02x", what, desc(c), i,
                   a->full[i], b->full[i]);
}

/* out values equal bit for bit, or both NaN */
static void same_values(const char *what, const cfg *c, tbuf *a, tbuf *b, int64_t n0, int64_t n1, int64_t n2)
{
    for (int64_t i = 0; i < n0; i++)
        for (int64_t j = 0; j < n1; j++)
            for (int64_t l = 0; l < n2; l++) {
                const double x = tb_get(a, i, j, l), y = tb_get(b, i, j, l);
                const size_t sz = a->t.dtype == MOEFUSE_F32 ? 4 : 2;
                HCHECK((isnan(x) && isnan(y)) || memcmp(tb_el(a, i, j, l), tb_el(b, i, j, l), sz) == 0,
                       "%s %s: [%lld,%lld,%lld] is %.9g, the reference's %.9g", what, desc(c), (long long)i, (long long)j,
                       (long long)l, x, y);
            }
}

/*
 * Hopper tolerance of NUMERICS.md for h rows [rows, I] against the CPU's: each scale within
 * 2e-2 (UE8M0: equal, or a factor of 2 apart), at most 5% of the codes different, and h
 * dequantized within 2e-2 in relative 2-norm.
 */
static void near_h(const cfg *c, tbuf *h, tbuf *hs, tbuf *rh, tbuf *rhs, int64_t n0, int64_t n1, int lead3)
{
    const int64_t I = c->I, G = I / BLK;
    const int ue = c->ue8m0 || c->layout == MOEFUSE_SCALE_PACKED_UE8M0;
    int64_t differ = 0, total = 0;
    double num = 0, den = 0;
    for (int64_t a = 0; a < n0; a++)
        for (int64_t b = 0; b < n1; b++) {
            const int64_t e = lead3 ? a : 0, t = lead3 ? b : a * n1 + b;
            for (int64_t g = 0; g < G; g++) {
                int eb;
                const double s = h_scale_at(hs, c->layout, e, t, g, &eb), rs = h_scale_at(rhs, c->layout, e, t, g, &eb);
                const int close = fabs(s - rs) <= 2e-2 * fabs(rs);
                HCHECK(close || (ue && (s == 2 * rs || rs == 2 * s)), "h scale %s: %g, the CPU's %g",
                       desc(c), s, rs);
                for (int64_t i = g * BLK; i < (g + 1) * BLK; i++) {
                    const uint8_t q = *(uint8_t *)tb_el(h, a, b, i), rq = *(uint8_t *)tb_el(rh, a, b, i);
                    total++;
                    if (is_nan_code(q) || is_nan_code(rq)) {
                        HCHECK(is_nan_code(q) && is_nan_code(rq), "h code %s: 0x%02x, the CPU's 0x%02x",
                               desc(c), q, rq);
                        continue;
                    }
                    differ += q != rq;
                    const double v = f8val[q] * s, rv = f8val[rq] * rs;
                    num += (v - rv) * (v - rv);
                    den += rv * rv;
                }
            }
        }
    HCHECK(differ * 100 <= 5 * total, "h %s: %lld of %lld codes differ from the CPU's (over 5%%)",
           desc(c), (long long)differ, (long long)total);
    HCHECK(num <= 4e-4 * den, "h %s: dequantized, %g relative to the CPU's (over 2e-2)", desc(c),
           den > 0 ? sqrt(num / den) : sqrt(num));
}

static double rel_between(tbuf *a, tbuf *b, int64_t n0, int64_t n1, int64_t n2)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n0; i++)
        for (int64_t j = 0; j < n1; j++)
            for (int64_t l = 0; l < n2; l++) {
                const double x = tb_get(a, i, j, l), y = tb_get(b, i, j, l);
                if (isnan(y)) continue;
                num += (x - y) * (x - y);
                den += y * y;
            }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void expect_ok(moefuse_status st, const char *what, moefuse_context *ctx)
{
    HCHECK(st == MOEFUSE_OK, "%s: %s (%s)", what, moefuse_status_name(st), moefuse_last_error(ctx));
}

/* a tensor and, on a backend other than the CPU, its twin on the CPU backend */
typedef struct pair {
    tbuf *d, *c;
} pair;

static pair mk(tbuf *d)
{
    pair p = {d, NULL};
    if (g_ref) p.c = tb_twin(d, g_ref);
    return p;
}

/* -------------------------------------------------------------- routed */

/* The call's options for a case: its activation, its activation scales' layout and eps. */
static moefuse_fp8_moe_options options_of(const cfg *c)
{
    moefuse_fp8_moe_options o = {0};
    o.moe.activation = c->act;
    o.moe.order = c->order;
    o.moe.limit = c->limit;
    o.moe.alpha = c->alpha;
    o.moe.up_offset = c->up_offset;
    o.act.scale_layout = c->layout;
    o.act.ue8m0 = c->ue8m0;
    o.act.eps = c->eps;
    return o;
}

static void run_routed(cfg c)
{
    const int64_t M = c.M, K = c.K, I = c.I, E = c.E, k = c.k, Eg = c.use_map ? c.Eg : E;
    const int64_t S = M * k, GK = K / BLK, GI = I / BLK;
    const int ue = c.ue8m0 || c.layout == MOEFUSE_SCALE_PACKED_UE8M0;
    tbuf *x = tb_new2("x", c.xdt, M, K, 3, 1), *xs = NULL;
    if (c.xdt == MOEFUSE_F8_E4M3) {
        xs = h_new_scales("x_scales", c.layout, c.ue8m0, 0, M, GK, 0);
        xs->is_input = 1;
        zero_logical(xs);
    }
    for (int64_t m = 0; m < M; m++) fill_x_row(&c, x, xs, -1, m);
    tb_upload(x);
    if (xs) tb_upload(xs);
    tbuf *w1 = tb_new3("w1", MOEFUSE_F8_E4M3, E, 2 * I, K, 0, 1);
    tbuf *w1s = tb_new3("w1_scales", c.wsdt, E, 2 * I / BLK, GK, 0, 1);
    fill_weight(w1, w1s, E, 2 * I, K, c.nan_w);
    tbuf *w2 = tb_new3("w2", MOEFUSE_F8_E4M3, E, K, I, 0, 1);
    tbuf *w2s = tb_new3("w2_scales", c.wsdt, E, K / BLK, GI, 0, 1);
    fill_weight(w2, w2s, E, K, I, c.nan_w);
    tbuf *b1 = NULL, *b2 = NULL;
    if (c.bias) {
        const moefuse_dtype bdt = c.bias == 1 ? MOEFUSE_F32 : MOEFUSE_BF16;
        b1 = tb_new2("b1", bdt, E, 2 * I, 0, 1);
        tb_fill_unif(b1, -0.5, 0.5);
        tb_upload(b1);
        b2 = tb_new2("b2", bdt, E, K, 1, 1);
        tb_fill_unif(b2, -0.5, 0.5);
        tb_upload(b2);
    }
    tbuf *ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 0, 1), *wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++) {
            int64_t id = h_randint(0, Eg - 1);
            if (c.empty_expert && !c.use_map && id == E - 1) id = 0; /* expert E-1 gets no slot */
            if (c.invalid) id = h_maybe_invalid_id(id, Eg, m, j);
            tb_set(ids, m, j, 0, (double)id);
            tb_set(wts, m, j, 0, h_unif(0.05, 1));
        }
    tb_upload(ids);
    tb_upload(wts);
    tbuf *map = NULL;
    int32_t *mapv = NULL;
    if (c.use_map)
        map = h_new_expert_map(Eg, E, &mapv);
    /* outputs */
    tbuf *h = tb_new3("h", MOEFUSE_F8_E4M3, M, k, I, 1, 0);
    tbuf *hs = h_new_scales("h_scales", c.layout, c.ue8m0, 0, S, GI, 0);
    tbuf *out = tb_new2("out", c.odt, M, K, 2, 0), *fwd = tb_new2("fwd", c.odt, M, K, 0, 0);
    tbuf *y = c.unreduced ? tb_new3("y", c.odt, M, k, K, 0, 0) : NULL;
    /* twins on the CPU backend, before any call */
    pair px = mk(x), pxs = xs ? mk(xs) : (pair){0}, pw1 = mk(w1), pw1s = mk(w1s), pw2 = mk(w2), pw2s = mk(w2s);
    pair pb1 = b1 ? mk(b1) : (pair){0}, pb2 = b2 ? mk(b2) : (pair){0}, pids = mk(ids), pwts = mk(wts);
    pair pmap = map ? mk(map) : (pair){0}, ph = mk(h), phs = mk(hs), pout = mk(out), pfwd = mk(fwd);
    pair py = y ? mk(y) : (pair){0};
    (void)pfwd;
    moefuse_routing R = {0}, RC = {0};
    R.topk_ids = ids->t;
    R.topk_weights = wts->t;
    if (map) R.expert_map = map->t;
    if (g_ref) {
        RC.topk_ids = pids.c->t;
        RC.topk_weights = pwts.c->t;
        if (map) RC.expert_map = pmap.c->t;
    }
    const moefuse_fp8_moe_options o = options_of(&c);

    /* gate, then the final from the library's own h, then forward */
    expect_ok(CALL(moefuse_moe_gate_fp8(g_ctx, T(x), T(xs), T(w1), T(w1s), T(b1), &R, T(h), T(hs), &o)),
              "moe_gate_fp8", g_ctx);
    expect_ok(CALL(moefuse_moe_final_fp8(g_ctx, T(h), T(hs), T(w2), T(w2s), T(b2), &R, T(out), &o)),
              "moe_final_fp8", g_ctx);
    if (y)
        expect_ok(CALL(moefuse_moe_final_fp8(g_ctx, T(h), T(hs), T(w2), T(w2s), T(b2), &R, T(y), &o)),
                  "moe_final_fp8 un-reduced", g_ctx);
    expect_ok(CALL(moefuse_moe_forward_fp8(g_ctx, T(x), T(xs), T(w1), T(w1s), T(w2), T(w2s), T(b1), T(b2), &R,
                                           T(fwd), &o)),
              "moe_forward_fp8", g_ctx);

    /* the oracle: each slot's h from x, quantized in double; out from it (the chain), and
     * out from the library's own h (the final alone) */
    uint8_t *qa = malloc((size_t)K), *hq = malloc((size_t)(S * I + 1));
    double *sa = malloc(sizeof(double) * (size_t)GK), *hsd = malloc(sizeof(double) * (size_t)(S * GI + 1));
    double *got_h = malloc(sizeof(double) * (size_t)(S * I + 1)), *ref_h = malloc(sizeof(double) * (size_t)(S * I + 1));
    double *yr = malloc(sizeof(double) * (size_t)K), *yl = malloc(sizeof(double) * (size_t)K);
    double *out_chain = calloc((size_t)(M * K + 1), sizeof(double)), *out_lib = calloc((size_t)(M * K + 1), sizeof(double));
    double *got_out = malloc(sizeof(double) * (size_t)(M * K + 1));
    double *y_chain = calloc((size_t)(S * K + 1), sizeof(double)), *y_lib = calloc((size_t)(S * K + 1), sizeof(double));
    double *got_y = malloc(sizeof(double) * (size_t)(S * K + 1));
    double *untied_h = malloc(sizeof(double) * (size_t)(S * I + 1)); /* got_h, ties as the oracle's */
    size_t nh = 0;
    uint8_t lq[4096];
    double ls[64], hraw[4096];
    for (int64_t m = 0; m < M; m++) {
        oracle_x_row(&c, x, xs, -1, m, qa, sa);
        for (int64_t j = 0; j < k; j++) {
            const int64_t s = m * k + j;
            const int64_t e = or_local_expert((int32_t)tb_get(ids, m, j, 0), mapv, Eg, E);
            if (e < 0) { /* invalid: codes 0, scale bytes 0 */
                for (int64_t i = 0; i < I; i++)
                    HCHECK(*(uint8_t *)tb_el(h, m, j, i) == 0, "invalid slot %lld: h code not 0 %s", (long long)s, desc(&c));
                for (int64_t g = 0; g < GI; g++) {
                    int eb;
                    const double v = h_scale_at(hs, c.layout, 0, s, g, &eb);
                    HCHECK(v == 0.0 || eb == 0, "invalid slot %lld: scale not 0 %s", (long long)s, desc(&c));
                    HCHECK(eb <= 0, "invalid slot %lld: scale byte %d %s", (long long)s, eb, desc(&c));
                }
                if (c.layout == MOEFUSE_SCALE_PACKED_UE8M0)
                    for (int64_t g = 0; g < (GI + 3) / 4 * 4; g++) {
                        int eb;
                        h_scale_at(hs, c.layout, 0, s, g, &eb);
                        HCHECK(eb == 0, "invalid slot %lld: packed byte %lld is %d %s", (long long)s, (long long)g, eb,
                               desc(&c));
                    }
                continue;
            }
            oracle_gate(&c, qa, sa, w1, w1s, b1, e, hq + s * I, hsd + s * GI, hraw);
            for (int64_t g = 0; g < GI; g++) {
                int eb;
                ls[g] = h_scale_at(hs, c.layout, 0, s, g, &eb);
            }
            for (int64_t i = 0; i < I; i++) {
                lq[i] = *(uint8_t *)tb_el(h, m, j, i);
                const uint8_t want = hq[s * I + i];
                got_h[nh] = f8val[lq[i]] * ls[i / BLK];
                untied_h[nh] = h_tie_flip(lq[i], want, hraw[i], hsd[s * GI + i / BLK])
                                   ? f8val[want] * ls[i / BLK]
                                   : got_h[nh];
                ref_h[nh++] = f8val[want] * hsd[s * GI + i / BLK];
            }
            oracle_final(&c, hq + s * I, hsd + s * GI, w2, w2s, b2, e, yr);
            oracle_final(&c, lq, ls, w2, w2s, b2, e, yl);
            const double wt = tb_get(wts, m, j, 0);
            for (int64_t r = 0; r < K; r++) {
                y_chain[s * K + r] = yr[r];
                y_lib[s * K + r] = yl[r];
                out_chain[m * K + r] += wt * yr[r];
                out_lib[m * K + r] += wt * yl[r];
            }
        }
    }
    const double herr = rel_err_nan("h (dequantized)", &c, got_h, ref_h, nh, 0.0);
    HCHECK(herr <= FP8_BOUND, "h %s: rel err %.3g > %.3g", desc(&c), herr, FP8_BOUND);
    if (is_cpu()) {
        const double uerr = rel_err_nan("h (dequantized)", &c, untied_h, ref_h, nh, 0.0);
        HCHECK(uerr <= CPU_H_BOUND, "h on the CPU, past rounding ties %s: rel err %.3g > %.3g", desc(&c), uerr,
               CPU_H_BOUND);
    }
    h_check_scale_padding(hs, c.layout, 0, S, S, GI);
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < K; r++) got_out[m * K + r] = tb_get(out, m, r, 0);
    const double floor = h_gemm_floor(c.odt);
    double oerr = rel_err_nan("out", &c, got_out, out_lib, (size_t)(M * K), floor);
    if (is_cpu()) /* the final alone: one f32 fmaf per block, then the output's rounding */
        HCHECK(oerr <= h_gemm_bound(c.odt), "out on the CPU vs the final of its own h %s: %.3g > %.3g", desc(&c),
               oerr, h_gemm_bound(c.odt));
    oerr = rel_err_nan("out", &c, got_out, out_chain, (size_t)(M * K), floor);
    HCHECK(oerr <= FP8_BOUND, "out %s: rel err %.3g > %.3g", desc(&c), oerr, FP8_BOUND);
    if (getenv("MOEFUSE_FP8_REPORT"))
        fprintf(stderr, "fp8 %s %s: h %.3g, out %.3g\n", h_backend(), desc(&c), herr, oerr);
    if (y) {
        for (int64_t i = 0; i < S * K; i++) got_y[i] = tb_get(y, i / (k * K), (i / K) % k, i % K);
        for (int64_t s = 0; s < S; s++)
            if (or_local_expert((int32_t)tb_get(ids, s / k, s % k, 0), mapv, Eg, E) < 0)
                for (int64_t r = 0; r < K; r++)
                    HCHECK(got_y[s * K + r] == 0.0 && !signbit(got_y[s * K + r]), "invalid slot %lld: y not +0 %s",
                           (long long)s, desc(&c));
        double yerr = rel_err_nan("y", &c, got_y, y_lib, (size_t)(S * K), floor);
        if (is_cpu())
            HCHECK(yerr <= h_gemm_bound(c.odt), "y on the CPU vs its own h %s: %.3g", desc(&c), yerr);
        yerr = rel_err_nan("y", &c, got_y, y_chain, (size_t)(S * K), floor);
        HCHECK(yerr <= FP8_BOUND, "y %s: rel err %.3g > %.3g", desc(&c), yerr, FP8_BOUND);
    }
    /* forward is the gate then the final on the same backend, bit for bit */
    same_values("forward vs gate then final", &c, fwd, out, M, K, 1);

    if (g_ref) { /* the CPU golden backend on the same bytes */
        expect_ok(CALL(moefuse_moe_gate_fp8(g_ref, T(px.c), T(pxs.c), T(pw1.c), T(pw1s.c), T(pb1.c), &RC, T(ph.c),
                                            T(phs.c), &o)),
                  "moe_gate_fp8 on the CPU", g_ref);
        expect_ok(CALL(moefuse_moe_final_fp8(g_ref, T(ph.c), T(phs.c), T(pw2.c), T(pw2s.c), T(pb2.c), &RC,
                                             T(pout.c), &o)),
                  "moe_final_fp8 on the CPU", g_ref);
        if (y)
            expect_ok(CALL(moefuse_moe_final_fp8(g_ref, T(ph.c), T(phs.c), T(pw2.c), T(pw2s.c), T(pb2.c), &RC,
                                                 T(py.c), &o)),
                      "moe_final_fp8 un-reduced on the CPU", g_ref);
        if (exact_backend()) {
            same_codes("h", &c, h, ph.c);
            same_bytes("h_scales", &c, hs, phs.c);
            same_values("out", &c, out, pout.c, M, K, 1);
            if (y) same_values("y", &c, y, py.c, M, k, K);
        } else {
            near_h(&c, h, hs, ph.c, phs.c, M, k, 0);
            const double d = rel_between(out, pout.c, M, K, 1);
            HCHECK(d <= FP8_BOUND, "out vs the CPU %s: %.3g", desc(&c), d);
        }
    }
    (void)ue;
    free(qa), free(hq), free(sa), free(hsd), free(got_h), free(untied_h), free(ref_h), free(yr), free(yl);
    free(out_chain), free(out_lib), free(got_out), free(y_chain), free(y_lib), free(got_y), free(mapv);
    tb_free_all();
}

static cfg base_cfg(void)
{
    cfg c = {0};
    c.M = 37, c.K = 256, c.I = 128, c.E = 4, c.k = 2, c.Eg = 6;
    c.xdt = MOEFUSE_BF16, c.wsdt = MOEFUSE_F32, c.odt = MOEFUSE_F32;
    c.layout = MOEFUSE_SCALE_ROW_MAJOR;
    return c;
}

/* M = 0, 1, 3, 37, 300 and k = 1..8, K and I over {128, 256, 384, 640} */
START_TEST(test_shapes)
{
    static const int64_t Ms[] = {0, 1, 3, 37, 300}, dims[] = {128, 256, 384, 640};
    for (int i = 0; i < 5; i++) {
        cfg c = base_cfg();
        c.M = Ms[i];
        c.k = i == 4 ? 2 : 1 + h_randint(0, 7);
        c.K = dims[h_randint(0, 3)];
        c.I = i == 4 ? 128 : dims[h_randint(0, 3)];
        c.unreduced = i % 2;
        c.invalid = i >= 2;
        run_routed(c);
    }
    for (int64_t k = 1; k <= 8; k++) {
        cfg c = base_cfg();
        c.M = 5, c.k = k, c.E = 3, c.K = 128, c.I = 128, c.invalid = 1, c.unreduced = 1;
        run_routed(c);
    }
    cfg c = base_cfg();
    c.K = 640, c.I = 640, c.M = 9, c.k = 3;
    run_routed(c);
}
END_TEST

/* every activation, order, limit, bias dtype, x dtype, layout and weight scale form */
START_TEST(test_options)
{
    static const moefuse_dtype xdts[] = {MOEFUSE_F32, MOEFUSE_BF16, MOEFUSE_F16, MOEFUSE_F8_E4M3};
    static const int layouts[][2] = {{MOEFUSE_SCALE_ROW_MAJOR, 0}, {MOEFUSE_SCALE_ROW_MAJOR, 1},
                                     {MOEFUSE_SCALE_COLUMN_MAJOR, 0}, {MOEFUSE_SCALE_COLUMN_MAJOR, 1},
                                     {MOEFUSE_SCALE_PACKED_UE8M0, 0}};
    for (int i = 0; i < 12; i++) {
        cfg c = base_cfg();
        c.act = i % 4;
        c.alpha = i == 7 ? 0.8f : 0.0f;
        c.up_offset = i % 5 == 2 ? 1.0f : (i == 9 ? -0.5f : 0.0f);
        c.order = (i / 4) % 3;
        c.limit = i % 4 == 3 ? 0.75f : 0.0f;
        c.bias = i % 3;
        c.xdt = xdts[i % 4];
        c.layout = layouts[i % 5][0];
        c.ue8m0 = layouts[i % 5][1];
        c.wsdt = i % 2 ? MOEFUSE_U8 : MOEFUSE_F32;
        c.odt = i % 3 == 0 ? MOEFUSE_F32 : (i % 3 == 1 ? MOEFUSE_BF16 : MOEFUSE_F16);
        c.use_map = i % 2, c.invalid = 1, c.unreduced = i % 2;
        c.eps = i == 5 ? 1e-4f : 0.0f;
        c.zero_groups = i % 4 == 1;
        c.M = 13 + i, c.k = 1 + i % 4, c.E = 3 + i % 3, c.Eg = c.E + 2;
        c.empty_expert = !c.use_map;
        run_routed(c);
    }
}
END_TEST

/* NaN codes in the weights and in x, NaN and Inf in a bf16 (and f32) x, all-zero groups */
START_TEST(test_specials)
{
    for (int i = 0; i < 5; i++) {
        cfg c = base_cfg();
        c.nan_w = i == 0 || i == 3;
        c.nan_x = i == 1 || i == 2;
        c.inf_x = i == 4;
        c.zero_groups = 1;
        c.xdt = i == 2 ? MOEFUSE_F8_E4M3 : (i == 4 ? MOEFUSE_F32 : MOEFUSE_BF16);
        c.layout = i == 3 ? MOEFUSE_SCALE_PACKED_UE8M0 : MOEFUSE_SCALE_ROW_MAJOR;
        c.unreduced = 1, c.invalid = 1;
        run_routed(c);
    }
}
END_TEST

/*
 * gpt-oss's activation (silu_alpha 1.702, up offset 1, limit 7, interleaved rows: one weight
 * scale block of 128 rows holds the gate and up rows of 64 h columns) with biases; also a
 * limit of 0.25, where these gate values (|a| below about 1.5) meet the clamp, the other
 * orders and another alpha.
 */
START_TEST(test_gpt_oss)
{
    for (int i = 0; i < 6; i++) {
        cfg c = base_cfg();
        c.act = MOEFUSE_ACT_SILU_ALPHA;
        c.alpha = i == 1 ? 1.702f : i == 4 ? 2.0f : 0.0f;
        c.up_offset = i == 5 ? 0.0f : 1.0f;
        c.limit = i % 2 ? 0.25f : 7.0f;
        c.order = i < 3 ? MOEFUSE_GATE_INTERLEAVED : i - 3;
        c.bias = 1 + i % 2;
        c.K = i % 2 ? 384 : 256, c.I = i == 2 ? 384 : 256;
        c.xdt = i == 3 ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16;
        c.wsdt = i % 2 ? MOEFUSE_U8 : MOEFUSE_F32;
        c.odt = i % 3 == 1 ? MOEFUSE_BF16 : MOEFUSE_F32;
        c.M = 9 + i, c.k = 4, c.E = 6, c.invalid = i % 2, c.unreduced = i % 2 == 0;
        run_routed(c);
    }
}
END_TEST

/* ------------------------------------------------------------------ masked */

static void run_masked(cfg c, int64_t Tmax, const int32_t *counts)
{
    const int64_t K = c.K, I = c.I, E = c.E, GK = K / BLK, GI = I / BLK;
    tbuf *x = tb_new3("x", c.xdt, E, Tmax, K, 1, 1), *xs = NULL;
    if (c.xdt == MOEFUSE_F8_E4M3) {
        xs = h_new_scales("x_scales", c.layout, c.ue8m0, E, Tmax, GK, 0);
        xs->is_input = 1;
        zero_logical(xs);
    }
    for (int64_t e = 0; e < E; e++)
        for (int64_t t = 0; t < Tmax; t++) fill_x_row(&c, x, xs, e, t);
    tb_upload(x);
    if (xs) tb_upload(xs);
    tbuf *cn = tb_new1("counts", MOEFUSE_I32, E, 1);
    for (int64_t e = 0; e < E; e++) tb_set(cn, e, 0, 0, counts[e]);
    tb_upload(cn);
    tbuf *w1 = tb_new3("w1", MOEFUSE_F8_E4M3, E, 2 * I, K, 0, 1), *w1s = tb_new3("w1_scales", c.wsdt, E, 2 * I / BLK, GK, 0, 1);
    fill_weight(w1, w1s, E, 2 * I, K, c.nan_w);
    tbuf *w2 = tb_new3("w2", MOEFUSE_F8_E4M3, E, K, I, 0, 1), *w2s = tb_new3("w2_scales", c.wsdt, E, K / BLK, GI, 0, 1);
    fill_weight(w2, w2s, E, K, I, c.nan_w);
    tbuf *b1 = NULL, *b2 = NULL;
    if (c.bias) {
        b1 = tb_new2("b1", MOEFUSE_F32, E, 2 * I, 0, 1);
        tb_fill_unif(b1, -0.5, 0.5);
        tb_upload(b1);
        b2 = tb_new2("b2", MOEFUSE_BF16, E, K, 0, 1);
        tb_fill_unif(b2, -0.5, 0.5);
        tb_upload(b2);
    }
    tbuf *out = tb_new3("out", c.odt, E, Tmax, K, 2, 0);
    pair px = mk(x), pxs = xs ? mk(xs) : (pair){0}, pcn = mk(cn), pw1 = mk(w1), pw1s = mk(w1s), pw2 = mk(w2);
    pair pw2s = mk(w2s), pb1 = b1 ? mk(b1) : (pair){0}, pb2 = b2 ? mk(b2) : (pair){0}, pout = mk(out);
    const moefuse_fp8_moe_options o = options_of(&c); /* eps: 0 in every masked case */
    expect_ok(CALL(moefuse_moe_masked_fp8(g_ctx, T(x), T(xs), T(cn), T(w1), T(w1s), T(w2), T(w2s), T(b1), T(b2),
                                          T(out), &o)),
              "moe_masked_fp8", g_ctx);
    /* rows n[e] <= t < Tmax keep their bytes; rows t < n[e] against the oracle */
    uint8_t *qa = malloc((size_t)K), hq[4096];
    double *sa = malloc(sizeof(double) * (size_t)GK), hsd[64], *yr = malloc(sizeof(double) * (size_t)K);
    double *got = malloc(sizeof(double) * (size_t)(E * Tmax * K + 1)), *ref = malloc(sizeof(double) * (size_t)(E * Tmax * K + 1));
    size_t n = 0;
    const size_t osz = c.odt == MOEFUSE_F32 ? 4 : 2;
    for (int64_t e = 0; e < E; e++) {
        const int64_t ne = counts[e] < 0 ? 0 : (counts[e] > Tmax ? Tmax : counts[e]);
        for (int64_t t = ne; t < Tmax; t++) {
            const size_t at = (size_t)((unsigned char *)tb_el(out, e, t, 0) - out->full);
            HCHECK(memcmp(out->full + at, out->shadow + at, (size_t)K * osz) == 0,
                   "masked out row (e=%lld, t=%lld) past the count %lld was written %s", (long long)e, (long long)t,
                   (long long)ne, desc(&c));
        }
        for (int64_t t = 0; t < ne; t++) {
            oracle_x_row(&c, x, xs, e, t, qa, sa);
            oracle_gate(&c, qa, sa, w1, w1s, b1, e, hq, hsd, NULL);
            oracle_final(&c, hq, hsd, w2, w2s, b2, e, yr);
            for (int64_t r = 0; r < K; r++) {
                got[n] = tb_get(out, e, t, r);
                ref[n++] = yr[r];
            }
        }
    }
    const double err = rel_err_nan("masked out", &c, got, ref, n, h_gemm_floor(c.odt));
    HCHECK(err <= FP8_BOUND, "masked out %s: rel err %.3g > %.3g", desc(&c), err, FP8_BOUND);
    if (getenv("MOEFUSE_FP8_REPORT")) fprintf(stderr, "fp8 masked %s %s: out %.3g\n", h_backend(), desc(&c), err);
    if (g_ref) {
        expect_ok(CALL(moefuse_moe_masked_fp8(g_ref, T(px.c), T(pxs.c), T(pcn.c), T(pw1.c), T(pw1s.c), T(pw2.c),
                                              T(pw2s.c), T(pb1.c), T(pb2.c), T(pout.c), &o)),
                  "moe_masked_fp8 on the CPU", g_ref);
        if (exact_backend()) {
            same_values("masked out", &c, out, pout.c, E, Tmax, K);
        } else {
            const double d = rel_between(out, pout.c, E, Tmax, K);
            HCHECK(d <= FP8_BOUND, "masked out vs the CPU %s: %.3g", desc(&c), d);
        }
    }
    free(qa), free(sa), free(yr), free(got), free(ref);
    tb_free_all();
}

/* counts negative, 0, over Tmax, partial and full; every x dtype and layout */
START_TEST(test_masked)
{
    static const moefuse_dtype xdts[] = {MOEFUSE_BF16, MOEFUSE_F8_E4M3, MOEFUSE_F32, MOEFUSE_F16};
    for (int i = 0; i < 4; i++) {
        cfg c = base_cfg();
        c.E = 5, c.K = i == 2 ? 384 : 256, c.I = i == 3 ? 256 : 128;
        c.xdt = xdts[i];
        c.layout = i % 3;
        c.ue8m0 = i == 1;
        c.wsdt = i % 2 ? MOEFUSE_U8 : MOEFUSE_F32;
        c.odt = i % 2 ? MOEFUSE_BF16 : MOEFUSE_F32;
        c.act = i % 3, c.order = i % 2, c.limit = i == 2 ? 1.5f : 0.0f, c.bias = i % 2;
        if (i == 3) /* gpt-oss's activation in the masked layout */
            c.act = MOEFUSE_ACT_SILU_ALPHA, c.order = MOEFUSE_GATE_INTERLEAVED, c.limit = 7.0f,
            c.up_offset = 1.0f;
        c.nan_w = i == 3;
        const int64_t Tmax = 9 + i;
        const int32_t counts[5] = {-4, 0, (int32_t)Tmax + 7, (int32_t)h_randint(1, Tmax - 1), (int32_t)Tmax};
        run_masked(c, Tmax, counts);
    }
}
END_TEST

/*
 * Decode shapes (the CUDA backend's decode kernel, which MOEFUSE_CUDA_FP8=decode forces):
 * M = 1, 2, 7, 31 and 64 in every activation-scale layout, bf16 and FP8 x, invalid ids and
 * an expert_map; slots that route themselves (up to 32) and slots the route kernel lists,
 * more than one tile of an expert (over 32 slots), depths of 5 blocks (a ragged split), and
 * masked experts of several tiles.
 */
START_TEST(test_decode)
{
    static const int64_t Ms[] = {1, 2, 7, 31, 64};
    static const int layouts[][2] = {{MOEFUSE_SCALE_ROW_MAJOR, 0}, {MOEFUSE_SCALE_ROW_MAJOR, 1},
                                     {MOEFUSE_SCALE_COLUMN_MAJOR, 0}, {MOEFUSE_SCALE_COLUMN_MAJOR, 1},
                                     {MOEFUSE_SCALE_PACKED_UE8M0, 0}};
    for (int i = 0; i < 10; i++) {
        cfg c = base_cfg();
        c.M = Ms[i % 5];
        c.k = i < 5 ? 8 : 2;
        c.E = i == 9 ? 3 : 16, c.Eg = c.E + 4;
        c.K = i % 2 ? 640 : 256, c.I = i % 3 ? 256 : 128;
        c.xdt = i % 2 ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16;
        c.layout = layouts[i % 5][0];
        c.ue8m0 = layouts[i % 5][1];
        c.wsdt = i % 3 == 1 ? MOEFUSE_U8 : MOEFUSE_F32;
        c.odt = i % 2 ? MOEFUSE_BF16 : MOEFUSE_F32;
        c.act = i % 3, c.bias = i % 3, c.limit = i == 4 ? 0.75f : 0.0f;
        if (i % 4 == 2) /* gpt-oss's activation on the decode shapes */
            c.act = MOEFUSE_ACT_SILU_ALPHA, c.order = MOEFUSE_GATE_INTERLEAVED, c.limit = 7.0f,
            c.up_offset = 1.0f, c.bias = 2;
        c.use_map = i % 4 == 1, c.invalid = 1, c.unreduced = i % 2 == 0;
        run_routed(c);
    }
    for (int i = 0; i < 2; i++) {
        cfg c = base_cfg();
        c.E = 3, c.K = 384, c.I = 128;
        c.xdt = i ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16;
        c.layout = i ? MOEFUSE_SCALE_PACKED_UE8M0 : MOEFUSE_SCALE_COLUMN_MAJOR;
        c.bias = 1;
        const int64_t Tmax = 70;
        const int32_t counts[3] = {70, 33, (int32_t)h_randint(1, 31)};
        run_masked(c, Tmax, counts);
    }
}
END_TEST

/* ---------------------------------------------------------------- driver */

/*
 * Whether the backend under test has FP8 MoE: a one-slot gate on zeros. MOEFUSE_ERR_UNSUPPORTED
 * makes the program report SKIP; any other failure runs the suite, which then reports it.
 */
static int fp8_probe(void)
{
    moefuse_context *ctx = NULL;
    if (moefuse_context_create(&ctx, h_backend()) != MOEFUSE_OK) return 1; /* h_run reports it */
    void *buf = NULL;
    int ok = 1;
    const size_t need = 512 + 2 * BLK * BLK + 64 + 64 + 256 + 64;
    if (moefuse_buffer_alloc(ctx, need, &buf) == MOEFUSE_OK) {
        unsigned char *zeros = calloc(1, need);
        moefuse_buffer_write(ctx, buf, 0, zeros, need);
        free(zeros);
        const int64_t xsh[2] = {1, BLK}, ws[3] = {1, 2 * BLK, BLK}, wss[3] = {1, 2, 1}, ids[2] = {1, 1},
                      hsh[3] = {1, 1, BLK}, hss[2] = {1, 1};
        moefuse_tensor x = moefuse_tensor_dense(buf, MOEFUSE_F32, 2, xsh);
        moefuse_tensor w1 = moefuse_tensor_dense(buf, MOEFUSE_F8_E4M3, 3, ws);
        w1.offset = 512;
        moefuse_tensor w1s = moefuse_tensor_dense(buf, MOEFUSE_F32, 3, wss);
        w1s.offset = 512 + 2 * BLK * BLK;
        moefuse_tensor id = moefuse_tensor_dense(buf, MOEFUSE_I32, 2, ids);
        id.offset = w1s.offset + 64;
        moefuse_tensor h = moefuse_tensor_dense(buf, MOEFUSE_F8_E4M3, 3, hsh);
        h.offset = id.offset + 64;
        moefuse_tensor hs = moefuse_tensor_dense(buf, MOEFUSE_F32, 2, hss);
        hs.offset = h.offset + 256;
        moefuse_routing r = {0};
        r.topk_ids = id;
        const moefuse_status st = moefuse_moe_gate_fp8(ctx, &x, NULL, &w1, &w1s, NULL, &r, &h, &hs, NULL);
        if (st == MOEFUSE_ERR_UNSUPPORTED) {
            printf("SKIP: backend %s has no FP8 MoE: %s\n", h_backend(), moefuse_last_error(ctx));
            ok = 0;
        }
        moefuse_buffer_free(ctx, buf);
    }
    moefuse_context_destroy(ctx);
    return ok;
}

/* The probe runs in a child process: an OpenMP team started before Check forks its tests
 * would not survive the fork. */
static int fp8_supported(void)
{
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) _exit(fp8_probe() ? 0 : 3);
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) return 1;
    return !(WIFEXITED(status) && WEXITSTATUS(status) == 3);
}

static void setup(void)
{
    init_f8();
    if (is_cpu()) h_setup();
    else h_setup_cross();
}

int main(void)
{
    if (!fp8_supported()) return 77;
    Suite *s = suite_create("moe_fp8");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, h_teardown);
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_shapes);
    tcase_add_test(tc, test_options);
    tcase_add_test(tc, test_specials);
    tcase_add_test(tc, test_gpt_oss);
    tcase_add_test(tc, test_masked);
    tcase_add_test(tc, test_decode);
    suite_add_tcase(s, tc);
    return h_run(s);
}
