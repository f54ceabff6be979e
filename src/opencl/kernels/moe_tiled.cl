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
/* work-group 16 x 16: rows ty + 16 i (i < 4), columns tx + 16 jj (jj < 4) of MF_TN */
#if 2 * MF_TH != MF_TN
#error "the gate's tile (gate and up columns) is mf_tile_gemm's MF_TN wide"
#endif

/*
 * Routing in three steps over slots [s0, s1): count the valid slots of each
 * expert (integer atomics: the counts do not depend on the order), scan the
 * counts into offs / tiles of tm slots (one work-item; E is small: MF_TM here,
 * MF_FP8_TM for moe_fp8_tiled.cl), then place each slot
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

__kernel void mf_moe_route_scan(__global long *route, __global int *cf, long cfo, long experts,
                                long tm)
{
    if (get_global_id(0) != 0)
        return;
    __global long *offs = route, *tiles = route + experts + 1;
    offs[0] = 0;
    tiles[0] = 0;
    for (long e = 0; e < experts; e++) {
        const long n = cf[cfo + e];
        offs[e + 1] = offs[e] + n;
        tiles[e + 1] = tiles[e] + (n + tm - 1) / tm;
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

/*
 * This work-group's tile of the route (tile get_group_id(1), of tm slots): its expert *e, and
 * its slots staged in rows, -1 past the tile's count (the kernels tell real rows by s >= 0).
 * False past the last tile, before the barrier: the tile is uniform, so the whole work-group
 * leaves.
 */
inline int mf_tile_begin(__global const long *route, long experts, __local long *rows, int lid,
                         int tm, long *e)
{
    __global const long *offs = route, *tiles = route + experts + 1;
    __global const long *list = route + 2 * experts + 2;
    const long tile = (long)get_group_id(1);
    if (tile >= tiles[experts])
        return 0;
    *e = mf_find_expert(tiles, experts, tile);
    const long first = offs[*e] + (tile - tiles[*e]) * tm;
    const long left = offs[*e + 1] - first;
    const long n = left < tm ? left : tm;
    if (lid < tm)
        rows[lid] = lid < n ? list[first + lid] : -1;
    barrier(CLK_LOCAL_MEM_FENCE);
    return 1;
}

/*
 * The GEMM of one tile, for both kernels: acc[i][jj] = the fma chain over k = 0 .. depth - 1, in
 * order, of A[tile row ty + 16 i, k] * B[tile column tx + 16 jj, k]. Work-item lid stages
 * elements lid + 256 q (q < 4) of each MF_TK-deep slab: tile row / column (lid + 256 q) / MF_TK
 * of A (offset arow[q] of its k = 0) and of B (weight row brow[q]); -1 stages zeros (a row
 * past the tile, a column past the output).
 */
