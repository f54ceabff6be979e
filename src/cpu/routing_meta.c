/*
 * routing_metadata (include/moefuse.h, docs/NUMERICS.md "Routing metadata"). Each local expert
 * scans every slot in order, so its list comes out ascending: no scratch (the call declares
 * none), no sort, and the experts run in parallel. O(E * M * k), the OpenCL kernels' shape.
 */
#include "cpu/cpu_internal.h"
#include "cpu/moe_slots.h"
#include "cpu/omp_compat.h"
#include "cpu/tensor_cpu.h"

#include <stdint.h>

/* Where expert e's list starts: its predecessors' counts, each padded to the block. */
static int64_t list_start(const mf_meta_args *a, int64_t e)
{
    int64_t start = 0;
    for (int64_t f = 0; f < e; f++) {
        const int64_t n = *(const int32_t *)mf_at1(&a->counts, f);
        start += (n + a->block - 1) / a->block * a->block;
    }
    return start;
}

moefuse_status mf_cpu_routing_metadata(moefuse_context *ctx, void *state, const mf_meta_args *a)
{
    (void)ctx;
    (void)state;
    const mf_moe_args *r = &a->route;
    const int64_t k = r->topk, E = r->experts, S = r->tokens * k;
MF_OMP(parallel for schedule(static))
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0;
        for (int64_t s = 0; s < S; s++)
            n += mf_slot_expert(r, s / k, s % k) == e;
        *(int32_t *)mf_at1(&a->counts, e) = (int32_t)n;
    }
MF_OMP(parallel for schedule(static))
    for (int64_t e = 0; e <= E; e++) {
        const int64_t start = list_start(a, e);
        if (a->offsets.data)
            *(int32_t *)mf_at1(&a->offsets, e) = (int32_t)start;
        if (e == E) { /* past the total: -1 */
            for (int64_t p = start; a->order.data && p < a->length; p++)
                *(int32_t *)mf_at1(&a->order, p) = -1;
            continue;
        }
        int64_t n = 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t m = s / k, j = s % k;
            if (mf_slot_expert(r, m, j) != e)
                continue;
            if (a->order.data)
                *(int32_t *)mf_at1(&a->order, start + n) = (int32_t)s;
            if (a->position.data)
                *(int32_t *)mf_at2(&a->position, m, j) = (int32_t)(start + n);
            if (a->masked_row.data)
                *(int32_t *)mf_at2(&a->masked_row, m, j) = (int32_t)n;
            n++;
        }
        const int64_t end = start + (n + a->block - 1) / a->block * a->block;
        for (int64_t p = start + n; a->order.data && p < end; p++)
            *(int32_t *)mf_at1(&a->order, p) = -1; /* the list's padding */
    }
    for (int64_t s = 0; s < S; s++) { /* invalid slots */
        const int64_t m = s / k, j = s % k;
        if (mf_slot_expert(r, m, j) >= 0)
            continue;
        if (a->position.data)
            *(int32_t *)mf_at2(&a->position, m, j) = -1;
        if (a->masked_row.data)
            *(int32_t *)mf_at2(&a->masked_row, m, j) = -1;
    }
    return MOEFUSE_OK;
}
