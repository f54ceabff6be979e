/*
 * moe_gate_fp8 and moe_final_fp8 of the OpenCL backend (kernels/moe_fp8.cl, a work-group a
 * row; kernels/moe_fp8_tiled.cl, tiles of rows of one expert), routed or masked; the core
 * runs moe_forward_fp8 and moe_masked_fp8 as the two. An f32/f16/bf16 x is first quantized
 * by quant's own kernels into scratch (row-major f32 scales: the same codes and scale values
 * as any act layout holds); the reduced final writes y [M*k, K] in f32 to scratch and
 * mf_moe_reduce sums it in slot order. Each call makes one scratch request, sized from the
 * shapes and the device alone (the *_workspace members).
 */
#include "opencl/ocl_internal.h"

#include <string.h>

enum { FP8_BLOCK = 128, FP8_TM = 16 /* kernels/moe_fp8_tiled.cl: MF_FP8_TM */ };

/* Slots per busy expert from which a routed call takes the tiles (fp8_tiled). */
enum { FP8_TILED_MIN_PER_EXPERT = 8 };

/*
 * Tiles of rows of one expert (kernels/moe_fp8_tiled.cl: each weight block read once a tile)
 * or a work-group a row (kernels/moe_fp8.cl: once a row). From the shapes and the device
 * alone, so that both steps and the workspace queries agree. Measured with PoCL on the 2-core
 * EPYC (docs/PERFORMANCE.md), Qwen3-30B-A3B's experts, a layer call, a row / tiles: 2 slots
 * per busy expert 0.84 / 1.18 s, 8 3.40 / 2.90 s, 16 7.26 / 4.00 s; masked, 64 rows each of 8
 * experts, 0.78-1.12 / 0.89 s (rows of one expert are neighbours there, and share the
 * weights through the caches). MOEFUSE_OPENCL_GEMM=tiled takes the tiles for every call, `simple`
 * a work-group a row.
 */
static bool fp8_tiled(const ocl_state *s, const mf_moe_args *a)
{
    if (s->force_tiled)
        return true;
    if (!s->tiled || a->masked)
        return false;
    const int64_t S = a->tokens * a->topk, busy = a->experts < S ? a->experts : S;
    return busy > 0 && S >= FP8_TILED_MIN_PER_EXPERT * busy;
}

/* The route of a tiled routed call's slots in tiles of FP8_TM (first in both steps'
 * scratch). */
static size_t route_bytes(const ocl_state *s, const mf_moe_args *a)
{
    return a->masked || !fp8_tiled(s, a)
               ? 0
               : mf_round_up(mf_ocl_moe_route_bytes(a, a->tokens * a->topk), 256);
}

/* Tiles the tiled kernels' grids cover: the route's bound, or masked E * ceil(Tmax / TM). */
static size_t tiles_bound(const mf_moe_args *a)
{
    return a->masked ? (size_t)(a->experts * ((a->tokens + FP8_TM - 1) / FP8_TM))
                     : mf_ocl_moe_route_tiles(a, a->tokens * a->topk, FP8_TM);
}

/* The gate's scratch: the route, then x's quantization: codes [blocks, T, K], then row-major
 * f32 scales. */
typedef struct fp8_x_plan {
    bool quantize;
    mf_rows_args q;
    size_t off_codes, codes_bytes, off_scales, bytes;
} fp8_x_plan;

static fp8_x_plan plan_x(const ocl_state *s, const mf_moe_args *a)
{
    fp8_x_plan x;
    memset(&x, 0, sizeof x);
    x.off_codes = x.bytes = route_bytes(s, a);
    x.quantize = a->x.dtype != MOEFUSE_F8_E4M3;
    if (!x.quantize)
        return x;
    const int64_t blocks = a->masked ? a->experts : 1, T = a->tokens, K = a->model_dim;
    mf_rows_args *q = &x.q;
    q->x = mf_tensor_lift3(&a->x);
    /* counts, row_scale, expert_scale stay absent (zeroed): every row is quantized, the
     * masked rows past n[e] unread, and quant takes no scratch of its own */
    q->experts = blocks;
    q->rows = T;
    q->hidden = K;
    q->group = FP8_BLOCK;
    q->groups = K / FP8_BLOCK;
    q->rows_padded = (T + 3) / 4 * 4;
    q->activate = false;
    q->quant = a->act;
    q->quant.group_size = FP8_BLOCK;
    q->quant.scale_layout = MOEFUSE_SCALE_ROW_MAJOR;
    const int64_t qshape[3] = {blocks, T, K}, sshape[3] = {blocks, T, K / FP8_BLOCK};
    q->out = moefuse_tensor_dense(NULL, MOEFUSE_F8_E4M3, 3, qshape);
    q->scales = moefuse_tensor_dense(NULL, MOEFUSE_F32, 3, sshape);
    x.codes_bytes = (size_t)(blocks * T * K);
    x.off_scales = x.off_codes + mf_round_up(x.codes_bytes, 256);
    x.bytes = x.off_scales + (size_t)(blocks * T * (K / FP8_BLOCK)) * sizeof(cl_float);
    return x;
}

