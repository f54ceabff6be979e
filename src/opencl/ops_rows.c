/*
 * Host side of the row operations: act_quant (2-D and masked 3-D), quant,
 * act_mul and dequant. The masked call first turns the device-resident
 * counts into row offsets on the device (the host never reads them), then
 * launches a fixed grid of work-groups over the flattened valid rows.
 */
#include "opencl/ocl_internal.h"

/* h values one lane keeps in registers: MF_PRIV of kernels/rows.cl */
enum { PRIV = 8 };

/* x and row_scale as every row kernel takes them. */
static void row_input_args(mf_kargs *k, const mf_rows_args *a)
{
    mf_karg_operand(k, &a->x, 2, true);
    mf_karg_operand(k, &a->row_scale, 2, false);
    mf_karg_int(k, a->row_scale.data != NULL);
}

/* Work-groups for a grid-stride walk over `rows` rows. */
static size_t row_groups(const ocl_state *s, int64_t rows)
{
    size_t cap = (size_t)s->compute_units * 32;
    return rows < (int64_t)cap ? (size_t)(rows > 0 ? rows : 0) : cap;
}

static moefuse_status rows_quant(moefuse_context *ctx, ocl_state *s, const mf_rows_args *a,
                                 const char *op)
{
    const bool masked = a->counts.data != NULL;
    const moefuse_scale_layout layout = a->quant.scale_layout;
    cl_mem offs = NULL;
    if (masked) {
        MF_TRY(mf_ocl_scratch(ctx, s, (size_t)(a->experts + 1) * sizeof(cl_long), op, &offs));
        mf_kargs k = mf_kargs_begin(s->kernels[MF_K_COUNT_PREFIX]);
        mf_karg_operand(&k, &a->counts, 1, false);
        mf_karg_long(&k, a->experts);
        mf_karg_long(&k, a->rows);
        mf_karg_mem(&k, offs);
        const size_t one = 1;
        MF_TRY(mf_ocl_launch(ctx, s, &k, op, 1, &one, &one));
    }

    /* lanes per quantization group: the fewest (a power of two, at most the
     * work-group) that hold a group in registers at PRIV values each. Small
     * groups then share a work-group pass (fewer barriers per row), and a
     * whole-row group gets the whole work-group. H100, T=4096 H=7168 G=128:
     * 315 GB/s with 32 lanes recomputing h, 467 with 16 lanes in registers. */
    size_t lanes = 1;
    while (lanes < s->wg && (int64_t)lanes * PRIV < a->group)
        lanes *= 2;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_ROWS_QUANT]);
    row_input_args(&k, a);
    mf_karg_operand(&k, &a->expert_scale, 1, true);
    mf_karg_int(&k, a->expert_scale.data != NULL);
    mf_karg_mem(&k, offs);
    mf_karg_int(&k, masked);
    mf_karg_long(&k, a->experts);
    mf_karg_long(&k, a->rows);
    mf_karg_long(&k, a->hidden);
    mf_karg_long(&k, a->group);
    mf_karg_long(&k, a->groups);
    mf_karg_int(&k, a->activate);
    mf_karg_int(&k, (int32_t)a->act.activation);
    mf_karg_int(&k, (int32_t)a->act.order);
    mf_karg_float(&k, a->act.limit);
    mf_karg_int(&k, a->act.intermediate == MOEFUSE_ROUND_BF16);
    mf_karg_operand(&k, &a->out, 2, true);
    mf_karg_operand(&k, &a->scales, 2, true);
    mf_karg_int(&k, (int32_t)layout);
    mf_karg_int(&k, a->quant.ue8m0 || layout == MOEFUSE_SCALE_PACKED_UE8M0);
    mf_karg_float(&k, a->quant.eps);
    mf_karg_int(&k, (int32_t)lanes);
    mf_karg_local(&k, s->wg * sizeof(cl_float));
    const size_t global = row_groups(s, a->experts * a->rows) * s->wg;
    MF_TRY(mf_ocl_launch(ctx, s, &k, op, 1, &global, &s->wg));

    /* rows that are zeroed rather than computed: the tail (zero_tail) and the padding */
    const bool tail = a->zero_tail && masked;
    const int64_t t_begin = tail ? 0 : a->rows;
    const int64_t t_end = layout == MOEFUSE_SCALE_ROW_MAJOR ? a->rows : a->rows_padded;
    if (t_end <= t_begin)
        return MOEFUSE_OK;
    k = mf_kargs_begin(s->kernels[MF_K_ROWS_TAIL]);
    mf_karg_mem(&k, offs);
    mf_karg_int(&k, masked);
    mf_karg_int(&k, tail);
    mf_karg_long(&k, a->experts);
    mf_karg_long(&k, a->rows);
    mf_karg_long(&k, t_begin);
    mf_karg_long(&k, t_end);
    mf_karg_long(&k, a->hidden);
    mf_karg_long(&k, a->groups);
    mf_karg_operand(&k, &a->out, 2, false);
    mf_karg_operand(&k, &a->scales, 2, true);
    mf_karg_int(&k, (int32_t)layout);
    const size_t local = 64;
    const size_t n = mf_round_up((size_t)(a->experts * (t_end - t_begin)), local);
    return mf_ocl_launch(ctx, s, &k, op, 1, &n, &local);
}

moefuse_status mf_ocl_act_quant(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    return rows_quant(ctx, state, a, a->counts.data ? "act_quant_masked" : "act_quant");
}

moefuse_status mf_ocl_quant(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    return rows_quant(ctx, state, a, "quant");
}

moefuse_status mf_ocl_act_mul(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    ocl_state *s = state;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_ROWS_ACT_MUL]);
    row_input_args(&k, a);
    mf_karg_long(&k, a->rows);
    mf_karg_long(&k, a->hidden);
    mf_karg_int(&k, (int32_t)a->act.activation);
    mf_karg_int(&k, (int32_t)a->act.order);
    mf_karg_float(&k, a->act.limit);
    mf_karg_int(&k, a->act.intermediate == MOEFUSE_ROUND_BF16);
    mf_karg_operand(&k, &a->out, 2, true);
    const size_t global = row_groups(s, a->rows) * s->wg;
    return mf_ocl_launch(ctx, s, &k, "act_mul", 1, &global, &s->wg);
}

moefuse_status mf_ocl_dequant(moefuse_context *ctx, void *state, const mf_dequant_args *a)
{
    ocl_state *s = state;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_DEQUANT]);
    mf_karg_operand(&k, &a->q, 1, true);
    mf_karg_tensor(&k, &a->scales);
    mf_karg_long(&k, a->scales.stride[1]); /* rank 3 with E = 1: dim 1 is t or g */
    mf_karg_int(&k, (int32_t)a->scales.dtype);
    mf_karg_int(&k, (int32_t)a->quant.scale_layout);
    mf_karg_operand(&k, &a->out, 1, true);
    mf_karg_long(&k, a->rows);
    mf_karg_long(&k, a->hidden);
    mf_karg_long(&k, a->group);
    const size_t total = (size_t)(a->rows * a->hidden);
    const size_t cap = (size_t)s->compute_units * 32 * s->wg;
    const size_t global = mf_round_up(total < cap ? total : cap, s->wg);
    return mf_ocl_launch(ctx, s, &k, "dequant", 1, &global, &s->wg);
}
