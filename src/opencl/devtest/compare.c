/*
 * Development check of the OpenCL backend against the CPU golden backend,
 * through the public API only, until the cross-backend Check suite exists.
 * Every case runs the same call on both contexts over identical buffers
 * (canary-filled, outputs at an offset with padded rows) and compares the
 * WHOLE output buffers: bytes outside the outputs must stay equal too.
 *
 * Build (after building the library in BUILD):
 *   cc -std=c11 -O2 -Iinclude src/opencl/devtest/compare.c BUILD/src/libmoefuse.a \
 *      -fopenmp -lOpenCL -lm -o /tmp/mf_compare && /tmp/mf_compare [seed] [rounds]
 */
#include "moefuse.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static moefuse_context *cpu, *ocl;
static uint64_t rs = 88172645463325252ull;
static long n_cases, n_fail;
static int big; /* argv[3] == "big": production-like widths (slow on a CPU device) */

/* Worst differences seen, per kind. */
static double worst_rel = 0, worst_ulp_f32 = 0, worst_ulp_half = 0;
static long code_one_apart, code_total, scale_total, nan_sign_apart;

static uint64_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}
static double unif(double a, double b) { return a + (b - a) * (double)(rnd() >> 11) / 9007199254740992.0; }
static int64_t rint_(int64_t lo, int64_t hi) { return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)); }

#define CHECK(call)                                                                               \
    do {                                                                                          \
        moefuse_status st_ = (call);                                                              \
        if (st_ != MOEFUSE_OK) {                                                                  \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,                   \
                    moefuse_status_name(st_), moefuse_last_error(NULL));                          \
            exit(2);                                                                              \
        }                                                                                         \
    } while (0)

/* A buffer pair (cpu, ocl) with identical contents and a host mirror. */
typedef struct pair {
    void *c, *o;
    size_t bytes;
    unsigned char *host;
    moefuse_tensor tc, to;
} pair;

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static uint16_t to_f16(float f) /* test data only: truncating conversion is fine */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t s = (u >> 16) & 0x8000u, e = (u >> 23) & 0xFFu, m = u & 0x7FFFFFu;
    if (e == 0xFF)
        return (uint16_t)(s | 0x7C00u | (m ? 0x200u : 0));
    int ne = (int)e - 127 + 15;
    if (ne >= 31)
        return (uint16_t)(s | 0x7C00u);
    if (ne <= 0)
        return (uint16_t)s;
    return (uint16_t)(s | ((uint32_t)ne << 10) | (m >> 13));
}

/* Tensor of `shape` at a byte offset, rows padded by `pad` elements, in a canary-filled buffer. */
static pair make(moefuse_dtype dt, int rank, const int64_t *shape, int64_t pad)
{
    pair p;
    memset(&p, 0, sizeof p);
    int64_t stride[4], es = (int64_t)moefuse_dtype_size(dt);
    int64_t s = 1;
    for (int d = rank - 1; d >= 0; d--) {
        stride[d] = s;
        s *= shape[d] + (d == rank - 1 ? pad : 0);
    }
    int64_t off = 16 * es; /* leading canary */
    p.bytes = (size_t)(off + s * es + 64);
    p.host = malloc(p.bytes);
    memset(p.host, 0xA5, p.bytes);
    CHECK(moefuse_buffer_alloc(cpu, p.bytes, &p.c));
    CHECK(moefuse_buffer_alloc(ocl, p.bytes, &p.o));
    p.tc = moefuse_tensor_strided(p.c, dt, rank, shape, stride);
    p.to = moefuse_tensor_strided(p.o, dt, rank, shape, stride);
    p.tc.offset = p.to.offset = off;
    return p;
}

static void upload(pair *p)
{
    CHECK(moefuse_buffer_write(cpu, p->c, 0, p->host, p->bytes));
    CHECK(moefuse_buffer_write(ocl, p->o, 0, p->host, p->bytes));
}

static void drop(pair *p)
{
    moefuse_buffer_free(cpu, p->c);
    moefuse_buffer_free(ocl, p->o);
    free(p->host);
}

/* Address of element index i (row-major over shape) in the host mirror. */
static unsigned char *el(pair *p, const int64_t *idx)
{
    int64_t o = p->tc.offset / (int64_t)moefuse_dtype_size(p->tc.dtype);
    for (int d = 0; d < p->tc.rank; d++)
        o += idx[d] * p->tc.stride[d];
    return p->host + o * (int64_t)moefuse_dtype_size(p->tc.dtype);
}

