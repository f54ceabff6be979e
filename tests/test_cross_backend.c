/*
 * Cross-backend agreement (docs/NUMERICS.md, "Agreement between backends").
 * Every operation runs on the CPU golden backend (g_ref) and on the backend
 * under test (g_ctx) over identical buffers (tb_twin: same bytes, canaries and
 * poison), from fresh random data every run. Results are compared element by
 * element with the bounds of that section; every other byte of the two
 * buffers (row padding, untouched tails, canaries) must be equal, and
 * h_check_all checks each side's canaries after each call. The GEMMs are also
 * compared with the float64 oracle (oracle.c).
 *
 * With MOEFUSE_TEST_BACKEND=cpu both sides are CPU contexts. The program then
 * checks its own cases and comparisons, and that two CPU contexts agree bit for
 * bit, in seconds: cheap enough to run on every build, and a broken
 * comparison shows up before anyone runs it on a GPU.
 *
 * What must agree:
 *  - act_mul, act_quant, act_quant_masked, quant, dequant, topk_softmax:
 *    every byte, bit for bit (every backend runs the library's own exp, erf
 *    and tanh and IEEE f32 arithmetic in the documented order). The one
 *    exception: a NaN from act(g) * u where both are NaN may carry either
 *    operand's sign (f8 NaN code 0x7F or 0xFF, act_mul's NaN sign).
 *  - GEMMs: relative error <= 1e-5 (f32), 8e-3 (bf16), 4e-3 (f16, oracle.h), each element's
 *    error first less half a subnormal step of its dtype (NUMERICS.md)
 *    against the oracle on both backends, and between the two backends.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* ---------------------------------------------------------------- pairs */

/* One tensor on the backend under test (d) and its twin on the CPU (c). */
typedef struct {
    tbuf *d, *c;
} pair;

static pair pair_of(tbuf *d)
{
    pair p = {d, tb_twin(d, g_ref)};
    return p;
}

static pair pair1(const char *name, moefuse_dtype dt, int64_t a, int in)
{
    return pair_of(tb_new1(name, dt, a, in));
}
static pair pair2(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t rp, int in)
{
    return pair_of(tb_new2(name, dt, a, b, rp, in));
}
static pair pair3(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t c, int64_t rp, int in)
{
    return pair_of(tb_new3(name, dt, a, b, c, rp, in));
}

/* A call's status and message, taken before the canary check's reads clear the message. */
typedef struct {
    moefuse_status st;
    char msg[512];
} outcome;

static outcome outcome_of(moefuse_status st, const moefuse_context *ctx)
{
    outcome o = {st, ""};
    snprintf(o.msg, sizeof o.msg, "%s", moefuse_last_error(ctx));
    return o;
}

/* The same call on both sides: both succeed; canaries intact (nothing written if one fails). */
#define BOTH(on_dev, on_cpu, what) both(outcome_of((on_dev), g_ctx), outcome_of((on_cpu), g_ref), (what))

static void both(outcome dev, outcome cpu, const char *what)
{
    h_check_all(dev.st != MOEFUSE_OK || cpu.st != MOEFUSE_OK);
    HCHECK(cpu.st == MOEFUSE_OK, "%s on cpu: %s (%s)", what, moefuse_status_name(cpu.st), cpu.msg);
    HCHECK(dev.st == MOEFUSE_OK, "%s on %s: %s (%s)", what, h_backend(), moefuse_status_name(dev.st), dev.msg);
}

/* Bytes of an output compared by a tolerance; all others must be equal. */
static unsigned char *judged_new(pair p) { return calloc(p.d->total, 1); }

static void judge(unsigned char *judged, const tbuf *tb, const void *el, size_t n)
{
    memset(judged + ((const unsigned char *)el - tb->full), 1, n);
}

/* Row padding, untouched rows, poison and canaries: the same bytes on both sides. */
static void same_elsewhere(pair p, unsigned char *judged, const char *what)
{
    for (size_t i = 0; i < p.d->total; i++)
        if (!judged[i] && p.d->full[i] != p.c->full[i]) {
            unsigned char a = p.c->full[i], b = p.d->full[i];
            free(judged);
            HCHECK(0, "%s: '%s' byte %zu of %zu (%s) is 0x%02x on cpu, 0x%02x on %s", what, p.d->name, i,
                   p.d->total, p.d->logical[i] ? "element not compared by value" : "padding or canary", a, b,
                   h_backend());
        }
    free(judged);
}

/* ------------------------------------------------------ what a test saw */

/* Counted per test: reset by the fixture (tests share a process under CK_FORK=no). */
static struct {
    long long codes, scales, values; /* codes, f32 scales, act_mul values compared */
    long long nan_either;            /* NaN from two NaN operands: sign not compared */
    double gemm_rel;                 /* largest GEMM relative error, device vs cpu */
} seen;

static void finish(const char *test)
{
    fprintf(stderr,
            "%s on %s: %lld codes, %lld f32 scales, %lld act_mul values bit-equal (%lld NaN of two NaN "
            "operands, sign free); GEMM rel. error <= %.3g\n",
            test, h_backend(), seen.codes, seen.scales, seen.values, seen.nan_either, seen.gemm_rel);
}

/* ------------------------------------------------------------- helpers */

