/* Independent float64 oracle; see oracle.h for the comparison rules. */
#include "oracle.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* format parameters: precision p (with implicit bit), emin of normals, max finite */
static void fmt(int dt, int *p, int *emin, double *maxv)
{
    switch (dt) {
    case OR_F16: *p = 11; *emin = -14; *maxv = 65504.0; break;
    case OR_BF16: *p = 8; *emin = -126; *maxv = ldexp(2.0 - ldexp(1.0, -7), 127); break;
    case OR_F8: *p = 4; *emin = -6; *maxv = 448.0; break;
    default: *p = 24; *emin = -126; *maxv = (double)FLT_MAX; break;
    }
}

double or_round(int dt, double x)
{
    if (isnan(x)) return x;
    if (dt == OR_F8 && isinf(x)) return x > 0 ? 448.0 : -448.0;
    if (isinf(x) || x == 0.0) return x;
    int p, emin;
    double maxv;
    fmt(dt, &p, &emin, &maxv);
    int e;
    frexp(x, &e);
    int lead = e - 1;
    if (lead < emin) lead = emin;
    double q = ldexp(1.0, lead - (p - 1));
    double r = rint(x / q) * q; /* exact scaling; rint is round-half-even */
    if (r == 0.0) r = copysign(0.0, x);
    if (fabs(r) > maxv) {
        if (dt == OR_F8) return x > 0 ? 448.0 : -448.0;
        return x > 0 ? INFINITY : -INFINITY;
    }
    return r;
}

float or_f32(double x) { return (float)or_round(OR_F32, x); }

static uint32_t enc_generic(double r, int ebits, int mbits, int bias, int ieee)
{
    uint32_t sign = signbit(r) ? 1u : 0u;
    uint32_t out;
    if (isnan(r)) {
        if (ieee) out = ((1u << ebits) - 1) << mbits | (1u << (mbits - 1));
        else out = ((1u << ebits) - 1) << mbits | ((1u << mbits) - 1);
    } else if (isinf(r)) {
        out = ((1u << ebits) - 1) << mbits;
    } else if (r == 0.0) {
        out = 0;
    } else {
        double a = fabs(r);
        int e;
        frexp(a, &e);
        int lead = e - 1;
        int emin = 1 - bias;
        if (lead < emin) {
            out = (uint32_t)ldexp(a, -(emin - mbits)); /* subnormal */
        } else {
            uint32_t m = (uint32_t)(ldexp(a, -lead) * (double)(1u << mbits)) - (1u << mbits);
            out = ((uint32_t)(lead + bias) << mbits) | m;
        }
    }
    return out | (sign << (ebits + mbits));
}

static double dec_generic(uint32_t b, int ebits, int mbits, int bias, int ieee)
{
    uint32_t sign = (b >> (ebits + mbits)) & 1u;
    uint32_t ex = (b >> mbits) & ((1u << ebits) - 1);
    uint32_t m = b & ((1u << mbits) - 1);
    double v;
    if (ieee && ex == (1u << ebits) - 1) v = m ? NAN : INFINITY;
    else if (!ieee && ex == (1u << ebits) - 1 && m == (1u << mbits) - 1) v = NAN;
    else if (ex == 0) v = ldexp((double)m, 1 - bias - mbits);
    else v = ldexp(1.0 + (double)m / (double)(1u << mbits), (int)ex - bias);
    return sign ? -v : v;
}

uint32_t or_encode(int dt, double x)
{
    double r = or_round(dt, x);
    switch (dt) {
    case OR_F32: return enc_generic(r, 8, 23, 127, 1);
    case OR_F16: return enc_generic(r, 5, 10, 15, 1);
    case OR_BF16: return enc_generic(r, 8, 7, 127, 1);
    case OR_F8: return enc_generic(r, 4, 3, 7, 0);
    default: return 0;
    }
}

double or_decode(int dt, uint32_t b)
{
    switch (dt) {
    case OR_F32: return dec_generic(b, 8, 23, 127, 1);
    case OR_F16: return dec_generic(b & 0xFFFF, 5, 10, 15, 1);
    case OR_BF16: return dec_generic(b & 0xFFFF, 8, 7, 127, 1);
    case OR_F8: return dec_generic(b & 0xFF, 4, 3, 7, 0);
    case OR_I8: return (double)(int8_t)(uint8_t)b;
    case OR_U8: return (b & 0xFF) == 255 ? NAN : ldexp(1.0, (int)(b & 0xFF) - 127);
    case OR_I32: return (double)(int32_t)b;
    default: return NAN;
    }
}