/*
 * Quantize x's rows, one expert block at a time: without counts, the row kernels read one
 * block (the 2-D layout), and a call with counts would take scratch of its own.
 */
static moefuse_status quantize_x(moefuse_context *ctx, ocl_state *s, const mf_rows_args *all)
{
    for (int64_t e = 0; e < all->experts; e++) {
        mf_rows_args q = *all;
        q.experts = 1;
        q.x.shape[0] = q.out.shape[0] = q.scales.shape[0] = 1;
        q.x.offset += e * all->x.stride[0] * (int64_t)moefuse_dtype_size(all->x.dtype);
        q.out.offset += e * all->out.stride[0];
        q.scales.offset += e * all->scales.stride[0] * (int64_t)sizeof(cl_float);
        MF_TRY(mf_ocl_quant(ctx, s, &q));
    }
    return MOEFUSE_OK;
}

/* The final's scratch: the route, then the reduced final's f32 y [M * k, K]. */
static size_t y_bytes(const mf_moe_args *a)
{
    return a->reduce && !a->masked
               ? (size_t)(a->tokens * a->topk) * (size_t)a->model_dim * sizeof(cl_float)
               : 0;
}

moefuse_status mf_ocl_moe_gate_fp8_workspace(moefuse_context *ctx, void *state,
                                             const mf_moe_args *a, size_t *bytes)
{
    (void)ctx;
    *bytes = plan_x(state, a).bytes;
    return MOEFUSE_OK;
}

moefuse_status mf_ocl_moe_final_fp8_workspace(moefuse_context *ctx, void *state,
                                              const mf_moe_args *a, size_t *bytes)
{
    (void)ctx;
    *bytes = route_bytes(state, a) + y_bytes(a);
    return MOEFUSE_OK;
}

/* An act-layout scales view: buffer, element offset, the two outer strides, layout, kind. */
static void act_scales_args(mf_kargs *k, const moefuse_tensor *t, moefuse_scale_layout layout)
{
    mf_karg_operand(k, t, 2, false);
    mf_karg_int(k, (int32_t)layout);
    mf_karg_int(k, layout == MOEFUSE_SCALE_PACKED_UE8M0 ? 2 : (t->dtype == MOEFUSE_U8 ? 1 : 0));
}

static void weight_scales_args(mf_kargs *k, const moefuse_tensor *t)
{
    mf_karg_operand(k, t, 2, false);
    mf_karg_int(k, t->dtype == MOEFUSE_U8);
}

static void bias_args(mf_kargs *k, const moefuse_tensor *b)
{
    mf_karg_operand(k, b, 1, true);
    mf_karg_int(k, b->data != NULL);
}

/* Routing (absent in the masked layout) and the masked counts. */
static void rows_args(mf_kargs *k, const mf_moe_args *a)
{
    mf_karg_operand(k, &a->topk_ids, 1, false);
    mf_karg_operand(k, &a->expert_map, 1, false);
    mf_karg_int(k, a->expert_map.data != NULL);
    mf_karg_long(k, a->topk);
    mf_karg_long(k, a->experts);
    mf_karg_long(k, a->global_experts);
    mf_karg_operand(k, &a->counts, 1, false);
    mf_karg_int(k, a->masked);
    mf_karg_long(k, a->masked ? a->tokens : 0);
}

/* A device whose work-groups cannot hold the FP8 kernels' says so rather than computing. */
static moefuse_status fp8_supported(moefuse_context *ctx, const ocl_state *s, const char *op)
{
    return s->fp8 ? MOEFUSE_OK
                  : mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                             "%s: the FP8 kernels need work-groups of 128 and 64 items; %s "
                             "cannot run them",
                             op, s->device_name);
}

/* The x operand of the gate kernels: the call's codes and scales, or their quantization. */
typedef struct fp8_x_view {
    moefuse_tensor codes, scales;
    moefuse_scale_layout layout;
    bool quantized;
} fp8_x_view;

/* The arguments the gate kernels share (kernels/moe_fp8.cl, moe_fp8_tiled.cl), up to
 * `specials`: rows of the scales are padded to 4 where the layout pads them (tpad). */