typedef struct {
    int layout, ue8m0;
} lay;
static const lay LAYS[5] = {
    {MOEFUSE_SCALE_ROW_MAJOR, 0},    {MOEFUSE_SCALE_COLUMN_MAJOR, 0}, {MOEFUSE_SCALE_ROW_MAJOR, 1},
    {MOEFUSE_SCALE_COLUMN_MAJOR, 1}, {MOEFUSE_SCALE_PACKED_UE8M0, 1},
};
static const moefuse_dtype FLOATS[3] = {MOEFUSE_F32, MOEFUSE_F16, MOEFUSE_BF16};

static double *doubles(size_t n) { return malloc(sizeof(double) * (n ? n : 1)); }

/*
 * Does the backend under test divide correctly rounded? NUMERICS.md exempts an OpenCL device
 * that does not (its name says so) from the bit-equality of the row operations; none of the
 * devices this project tests on is one, and the test says so when it meets one.
 */
static int exact_division(void)
{
    static int warned;
    const int exact = strstr(moefuse_device_name(g_ctx), "division not correctly rounded") == NULL;
    if (!exact && !warned++)
        fprintf(stderr, "NOTE: %s does not divide correctly rounded: row-op values not compared\n",
                moefuse_device_name(g_ctx));
    return exact;
}

/* g and u of output channel c (x is [T, 2H], or [E, T, 2H] with e >= 0) */
static void gate_up(tbuf *x, int64_t e, int64_t t, int64_t c, int64_t H, int order, double *g, double *u)
{
    int64_t gc = or_gate_pos(order, H, c), uc = or_up_pos(order, H, c);
    int three = x->t.rank == 3;
    *g = three ? tb_get(x, e, t, gc) : tb_get(x, t, gc, 0);
    *u = three ? tb_get(x, e, t, uc) : tb_get(x, t, uc, 0);
}

/*
 * act(g) and u both NaN. NUMERICS.md does not fix the sign of h's NaN then: x86
 * keeps whichever NaN operand of act(g) * u the compiler placed first
 * (src/opencl/README.md, "NaN signs"). Everywhere else NaN signs must agree.
 */
static int nan_from_two_nans(double g, double u, const or_act_opt *o)
{
    or_act_opt plain = *o;
    plain.round_bf16 = 0;
    plain.up_offset = 0; /* act(g) alone: the offset keeps a NaN u NaN, and adds no other */
    double p, lo, hi;
    or_act_elem(g, 1.0, 1.0, 1.0, &plain, &p, &lo, &hi); /* act(g), after the clamp */
    return isnan(p) && isnan(u);
}

/* Inputs for the activation paths: uniform, with NaN, +-Inf and zeros sprinkled in. */
static double act_input(int special)
{
    if (special) {
        int64_t r = h_randint(0, 199);
        if (r == 0) return NAN;
        if (r == 1) return -NAN;
        if (r == 2) return INFINITY;
        if (r == 3) return -INFINITY;
        if (r == 4) return -0.0; /* its sign survives no up offset, and none survives one */
        if (r < 8) return 0.0;
        if (r == 8) return 7.0; /* gpt-oss's clamp */
        if (r == 9) return -7.0;
    }
    return h_unif(-6, 6);
}

/*
 * special = 2, bf16 x of at least 65536 gates: every bf16 bit pattern once as a gate (in an
 * order that mixes magnitudes within a group), u as with special = 1. The CUDA table kernels
 * read act(g) from a table over part of the range and compute the rest: both must give the
 * CPU's bits.
 */
static void fill_every_bf16_gate(tbuf *x, int64_t H, int order)
{
    const moefuse_tensor *t = &x->t;
    const int three = t->rank == 3;
    const int64_t n0 = three ? t->shape[0] : 1, n1 = t->shape[three ? 1 : 0];
    int64_t k = 0;
    for (int64_t a = 0; a < n0; a++)
        for (int64_t b = 0; b < n1; b++)
            for (int64_t c = 0; c < H; c++, k++) {
                const int64_t gc = or_gate_pos(order, H, c), uc = or_up_pos(order, H, c);
                uint16_t *g = three ? tb_el(x, a, b, gc) : tb_el(x, b, gc, 0);
                *g = (uint16_t)((uint32_t)k * 0x9E37u); /* odd factor: a permutation mod 2^16 */
                if (three)
                    tb_set(x, a, b, uc, act_input(1));
                else
                    tb_set(x, b, uc, 0, act_input(1));
            }
}

static void fill_act(tbuf *x, int special)
{
    const moefuse_tensor *t = &x->t;
    int64_t n0 = t->rank == 3 ? t->shape[0] : 1, n1 = t->shape[t->rank - 2], n2 = t->shape[t->rank - 1];
    for (int64_t a = 0; a < n0; a++)
        for (int64_t b = 0; b < n1; b++)
            for (int64_t c = 0; c < n2; c++) {
                if (t->rank == 3)
                    tb_set(x, a, b, c, act_input(special));
                else
                    tb_set(x, b, c, 0, act_input(special));
            }
}

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