/* Fill every element with values from gen(). */
static void fill(pair *p, float (*gen)(void))
{
    int64_t n = moefuse_tensor_numel(&p->tc), idx[4] = {0};
    for (int64_t i = 0; i < n; i++) {
        int64_t r = i;
        for (int d = p->tc.rank - 1; d >= 0; d--) {
            idx[d] = r % p->tc.shape[d];
            r /= p->tc.shape[d];
        }
        unsigned char *q = el(p, idx);
        float v = gen();
        switch (p->tc.dtype) {
        case MOEFUSE_F32: memcpy(q, &v, 4); break;
        case MOEFUSE_BF16: { uint16_t h = to_bf16(v); memcpy(q, &h, 2); } break;
        case MOEFUSE_F16: { uint16_t h = to_f16(v); memcpy(q, &h, 2); } break;
        case MOEFUSE_I32: { int32_t x = (int32_t)v; memcpy(q, &x, 4); } break;
        default: *q = (unsigned char)(int)v; break;
        }
    }
    upload(p);
}

static float g_act(void)
{
    uint64_t r = rnd() % 1000;
    if (r == 0) return NAN;
    if (r == 1) return INFINITY;
    if (r == 2) return -INFINITY;
    if (r < 8) return 0.0f;
    return (float)unif(-6, 6);
}
static float g_unit(void) { return (float)unif(-1, 1); }
static float g_pos(void) { return (float)unif(0.25, 2); }

static float f16_value(uint16_t h)
{
    int e = (h >> 10) & 0x1F, m = h & 0x3FF;
    float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY)
                                                       : ldexpf((float)(m | 0x400), e - 25);
    return (h & 0x8000) ? -v : v;
}

static int64_t ulp_diff(uint32_t a, uint32_t b)
{
    int64_t x = (a & 0x80000000u) ? -(int64_t)(a & 0x7FFFFFFFu) : (int64_t)a;
    int64_t y = (b & 0x80000000u) ? -(int64_t)(b & 0x7FFFFFFFu) : (int64_t)b;
    return x > y ? x - y : y - x;
}

/* e4m3 code as a signed ordinal, to count codes one apart. */
static int f8_ord(unsigned char c) { return (c & 0x80) ? -(int)(c & 0x7F) : (int)c; }

/*
 * Compare the whole buffers. kind: 0 bytes must be equal; 1 f8 codes (one
 * apart allowed, counted); 2 i8 codes (same); 3 f32 (ulps recorded, <= max_ulp);
 * 4 16-bit floats (ulps in 16-bit units, <= max_ulp). Bytes outside the
 * tensor must be equal whatever the kind.
 */
static int compare(const char *what, pair *p, int kind, int64_t max_ulp)
{
    unsigned char *oc = malloc(p->bytes), *oo = malloc(p->bytes);
    CHECK(moefuse_buffer_read(cpu, p->c, 0, oc, p->bytes));
    CHECK(moefuse_buffer_read(ocl, p->o, 0, oo, p->bytes));
    int bad = 0;
    const size_t es = moefuse_dtype_size(p->tc.dtype);
    for (size_t i = 0; i < p->bytes && bad < 5; i += es) {
        if (memcmp(oc + i, oo + i, es) == 0) {
            if (kind == 1 || kind == 2)
                code_total++;
            continue;
        }
        int ok = 0;
        if (kind == 1) {
            code_total++;
            /* both NaN codes, signs apart: h was NaN from two NaN operands (act(g) and
             * u), where x86 keeps whichever the compiler put first (numerics.cl) */
            if ((oc[i] & 0x7F) == 0x7F && (oo[i] & 0x7F) == 0x7F) {
                nan_sign_apart++;
                continue;
            }
            ok = abs(f8_ord(oc[i]) - f8_ord(oo[i])) <= 1 && (oc[i] & 0x7F) != 0x7F &&
                 (oo[i] & 0x7F) != 0x7F && ((oc[i] ^ oo[i]) & 0x80) == 0;
            code_one_apart += ok;
        } else if (kind == 2) {
            code_total++;
            ok = abs((int)(signed char)oc[i] - (int)(signed char)oo[i]) <= 1;
            code_one_apart += ok;
        } else if (kind == 3) {
            uint32_t a, b;
            memcpy(&a, oc + i, 4);
            memcpy(&b, oo + i, 4);
            int64_t u = ulp_diff(a, b);
            ok = u <= max_ulp;
            if (u > worst_ulp_f32 && ok)
                worst_ulp_f32 = (double)u;
        } else if (kind == 4) {
            uint16_t a, b;
            memcpy(&a, oc + i, 2);
            memcpy(&b, oo + i, 2);
            int64_t u = ulp_diff((uint32_t)(a & 0x8000 ? 0x80000000u | (a & 0x7FFF) : a),
                                 (uint32_t)(b & 0x8000 ? 0x80000000u | (b & 0x7FFF) : b));
            ok = u <= max_ulp;
            if (u > worst_ulp_half && ok) {
                worst_ulp_half = (double)u;
                if (u > 2)
                    fprintf(stderr, "  note: %s 16-bit %04x (cpu) vs %04x (opencl)\n", what, a, b);
            }
        }
        if (!ok) {
            if (bad == 0)
                fprintf(stderr, "  %s: first differences (byte offset: cpu vs opencl)\n", what);
            fprintf(stderr, "    @%zu:", i);
            for (size_t b = 0; b < es; b++)
                fprintf(stderr, " %02x/%02x", oc[i + b], oo[i + b]);
            fprintf(stderr, "\n");
            bad++;
        }
    }
    free(oc);
    free(oo);
    return bad;
}

