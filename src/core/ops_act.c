/*
 * Public entry points of the row-wise operations: act_quant (2-D and masked
 * 3-D), act_mul, quant, dequant. Each validates its operands once, fills an
 * mf_rows_args / mf_dequant_args with everything normalised, and calls the
 * backend.
 */
#include "core/ops_internal.h"
#include "core/options.h"

/* x's last dim is 2H for the gated ops (even, > 0) or H for quant (> 0). */
static moefuse_status row_width(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                bool gated, int64_t *hidden)
{
    int64_t width = x->shape[x->rank - 1];
    if (width == 0 || (gated && width % 2 != 0))
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        gated ? "%s: x has %lld channels; the gated input needs an even number "
                                "> 0 ([gate | up], 2H)"
                              : "%s: x has %lld channels; it needs at least one",
                        op, (long long)width);
    *hidden = gated ? width / 2 : width;
    return MOEFUSE_OK;
}

/* Run (or measure) a row-wise operation whose arguments are valid. */
typedef moefuse_status (*rows_fn)(moefuse_context *, void *, const mf_rows_args *);

static moefuse_status run_rows(moefuse_context *ctx, const char *op, rows_fn fn,
                               const mf_rows_args *a, size_t *measure)
{
    if (!fn)
        return mf_unimplemented(ctx, op);
    size_t need = 0;
    if (ctx->backend->rows_workspace && mf_workspace_matters(ctx, measure))
        MF_TRY(ctx->backend->rows_workspace(ctx, ctx->state, a, &need));
    bool run;
    MF_TRY(mf_workspace_step(ctx, op, need, measure, &run));
    return run ? fn(ctx, ctx->state, a) : MOEFUSE_OK;
}

/* The 2-D quantizing calls share everything but the activation. */
static moefuse_status rows_2d(moefuse_context *ctx, const char *op, bool gated,
                              const moefuse_tensor *x, const moefuse_tensor *row_scale,
                              const moefuse_tensor *q, const moefuse_tensor *scales,
                              const moefuse_act_options *act, const moefuse_quant_options *quant,
                              mf_rows_args *a, bool *idle)
{
    MF_TRY(mf_check_tensor(ctx, op, "x", x, 2, MF_FLOATS));
    MF_TRY(row_width(ctx, op, x, gated, &a->hidden));
    a->experts = 1;
    a->rows = x->shape[0];
    MF_TRY(mf_check_tensor(ctx, op, "q", q, 2, MF_QUANTIZED));
    int64_t q_shape[2] = {a->rows, a->hidden};
    MF_TRY(mf_expect_shape(ctx, op, "q", q, q_shape, gated ? "x [T, 2H]" : "x [T, H]"));
    if (gated)
        MF_TRY(mf_normalize_act(ctx, op, act, &a->act));
    MF_TRY(mf_normalize_quant(ctx, op, quant, q->dtype, a->hidden, &a->quant));
    MF_TRY(mf_check_optional(ctx, op, "row_scale", row_scale, 1, MF_DT(MOEFUSE_F32)));
    if (mf_present(row_scale))
        MF_TRY(mf_expect_shape(ctx, op, "row_scale", row_scale, &a->rows, "x [T, ...]"));
    a->group = a->quant.group_size;
    a->groups = a->hidden / a->group;
    a->rows_padded = (a->rows + 3) / 4 * 4;
    MF_TRY(mf_check_scales(ctx, op, "scales", scales, &a->quant, false, 1, a->rows, a->groups, &a->scales));
    a->activate = gated;
    a->x = mf_with_leading_unit(x);
    a->out = mf_with_leading_unit(q);
    a->row_scale = mf_present(row_scale) ? mf_with_leading_unit(row_scale) : mf_absent();
    a->counts = mf_absent();
    a->expert_scale = mf_absent();
    const mf_operand operands[] = {
        {"x", x, false}, {"row_scale", row_scale, false}, {"q", q, true}, {"scales", scales, true}};
    return mf_check_outputs(ctx, op, operands, sizeof operands / sizeof operands[0], idle);
}

