/*
 * The expert-parallel tests' pieces: a world of ranks as threads of this program (the
 * library's in-process transport), each with its own context (of MOEFUSE_TEST_BACKEND: cpu,
 * or cuda with the ranks sharing one GPU) and group, and host data.
 */
#ifndef MOEFUSE_TEST_EP_H
#define MOEFUSE_TEST_EP_H

#include "ep/ep_internal.h"
#include "harness.h"

#include <check.h>
#include <stdint.h>
#include <stdlib.h>

#define EP_MAX_WORLD 8

/* One rank's part of a test: run(rank) in its own thread with ctx and group ready. */
typedef struct ep_world {
    int32_t world, experts;
    const int32_t *owner; /* NULL: contiguous blocks */
    mf_ep_inproc_world *w;
    moefuse_context *ctx[EP_MAX_WORLD];
    moefuse_ep_group *group[EP_MAX_WORLD];
    void (*run)(struct ep_world *, int32_t rank);
    void *arg;
} ep_world;

/* Makes the contexts and groups, runs run() on every rank at once, frees them. */
void ep_run(int32_t world, int32_t experts, const int32_t *owner,
            void (*run)(ep_world *, int32_t), void *arg);

/* The rank of global expert g, and its local index there. */
int32_t ep_owner(const ep_world *w, int32_t g);
int32_t ep_local(const ep_world *w, int32_t g);

/* Backend memory of ctx: `bytes` between two guards of canary bytes, holding host's bytes (the
   canary when host is NULL). Tensors over it take data = the buffer, offset = EP_GUARD. */
#define EP_GUARD 64
void *ep_put(moefuse_context *ctx, const void *host, size_t bytes);
/* Its bytes and both guards, back in host memory (malloc'd: EP_GUARD + bytes + EP_GUARD). */
unsigned char *ep_get(moefuse_context *ctx, void *buffer, size_t bytes);
/* Both guards of such a copy still hold the canary. */
int ep_guards_ok(const unsigned char *copy, size_t bytes);

/* Host buffers with canary bytes on both sides, checked by ep_canaries_ok. */
void *ep_alloc(size_t bytes);
int ep_canaries_ok(const void *p);
void ep_free(void *p);

/* Random values in [-1, 1) as dt (f32/f16/bf16 or f8_e4m3 codes without NaN). */
void ep_fill(void *p, moefuse_dtype dt, int64_t n);
/* Routing of M tokens: ids in [lo, hi) with some invalid ones (-1, E + 3), weights > 0. */
void ep_routing(int32_t *ids, float *w, int64_t M, int64_t k, int32_t lo, int32_t hi,
                int32_t E);

/* The rows of experts the given rank owns, from a global [E, rows, cols] tensor's bytes. */
void *ep_slice(const ep_world *w, int32_t rank, const void *global, int64_t rows, int64_t cols,
               size_t elem, int32_t *local_count);
/* The same with the `shared` experts after the global ones appended (every rank's). */
void *ep_slice_shared(const ep_world *w, int32_t rank, const void *global, int64_t rows,
                      int64_t cols, size_t elem, int32_t shared, int32_t *local_count);

/* A dispatch and combine on every rank (test_ep_dispatch.c): its inputs, made by ep_disp_run
   from the shapes, and its outputs read back with their guards. */
typedef struct disp_case {
    int32_t world, E, k;
    int64_t K, tmax, M[EP_MAX_WORLD];
    int quantize, lay; /* FP8 rows: recv_scales in LAYS[lay] */
    int f8x;           /* FP8 rows from an f8 x with its scales in LAYS[lay] (quantize 0) */
    int ll;            /* the low-latency mode, max_tokens the largest M (ep_disp_run sets it) */
    int busy;          /* every slot names expert 1 (ep_disp_run) */
    int y_bf16;        /* the experts' outputs y in bf16 (else f32) */
    int out_bf16;      /* combine's out in bf16 (else f32) */
    void *xq[EP_MAX_WORLD], *xs[EP_MAX_WORLD];
    size_t xs_bytes[EP_MAX_WORLD];
    moefuse_dtype dt;
    moefuse_ep_dispatch_options opt;
    void *x[EP_MAX_WORLD];
    int32_t *ids[EP_MAX_WORLD];
    float *wts[EP_MAX_WORLD];
    /* outputs read back, each with its guards (ep_get) */
    unsigned char *recv[EP_MAX_WORLD], *scales[EP_MAX_WORLD], *counts[EP_MAX_WORLD],
        *out[EP_MAX_WORLD];
    size_t scale_bytes[EP_MAX_WORLD];
    int32_t local[EP_MAX_WORLD];
    moefuse_status st[EP_MAX_WORLD], st_combine[EP_MAX_WORLD];
    char msg[EP_MAX_WORLD][512];
} disp_case;

/* World ranks, M + 5 r tokens on rank r, bf16 rows, E = 8, k = 4, K = 256. */
disp_case ep_disp_case(int32_t world, int64_t M, int64_t tmax);
/* Draws the inputs and runs every rank (owner: NULL or the placement). */
void ep_disp_run(disp_case *c, const int32_t *owner);
/* Every output against the contract (the low-latency combine's sum by rank with c->ll). */
void ep_disp_check(disp_case *c);
void ep_disp_free(disp_case *c);
/* The padded scale layouts' rows Tmax .. Ta - 1 are zero on every rank. */
void ep_disp_check_padding(const disp_case *c);
/* One rank of a case whose inputs are drawn: dispatch, y made up, combine (ep_run's run). */
void ep_disp_rank(ep_world *w, int32_t r);
/* Every byte of [p, p + n) is the canary. */
int ep_untouched(const void *p, size_t n);

void ep_add_layer_tests(Suite *s);
void ep_add_dispatch_tests(Suite *s);
void ep_add_ll_tests(Suite *s);

#endif