/* Per-operation summary: cases, failures, worst f32 / 16-bit ulp, worst relative error. */
#define MAX_OPS 16
static struct opstat {
    const char *name;
    long cases, fails, exact;
    double ulp32, ulp16, rel;
} ops[MAX_OPS];
static int n_ops;

static struct opstat *stat_of(const char *name)
{
    for (int i = 0; i < n_ops; i++)
        if (strcmp(ops[i].name, name) == 0)
            return &ops[i];
    ops[n_ops].name = name;
    return &ops[n_ops++];
}

static void report(const char *name, int bad, const char *desc)
{
    struct opstat *st = stat_of(name);
    st->cases++;
    st->fails += bad != 0;
    if (worst_ulp_f32 > st->ulp32)
        st->ulp32 = worst_ulp_f32;
    if (worst_ulp_half > st->ulp16)
        st->ulp16 = worst_ulp_half;
    if (worst_rel > st->rel)
        st->rel = worst_rel;
    st->exact += worst_ulp_f32 == 0 && worst_ulp_half == 0 && worst_rel == 0;
    worst_ulp_f32 = worst_ulp_half = worst_rel = 0;
    n_cases++;
    if (bad) {
        n_fail++;
        fprintf(stderr, "FAIL %s: %s\n", name, desc);
    }
}

/*
 * Scales: f32 within 1 ulp for silu (exp and division), byte exponents exact
 * unless the f32 scale sits next to a power of two. The gelu forms pass h's
 * own difference through (1 + erf / 1 + tanh cancels; glibc's erff/tanhf are
 * not correctly rounded), so they get 8 ulp; the worst is reported.
 */
static int compare_scales(pair *p, int gelu)
{
    if (p->tc.dtype != MOEFUSE_F32)
        return compare("scales", p, 0, 0);
    int bad = compare("scales", p, 3, gelu ? 8 : 1);
    scale_total += moefuse_tensor_numel(&p->tc);
    return bad;
}

static const moefuse_dtype floats[3] = {MOEFUSE_F32, MOEFUSE_BF16, MOEFUSE_F16};

/* ------------------------------------------------------------- row ops */

