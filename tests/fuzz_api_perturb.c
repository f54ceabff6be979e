/* fuzz_api: the perturbations that make a valid call (possibly) invalid. */
#include "fuzz_api.h"

#include <math.h>

/* ----------------------------------------------------------------- perturbations */

typedef bool operand_filter(const fuzz_call *c, const operand *o);

static bool any_operand(const fuzz_call *c, const operand *o) { return (void)c, o->passed; }

static bool shaped_operand(const fuzz_call *c, const operand *o)
{
    return (void)c, o->passed && rank_ok(&o->t);
}

/* In the arena, with elements whose reach is known. */
static bool placed_operand(const fuzz_call *c, const operand *o)
{
    return (void)c, o->passed && o->data == DATA_ARENA && placed_bytes(o) > 0;
}

static bool empty_operand(const fuzz_call *c, const operand *o)
{
    return (void)c, o->passed && is_empty(&o->t);
}

/* A random operand that passes the filter, or -1. */
static int pick_operand(rng *r, const fuzz_call *c, operand_filter *filter)
{
    int candidates[MAX_OPERANDS], n = 0;
    for (int i = 0; i < c->count; i++)
        if (filter(c, &c->v[i]))
            candidates[n++] = i;
    return n ? candidates[rng_int(r, 0, n - 1)] : -1;
}

static bool perturb_dim(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int64_t odd[] = {0, -1, -7, INT64_MIN, INT64_MAX, (int64_t)1 << 40,
                                  (int64_t)1 << 31, 3};
    int i = pick_operand(r, c, shaped_operand);
    if (i < 0)
        return false;
    moefuse_tensor *t = &c->v[i].t;
    int d = (int)rng_int(r, 0, t->rank - 1);
    int64_t old = t->shape[d];
    switch (rng_int(r, 0, 3)) {
    case 0: t->shape[d] = add_sat(old, 1); break;
    case 1: t->shape[d] = add_sat(old, -1); break;
    case 2: t->shape[d] = mul_sat(old, 2); break;
    default: t->shape[d] = PICK(r, odd); break;
    }
    note(c, "%s shape[%d] %lld -> %lld", c->v[i].name, d, (long long)old, (long long)t->shape[d]);
    c->maybe_invalid = true;
    return t->shape[d] != old;
}

static bool perturb_rank(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int32_t odd[] = {0, -1, 5, 64, INT32_MIN};
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    moefuse_tensor *t = &c->v[i].t;
    int32_t old = t->rank, rank;
    int64_t choice = rng_int(r, 0, 9);
    int64_t step = choice < 4 ? -1 : 1;
    rank = choice < 8 && old > INT32_MIN && old < INT32_MAX ? (int32_t)(old + step) : PICK(r, odd);
    if (rank > old && rank <= MOEFUSE_MAX_RANK && old >= 0)
        for (int d = old; d < rank; d++)
            t->shape[d] = 1, t->stride[d] = 1;
    t->rank = rank;
    note(c, "%s rank %d -> %d", c->v[i].name, (int)old, (int)rank);
    c->maybe_invalid = true;
    return rank != old;
}

static bool perturb_dtype(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int odd[] = {-1, MOEFUSE_DTYPE_COUNT_, 1000, INT32_MIN};
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    moefuse_tensor *t = &c->v[i].t;
    moefuse_dtype old = t->dtype;
    t->dtype = rng_percent(r, 75) ? (moefuse_dtype)rng_int(r, 0, MOEFUSE_DTYPE_COUNT_ - 1)
                                  : (moefuse_dtype)PICK(r, odd);
    note(c, "%s dtype %d -> %d", c->v[i].name, (int)old, (int)t->dtype);
    c->maybe_invalid = true;
    return t->dtype != old;
}

/* Whether the stride is legal is judged from the result (expected_outcome). */
static bool perturb_stride(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int64_t innermost[] = {0, 2, -1, 3, (int64_t)1 << 40};
    static const int64_t odd[] = {0, -1, (int64_t)1 << 40, INT64_MIN, INT64_MAX};
    int i = pick_operand(r, c, shaped_operand);
    if (i < 0)
        return false;
    moefuse_tensor *t = &c->v[i].t;
    int d = (int)rng_int(r, 0, t->rank - 1);
    int64_t old = t->stride[d];
    if (d == t->rank - 1) {
        t->stride[d] = PICK(r, innermost);
    } else {
        switch (rng_int(r, 0, 4)) {
        case 0: t->stride[d] = inner_extent(t, d) - 1; break; /* rows overlap by one element */
        case 1: t->stride[d] = mul_sat(old, -1); break;
        case 2: t->stride[d] = add_sat(old, rng_int(r, 1, 64)); break; /* more padding: legal */
        default: t->stride[d] = PICK(r, odd); break;
        }
    }
    note(c, "%s stride[%d] %lld -> %lld", c->v[i].name, d, (long long)old, (long long)t->stride[d]);
    return t->stride[d] != old;
}

