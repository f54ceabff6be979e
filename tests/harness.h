/* Test harness: backend choice, canary-guarded buffers, seeded RNG. */
#ifndef MOEFUSE_TEST_HARNESS_H
#define MOEFUSE_TEST_HARNESS_H

#include <check.h>
#include <stdint.h>
#include <stdio.h>

#include "moefuse.h"
#include "oracle.h"

extern moefuse_context *g_ctx;  /* the backend under test (MOEFUSE_TEST_BACKEND) */
extern moefuse_context *g_ref;  /* cross-backend tests only: the CPU golden backend */
extern unsigned long long g_seed;

/* MOEFUSE_TEST_BACKEND, or "cpu" */
const char *h_backend(void);

/* every assertion message carries the seed */
#define HCHECK(cond, ...) \
    ck_assert_msg((cond), "[seed=%llu MOEFUSE_TEST_SEED reproduces] %s", g_seed, h_fmt(__VA_ARGS__))
const char *h_fmt(const char *fmt, ...);

/* RNG */
uint64_t h_rand(void);
double h_unif(double a, double b);
int64_t h_randint(int64_t lo, int64_t hi); /* inclusive */

/* A tensor in a backend buffer laid out as pad + payload + pad. */
typedef struct tbuf {
    char name[48];
    moefuse_context *ctx; /* the context that owns buf */
    void *buf;
    size_t total; /* bytes incl. pads */
    size_t pad;
    moefuse_tensor t;
    unsigned char *full;   /* host copy of the whole buffer */
    unsigned char *shadow; /* last uploaded whole buffer */
    unsigned char *logical;/* 1 where a byte belongs to an element */
    int is_input;
    struct tbuf *twin; /* tb_twin's copy in another context, or NULL */
    struct tbuf *next;
} tbuf;

/* row_pad: extra elements between rows (added to the stride of dim rank-2) */
tbuf *tb_new(const char *name, moefuse_dtype dt, int rank, const int64_t *shape, int64_t row_pad,
             int is_input);
tbuf *tb_new2(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t row_pad, int in);
tbuf *tb_new3(const char *name, moefuse_dtype dt, int64_t a, int64_t b, int64_t c, int64_t row_pad,
              int in);
tbuf *tb_new1(const char *name, moefuse_dtype dt, int64_t a, int in);
void *tb_el(tbuf *tb, int64_t i0, int64_t i1, int64_t i2); /* unused indices 0 */
double tb_get(tbuf *tb, int64_t i0, int64_t i1, int64_t i2);
void tb_set(tbuf *tb, int64_t i0, int64_t i1, int64_t i2, double v); /* rounds to dtype */
void tb_fill_unif(tbuf *tb, double a, double b);
/* tb_fill_unif, then tb_upload: an input of uniform values in one line; returns tb */
tbuf *tb_upload_unif(tbuf *tb, double a, double b);
/* writes the host bytes to the buffer, and to the twin's buffer when tb has one */
void tb_upload(tbuf *tb);
/* The same tensor in another context: same shape, strides, pads and bytes
 * (canaries and poison included), named "<name>@<backend>". It is a live tbuf
 * like any other (h_check_all checks it, tb_free_all frees it), and every later
 * tb_upload(tb) copies tb's host bytes into it too. */
tbuf *tb_twin(tbuf *tb, moefuse_context *ctx);
/* read everything back; checks canaries of every live tbuf and, when
 * untouched, that no byte of any tensor changed. Called after every call. */
void h_check_all(int untouched);
void tb_free_all(void);

int h_dt_or(moefuse_dtype dt); /* to oracle dtype */
/* NUMERICS.md, MoE: the relative 2-norm bound of a GEMM output of dtype dt, and the error each
 * element may have first (half the spacing of dt's subnormals) */
double h_gemm_bound(moefuse_dtype dt);
double h_gemm_floor(moefuse_dtype dt);
/* ||got - ref|| / ||ref|| over n values (the plain norm when ref is 0), each |got - ref| first
 * reduced by floor (at least 0) */
double h_rel_err_floor(const double *got, const double *ref, size_t n, double floor);
moefuse_tensor *T(tbuf *tb);     /* &tb->t, NULL-safe */

/* The float dtypes of x, h and outputs, in the order the tests loop over them. */
extern const moefuse_dtype FLOATS[3];

/* A scale layout: row- or column-major f32 scales (ue8m0: powers of two), or packed ue8m0. */
typedef struct {
    int layout, ue8m0;
} lay;
/* all five: row, column, row ue8m0, column ue8m0, packed */
extern const lay LAYS[5];

/* fixtures */
void h_setup(void);
void h_setup_cross(void); /* h_setup, plus g_ref on the cpu backend */
void h_teardown(void);
/* Creates and destroys one context on `be` in a child process, because a device runtime
 * started here might not survive the fork of every Check test. Returns the status of
 * moefuse_context_create; msg gets its message, or the device's name (moefuse_device_name)
 * when it succeeded. */