static void gate_args(mf_kargs *k, const mf_moe_args *a, const fp8_x_view *x, int64_t tpad,
                      int64_t rows)
{
    const moefuse_tensor *xq = &x->codes;
    mf_karg_tensor(k, xq);
    mf_karg_long(k, a->masked ? xq->stride[0] : (x->quantized ? xq->stride[1] : xq->stride[0]));
    mf_karg_long(k, a->masked ? xq->stride[1] : 0);
    act_scales_args(k, &x->scales, x->layout);
    mf_karg_operand(k, &a->w1, 2, false);
    weight_scales_args(k, &a->w1_scales);
    bias_args(k, &a->b1);
    rows_args(k, a);
    mf_karg_long(k, tpad);
    mf_karg_long(k, rows);
    mf_karg_long(k, a->model_dim);
    mf_karg_long(k, a->inter_dim);
    mf_karg_int(k, (int32_t)a->opt.order);
    mf_karg_int(k, (int32_t)a->opt.activation);
    mf_karg_float(k, a->opt.alpha);
    mf_karg_float(k, a->opt.limit);
    mf_karg_float(k, a->opt.up_offset);
    mf_karg_operand(k, &a->h, 2, false);
    act_scales_args(k, &a->h_scales, a->act.scale_layout);
    mf_karg_int(k, a->act.ue8m0 || a->act.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0);
    mf_karg_float(k, a->act.eps);
}

/*
 * The gate: the route (routed), x quantized where it is not e4m3, the rows no tile holds
 * (invalid slots' codes and scales 0, scale padding's scales 0) by moe_fp8.cl's kernel, then
 * the tiles (moe_fp8_tiled.cl).
 */
moefuse_status mf_ocl_moe_gate_fp8(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    static const char op[] = "moe_gate_fp8";
    ocl_state *s = state;
    MF_TRY(fp8_supported(ctx, s, op));
    const int64_t I = a->inter_dim;
    const int64_t rows = a->masked ? a->tokens : a->tokens * a->topk;
    if (rows == 0)
        return MOEFUSE_OK;
    const bool tiled = fp8_tiled(s, a);
    fp8_x_plan xp = plan_x(s, a);
    fp8_x_view xv = {a->x, a->x_scales, a->act.scale_layout, xp.quantize};
    cl_mem scratch = NULL;
    if (xp.bytes > 0)
        MF_TRY(mf_ocl_scratch(ctx, s, xp.bytes, op, &scratch));
    if (tiled && !a->masked)
        MF_TRY(mf_ocl_moe_route(ctx, s, a, scratch, 0, rows, FP8_TM, op));
    if (xp.quantize) {
        xp.q.out.data = xp.q.scales.data = scratch;
        xp.q.out.offset = (int64_t)xp.off_codes;
        xp.q.scales.offset = (int64_t)xp.off_scales;
        MF_TRY(quantize_x(ctx, s, &xp.q));
        xv.codes = xp.q.out;
        xv.scales = xp.q.scales;
        xv.layout = MOEFUSE_SCALE_ROW_MAJOR;
    }
    /* rows of the scales: padded to 4 where the layout pads them */
    const bool pad = a->act.scale_layout != MOEFUSE_SCALE_ROW_MAJOR;
    const int64_t tpad = a->masked ? (pad ? (a->tokens + 3) / 4 * 4 : a->tokens) : 0;
    const int64_t launch_rows = a->masked ? a->experts * tpad : (pad ? (rows + 3) / 4 * 4 : rows);
    /* a work-group a row; beside the tiles, only the rows they do not hold (specials): a
     * routed call's invalid slots (device data) and padding, the masked layout's padding */
    if (!tiled || !a->masked || tpad > a->tokens) {
        mf_kargs k = mf_kargs_begin(s->kernels[MF_K_MOE_FP8_GATE]);
        gate_args(&k, a, &xv, tpad, rows);
        mf_karg_int(&k, tiled);
        const size_t global[2] = {(size_t)I, (size_t)launch_rows}, local[2] = {128, 1};
        MF_TRY(mf_ocl_launch(ctx, s, &k, op, 2, global, local));
    }
    if (!tiled)
        return MOEFUSE_OK;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_MOE_FP8_GATE_TILED]);
    gate_args(&k, a, &xv, tpad, rows);
    mf_karg_int(&k, 0);
    mf_karg_mem(&k, a->masked ? NULL : scratch);
    const size_t global[2] = {(size_t)I, tiles_bound(a)}, local[2] = {128, 1};
    return mf_ocl_launch(ctx, s, &k, op, 2, global, local);
}

