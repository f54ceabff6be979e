/* test_cross_backend: pairs of twins, the call on both sides, the counts a test prints, and
 * the activation inputs the row-operation tests share. */
#include "test_cross_backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

pair pair_of(tbuf *d)
{
    pair p = {d, tb_twin(d, g_ref)};
    return p;
}

pair pair1(const char *name, moefuse_dtype dt, int64_t a, int in)
{
    return pair_of(tb_new1(name, dt, a, in));
}
pair pair2(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t rp, int in)
{
    return pair_of(tb_new2(name, dt, a, b, rp, in));
}
pair pair3(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t c, int64_t rp, int in)
{
    return pair_of(tb_new3(name, dt, a, b, c, rp, in));
}

outcome outcome_of(moefuse_status st, const moefuse_context *ctx)
{
    outcome o = {st, ""};
    snprintf(o.msg, sizeof o.msg, "%s", moefuse_last_error(ctx));
    return o;
}

void both(outcome dev, outcome cpu, const char *what)
{
    h_check_all(dev.st != MOEFUSE_OK || cpu.st != MOEFUSE_OK);
    HCHECK(cpu.st == MOEFUSE_OK, "%s on cpu: %s (%s)", what, moefuse_status_name(cpu.st), cpu.msg);
    HCHECK(dev.st == MOEFUSE_OK, "%s on %s: %s (%s)", what, h_backend(), moefuse_status_name(dev.st), dev.msg);
}

/* Bytes of an output compared by a tolerance; all others must be equal. */
unsigned char *judged_new(pair p) { return calloc(p.d->total, 1); }

void judge(unsigned char *judged, const tbuf *tb, const void *el, size_t n)
{
    memset(judged + ((const unsigned char *)el - tb->full), 1, n);
}

/* Row padding, untouched rows, poison and canaries: the same bytes on both sides. */
void same_elsewhere(pair p, unsigned char *judged, const char *what)
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

struct seen seen;

void finish(const char *test)
{
    fprintf(stderr,
            "%s on %s: %lld codes, %lld f32 scales, %lld act_mul values bit-equal (%lld NaN of two NaN "
            "operands, sign free); GEMM rel. error <= %.3g\n",
            test, h_backend(), seen.codes, seen.scales, seen.values, seen.nan_either, seen.gemm_rel);
}

double *doubles(size_t n) { return malloc(sizeof(double) * (n ? n : 1)); }

/*
 * Does the backend under test divide correctly rounded? NUMERICS.md exempts an OpenCL device
 * that does not (its name says so) from the bit-equality of the row operations; none of the
 * devices this project tests on is one, and the test says so when it meets one.
 */
int exact_division(void)
{
    static int warned;
    const int exact = strstr(moefuse_device_name(g_ctx), "division not correctly rounded") == NULL;
    if (!exact && !warned++)
        fprintf(stderr, "NOTE: %s does not divide correctly rounded: row-op values not compared\n",
                moefuse_device_name(g_ctx));
    return exact;
}

/* g and u of output channel c (x is [T, 2H], or [E, T, 2H] with e >= 0) */
void gate_up(tbuf *x, int64_t e, int64_t t, int64_t c, int64_t H, int order, double *g, double *u)
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
int nan_from_two_nans(double g, double u, const or_act_opt *o)
{
    or_act_opt plain = *o;
    plain.round_bf16 = 0;
    plain.up_offset = 0; /* act(g) alone: the offset keeps a NaN u NaN, and adds no other */
    double p, lo, hi;
    or_act_elem(g, 1.0, 1.0, 1.0, &plain, &p, &lo, &hi); /* act(g), after the clamp */
    return isnan(p) && isnan(u);
}

/* Inputs for the activation paths: uniform, with NaN, +-Inf and zeros sprinkled in. */
double act_input(int special)
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
void fill_every_bf16_gate(tbuf *x, int64_t H, int order)
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

void fill_act(tbuf *x, int special)
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
