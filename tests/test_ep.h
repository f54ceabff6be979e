/*
 * The expert-parallel tests' pieces: a world of ranks as threads of this program (the
 * library's in-process transport), each with its own CPU context and group, and host data.
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

void ep_add_layer_tests(Suite *s);
void ep_add_dispatch_tests(Suite *s);

#endif