static void case_act_quant(int masked)
{
    moefuse_act_quant_options o;
    memset(&o, 0, sizeof o);
    const moefuse_dtype xdt = floats[rnd() % 3];
    const moefuse_dtype qdt = rnd() % 4 ? MOEFUSE_F8_E4M3 : MOEFUSE_I8;
    static const int64_t gs[3] = {32, 64, 128};
    int64_t G = gs[rnd() % 3];
    int64_t H = G * rint_(1, 4);
    if (rnd() % 5 == 0) { /* per-row group of an odd width */
        H = rint_(1, 300);
        G = H;
    }
    o.quant.group_size = G;
    o.quant.scale_layout = (moefuse_scale_layout)(rnd() % (qdt == MOEFUSE_F8_E4M3 ? 3 : 2));
    o.quant.ue8m0 = qdt == MOEFUSE_F8_E4M3 && (rnd() % 2);
    if (rnd() % 4 == 0)
        o.quant.eps = 1e-3f;
    o.act.activation = (moefuse_activation)(rnd() % 3);
    o.act.order = (moefuse_gate_order)(rnd() % 2);
    o.act.limit = rnd() % 3 == 0 ? 3.5f : 0.0f;
    o.act.intermediate = (moefuse_rounding)(rnd() % 2);
    o.zero_tail = (int)(rnd() % 2);
    if (big) {
        G = rnd() % 2 ? 128 : 7168;
        H = 7168;
        o.quant.group_size = G;
    }
    const int64_t E = masked ? rint_(1, big ? 32 : 9) : 1, T = rint_(1, big ? 128 : 37);
    const int64_t Gn = H / G;
    const int64_t Ta = (T + 3) / 4 * 4;
    const bool u8 = o.quant.ue8m0 && o.quant.scale_layout != MOEFUSE_SCALE_PACKED_UE8M0;
    const moefuse_dtype sdt = o.quant.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0 ? MOEFUSE_I32
                              : u8                                              ? MOEFUSE_U8
                                                                                : MOEFUSE_F32;
    int64_t xs[3] = {E, T, 2 * H}, qs[3] = {E, T, H}, ss[3];
    switch (o.quant.scale_layout) {
    case MOEFUSE_SCALE_ROW_MAJOR: ss[0] = E, ss[1] = T, ss[2] = Gn; break;
    case MOEFUSE_SCALE_COLUMN_MAJOR: ss[0] = E, ss[1] = Gn, ss[2] = Ta; break;
    default: ss[0] = E, ss[1] = (Gn + 3) / 4, ss[2] = Ta; break;
    }
    const int r = masked ? 3 : 2, off = masked ? 0 : 1;
    pair x = make(xdt, r, xs + off, rint_(0, 3));
    pair q = make(qdt, r, qs + off, rint_(0, 5));
    pair s = make(sdt, r, ss + off, 0);
    pair rsc = make(MOEFUSE_F32, r - 1, xs + off, 0);
    pair cnt = make(MOEFUSE_I32, 1, &E, 0);
    pair es = make(rnd() % 2 ? MOEFUSE_F32 : MOEFUSE_BF16, 1, &E, 0);
    fill(&x, g_act);
    fill(&rsc, g_pos);
    fill(&es, g_pos);
    upload(&q);
    upload(&s);
    for (int64_t e = 0; e < E; e++) { /* counts outside [0, T] too: they must be clamped */
        int32_t n = (int32_t)rint_(-3, T + 3);
        memcpy(cnt.host + cnt.tc.offset + e * 4, &n, 4);
    }
    upload(&cnt);
    const bool use_rs = rnd() % 2, use_es = masked && rnd() % 2;
    if (masked) {
        CHECK(moefuse_act_quant_masked(cpu, &x.tc, &cnt.tc, use_rs ? &rsc.tc : NULL,
                                       use_es ? &es.tc : NULL, &q.tc, &s.tc, &o));
        CHECK(moefuse_act_quant_masked(ocl, &x.to, &cnt.to, use_rs ? &rsc.to : NULL,
                                       use_es ? &es.to : NULL, &q.to, &s.to, &o));
    } else {
        CHECK(moefuse_act_quant(cpu, &x.tc, use_rs ? &rsc.tc : NULL, &q.tc, &s.tc, &o));
        CHECK(moefuse_act_quant(ocl, &x.to, use_rs ? &rsc.to : NULL, &q.to, &s.to, &o));
    }
    int bad = compare("q", &q, qdt == MOEFUSE_F8_E4M3 ? 1 : 2, 0) +
              compare_scales(&s, o.act.activation != MOEFUSE_ACT_SILU);
    char d[256];
    snprintf(d, sizeof d,
             "E=%lld T=%lld H=%lld G=%lld x=%s q=%s layout=%d ue8m0=%d act=%d order=%d limit=%g "
             "round=%d rs=%d es=%d zero_tail=%d",
             (long long)E, (long long)T, (long long)H, (long long)G, moefuse_dtype_name(xdt),
             moefuse_dtype_name(qdt), (int)o.quant.scale_layout, o.quant.ue8m0,
             (int)o.act.activation, (int)o.act.order, (double)o.act.limit, (int)o.act.intermediate,
             use_rs, use_es, o.zero_tail);
    report(masked ? "act_quant_masked" : "act_quant", bad, d);
    drop(&x), drop(&q), drop(&s), drop(&rsc), drop(&cnt), drop(&es);
}

