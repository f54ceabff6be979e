/* fuzz_api: building near-valid calls of every operation and placing their operands. */
#include "fuzz_api.h"

#include <stdlib.h>

/* ----------------------------------------------------------------- building valid calls */

static int add_operand(fuzz_call *c, const char *name, enum role role, bool optional,
                       moefuse_dtype dtype, dtype_set allowed, enum fill_kind fill, int rank,
                       const int64_t *shape)
{
    operand *o = &c->v[c->count];
    memset(o, 0, sizeof *o);
    o->name = name;
    o->role = role;
    o->optional = optional;
    o->passed = true;
    o->data = DATA_ARENA;
    o->want_rank = o->alt_rank = rank;
    o->allowed = allowed;
    o->fill = fill;
    o->t.dtype = dtype;
    o->t.rank = rank;
    for (int d = 0; d < rank; d++)
        o->t.shape[d] = shape[d];
    set_dense_strides(&o->t);
    return c->count++;
}

/* An optional operand left out: as a NULL pointer or as a tensor with NULL data. */
static void maybe_absent(rng *r, fuzz_call *c, int slot, int percent)
{
    operand *o = &c->v[slot];
    if (!rng_percent(r, percent))
        return;
    if (o->in_routing || rng_percent(r, 50))
        o->data = DATA_NULL;
    else
        o->passed = false;
}

/* A call without rows touches no memory whatever its width: sometimes a huge one, so that
   backends that size work or scratch by the width before looking at the rows show it. */
static bool go_wide(rng *r, int64_t rows) { return rows == 0 && rng_percent(r, 25); }

/* Gated inputs are 2H wide: their H stays below 2^62. */
static int64_t huge_width(rng *r, bool gated)
{
    static const int64_t huge[] = {(int64_t)1 << 31, (int64_t)1 << 40, (int64_t)1 << 60,
                                   (int64_t)1 << 62};
    return huge[rng_int(r, 0, COUNT_OF(huge) - (gated ? 2 : 1))];
}

/* Token counts: mostly small, sometimes none. */
static int64_t pick_rows(rng *r, int64_t most)
{
    if (rng_percent(r, 6))
        return 0;
    return rng_percent(r, 60) ? rng_int(r, 1, 4) : rng_int(r, 1, most);
}

static float pick_eps(rng *r)
{
    static const float valid[] = {1e-10f, 1e-6f, 1e-3f, 1e-30f, 1e-34f, 0.5f, 1.0f};
    return rng_percent(r, 50) ? 0.0f : PICK(r, valid);
}

/* silu_alpha's alpha (0: the default) and an up offset, both valid. */
static void pick_gated_extras(rng *r, moefuse_activation act, float *alpha, float *up_offset)
{
    static const float alphas[] = {0.0f, 1.702f, 0.3f, 1e30f}, offsets[] = {1.0f, -1.0f, 1e30f};
    *alpha = act == MOEFUSE_ACT_SILU_ALPHA ? PICK(r, alphas) : 0.0f;
    *up_offset = rng_percent(r, 60) ? 0.0f : PICK(r, offsets);
}

static void pick_act_options(rng *r, moefuse_act_options *a)
{
    static const float limits[] = {0.25f, 1.0f, 7.0f, 1e30f};
    a->activation = (moefuse_activation)rng_int(r, 0, MOEFUSE_ACT_COUNT_ - 1);
    a->order = (moefuse_gate_order)rng_int(r, 0, MOEFUSE_GATE_ORDER_COUNT_ - 1);
    a->limit = rng_percent(r, 60) ? 0.0f : PICK(r, limits);
    a->intermediate = (moefuse_rounding)rng_int(r, 0, MOEFUSE_ROUNDING_COUNT_ - 1);
    pick_gated_extras(r, a->activation, &a->alpha, &a->up_offset);
}

typedef struct quant_config {
    int64_t hidden, group, groups;
    moefuse_dtype code_dtype, scale_dtype;
    moefuse_scale_layout layout;
} quant_config;