typedef struct {
    moefuse_dtype xdt, qdt;
    int64_t E, T, H, G; /* E = 0: the 2-D call; T is Tmax for the masked call */
    lay L;
    int act, order, rnd, use_rs, es_kind, zero_tail, rp, special, quant_only;
    int boundary; /* h of boundary values (boundary_h) instead of random ones */
    float limit, eps, alpha, up_offset;
    int32_t counts[8];
    const int32_t *many_counts; /* the counts when E > 8 */
} qcfg;

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
static void run_quant_case(qcfg c)
{
    const int64_t E = c.E, Tn = c.T, H = c.H, Gn = H / c.G;
    const int u8 = c.L.ue8m0 && c.L.layout != MOEFUSE_SCALE_PACKED_UE8M0;
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
        tb_fill_unif(rs.d, 0.05, 2);
        tb_upload(rs.d);
    }
    if (c.es_kind) {
        es = pair1("expert_scale", c.es_kind == 1 ? MOEFUSE_F32 : MOEFUSE_BF16, E, 1);
        tb_fill_unif(es.d, 0.25, 4);
        tb_upload(es.d);
    }
    if (E) {
        cn = pair1("counts", MOEFUSE_I32, E, 1);
        for (int64_t e = 0; e < E; e++) tb_set(cn.d, e, 0, 0, count_of(&c, e));
        tb_upload(cn.d);
    }
    pair q = E ? pair3("q", c.qdt, E, Tn, H, c.rp ? 3 : 0, 0) : pair2("q", c.qdt, Tn, H, c.rp ? 3 : 0, 0);
    pair sc = pair_of(h_new_scales("scales", c.L.layout, u8, E, Tn, Gn, c.rp ? 1 : 0));
    moefuse_act_quant_options o = {0};
    o.act.activation = c.act;
    o.act.order = c.order;
    o.act.limit = c.limit;
    o.act.intermediate = c.rnd;
    o.act.alpha = c.alpha;
    o.act.up_offset = c.up_offset;
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

/* ------------------------------------------------------- float outputs */

/* act_mul: bit-equal; a NaN from two NaN operands may have either sign. */
/* for failure messages only */
static const char *act_at(const char *what, int64_t t, int64_t c, double g, double u)
{
    return h_fmt("%s [%lld, %lld] g=%a u=%a", what, (long long)t, (long long)c, g, u);
}

static void cmp_act_value(pair x, pair out, int64_t t, int64_t c, int64_t H, const or_act_opt *o,
                          const char *what)
{
    const moefuse_dtype dt = out.d->t.dtype;
    seen.values++;
    if (memcmp(tb_el(out.d, t, c, 0), tb_el(out.c, t, c, 0), moefuse_dtype_size(dt)) == 0)
        return;
    double vd = tb_get(out.d, t, c, 0), vc = tb_get(out.c, t, c, 0), g, u;
    gate_up(x.d, 0, t, c, H, o->order, &g, &u);
    HCHECK((isnan(vc) && isnan(vd) && nan_from_two_nans(g, u, o)) || !exact_division(),
           "%s: %a on cpu, %a on %s: must be bit-equal",
           act_at(what, t, c, g, u), vc, vd, h_backend());
    seen.nan_either++;
}

typedef struct {
    moefuse_dtype dt;
    int64_t T, H;
    int act, order, rnd, use_rs, rp, special;
    float limit, alpha, up_offset;
} mcfg;

static void run_act_mul_case(mcfg c)
{
    pair x = pair2("x", c.dt, c.T, 2 * c.H, c.rp, 1);
    if (c.special == 2)
        fill_every_bf16_gate(x.d, c.H, c.order);
    else
        fill_act(x.d, c.special);
    tb_upload(x.d);
    pair rs = {NULL, NULL};
    if (c.use_rs) {
        rs = pair1("row_scale", MOEFUSE_F32, c.T, 1);
        tb_fill_unif(rs.d, 0.1, 3);
        tb_upload(rs.d);
    }
    pair out = pair2("out", c.dt, c.T, c.H, c.rp ? 3 : 0, 0);
    moefuse_act_options o = {.activation = c.act, .order = c.order, .limit = c.limit,
                             .intermediate = c.rnd, .alpha = c.alpha, .up_offset = c.up_offset};
    const char *what = h_fmt("act_mul[dt=%s T=%lld H=%lld act=%d alpha=%g up_offset=%g order=%d round=%d "
                             "limit=%g rs=%d special=%d]",
                             moefuse_dtype_name(c.dt), (long long)c.T, (long long)c.H, c.act,
                             (double)c.alpha, (double)c.up_offset, c.order, c.rnd, (double)c.limit,
                             c.use_rs, c.special);
    BOTH(moefuse_act_mul(g_ctx, T(x.d), T(rs.d), T(out.d), &o),
         moefuse_act_mul(g_ref, T(x.c), T(rs.c), T(out.c), &o), what);
    or_act_opt ao = {c.act, c.order, c.limit, c.rnd, c.alpha, c.up_offset};
    unsigned char *j = judged_new(out);
    for (int64_t t = 0; t < c.T; t++)
        for (int64_t i = 0; i < c.H; i++) {
            judge(j, out.d, tb_el(out.d, t, i, 0), moefuse_dtype_size(c.dt));
            cmp_act_value(x, out, t, i, c.H, &ao, what);
        }
    same_elsewhere(out, j, what);
    tb_free_all();
}

/* --------------------------------------------------------------- router */

