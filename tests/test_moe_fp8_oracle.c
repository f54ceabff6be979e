/* test_moe_fp8: a case's operands, the float64 oracle, and the comparisons with it and the CPU. */
#include "test_moe_fp8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

double f8val[256];

void init_f8(void)
{
    for (int c = 0; c < 256; c++) f8val[c] = or_decode(OR_F8, (uint32_t)c);
}

static int is_nan_code(uint8_t c) { return (c & 0x7F) == 0x7F; }

const char *desc(const cfg *c)
{
    return h_fmt("[M=%lld K=%lld I=%lld E=%lld k=%lld xdt=%d layout=%d ue8m0=%d wsdt=%d odt=%d "
                 "act=%d alpha=%g beta=%g ord=%d lim=%g bias=%d map=%d inv=%d nanw=%d nanx=%d infx=%d]",
                 (long long)c->M, (long long)c->K, (long long)c->I, (long long)c->E, (long long)c->k,
                 c->xdt, c->layout, c->ue8m0, c->wsdt, c->odt, c->act, c->alpha, c->up_offset,
                 c->order, c->limit, c->bias, c->use_map, c->invalid, c->nan_w, c->nan_x, c->inf_x);
}

/* ------------------------------------------------------------- operands */

/* w [E, N, D] codes of values in about [-200, 200]; scales [E, N/128, D/128] of ~1/(200 sqrt D) */
void fill_weight(tbuf *w, tbuf *ws, int64_t E, int64_t N, int64_t D, int nan_w)
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
void zero_logical(tbuf *tb)
{
    for (size_t i = 0; i < tb->total; i++)
        if (tb->logical[i]) tb->full[i] = 0;
}

/*
 * One activation row (x[e, t] masked with e >= 0, else x[t]) of K values: random f32/f16/bf16
 * values with specials as c asks, or f8 codes with scales written to xs (layout's row t).
 */
void fill_x_row(const cfg *c, tbuf *x, tbuf *xs, int64_t e, int64_t t)
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
void oracle_x_row(const cfg *c, tbuf *x, tbuf *xs, int64_t e, int64_t t, uint8_t *q, double *s)
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

/*
 * Step 2 of NUMERICS.md in double: sum over blocks of exact block sum * sa * sw, + bias. With
 * magnitudes, the same sum of |product| times |sa| |sw| (no bias): what a Hopper path's block
 * sums' error is measured against.
 */
static double oracle_sum(const uint8_t *qa, const double *sa, tbuf *w, tbuf *ws, int64_t e, int64_t r,
                         int64_t D, tbuf *bias, int magnitudes)
{
    double acc = 0.0;
    for (int64_t b = 0; b < D / BLK; b++) {
        double p = 0.0;
        for (int64_t d = b * BLK; d < (b + 1) * BLK; d++) {
            const double v = f8val[qa[d]] * f8val[*(uint8_t *)tb_el(w, e, r, d)];
            p += magnitudes ? fabs(v) : v;
        }
        const double sw = weight_scale(ws, e, r / BLK, b);
        acc += magnitudes ? p * fabs(sa[b]) * fabs(sw) : p * sa[b] * sw;
    }
    return bias && !magnitudes ? acc + tb_get(bias, e, r, 0) : acc;
}

static double oracle_dot(const uint8_t *qa, const double *sa, tbuf *w, tbuf *ws, int64_t e, int64_t r,
                         int64_t D, tbuf *bias)
{
    return oracle_sum(qa, sa, w, ws, e, r, D, bias, 0);
}

/*
 * How far h = act(g) (u + beta) moves when g and u move by HOPPER_SUM_REL of their products'
 * magnitudes: the largest change at the four corners, with a quarter more for the curvature
 * inside (the box is a few ulps of the products wide).
 */
static double oracle_h_slack(const cfg *c, const or_act_opt *ao, const uint8_t *qa, const double *sa,
                             tbuf *w1, tbuf *w1s, int64_t e, int64_t ch, double gv, double uv, double h)
{
    const double dg = HOPPER_SUM_REL * oracle_sum(qa, sa, w1, w1s, e, or_gate_pos(c->order, c->I, ch), c->K, NULL, 1);
    const double du = HOPPER_SUM_REL * oracle_sum(qa, sa, w1, w1s, e, or_up_pos(c->order, c->I, ch), c->K, NULL, 1);
    double worst = 0.0;
    for (int sg = -1; sg <= 1; sg += 2)
        for (int su = -1; su <= 1; su += 2) {
            double p, lo, hi;
            or_act_elem(gv + sg * dg, uv + su * du, 1.0, 1.0, ao, &p, &lo, &hi);
            worst = fmax(worst, fabs(p - h));
        }
    return 1.25 * worst;
}