inline void mf_tile_gemm(__local float (*as)[MF_TM], __local float (*bs)[MF_TN],
                         __global const uchar *a, const long *arow, __global const uchar *w,
                         const long *brow, int dt, long depth, int tx, int ty, int lid,
                         float (*acc)[4])
{
    for (int i = 0; i < 4; i++)
        for (int jj = 0; jj < 4; jj++)
            acc[i][jj] = 0.0f;
    for (long k0 = 0; k0 < depth; k0 += MF_TK) {
        const int kn = depth - k0 < MF_TK ? (int)(depth - k0) : MF_TK;
        for (int q = 0; q < 4; q++) {
            const int idx = lid + 256 * q, r = idx / MF_TK, kk = idx % MF_TK;
            as[kk][r] = (arow[q] >= 0 && kk < kn) ? mf_load(a, dt, arow[q] + k0 + kk) : 0.0f;
            bs[kk][r] = (brow[q] >= 0 && kk < kn) ? mf_load(w, dt, brow[q] + k0 + kk) : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int kk = 0; kk < kn; kk++) { /* only real k: the chains match the CPU's */
            float av[4], bv[4];
            for (int i = 0; i < 4; i++)
                av[i] = as[kk][ty + 16 * i];
            for (int jj = 0; jj < 4; jj++)
                bv[jj] = bs[kk][tx + 16 * jj];
            for (int i = 0; i < 4; i++)
                for (int jj = 0; jj < 4; jj++)
                    acc[i][jj] = fma(av[i], bv[jj], acc[i][jj]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
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
    __local float bs[MF_TK][MF_TN];
    __local long rows[MF_TM];
    const int tx = (int)get_local_id(0), ty = (int)get_local_id(1), lid = ty * 16 + tx;
    long e;
    if (!mf_tile_begin(route, experts, rows, lid, MF_TM, &e))
        return;
    const long i0 = (long)get_group_id(0) * MF_TH;
    const long grow = mf_gate_at(order, idim), urow = mf_up_at(order, idim);
    const long step = mf_gate_step(order);
    long arow[4], brow[4];
    for (int q = 0; q < 4; q++) {
        const int c = (lid + 256 * q) / MF_TK; /* tile row; column 0..63: gate, then up */
        const long s = rows[c], col = i0 + (c % MF_TH);
        const long wrow = (c < MF_TH ? grow : urow) + col * step;
        arow[q] = s >= 0 ? xo + (s / topk) * xs0 : -1;
        brow[q] = col < idim ? wo + e * ws0 + wrow * ws1 : -1;
    }
    float acc[4][4]; /* columns jj < 2: gate, jj + 2: up of the same h column */
    mf_tile_gemm(as, bs, x, arow, w1, brow, xdt, kdim, tx, ty, lid, acc);
    for (int i = 0; i < 4; i++) {
        const long s = rows[ty + 16 * i];
        if (s < 0)
            continue; /* past the tile's slots */
        const long m = s / topk, j = s % topk;
        for (int jj = 0; jj < 2; jj++) {
            const long col = i0 + tx + 16 * jj;
            if (col >= idim)
                continue;
            mf_store(h, hdt, ho + m * hs0 + j * hs1 + col,
                     mf_gate_out(acc[i][jj], acc[i][jj + 2], b1, bdt, bo + e * bs0, has_b, grow,
                                 urow, step, col, mf_gate_fn_of(act, alpha, limit, beta)));
        }
    }
}

/*
 * Column col of slot s's y, from its f32 dot product (both tiled finals end here): plus
 * b2[e][col] (at bbase) if given; reduced, in f32 into ybuf[(s - s0) * K + col], which
 * mf_moe_reduce sums in j order; un-reduced, rounded into out[m, j, col].
 */
inline void mf_final_out(float y, long s, long col, long topk, long kdim,
                         __global const uchar *b2, int bdt, long bbase, int has_b, int reduce,
                         long s0, __global float *ybuf, long ybo, __global uchar *out, long oo,
                         long os0, long os1, int odt)
{
    if (has_b)
        y = y + mf_load(b2, bdt, bbase + col);
    if (reduce)
        ybuf[ybo + (s - s0) * kdim + col] = y;
    else
        mf_store(out, odt, oo + (s / topk) * os0 + (s % topk) * os1 + col, y);
}

/* y = h[m, j] @ w2[e]^T (+ b2[e]) for one tile, stored by mf_final_out. */
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
    long e;
    if (!mf_tile_begin(route, experts, rows, lid, MF_TM, &e))
        return;
    const long r0 = (long)get_group_id(0) * MF_TN;
    long arow[4], brow[4];
    for (int q = 0; q < 4; q++) {
        const int c = (lid + 256 * q) / MF_TK; /* tile row; column: the weight row r0 + c */
        const long s = rows[c], col = r0 + c;
        arow[q] = s >= 0 ? ho + (s / topk) * hs0 + (s % topk) * hs1 : -1;
        brow[q] = col < kdim ? wo + e * ws0 + col * ws1 : -1;
    }
    float acc[4][4];
    mf_tile_gemm(as, bs, hp, arow, w2, brow, hdt, idim, tx, ty, lid, acc);
    for (int i = 0; i < 4; i++) {
        const long s = rows[ty + 16 * i];
        if (s < 0)
            continue; /* past the tile's slots */
        for (int jj = 0; jj < 4; jj++) {
            const long col = r0 + tx + 16 * jj;
            if (col < kdim)
                mf_final_out(acc[i][jj], s, col, topk, kdim, b2, bdt, bo + e * bs0, has_b,
                             reduce, s0, ybuf, ybo, out, oo, os0, os1, odt);
        }
    }
}

/* out[m, col] = sum over valid j in order of topk_weights[m, j] * y, from 0; rows m0 + group. */
__kernel void mf_moe_reduce(__global const int *ids, long io, long is0,
                            __global const float *tw, long two, long tws0,
                            __global const int *map, long mo, long ms0, int has_map, long topk,
                            long experts, long global_experts, long kdim, long m0,
                            __global const float *ybuf, long ybo, __global uchar *out, long oo,
                            long os0, int odt)
{
    const long col = (long)get_global_id(0), m = m0 + (long)get_global_id(1);
    if (col >= kdim)
        return;
    float acc = 0.0f;
    for (long j = 0; j < topk; j++) {
        if (mf_slot_expert(ids, io, is0, m, j, map, mo, ms0, has_map, experts, global_experts) < 0)
            continue;
        const float prod =
            tw[two + m * tws0 + j] * ybuf[ybo + (m * topk + j - m0 * topk) * kdim + col];
        acc = acc + prod;
    }
    mf_store(out, odt, oo + m * os0 + col, acc);
}