uint8_t or_f8_code(double v)
{
    if (isnan(v)) return signbit(v) ? 0xFF : 0x7F;
    return (uint8_t)or_encode(OR_F8, v);
}

int8_t or_i8_code(double v)
{
    if (isnan(v)) return 0;
    if (v >= 127.0) return 127;
    if (v <= -127.0) return -127;
    return (int8_t)rint(v);
}

int or_f8_ord(uint8_t c)
{
    int mag = c & 0x7F;
    if (mag == 0x7F) return 1000;
    return (c & 0x80) ? -mag : mag;
}

double or_ulp32(double x)
{
    x = fabs(x);
    if (x < ldexp(1.0, -126)) return ldexp(1.0, -149);
    int e;
    frexp(x, &e);
    return ldexp(1.0, e - 1 - 23);
}

double or_next32(double x, int dir) { return (double)nextafterf((float)x, dir > 0 ? INFINITY : -INFINITY); }

int or_ue8m0(float s)
{
    uint32_t b;
    memcpy(&b, &s, 4);
    int e = (int)((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0);
    if (e < 1) e = 1;
    if (e > 254) e = 254;
    return e;
}

/* ------------------------------------------------------------ intervals */

typedef struct { double lo, hi; } iv;
/* one correctly rounded f32 operation: |err| <= 2^-24 |x| (normal range);
 * the library's exp, erf, tanh (docs/NUMERICS.md): within 0.882 ulp of the exact value
 * (checked for every f32), so |err| <= 2^-23 |x| holds.
 * TINY covers the absolute error of subnormal results. */
static const double REL_OP = 0x1p-24 * (1.0 + 0x1p-8);
static const double REL_FN = 0x1p-23 * (1.0 + 0x1p-8);
static const double TINY = 0x1p-148;

static iv widen_by(iv a, double rel)
{
    iv r;
    r.lo = a.lo - fabs(a.lo) * rel - TINY;
    r.hi = a.hi + fabs(a.hi) * rel + TINY;
    return r;
}
static iv widen(iv a) { return widen_by(a, REL_OP); }
static iv pt(double x) { iv r = {x, x}; return r; }
static iv ivmul(iv a, iv b)
{
    double c[4] = {a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi};
    iv r = {c[0], c[0]};
    for (int i = 1; i < 4; i++) {
        if (c[i] < r.lo) r.lo = c[i];
        if (c[i] > r.hi) r.hi = c[i];
    }
    return widen(r);
}
static iv ivdiv(iv a, iv b) /* b does not contain 0 */
{
    double c[4] = {a.lo / b.lo, a.lo / b.hi, a.hi / b.lo, a.hi / b.hi};
    iv r = {c[0], c[0]};
    for (int i = 1; i < 4; i++) {
        if (c[i] < r.lo) r.lo = c[i];
        if (c[i] > r.hi) r.hi = c[i];
    }
    return widen(r);
}
static iv ivadd(iv a, iv b) { iv r = {a.lo + b.lo, a.hi + b.hi}; return widen(r); }
/* monotone increasing function, libm error allowed as 2 ulp via double widening */
static iv ivmono(double (*f)(double), iv a) { iv r = {f(a.lo), f(a.hi)}; return widen_by(r, REL_FN); }
static double negexp(double x) { return exp(-x); }

int64_t or_gate_pos(int order, int64_t n, int64_t i)
{
    return order == 2 ? 2 * i : order == 1 ? n + i : i;
}

int64_t or_up_pos(int order, int64_t n, int64_t i)
{
    return order == 2 ? 2 * i + 1 : order == 1 ? i : n + i;
}

static double alpha_of(const or_act_opt *o) { return o->alpha != 0 ? o->alpha : (double)1.702f; }

static const double C_GELU = (double)0.70710678118654752f;
static const double C_T1 = (double)0.7978845608028654f;
static const double C_T2 = (double)0.044715f;

static double act_point(int act, double alpha, double g)
{
    switch (act) {
    case 1: return (0.5 * g) * (1.0 + erf(g * C_GELU));
    case 2: return (0.5 * g) * (1.0 + tanh(C_T1 * (g + C_T2 * ((g * g) * g))));
    case 3: return g / (1.0 + exp(-(alpha * g)));
    default: return g / (1.0 + exp(-g));
    }
}

static iv act_iv(int act, double alpha, double g)
{
    iv G = pt(g);
    switch (act) {
    case 3: {
        /* a = alpha g rounded; exp(-a) is decreasing in a */
        iv A = ivmul(pt(alpha), G);
        iv e = {negexp(A.hi), negexp(A.lo)};
        e = widen_by(e, REL_FN);
        iv den = ivadd(pt(1.0), e);
        return ivdiv(G, den);
    }
    case 1: {
        iv z = ivmul(G, pt(C_GELU));
        iv e = ivmono(erf, z);
        iv t = ivadd(pt(1.0), e);
        return ivmul(pt(0.5 * g), t);
    }
    case 2: {
        iv gg = ivmul(G, G);
        iv ggg = ivmul(gg, G);
        iv t1 = ivmul(pt(C_T2), ggg);
        iv t2 = ivadd(G, t1);
        iv t3 = ivmul(pt(C_T1), t2);
        iv th = ivmono(tanh, t3);
        iv t4 = ivadd(pt(1.0), th);
        return ivmul(pt(0.5 * g), t4);
    }
    default: {
        /* e = exp(-g) is decreasing in g: evaluate on a point, widen */
        iv e = {negexp(g), negexp(g)};
        e = widen_by(e, REL_FN);
        iv den = ivadd(pt(1.0), e);
        return ivdiv(G, den);
    }
    }
}

static double rbf(double x) { return or_round(OR_BF16, x); }

void or_act_elem(double g, double u, double rs, double es, const or_act_opt *o, double *point,
                 double *lo, double *hi)
{
    if (o->limit > 0) {
        double L = o->limit;
        g = (g > L) ? L : g;
        u = (u > L) ? L : (u < -L ? -L : u);
    }
    /* the up offset: one f32 addition, none at all when it is 0 */
    iv U = pt(u);
    if (o->up_offset != 0) {
        U = ivadd(pt(u), pt(o->up_offset));
        u = u + o->up_offset;
    }
    const double alpha = alpha_of(o);
    double a = act_point(o->act, alpha, g);
    if (o->round_bf16) a = rbf(a);
    double h = ((a * u) * rs) * es;
    if (o->round_bf16) h = rbf(h);
    *point = h;
    if (!isfinite(g) || !isfinite(u) || !isfinite(h)) {
        *lo = *hi = h;
        return;
    }
    iv A = act_iv(o->act, alpha, g);
    if (o->round_bf16) {
        A.lo = rbf(A.lo);
        A.hi = rbf(A.hi);
    }
    iv H = ivmul(ivmul(ivmul(A, U), pt(rs)), pt(es));
    if (o->round_bf16) {
        H.lo = rbf(H.lo);
        H.hi = rbf(H.hi);
    }
    *lo = H.lo;
    *hi = H.hi;
}

float or_quant_group(const double *h, int64_t G, int is_f8, int ue8m0, float eps, uint8_t *codes,
                     int *e_out)
{
    double amax = 0.0;
    for (int64_t i = 0; i < G; i++)
        if (isfinite(h[i]) && fabs(h[i]) > amax) amax = fabs(h[i]);
    if (amax < (double)eps) amax = (double)eps;
    float s = or_f32(amax / (is_f8 ? 448.0 : 127.0));
    int e = 0;
    if (ue8m0) {
        e = or_ue8m0(s);
        s = (float)ldexp(1.0, e - 127);
    }
    if (e_out) *e_out = e;
    for (int64_t i = 0; i < G; i++) {
        double v = h[i];
        if (is_f8) {
            if (isnan(v)) codes[i] = signbit(v) ? 0xFF : 0x7F;
            else if (isinf(v)) codes[i] = v > 0 ? 0x7E : 0xFE;
            else codes[i] = or_f8_code(or_f32(v / (double)s));
        } else {
            if (isnan(v)) codes[i] = 0;
            else if (isinf(v)) codes[i] = (uint8_t)(int8_t)(v > 0 ? 127 : -127);
            else codes[i] = (uint8_t)or_i8_code(or_f32(v / (double)s));
        }
    }
    return s;
}

int64_t or_local_expert(int32_t id, const int32_t *map, int64_t Eg, int64_t E)
{
    if (!map) Eg = E;
    if (id < 0 || id >= Eg) return -1;
    int64_t e = map ? map[id] : id;
    if (e < 0 || e >= E) return -1;
    return e;
}

void or_moe_gate(int64_t M, int64_t K, int64_t I, int64_t E, int64_t k, const double *x,
                 const double *w1, const double *b1, const int32_t *ids, const int32_t *map,
                 int64_t Eg, const or_act_opt *o, double *h, int64_t *valid)
{
    double *a = malloc(sizeof(double) * (size_t)(2 * I));
    or_act_opt oo = *o;
    oo.round_bf16 = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++) {
            int64_t e = or_local_expert(ids[m * k + j], map, Eg, E);
            valid[m * k + j] = e;
            double *hr = h + (m * k + j) * I;
            if (e < 0) {
                for (int64_t i = 0; i < I; i++) hr[i] = 0.0;
                continue;
            }
            for (int64_t r = 0; r < 2 * I; r++) {
                double s = 0.0;
                const double *wr = w1 + (e * 2 * I + r) * K;
                for (int64_t c = 0; c < K; c++) s += x[m * K + c] * wr[c];
                if (b1) s += b1[e * 2 * I + r];
                a[r] = s;
            }
            for (int64_t i = 0; i < I; i++) {
                double g = a[or_gate_pos(o->order, I, i)];
                double u = a[or_up_pos(o->order, I, i)];
                double p, lo, hi;
                or_act_elem(g, u, 1.0, 1.0, &oo, &p, &lo, &hi);
                hr[i] = p;
            }
        }
    free(a);
}

