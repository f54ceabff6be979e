/*
 * Independent float64 oracle for the moefuse test suite.
 *
 * Written from the format definitions and docs/NUMERICS.md only; it includes
 * nothing from src/. Everything is computed in double.
 *
 * Comparison rules used by the tests (see also compare helpers in harness.h):
 *  - quant from f32/f16/bf16 input: scales and codes bit-exact. The oracle
 *    divides in double and rounds to f32, which equals the correctly rounded
 *    f32 division the library is specified to do (double has > 2*24+2 bits).
 *  - paths with an activation: the oracle evaluates each element as a double
 *    INTERVAL [lo, hi]: every f32 operation of the documented formula
 *    is widened outward by its own rounding bound: 2^-24 relative for each
 *    + - * / (correctly rounded), 2^-23 (1 ulp) for the library's exp/erf/tanh. The result is thus what f32-vs-f64 differences can
 *    justify, taking the conditioning of the formula into account (gelu's
 *    1 + erf(z) cancels for negative z). With MOEFUSE_ROUND_BF16 the ends of
 *    the interval are rounded to bf16 (rounding is monotone).
 *    Scales: the library's f32 scale must lie in [f32(amax_lo/448),
 *    f32(amax_hi/448)] (typically within 1-3 ulp of the oracle's point
 *    value, exactly as far as f32 arithmetic can move it); with ue8m0 its exponent
 *    byte must be the UE8M0 exponent of some scale in that range (so it may
 *    be one apart only when s lies that close to a power-of-two boundary).
 *    Codes: the library's code must lie between the codes of
 *    f32(lo/s_lib) and f32(hi/s_lib) (the encoders are monotone), and be at
 *    most one code from the oracle's point value; a zero code carries the
 *    sign of the point value; NaN/Inf codes exact. No count tolerance.
 *  - act_mul: the output must lie between round_dtype(lo) and
 *    round_dtype(hi); for f32 output the allowed band is the union of that
 *    interval and the point value +- relative 2^-22.
 *  - GEMMs: ||out - ref|| / ||ref|| <= 1e-5 (f32 out), 8e-3 (bf16, NUMERICS.md),
 *    4e-3 (f16: one rounding of the result is 2^-11 ~ 4.9e-4 relative per
 *    element; f16 inputs are exact in the oracle, so 8x margin for f32
 *    accumulation and activation differences), and exact zeros for invalid
 *    slots.
 *  - topk: ids exact (logits generated without near-ties, except in the tie
 *    tests), weights within (E + 4) ulp relative (sequential f32 summation of
 *    E terms) and another k ulp after renormalization.
 */
#ifndef MOEFUSE_TEST_ORACLE_H
#define MOEFUSE_TEST_ORACLE_H

#include <stdint.h>
#include <stddef.h>

/* dtype codes mirror the public enum values but are independent ints here */
enum { OR_F32 = 0, OR_F16, OR_BF16, OR_F8, OR_I8, OR_I32, OR_U8 };

/* round a double to a format (RNE); IEEE formats overflow to Inf, f8
 * saturates to +-448; NaN stays NaN */
double or_round(int dt, double x);
/* encode a value already representable (or NaN/Inf) into bits */
uint32_t or_encode(int dt, double x); /* rounds first */
double or_decode(int dt, uint32_t bits);
/* f8 code from an f32 value v (NaN -> 0x7F/0xFF, Inf -> 0x7E/0xFE) */
uint8_t or_f8_code(double v);
int8_t or_i8_code(double v);
/* order of an f8 code on the number line (NaN codes -> large) */
int or_f8_ord(uint8_t c);
float or_f32(double x); /* round to f32 */
double or_ulp32(double x); /* ulp of an f32 value */
double or_next32(double x, int dir); /* next f32 up (dir>0) or down */
int or_ue8m0(float s); /* UE8M0 exponent (clamped 1..254) of an f32 scale */

/* activation options */
typedef struct {
    int act;   /* 0 silu, 1 gelu, 2 gelu_tanh, 3 silu_alpha */
    int order; /* 0 gate first, 1 up first, 2 interleaved (gate i at 2i, up i at 2i + 1) */
    double limit;
    int round_bf16;
    double alpha;     /* silu_alpha's; 0: the documented default, f32(1.702) */
    double up_offset; /* added to u after the clamp; 0: nothing added */
} or_act_opt;

/* Position of gate value i and up value i in a gated row of 2n values (x's channels, w1's
 * rows), by the order option (docs/NUMERICS.md "Gated activation"). */
int64_t or_gate_pos(int order, int64_t n, int64_t i);
int64_t or_up_pos(int order, int64_t n, int64_t i);

/* point value (double) and justified interval of h for one element */
void or_act_elem(double g, double u, double rs, double es, const or_act_opt *o, double *point,
                 double *lo, double *hi);

/* point quantization of a group of exact f32 values h[0..G-1]: returns f32 scale
 * and codes. is_f8, ue8m0, eps. */
float or_quant_group(const double *h, int64_t G, int is_f8, int ue8m0, float eps, uint8_t *codes,
                     int *e_out);

/* MoE reference in double. Inputs are arrays of exact doubles (decoded).
 * x [M,K], w1 [E,2I,K], b1 [E,2I] or NULL, ids [M,k], map [Eg] or NULL
 * (Eg ignored if map NULL -> Eg=E). Output h [M,k,I] (zeros for invalid);
 * valid[M*k] set to the local expert or -1. */
void or_moe_gate(int64_t M, int64_t K, int64_t I, int64_t E, int64_t k, const double *x,
                 const double *w1, const double *b1, const int32_t *ids, const int32_t *map,
                 int64_t Eg, const or_act_opt *o, double *h, int64_t *valid);
/* y [M,k,K] un-reduced (zeros for invalid); out [M,K] reduced with weights. */
void or_moe_final(int64_t M, int64_t K, int64_t I, int64_t E, int64_t k, const double *h,
                  const double *w2, const double *b2, const int64_t *valid, const double *wts,
                  double *y, double *out);
int64_t or_local_expert(int32_t id, const int32_t *map, int64_t Eg, int64_t E);

/* topk softmax of one row: probabilities p[E] (double) and the order */
void or_topk_row(const double *logits, int64_t E, int64_t k, int renorm, int32_t *ids,
                 double *w);

#endif