static void case_quant(void)
{
    moefuse_quant_options o;
    memset(&o, 0, sizeof o);
    const moefuse_dtype xdt = floats[rnd() % 3];
    const moefuse_dtype qdt = rnd() % 4 ? MOEFUSE_F8_E4M3 : MOEFUSE_I8;
    int64_t G = 32 << (rnd() % 3), H = G * rint_(1, 3), T = rint_(1, 20);
    o.group_size = G;
    o.scale_layout = (moefuse_scale_layout)(rnd() % (qdt == MOEFUSE_F8_E4M3 ? 3 : 2));
    o.ue8m0 = qdt == MOEFUSE_F8_E4M3 && (rnd() % 2);
    const bool u8 = o.ue8m0 && o.scale_layout != MOEFUSE_SCALE_PACKED_UE8M0;
    const moefuse_dtype sdt = o.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0 ? MOEFUSE_I32
                              : u8                                       ? MOEFUSE_U8
                                                                         : MOEFUSE_F32;
    const int64_t Gn = H / G, Ta = (T + 3) / 4 * 4;
    int64_t xs[2] = {T, H}, ss[2];
    switch (o.scale_layout) {
    case MOEFUSE_SCALE_ROW_MAJOR: ss[0] = T, ss[1] = Gn; break;
    case MOEFUSE_SCALE_COLUMN_MAJOR: ss[0] = Gn, ss[1] = Ta; break;
    default: ss[0] = (Gn + 3) / 4, ss[1] = Ta; break;
    }
    pair x = make(xdt, 2, xs, rint_(0, 2)), q = make(qdt, 2, xs, 0), s = make(sdt, 2, ss, 0);
    fill(&x, g_act);
    upload(&q);
    upload(&s);
    CHECK(moefuse_quant(cpu, &x.tc, &q.tc, &s.tc, &o));
    CHECK(moefuse_quant(ocl, &x.to, &q.to, &s.to, &o));
    int bad = compare("q", &q, qdt == MOEFUSE_F8_E4M3 ? 1 : 2, 0) + compare_scales(&s, 0);
    char d[160];
    snprintf(d, sizeof d, "T=%lld H=%lld G=%lld x=%s q=%s layout=%d ue8m0=%d", (long long)T,
             (long long)H, (long long)G, moefuse_dtype_name(xdt), moefuse_dtype_name(qdt),
             (int)o.scale_layout, o.ue8m0);
    report("quant", bad, d);

    /* dequant of what the CPU produced (same bytes on both sides) */
    moefuse_dtype odt = floats[rnd() % 3];
    pair out = make(odt, 2, xs, 1);
    upload(&out);
    CHECK(moefuse_buffer_read(cpu, q.c, 0, q.host, q.bytes));
    CHECK(moefuse_buffer_read(cpu, s.c, 0, s.host, s.bytes));
    if (qdt == MOEFUSE_F8_E4M3) /* sprinkle NaN codes */
        q.host[q.tc.offset] = 0x7F;
    upload(&q);
    upload(&s);
    CHECK(moefuse_dequant(cpu, &q.tc, &s.tc, &out.tc, &o));
    CHECK(moefuse_dequant(ocl, &q.to, &s.to, &out.to, &o));
    bad = compare("out", &out, 0, 0);
    report("dequant", bad, d);
    drop(&x), drop(&q), drop(&s), drop(&out);
}

static float host_value(pair *p, const int64_t *idx, const unsigned char *buf)
{
    const unsigned char *q = buf + (el(p, idx) - p->host);
    uint16_t h;
    float f;
    if (p->tc.dtype == MOEFUSE_F32) {
        memcpy(&f, q, 4);
        return f;
    }
    memcpy(&h, q, 2);
    if (p->tc.dtype == MOEFUSE_F16)
        return f16_value(h);
    uint32_t u = (uint32_t)h << 16;
    memcpy(&f, &u, 4);
    return f;
}

/*
 * act_mul agreement: 3 ulp of the output dtype (see below), widened for the gelu forms
 * by the cancellation in 1 + erf / 1 + tanh: a few f32 ulp of t (glibc's erff
 * and tanhf are not correctly rounded; the device's differ) move h by up to
 * |0.5 g u| * 4 * 2^-24. Bytes outside out must be equal.
 */