static double logit(int mode, int64_t m, int64_t i, int64_t E)
{
    switch (mode) {
    case 1:
        return (double)((i * 7 + m) % (E / 2 + 1)) * 0.5; /* ties in pairs */
    case 2: {                                             /* NaN, +-Inf, ties sprinkled in */
        int64_t r = h_randint(0, 39);
        if (r == 0) return NAN;
        if (r == 1) return INFINITY;
        if (r == 2) return -INFINITY;
        if (r < 6) return 1.0;
        return h_unif(-8, 8);
    }
    case 3:
        return i == 1 ? NAN : -INFINITY; /* every number -Inf */
    case 4: /* one large logit, the rest 80-120 below: exps near or under the subnormals */
        return i == m % E ? 0.0 : h_unif(-120, -80);
    case 5: /* neighbours an ulp or two apart (in f32): quotients that round together */
        return 1.0 + (double)h_randint(0, 12) * 0x1p-23;
    default:
        return h_unif(-8, 8);
    }
}

/* ids and weights: every byte equal (the library's exp, the sum in index order everywhere). */
static void run_topk_case_rp(moefuse_dtype dt, int64_t M, int64_t E, int64_t k, int renorm,
                             int mode, int64_t rp)
{
    pair lg = pair2("logits", dt, M, E, rp, 1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < E; i++) tb_set(lg.d, m, i, 0, logit(mode, m, i, E));
    tb_upload(lg.d);
    pair ids = pair2("ids", MOEFUSE_I32, M, k, 2, 0), w = pair2("weights", MOEFUSE_F32, M, k, 1, 0);
    const char *what = h_fmt("topk_softmax[logits=%s M=%lld E=%lld k=%lld renormalize=%d mode=%d]",
                             moefuse_dtype_name(dt), (long long)M, (long long)E, (long long)k, renorm, mode);
    BOTH(moefuse_topk_softmax(g_ctx, T(lg.d), renorm, T(ids.d), T(w.d)),
         moefuse_topk_softmax(g_ref, T(lg.c), renorm, T(ids.c), T(w.c)), what);
    same_elsewhere(ids, judged_new(ids), what);
    same_elsewhere(w, judged_new(w), what);
    tb_free_all();
}

/* Rows padded by one element: unaligned rows, read element by element. */
static void run_topk_case(moefuse_dtype dt, int64_t M, int64_t E, int64_t k, int renorm, int mode)
{
    run_topk_case_rp(dt, M, E, k, renorm, mode, 1);
}

/* ------------------------------------------------------------------ MoE */

typedef struct {
    moefuse_dtype dt, odt, b1dt;
    int64_t M, K, I, E, k, Eg; /* Eg: expert_map length (0: no map) */
    int bias, act, order, invalid;
    float limit, alpha, up_offset;
} ecfg;

static const char *edesc(const ecfg *c)
{
    return h_fmt("moe[dt=%s out=%s b1=%s M=%lld K=%lld I=%lld E=%lld k=%lld Eg=%lld bias=%d act=%d order=%d "
                 "limit=%g alpha=%g up_offset=%g invalid=%d]",
                 moefuse_dtype_name(c->dt), moefuse_dtype_name(c->odt), moefuse_dtype_name(c->b1dt),
                 (long long)c->M, (long long)c->K, (long long)c->I, (long long)c->E, (long long)c->k,
                 (long long)c->Eg, c->bias, c->act, c->order, (double)c->limit, (double)c->alpha,
                 (double)c->up_offset, c->invalid);
}

/* decoded values of a 3-D (or lower, unused dims 1) tensor */
static double *values(tbuf *tb, int64_t n0, int64_t n1, int64_t n2)
{
    double *v = doubles((size_t)(n0 * n1 * n2));
    for (int64_t a = 0; a < n0; a++)
        for (int64_t b = 0; b < n1; b++)
            for (int64_t c = 0; c < n2; c++) v[(a * n1 + b) * n2 + c] = tb_get(tb, a, b, c);
    return v;
}

/*
 * A GEMM output [n0, n1, n2] on both sides: each against the oracle, and the
 * two against each other, within the bound; rows of invalid slots (valid[]
 * < 0, when rows_are_slots) exactly 0 on both; other bytes equal.
 */
static void cmp_gemm(const ecfg *c, pair out, const double *ref, int64_t n0, int64_t n1, int64_t n2,
                     const int64_t *valid, int rows_are_slots, double bound, double floor,
                     const char *name)
{
    size_t n = (size_t)(n0 * n1 * n2);
    double *vd = values(out.d, n0, n1, n2), *vc = values(out.c, n0, n1, n2);
    const char *what = h_fmt("%s %s", name, edesc(c));
    for (size_t i = 0; i < n; i++) {
        HCHECK(isfinite(vd[i]) && isfinite(vc[i]), "%s: element %zu is %a on cpu, %a on %s", what, i, vc[i],
               vd[i], h_backend());
        if (rows_are_slots && valid[i / (size_t)n2] < 0)
            HCHECK(vd[i] == 0.0 && vc[i] == 0.0, "%s: invalid slot %zu: %a on cpu, %a on %s, want 0", what,
                   i / (size_t)n2, vc[i], vd[i], h_backend());
    }
    double e_cpu = h_rel_err_floor(vc, ref, n, floor), e_dev = h_rel_err_floor(vd, ref, n, floor),
           e_both = h_rel_err_floor(vd, vc, n, 2 * floor);
    if (e_both > seen.gemm_rel) seen.gemm_rel = e_both;
    HCHECK(e_cpu <= bound, "%s: cpu vs oracle: relative error %.3g > %.3g", what, e_cpu, bound);
    HCHECK(e_dev <= bound, "%s: %s vs oracle: relative error %.3g > %.3g", what, h_backend(), e_dev, bound);
    HCHECK(e_both <= bound, "%s: %s vs cpu: relative error %.3g > %.3g", what, h_backend(), e_both, bound);
    free(vd);
    free(vc);
    unsigned char *j = judged_new(out);
    for (size_t i = 0; i < out.d->total; i++) j[i] = out.d->logical[i];
    same_elsewhere(out, j, what);
}