/* H, G and a scale layout that fit together, and the options that ask for them. */
static void pick_quant_config(rng *r, int64_t max_hidden, quant_config *q,
                              moefuse_quant_options *opt)
{
    static const int64_t groups[] = {32, 64, 128};
    if (rng_percent(r, 25)) { /* G = H: any width */
        q->hidden = q->group = rng_int(r, 1, 80);
        opt->group_size = q->group;
    } else {
        q->group = PICK(r, groups);
        if (q->group > max_hidden)
            q->group = 32;
        q->hidden = q->group * rng_int(r, 1, max_hidden / q->group);
        opt->group_size = q->group == 128 && rng_percent(r, 50) ? 0 : q->group;
    }
    q->groups = q->hidden / q->group;
    q->code_dtype = rng_percent(r, 70) ? MOEFUSE_F8_E4M3 : MOEFUSE_I8;
    q->layout = (moefuse_scale_layout)rng_int(r, 0, MOEFUSE_SCALE_LAYOUT_COUNT_ - 1);
    if (q->code_dtype == MOEFUSE_I8 && q->layout == MOEFUSE_SCALE_PACKED_UE8M0)
        q->layout = MOEFUSE_SCALE_COLUMN_MAJOR;
    bool packed = q->layout == MOEFUSE_SCALE_PACKED_UE8M0;
    bool ue8m0 = packed || (q->code_dtype == MOEFUSE_F8_E4M3 && rng_percent(r, 40));
    opt->scale_layout = q->layout;
    opt->ue8m0 = !ue8m0 ? 0 : packed && rng_percent(r, 50) ? 0 : rng_percent(r, 80) ? 1 : 7;
    opt->eps = pick_eps(r);
    if (packed)
        q->scale_dtype = MOEFUSE_I32;
    else
        q->scale_dtype = ue8m0 && rng_percent(r, 60) ? MOEFUSE_U8 : MOEFUSE_F32;
}

/* H huge, G = 128 or H: for calls without rows. */
static void widen_quant(rng *r, bool gated, quant_config *q, moefuse_quant_options *opt)
{
    q->hidden = huge_width(r, gated);
    q->group = rng_percent(r, 50) ? 128 : q->hidden;
    q->groups = q->hidden / q->group;
    opt->group_size = q->group == 128 && rng_percent(r, 50) ? 0 : q->group;
}

/* The scales operand of a layout; experts < 0: the 2-D form. */
static int add_scales(fuzz_call *c, const quant_config *q, enum role role, int64_t experts,
                      int64_t rows)
{
    int64_t padded = (rows + 3) / 4 * 4, a, b;
    switch (q->layout) {
    case MOEFUSE_SCALE_ROW_MAJOR: a = rows, b = q->groups; break;
    case MOEFUSE_SCALE_COLUMN_MAJOR: a = q->groups, b = padded; break;
    default: a = (q->groups + 3) / 4, b = padded; break;
    }
    const dtype_set allowed = DT(MOEFUSE_F32) | DT(MOEFUSE_U8) | DT(MOEFUSE_I32);
    enum fill_kind fill = q->scale_dtype == MOEFUSE_F32 ? FILL_FLOATS : FILL_BYTES;
    if (experts < 0)
        return add_operand(c, "scales", role, false, q->scale_dtype, allowed, fill, 2, SHAPE(a, b));
    return add_operand(c, "scales", role, false, q->scale_dtype, allowed, fill, 3,
                       SHAPE(experts, a, b));
}

static void build_act_quant(rng *r, fuzz_call *c)
{
    quant_config q;
    pick_quant_config(r, 256, &q, &c->aq.quant);
    pick_act_options(r, &c->aq.act);
    c->aq.zero_tail = rng_percent(r, 20); /* 2-D: ignored */
    int64_t T = pick_rows(r, 12);
    if (go_wide(r, T))
        widen_quant(r, true, &q, &c->aq.quant);
    int64_t H = q.hidden;
    c->hidden = H;
    add_operand(c, "x", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(T, 2 * H));
    add_operand(c, "row_scale", ROLE_INPUT, true, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_FLOATS, 1,
                SHAPE(T));
    add_operand(c, "q", ROLE_OUTPUT, false, q.code_dtype, CODES, FILL_BYTES, 2, SHAPE(T, H));
    add_scales(c, &q, ROLE_OUTPUT, -1, T);
    maybe_absent(r, c, AQ_ROW_SCALE, 50);
}