/* Elsewhere in the arena: legal unless it now overlaps an operand it must not. */
static bool perturb_move(const fuzzer *f, rng *r, fuzz_call *c)
{
    int i = pick_operand(r, c, placed_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    int64_t span = placed_bytes(o), es = elem_bytes(o->t.dtype);
    if (span > f->arena_bytes)
        return false;
    o->pos = rng_int(r, 0, f->arena_bytes - span) / es * es;
    o->host_split = rng_percent(r, 50) ? 0 : o->pos;
    note(c, "%s moved to %lld", o->name, (long long)o->pos);
    return true;
}

static bool perturb_misalign(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    int i = pick_operand(r, c, placed_operand);
    if (i < 0 || elem_bytes(c->v[i].t.dtype) < 2)
        return false;
    operand *o = &c->v[i];
    o->pos += rng_int(r, 1, elem_bytes(o->t.dtype) - 1);
    o->host_split = rng_percent(r, 50) ? 0 : o->pos;
    note(c, "%s misaligned to %lld", o->name, (long long)o->pos);
    return true;
}

static bool perturb_negative_offset(const fuzzer *f, rng *r, fuzz_call *c)
{
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    int64_t room = f->handles ? 1 << 20 : f->arena_bytes - o->pos; /* host: data stays inside */
    if (room < 1)
        return false;
    o->negative_offset = rng_int(r, 1, room < 4096 ? room : 4096);
    note(c, "%s offset -%lld", o->name, (long long)o->negative_offset);
    return true;
}

/* Only where the library knows buffer sizes: elsewhere it cannot tell, and must not be asked. */
static bool perturb_past_end(const fuzzer *f, rng *r, fuzz_call *c)
{
    if (!f->knows_sizes)
        return false;
    int i = pick_operand(r, c, placed_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    int64_t span = placed_bytes(o), es = elem_bytes(o->t.dtype);
    switch (rng_int(r, 0, 2)) {
    case 0: /* straddles the end */
        o->pos = round_up(f->arena_bytes - span + rng_int(r, 1, span), es);
        break;
    case 1: o->pos = round_up(f->arena_bytes + rng_int(r, 0, 4096), es); break;
    default: o->pos = (int64_t)1 << 40; break;
    }
    note(c, "%s past the end at %lld", o->name, (long long)o->pos);
    return true;
}

/* One operand onto another (in place, or shifted): legal only between inputs. */
static bool perturb_alias(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    int a = pick_operand(r, c, placed_operand), b = pick_operand(r, c, placed_operand);
    if (a < 0 || b < 0 || a == b)
        return false;
    operand *moved = &c->v[a];
    const operand *onto = &c->v[b];
    int64_t delta = 0;
    if (rng_percent(r, 60))
        delta = rng_int(r, -placed_bytes(moved) + 1, placed_bytes(onto) - 1) / 4 * 4;
    moved->pos = onto->pos + delta;
    moved->host_split = moved->pos >= 0 && rng_percent(r, 50) ? moved->pos : 0;
    note(c, "%s aliased onto %s%+lld", moved->name, onto->name, (long long)delta);
    return true;
}

static bool perturb_null_data(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    int i = pick_operand(r, c, any_operand);
    if (i < 0 || c->v[i].data == DATA_NULL)
        return false;
    c->v[i].data = DATA_NULL;
    note(c, "%s data NULL", c->v[i].name);
    return true;
}

static bool perturb_null_pointer(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    if (o->in_routing) { /* handed by value: the zeroed tensor */
        memset(&o->t, 0, sizeof o->t);
        o->data = DATA_NULL;
        note(c, "%s zeroed", o->name);
    } else {
        o->passed = false;
        note(c, "%s NULL", o->name);
    }
    return true;
}

static bool perturb_foreign(const fuzzer *f, rng *r, fuzz_call *c)
{
    if (!f->checks_ownership)
        return false;
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    c->v[i].data = DATA_FOREIGN;
    c->v[i].pos = c->v[i].pos % 64; /* inside foreign_bytes for the first element */
    note(c, "%s foreign host pointer", c->v[i].name);
    if (is_empty(&c->v[i].t))
        c->maybe_invalid = true; /* an empty tensor's pointer may or may not be looked at */
    return true;
}

/* Any strides and maybe NULL data on an empty tensor: numpy and torch hand those over. */
static bool perturb_empty_strides(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int64_t odd[] = {-5, 0, 7, 1, (int64_t)1 << 40, -((int64_t)1 << 40), INT64_MIN,
                                  INT64_MAX};
    int i = pick_operand(r, c, empty_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    for (int d = 0; d < o->t.rank; d++)
        o->t.stride[d] = PICK(r, odd);
    if (rng_percent(r, 50) && o->data == DATA_ARENA)
        o->data = DATA_NULL;
    note(c, "empty %s: odd strides%s", o->name, o->data == DATA_NULL ? ", NULL data" : "");
    return true;
}

static float garbage_float(rng *r)
{
    static const float odd[] = {NAN, -NAN, INFINITY, -INFINITY, -1.0f, -1e-10f, -0.0f,
                                1e-36f, 1e-40f, 1e-45f, 1e-38f, 1e-35f * 0.5f};
    return PICK(r, odd);
}

static int32_t garbage_enum(rng *r, int32_t count)
{
    static const int32_t odd[] = {-1, 1000, INT32_MIN, INT32_MAX};
    return rng_percent(r, 40) ? count : rng_percent(r, 30) ? (int32_t)rng_int(r, 0, count - 1)
                                                          : PICK(r, odd);
}

static void perturb_act_option(rng *r, fuzz_call *c, moefuse_act_options *a)
{
    switch (rng_int(r, 0, 5)) {
    case 0: a->activation = (moefuse_activation)garbage_enum(r, MOEFUSE_ACT_COUNT_); break;
    case 1: a->order = (moefuse_gate_order)garbage_enum(r, MOEFUSE_GATE_ORDER_COUNT_); break;
    case 2: a->intermediate = (moefuse_rounding)garbage_enum(r, MOEFUSE_ROUNDING_COUNT_); break;
    case 3: a->alpha = rng_percent(r, 30) ? 1.702f : garbage_float(r); break; /* any activation */
    case 4: a->up_offset = garbage_float(r); break;
    default: a->limit = garbage_float(r); break;
    }
    note(c, "act options {%d, %d, %g, %d, alpha %g, up_offset %g}", (int)a->activation,
         (int)a->order, (double)a->limit, (int)a->intermediate, (double)a->alpha,
         (double)a->up_offset);
}

static void perturb_quant_option(rng *r, fuzz_call *c, moefuse_quant_options *q)
{
    static const int64_t groups[] = {0, 32, 64, 128, 16, 127, 256, -32, (int64_t)1 << 40,
                                     INT64_MIN};
    static const int32_t ue8m0[] = {0, 1, -1, 7};
    switch (rng_int(r, 0, 3)) {
    case 0: /* shapes depend on these: the call may or may not still fit */
        q->group_size = PICK(r, groups);
        c->maybe_invalid = true;
        break;
    case 1:
        q->scale_layout = (moefuse_scale_layout)garbage_enum(r, MOEFUSE_SCALE_LAYOUT_COUNT_);
        c->maybe_invalid = true;
        break;
    case 2:
        q->ue8m0 = PICK(r, ue8m0);
        c->maybe_invalid = true;
        break;
    default: q->eps = garbage_float(r); break;
    }
    note(c, "quant options {G %lld, layout %d, ue8m0 %d, eps %g}", (long long)q->group_size,
         (int)q->scale_layout, (int)q->ue8m0, (double)q->eps);
}

static bool perturb_option(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    if (rng_percent(r, 10)) {
        c->null_options = true;
        note(c, "options NULL");
        if (takes_quant_options(c->op)) /* defaults: G = 128, row-major */
            c->maybe_invalid = true;
        return true;
    }
    if (c->op == OP_TOPK_SOFTMAX) {
        static const int32_t odd[] = {2, -1, INT32_MAX, INT32_MIN};
        c->renormalize = PICK(r, odd);
        note(c, "renormalize %d", (int)c->renormalize);
        return true;
    }
    if (c->op == OP_TOPK_ROUTE) {
        moefuse_router_options *o = &c->route;
        switch (rng_int(r, 0, 5)) {
        case 0: o->scoring = (moefuse_router_scoring)garbage_enum(r, 3); break;
        case 1: o->group_scoring = (moefuse_group_scoring)garbage_enum(r, 2); break;
        case 2: o->n_group = (int32_t)rng_int(r, -2, 70); break;
        case 3: o->topk_group = (int32_t)rng_int(r, -2, 70); break;
        case 4: o->scale = garbage_float(r); break;
        default: o->reserved[rng_int(r, 0, 3)] = (uint32_t)rng_int(r, 1, 1000); break;
        }
        c->maybe_invalid = true;
        note(c, "router options {scoring %d, groups %d/%d (%d), scale %g}", (int)o->scoring,
             (int)o->topk_group, (int)o->n_group, (int)o->group_scoring, (double)o->scale);
        return true;
    }
    if (c->op == OP_ROUTING_META) {
        static const int32_t odd[] = {0, -1, INT32_MIN, 2, 1 << 30};
        c->block_size = PICK(r, odd);
        c->maybe_invalid = true;
        note(c, "block_size %d", (int)c->block_size);
        return true;
    }
    if (is_moe(c->op)) {
        moefuse_act_options a = {.activation = c->moe.activation, .order = c->moe.order,
                                 .limit = c->moe.limit, .alpha = c->moe.alpha,
                                 .up_offset = c->moe.up_offset};
        perturb_act_option(r, c, &a);
        c->moe.activation = a.activation;
        c->moe.order = a.order;
        c->moe.limit = a.limit;
        c->moe.alpha = a.alpha;
        c->moe.up_offset = a.up_offset;
        return true;
    }
    bool act = takes_act_options(c->op), quant = takes_quant_options(c->op);
    if (c->op == OP_ACT_QUANT_MASKED && rng_percent(r, 15)) {
        static const int32_t odd[] = {2, -1, INT32_MIN};
        c->aq.zero_tail = PICK(r, odd);
        note(c, "zero_tail %d", (int)c->aq.zero_tail);
    } else if (act && (!quant || rng_percent(r, 50))) {
        perturb_act_option(r, c, &c->aq.act);
    } else {
        perturb_quant_option(r, c, &c->aq.quant);
    }
    return true;
}

static bool perturb_null_routing(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f, (void)r;
    if (!is_moe(c->op) && c->op != OP_ROUTING_META)
        return false;
    c->null_routing = true;
    note(c, "routing NULL");
    return true;
}

/* Shared experts no call can take: a negative count, more than any E, a NaN scale (with one
 * shared expert, h or out also lack its slot), or any at all in routing_metadata. */
static bool perturb_shared(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    if (!is_moe(c->op) && c->op != OP_ROUTING_META)
        return false;
    switch (rng_int(r, 0, 2)) {
    case 0: c->n_shared = (int32_t)rng_int(r, INT32_MIN, -1); break;
    case 1: c->n_shared = (int32_t)rng_int(r, 1 << 20, INT32_MAX); break;
    default:
        c->n_shared = 1;
        c->shared_scale = NAN;
        break;
    }
    note(c, "routing.n_shared %d, shared_scale %g", (int)c->n_shared, (double)c->shared_scale);
    return true;
}

static bool perturb_null_context(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f, (void)r;
    c->null_context = true;
    note(c, "ctx NULL");
    return true;
}

typedef bool perturb_fn(const fuzzer *f, rng *r, fuzz_call *c);

static const struct {
    perturb_fn *fn;
    int weight;
} perturbations[] = {
    {perturb_dim, 12},          {perturb_rank, 4},          {perturb_dtype, 8},
    {perturb_stride, 10},       {perturb_move, 8},          {perturb_misalign, 5},
    {perturb_negative_offset, 3}, {perturb_past_end, 7},    {perturb_alias, 14},
    {perturb_null_data, 5},     {perturb_null_pointer, 4},  {perturb_foreign, 2},
    {perturb_option, 16},       {perturb_empty_strides, 6}, {perturb_null_routing, 1},
    {perturb_null_context, 1},  {perturb_shared, 3},
};

static perturb_fn *pick_perturbation(rng *r)
{
    int total = 0;
    for (int i = 0; i < COUNT_OF(perturbations); i++)
        total += perturbations[i].weight;
    int64_t at = rng_int(r, 0, total - 1);
    for (int i = 0; i < COUNT_OF(perturbations); i++) {
        if (at < perturbations[i].weight)
            return perturbations[i].fn;
        at -= perturbations[i].weight;
    }
    return perturbations[0].fn;
}

/* Host memory cannot be bounds-checked by the library: no tensor may reach outside the arena. */
static bool stays_inside(const fuzzer *f, const fuzz_call *c)
{
    if (f->knows_sizes)
        return true;
    for (int i = 0; i < c->count; i++) {
        const operand *o = &c->v[i];
        if (!o->passed || o->data != DATA_ARENA)
            continue;
        if (o->pos < 0 || o->pos > f->arena_bytes || o->host_split < 0 || o->host_split > o->pos ||
            o->pos + o->negative_offset > f->arena_bytes)
            return false;
        int64_t lo, hi;
        if (!has_elements(&o->t))
            continue;
        if (!arena_reach(o, &lo, &hi) || lo < 0 || hi > f->arena_bytes)
            return false;
    }
    return true;
}

void apply_perturbation(const fuzzer *f, rng *r, fuzz_call *c)
{
    for (int attempt = 0; attempt < 12; attempt++) {
        fuzz_call trial = *c;
        if (pick_perturbation(r)(f, r, &trial) && stays_inside(f, &trial)) {
            *c = trial;
            c->perturbations++;
            return;
        }
    }
}
