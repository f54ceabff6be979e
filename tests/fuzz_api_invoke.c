/* fuzz_api: the arena's bytes, operands bound to it, and the call made. */
#include "fuzz_api.h"

#include <math.h>

static unsigned char foreign_bytes[256]; /* host memory handed where a device buffer belongs */

/* ----------------------------------------------------------------- arena contents */

/* fn for every element of o that lies wholly inside the arena. */
void for_each_element(const fuzzer *f, const operand *o, element_fn *fn, void *opaque)
{
    const moefuse_tensor *t = &o->t;
    if (!o->passed || o->data != DATA_ARENA || o->negative_offset || !has_elements(t))
        return;
    int64_t count = 1, es = elem_bytes(t->dtype);
    for (int d = 0; d < t->rank; d++)
        if (__builtin_mul_overflow(count, t->shape[d], &count) || count > f->arena_bytes)
            return; /* more elements than bytes: refused anyway, nothing sensible to visit */
    int64_t index[MOEFUSE_MAX_RANK] = {0};
    for (int64_t n = 0; n < count; n++) {
        int64_t off = 0, step;
        bool fits = true;
        for (int d = 0; d < t->rank && fits; d++)
            fits = !__builtin_mul_overflow(index[d], t->stride[d], &step) &&
                   !__builtin_add_overflow(off, step, &off);
        int64_t byte;
        if (fits && !__builtin_mul_overflow(off, es, &byte) &&
            !__builtin_add_overflow(byte, o->pos, &byte) && byte >= 0 &&
            byte <= f->arena_bytes - es)
            fn(opaque, byte, es);
        for (int d = t->rank - 1; d >= 0 && ++index[d] == t->shape[d]; d--)
            index[d] = 0;
    }
}

static float sane_f32(rng *r)
{
    static const float special[] = {0.0f, -0.0f, NAN, INFINITY, -INFINITY, 1e30f, -3e38f,
                                    1e-40f, 448.0f, 1e-30f};
    return rng_percent(r, 3) ? PICK(r, special) : (float)(rng_unit(r) * 8.0 - 4.0);
}

static uint16_t sane_f16(rng *r)
{
    static const uint16_t special[] = {0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x0001, 0x7BFF};
    if (rng_percent(r, 3))
        return PICK(r, special);
    return (uint16_t)((rng_int(r, 0, 1) << 15) | (rng_int(r, 10, 17) << 10) | rng_int(r, 0, 1023));
}

static uint16_t sane_bf16(rng *r)
{
    static const uint16_t special[] = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x7F7F};
    if (rng_percent(r, 3))
        return PICK(r, special);
    return (uint16_t)((rng_int(r, 0, 1) << 15) | (rng_int(r, 120, 129) << 7) | rng_int(r, 0, 127));
}

/* Device data is never trusted: some ids, map entries and counts are out of range. */
static int32_t routing_value(rng *r, enum fill_kind kind, int64_t limit)
{
    const int32_t top = (int32_t)limit;
    switch (kind) {
    case FILL_IDS: {
        const int32_t odd[] = {-1, -2, top, top + 3, INT32_MIN, INT32_MAX};
        return rng_percent(r, 85) ? (int32_t)rng_int(r, 0, limit - 1) : PICK(r, odd);
    }
    case FILL_MAP: {
        const int32_t odd[] = {top, -7, INT32_MIN, INT32_MAX};
        int64_t choice = rng_int(r, 0, 9);
        return choice < 7 ? (int32_t)rng_int(r, 0, limit - 1) : choice < 9 ? -1 : PICK(r, odd);
    }
    default: { /* counts: clamped to [0, Tmax] by the kernels */
        const int32_t odd[] = {-1, -100, top + 1, top + 50, INT32_MIN, INT32_MAX};
        return rng_percent(r, 75) ? (int32_t)rng_int(r, 0, limit) : PICK(r, odd);
    }
    }
}