static void build_act_quant_masked(rng *r, fuzz_call *c)
{
    static const int32_t zero_tails[] = {0, 0, 1, 1, -3, 1000};
    quant_config q;
    pick_quant_config(r, 128, &q, &c->aq.quant);
    pick_act_options(r, &c->aq.act);
    c->aq.zero_tail = PICK(r, zero_tails);
    int64_t E = rng_percent(r, 5) ? 0 : rng_int(r, 1, 4), Tmax = pick_rows(r, 8);
    if (go_wide(r, Tmax))
        widen_quant(r, true, &q, &c->aq.quant);
    int64_t H = q.hidden;
    c->hidden = H;
    add_operand(c, "x", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 3,
                SHAPE(E, Tmax, 2 * H));
    int counts = add_operand(c, "counts", ROLE_INPUT, false, MOEFUSE_I32, DT(MOEFUSE_I32),
                             FILL_COUNTS, 1, SHAPE(E));
    c->v[counts].fill_limit = Tmax;
    add_operand(c, "row_scale", ROLE_INPUT, true, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_FLOATS, 2,
                SHAPE(E, Tmax));
    add_operand(c, "expert_scale", ROLE_INPUT, true,
                rng_percent(r, 50) ? MOEFUSE_F32 : MOEFUSE_BF16,
                DT(MOEFUSE_F32) | DT(MOEFUSE_BF16), FILL_FLOATS, 1, SHAPE(E));
    add_operand(c, "q", ROLE_OUTPUT, false, q.code_dtype, CODES, FILL_BYTES, 3, SHAPE(E, Tmax, H));
    add_scales(c, &q, ROLE_OUTPUT, E, Tmax);
    maybe_absent(r, c, MQ_ROW_SCALE, 50);
    maybe_absent(r, c, MQ_EXPERT_SCALE, 50);
}

static void build_act_mul(rng *r, fuzz_call *c)
{
    pick_act_options(r, &c->aq.act);
    int64_t T = pick_rows(r, 12), H = rng_percent(r, 50) ? rng_int(r, 1, 32) : rng_int(r, 1, 256);
    if (go_wide(r, T))
        H = huge_width(r, true);
    moefuse_dtype dt = pick_float(r);
    add_operand(c, "x", ROLE_INPUT, false, dt, FLOATS, FILL_FLOATS, 2, SHAPE(T, 2 * H));
    add_operand(c, "row_scale", ROLE_INPUT, true, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_FLOATS, 1,
                SHAPE(T));
    add_operand(c, "out", ROLE_OUTPUT, false, dt, FLOATS, FILL_BYTES, 2, SHAPE(T, H));
    maybe_absent(r, c, AM_ROW_SCALE, 50);
}

/* quant's and dequant's sizes and options (no activation: H wide); returns T. */
static int64_t pick_plain_quant(rng *r, fuzz_call *c, quant_config *q)
{
    pick_quant_config(r, 256, q, &c->aq.quant);
    int64_t T = pick_rows(r, 12);
    if (go_wide(r, T))
        widen_quant(r, false, q, &c->aq.quant);
    c->hidden = q->hidden;
    return T;
}

static void build_quant(rng *r, fuzz_call *c)
{
    quant_config q;
    int64_t T = pick_plain_quant(r, c, &q), H = q.hidden;
    add_operand(c, "x", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(T, H));
    add_operand(c, "q", ROLE_OUTPUT, false, q.code_dtype, CODES, FILL_BYTES, 2, SHAPE(T, H));
    add_scales(c, &q, ROLE_OUTPUT, -1, T);
}

static void build_dequant(rng *r, fuzz_call *c)
{
    quant_config q;
    int64_t T = pick_plain_quant(r, c, &q), H = q.hidden;
    add_operand(c, "q", ROLE_INPUT, false, q.code_dtype, CODES, FILL_BYTES, 2, SHAPE(T, H));
    add_scales(c, &q, ROLE_INPUT, -1, T);
    add_operand(c, "out", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 2, SHAPE(T, H));
}

static void build_topk_softmax(rng *r, fuzz_call *c)
{
    static const int32_t renormalize[] = {0, 0, 1, 1, -1, 7, INT32_MIN};
    int64_t E = rng_percent(r, 70) ? rng_int(r, 1, 16) : rng_int(r, 17, 64);
    int64_t M = pick_rows(r, 16);
    if (go_wide(r, M))
        E = huge_width(r, false);
    int64_t k = rng_percent(r, 90) ? rng_int(r, 1, E < 8 ? E : 8) : E;
    c->renormalize = PICK(r, renormalize);
    add_operand(c, "logits", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(M, E));
    add_operand(c, "ids", ROLE_OUTPUT, false, MOEFUSE_I32, DT(MOEFUSE_I32), FILL_BYTES, 2,
                SHAPE(M, k));
    add_operand(c, "weights", ROLE_OUTPUT, false, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_BYTES, 2,
                SHAPE(M, k));
}