static int act_mul_check(pair *x, pair *out, pair *rsc, const moefuse_act_options *o, int64_t T,
                         int64_t H)
{
    unsigned char *a = malloc(out->bytes), *b = malloc(out->bytes);
    CHECK(moefuse_buffer_read(cpu, out->c, 0, a, out->bytes));
    CHECK(moefuse_buffer_read(ocl, out->o, 0, b, out->bytes));
    unsigned char *inside = calloc(out->bytes, 1);
    const size_t es = moefuse_dtype_size(out->tc.dtype);
    int bad = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < H; c++) {
            int64_t oi[2] = {t, c}, gi[2] = {t, o->order ? H + c : c}, ui[2] = {t, o->order ? c : H + c};
            size_t off = (size_t)(el(out, oi) - out->host);
            memset(inside + off, 1, es);
            float va = host_value(out, oi, a), vb = host_value(out, oi, b);
            if (memcmp(a + off, b + off, es) == 0 || (isnan(va) && isnan(vb)))
                continue;
            float g = host_value(x, gi, x->host), u = host_value(x, ui, x->host);
            float r = rsc ? host_value(rsc, oi, rsc->host) : 1.0f;
            double ulp = es == 4 ? ldexp(1.0, ilogb(fmax(fabs(va), 1e-30)) - 23)
                         : out->tc.dtype == MOEFUSE_BF16 ? ldexp(1.0, ilogb(fmax(fabs(va), 1e-30)) - 7)
                                                         : ldexp(1.0, ilogb(fmax(fabs(va), 6e-5)) - 10);
            /* glibc's expf is not correctly rounded (0.502 ulp) nor is the device's:
             * one ulp of exp(-g) can become two or three of g / d * u * r */
            double allow = ulp * 3.0001;
            double nu = fabs((double)va - vb) / ulp;
            if (es == 4 && nu > worst_ulp_f32)
                worst_ulp_f32 = nu;
            if (es == 2 && nu > worst_ulp_half)
                worst_ulp_half = nu;
            if (o->activation != MOEFUSE_ACT_SILU)
                allow += fabs(0.5 * g * u * r) * 4 * ldexp(1.0, -24);
            if (o->intermediate == MOEFUSE_ROUND_BF16) /* bf16 steps of act(g) and h can flip */
                allow += fabs(u * r) * ldexp(1.0, -7) * fmax(fabs(g), 1.0) +
                         ldexp(1.0, ilogb(fmax(fabs(va), 1e-30)) - 7);
            if (!(fabs((double)va - vb) <= allow)) {
                if (bad++ < 5)
                    fprintf(stderr, "  act_mul [%lld, %lld] g=%g u=%g: cpu %.9g opencl %.9g\n",
                            (long long)t, (long long)c, g, u, va, vb);
            }
        }
    for (size_t i = 0; i < out->bytes; i++)
        if (!inside[i] && a[i] != b[i] && bad++ < 5)
            fprintf(stderr, "  act_mul: byte %zu outside out changed\n", i);
    free(a), free(b), free(inside);
    return bad;
}

static void case_act_mul(void)
{
    moefuse_act_options o;
    memset(&o, 0, sizeof o);
    const moefuse_dtype xdt = floats[rnd() % 3];
    o.activation = (moefuse_activation)(rnd() % 3);
    o.order = (moefuse_gate_order)(rnd() % 2);
    o.limit = rnd() % 3 == 0 ? 2.5f : 0.0f;
    o.intermediate = (moefuse_rounding)(rnd() % 2);
    int64_t T = rint_(1, 30), H = rint_(1, 200);
    int64_t xs[2] = {T, 2 * H}, os[2] = {T, H};
    pair x = make(xdt, 2, xs, rint_(0, 3)), out = make(xdt, 2, os, rint_(0, 3));
    pair rsc = make(MOEFUSE_F32, 1, &T, 0);
    fill(&x, g_act);
    fill(&rsc, g_pos);
    upload(&out);
    bool use_rs = rnd() % 2;
    CHECK(moefuse_act_mul(cpu, &x.tc, use_rs ? &rsc.tc : NULL, &out.tc, &o));
    CHECK(moefuse_act_mul(ocl, &x.to, use_rs ? &rsc.to : NULL, &out.to, &o));
    int bad = act_mul_check(&x, &out, use_rs ? &rsc : NULL, &o, T, H);
    char d[160];
    snprintf(d, sizeof d, "T=%lld H=%lld x=%s act=%d order=%d limit=%g round=%d rs=%d",
             (long long)T, (long long)H, moefuse_dtype_name(xdt), (int)o.activation, (int)o.order,
             (double)o.limit, (int)o.intermediate, use_rs);
    report("act_mul", bad, d);
    drop(&x), drop(&out), drop(&rsc);
}

/* --------------------------------------------------------------- router */

static float g_logit(void)
{
    uint64_t r = rnd() % 200;
    if (r == 0) return NAN;
    if (r == 1) return INFINITY;
    if (r == 2) return -INFINITY;
    if (r < 20) return 1.0f; /* ties */
    return (float)unif(-8, 8);
}

static void case_topk(void)
{
    const moefuse_dtype ldt = floats[rnd() % 3];
    int64_t M = rint_(1, 50), E = rint_(1, 70), k = rint_(1, E < 8 ? E : 8);
    int64_t ls[2] = {M, E}, is[2] = {M, k};
    pair l = make(ldt, 2, ls, rint_(0, 2)), ids = make(MOEFUSE_I32, 2, is, 1),
         w = make(MOEFUSE_F32, 2, is, 1);
    fill(&l, g_logit);
    upload(&ids);
    upload(&w);
    int ren = (int)(rnd() % 2);
    CHECK(moefuse_topk_softmax(cpu, &l.tc, ren, &ids.tc, &w.tc));
    CHECK(moefuse_topk_softmax(ocl, &l.to, ren, &ids.to, &w.to));
    int bad = compare("ids", &ids, 0, 0) + compare("weights", &w, 3, 4);
    char d[128];
    snprintf(d, sizeof d, "M=%lld E=%lld k=%lld logits=%s renormalize=%d", (long long)M,
             (long long)E, (long long)k, moefuse_dtype_name(ldt), ren);
    report("topk_softmax", bad, d);
    drop(&l), drop(&ids), drop(&w);
}