static moefuse_status act_quant(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                const moefuse_tensor *row_scale, const moefuse_tensor *q,
                                const moefuse_tensor *scales, const moefuse_act_quant_options *opt,
                                size_t *measure)
{
    mf_rows_args a = {0};
    bool idle;
    if (opt)
        MF_TRY(MF_CHECK_RESERVED(ctx, op, "act_quant options", opt->reserved));
    MF_TRY(rows_2d(ctx, op, true, x, row_scale, q, scales, opt ? &opt->act : NULL,
                  opt ? &opt->quant : NULL, &a, &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    return run_rows(ctx, op, ctx->backend->act_quant, &a, measure);
}

moefuse_status mf_quant_call(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                             const moefuse_tensor *q, const moefuse_tensor *scales,
                             const moefuse_quant_options *opt, size_t *measure)
{
    mf_rows_args a = {0};
    bool idle;
    MF_TRY(rows_2d(ctx, op, false, x, NULL, q, scales, NULL, opt, &a, &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    return run_rows(ctx, op, ctx->backend->quant, &a, measure);
}

static moefuse_status act_quant_masked(moefuse_context *ctx, const char *op,
                                       const moefuse_tensor *x, const moefuse_tensor *counts,
                                       const moefuse_tensor *row_scale,
                                       const moefuse_tensor *expert_scale, const moefuse_tensor *q,
                                       const moefuse_tensor *scales,
                                       const moefuse_act_quant_options *opt, size_t *measure)
{
    mf_rows_args a = {0};
    MF_TRY(mf_check_tensor(ctx, op, "x", x, 3, MF_FLOATS));
    MF_TRY(row_width(ctx, op, x, true, &a.hidden));
    a.experts = x->shape[0];
    a.rows = x->shape[1];
    MF_TRY(mf_check_tensor(ctx, op, "counts", counts, 1, MF_DT(MOEFUSE_I32)));
    MF_TRY(mf_expect_shape(ctx, op, "counts", counts, &a.experts, "x [E, Tmax, 2H]"));
    MF_TRY(mf_check_tensor(ctx, op, "q", q, 3, MF_QUANTIZED));
    int64_t q_shape[3] = {a.experts, a.rows, a.hidden};
    MF_TRY(mf_expect_shape(ctx, op, "q", q, q_shape, "x [E, Tmax, 2H]"));
    if (opt)
        MF_TRY(MF_CHECK_RESERVED(ctx, op, "act_quant options", opt->reserved));
    MF_TRY(mf_normalize_act(ctx, op, opt ? &opt->act : NULL, &a.act));
    MF_TRY(mf_normalize_quant(ctx, op, opt ? &opt->quant : NULL, q->dtype, a.hidden, &a.quant));
    MF_TRY(mf_check_optional(ctx, op, "row_scale", row_scale, 2, MF_DT(MOEFUSE_F32)));
    if (mf_present(row_scale))
        MF_TRY(mf_expect_shape(ctx, op, "row_scale", row_scale, q_shape, "x [E, Tmax, ...]"));
    MF_TRY(mf_check_optional(ctx, op, "expert_scale", expert_scale, 1,
                            MF_DT(MOEFUSE_F32) | MF_DT(MOEFUSE_BF16)));
    if (mf_present(expert_scale))
        MF_TRY(mf_expect_shape(ctx, op, "expert_scale", expert_scale, &a.experts, "x [E, ...]"));
    a.group = a.quant.group_size;
    a.groups = a.hidden / a.group;
    a.rows_padded = (a.rows + 3) / 4 * 4;
    MF_TRY(mf_check_scales(ctx, op, "scales", scales, &a.quant, true, a.experts, a.rows, a.groups,
                          &a.scales));
    a.activate = true;
    a.zero_tail = opt && opt->zero_tail;
    a.x = *x;
    a.out = *q;
    a.counts = *counts;
    a.row_scale = mf_present(row_scale) ? *row_scale : mf_absent();
    a.expert_scale = mf_present(expert_scale) ? *expert_scale : mf_absent();
    const mf_operand operands[] = {{"x", x, false},           {"counts", counts, false},
                                   {"row_scale", row_scale, false},
                                   {"expert_scale", expert_scale, false},
                                   {"q", q, true},            {"scales", scales, true}};
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, sizeof operands / sizeof operands[0], &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    return run_rows(ctx, op, ctx->backend->act_quant, &a, measure);
}

static moefuse_status act_mul(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                              const moefuse_tensor *row_scale, const moefuse_tensor *out,
                              const moefuse_act_options *opt, size_t *measure)
{
    mf_rows_args a = {0};
    MF_TRY(mf_check_tensor(ctx, op, "x", x, 2, MF_FLOATS));
    MF_TRY(row_width(ctx, op, x, true, &a.hidden));
    a.experts = 1;
    a.rows = x->shape[0];
    MF_TRY(mf_check_tensor(ctx, op, "out", out, 2, MF_DT(x->dtype)));
    int64_t out_shape[2] = {a.rows, a.hidden};
    MF_TRY(mf_expect_shape(ctx, op, "out", out, out_shape, "x [T, 2H]"));
    MF_TRY(mf_normalize_act(ctx, op, opt, &a.act));
    MF_TRY(mf_check_optional(ctx, op, "row_scale", row_scale, 1, MF_DT(MOEFUSE_F32)));
    if (mf_present(row_scale))
        MF_TRY(mf_expect_shape(ctx, op, "row_scale", row_scale, &a.rows, "x [T, ...]"));
    a.activate = true;
    a.x = mf_with_leading_unit(x);
    a.out = mf_with_leading_unit(out);
    a.row_scale = mf_present(row_scale) ? mf_with_leading_unit(row_scale) : mf_absent();
    a.counts = mf_absent();
    a.expert_scale = mf_absent();
    a.scales = mf_absent();
    const mf_operand operands[] = {
        {"x", x, false}, {"row_scale", row_scale, false}, {"out", out, true}};
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, sizeof operands / sizeof operands[0], &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    return run_rows(ctx, op, ctx->backend->act_mul, &a, measure);
}

static moefuse_status dequant(moefuse_context *ctx, const char *op, const moefuse_tensor *q,
                              const moefuse_tensor *scales, const moefuse_tensor *out,
                              const moefuse_quant_options *opt, size_t *measure)
{
    mf_dequant_args a = {0};
    MF_TRY(mf_check_tensor(ctx, op, "q", q, 2, MF_QUANTIZED));
    a.rows = q->shape[0];
    a.hidden = q->shape[1];
    if (a.hidden == 0)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: q has 0 channels; it needs at least one", op);
    MF_TRY(mf_normalize_quant(ctx, op, opt, q->dtype, a.hidden, &a.quant));
    MF_TRY(mf_check_tensor(ctx, op, "out", out, 2, MF_FLOATS));
    MF_TRY(mf_expect_shape(ctx, op, "out", out, q->shape, "q [T, H]"));
    a.group = a.quant.group_size;
    a.groups = a.hidden / a.group;
    a.rows_padded = (a.rows + 3) / 4 * 4;
    MF_TRY(mf_check_scales(ctx, op, "scales", scales, &a.quant, false, 1, a.rows, a.groups, &a.scales));
    a.q = *q;
    a.out = *out;
    const mf_operand operands[] = {{"q", q, false}, {"scales", scales, false}, {"out", out, true}};
    bool idle;
    MF_TRY(mf_check_outputs(ctx, op, operands, sizeof operands / sizeof operands[0], &idle));
    if (idle)
        return mf_nothing_to_do(measure);
    if (!ctx->backend->dequant)
        return mf_unimplemented(ctx, op);
    bool run; /* no backend needs scratch to dequantize */
    MF_TRY(mf_workspace_step(ctx, op, 0, measure, &run));
    return run ? ctx->backend->dequant(ctx, ctx->state, &a) : MOEFUSE_OK;
}

/* ------------------------------------------------------------ entry points */

moefuse_status moefuse_act_quant(moefuse_context *ctx, const moefuse_tensor *x,
                                 const moefuse_tensor *row_scale, const moefuse_tensor *q,
                                 const moefuse_tensor *scales, const moefuse_act_quant_options *opt)
{
    static const char op[] = "act_quant";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, act_quant(ctx, op, x, row_scale, q, scales, opt, NULL));
}

moefuse_status moefuse_act_quant_workspace_size(moefuse_context *ctx, const moefuse_tensor *x,
                                                const moefuse_tensor *row_scale,
                                                const moefuse_tensor *q,
                                                const moefuse_tensor *scales,
                                                const moefuse_act_quant_options *opt, size_t *bytes)
{
    static const char op[] = "act_quant";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, act_quant(ctx, op, x, row_scale, q, scales, opt, bytes));
}

moefuse_status moefuse_act_quant_masked(moefuse_context *ctx, const moefuse_tensor *x,
                                        const moefuse_tensor *counts,
                                        const moefuse_tensor *row_scale,
                                        const moefuse_tensor *expert_scale,
                                        const moefuse_tensor *q, const moefuse_tensor *scales,
                                        const moefuse_act_quant_options *opt)
{
    static const char op[] = "act_quant_masked";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx,
                    act_quant_masked(ctx, op, x, counts, row_scale, expert_scale, q, scales, opt,
                                     NULL));
}

moefuse_status moefuse_act_quant_masked_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *counts,
    const moefuse_tensor *row_scale, const moefuse_tensor *expert_scale, const moefuse_tensor *q,
    const moefuse_tensor *scales, const moefuse_act_quant_options *opt, size_t *bytes)
{
    static const char op[] = "act_quant_masked";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, act_quant_masked(ctx, op, x, counts, row_scale, expert_scale, q, scales,
                                          opt, bytes));
}