void or_moe_final(int64_t M, int64_t K, int64_t I, int64_t E, int64_t k, const double *h,
                  const double *w2, const double *b2, const int64_t *valid, const double *wts,
                  double *y, double *out)
{
    (void)E;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t r = 0; r < K; r++) out[m * K + r] = 0.0;
        for (int64_t j = 0; j < k; j++) {
            int64_t e = valid[m * k + j];
            double *yr = y + (m * k + j) * K;
            for (int64_t r = 0; r < K; r++) {
                if (e < 0) {
                    yr[r] = 0.0;
                    continue;
                }
                double s = 0.0;
                const double *wr = w2 + (e * K + r) * I;
                const double *hr = h + (m * k + j) * I;
                for (int64_t i = 0; i < I; i++) s += hr[i] * wr[i];
                if (b2) s += b2[e * K + r];
                yr[r] = s;
                out[m * K + r] += wts[m * k + j] * s;
            }
        }
    }
}

void or_topk_row(const double *l, int64_t E, int64_t k, int renorm, int32_t *ids, double *w)
{
    double *p = malloc(sizeof(double) * (size_t)E);
    int *used = calloc((size_t)E, sizeof(int));
    double mx = -INFINITY;
    int any = 0;
    for (int64_t i = 0; i < E; i++)
        if (!isnan(l[i])) {
            if (!any || l[i] > mx) mx = l[i];
            any = 1;
        }
    if (any && isinf(mx) && mx > 0) {
        int64_t c = 0;
        for (int64_t i = 0; i < E; i++) c += (l[i] == INFINITY);
        for (int64_t i = 0; i < E; i++) p[i] = (l[i] == INFINITY) ? 1.0 / (double)c : 0.0;
    } else if (any && isinf(mx)) {
        int64_t c = 0;
        for (int64_t i = 0; i < E; i++) c += !isnan(l[i]);
        for (int64_t i = 0; i < E; i++) p[i] = isnan(l[i]) ? 0.0 : 1.0 / (double)c;
    } else {
        double s = 0.0;
        for (int64_t i = 0; i < E; i++) s += isnan(l[i]) ? 0.0 : exp(l[i] - mx);
        for (int64_t i = 0; i < E; i++) p[i] = isnan(l[i]) ? 0.0 : exp(l[i] - mx) / s;
    }
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        /* numbers before NaN logits; among equal p the lower id */
        for (int64_t i = 0; i < E; i++) {
            if (used[i]) continue;
            if (best < 0) { best = i; continue; }
            int bn = isnan(l[best]), in = isnan(l[i]);
            if (bn && !in) best = i;
            else if (bn == in && p[i] > p[best]) best = i;
        }
        used[best] = 1;
        ids[j] = (int32_t)best;
        w[j] = p[best];
    }
    if (renorm) {
        double s = 0.0;
        for (int64_t j = 0; j < k; j++) s += w[j];
        if (s > 0)
            for (int64_t j = 0; j < k; j++) w[j] /= s;
    }
    free(p);
    free(used);
}
