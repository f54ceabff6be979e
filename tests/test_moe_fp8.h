/* test_moe_fp8's parts (test_moe_fp8.c says what is held to what): a case, its operands,
 * the oracle and the comparisons, and what each file gives the others. */
#ifndef MOEFUSE_TEST_MOE_FP8_H
#define MOEFUSE_TEST_MOE_FP8_H

#include "harness.h"

#define BLK 128
/* NUMERICS.md: relative 2-norm error of out and of dequantized h, the exact backends' (a
 * Hopper path's h goes element by element: h_code_step and oracle_gate's hslack) */
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
/* NUMERICS.md: a Hopper path's final against the float64 final of its own h, past the output
 * dtype's bound (h_gemm_bound): its block sums, measured off by 2.4e-4 */
#define HOPPER_BLOCK_BOUND 1e-3
#define TIE_REL 1e-5
/* NUMERICS.md: a Hopper path's block sum within this much of the sum of its products' magnitudes */
#define HOPPER_SUM_REL 0x1p-12

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

/* a tensor and, on a backend other than the CPU, its twin on the CPU backend */
typedef struct pair {
    tbuf *d, *c;
} pair;

/* test_moe_fp8_oracle.c */
extern double f8val[256]; /* every f8 code's value (init_f8) */
void init_f8(void);
const char *desc(const cfg *c);
void fill_weight(tbuf *w, tbuf *ws, int64_t E, int64_t N, int64_t D, int nan_w);
void zero_logical(tbuf *tb);
void fill_x_row(const cfg *c, tbuf *x, tbuf *xs, int64_t e, int64_t t);
void oracle_x_row(const cfg *c, tbuf *x, tbuf *xs, int64_t e, int64_t t, uint8_t *q, double *s);
void oracle_gate(const cfg *c, const uint8_t *qa, const double *sa, tbuf *w1, tbuf *w1s, tbuf *b1,
                 int64_t e, uint8_t *hq, double *hs, double *hraw, double *hslack);
int h_tie_flip(uint8_t got, uint8_t want, double raw, double s);
/*
 * One e4m3 code step at the larger of two dequantized h values, on the coarser of their two
 * groups' scales (s_got, s_ref), with 1e-3 of it for the scales' own rounding. A Hopper path's
 * h may be that far from the oracle's, and by what its block sums' error moves h (oracle_gate's
 * hslack) (NUMERICS.md).
 */
double h_code_step(double got, double ref, double s_got, double s_ref);
void oracle_final(const cfg *c, const uint8_t *hq, const double *hs, tbuf *w2, tbuf *w2s, tbuf *b2,
                  int64_t e, double *y);
double rel_err_nan(const char *what, const cfg *c, const double *got, const double *ref, size_t n,
                   double floor);
int is_cpu(void);
int exact_backend(void);
void same_codes(const char *what, const cfg *c, tbuf *a, tbuf *b);
void same_bytes(const char *what, const cfg *c, tbuf *a, tbuf *b);
void same_values(const char *what, const cfg *c, tbuf *a, tbuf *b, int64_t n0, int64_t n1, int64_t n2);
void near_h(const cfg *c, tbuf *h, tbuf *hs, tbuf *rh, tbuf *rhs, int64_t n0, int64_t n1, int lead3);
double rel_between(tbuf *a, tbuf *b, int64_t n0, int64_t n1, int64_t n2);
void expect_ok(moefuse_status st, const char *what, moefuse_context *ctx);
pair mk(tbuf *d);

/* test_moe_fp8_routed.c */
moefuse_fp8_moe_options options_of(const cfg *c);
void run_routed(cfg c);
cfg base_cfg(void);

void moe_fp8_routed_tests(TCase *tc); /* test_moe_fp8_routed.c */
void moe_fp8_masked_tests(TCase *tc); /* test_moe_fp8_masked.c */

#endif
