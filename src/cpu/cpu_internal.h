/* Entry points shared between the CPU backend's source files. */
#ifndef MOEFUSE_CPU_INTERNAL_H
#define MOEFUSE_CPU_INTERNAL_H

#include "core/backend.h"
#include "cpu/omp_compat.h"

#include <stdbool.h>
#include <stddef.h>

#ifdef _OPENMP
#include <omp.h>
#endif

static inline int mf_cpu_max_threads(void)
{
#ifdef _OPENMP
    int n = omp_get_max_threads();
    return n > 0 ? n : 1;
#else
    return 1;
#endif
}

static inline int mf_cpu_thread_id(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* 64-byte aligned host scratch of a call; never NULL for bytes == 0 unless out of memory
 * (or a host-allocation fault injected by a test, core/fault.h). */
void *mf_cpu_alloc(size_t bytes);
void mf_cpu_free(void *p);

/* A call's scratch: the caller's workspace when one is set (moefuse_set_workspace), else the
 * heap. mf_cpu_scratch_release frees what came from the heap. */
typedef struct mf_cpu_scratch {
    char *mem;
    bool owned;
} mf_cpu_scratch;
moefuse_status mf_cpu_scratch_take(moefuse_context *ctx, const char *op, size_t bytes,
                                   mf_cpu_scratch *out);
void mf_cpu_scratch_release(mf_cpu_scratch *s);

moefuse_status mf_cpu_act_quant(moefuse_context *ctx, void *state, const mf_rows_args *a);
moefuse_status mf_cpu_act_mul(moefuse_context *ctx, void *state, const mf_rows_args *a);
moefuse_status mf_cpu_quant(moefuse_context *ctx, void *state, const mf_rows_args *a);
moefuse_status mf_cpu_dequant(moefuse_context *ctx, void *state, const mf_dequant_args *a);
moefuse_status mf_cpu_topk_route(moefuse_context *ctx, void *state, const mf_topk_args *a);
moefuse_status mf_cpu_routing_metadata(moefuse_context *ctx, void *state, const mf_meta_args *a);
/* expert parallelism's rows (ep_rows.c) */
moefuse_status mf_cpu_ep_gather(moefuse_context *ctx, void *state, const mf_ep_rows_args *a);
moefuse_status mf_cpu_ep_scatter(moefuse_context *ctx, void *state, const mf_ep_rows_args *a);
moefuse_status mf_cpu_ep_reduce(moefuse_context *ctx, void *state, const mf_ep_reduce_args *a);
/* the column-major and packed layouts' padding before a->counts[e] rows are written */
void mf_cpu_ep_zero_padding(const mf_ep_rows_args *a);
/* the low-latency mode's steps (ep_ll.c) */
moefuse_status mf_cpu_ep_ll_pack(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
moefuse_status mf_cpu_ep_ll_place(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
moefuse_status mf_cpu_ep_ll_partial(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
moefuse_status mf_cpu_ep_ll_sum(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
moefuse_status mf_cpu_ep_copy(moefuse_context *ctx, void *state, void *dst, const void *src,
                              size_t bytes);
moefuse_status mf_cpu_meta_workspace(moefuse_context *ctx, void *state, const mf_meta_args *a,
                                     size_t *bytes);
moefuse_status mf_cpu_moe_gate(moefuse_context *ctx, void *state, const mf_moe_args *a);
moefuse_status mf_cpu_moe_final(moefuse_context *ctx, void *state, const mf_moe_args *a);

moefuse_status mf_cpu_moe_gate_fp8(moefuse_context *ctx, void *state, const mf_moe_args *a);
moefuse_status mf_cpu_moe_final_fp8(moefuse_context *ctx, void *state, const mf_moe_args *a);

/* The bytes of scratch each takes (backend.h's *_workspace members). */
moefuse_status mf_cpu_rows_workspace(moefuse_context *ctx, void *state, const mf_rows_args *a,
                                     size_t *bytes);
moefuse_status mf_cpu_topk_workspace(moefuse_context *ctx, void *state, const mf_topk_args *a,
                                     size_t *bytes);
moefuse_status mf_cpu_moe_gate_workspace(moefuse_context *ctx, void *state, const mf_moe_args *a,
                                         size_t *bytes);
moefuse_status mf_cpu_moe_final_workspace(moefuse_context *ctx, void *state,
                                          const mf_moe_args *a, size_t *bytes);
moefuse_status mf_cpu_moe_gate_fp8_workspace(moefuse_context *ctx, void *state,
                                             const mf_moe_args *a, size_t *bytes);
moefuse_status mf_cpu_moe_final_fp8_workspace(moefuse_context *ctx, void *state,
                                              const mf_moe_args *a, size_t *bytes);

/*
 * Group scales in the layouts of moefuse_scale_layout (rows.c), rank-3 scale tensors [E, ...]:
 * the address of (e, t, g) (a byte of the word when packed), a store of the f32 scale s or
 * its exponent byte ue as the tensor holds, and the zeroing of a row's slots (the unused
 * bytes of its last packed word included).
 */
char *mf_cpu_scale_addr(const moefuse_tensor *scales, moefuse_scale_layout layout, int64_t e,
                        int64_t t, int64_t g);
void mf_cpu_put_scale(const moefuse_tensor *scales, moefuse_scale_layout layout, int64_t e,
                      int64_t t, int64_t g, float s, uint8_t ue);
int64_t mf_cpu_scale_slots(moefuse_scale_layout layout, int64_t groups);
void mf_cpu_zero_scales_row(const moefuse_tensor *scales, moefuse_scale_layout layout,
                            int64_t groups, int64_t e, int64_t t);

#endif /* MOEFUSE_CPU_INTERNAL_H */