typedef struct moe_sizes {
    int64_t M, K, I, E, k, E_global;
    bool map;
    moefuse_dtype dtype;
} moe_sizes;

static void pick_moe(rng *r, fuzz_call *c, moe_sizes *s)
{
    static const float limits[] = {0.5f, 3.0f, 1e20f};
    s->M = pick_rows(r, 6);
    s->K = rng_int(r, 1, 32);
    s->I = rng_int(r, 1, 16);
    s->E = rng_int(r, 1, 4);
    s->k = go_wide(r, s->M) ? huge_width(r, false) : rng_int(r, 1, 4);
    s->map = rng_percent(r, 40);
    s->E_global = s->map ? rng_int(r, 1, 8) : s->E;
    s->dtype = pick_float(r);
    c->moe.activation = (moefuse_activation)rng_int(r, 0, MOEFUSE_ACT_COUNT_ - 1);
    c->moe.order = (moefuse_gate_order)rng_int(r, 0, MOEFUSE_GATE_ORDER_COUNT_ - 1);
    c->moe.limit = rng_percent(r, 70) ? 0.0f : PICK(r, limits);
    pick_gated_extras(r, c->moe.activation, &c->moe.alpha, &c->moe.up_offset);
}

/* topk_ids, topk_weights, expert_map, in that order. */
static void add_routing(rng *r, fuzz_call *c, const moe_sizes *s, enum role weights_role)
{
    int ids = add_operand(c, "topk_ids", ROLE_INPUT, false, MOEFUSE_I32, DT(MOEFUSE_I32),
                          FILL_IDS, 2, SHAPE(s->M, s->k));
    int weights = add_operand(c, "topk_weights", weights_role, false, MOEFUSE_F32,
                              DT(MOEFUSE_F32), FILL_PROBS, 2, SHAPE(s->M, s->k));
    int map = add_operand(c, "expert_map", ROLE_INPUT, true, MOEFUSE_I32, DT(MOEFUSE_I32),
                          FILL_MAP, 1, SHAPE(s->E_global));
    c->v[ids].fill_limit = s->E_global;
    c->v[map].fill_limit = s->E;
    c->v[ids].in_routing = c->v[weights].in_routing = c->v[map].in_routing = true;
    if (!s->map)
        c->v[map].data = DATA_NULL;
    /* moe_gate ignores the weights: often the zeroed tensor callers pass */
    if (weights_role == ROLE_IGNORED && rng_percent(r, 50)) {
        memset(&c->v[weights].t, 0, sizeof c->v[weights].t);
        c->v[weights].data = DATA_NULL;
    }
}

static void build_moe_gate(rng *r, fuzz_call *c)
{
    moe_sizes s;
    pick_moe(r, c, &s);
    add_operand(c, "x", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 2, SHAPE(s.M, s.K));
    add_operand(c, "w1", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3,
                SHAPE(s.E, 2 * s.I, s.K));
    add_operand(c, "b1", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 2,
                SHAPE(s.E, 2 * s.I));
    add_routing(r, c, &s, ROLE_IGNORED);
    add_operand(c, "h", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 3,
                SHAPE(s.M, s.k, s.I));
    maybe_absent(r, c, GA_B1, 50);
}

static void build_moe_final(rng *r, fuzz_call *c)
{
    moe_sizes s;
    pick_moe(r, c, &s);
    add_operand(c, "h", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3, SHAPE(s.M, s.k, s.I));
    add_operand(c, "w2", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3, SHAPE(s.E, s.K, s.I));
    add_operand(c, "b2", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(s.E, s.K));
    add_routing(r, c, &s, ROLE_INPUT);
    c->v[FI_WEIGHTS].only_when_reduced = true;
    int out;
    if (rng_percent(r, 50))
        out = add_operand(c, "out", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 2,
                          SHAPE(s.M, s.K));
    else
        out = add_operand(c, "out", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 3,
                          SHAPE(s.M, s.k, s.K));
    c->v[out].alt_rank = c->v[out].want_rank == 2 ? 3 : 2; /* reduced or not */
    maybe_absent(r, c, FI_B2, 50);
}