/* ------------------------------------------------------------------ MoE */

static double rel_err(pair *p)
{
    size_t n = p->bytes;
    unsigned char *a = malloc(n), *b = malloc(n);
    CHECK(moefuse_buffer_read(cpu, p->c, 0, a, n));
    CHECK(moefuse_buffer_read(ocl, p->o, 0, b, n));
    double num = 0, den = 0;
    int64_t cnt = moefuse_tensor_numel(&p->tc), idx[4];
    for (int64_t i = 0; i < cnt; i++) {
        int64_t r = i;
        for (int d = p->tc.rank - 1; d >= 0; d--) {
            idx[d] = r % p->tc.shape[d];
            r /= p->tc.shape[d];
        }
        size_t off = (size_t)(el(p, idx) - p->host);
        float x, y;
        if (p->tc.dtype == MOEFUSE_F32) {
            memcpy(&x, a + off, 4), memcpy(&y, b + off, 4);
        } else {
            uint16_t hx, hy;
            memcpy(&hx, a + off, 2), memcpy(&hy, b + off, 2);
            if (p->tc.dtype == MOEFUSE_BF16) {
                uint32_t ux = (uint32_t)hx << 16, uy = (uint32_t)hy << 16;
                memcpy(&x, &ux, 4), memcpy(&y, &uy, 4);
            } else {
                x = f16_value(hx);
                y = f16_value(hy);
            }
        }
        num += ((double)x - y) * ((double)x - y);
        den += (double)x * x;
    }
    free(a), free(b);
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void case_moe(void)
{
    moefuse_moe_options o;
    memset(&o, 0, sizeof o);
    const moefuse_dtype dt = floats[rnd() % 3];
    o.activation = (moefuse_activation)(rnd() % 3);
    o.order = (moefuse_gate_order)(rnd() % 2);
    o.limit = rnd() % 3 == 0 ? 2.0f : 0.0f;
    int64_t M = rint_(1, 24), K = rint_(1, 300), I = rint_(1, 200), E = rint_(1, 6);
    if (big) {
        M = rint_(1, 96), K = 1024 + rint_(0, 3), I = 512 + rint_(0, 5), E = rint_(2, 8);
    }
    int64_t k = rint_(1, E < 4 ? E : 4);
    bool use_map = rnd() % 2;
    int64_t Eg = use_map ? E + 3 : E;
    int64_t xs[2] = {M, K}, w1s[3] = {E, 2 * I, K}, w2s[3] = {E, K, I}, b1s[2] = {E, 2 * I},
            b2s[2] = {E, K}, hs[3] = {M, k, I}, ts[2] = {M, k}, ys[3] = {M, k, K};
    pair x = make(dt, 2, xs, rint_(0, 2)), w1 = make(dt, 3, w1s, 0), w2 = make(dt, 3, w2s, 0);
    pair b1 = make(rnd() % 2 ? MOEFUSE_F32 : dt, 2, b1s, 0), b2 = make(dt, 2, b2s, 0);
    pair h = make(dt, 3, hs, rint_(0, 2)), ids = make(MOEFUSE_I32, 2, ts, 0),
         tw = make(MOEFUSE_F32, 2, ts, 0), map = make(MOEFUSE_I32, 1, &Eg, 0);
    pair out = make(dt, 2, xs, 1), y = make(dt, 3, ys, 0), fo = make(dt, 2, xs, 0);
    fill(&x, g_unit), fill(&w1, g_unit), fill(&w2, g_unit), fill(&b1, g_unit), fill(&b2, g_unit);
    fill(&tw, g_pos);
    for (int64_t i = 0; i < M * k; i++) { /* ids: mostly valid, some out of range */
        int32_t id = (int32_t)rint_(-1, Eg);
        memcpy(ids.host + ids.tc.offset + i * 4, &id, 4);
    }
    upload(&ids);
    for (int64_t i = 0; i < Eg; i++) {
        int32_t e = (int32_t)rint_(-1, E);
        memcpy(map.host + map.tc.offset + i * 4, &e, 4);
    }
    upload(&map);
    upload(&h), upload(&out), upload(&y), upload(&fo);
    bool bias = rnd() % 2;
    moefuse_routing rc = {ids.tc, tw.tc, use_map ? map.tc : (moefuse_tensor){0}};
    moefuse_routing ro = {ids.to, tw.to, use_map ? map.to : (moefuse_tensor){0}};
    CHECK(moefuse_moe_gate(cpu, &x.tc, &w1.tc, bias ? &b1.tc : NULL, &rc, &h.tc, &o));
    CHECK(moefuse_moe_gate(ocl, &x.to, &w1.to, bias ? &b1.to : NULL, &ro, &h.to, &o));
    /* SPEC section 5 bounds for the GEMMs (there against an f64 oracle) */
    const double tol = dt == MOEFUSE_F32 ? 1e-5 : dt == MOEFUSE_BF16 ? 8e-3 : 1e-3;
    char d[200];
    snprintf(d, sizeof d, "M=%lld K=%lld I=%lld E=%lld k=%lld dt=%s act=%d order=%d limit=%g "
             "bias=%d map=%d", (long long)M, (long long)K, (long long)I, (long long)E,
             (long long)k, moefuse_dtype_name(dt), (int)o.activation, (int)o.order,
             (double)o.limit, bias, use_map);
    double e1 = rel_err(&h);
    worst_rel = e1;
    int bad = compare("h", &h, dt == MOEFUSE_F32 ? 3 : 4, 1 << 30) != 0 || e1 > tol;
    report("moe_gate", bad, d);
    /* final from the same h on both sides (the CPU's), reduced and not */
    CHECK(moefuse_buffer_read(cpu, h.c, 0, h.host, h.bytes));
    upload(&h);
    CHECK(moefuse_moe_final(cpu, &h.tc, &w2.tc, bias ? &b2.tc : NULL, &rc, &out.tc, &o));
    CHECK(moefuse_moe_final(ocl, &h.to, &w2.to, bias ? &b2.to : NULL, &ro, &out.to, &o));
    double e2 = rel_err(&out);
    worst_rel = e2;
    bad = compare("out", &out, dt == MOEFUSE_F32 ? 3 : 4, 1 << 30) != 0 || e2 > tol;
    report("moe_final", bad, d);
    CHECK(moefuse_moe_final(cpu, &h.tc, &w2.tc, bias ? &b2.tc : NULL, &rc, &y.tc, &o));
    CHECK(moefuse_moe_final(ocl, &h.to, &w2.to, bias ? &b2.to : NULL, &ro, &y.to, &o));
    double e3 = rel_err(&y);
    worst_rel = e3;
    bad = compare("y", &y, dt == MOEFUSE_F32 ? 3 : 4, 1 << 30) != 0 || e3 > tol;
    report("moe_final(unreduced)", bad, d);
    CHECK(moefuse_moe_forward(cpu, &x.tc, &w1.tc, &w2.tc, bias ? &b1.tc : NULL,
                              bias ? &b2.tc : NULL, &rc, &fo.tc, &o));
    CHECK(moefuse_moe_forward(ocl, &x.to, &w1.to, &w2.to, bias ? &b1.to : NULL,
                              bias ? &b2.to : NULL, &ro, &fo.to, &o));
    double e4 = rel_err(&fo);
    worst_rel = e4;
    bad = compare("forward", &fo, dt == MOEFUSE_F32 ? 3 : 4, 1 << 30) != 0 || e4 > tol;
    report("moe_forward", bad, d);
    drop(&x), drop(&w1), drop(&w2), drop(&b1), drop(&b2), drop(&h), drop(&ids), drop(&tw);
    drop(&map), drop(&out), drop(&y), drop(&fo);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        rs = strtoull(argv[1], NULL, 10) * 2654435761ull + 1;
    int rounds = argc > 2 ? atoi(argv[2]) : 40;
    big = argc > 3 && strcmp(argv[3], "big") == 0;
    CHECK(moefuse_context_create(&cpu, "cpu"));
    CHECK(moefuse_context_create(&ocl, "opencl"));
    printf("opencl device: %s\n", moefuse_device_name(ocl));
    for (int r = 0; r < rounds; r++) {
        case_act_quant(0);
        case_act_quant(1);
        if (!big) {
            case_quant();
            case_act_mul();
            case_topk();
        }
        case_moe();
    }
    printf("cases %ld, failed %ld\n", n_cases, n_fail);
    printf("quantized codes compared: %ld, one code apart: %ld, NaN codes of opposite sign: %ld\n",
           code_total, code_one_apart, nan_sign_apart);
    printf("%-22s %6s %6s %8s %10s %10s %10s\n", "op", "cases", "failed", "bitexact", "f32 ulp",
           "16b ulp", "rel err");
    for (int i = 0; i < n_ops; i++)
        printf("%-22s %6ld %6ld %8ld %10g %10g %10.3g\n", ops[i].name, ops[i].cases, ops[i].fails,
               ops[i].exact, ops[i].ulp32, ops[i].ulp16, ops[i].rel);
    moefuse_context_destroy(ocl);
    moefuse_context_destroy(cpu);
    return n_fail != 0;
}