/* A token without a valid slot gets an output row of exact zeros, on both sides. */
static void check_empty_tokens(const ecfg *c, pair out, const int64_t *valid)
{
    for (int64_t m = 0; m < c->M; m++) {
        int any = 0;
        for (int64_t j = 0; j < c->k; j++) any |= valid[m * c->k + j] >= 0;
        for (int64_t r = 0; r < c->K && !any; r++)
            HCHECK(tb_get(out.c, m, r, 0) == 0.0 && tb_get(out.d, m, r, 0) == 0.0,
                   "%s: token %lld has no valid slot, out[%lld, %lld] is %a on cpu, %a on %s", edesc(c),
                   (long long)m, (long long)m, (long long)r, tb_get(out.c, m, r, 0), tb_get(out.d, m, r, 0),
                   h_backend());
    }
}

/* ids mostly valid; with c->invalid also -1 and >= Eg, and a token with no valid slot */
static void fill_routing(const ecfg *c, int64_t Eg, pair ids, pair wts, pair map)
{
    for (int64_t m = 0; m < c->M; m++)
        for (int64_t j = 0; j < c->k; j++) {
            int64_t id = h_randint(0, Eg - 1);
            if (c->invalid) id = h_maybe_invalid_id(id, Eg, m, j);
            tb_set(ids.d, m, j, 0, (double)id);
            tb_set(wts.d, m, j, 0, h_unif(0.05, 1));
        }
    tb_upload(ids.d);
    tb_upload(wts.d);
    if (!map.d) return;
    for (int64_t g = 0; g < Eg; g++)
        tb_set(map.d, g, 0, 0, (double)h_map_entry(g, Eg, c->E));
    tb_upload(map.d);
}