moefuse_status moefuse_act_mul(moefuse_context *ctx, const moefuse_tensor *x,
                               const moefuse_tensor *row_scale, const moefuse_tensor *out,
                               const moefuse_act_options *opt)
{
    static const char op[] = "act_mul";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, act_mul(ctx, op, x, row_scale, out, opt, NULL));
}

moefuse_status moefuse_act_mul_workspace_size(moefuse_context *ctx, const moefuse_tensor *x,
                                              const moefuse_tensor *row_scale,
                                              const moefuse_tensor *out,
                                              const moefuse_act_options *opt, size_t *bytes)
{
    static const char op[] = "act_mul";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, act_mul(ctx, op, x, row_scale, out, opt, bytes));
}

moefuse_status moefuse_quant(moefuse_context *ctx, const moefuse_tensor *x,
                             const moefuse_tensor *q, const moefuse_tensor *scales,
                             const moefuse_quant_options *opt)
{
    static const char op[] = "quant";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, mf_quant_call(ctx, op, x, q, scales, opt, NULL));
}

moefuse_status moefuse_quant_workspace_size(moefuse_context *ctx, const moefuse_tensor *x,
                                            const moefuse_tensor *q, const moefuse_tensor *scales,
                                            const moefuse_quant_options *opt, size_t *bytes)
{
    static const char op[] = "quant";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, mf_quant_call(ctx, op, x, q, scales, opt, bytes));
}

moefuse_status moefuse_dequant(moefuse_context *ctx, const moefuse_tensor *q,
                               const moefuse_tensor *scales, const moefuse_tensor *out,
                               const moefuse_quant_options *opt)
{
    static const char op[] = "dequant";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, dequant(ctx, op, q, scales, out, opt, NULL));
}

moefuse_status moefuse_dequant_workspace_size(moefuse_context *ctx, const moefuse_tensor *q,
                                              const moefuse_tensor *scales,
                                              const moefuse_tensor *out,
                                              const moefuse_quant_options *opt, size_t *bytes)
{
    static const char op[] = "dequant";
    MF_TRY(mf_enter_query(ctx, op, bytes));
    return mf_leave(ctx, dequant(ctx, op, q, scales, out, opt, bytes));
}
