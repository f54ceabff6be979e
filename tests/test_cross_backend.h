/* test_cross_backend's parts (test_cross_backend.c says what must agree): each tensor as a
 * pair of twins, the call on both sides, and what each file gives the others. */
#ifndef MOEFUSE_TEST_CROSS_BACKEND_H
#define MOEFUSE_TEST_CROSS_BACKEND_H

#include "harness.h"

/* One tensor on the backend under test (d) and its twin on the CPU (c). */
typedef struct {
    tbuf *d, *c;
} pair;

/* A call's status and message, taken before the canary check's reads clear the message. */
typedef struct {
    moefuse_status st;
    char msg[512];
} outcome;

/* The same call on both sides: both succeed; canaries intact (nothing written if one fails). */
#define BOTH(on_dev, on_cpu, what) both(outcome_of((on_dev), g_ctx), outcome_of((on_cpu), g_ref), (what))
/* ------------------------------------------------------ what a test saw */

/* Counted per test: reset by the fixture (tests share a process under CK_FORK=no). */
extern struct seen {
    long long codes, scales, values; /* codes, f32 scales, act_mul values compared */
    long long nan_either;            /* NaN from two NaN operands: sign not compared */
    double gemm_rel;                 /* largest GEMM relative error, device vs cpu */
} seen;

/* ------------------------------------------------------------- helpers */

/* (FLOATS, lay and LAYS: harness.h) */
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

typedef struct {
    moefuse_dtype dt;
    int64_t T, H;
    int act, order, rnd, use_rs, rp, special;
    float limit, alpha, up_offset;
} mcfg;

/* test_cross_backend_common.c */
pair pair_of(tbuf *d);
pair pair1(const char *name, moefuse_dtype dt, int64_t a, int in);
pair pair2(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t rp, int in);
pair pair3(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t c, int64_t rp, int in);
outcome outcome_of(moefuse_status st, const moefuse_context *ctx);
void both(outcome dev, outcome cpu, const char *what);
unsigned char *judged_new(pair p);
void judge(unsigned char *judged, const tbuf *tb, const void *el, size_t n);
void same_elsewhere(pair p, unsigned char *judged, const char *what);
void finish(const char *test);
double *doubles(size_t n);
int exact_division(void);
void gate_up(tbuf *x, int64_t e, int64_t t, int64_t c, int64_t H, int order, double *g, double *u);
int nan_from_two_nans(double g, double u, const or_act_opt *o);
double act_input(int special);
void fill_every_bf16_gate(tbuf *x, int64_t H, int order);
void fill_act(tbuf *x, int special);

/* test_cross_backend_quant.c */
void run_quant_case(qcfg c);
qcfg qbase(int64_t E, int64_t T, int64_t H, int64_t G);

/* test_cross_backend_rows.c */
void run_act_mul_case(mcfg c);

void cross_backend_quant_tests(TCase *tc); /* test_cross_backend_quant.c */
void cross_backend_rows_tests(TCase *tc); /* test_cross_backend_rows.c */
void cross_backend_moe_tests(TCase *tc); /* test_cross_backend_moe.c */

#endif