static void run_moe_case(ecfg c)
{
    const int64_t M = c.M, K = c.K, I = c.I, E = c.E, k = c.k, Eg = c.Eg ? c.Eg : E;
    pair x = pair2("x", c.dt, M, K, 1, 1), w1 = pair3("w1", c.dt, E, 2 * I, K, 0, 1);
    pair w2 = pair3("w2", c.dt, E, K, I, 1, 1), b1 = {NULL, NULL}, b2 = {NULL, NULL};
    tb_fill_unif(x.d, -1, 1);
    tb_fill_unif(w1.d, -2 / sqrt((double)K), 2 / sqrt((double)K));
    tb_fill_unif(w2.d, -2 / sqrt((double)I), 2 / sqrt((double)I));
    tb_upload(x.d);
    tb_upload(w1.d);
    tb_upload(w2.d);
    if (c.bias) {
        b1 = pair2("b1", c.b1dt, E, 2 * I, 1, 1);
        b2 = pair2("b2", c.dt, E, K, 0, 1);
        tb_fill_unif(b1.d, -0.5, 0.5);
        tb_fill_unif(b2.d, -0.5, 0.5);
        tb_upload(b1.d);
        tb_upload(b2.d);
    }
    pair ids = pair2("topk_ids", MOEFUSE_I32, M, k, 1, 1), wts = pair2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    pair map = c.Eg ? pair1("expert_map", MOEFUSE_I32, Eg, 1) : (pair){NULL, NULL};
    fill_routing(&c, Eg, ids, wts, map);
    moefuse_routing rd = {.topk_ids = ids.d->t, .topk_weights = wts.d->t,
                          .expert_map = map.d ? map.d->t : (moefuse_tensor){0}};
    moefuse_routing rc = {.topk_ids = ids.c->t, .topk_weights = wts.c->t,
                          .expert_map = map.c ? map.c->t : (moefuse_tensor){0}};
    moefuse_moe_options o = {.activation = c.act, .order = c.order, .limit = c.limit,
                             .alpha = c.alpha, .up_offset = c.up_offset};

    /* the oracle's h, from the inputs */
    double *xv = values(x.d, M, K, 1), *w1v = values(w1.d, E, 2 * I, K), *w2v = values(w2.d, E, K, I);
    double *b1v = c.bias ? values(b1.d, E, 2 * I, 1) : NULL, *b2v = c.bias ? values(b2.d, E, K, 1) : NULL;
    double *wv = values(wts.d, M, k, 1), *href = doubles((size_t)(M * k * I));
    int32_t *idv = malloc(sizeof(int32_t) * (size_t)(M * k + 1)), *mapv = NULL;
    int64_t *valid = malloc(sizeof(int64_t) * (size_t)(M * k + 1));
    for (int64_t i = 0; i < M * k; i++) idv[i] = (int32_t)tb_get(ids.d, i / k, i % k, 0);
    if (map.d) {
        mapv = malloc(sizeof(int32_t) * (size_t)Eg);
        for (int64_t g = 0; g < Eg; g++) mapv[g] = (int32_t)tb_get(map.d, g, 0, 0);
    }
    or_act_opt ao = {c.act, c.order, c.limit, 0, c.alpha, c.up_offset};
    or_moe_gate(M, K, I, E, k, xv, w1v, b1v, idv, mapv, Eg, &ao, href, valid);

    pair h = pair3("h", c.dt, M, k, I, 1, 0);
    BOTH(moefuse_moe_gate(g_ctx, T(x.d), T(w1.d), T(b1.d), &rd, T(h.d), &o),
         moefuse_moe_gate(g_ref, T(x.c), T(w1.c), T(b1.c), &rc, T(h.c), &o), edesc(&c));
    cmp_gemm(&c, h, href, M, k, I, valid, 1, h_gemm_bound(c.dt), h_gemm_floor(c.dt), "moe_gate h");

    /* final from the same h on both sides (the CPU's), so only the final kernel differs */
    memcpy(h.d->full, h.c->full, h.d->total);
    tb_upload(h.d);
    double *hv = values(h.c, M, k, I), *yref = doubles((size_t)(M * k * K)), *oref = doubles((size_t)(M * K));
    or_moe_final(M, K, I, E, k, hv, w2v, b2v, valid, wv, yref, oref);
    pair out = pair2("out", c.odt, M, K, 2, 0), y = pair3("y", c.odt, M, k, K, 0, 0);
    BOTH(moefuse_moe_final(g_ctx, T(h.d), T(w2.d), T(b2.d), &rd, T(out.d), &o),
         moefuse_moe_final(g_ref, T(h.c), T(w2.c), T(b2.c), &rc, T(out.c), &o), edesc(&c));
    cmp_gemm(&c, out, oref, M, K, 1, valid, 0, h_gemm_bound(c.odt), h_gemm_floor(c.odt), "moe_final out");
    check_empty_tokens(&c, out, valid);
    BOTH(moefuse_moe_final(g_ctx, T(h.d), T(w2.d), T(b2.d), &rd, T(y.d), &o),
         moefuse_moe_final(g_ref, T(h.c), T(w2.c), T(b2.c), &rc, T(y.c), &o), edesc(&c));
    cmp_gemm(&c, y, yref, M, k, K, valid, 1, h_gemm_bound(c.odt), h_gemm_floor(c.odt),
             "moe_final y (un-reduced)");

    /* whole layer from the oracle's h: h is rounded to x's dtype on the way (test_moe's bound) */
    or_moe_final(M, K, I, E, k, href, w2v, b2v, valid, wv, yref, oref);
    pair fwd = pair2("forward_out", c.odt, M, K, 0, 0);
    BOTH(moefuse_moe_forward(g_ctx, T(x.d), T(w1.d), T(w2.d), T(b1.d), T(b2.d), &rd, T(fwd.d), &o),
         moefuse_moe_forward(g_ref, T(x.c), T(w1.c), T(w2.c), T(b1.c), T(b2.c), &rc, T(fwd.c), &o), edesc(&c));
    cmp_gemm(&c, fwd, oref, M, K, 1, valid, 0, fmax(h_gemm_bound(c.odt), h_gemm_bound(c.dt)),
             fmax(h_gemm_floor(c.odt), h_gemm_floor(c.dt)), "moe_forward out");

    free(xv), free(w1v), free(w2v), free(b1v), free(b2v), free(wv), free(href), free(idv), free(mapv);
    free(valid), free(hv), free(yref), free(oref);
    tb_free_all();
}

/* ---------------------------------------------------------------- tests */

static qcfg qbase(int64_t E, int64_t T, int64_t H, int64_t G)
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

START_TEST(t_act_mul)
{
    for (int d = 0; d < 3; d++)
        for (int a = 0; a < 3; a++)
            for (int v = 0; v < 3; v++) {
                mcfg c = {FLOATS[d], 7, v == 2 ? 33 : 70, a, v & 1, v == 1, v != 0, (a + v) & 1, v == 2, 0.0f, 0.0f, 0.0f};
                c.limit = v == 1 ? 2.5f : 0.0f;
                run_act_mul_case(c);
            }
    const int64_t Ts[3] = {0, 1, 129}, Hs[3] = {5, 1, 96};
    for (int i = 0; i < 3; i++) {
        mcfg c = {FLOATS[i], Ts[i], Hs[i], i, 0, 0, 0, 1, 1, 0.0f, 0.0f, 0.0f};
        run_act_mul_case(c);
    }
    for (int r = 0; r < 6; r++) {
        mcfg c = {FLOATS[h_randint(0, 2)],
                  h_randint(1, 40),
                  h_randint(1, 300),
                  (int)h_randint(0, 2),
                  (int)h_randint(0, 1),
                  (int)h_randint(0, 1),
                  (int)h_randint(0, 1),
                  (int)h_randint(0, 1),
                  1,
                  0.0f,
                  0.0f,
                  0.0f};
        c.limit = h_randint(0, 2) == 0 ? (float)h_unif(0.5, 6) : 0.0f;
        c.act = (int)h_randint(0, 3);
        c.order = (int)h_randint(0, 2);
        c.up_offset = h_randint(0, 2) == 0 ? (float)h_unif(-2, 2) : 0.0f;
        run_act_mul_case(c);
    }
    finish("act_mul");
}
END_TEST

