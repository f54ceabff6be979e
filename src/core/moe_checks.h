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

/* Copy `in` (NULL = defaults) to `out` after range checks. */
moefuse_status mf_moe_check_options(moefuse_context *ctx, const char *op,
                                    const moefuse_moe_options *in, moefuse_moe_options *out);
/* topk_ids [M, k] (M = a->tokens), topk_weights [M, k] when need_weights, expert_map; sets
 * a->topk and the routing tensors. */
moefuse_status mf_moe_check_routing(moefuse_context *ctx, const char *op,
                                    const moefuse_routing *r, bool need_weights, mf_moe_args *a);
/* The routing tensors as inputs of the overlap check, at ops[0..2]. */
void mf_moe_routing_operands(const moefuse_routing *r, mf_operand *ops);
/* The scratch a step takes: its backend member's answer, or 0 (none, or it does not matter). */
moefuse_status mf_moe_step_workspace(moefuse_context *ctx, mf_moe_size_fn size,
                                     const mf_moe_args *a, size_t *measure, size_t *bytes);
/* Run (or measure) one step whose arguments are valid; a NULL fn is unimplemented. */
moefuse_status mf_moe_run_step(moefuse_context *ctx, const char *op, mf_moe_fn fn,
                               mf_moe_size_fn size, const mf_moe_args *a, size_t *measure);
/* A failed step of a whole-layer call: put the call's name in front of the step's message. */
moefuse_status mf_moe_in_forward(moefuse_context *ctx, const char *op, moefuse_status status);

#endif /* MOEFUSE_CORE_MOE_CHECKS_H */
