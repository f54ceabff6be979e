/*
 * routing_metadata (src/cpu/routing_meta.c is the reference). Two paths, both ascending in the
 * slot by construction, no atomic deciding a place:
 *  - spans (E <= MF_META_SPAN_E): a work-group per span of slots counts it per expert (local
 *    atomics: a count does not depend on their order); then a work-group per span sums the
 *    spans before its own and all of them, scans the padded totals into the offsets, and
 *    places its slots a round of 64 at a time, a slot's place its expert's next one plus the
 *    round's earlier slots of the same expert. O(M * k * 64 + spans * E).
 *  - per expert (more experts): a work-item per local expert scans every slot in order:
 *    O(E * M * k).
 * mf_slot_expert is moe.cl's.
 */
#define MF_META_ROUTE                                                                          \
    __global const int *ids, long io, long is0, __global const int *map, long mo, long ms0,  \
        int has_map, long tokens, long topk, long experts, long global_experts

/* What both place kernels write (counts is read back by the per-expert one). */
#define MF_META_OUTPUTS                                                                        \
    __global int *counts, long co, long block, long length, __global int *offsets, long oo,   \
        int has_offsets, __global int *order, long ro, int has_order, __global int *position, \
        long po, long ps0, int has_position, __global int *mrow, long wo, long ws0, int has_mrow

#define MF_META_EXPERT(s)                                                                       \
    mf_slot_expert(ids, io, is0, (s) / topk, (s) % topk, map, mo, ms0, has_map, experts,      \
                   global_experts)

/* ------------------------------------------------------------ spans */

#define MF_META_SPAN_E 2048 /* the most experts of the span path (its local arrays) */
#define MF_META_WG 64       /* work-items of a span's work-group; a round of slots */

/* Span b (work-group b) of `span` slots: its count of each expert, to sums[b * E + e]. */
__kernel __attribute__((reqd_work_group_size(MF_META_WG, 1, 1)))
void mf_routing_meta_span_count(MF_META_ROUTE, long span, __global int *sums)
{
    __local int hist[MF_META_SPAN_E];
    const long b = (long)get_group_id(0), lid = (long)get_local_id(0);
    const long S = tokens * topk, lo = b * span, hi = min(lo + span, S);
    for (long e = lid; e < experts; e += MF_META_WG)
        hist[e] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (long s = lo + lid; s < hi; s += MF_META_WG) {
        const long e = MF_META_EXPERT(s);
        if (e >= 0)
            atomic_inc(&hist[e]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (long e = lid; e < experts; e += MF_META_WG)
        sums[b * experts + e] = hist[e];
}

/*
 * Span b: the offsets from every span's counts, then its slots in rounds of MF_META_WG, each
 * placed at its expert's next position plus its rank among the round's earlier slots of the
 * same expert; the padding of the experts e = b (mod spans) and a share of the tail. Work-group
 * 0 writes counts and offsets.
 */
__kernel __attribute__((reqd_work_group_size(MF_META_WG, 1, 1)))
void mf_routing_meta_span_place(MF_META_ROUTE, long span, __global const int *sums,
                                MF_META_OUTPUTS)
{
    __local int tot[MF_META_SPAN_E], next[MF_META_SPAN_E], off[MF_META_SPAN_E + 1];
    __local long round_e[MF_META_WG];
    const long b = (long)get_group_id(0), spans = (long)get_num_groups(0);
    const long lid = (long)get_local_id(0);
    const long S = tokens * topk, lo = b * span, hi = min(lo + span, S);
    for (long e = lid; e < experts; e += MF_META_WG) {
        int before = 0, all = 0;
        for (long c = 0; c < spans; c++) {
            const int n = sums[c * experts + e];
            before += c < b ? n : 0;
            all += n;
        }
        tot[e] = all;
        next[e] = before;
        if (b == 0)
            counts[co + e] = all;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) { /* the padded totals, scanned in expert order */
        int at = 0;
        for (long e = 0; e < experts; e++) {
            off[e] = at;
            at += (int)((tot[e] + block - 1) / block * block);
        }
        off[experts] = at;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (long e = lid; e <= experts; e += MF_META_WG) {
        if (e < experts)
            next[e] += off[e];
        if (has_offsets && b == 0)
            offsets[oo + e] = off[e];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (long s0 = lo; s0 < hi; s0 += MF_META_WG) {
        const long s = s0 + lid;
        const long e = s < hi ? MF_META_EXPERT(s) : -2;
        round_e[lid] = e;
        barrier(CLK_LOCAL_MEM_FENCE);
        int rank = 0, later = 0;
        for (long j = 0; j < MF_META_WG; j++) {
            rank += j < lid && round_e[j] == e;
            later += j > lid && round_e[j] == e;
        }
        if (e >= 0) {
            const int pos = next[e] + rank;
            if (has_order)
                order[ro + pos] = (int)s;
            if (has_position)
                position[po + (s / topk) * ps0 + s % topk] = pos;
            if (has_mrow)
                mrow[wo + (s / topk) * ws0 + s % topk] = pos - off[e];
        } else if (e == -1) {
            if (has_position)
                position[po + (s / topk) * ps0 + s % topk] = -1;
            if (has_mrow)
                mrow[wo + (s / topk) * ws0 + s % topk] = -1;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (e >= 0 && later == 0) /* the round's last slot of e moves e's next place */
            next[e] += rank + 1;
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (!has_order)
        return;
    for (long e = b + spans * lid; e < experts; e += spans * MF_META_WG)
        for (long p = off[e] + tot[e]; p < off[e + 1]; p++)
            order[ro + p] = -1;
    for (long p = off[experts] + b * MF_META_WG + lid; p < length; p += spans * MF_META_WG)
        order[ro + p] = -1;
}

/* ------------------------------------------------------------ per expert */

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
__kernel void mf_routing_meta_place(MF_META_ROUTE, MF_META_OUTPUTS)
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
