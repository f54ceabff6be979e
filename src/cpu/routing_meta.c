/*
 * routing_metadata (include/moefuse.h): a counting sort of the valid slots by local expert,
 * stable (ascending slot within an expert), with each expert's list padded to the block size.
 * One pass to count, a prefix, one pass to place: the reference the device backends match.
 */
#include "cpu/cpu_internal.h"
#include "cpu/moe_slots.h"
#include "cpu/tensor_cpu.h"

#include <stdint.h>

moefuse_status mf_cpu_routing_metadata(moefuse_context *ctx, void *state, const mf_meta_args *a)
{
    (void)state;
    const mf_moe_args *r = &a->route;
    const int64_t M = r->tokens, k = r->topk, E = r->experts, S = M * k;
    mf_cpu_scratch scratch;
    MF_TRY(mf_cpu_scratch_take(ctx, "routing_metadata", (size_t)(3 * E + 1) * sizeof(int64_t),
                               &scratch));
    int64_t *cnt = (int64_t *)scratch.mem, *start = cnt + E, *fill = start + E;
    for (int64_t e = 0; e < E; e++)
        cnt[e] = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t e = mf_slot_expert(r, s / k, s % k);
        if (e >= 0)
            cnt[e]++;
    }
    int64_t total = 0;
    for (int64_t e = 0; e < E; e++) {
        *(int32_t *)mf_at1(&a->counts, e) = (int32_t)cnt[e];
        if (a->offsets.data)
            *(int32_t *)mf_at1(&a->offsets, e) = (int32_t)total;
        start[e] = fill[e] = total;
        total += (cnt[e] + a->block - 1) / a->block * a->block;
    }
    if (a->offsets.data)
        *(int32_t *)mf_at1(&a->offsets, E) = (int32_t)total;
    if (a->order.data) /* padding and the tail: -1; the slots overwrite their entries below */
        for (int64_t p = 0; p < a->length; p++)
            *(int32_t *)mf_at1(&a->order, p) = -1;
    for (int64_t s = 0; s < S; s++) {
        const int64_t m = s / k, j = s % k, e = mf_slot_expert(r, m, j);
        const int64_t p = e >= 0 ? fill[e]++ : -1;
        if (a->order.data && p >= 0)
            *(int32_t *)mf_at1(&a->order, p) = (int32_t)s;
        if (a->position.data)
            *(int32_t *)mf_at2(&a->position, m, j) = (int32_t)p;
        if (a->masked_row.data)
            *(int32_t *)mf_at2(&a->masked_row, m, j) = (int32_t)(p >= 0 ? p - start[e] : -1);
    }
    mf_cpu_scratch_release(&scratch);
    return MOEFUSE_OK;
}
