/* fuzz_api: describing a call and counting and reporting violations. */
#include "fuzz_api.h"

/* ----------------------------------------------------------------- reports */

static const char *shape_text(char *buf, size_t size, int rank, const int64_t *v)
{
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int d = 0; d < rank && d < MOEFUSE_MAX_RANK && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d ? ", %lld" : "%lld", (long long)v[d]);
    if (used < size)
        snprintf(buf + used, size - used, "]");
    return buf;
}

static void describe_operand(const fuzz_call *c, const operand *o)
{
    static const char *const roles[] = {"input", "output", "ignored"};
    char shape[128], stride[128];
    printf("    %-13s %-7s ", o->name, roles[o->role]);
    if (!o->passed) {
        printf("NULL pointer\n");
        return;
    }
    printf("%s rank %d shape %s stride %s", moefuse_dtype_name(o->t.dtype), (int)o->t.rank,
           shape_text(shape, sizeof shape, o->t.rank, o->t.shape),
           shape_text(stride, sizeof stride, o->t.rank, o->t.stride));
    if (o->data == DATA_NULL)
        printf(", data NULL");
    else if (o->data == DATA_FOREIGN)
        printf(", foreign pointer");
    else
        printf(", at arena byte %lld", (long long)o->pos);
    printf(" (offset %lld)", (long long)o->t.offset);
    int64_t lo, hi;
    if (o->data == DATA_ARENA && arena_reach(o, &lo, &hi))
        printf(", bytes [%lld, %lld)", (long long)lo, (long long)hi);
    if (!operand_used(c, o))
        printf(", not read by this call");
    printf("\n");
}

static void describe_options(const fuzz_call *c)
{
    const moefuse_act_options *a = &c->aq.act;
    const moefuse_quant_options *q = &c->aq.quant;
    if (c->null_options) {
        printf("    options NULL\n");
        return;
    }
    if (takes_act_options(c->op))
        printf("    act {activation %d, order %d, limit %g, intermediate %d, alpha %g, "
               "up_offset %g}\n",
               (int)a->activation, (int)a->order, (double)a->limit, (int)a->intermediate,
               (double)a->alpha, (double)a->up_offset);
    if (takes_quant_options(c->op))
        printf("    quant {group_size %lld, layout %d, ue8m0 %d, eps %g}%s\n",
               (long long)q->group_size, (int)q->scale_layout, (int)q->ue8m0, (double)q->eps,
               c->op == OP_ACT_QUANT_MASKED ? (c->aq.zero_tail ? " zero_tail" : "") : "");
    if (is_moe(c->op))
        printf("    moe {activation %d, order %d, limit %g, alpha %g, up_offset %g}%s\n",
               (int)c->moe.activation, (int)c->moe.order, (double)c->moe.limit,
               (double)c->moe.alpha, (double)c->moe.up_offset,
               c->null_routing ? " routing NULL" : "");
    if (c->op == OP_TOPK_SOFTMAX)
        printf("    renormalize %d\n", (int)c->renormalize);
    if (c->op == OP_TOPK_ROUTE)
        printf("    router {scoring %d, n_group %d, topk_group %d, group_scoring %d, renormalize "
               "%d, scale %g}\n",
               (int)c->route.scoring, (int)c->route.n_group, (int)c->route.topk_group,
               (int)c->route.group_scoring, (int)c->route.renormalize, (double)c->route.scale);
    if (c->op == OP_ROUTING_META)
        printf("    block_size %d%s\n", (int)c->block_size, c->null_routing ? " routing NULL" : "");
}

void describe_call(const fuzz_call *c)
{
    printf("  %s%s, perturbed: %s\n", op_names[c->op], c->null_context ? " (ctx NULL)" : "",
           c->perturbations ? c->notes : "nothing");
    for (int i = 0; i < c->count; i++)
        describe_operand(c, &c->v[i]);
    describe_options(c);
}