static void build_moe_forward(rng *r, fuzz_call *c)
{
    moe_sizes s;
    pick_moe(r, c, &s);
    add_operand(c, "x", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 2, SHAPE(s.M, s.K));
    add_operand(c, "w1", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3,
                SHAPE(s.E, 2 * s.I, s.K));
    add_operand(c, "w2", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3, SHAPE(s.E, s.K, s.I));
    add_operand(c, "b1", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 2,
                SHAPE(s.E, 2 * s.I));
    add_operand(c, "b2", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(s.E, s.K));
    add_routing(r, c, &s, ROLE_INPUT);
    add_operand(c, "out", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 2,
                SHAPE(s.M, s.K));
    maybe_absent(r, c, FW_B1, 50);
    maybe_absent(r, c, FW_B2, 50);
}

/* topk_route: valid options (groups that divide E, k within the kept groups), biases or not. */
static void build_topk_route(rng *r, fuzz_call *c)
{
    static const float scales[] = {0.0f, 1.0f, 2.5f, 16.0f};
    /* no huge E (topk_softmax's calls try those): [E] biases, even absent, need a place */
    const int64_t E = rng_percent(r, 70) ? rng_int(r, 1, 16) : rng_int(r, 17, 64);
    const int64_t M = pick_rows(r, 16);
    moefuse_router_options *o = &c->route;
    o->scoring = (moefuse_router_scoring)rng_int(r, 0, MOEFUSE_ROUTER_TOPK_SOFTMAX);
    o->group_scoring = (moefuse_group_scoring)rng_int(r, 0, MOEFUSE_GROUP_MAX);
    o->renormalize = (int32_t)rng_int(r, 0, 1);
    o->scale = PICK(r, scales);
    int64_t kept = E;
    if (E <= 64 && rng_percent(r, 50)) {
        int32_t g = (int32_t)rng_int(r, 1, E);
        while (E % g)
            g--;
        o->n_group = g;
        o->topk_group = g > 1 ? (int32_t)rng_int(r, 1, g) : (int32_t)rng_int(r, 0, 1);
        kept = g > 1 ? o->topk_group * (E / g) : E;
    }
    const int64_t most = kept < 8 ? kept : 8;
    const int64_t k = rng_percent(r, 90) ? rng_int(r, 1, most > 0 ? most : 1) : kept;
    add_operand(c, "logits", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(M, E));
    add_operand(c, "logit_bias", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 1, SHAPE(E));
    add_operand(c, "choice_bias", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 1,
                SHAPE(E));
    add_operand(c, "ids", ROLE_OUTPUT, false, MOEFUSE_I32, DT(MOEFUSE_I32), FILL_BYTES, 2,
                SHAPE(M, k));
    add_operand(c, "weights", ROLE_OUTPUT, false, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_BYTES, 2,
                SHAPE(M, k));
    maybe_absent(r, c, TR_LOGIT_BIAS, 60);
    maybe_absent(r, c, TR_CHOICE_BIAS, 50);
}

/* routing_metadata: the routing of a MoE call, every output or some, blocks of 1 to 16. */
static void build_routing_meta(rng *r, fuzz_call *c)
{
    static const int32_t blocks[] = {1, 1, 4, 16, 7};
    moe_sizes s;
    pick_moe(r, c, &s);
    c->block_size = PICK(r, blocks);
    add_routing(r, c, &s, ROLE_IGNORED);
    const int64_t S = mul_sat(s.M, s.k);
    const int64_t L = add_sat(add_sat(S, s.E * (c->block_size - 1)), rng_int(r, 0, 3));
    const struct {
        const char *name;
        int rank;
        int64_t a, b;
    } outs[] = {{"counts", 1, s.E, 0},        {"offsets", 1, s.E + 1, 0}, {"order", 1, L, 0},
                {"position", 2, s.M, s.k},   {"masked_row", 2, s.M, s.k}};
    for (int i = 0; i < 5; i++) {
        const int slot = add_operand(c, outs[i].name, ROLE_OUTPUT, i > 0, MOEFUSE_I32,
                                     DT(MOEFUSE_I32), FILL_BYTES, outs[i].rank,
                                     outs[i].rank == 1 ? SHAPE(outs[i].a) : SHAPE(outs[i].a, outs[i].b));
        c->v[slot].in_routing = true; /* members of moefuse_routing_meta */
        if (i > 0)
            maybe_absent(r, c, slot, 30);
    }
}

