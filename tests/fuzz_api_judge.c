/* fuzz_api: what the API must do with a call (include/moefuse.h, docs/API.md). */
#include "fuzz_api.h"

#include <math.h>

/* ----------------------------------------------------------------- what the API must do */

static void must_refuse_as(verdict *v, enum violation_kind kind, const char *fmt, ...)
{
    if (v->expect == EXPECT_REFUSAL)
        return; /* the first reason is enough */
    v->expect = EXPECT_REFUSAL;
    v->kind = kind;
    va_list args;
    va_start(args, fmt);
    vsnprintf(v->why, sizeof v->why, fmt, args);
    va_end(args);
}

#define must_refuse(v, ...) must_refuse_as((v), V_ACCEPTED_INVALID, __VA_ARGS__)

static void may_refuse(verdict *v)
{
    if (v->expect == EXPECT_OK)
        v->expect = EXPECT_EITHER;
}

/* Layout rules of a non-empty tensor: strides, offset, alignment, bounds. */
static void judge_layout(const fuzzer *f, const operand *o, verdict *v)
{
    const moefuse_tensor *t = &o->t;
    const int last = t->rank - 1;
    if (t->stride[last] != 1) {
        if (t->shape[last] > 1)
            must_refuse(v, "%s: innermost stride %lld", o->name, (long long)t->stride[last]);
        else
            may_refuse(v);
    }
    for (int d = 0; d < last; d++) {
        if (t->shape[d] == 1) {
            if (t->stride[d] < 0)
                may_refuse(v);
            continue;
        }
        int64_t extent = inner_extent(t, d);
        if (extent < 0)
            must_refuse(v, "%s: extent overflows", o->name);
        else if (t->stride[d] < extent)
            must_refuse(v, "%s: stride[%d] %lld < %lld (rows overlap or run backwards)", o->name,
                        d, (long long)t->stride[d], (long long)extent);
    }
    if (o->negative_offset)
        must_refuse(v, "%s: negative offset", o->name);
    if (misaligned(o))
        must_refuse(v, "%s: misaligned", o->name);
    int64_t lo, hi;
    if (!arena_reach(o, &lo, &hi))
        must_refuse(v, "%s: extent overflows", o->name);
    else if (f->knows_sizes && o->data == DATA_ARENA && (lo < 0 || hi > f->arena_bytes))
        must_refuse_as(v, V_ACCEPTED_OUT_OF_BOUNDS,
                       "%s: bytes [%lld, %lld) outside its %lld-byte buffer",
                       o->name, (long long)lo, (long long)hi, (long long)f->arena_bytes);
}

static void judge_operand(const fuzzer *f, const operand *o, verdict *v)
{
    const moefuse_tensor *t = &o->t;
    if (!o->passed) {
        if (!o->optional)
            must_refuse(v, "%s: NULL", o->name);
        return;
    }
    if (!operand_present(o))
        return;
    if (t->rank != o->want_rank && t->rank != o->alt_rank) {
        must_refuse(v, "%s: rank %d", o->name, (int)t->rank);
        return;
    }
    if (has_negative_dim(t))
        must_refuse(v, "%s: negative dim", o->name);
    else if (!dtype_in(t->dtype, o->allowed))
        must_refuse(v, "%s: dtype %d", o->name, (int)t->dtype);
    else if (is_empty(t)) { /* any strides, NULL data (rule 1); the rest is unspecified */
        if (o->negative_offset || misaligned(o) || o->data == DATA_FOREIGN ||
            (f->knows_sizes && o->data == DATA_ARENA && o->pos >= f->arena_bytes))
            may_refuse(v);
    } else if (o->data == DATA_NULL)
        must_refuse(v, "%s: NULL data", o->name);
    else if (o->data == DATA_FOREIGN)
        must_refuse(v, "%s: foreign pointer", o->name);
    else
        judge_layout(f, o, v);
}

/* No output may share a byte with another operand of the call (rule 4). */
static void judge_overlap(const fuzz_call *c, verdict *v)
{
    for (int i = 0; i < c->count; i++) {
        const operand *out = &c->v[i];
        int64_t lo, hi;
        if (out->role != ROLE_OUTPUT || !operand_present(out) || out->data != DATA_ARENA ||
            !arena_reach(out, &lo, &hi))
            continue;
        for (int j = 0; j < c->count; j++) {
            const operand *other = &c->v[j];
            int64_t other_lo, other_hi;
            if (j == i || !operand_used(c, other) || !operand_present(other) ||
                other->data != DATA_ARENA || !arena_reach(other, &other_lo, &other_hi))
                continue;
            if (lo < other_hi && other_lo < hi)
                must_refuse_as(v, V_ACCEPTED_OVERLAP,
                               "output %s [%lld, %lld) overlaps %s [%lld, %lld)", out->name,
                               (long long)lo, (long long)hi, other->name, (long long)other_lo,
                               (long long)other_hi);
        }
    }
}

