/*
 * Tiled MoE GEMMs over slots grouped by expert on the device.
 *
 * mf_moe_route_* (below) list the valid slots s = m * k + j of a slot range
 * grouped by local expert, with offs[E+1] (slot prefix) and tiles[E+1]
 * (prefix of MF_TM-slot tiles). A GEMM work-group takes one tile of one expert and a
 * block of output columns: MF_TM x (columns) outputs, MF_TK-deep slabs of the
 * activations and the weights staged in local memory, each work-item holding
 * a 4 x 2 (gate: times two, gate and up) or 4 x 4 (final) register tile.
 * Every output is still one fma chain over k = 0, 1, ... in order, so the
 * tiling changes speed only, never a bit.
 */
#define MF_TM 64 /* slots per tile */
#define MF_TK 16 /* depth of one staged slab */
#define MF_TH 32 /* gate: h columns per work-group (64 weight rows: gate and up) */
#define MF_TN 64 /* final: output columns per work-group */
/* work-group 16 x 16: rows ty + 16 i (i < 4), columns tx + 16 jj */

/*
 * Routing in three steps over slots [s0, s1): count the valid slots of each
 * expert (integer atomics: the counts do not depend on the order), scan the
 * counts into offs / tiles (one work-item; E is small), then place each slot
 * at fill[e]++. The order of the slots inside an expert's list is therefore
 * unspecified, which changes nothing: every output element is its own fma
 * chain, whatever tile or row of a tile its slot lands in.
 * Layout: route = longs [offs (E+1) | tiles (E+1) | list (s1 - s0)] and
 * cf = ints [count (E) | fill (E)] (the same buffer, int offset cfo).
 */
__kernel void mf_moe_route_count(__global const int *ids, long io, long is0,
                                 __global const int *map, long mo, long ms0, int has_map,
                                 long topk, long experts, long global_experts, long s0, long s1,
                                 __global int *cf, long cfo)
{
    const long s = s0 + (long)get_global_id(0);
    if (s >= s1)
        return;
    const long e = mf_slot_expert(ids, io, is0, s / topk, s % topk, map, mo, ms0, has_map,
                                  experts, global_experts);
    if (e >= 0)
        atomic_inc(&cf[cfo + e]);
}

__kernel void mf_moe_route_scan(__global long *route, __global int *cf, long cfo, long experts)
{
    if (get_global_id(0) != 0)
        return;
    __global long *offs = route, *tiles = route + experts + 1;
    offs[0] = 0;
    tiles[0] = 0;
    for (long e = 0; e < experts; e++) {
        const long n = cf[cfo + e];
        offs[e + 1] = offs[e] + n;
        tiles[e + 1] = tiles[e] + (n + MF_TM - 1) / MF_TM;
        cf[cfo + experts + e] = (int)offs[e];
    }
}

__kernel void mf_moe_route_fill(__global const int *ids, long io, long is0,
                                __global const int *map, long mo, long ms0, int has_map,
                                long topk, long experts, long global_experts, long s0, long s1,
                                __global long *route, __global int *cf, long cfo)
{
    const long s = s0 + (long)get_global_id(0);
    if (s >= s1)
        return;
    const long e = mf_slot_expert(ids, io, is0, s / topk, s % topk, map, mo, ms0, has_map,
                                  experts, global_experts);
    if (e >= 0)
        route[2 * experts + 2 + atomic_inc(&cf[cfo + experts + e])] = s;
}

/* Zero the rows [.., width) of invalid slots: h for the gate, y when un-reduced. */
__kernel void mf_moe_zero_invalid(__global const int *ids, long io, long is0,
                                  __global const int *map, long mo, long ms0, int has_map,
                                  long topk, long experts, long global_experts,
                                  __global uchar *out, long oo, long os0, long os1, int odt,
                                  long width)
{
    const long slot = (long)get_global_id(1), col = (long)get_global_id(0);
    const long m = slot / topk, j = slot % topk;
    if (col >= width ||
        mf_slot_expert(ids, io, is0, m, j, map, mo, ms0, has_map, experts, global_experts) >= 0)
        return;
    mf_store(out, odt, oo + m * os0 + j * os1 + col, 0.0f);
}

