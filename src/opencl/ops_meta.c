/*
 * Host side of the routing kernels of kernels/routing_meta.cl: routing_metadata (by spans of
 * slots up to META_SPAN_E experts; beyond, count per expert, place per expert, mark the invalid
 * slots) and the shared experts' slots.
 */
#include "opencl/ocl_internal.h"

/* The routing operands every kernel of kernels/routing_meta.cl starts with. */
static void route_args(mf_kargs *k, const mf_moe_args *r)
{
    mf_karg_operand(k, &r->topk_ids, 1, false);
    mf_karg_operand(k, &r->expert_map, 1, false);
    mf_karg_int(k, r->expert_map.data != NULL);
    mf_karg_long(k, r->tokens);
    mf_karg_long(k, r->topk);
    mf_karg_long(k, r->experts);
    mf_karg_long(k, r->global_experts);
}

/* An optional [M, k] output: buffer, offset, row stride, present. */
static void slot_out(mf_kargs *k, const moefuse_tensor *t)
{
    mf_karg_operand(k, t, 1, false);
    mf_karg_int(k, t->data != NULL);
}

/* The outputs both place kernels take (kernels/routing_meta.cl, MF_META_OUTPUTS). */
static void meta_outputs(mf_kargs *k, const mf_meta_args *a)
{
    mf_karg_operand(k, &a->counts, 0, false);
    mf_karg_long(k, a->block);
    mf_karg_long(k, a->length);
    mf_karg_operand(k, &a->offsets, 0, false);
    mf_karg_int(k, a->offsets.data != NULL);
    mf_karg_operand(k, &a->order, 0, false);
    mf_karg_int(k, a->order.data != NULL);
    slot_out(k, &a->position);
    slot_out(k, &a->masked_row);
}

/* As kernels/routing_meta.cl: the most experts of the span path, a span's work-group. */
#define META_SPAN_E 2048
#define META_WG 64

/* The span path's spans for these args (0: more experts than it takes), and their slots. */
static int64_t meta_spans(const mf_meta_args *a, int64_t *span)
{
    const int64_t E = a->route.experts, S = a->route.tokens * a->route.topk;
    if (E <= 0 || E > META_SPAN_E)
        return 0;
    /* rounds of META_WG slots a span; at most META_WG spans, so that each work-group's sums
     * over the spans stay short */
    int64_t rounds = (S + META_WG * META_WG - 1) / (META_WG * META_WG);
    rounds = rounds < 1 ? 1 : rounds;
    *span = META_WG * rounds;
    return S > 0 ? (S + *span - 1) / *span : 1;
}

moefuse_status mf_ocl_meta_workspace(moefuse_context *ctx, void *state, const mf_meta_args *a,
                                     size_t *bytes)
{
    (void)ctx;
    (void)state;
    int64_t span;
    *bytes = (size_t)(meta_spans(a, &span) * a->route.experts) * sizeof(int32_t);
    return MOEFUSE_OK;
}

/* Span path: each span's counts, then each span's places (kernels/routing_meta.cl). */
static moefuse_status meta_by_spans(moefuse_context *ctx, ocl_state *s, const mf_meta_args *a,
                                    int64_t spans, int64_t span)
{
    static const char op[] = "routing_metadata";
    const mf_moe_args *r = &a->route;
    cl_mem sums;
    MF_TRY(mf_ocl_scratch(ctx, s, (size_t)(spans * r->experts) * sizeof(int32_t), op, &sums));
    const size_t local = META_WG, global = (size_t)spans * META_WG;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_ROUTING_META_SPAN_COUNT]);
    route_args(&k, r);
    mf_karg_long(&k, span);
    mf_karg_mem(&k, sums);
    MF_TRY(mf_ocl_launch(ctx, s, &k, op, 1, &global, &local));

    k = mf_kargs_begin(s->kernels[MF_K_ROUTING_META_SPAN_PLACE]);
    route_args(&k, r);
    mf_karg_long(&k, span);
    mf_karg_mem(&k, sums);
    meta_outputs(&k, a);
    return mf_ocl_launch(ctx, s, &k, op, 1, &global, &local);
}

moefuse_status mf_ocl_routing_metadata(moefuse_context *ctx, void *state, const mf_meta_args *a)
{
    ocl_state *s = state;
    const mf_moe_args *r = &a->route;
    int64_t span;
    const int64_t spans = meta_spans(a, &span);
    if (spans > 0)
        return meta_by_spans(ctx, s, a, spans, span);
    const size_t local = 64;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_ROUTING_META_COUNT]);
    route_args(&k, r);
    mf_karg_operand(&k, &a->counts, 0, false);
    size_t global = mf_round_up((size_t)r->experts, local);
    MF_TRY(mf_ocl_launch(ctx, s, &k, "routing_metadata", 1, &global, &local));

    k = mf_kargs_begin(s->kernels[MF_K_ROUTING_META_PLACE]);
    route_args(&k, r);
    meta_outputs(&k, a);
    global = mf_round_up((size_t)r->experts + 1, local);
    MF_TRY(mf_ocl_launch(ctx, s, &k, "routing_metadata", 1, &global, &local));

    if (!a->position.data && !a->masked_row.data)
        return MOEFUSE_OK;
    k = mf_kargs_begin(s->kernels[MF_K_ROUTING_META_INVALID]);
    route_args(&k, r);
    slot_out(&k, &a->position);
    slot_out(&k, &a->masked_row);
    global = mf_round_up((size_t)(r->tokens * r->topk), local);
    return mf_ocl_launch(ctx, s, &k, "routing_metadata", 1, &global, &local);
}

moefuse_status mf_ocl_moe_shared_routing(moefuse_context *ctx, void *state,
                                         const mf_shared_args *a)
{
    ocl_state *s = state;
    const mf_moe_args *r = &a->route;
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_MOE_SHARED_ROUTING]);
    route_args(&k, r);
    mf_karg_operand(&k, &r->topk_weights, 1, false);
    mf_karg_int(&k, a->weights.data != NULL);
    mf_karg_long(&k, a->n_shared);
    mf_karg_float(&k, a->scale);
    mf_karg_operand(&k, &a->shared_weights, 1, false);
    mf_karg_int(&k, a->shared_weights.data != NULL);
    mf_karg_operand(&k, &a->ids, 0, false);
    mf_karg_operand(&k, a->weights.data ? &a->weights : &a->ids, 0, false);
    const size_t local = 64, global = mf_round_up((size_t)r->tokens, local);
    return mf_ocl_launch(ctx, s, &k, "moe_shared_routing", 1, &global, &local);
}