static void judge_act_options(const moefuse_act_options *a, verdict *v)
{
    if ((unsigned)a->activation >= MOEFUSE_ACT_COUNT_)
        must_refuse(v, "activation %d", (int)a->activation);
    if ((unsigned)a->order >= MOEFUSE_GATE_ORDER_COUNT_)
        must_refuse(v, "order %d", (int)a->order);
    if ((unsigned)a->intermediate >= MOEFUSE_ROUNDING_COUNT_)
        must_refuse(v, "intermediate %d", (int)a->intermediate);
    if (isnan(a->limit) || a->limit < 0.0f)
        must_refuse(v, "limit %g", (double)a->limit);
    else if (isinf(a->limit) || (a->limit == 0.0f && signbit(a->limit)))
        may_refuse(v);
    if (a->alpha != 0.0f && a->activation != MOEFUSE_ACT_SILU_ALPHA)
        must_refuse(v, "alpha %g with activation %d", (double)a->alpha, (int)a->activation);
    if (a->activation == MOEFUSE_ACT_SILU_ALPHA && a->alpha != 0.0f &&
        !(a->alpha > 0.0f && isfinite(a->alpha)))
        must_refuse(v, "alpha %g", (double)a->alpha);
    if (!isfinite(a->up_offset))
        must_refuse(v, "up_offset %g", (double)a->up_offset);
}

static void judge_quant_options(const fuzz_call *c, const moefuse_quant_options *q, verdict *v)
{
    if ((unsigned)q->scale_layout >= MOEFUSE_SCALE_LAYOUT_COUNT_)
        must_refuse(v, "scale_layout %d", (int)q->scale_layout);
    float eps = q->eps;
    if (eps != 0.0f && (isnan(eps) || isinf(eps) || eps < 1e-35f))
        must_refuse(v, "eps %g", (double)eps); /* rule 2 */
    else if (eps == 0.0f && signbit(eps))
        may_refuse(v);
    if (q->group_size < 0)
        must_refuse(v, "group_size %lld", (long long)q->group_size);
    else if (q->group_size != 0 && q->group_size != 32 && q->group_size != 64 &&
             q->group_size != 128 && q->group_size != c->hidden)
        may_refuse(v); /* depends on H */
    const operand *codes = code_operand(c);
    bool ue8m0 = q->ue8m0 != 0 || q->scale_layout == MOEFUSE_SCALE_PACKED_UE8M0;
    if (codes->passed && codes->t.dtype == MOEFUSE_I8 && ue8m0)
        must_refuse(v, "UE8M0 scales with i8 codes");
}

static void judge_options(const fuzz_call *c, verdict *v)
{
    if (c->null_options)
        return;
    if (takes_act_options(c->op))
        judge_act_options(&c->aq.act, v);
    if (takes_quant_options(c->op))
        judge_quant_options(c, &c->aq.quant, v);
    if (is_moe(c->op)) {
        moefuse_act_options a = {.activation = c->moe.activation, .order = c->moe.order,
                                 .limit = c->moe.limit, .alpha = c->moe.alpha,
                                 .up_offset = c->moe.up_offset};
        judge_act_options(&a, v);
    }
    if (c->op == OP_TOPK_ROUTE) {
        const moefuse_router_options *o = &c->route;
        if ((unsigned)o->scoring > MOEFUSE_ROUTER_TOPK_SOFTMAX)
            must_refuse(v, "scoring %d", (int)o->scoring);
        if ((unsigned)o->group_scoring > MOEFUSE_GROUP_MAX)
            must_refuse(v, "group_scoring %d", (int)o->group_scoring);
        if (!isfinite(o->scale))
            must_refuse(v, "scale %g", (double)o->scale);
        if (o->n_group < 0 || o->n_group > MOEFUSE_ROUTER_MAX_GROUPS)
            must_refuse(v, "n_group %d", (int)o->n_group);
        for (int i = 0; i < 4; i++)
            if (o->reserved[i])
                must_refuse(v, "router options reserved[%d]", i);
    }
}

/* routing_metadata's block size: refused below 1 whatever the tensors. */
static void judge_block_size(const fuzz_call *c, verdict *v)
{
    if (c->op == OP_ROUTING_META && c->block_size < 1)
        must_refuse(v, "block_size %d", (int)c->block_size);
}

/* Shared experts: the fuzzer's calls have none, so any it was given must be refused
 * (perturb_shared gives only counts and scales no call takes). */
static void judge_shared(const fuzz_call *c, verdict *v)
{
    if (c->n_shared != 0)
        must_refuse(v, "routing.n_shared %d", (int)c->n_shared);
}

verdict expected_outcome(const fuzzer *f, const fuzz_call *c)
{
    verdict v = {c->maybe_invalid ? EXPECT_EITHER : EXPECT_OK, V_ACCEPTED_INVALID, ""};
    if (c->null_context)
        must_refuse(&v, "ctx NULL");
    if (c->null_routing)
        must_refuse(&v, "routing NULL");
    for (int i = 0; i < c->count; i++)
        if (operand_used(c, &c->v[i]))
            judge_operand(f, &c->v[i], &v);
    judge_overlap(c, &v);
    judge_options(c, &v);
    judge_block_size(c, &v);
    judge_shared(c, &v);
    return v;
}