typedef struct fill_job {
    unsigned char *image;
    rng *r;
    const operand *o;
} fill_job;

static void fill_element(void *opaque, int64_t byte, int64_t bytes)
{
    fill_job *job = opaque;
    unsigned char *dst = job->image + byte;
    const moefuse_dtype dt = job->o->t.dtype;
    (void)bytes;
    switch (job->o->fill) {
    case FILL_FLOATS:
    case FILL_PROBS:
        if (dt == MOEFUSE_F32) {
            float v = job->o->fill == FILL_PROBS ? (float)rng_unit(job->r) : sane_f32(job->r);
            memcpy(dst, &v, 4);
        } else if (dt == MOEFUSE_F16 || dt == MOEFUSE_BF16) {
            uint16_t v = dt == MOEFUSE_F16 ? sane_f16(job->r) : sane_bf16(job->r);
            memcpy(dst, &v, 2);
        }
        break;
    case FILL_IDS:
    case FILL_MAP:
    case FILL_COUNTS:
        if (dt == MOEFUSE_I32 && job->o->fill_limit > 0) {
            int32_t value = routing_value(job->r, job->o->fill, job->o->fill_limit);
            memcpy(dst, &value, 4);
        } else if (dt == MOEFUSE_I32 && job->o->fill == FILL_COUNTS) {
            int32_t value = (int32_t)rng_int(job->r, -2, 2);
            memcpy(dst, &value, 4);
        }
        break;
    default: break; /* the random bytes already there */
    }
}

/* Random bytes everywhere, then input values that make the kernels do real work. */
void compose_image(fuzzer *f, rng *r, const fuzz_call *c)
{
    uint64_t word = rng_next(r) | 1; /* xorshift64: the bulk of the bytes, cheaply */
    for (int64_t i = 0; i + 8 <= f->arena_bytes; i += 8) {
        word ^= word << 13, word ^= word >> 7, word ^= word << 17;
        memcpy(f->image + i, &word, 8);
    }
    for (int i = 0; i < c->count; i++) {
        const operand *o = &c->v[i];
        if (o->role == ROLE_OUTPUT || o->fill == FILL_BYTES)
            continue;
        if (o->fill == FILL_FLOATS && rng_percent(r, 25))
            continue; /* raw bytes: NaN, Inf and huge values too */
        fill_job job = {f->image, r, o};
        for_each_element(f, o, fill_element, &job);
    }
}

void mark_writable(void *opaque, int64_t byte, int64_t bytes)
{
    memset((unsigned char *)opaque + byte, 1, (size_t)bytes);
}

/* ----------------------------------------------------------------- making the call */

void bind_operand(const fuzzer *f, operand *o)
{
    switch (o->data) {
    case DATA_NULL:
        o->t.data = NULL;
        o->t.offset = o->pos;
        break;
    case DATA_FOREIGN:
        o->t.data = foreign_bytes;
        o->t.offset = o->pos;
        break;
    default:
        if (f->handles) {
            o->t.data = f->arena;
            o->t.offset = o->pos;
        } else {
            o->t.data = (unsigned char *)f->arena + o->host_split;
            o->t.offset = o->pos - o->host_split;
        }
        break;
    }
    if (o->negative_offset) {
        if (!f->handles && o->data == DATA_ARENA) /* same element 0, offset field negative */
            o->t.data = (unsigned char *)f->arena + o->pos + o->negative_offset;
        o->t.offset = -o->negative_offset;
    }
}

static const moefuse_tensor *arg(const fuzz_call *c, int slot)
{
    return c->v[slot].passed ? &c->v[slot].t : NULL;
}

static moefuse_routing routing_of(const fuzz_call *c, int ids, int weights, int map)
{
    moefuse_routing routing = {0}; /* no shared experts, unless perturbed */
    routing.n_shared = c->n_shared;
    routing.shared_scale = c->shared_scale;
    routing.topk_ids = c->v[ids].t;
    routing.topk_weights = c->v[weights].t;
    routing.expert_map = c->v[map].t;
    return routing;
}