static void (*const builders[OP_COUNT])(rng *, fuzz_call *) = {
    build_act_quant, build_act_quant_masked, build_act_mul,   build_quant,      build_dequant,
    build_topk_softmax, build_moe_gate,      build_moe_final, build_moe_forward,
    build_topk_route,   build_routing_meta,
};

/* Row padding, padded outer dims and free strides of size-1 dims: all legal. */
static void pick_strides(rng *r, moefuse_tensor *t)
{
    if (!rank_ok(t))
        return;
    bool pad = rng_percent(r, 35);
    t->stride[t->rank - 1] = 1;
    for (int d = t->rank - 2; d >= 0; d--) {
        int64_t inner = t->shape[d + 1] > 0 ? t->shape[d + 1] : 1;
        int64_t row_pad = pad && rng_percent(r, 60) ? rng_int(r, 1, 8) : 0;
        t->stride[d] = add_sat(mul_sat(t->stride[d + 1], inner), row_pad);
    }
    for (int d = 0; d < t->rank - 1; d++)
        if (t->shape[d] == 1 && rng_percent(r, 10))
            t->stride[d] = rng_int(r, 0, 5000);
}

/* Bytes an operand's elements cover when placed at 0 (0 when it has none). */
int64_t placed_bytes(const operand *o)
{
    int64_t lo, hi, bytes;
    if (!has_elements(&o->t) || !relative_reach(&o->t, &lo, &hi) ||
        __builtin_sub_overflow(hi, lo, &bytes))
        return 0;
    return bytes;
}

/* Disjoint random positions in the arena, in random order; false when they do not fit. */
static bool place_operands(const fuzzer *f, rng *r, fuzz_call *c)
{
    int order[MAX_OPERANDS];
    int64_t reserve = 0;
    for (int i = 0; i < c->count; i++) {
        order[i] = i;
        reserve += placed_bytes(&c->v[i]) + 64 + 256; /* alignment, gap */
    }
    if (reserve > f->arena_bytes)
        return false;
    for (int i = c->count - 1; i > 0; i--) {
        int j = (int)rng_int(r, 0, i), swap = order[i];
        order[i] = order[j];
        order[j] = swap;
    }
    int64_t cursor = rng_int(r, 0, f->arena_bytes - reserve);
    for (int i = 0; i < c->count; i++) {
        operand *o = &c->v[order[i]];
        cursor = round_up(cursor, rng_percent(r, 50) ? 64 : elem_bytes(o->t.dtype));
        o->pos = cursor;
        cursor += placed_bytes(o) + (rng_percent(r, 30) ? 0 : rng_int(r, 0, 256));
        int64_t choice = rng_int(r, 0, 9);
        o->host_split = choice < 5 ? 0 : choice < 8 ? o->pos : rng_int(r, 0, o->pos);
        /* frameworks hand empty tensors over with NULL data */
        if (is_empty(&o->t) && o->data == DATA_ARENA && rng_percent(r, 30))
            o->data = DATA_NULL;
    }
    return true;
}

void build_call(const fuzzer *f, rng *r, fuzz_call *c)
{
    enum op op = (enum op)rng_int(r, 0, OP_COUNT - 1);
    for (int attempt = 0;; attempt++) {
        memset(c, 0, sizeof *c);
        c->op = op;
        builders[op](r, c);
        for (int i = 0; i < c->count; i++)
            pick_strides(r, &c->v[i].t);
        if (place_operands(f, r, c))
            break;
        if (attempt == 100) {
            fprintf(stderr, "fuzz_api: cannot place a %s call in the arena (a bug here)\n",
                    op_names[op]);
            exit(2);
        }
    }
    int64_t choice = rng_int(r, 0, 99);
    int count = choice < 30 ? 0 : choice < 85 ? 1 : (int)rng_int(r, 2, 3);
    for (int i = 0; i < count; i++)
        apply_perturbation(f, r, c);
    for (int i = 0; i < c->count; i++)
        bind_operand(f, &c->v[i]);
}
