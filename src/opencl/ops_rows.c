/*
 * Host side of the row operations: act_quant (2-D and masked 3-D), quant,
 * act_mul and dequant. The masked call first turns the device-resident
 * counts into row offsets on the device (the host never reads them), then
 * launches a fixed grid of work-groups over the flattened valid rows.
 */
#include "opencl/ocl_internal.h"
#include "numerics/mf_act_table.h"

/* Consecutive channels of one lane: MF_PER_LANE of kernels/rows.cl */
enum { PER_LANE = 8 };

/* A lane's PER_LANE channels are one chunk of mf_ocl_chunks_aligned (the kernels add multiples
 * of 8 to an aligned row): 16-byte loads of bf16 / f16 (two of f32), 8-byte stores of codes. */
_Static_assert(PER_LANE == MF_OCL_CHUNK, "a lane's channels are one aligned chunk");

/* x and row_scale as every row kernel takes them. */
static void row_input_args(mf_kargs *k, const mf_rows_args *a)
{
    mf_karg_operand(k, &a->x, 2, true);
    mf_karg_operand(k, &a->row_scale, 2, false);
    mf_karg_int(k, a->row_scale.data != NULL);
}

/* The gated activation's options, as the act_quant and act_mul kernels take them. */
static void act_args(mf_kargs *k, const moefuse_act_options *act)
{
    mf_karg_int(k, (int32_t)act->activation);
    mf_karg_int(k, (int32_t)act->order);
    mf_karg_float(k, act->limit);
    mf_karg_float(k, act->alpha);
    mf_karg_float(k, act->up_offset);
    mf_karg_int(k, act->intermediate == MOEFUSE_ROUND_BF16);
}

/* Work-groups for a grid-stride walk over `items` items: at most 32 per compute unit on a
 * GPU (the rest of the items loop); on a CPU device (PoCL runs a work-group as a loop over
 * its work-items, barrier to barrier) more and shorter ones keep each group's memory close:
 * act_mul T=4096 H=2048 86 -> 60 ms on PoCL. */
static size_t item_groups(const ocl_state *s, int64_t items)
{
    size_t cap = (size_t)s->compute_units * (s->cpu_device ? 512 : 32);
    return items < (int64_t)cap ? (size_t)(items > 0 ? items : 0) : cap;
}

/* The variant of mf_rows_quant a call can take: a specialised one (kernels/rows_kernels.cl,
 * MF_SPEC_*) where the call has none of the options it leaves out, else the general one. bf16 x
 * with an activation that has a table (not silu_alpha) and no options takes a table kernel where
 * the context has the tables. */
static enum mf_ocl_kernel quant_kernel(const ocl_state *s, const mf_rows_args *a, size_t lanes,
                                       bool vec)
{
    const bool simple = vec && lanes <= 32 &&
                        (int64_t)lanes * PER_LANE >= a->group && a->row_scale.data == NULL &&
                        a->expert_scale.data == NULL;
    if (simple && !a->activate)
        return MF_K_ROWS_QUANT_H;
    const bool plain = simple && !(a->act.limit > 0.0f) &&
                       a->act.intermediate != MOEFUSE_ROUND_BF16 && a->act.up_offset == 0.0f &&
                       a->act.order != MOEFUSE_GATE_INTERLEAVED;
    if (plain && s->act_tables && a->x.dtype == MOEFUSE_BF16 &&
        mf_act_table_has((int)a->act.activation))
        return s->table_local ? MF_K_ROWS_QUANT_TAB_LOCAL : MF_K_ROWS_QUANT_TAB_GLOBAL;
    if (plain && a->act.activation == MOEFUSE_ACT_SILU)
        return MF_K_ROWS_QUANT_SILU;
    return MF_K_ROWS_QUANT;
}

/* The masked layout's row offsets, in scratch (rows_quant); 0 for the 2-D calls. */
static size_t offsets_bytes(const mf_rows_args *a)
{
    return a->counts.data ? (size_t)(a->experts + 1) * sizeof(cl_long) : 0;
}

