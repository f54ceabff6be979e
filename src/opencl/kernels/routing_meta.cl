/*
 * routing_metadata (src/cpu/routing_meta.c is the reference). One work-item per local expert
 * scans every slot in order, so each expert's list comes out ascending with no atomics and no
 * sort: O(E * M * k) reads, which the few-kilobyte ids of a decode or prefill step afford.
 * mf_slot_expert is moe.cl's.
 */
#define MF_META_ROUTE                                                                          \
    __global const int *ids, long io, long is0, __global const int *map, long mo, long ms0,  \
        int has_map, long tokens, long topk, long experts, long global_experts

#define MF_META_EXPERT(s)                                                                       \
    mf_slot_expert(ids, io, is0, (s) / topk, (s) % topk, map, mo, ms0, has_map, experts,      \
                   global_experts)

/* counts[e]: the valid slots of expert e. */
__kernel void mf_routing_meta_count(MF_META_ROUTE, __global int *counts, long co)
{
    const long e = (long)get_global_id(0);
    if (e >= experts)
        return;
    long n = 0;
    for (long s = 0; s < tokens * topk; s++)
        n += MF_META_EXPERT(s) == e;
    counts[co + e] = (int)n;
}

/*
 * Work-item e < E: offsets[e], its slots in order with their positions and masked rows, its
 * padding (-1). Work-item E: offsets[E], and -1 in order past the total.
 */
__kernel void mf_routing_meta_place(MF_META_ROUTE, __global const int *counts, long co,
                                    long block, long length,
                                    __global int *offsets, long oo, int has_offsets,
                                    __global int *order, long ro, int has_order,
                                    __global int *position, long po, long ps0, int has_position,
                                    __global int *mrow, long wo, long ws0, int has_mrow)
{
    const long e = (long)get_global_id(0);
    if (e > experts)
        return;
    long start = 0;
    for (long f = 0; f < e; f++)
        start += (counts[co + f] + block - 1) / block * block;
    if (has_offsets)
        offsets[oo + e] = (int)start;
    if (e == experts) {
        if (has_order)
            for (long p = start; p < length; p++)
                order[ro + p] = -1;
        return;
    }
    long n = 0;
    for (long s = 0; s < tokens * topk; s++) {
        if (MF_META_EXPERT(s) != e)
            continue;
        if (has_order)
            order[ro + start + n] = (int)s;
        if (has_position)
            position[po + (s / topk) * ps0 + s % topk] = (int)(start + n);
        if (has_mrow)
            mrow[wo + (s / topk) * ws0 + s % topk] = (int)n;
        n++;
    }
    if (has_order)
        for (long p = start + n; p < start + (n + block - 1) / block * block; p++)
            order[ro + p] = -1;
}

/* The invalid slots' position and masked row: -1. */
__kernel void mf_routing_meta_invalid(MF_META_ROUTE, __global int *position, long po, long ps0,
                                      int has_position, __global int *mrow, long wo, long ws0,
                                      int has_mrow)
{
    const long s = (long)get_global_id(0);
    if (s >= tokens * topk || MF_META_EXPERT(s) >= 0)
        return;
    if (has_position)
        position[po + (s / topk) * ps0 + s % topk] = -1;
    if (has_mrow)
        mrow[wo + (s / topk) * ws0 + s % topk] = -1;
}

/*
 * Shared experts as slots (the core's moe_shared_routing; src/cpu/moe_slots.c is the
 * reference): work-item m writes the k + n slots of token m, routed ids as local ids (-1 when
 * invalid or on a shared expert), then experts - n + s; their weights when has_w.
 */
__kernel void mf_moe_shared_routing(MF_META_ROUTE, __global const float *w, long wo, long ws0,
                                    int has_w, long n, float scale,
                                    __global const float *sw, long swo, long sws0, int has_sw,
                                    __global int *oids, long oio, __global float *ow, long owo)
{
    const long m = (long)get_global_id(0);
    if (m >= tokens)
        return;
    const long slots = topk + n, shared0 = experts - n;
    for (long j = 0; j < topk; j++) {
        const long e = mf_slot_expert(ids, io, is0, m, j, map, mo, ms0, has_map, experts,
                                      global_experts);
        oids[oio + m * slots + j] = e >= 0 && e < shared0 ? (int)e : -1;
        if (has_w)
            ow[owo + m * slots + j] = w[wo + m * ws0 + j];
    }
    const float f = has_sw ? mf_mul(scale, sw[swo + m * sws0]) : scale; /* x86 NaN bits */
    for (long s = 0; s < n; s++) {
        oids[oio + m * slots + topk + s] = (int)(shared0 + s);
        if (has_w)
            ow[owo + m * slots + topk + s] = f;
    }
}
