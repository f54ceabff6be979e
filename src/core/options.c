/* Option checking and defaults for the activation and quantization calls. */
#include "core/options.h"

#include <math.h>

moefuse_status mf_check_reserved(moefuse_context *ctx, const char *op, const char *what,
                                 const uint32_t *words, size_t count)
{
    for (size_t i = 0; i < count; i++)
        if (words[i] != 0)
            return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                            "%s: %s.reserved[%zu] is %u; reserved words must be 0 (a newer "
                            "moefuse may give them meaning; this one, %d.%d.%d, does not)",
                            op, what, i, (unsigned)words[i], MOEFUSE_VERSION_MAJOR,
                            MOEFUSE_VERSION_MINOR, MOEFUSE_VERSION_PATCH);
    return MOEFUSE_OK;
}

moefuse_status mf_check_gated(moefuse_context *ctx, const char *op, mf_gated_fields f)
{
    if ((unsigned)*f.activation >= MOEFUSE_ACT_COUNT_)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: activation %d is not a moefuse_activation", op, (int)*f.activation);
    if ((unsigned)*f.order >= MOEFUSE_GATE_ORDER_COUNT_)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: order %d is not a moefuse_gate_order", op, (int)*f.order);
    if (!(*f.limit >= 0.0f))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: limit is %g; it must be > 0 to clamp, or 0 for no clamp", op,
                        (double)*f.limit);
    if (*f.activation != MOEFUSE_ACT_SILU_ALPHA && *f.alpha != 0.0f)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: alpha is %g but activation %d takes none; alpha is for "
                        "MOEFUSE_ACT_SILU_ALPHA only (leave it 0 otherwise)",
                        op, (double)*f.alpha, (int)*f.activation);
    if (*f.activation == MOEFUSE_ACT_SILU_ALPHA) {
        if (*f.alpha == 0.0f)
            *f.alpha = MOEFUSE_SILU_ALPHA_DEFAULT;
        if (!(*f.alpha > 0.0f) || !isfinite(*f.alpha))
            return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                            "%s: alpha is %g; MOEFUSE_ACT_SILU_ALPHA takes a finite alpha > 0, "
                            "or 0 for %g (gpt-oss's)",
                            op, (double)*f.alpha, (double)MOEFUSE_SILU_ALPHA_DEFAULT);
    }
    if (!isfinite(*f.up_offset))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: up_offset is %g; it must be finite (0: nothing is added to up)", op,
                        (double)*f.up_offset);
    return MOEFUSE_OK;
}

moefuse_status mf_normalize_act(moefuse_context *ctx, const char *op,
                                const moefuse_act_options *in, moefuse_act_options *out)
{
    moefuse_act_options opt = {0};
    if (in)
        opt = *in;
    const mf_gated_fields f = {&opt.activation, &opt.order, &opt.limit, &opt.alpha,
                               &opt.up_offset};
    MF_TRY(mf_check_gated(ctx, op, f));
    if ((unsigned)opt.intermediate >= MOEFUSE_ROUNDING_COUNT_)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: intermediate rounding %d is not a moefuse_rounding", op,
                        (int)opt.intermediate);
    MF_TRY(MF_CHECK_RESERVED(ctx, op, "act options", opt.reserved));
    *out = opt;
    return MOEFUSE_OK;
}

moefuse_status mf_normalize_quant(moefuse_context *ctx, const char *op,
                                  const moefuse_quant_options *in, moefuse_dtype code_dtype,
                                  int64_t hidden, moefuse_quant_options *out)
{
    moefuse_quant_options opt = {0};
    if (in)
        opt = *in;
    if ((unsigned)opt.scale_layout >= MOEFUSE_SCALE_LAYOUT_COUNT_)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: scale_layout %d is not a moefuse_scale_layout", op,
                        (int)opt.scale_layout);
    MF_TRY(MF_CHECK_RESERVED(ctx, op, "quant options", opt.reserved));
    if (opt.group_size == 0)
        opt.group_size = 128;
    if (opt.group_size != 32 && opt.group_size != 64 && opt.group_size != 128 &&
        opt.group_size != hidden)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: group_size %lld is not one of 32, 64, 128 or H = %lld", op,
                        (long long)opt.group_size, (long long)hidden);
    if (hidden % opt.group_size != 0)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: H = %lld is not a multiple of group_size %lld",
                        op, (long long)hidden, (long long)opt.group_size);
    if (opt.eps == 0.0f)
        opt.eps = 1e-10f;
    /* Below the minimum, amax / 448 of an all-zero group underflows to 0 and 0 / 0 gives
     * NaN codes; at or above it every scale is a normal f32 number. */
    if (!(opt.eps >= MOEFUSE_QUANT_EPS_MIN) || !isfinite(opt.eps))
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: eps is %g; it must be finite and at least %g (MOEFUSE_QUANT_EPS_MIN), "
                        "or 0 for the default 1e-10",
                        op, (double)opt.eps, (double)MOEFUSE_QUANT_EPS_MIN);
    if (opt.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0)
        opt.ue8m0 = 1;
    if (code_dtype == MOEFUSE_I8 && opt.ue8m0)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: UE8M0 scales (ue8m0 or the packed layout) are for f8_e4m3 codes, not i8",
                        op);
    opt.ue8m0 = opt.ue8m0 != 0;
    *out = opt;
    return MOEFUSE_OK;
}

moefuse_status mf_check_scales(moefuse_context *ctx, const char *op, const char *name,
                               const moefuse_tensor *scales,
                               const moefuse_quant_options *opt, bool masked, int64_t experts, int64_t rows,
                               int64_t groups, moefuse_tensor *normalized)
{
    const int32_t rank = masked ? 3 : 2;
    const int64_t rows_padded = (rows + 3) / 4 * 4;
    mf_dtype_set allowed = MF_DT(MOEFUSE_F32) | (opt->ue8m0 ? MF_DT(MOEFUSE_U8) : 0);
    int64_t want[3];
    int64_t *inner = masked ? want + 1 : want;
    want[0] = experts;
    switch (opt->scale_layout) {
    case MOEFUSE_SCALE_ROW_MAJOR:
        inner[0] = rows, inner[1] = groups;
        break;
    case MOEFUSE_SCALE_COLUMN_MAJOR:
        inner[0] = groups, inner[1] = rows_padded;
        break;
    default: /* PACKED_UE8M0 */
        allowed = MF_DT(MOEFUSE_I32);
        inner[0] = (groups + 3) / 4, inner[1] = rows_padded;
        break;
    }
    if (mf_present(scales) && scales->dtype == MOEFUSE_U8 && !opt->ue8m0)
        return mf_error(ctx, MOEFUSE_ERR_DTYPE,
                        "%s: %s are u8 (UE8M0 exponents) but the ue8m0 option is off", op, name);
    moefuse_status status = mf_check_tensor(ctx, op, name, scales, rank, allowed);
    if (status != MOEFUSE_OK)
        return status;
    static const char *const layout_what[] = {
        "the row-major layout [T, H/G]",
        "the column-major layout [H/G, round_up(T, 4)]",
        "the packed UE8M0 layout [ceil(H/G/4), round_up(T, 4)]",
    };
    status = mf_expect_shape(ctx, op, name, scales, want, layout_what[opt->scale_layout]);
    if (status != MOEFUSE_OK)
        return status;
    *normalized = masked ? *scales : mf_with_leading_unit(scales);
    return MOEFUSE_OK;
}
