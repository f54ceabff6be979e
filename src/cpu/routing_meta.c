/*
 * routing_metadata (include/moefuse.h, docs/NUMERICS.md "Routing metadata"): the contract's
 * definition, walked once. The slots are counted in order; the padded counts give each
 * expert's start; then the slots are placed in order, each at its expert's next position, so
 * every list is ascending by construction. O(M * k + E) on one thread, with two words of
 * scratch per expert (each expert's start and next place).
 */
#include "cpu/cpu_internal.h"
#include "cpu/moe_slots.h"
#include "cpu/tensor_cpu.h"

#include <stdint.h>

moefuse_status mf_cpu_meta_workspace(moefuse_context *ctx, void *state, const mf_meta_args *a,
                                     size_t *bytes)
{
    (void)ctx;
    (void)state;
    *bytes = (size_t)a->route.experts * 2 * sizeof(int64_t);
    return MOEFUSE_OK;
}

static void put1(const moefuse_tensor *t, int64_t i, int64_t v)
{
    if (t->data)
        *(int32_t *)mf_at1(t, i) = (int32_t)v;
}

static void put2(const moefuse_tensor *t, int64_t m, int64_t j, int64_t v)
{
    if (t->data)
        *(int32_t *)mf_at2(t, m, j) = (int32_t)v;
}

moefuse_status mf_cpu_routing_metadata(moefuse_context *ctx, void *state, const mf_meta_args *a)
{
    static const char op[] = "routing_metadata";
    const mf_moe_args *r = &a->route;
    const int64_t k = r->topk, E = r->experts, S = r->tokens * k, B = a->block;
    size_t bytes;
    MF_TRY(mf_cpu_meta_workspace(ctx, state, a, &bytes));
    mf_cpu_scratch scratch = {0};
    if (bytes > 0) /* no experts: no scratch (every slot is invalid) */
        MF_TRY(mf_cpu_scratch_take(ctx, op, bytes, &scratch));
    int64_t *start = (int64_t *)scratch.mem, *next = start ? start + E : NULL;

    for (int64_t e = 0; e < E; e++)
        next[e] = 0; /* each expert's count, for now */
    for (int64_t s = 0; s < S; s++) {
        const int64_t e = mf_slot_expert(r, s / k, s % k);
        if (e >= 0)
            next[e]++;
    }
    int64_t at = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = next[e], padded = (n + B - 1) / B * B;
        put1(&a->counts, e, n);
        put1(&a->offsets, e, at);
        for (int64_t p = at + n; p < at + padded; p++)
            put1(&a->order, p, -1); /* the list's padding */
        start[e] = at;
        next[e] = at;
        at += padded;
    }
    put1(&a->offsets, E, at);
    for (int64_t p = at; p < a->length; p++)
        put1(&a->order, p, -1); /* past the total */
    for (int64_t s = 0; s < S; s++) {
        const int64_t m = s / k, j = s % k, e = mf_slot_expert(r, m, j);
        if (e < 0) { /* invalid slots */
            put2(&a->position, m, j, -1);
            put2(&a->masked_row, m, j, -1);
            continue;
        }
        const int64_t p = next[e]++;
        put1(&a->order, p, s);
        put2(&a->position, m, j, p);
        put2(&a->masked_row, m, j, p - start[e]);
    }
    mf_cpu_scratch_release(&scratch);
    return MOEFUSE_OK;
}