/* Tile `tile` of the route: its expert, first list entry and slot count; false past the end. */
inline int mf_tile_of(__global const long *route, long experts, long tile, long *e, long *first,
                      long *n)
{
    __global const long *offs = route, *tiles = route + experts + 1;
    if (tile >= tiles[experts])
        return 0;
    *e = mf_find_expert(tiles, experts, tile);
    *first = offs[*e] + (tile - tiles[*e]) * MF_TM;
    const long left = offs[*e + 1] - *first;
    *n = left < MF_TM ? left : MF_TM;
    return 1;
}

__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void mf_moe_gate_tiled(__global const uchar *x, long xo, long xs0, int xdt,
                       __global const uchar *w1, long wo, long ws0, long ws1,
                       __global const uchar *b1, long bo, long bs0, int bdt, int has_b,
                       __global const long *route, long experts, long topk, long kdim, long idim,
                       int act, int order, float limit, float alpha, float beta,
                       __global uchar *h, long ho, long hs0, long hs1, int hdt)
{
    __local float as[MF_TK][MF_TM];
    __local float bs[MF_TK][2 * MF_TH];
    __local long rows[MF_TM];
    const int tx = (int)get_local_id(0), ty = (int)get_local_id(1), lid = ty * 16 + tx;
    long e, first, n;
    if (!mf_tile_of(route, experts, (long)get_group_id(1), &e, &first, &n))
        return; /* the whole work-group: tile is uniform */
    const long i0 = (long)get_group_id(0) * MF_TH;
    const long grow = mf_gate_at(order, idim), urow = mf_up_at(order, idim);
    const long step = mf_gate_step(order);
    __global const long *list = route + 2 * experts + 2;
    if (lid < MF_TM)
        rows[lid] = lid < n ? list[first + lid] : -1;
    barrier(CLK_LOCAL_MEM_FENCE);
    float ag[4][2], au[4][2];
    for (int i = 0; i < 4; i++)
        for (int jj = 0; jj < 2; jj++)
            ag[i][jj] = au[i][jj] = 0.0f;
    for (long k0 = 0; k0 < kdim; k0 += MF_TK) {
        const int kn = kdim - k0 < MF_TK ? (int)(kdim - k0) : MF_TK;
        for (int q = 0; q < 4; q++) {
            const int idx = lid + 256 * q, r = idx / MF_TK, kk = idx % MF_TK;
            const long s = rows[r];
            as[kk][r] = (s >= 0 && kk < kn) ? mf_load(x, xdt, xo + (s / topk) * xs0 + k0 + kk)
                                            : 0.0f;
            const int c = idx / MF_TK; /* 0..63: gate columns, then up columns */
            const long col = i0 + (c % MF_TH);
            const long wrow = (c < MF_TH ? grow : urow) + col * step;
            bs[kk][c] = (col < idim && kk < kn)
                            ? mf_load(w1, xdt, wo + e * ws0 + wrow * ws1 + k0 + kk)
                            : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int kk = 0; kk < kn; kk++) { /* only real k: the chains match the CPU's */
            float a[4], bg[2], bu[2];
            for (int i = 0; i < 4; i++)
                a[i] = as[kk][ty + 16 * i];
            for (int jj = 0; jj < 2; jj++) {
                bg[jj] = bs[kk][tx + 16 * jj];
                bu[jj] = bs[kk][MF_TH + tx + 16 * jj];
            }
            for (int i = 0; i < 4; i++)
                for (int jj = 0; jj < 2; jj++) {
                    ag[i][jj] = fma(a[i], bg[jj], ag[i][jj]);
                    au[i][jj] = fma(a[i], bu[jj], au[i][jj]);
                }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int i = 0; i < 4; i++) {
        const int r = ty + 16 * i;
        if (r >= n)
            continue;
        const long s = rows[r], m = s / topk, j = s % topk;
        for (int jj = 0; jj < 2; jj++) {
            const long col = i0 + tx + 16 * jj;
            if (col >= idim)
                continue;
            mf_store(h, hdt, ho + m * hs0 + j * hs1 + col,
                     mf_gate_out(ag[i][jj], au[i][jj], b1, bdt, bo + e * bs0, has_b, grow, urow,
                                 step, col, mf_gate_fn_of(act, alpha, limit, beta)));
        }
    }
}

/*
 * y = h[m, j] @ w2[e]^T (+ b2[e]) for one tile. Un-reduced: y rounded into
 * out[m, j, :]. Reduced: y in f32 into ybuf[(s - s0) * K + col], summed in
 * j order by mf_moe_reduce.
 */
__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void mf_moe_final_tiled(__global const uchar *hp, long ho, long hs0, long hs1, int hdt,
                        __global const uchar *w2, long wo, long ws0, long ws1,
                        __global const uchar *b2, long bo, long bs0, int bdt, int has_b,
                        __global const long *route, long experts, long topk, long kdim, long idim,
                        int reduce, long s0, __global float *ybuf, long ybo,
                        __global uchar *out, long oo, long os0, long os1, int odt)
{
    __local float as[MF_TK][MF_TM];
    __local float bs[MF_TK][MF_TN];
    __local long rows[MF_TM];
    const int tx = (int)get_local_id(0), ty = (int)get_local_id(1), lid = ty * 16 + tx;
    long e, first, n;
    if (!mf_tile_of(route, experts, (long)get_group_id(1), &e, &first, &n))
        return;
    const long r0 = (long)get_group_id(0) * MF_TN;
    __global const long *list = route + 2 * experts + 2;
    if (lid < MF_TM)
        rows[lid] = lid < n ? list[first + lid] : -1;
    barrier(CLK_LOCAL_MEM_FENCE);
    float acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int jj = 0; jj < 4; jj++)
            acc[i][jj] = 0.0f;
    for (long k0 = 0; k0 < idim; k0 += MF_TK) {
        const int kn = idim - k0 < MF_TK ? (int)(idim - k0) : MF_TK;
        for (int q = 0; q < 4; q++) {
            const int idx = lid + 256 * q, r = idx / MF_TK, kk = idx % MF_TK;
            const long s = rows[r];
            as[kk][r] = (s >= 0 && kk < kn)
                            ? mf_load(hp, hdt, ho + (s / topk) * hs0 + (s % topk) * hs1 + k0 + kk)
                            : 0.0f;
            const long col = r0 + r; /* r is 0..63 here too: the weight row */
            bs[kk][r] = (col < kdim && kk < kn)
                            ? mf_load(w2, hdt, wo + e * ws0 + col * ws1 + k0 + kk)
                            : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int kk = 0; kk < kn; kk++) {
            float a[4], b[4];
            for (int i = 0; i < 4; i++)
                a[i] = as[kk][ty + 16 * i];
            for (int jj = 0; jj < 4; jj++)
                b[jj] = bs[kk][tx + 16 * jj];
            for (int i = 0; i < 4; i++)
                for (int jj = 0; jj < 4; jj++)
                    acc[i][jj] = fma(a[i], b[jj], acc[i][jj]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int i = 0; i < 4; i++) {
        const int r = ty + 16 * i;
        if (r >= n)
            continue;
        const long s = rows[r], m = s / topk, j = s % topk;
        for (int jj = 0; jj < 4; jj++) {
            const long col = r0 + tx + 16 * jj;
            if (col >= kdim)
                continue;
            float y = acc[i][jj];
            if (has_b)
                y = y + mf_load(b2, bdt, bo + e * bs0 + col);
            if (reduce)
                ybuf[ybo + (s - s0) * kdim + col] = y;
            else
                mf_store(out, odt, oo + m * os0 + j * os1 + col, y);
        }
    }
}

/* out[m, col] = sum over valid j in order of topk_weights[m, j] * y, from 0; rows m0 + group. */
__kernel void mf_moe_reduce(__global const int *ids, long io, long is0,
                            __global const float *tw, long two, long tws0,
                            __global const int *map, long mo, long ms0, int has_map, long topk,
                            long experts, long global_experts, long kdim, long m0,
                            __global const float *ybuf, long ybo, __global uchar *out, long oo, long os0,
                            int odt)
{
    const long col = (long)get_global_id(0), m = m0 + (long)get_global_id(1);
    if (col >= kdim)
        return;
    float acc = 0.0f;
    for (long j = 0; j < topk; j++) {
        if (mf_slot_expert(ids, io, is0, m, j, map, mo, ms0, has_map, experts, global_experts) < 0)
            continue;
        const float prod = tw[two + m * tws0 + j] * ybuf[ybo + (m * topk + j - m0 * topk) * kdim + col];
        acc = acc + prod;
    }
    mf_store(out, odt, oo + m * os0 + col, acc);
}
