/*
 * The calls behind public entry points, for code inside the library that runs them as steps of
 * a larger call (expert parallelism's layer): the same checks and work as the public call,
 * without entering the context again. `measure` as everywhere: non-NULL asks for the
 * workspace size only.
 */
#ifndef MOEFUSE_CORE_OPS_INTERNAL_H
#define MOEFUSE_CORE_OPS_INTERNAL_H

#include "core/core.h"

moefuse_status mf_quant_call(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                             const moefuse_tensor *q, const moefuse_tensor *scales,
                             const moefuse_quant_options *opt, size_t *measure);
moefuse_status mf_moe_gate_call(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                const moefuse_tensor *w1, const moefuse_tensor *b1,
                                const moefuse_routing *routing, const moefuse_tensor *h,
                                const moefuse_moe_options *opt, size_t *measure);
moefuse_status mf_moe_final_call(moefuse_context *ctx, const char *op, const moefuse_tensor *h,
                                 const moefuse_tensor *w2, const moefuse_tensor *b2,
                                 const moefuse_routing *routing, const moefuse_tensor *out,
                                 const moefuse_moe_options *opt, size_t *measure);
moefuse_status mf_moe_gate_fp8_call(moefuse_context *ctx, const char *op,
                                    const moefuse_tensor *x, const moefuse_tensor *x_scales,
                                    const moefuse_tensor *w1, const moefuse_tensor *w1_scales,
                                    const moefuse_tensor *b1, const moefuse_routing *routing,
                                    const moefuse_tensor *h, const moefuse_tensor *h_scales,
                                    const moefuse_fp8_moe_options *opt, size_t *measure);
moefuse_status mf_moe_final_fp8_call(moefuse_context *ctx, const char *op,
                                     const moefuse_tensor *h, const moefuse_tensor *h_scales,
                                     const moefuse_tensor *w2, const moefuse_tensor *w2_scales,
                                     const moefuse_tensor *b2, const moefuse_routing *routing,
                                     const moefuse_tensor *out,
                                     const moefuse_fp8_moe_options *opt, size_t *measure);

#endif