/*
 * Every bf16 gate (65536 per call) through act_mul, act_quant and the masked call, each
 * activation and order, without options (CUDA: the table kernels, G = 32, 64 and 128) and
 * with them (the computed path).
 */
START_TEST(t_every_bf16_gate)
{
    for (int a = 0; a < 3; a++)
        for (int order = 0; order < 2; order++) {
            mcfg m = {MOEFUSE_BF16, 64, 1024, a, order, MOEFUSE_ROUND_NONE, 0, 0, 2, 0.0f, 0.0f, 0.0f};
            run_act_mul_case(m);
            qcfg c = qbase(0, 64, 1024, (int64_t[]){128, 64, 32}[a]);
            c.xdt = MOEFUSE_BF16;
            c.act = a;
            c.order = order;
            c.special = 2;
            c.L = LAYS[(a + 3 * order) % 5];
            run_quant_case(c);
        }
    mcfg m = {MOEFUSE_BF16, 64, 1024, MOEFUSE_ACT_SILU, 0, MOEFUSE_ROUND_BF16, 1, 0, 2, 3.0f, 0.0f, 0.0f};
    run_act_mul_case(m);
    qcfg c = qbase(4, 16, 1024, 128);
    for (int e = 0; e < 4; e++) c.counts[e] = 16;
    c.xdt = MOEFUSE_BF16;
    c.special = 2;
    run_quant_case(c);
    c.use_rs = 1;
    c.limit = 2.5f;
    run_quant_case(c);
    finish("every bf16 gate");
}
END_TEST

START_TEST(t_topk)
{
    for (int d = 0; d < 3; d++)
        for (int rn = 0; rn < 2; rn++) {
            run_topk_case(FLOATS[d], 17, 8, 2, rn, 0);
            run_topk_case(FLOATS[d], 5, 64, 8, rn, 0);
            run_topk_case(FLOATS[d], 1, 5, 5, rn, 0);
            run_topk_case(FLOATS[d], 0, 4, 1, rn, 0);
            run_topk_case(FLOATS[d], 3, 1, 1, rn, 0);
            run_topk_case(FLOATS[d], 6, 9, 4, rn, 1);
            run_topk_case(FLOATS[d], 30, 33, 6, rn, 2);
            run_topk_case(FLOATS[d], 4, 4, 4, rn, 3);
            /* router sizes (E <= 256, k <= 32: a block of rows, a warp per row), dense rows
             * read as vectors; past them (E > 256 or k > 32) the general kernel */
            run_topk_case_rp(FLOATS[d], 41, 256, 8, rn, 0, 0);
            run_topk_case_rp(FLOATS[d], 19, 256, 8, rn, 1, 0);
            run_topk_case_rp(FLOATS[d], 23, 256, 8, rn, 2, 0);
            run_topk_case_rp(FLOATS[d], 9, 256, 32, rn, 2, 0);
            run_topk_case_rp(FLOATS[d], 3, 256, 8, rn, 3, 0);
            run_topk_case_rp(FLOATS[d], 10, 128, 8, rn, 0, 0);
            run_topk_case(FLOATS[d], 13, 251, 7, rn, 2);
            run_topk_case_rp(FLOATS[d], 6, 300, 8, rn, 2, 0);
            run_topk_case_rp(FLOATS[d], 4, 64, 40, rn, 0, 0);
            run_topk_case_rp(FLOATS[d], 12, 256, 8, rn, 4, 0);
            run_topk_case_rp(FLOATS[d], 12, 256, 8, rn, 5, 0);
            run_topk_case_rp(FLOATS[d], 12, 40, 6, rn, 5, 0);
        }
    /* more rows than one wave of blocks holds (the blocks go round again), and row counts
     * past the small-M launch */
    run_topk_case_rp(MOEFUSE_BF16, 9001, 256, 8, 1, 0, 0);
    run_topk_case_rp(MOEFUSE_F32, 700, 200, 8, 0, 2, 0);
    run_topk_case(MOEFUSE_F16, 300, 256, 8, 1, 1);
    for (int r = 0; r < 6; r++) {
        int64_t E = h_randint(1, r < 3 ? 70 : 300);
        run_topk_case(FLOATS[h_randint(0, 2)], h_randint(1, 50), E, h_randint(1, E < 8 ? E : 8),
                      (int)h_randint(0, 1), (int)h_randint(0, 5));
    }
    finish("topk_softmax");
}
END_TEST

static ecfg ebase(moefuse_dtype dt)
{
    ecfg c;
    memset(&c, 0, sizeof c);
    c.dt = c.odt = c.b1dt = dt;
    c.M = 5, c.K = 37, c.I = 45, c.E = 4, c.k = 2;
    return c;
}

/* 0 and 1 tokens, odd sizes, empty experts, invalid ids, unmapped experts, biases, dtypes. */
START_TEST(t_moe_edges)
{
    for (int d = 0; d < 3; d++) {
        ecfg c = ebase(FLOATS[d]);
        c.M = 0;
        run_moe_case(c);
        c.M = 1, c.E = 8, c.k = 2; /* six experts get no token */
        c.bias = 1;
        c.b1dt = MOEFUSE_F32;
        run_moe_case(c);
        c = ebase(FLOATS[d]);
        c.M = 9, c.k = 3, c.invalid = 1, c.Eg = 10, c.bias = d != 1;
        c.act = d, c.order = 1;
        run_moe_case(c);
        c.Eg = 0;
        c.limit = 0.3f;
        run_moe_case(c);
        c = ebase(FLOATS[d]);
        c.K = 1, c.I = 1, c.E = 1, c.k = 1, c.M = 3, c.act = 2 - d;
        run_moe_case(c);
    }
    ecfg c = ebase(MOEFUSE_BF16);
    c.odt = MOEFUSE_F32, c.b1dt = MOEFUSE_F16, c.bias = 1, c.invalid = 1;
    run_moe_case(c);
    finish("moe edges");
}
END_TEST