/* Gate of one slot of expert e in double, then h quantized in double: codes hq[I], scales hs. */
void oracle_gate(const cfg *c, const uint8_t *qa, const double *sa, tbuf *w1, tbuf *w1s, tbuf *b1,
                 int64_t e, uint8_t *hq, double *hs, double *hraw, double *hslack)
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
            if (hslack)
                hslack[ch] = oracle_h_slack(c, &ao, qa, sa, w1, w1s, e, ch, gv, uv, h[i]);
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
int h_tie_flip(uint8_t got, uint8_t want, double raw, double s)
{
    if ((got ^ want) & 0x80 || abs((int)(got & 0x7F) - (int)(want & 0x7F)) != 1 || !(s > 0))
        return 0;
    const double mid = 0.5 * (f8val[got] + f8val[want]);
    return fabs(raw / s - mid) <= TIE_REL * fabs(mid);
}

/* Final of one slot of expert e from codes hq and scales hs: y[K]. */
void oracle_final(const cfg *c, const uint8_t *hq, const double *hs, tbuf *w2, tbuf *w2s, tbuf *b2,
                  int64_t e, double *y)
{
    for (int64_t r = 0; r < c->K; r++) y[r] = oracle_dot(hq, hs, w2, w2s, e, r, c->I, b2);
}

/* ------------------------------------------------------------ comparisons */

/*
 * Relative 2-norm error of got against ref over the values where ref is a number; where ref
 * is NaN, got must be NaN too, and where ref is a number, got must be one.
 */
double rel_err_nan(const char *what, const cfg *c, const double *got, const double *ref, size_t n,
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

double h_code_step(double got, double ref, double s_got, double s_ref)
{
    const double sc = fmax(s_got, s_ref);
    if (!(sc > 0))
        return 0.0; /* no scale to step on: only the block sums' error (the caller's slack) */
    const double q = fmax(fabs(got), fabs(ref)) / sc;
    int e = 0;
    frexp(q, &e); /* q in [2^(e-1), 2^e): e4m3 steps there are 2^(e-4), subnormals' 2^-9 */
    const double step = q < 0x1p-6 ? 0x1p-9 : ldexp(1.0, e - 4);
    return step * sc * 1.001;
}

int is_cpu(void) { return strcmp(h_backend(), "cpu") == 0; }

/* Backends whose p_b are exact: bit for bit equal to the CPU backend. */
int exact_backend(void)
{
    const char *be = h_backend(), *path = getenv("MOEFUSE_CUDA_FP8");
    if (strcmp(be, "opencl") == 0) return 1;
    return strcmp(be, "cuda") == 0 && path && strcmp(path, "portable") == 0;
}

/* byte-equal, or both NaN codes */
void same_codes(const char *what, const cfg *c, tbuf *a, tbuf *b)
{
    for (size_t i = 0; i < a->total; i++) {
        if (!a->logical[i]) continue;
        const uint8_t x = a->full[i], y = b->full[i];
        HCHECK(x == y || (is_nan_code(x) && is_nan_code(y)), "%s %s: byte %zu is 0x%02x, the CPU's 0x%02x", what,
               desc(c), i, x, y);
    }
}

void same_bytes(const char *what, const cfg *c, tbuf *a, tbuf *b)
{
    for (size_t i = 0; i < a->total; i++)
        if (a->logical[i])
            HCHECK(a->full[i] == b->full[i], "%s %s: byte %zu is 0x%02x, the CPU's 0x%02x", what, desc(c), i,
                   a->full[i], b->full[i]);
}

/* out values equal bit for bit, or both NaN */
void same_values(const char *what, const cfg *c, tbuf *a, tbuf *b, int64_t n0, int64_t n1, int64_t n2)
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
 * 2e-2 (UE8M0: equal, or a factor of 2 apart), at most 5% of the codes different, NaN codes
 * where the CPU's are. The values are held element by element against the oracle's, whose
 * block sums' magnitudes give the bound (run_routed's bound_h).
 */
void near_h(const cfg *c, tbuf *h, tbuf *hs, tbuf *rh, tbuf *rhs, int64_t n0, int64_t n1, int lead3)
{
    const int64_t I = c->I, G = I / BLK;
    const int ue = c->ue8m0 || c->layout == MOEFUSE_SCALE_PACKED_UE8M0;
    int64_t differ = 0, total = 0;
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
                }
            }
        }
    HCHECK(differ * 100 <= 5 * total, "h %s: %lld of %lld codes differ from the CPU's (over 5%%)",
           desc(c), (long long)differ, (long long)total);
}

double rel_between(tbuf *a, tbuf *b, int64_t n0, int64_t n1, int64_t n2)
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

void expect_ok(moefuse_status st, const char *what, moefuse_context *ctx)
{
    HCHECK(st == MOEFUSE_OK, "%s: %s (%s)", what, moefuse_status_name(st), moefuse_last_error(ctx));
}
pair mk(tbuf *d)
{
    pair p = {d, NULL};
    if (g_ref) p.c = tb_twin(d, g_ref);
    return p;
}