moefuse_status h_probe_backend(const char *be, char *msg, size_t size);
/* Runs the suite: seed handling, srunner, exit code. When the selected backend
 * is built but has no device, prints "SKIP: backend X unavailable: <why>" and
 * returns 77 (Meson's SKIP) without running anything. */
int h_run(Suite *s);
/* A test case of s, run between setup and h_teardown, each test within timeout seconds
 * (setup NULL: no fixture, for tests that make and destroy their own contexts). */
TCase *h_add_tcase(Suite *s, const char *name, void (*setup)(void), double timeout);

/* call + canary check */
#define CALL(expr) h_call((expr))
moefuse_status h_call(moefuse_status st);

/* compare helpers */
/* check a whole quantized result against per-element intervals hlo/hhi and
 * point values hp (row-major [T, H] doubles), for rows 0..T-1 of q/scales.
 * q/scales tensors are 2-D (or 3-D with expert e >= 0). exact: intervals are points. */
void h_check_quant(tbuf *q, tbuf *sc, int64_t e, int64_t T, int64_t Tdim, int64_t H, int64_t G,
                   int layout, int ue8m0, float eps, const double *hp, const double *hlo,
                   const double *hhi, const char *what);
/* The f32 scales the oracle allows for one group of G elements with point
 * values P and intervals [L, U] (as h_check_quant): [*slo, *shi]. */
void h_scale_band(const double *P, const double *L, const double *U, int64_t G, float eps,
                  int is_f8, double *slo, double *shi);

/* Routing of the MoE tests that want invalid slots: slot (m, j)'s id, or at random (2 draws in
 * 6) one outside [0, Eg); token 0 gets no valid slot at all. */
int64_t h_maybe_invalid_id(int64_t id, int64_t Eg, int64_t m, int64_t j);
/* ids [M, k] = (m + j) % E with weights 0.5, uploaded: a valid routing, for a test that needs one. */
void h_fill_simple_routing(tbuf *ids, tbuf *wts, int64_t M, int64_t k, int64_t E);
/* ids [M, k] drawn from [0, Eg) (avoid, when >= 0, drawn becomes 0), with invalid: then passed
 * through h_maybe_invalid_id; weights from [0.05, 1]; both uploaded. Each slot draws its id, its
 * invalid id, then its weight, so seeded runs keep their sequence. */
void h_fill_random_routing(tbuf *ids, tbuf *wts, int64_t M, int64_t k, int64_t Eg, int invalid,
                           int64_t avoid);
/* The activation options of a test case's fields. */
moefuse_act_options h_act_options(int act, int order, float limit, int rnd, float alpha,
                                  float up_offset);
/* expert_map[g] onto E local experts, drawn in order of g: -1 (not local) for every third id,
 * E (outside [0, E): invalid) for the last one when Eg > 2, else a random local expert. */
int32_t h_map_entry(int64_t g, int64_t Eg, int64_t E);
/* An expert_map [Eg] of h_map_entry's, uploaded; *values gets its entries, malloc'ed for the
 * oracle (the caller frees them). */
tbuf *h_new_expert_map(int64_t Eg, int64_t E, int32_t **values);

/* scale layout helpers: byte pointer / value for (e, t, g) */
double h_scale_at(tbuf *sc, int layout, int64_t e, int64_t t, int64_t g, int *ebyte);
/* the element of (e, t, g) in a row- or column-major scale tensor (not packed) */
void *h_scale_el(tbuf *sc, int layout, int64_t e, int64_t t, int64_t g);
/* The scales of a dequant test, 2-D [Tn, Gn] in any layout (ue: u8 exponents): every class of
 * scale, cycling with t + g; exponent bytes 1 to 255, or f32 from 1e-30 to 1e38. */
void h_fill_dequant_scales(tbuf *sc, int layout, int ue, int64_t Tn, int64_t Gn);
/* padding rows T..Ta-1; unused packed bytes of the rows 0..Tn-1 */
void h_check_scale_padding(tbuf *sc, int layout, int64_t e, int64_t Tn, int64_t T, int64_t Gn);

/* scale tensor for a layout: E == 0 -> 2-D. f32, u8 (ue8m0) or i32 (packed) */
tbuf *h_new_scales(const char *name, int layout, int ue8m0, int64_t E, int64_t T, int64_t Gn,
                   int64_t row_pad);
/* h_new_scales for the layout L: u8 exponents where L is ue8m0 but not packed */
tbuf *h_new_scales_of(const char *name, lay L, int64_t E, int64_t T, int64_t Gn, int64_t row_pad);
/* per-element oracle for act rows: x rows [T, 2H] (3-D with e >= 0), row_scale
 * optional tbuf (1-D [T] or 2-D [E,Tmax]), es expert factor; fills [T*H] arrays */
void h_ref_act(tbuf *x, int64_t e, int64_t Tn, int64_t H, tbuf *rs, double es, const or_act_opt *o,
               double *hp, double *hlo, double *hhi);

int h_have_openmp(void);

#endif