/* The arguments the final kernels share, up to `specials`; y at float ybo of y. */
static void final_args(mf_kargs *k, const mf_moe_args *a, bool reduce, cl_mem y, int64_t ybo)
{
    mf_karg_operand(k, &a->h, 2, false);
    act_scales_args(k, &a->h_scales, a->act.scale_layout);
    mf_karg_operand(k, &a->w2, 2, false);
    weight_scales_args(k, &a->w2_scales);
    bias_args(k, &a->b2);
    rows_args(k, a);
    mf_karg_long(k, a->model_dim);
    mf_karg_long(k, a->inter_dim);
    mf_karg_int(k, reduce);
    mf_karg_mem(k, y);
    mf_karg_long(k, ybo);
    if (reduce) { /* out is written by the reduction */
        mf_karg_mem(k, NULL);
        mf_karg_long(k, 0);
        mf_karg_long(k, 0);
        mf_karg_long(k, 0);
        mf_karg_int(k, (int32_t)a->out.dtype);
    } else {
        mf_karg_operand(k, &a->out, 2, true);
    }
}

/*
 * The final: the route (routed), the invalid slots' zero rows of an un-reduced out by
 * moe_fp8.cl's kernel, the tiles (moe_fp8_tiled.cl), then a reduced call's top-k sum.
 */
moefuse_status mf_ocl_moe_final_fp8(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    static const char op[] = "moe_final_fp8";
    ocl_state *s = state;
    MF_TRY(fp8_supported(ctx, s, op));
    const int64_t K = a->model_dim;
    const int64_t rows = a->masked ? a->experts * a->tokens : a->tokens * a->topk;
    const bool reduce = a->reduce && !a->masked;
    if (rows == 0) {
        if (!reduce || a->tokens == 0)
            return MOEFUSE_OK;
        /* k = 0: every token's sum is empty: the reduction writes its zeros */
    }
    const bool tiled = fp8_tiled(s, a);
    const size_t rbytes = route_bytes(s, a);
    const int64_t ybo = (int64_t)(rbytes / sizeof(cl_float));
    cl_mem scratch = NULL;
    if (rows > 0 && rbytes + y_bytes(a) > 0)
        MF_TRY(mf_ocl_scratch(ctx, s, rbytes + y_bytes(a), op, &scratch));
    if (rows > 0 && tiled && !a->masked)
        MF_TRY(mf_ocl_moe_route(ctx, s, a, scratch, 0, rows, FP8_TM, op));
    /* a work-group a row; beside the tiles, only an un-reduced routed out's invalid slots */
    if (rows > 0 && (!tiled || (!a->masked && !reduce))) {
        mf_kargs k = mf_kargs_begin(s->kernels[MF_K_MOE_FP8_FINAL]);
        final_args(&k, a, reduce, scratch, ybo);
        mf_karg_int(&k, tiled);
        const size_t global[2] = {mf_round_up((size_t)K, 64), (size_t)rows};
        const size_t local[2] = {64, 1};
        MF_TRY(mf_ocl_launch(ctx, s, &k, op, 2, global, local));
    }
    if (rows > 0 && tiled) {
        mf_kargs k = mf_kargs_begin(s->kernels[MF_K_MOE_FP8_FINAL_TILED]);
        final_args(&k, a, reduce, scratch, ybo);
        mf_karg_int(&k, 0);
        mf_karg_mem(&k, a->masked ? NULL : scratch);
        const size_t global[2] = {mf_round_up((size_t)K, 64), tiles_bound(a)};
        const size_t local[2] = {64, 1};
        MF_TRY(mf_ocl_launch(ctx, s, &k, op, 2, global, local));
    }
    if (!reduce)
        return MOEFUSE_OK;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_MOE_REDUCE]);
    mf_karg_operand(&k, &a->topk_ids, 1, false);
    mf_karg_operand(&k, &a->topk_weights, 1, false);
    mf_karg_operand(&k, &a->expert_map, 1, false);
    mf_karg_int(&k, a->expert_map.data != NULL);
    mf_karg_long(&k, a->topk);
    mf_karg_long(&k, a->experts);
    mf_karg_long(&k, a->global_experts);
    mf_karg_long(&k, K);
    mf_karg_long(&k, 0);
    mf_karg_mem(&k, scratch);
    mf_karg_long(&k, ybo);
    mf_karg_operand(&k, &a->out, 1, true);
    const size_t rg[2] = {mf_round_up((size_t)K, 64), (size_t)a->tokens}, rlocal[2] = {64, 1};
    return mf_ocl_launch(ctx, s, &k, op, 2, rg, rlocal);
}