void violation(fuzzer *f, enum violation_kind kind, const fuzz_call *c,
                      const call_record *rec, const char *fmt, ...)
{
    f->violations++;
    if (++f->violations_of[kind] > REPORTS_PER_KIND)
        return;
    printf("VIOLATION (%s): seed %llu call %llu on %s: ", violation_names[kind],
           (unsigned long long)f->seed, (unsigned long long)rec->index, f->backend);
    va_list args;
    va_start(args, fmt);
    vprintf(fmt, args);
    va_end(args);
    printf("\n  returned %s: \"%s\"\n", moefuse_status_name(rec->status), rec->message);
    if (c)
        describe_call(c);
    printf("  replay: MOEFUSE_TEST_BACKEND=%s MOEFUSE_FUZZ_SEED=%llu MOEFUSE_FUZZ_START=%llu "
           "MOEFUSE_FUZZ_CALLS=1 MOEFUSE_FUZZ_VERBOSE=1 %s\n",
           f->backend, (unsigned long long)f->seed, (unsigned long long)rec->index, f->program);
    fflush(stdout);
}

/* Names of the operands whose bytes hold arena byte b, for reports. */
static const char *owners_of(const fuzz_call *c, int64_t b, char *buf, size_t size)
{
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < c->count; i++) {
        int64_t lo, hi;
        const operand *o = &c->v[i];
        if (o->passed && o->data == DATA_ARENA && arena_reach(o, &lo, &hi) && lo <= b && b < hi &&
            used < size)
            used += (size_t)snprintf(buf + used, size - used, "%s%s", used ? ", " : "", o->name);
    }
    if (!used)
        snprintf(buf, size, "no operand");
    return buf;
}

/* Changed bytes that were not allowed to change; reports the first few. */
static void check_writes(fuzzer *f, const fuzz_call *c, const call_record *rec, bool accepted)
{
    if (memcmp(f->before, f->after, (size_t)f->arena_bytes) == 0)
        return;
    memset(f->writable, 0, (size_t)f->arena_bytes);
    if (accepted)
        for (int i = 0; i < c->count; i++)
            if (c->v[i].role == ROLE_OUTPUT && operand_present(&c->v[i]))
                for_each_element(f, &c->v[i], mark_writable, f->writable);
    char where[400] = "", owners[96];
    size_t used = 0;
    int64_t bad = 0;
    for (int64_t b = 0; b < f->arena_bytes; b++) {
        if (b % 64 == 0 && memcmp(f->before + b, f->after + b, 64) == 0) {
            b += 63; /* ARENA_BYTES is a multiple of 64 */
            continue;
        }
        if (f->before[b] == f->after[b] || f->writable[b])
            continue;
        if (bad++ < 4 && used < sizeof where)
            used += (size_t)snprintf(where + used, sizeof where - used,
                                     "%sbyte %lld (in %s) 0x%02x -> 0x%02x", used ? "; " : "",
                                     (long long)b, owners_of(c, b, owners, sizeof owners),
                                     f->before[b], f->after[b]);
    }
    if (bad)
        violation(f, accepted ? V_WROTE_OUTSIDE_OUTPUTS : V_REFUSED_BUT_WROTE, c, rec,
                  "%s call changed %lld bytes %s: %s", accepted ? "an accepted" : "a refused",
                  (long long)bad, accepted ? "outside its outputs" : "of the arena", where);
}

void check_call(fuzzer *f, const fuzz_call *c, const call_record *rec, const verdict *v)
{
    moefuse_status st = rec->status;
    if ((unsigned)st >= MOEFUSE_STATUS_COUNT_) {
        violation(f, V_STATUS, c, rec, "status %d is not a moefuse_status", (int)st);
        return;
    }
    if (st == MOEFUSE_OK) {
        if (rec->message[0])
            violation(f, V_MESSAGE, c, rec, "accepted, yet the last error is set");
        if (v->expect == EXPECT_REFUSAL)
            violation(f, v->kind, c, rec, "accepted a call it must refuse: %s", v->why);
    } else {
        if (!rec->message[0])
            violation(f, V_MESSAGE, c, rec, "refused without a message");
        if (v->expect == EXPECT_OK)
            violation(f, V_REFUSED_VALID, c, rec, "refused a valid call");
        /* every tensor fits in the arena: no scratch worth failing for, no device error */
        else if (st == MOEFUSE_ERR_INTERNAL || st == MOEFUSE_ERR_BACKEND_FAILURE ||
                 st == MOEFUSE_ERR_OUT_OF_MEMORY)
            violation(f, V_STATUS, c, rec, "%s on a call whose tensors fit in %d KiB",
                      moefuse_status_name(st), ARENA_BYTES / 1024);
    }
    check_writes(f, c, rec, st == MOEFUSE_OK);
}