moefuse_status mf_ocl_rows_workspace(moefuse_context *ctx, void *state, const mf_rows_args *a,
                                     size_t *bytes)
{
    (void)ctx;
    (void)state;
    *bytes = offsets_bytes(a);
    return MOEFUSE_OK;
}

static moefuse_status rows_quant(moefuse_context *ctx, ocl_state *s, const mf_rows_args *a,
                                 const char *op)
{
    const bool masked = a->counts.data != NULL;
    const moefuse_scale_layout layout = a->quant.scale_layout;
    cl_mem offs = NULL;
    if (masked) {
        MF_TRY(mf_ocl_scratch(ctx, s, offsets_bytes(a), op, &offs));
        mf_kargs k = mf_kargs_begin(s->kernels[MF_K_COUNT_PREFIX]);
        mf_karg_operand(&k, &a->counts, 1, false);
        mf_karg_long(&k, a->experts);
        mf_karg_long(&k, a->rows);
        mf_karg_mem(&k, offs);
        const size_t one = 1;
        MF_TRY(mf_ocl_launch(ctx, s, &k, op, 1, &one, &one));
    }

    /* lanes per quantization group: the fewest (a power of two, at most the
     * work-group) that hold a group in registers at PER_LANE values each.
     * Small groups then share an item (one barrier for wg / lanes groups),
     * and a group wider than PER_LANE x wg is an item of its own. */
    size_t lanes = 1;
    while (lanes < s->wg && (int64_t)lanes * PER_LANE < a->group)
        lanes *= 2;
    const bool g8 = a->group % PER_LANE == 0;
    const bool vec_x = g8 && mf_ocl_chunks_aligned(&a->x, 2);
    const bool vec_q = g8 && mf_ocl_chunks_aligned(&a->out, 2);
    const int64_t per_item = (int64_t)(s->wg / lanes);
    const int64_t items = a->experts * a->rows * ((a->groups + per_item - 1) / per_item);
    mf_kargs k = mf_kargs_begin(s->kernels[quant_kernel(s, a, lanes, vec_x && vec_q)]);
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
    act_args(&k, &a->act);
    mf_karg_operand(&k, &a->out, 2, true);
    mf_karg_operand(&k, &a->scales, 2, true);
    mf_karg_int(&k, (int32_t)layout);
    mf_karg_int(&k, a->quant.ue8m0 || layout == MOEFUSE_SCALE_PACKED_UE8M0);
    mf_karg_float(&k, a->quant.eps);
    mf_karg_int(&k, (int32_t)lanes);
    mf_karg_int(&k, vec_x);
    mf_karg_int(&k, vec_q);
    mf_karg_mem(&k, s->act_tables); /* read by the table kernels only */
    const int act = (int)a->act.activation;
    mf_karg_int(&k, s->act_tables && mf_act_table_has(act) ? act * (int32_t)MF_TAB_ENTRIES : 0);
    /* (the table kernel with its local copy too: fewer, longer groups were slower on the H100,
     * masked E=256 Tmax=128 H=7168 36.1% of copy with 8 per compute unit, 38.7% with 32) */
    const size_t global = item_groups(s, items) * s->wg;
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
    mf_karg_int(&k, a->hidden % PER_LANE == 0 && mf_ocl_chunks_aligned(&a->out, 2));
    const size_t tail_global = item_groups(s, a->experts * (t_end - t_begin)) * s->wg;
    return mf_ocl_launch(ctx, s, &k, op, 1, &tail_global, &s->wg);
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
    act_args(&k, &a->act);
    mf_karg_operand(&k, &a->out, 2, true);
    const bool h8 = a->hidden % PER_LANE == 0;
    mf_karg_int(&k, h8 && mf_ocl_chunks_aligned(&a->x, 2));
    mf_karg_int(&k, h8 && mf_ocl_chunks_aligned(&a->out, 2));
    const int64_t width = (int64_t)(PER_LANE * s->wg);
    const size_t global = item_groups(s, a->rows * ((a->hidden + width - 1) / width)) * s->wg;
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