START_TEST(t_moe_random)
{
    for (int r = 0; r < 6; r++) {
        ecfg c = ebase(FLOATS[r % 3]);
        c.M = h_randint(1, 40);
        c.E = h_randint(1, 8);
        c.k = h_randint(1, c.E < 4 ? c.E : 4);
        c.K = h_randint(1, 200);
        c.I = h_randint(1, 160);
        c.bias = (int)h_randint(0, 1);
        c.b1dt = FLOATS[h_randint(0, 2)];
        c.act = (int)h_randint(0, 3);
        c.order = (int)h_randint(0, 2);
        c.up_offset = h_randint(0, 1) ? (float)h_unif(-1, 1) : 0.0f;
        c.invalid = (int)h_randint(0, 1);
        c.Eg = h_randint(0, 1) ? c.E + 3 : 0;
        c.limit = h_randint(0, 2) == 0 ? (float)h_unif(0.5, 4) : 0.0f;
        c.odt = r >= 3 ? FLOATS[(r + 1) % 3] : c.dt;
        run_moe_case(c);
    }
    finish("moe random");
}
END_TEST

/*
 * gpt-oss's activation (silu_alpha, alpha 1.702, up offset 1, limit 7, interleaved): act_mul,
 * act_quant (2-D and masked) on random, edge and every-bf16-gate inputs, and a MoE layer with
 * biases; then other alphas, offsets and orders.
 */
START_TEST(t_gpt_oss)
{
    for (int v = 0; v < 6; v++) {
        const int order = v < 3 ? MOEFUSE_GATE_INTERLEAVED : v - 3;
        const float alpha = v == 1 ? 1.702f : v == 4 ? 0.6f : 0.0f;
        const float offset = v == 5 ? -0.25f : v == 2 ? 0.0f : 1.0f;
        mcfg m = {FLOATS[v % 3], 9, v == 2 ? 61 : 96, MOEFUSE_ACT_SILU_ALPHA, order,
                  v == 3 ? MOEFUSE_ROUND_BF16 : 0, v & 1, v & 1, 1, 7.0f, alpha, offset};
        run_act_mul_case(m);
        qcfg c = qbase(v & 1 ? 3 : 0, 7, 256, (int64_t[]){32, 64, 128}[v % 3]);
        c.counts[0] = 7, c.counts[1] = 0, c.counts[2] = 4;
        c.xdt = FLOATS[(v + 1) % 3];
        c.L = LAYS[v % 5];
        c.qdt = !c.L.ue8m0 && v == 2 ? MOEFUSE_I8 : MOEFUSE_F8_E4M3;
        c.act = MOEFUSE_ACT_SILU_ALPHA, c.alpha = alpha, c.up_offset = offset;
        c.order = order, c.limit = 7.0f, c.special = 1;
        c.use_rs = v & 1, c.es_kind = v % 3, c.zero_tail = v & 1;
        run_quant_case(c);
        /* every bf16 gate: the computed path (silu_alpha has no table) over all of them */
        mcfg every = {MOEFUSE_BF16, 64, 1024, MOEFUSE_ACT_SILU_ALPHA, order, 0, 0, 0, 2,
                      v & 1 ? 7.0f : 0.0f, alpha, offset};
        run_act_mul_case(every);
        ecfg e = ebase(FLOATS[v % 3]);
        e.M = 7, e.K = 64, e.I = 40, e.E = 5, e.k = 2, e.bias = 1, e.invalid = v & 1;
        e.act = MOEFUSE_ACT_SILU_ALPHA, e.alpha = alpha, e.up_offset = offset;
        e.order = order, e.limit = 7.0f;
        run_moe_case(e);
    }
    finish("gpt-oss activation");
}
END_TEST

static void setup(void)
{
    h_setup_cross();
    memset(&seen, 0, sizeof seen);
}

int main(void)
{
    Suite *s = suite_create("cross_backend");
    TCase *tc = tcase_create("cross_backend");
    tcase_add_checked_fixture(tc, setup, h_teardown);
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, t_act_quant_shapes);
    tcase_add_test(tc, t_act_quant_options);
    tcase_add_test(tc, t_act_quant_random);
    tcase_add_test(tc, t_boundaries);
    tcase_add_test(tc, t_whole_items);
    tcase_add_test(tc, t_masked);
    tcase_add_test(tc, t_quant_dequant);
    tcase_add_test(tc, t_dequant_handmade);
    tcase_add_test(tc, t_act_mul);
    tcase_add_test(tc, t_every_bf16_gate);
    tcase_add_test(tc, t_topk);
    tcase_add_test(tc, t_moe_edges);
    tcase_add_test(tc, t_moe_random);
    tcase_add_test(tc, t_gpt_oss);
    suite_add_tcase(s, tc);
    return h_run(s);
}
