/*
 * The checks and steps the MoE entry points share (ops_moe.c defines them; ops_moe_fp8.c
 * uses them too): options, routing, and running or measuring one GEMM step.
 */
#ifndef MOEFUSE_CORE_MOE_CHECKS_H
#define MOEFUSE_CORE_MOE_CHECKS_H

#include "core/core.h"

typedef moefuse_status (*mf_moe_fn)(moefuse_context *, void *, const mf_moe_args *);
typedef moefuse_status (*mf_moe_size_fn)(moefuse_context *, void *, const mf_moe_args *,
                                         size_t *);

/* Shared experts of a routed call (routing.n_shared > 0), kept by the core: the backends see
 * them as ordinary slots (moe_shared.c). */
typedef struct mf_shared {
    int64_t n;              /* n_shared; 0: none */
    int64_t routed;         /* topk_ids' k */
    float scale;            /* shared_scale, 1 when 0 was given */
    moefuse_tensor weights; /* shared_weights [M] f32 (final, forward), or absent */
} mf_shared;

/* A call on the routed and shared slots of a (a->topk counts both), run or measured. */
typedef moefuse_status (*mf_moe_runner)(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                        size_t *measure);

/* Copy `in` (NULL = defaults) to `out` after range checks. */
moefuse_status mf_moe_check_options(moefuse_context *ctx, const char *op,
                                    const moefuse_moe_options *in, moefuse_moe_options *out);
/* topk_ids [M, k] (M = a->tokens), topk_weights [M, k] when need_weights, expert_map, and the
 * shared experts (a->experts known): sets the routing tensors and a->topk = k + n_shared, and
 * *sh; sh NULL (a call with no place for them) refuses shared experts. */
moefuse_status mf_moe_check_routing(moefuse_context *ctx, const char *op,
                                    const moefuse_routing *r, bool need_weights, mf_moe_args *a,
                                    mf_shared *sh);
/* The routing tensors as inputs of the overlap check, at ops[0 .. MF_ROUTING_OPERANDS - 1]:
 * topk_ids, topk_weights, expert_map, shared_weights. */
#define MF_ROUTING_OPERANDS 4
void mf_moe_routing_operands(const moefuse_routing *r, mf_operand *ops);
/*
 * Run (or measure) `run` on a; with shared experts, on their slots made ordinary: the core
 * asks the backend (moe_shared_routing) for the ids and weights of all k + n slots, in front
 * of the call's workspace or in scratch of the context's, and runs `run` on them.
 */
moefuse_status mf_moe_run_shared(moefuse_context *ctx, const char *op, mf_moe_args *a,
                                 const mf_shared *sh, mf_moe_runner run, size_t *measure);
/* An optional bias of rank 2 whose shape is want's first two dims (`what` says where they come
 * from); *dst is it, or absent. */
moefuse_status mf_moe_check_bias(moefuse_context *ctx, const char *op, const char *name,
                                 const moefuse_tensor *b, const int64_t *want, const char *what,
                                 moefuse_tensor *dst);
/* out of a final step: [M, K] when it reduces the slots, else [M, k, K]; sets a->reduce and
 * a->out. */
moefuse_status mf_moe_check_final_out(moefuse_context *ctx, const char *op,
                                      const moefuse_tensor *out, bool reduce, mf_moe_args *a);
/* out [M, K] of a whole layer (routed), like x; sets a->reduce and a->out. */
moefuse_status mf_moe_check_layer_out(moefuse_context *ctx, const char *op,
                                      const moefuse_tensor *out, mf_moe_args *a);
/*
 * The last part of a routed call: the overlap check of its `own` operands and, after them
 * (room for MF_ROUTING_OPERANDS more), the routing's, where topk_weights and shared_weights
 * count only when the call reads them; then `run` through mf_moe_run_shared, or nothing when
 * every output is empty.
 */
moefuse_status mf_moe_finish_routed(moefuse_context *ctx, const char *op, mf_operand *operands,
                                    size_t own, const moefuse_routing *routing,
                                    bool reads_weights, mf_moe_args *a, const mf_shared *sh,
                                    mf_moe_runner run, size_t *measure);
/* The scratch a step takes: its backend member's answer, or 0 (none, or it does not matter). */
moefuse_status mf_moe_step_workspace(moefuse_context *ctx, mf_moe_size_fn size,
                                     const mf_moe_args *a, size_t *measure, size_t *bytes);
/* Run (or measure) one step whose arguments are valid; a NULL fn is unimplemented. */
moefuse_status mf_moe_run_step(moefuse_context *ctx, const char *op, mf_moe_fn fn,
                               mf_moe_size_fn size, const mf_moe_args *a, size_t *measure);
/* A failed step of a whole-layer call: put the call's name in front of the step's message. */
moefuse_status mf_moe_in_forward(moefuse_context *ctx, const char *op, moefuse_status status);

#endif /* MOEFUSE_CORE_MOE_CHECKS_H */