moefuse_status invoke(const fuzzer *f, const fuzz_call *c)
{
    moefuse_context *ctx = c->null_context ? NULL : f->ctx;
    const moefuse_act_quant_options *aq = c->null_options ? NULL : &c->aq;
    const moefuse_act_options *act = c->null_options ? NULL : &c->aq.act;
    const moefuse_quant_options *quant = c->null_options ? NULL : &c->aq.quant;
    const moefuse_moe_options *moe = c->null_options ? NULL : &c->moe;
    moefuse_routing routing;
    switch (c->op) {
    case OP_ACT_QUANT:
        return moefuse_act_quant(ctx, arg(c, AQ_X), arg(c, AQ_ROW_SCALE), arg(c, AQ_Q),
                                 arg(c, AQ_SCALES), aq);
    case OP_ACT_QUANT_MASKED:
        return moefuse_act_quant_masked(ctx, arg(c, MQ_X), arg(c, MQ_COUNTS), arg(c, MQ_ROW_SCALE),
                                        arg(c, MQ_EXPERT_SCALE), arg(c, MQ_Q), arg(c, MQ_SCALES),
                                        aq);
    case OP_ACT_MUL:
        return moefuse_act_mul(ctx, arg(c, AM_X), arg(c, AM_ROW_SCALE), arg(c, AM_OUT), act);
    case OP_QUANT:
        return moefuse_quant(ctx, arg(c, QU_X), arg(c, QU_Q), arg(c, QU_SCALES), quant);
    case OP_DEQUANT:
        return moefuse_dequant(ctx, arg(c, DQ_Q), arg(c, DQ_SCALES), arg(c, DQ_OUT), quant);
    case OP_TOPK_SOFTMAX:
        return moefuse_topk_softmax(ctx, arg(c, TK_LOGITS), c->renormalize, arg(c, TK_IDS),
                                    arg(c, TK_WEIGHTS));
    case OP_MOE_GATE:
        routing = routing_of(c, GA_IDS, GA_WEIGHTS, GA_MAP);
        return moefuse_moe_gate(ctx, arg(c, GA_X), arg(c, GA_W1), arg(c, GA_B1),
                                c->null_routing ? NULL : &routing, arg(c, GA_H), moe);
    case OP_MOE_FINAL:
        routing = routing_of(c, FI_IDS, FI_WEIGHTS, FI_MAP);
        return moefuse_moe_final(ctx, arg(c, FI_H), arg(c, FI_W2), arg(c, FI_B2),
                                 c->null_routing ? NULL : &routing, arg(c, FI_OUT), moe);
    case OP_TOPK_ROUTE:
        return moefuse_topk_route(ctx, arg(c, TR_LOGITS), arg(c, TR_LOGIT_BIAS),
                                  arg(c, TR_CHOICE_BIAS), c->null_options ? NULL : &c->route,
                                  arg(c, TR_IDS), arg(c, TR_WEIGHTS));
    case OP_ROUTING_META: {
        routing = routing_of(c, RM_IDS, RM_WEIGHTS, RM_MAP);
        const moefuse_routing_meta meta = {c->v[RM_COUNTS].t, c->v[RM_OFFSETS].t, c->v[RM_ORDER].t,
                                           c->v[RM_POSITION].t, c->v[RM_MASKED_ROW].t};
        return moefuse_routing_metadata(ctx, c->null_routing ? NULL : &routing, c->block_size,
                                        &meta);
    }
    default:
        routing = routing_of(c, FW_IDS, FW_WEIGHTS, FW_MAP);
        return moefuse_moe_forward(ctx, arg(c, FW_X), arg(c, FW_W1), arg(c, FW_W2), arg(c, FW_B1),
                                   arg(c, FW_B2), c->null_routing ? NULL : &routing, arg(c, FW_OUT),
                                   moe);
    }
}
