/* Option checking and defaults for the activation and quantization calls. */
#ifndef MOEFUSE_CORE_OPTIONS_H
#define MOEFUSE_CORE_OPTIONS_H

#include "core/core.h"

/* Reserved words of an option struct must be 0; `what` names the struct in the message. */
moefuse_status mf_check_reserved(moefuse_context *ctx, const char *op, const char *what,
                                 const uint32_t *words, size_t count);
#define MF_CHECK_RESERVED(ctx, op, what, array)                                                  \
    mf_check_reserved(ctx, op, what, array, sizeof(array) / sizeof((array)[0]))

/*
 * The gated activation's fields, which moefuse_act_options and moefuse_moe_options share:
 * enum ranges, limit >= 0, alpha only with SILU_ALPHA (there 0 becomes
 * MOEFUSE_SILU_ALPHA_DEFAULT, written back, so backends get the value itself), a finite
 * up_offset. The one place these are checked; backends do not check them again.
 */
typedef struct mf_gated_fields {
    moefuse_activation *activation;
    moefuse_gate_order *order;
    float *limit, *alpha, *up_offset;
} mf_gated_fields;
moefuse_status mf_check_gated(moefuse_context *ctx, const char *op, mf_gated_fields f);

/* Copy `in` (NULL = defaults) to `out` after range checks. */
moefuse_status mf_normalize_act(moefuse_context *ctx, const char *op,
                                const moefuse_act_options *in, moefuse_act_options *out);
/* Range checks, group_size/eps defaults, packed => ue8m0, UE8M0 only with f8 codes. */
moefuse_status mf_normalize_quant(moefuse_context *ctx, const char *op,
                                  const moefuse_quant_options *in, moefuse_dtype code_dtype,
                                  int64_t hidden, moefuse_quant_options *out);
/*
 * Check the scales tensor against its layout (masked: the 3-D layout)
 * and return it normalised to rank 3. `experts` is read only when masked.
 */
moefuse_status mf_check_scales(moefuse_context *ctx, const char *op, const char *name,
                               const moefuse_tensor *scales,
                               const moefuse_quant_options *opt, bool masked, int64_t experts, int64_t rows,
                               int64_t groups, moefuse_tensor *normalized);

#endif /* MOEFUSE_CORE_OPTIONS_H */
