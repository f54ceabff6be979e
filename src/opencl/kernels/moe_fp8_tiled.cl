/*
 * FP8 MoE over tiles of rows of one expert (moe_fp8.cl's arithmetic, the same bits): a
 * work-group takes up to MF_FP8_TM rows (routed: slots of one expert from the route,
 * moe_tiled.cl; masked: rows of one expert), and each work-item reads its weight block once
 * for all of them, where moe_fp8.cl's kernels read it once per row. Each row's block sum is
 * still the exact integer count, rounded once; acc = fma(p_b, sa * sw, acc) in block order.
 * Rows no tile holds (invalid slots, scale padding) are moe_fp8.cl's kernels' (their
 * `specials` argument).
 */
#define MF_FP8_TM 16 /* rows of a tile: 16 KB of staged counts, 16 sums a weight row */

/* A tile's rows as the kernels read them, in local memory (row i < n): MF_FP8_ROWS longs
 * [p | q | arow | sblk | st] of MF_FP8_TM each, then the local expert; p, q: routed token m
 * and slot j, masked expert e and row t; arow: element offset of the activation row's codes;
 * sblk, st: its scale row (expert block, row). Beside them sa (the row's scale of the staged
 * block) and nan (the staged block holds a NaN code). */
#define MF_FP8_ROWS (5 * MF_FP8_TM + 1)
#define MF_R_P 0
#define MF_R_Q MF_FP8_TM
#define MF_R_AROW (2 * MF_FP8_TM)
#define MF_R_SBLK (3 * MF_FP8_TM)
#define MF_R_ST (4 * MF_FP8_TM)
#define MF_R_E (5 * MF_FP8_TM)

/*
 * This work-group's tile, get_group_id(1): routed, the route's tile of MF_FP8_TM slots
 * (route: offs | tiles | list, moe_tiled.cl); masked, expert ti % E with rows from
 * (ti / E) * MF_FP8_TM below n[e] (chunk-major: the first chunks of all experts side by side).
 * Fills r's rows and expert (ao, as0, as1: the activation's offset and strides; gate: x,
 * else h); returns the rows, 0 for none (the same in every work-item).
 */
inline int mf_fp8_tile(__global const long *route, int masked, long experts, long topk,
                       long tmax, __global const int *counts, long co, long cs0, int gate,
                       long ao, long as0, long as1, __local long *r, int lid)
{
    const long ti = (long)get_group_id(1);
    long e, n;
    if (masked) {
        e = ti % experts;
        const long t0 = (ti / experts) * MF_FP8_TM;
        long c = counts[co + e * cs0];
        c = c < 0 ? 0 : (c > tmax ? tmax : c); /* device data: clamped */
        n = c - t0 <= 0 ? 0 : (c - t0 < MF_FP8_TM ? c - t0 : MF_FP8_TM);
        if (lid < n) {
            r[MF_R_P + lid] = e;
            r[MF_R_Q + lid] = t0 + lid;
        }
    } else {
        __global const long *offs = route, *tiles = route + experts + 1;
        __global const long *list = route + 2 * experts + 2;
        /* past the last tile: no rows, and no return before the barrier (PoCL 3.1 built a
         * return there into a kernel that read the rows' local memory unwritten) */
        e = ti < tiles[experts] ? mf_find_expert(tiles, experts, ti) : 0;
        const long first = offs[e] + (ti - tiles[e]) * MF_FP8_TM, left = offs[e + 1] - first;
        n = ti >= tiles[experts] ? 0 : (left < MF_FP8_TM ? left : MF_FP8_TM);
        if (lid < n) {
            const long s = list[first + lid];
            r[MF_R_P + lid] = s / topk;
            r[MF_R_Q + lid] = s % topk;
        }
    }
    if (lid < n) {
        /* the activation row: x (gate) routed token m, masked (e, t), its scale rows the
         * same; h (final) row (m, j) or (e, t), its scale rows slot s or (e, t) */
        const long p = r[MF_R_P + lid], q = r[MF_R_Q + lid];
        r[MF_R_AROW + lid] = ao + p * as0 + (masked || !gate ? q * as1 : 0);
        r[MF_R_SBLK + lid] = masked ? p : 0;
        r[MF_R_ST + lid] = masked ? q : (gate ? p : p * topk + q);
    }
    if (lid == 0)
        r[MF_R_E] = e;
    barrier(CLK_LOCAL_MEM_FENCE);
    return (int)n;
}

/* Stage block kb of the rows' codes as counts (rows past n: zeros), with each row's NaN flag
 * and its scale of the block (act layouts, moe_fp8.cl). */
inline void mf_fp8_stage_rows(__local long (*cnt)[128], __local const long *r,
                              __local float *sa, __local int *nan_a, int n,
                              __global const uchar *a, __global const uchar *asc, long aso,
                              long ass0, long ass1, int as_layout, int as_kind, long kb)
{
    const int c = (int)get_local_id(0), items = (int)get_local_size(0);
    barrier(CLK_LOCAL_MEM_FENCE); /* the block before is read */
    if (c < MF_FP8_TM)
        nan_a[c] = 0;
    if (c < n)
        sa[c] = mf_fp8_sc_read(asc, as_kind,
                               mf_fp8_sc_index(aso, ass0, ass1, as_layout, r[MF_R_SBLK + c],
                                               r[MF_R_ST + c], kb));
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int idx = c; idx < MF_FP8_TM * 128; idx += items) {
        const int i = idx >> 7, k = idx & 127;
        long v = 0;
        if (i < n) {
            const uint b = a[r[MF_R_AROW + i] + kb * 128 + k];
            v = mf_fp8_count(b);
            if (mf_fp8_is_nan(b))
                nan_a[i] = 1;
        }
        cnt[i][k] = v;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* The k loop of mf_fp8_dot_rows over its first NR rows (a constant: the sums stay in
 * registers, and a tile of few rows does no work for the others). */
#define MF_FP8_DOT_LOOP(NR)                                                                      \
    for (int k = 0; k < 128; k++) {                                                              \
        const uint b = w[k];                                                                     \
        nan |= mf_fp8_is_nan(b);                                                                 \
        const long wc = mf_fp8_count(b);                                                         \
        for (int i = 0; i < (NR); i++)                                                           \
            sums[i] += cnt[i][k] * wc;                                                           \
    }

/* sums[i] = the exact count of staged row i < n with weight block w (128 codes), 0 past n;
 * *nan_w whether w holds a NaN code. */
inline void mf_fp8_dot_rows(__local long (*cnt)[128], __global const uchar *w, int n,
                            long *sums, int *nan_w)
{
    for (int i = 0; i < MF_FP8_TM; i++)
        sums[i] = 0;
    int nan = 0;
    switch ((n + 3) / 4) { /* the same in every work-item */
    case 1: MF_FP8_DOT_LOOP(4) break;
    case 2: MF_FP8_DOT_LOOP(8) break;
    case 3: MF_FP8_DOT_LOOP(12) break;
    default: MF_FP8_DOT_LOOP(MF_FP8_TM) break;
    }
    *nan_w = nan;
}

/*
 * Gate: global (I, tiles), local (128, 1): the 128 h columns of group g of a tile's rows;
 * work-item c column g * 128 + c of each, from its gate and up weight rows. moe_fp8.cl's
 * gate arguments, then the route (routed calls).
 */
__kernel __attribute__((reqd_work_group_size(128, 1, 1)))
void mf_moe_fp8_gate_tiled(MF_FP8_GATE_PARAMS, __global const long *route)
{
    __local long cnt[MF_FP8_TM][128];
    __local float red[MF_FP8_TM][128];
    __local long r[MF_FP8_ROWS];
    __local float sa[MF_FP8_TM];
    __local int nan_a[MF_FP8_TM];
    const int c = (int)get_local_id(0);
    const int n =
        mf_fp8_tile(route, masked, experts, topk, tmax, counts, co, cs0, 1, xo, xs0, xs1, r, c);
    if (n == 0)
        return;
    const long e = r[MF_R_E], g = (long)get_group_id(0), gn = idim / 128, col = g * 128 + c;
    const long gate_row = mf_gate_at(order, idim), up_row = mf_up_at(order, idim);
    const long step = mf_gate_step(order);
    const long grow = gate_row + col * step, urow = up_row + col * step;
    __global const uchar *wg = w + wo + e * ws0 + grow * ws1;
    __global const uchar *wu = w + wo + e * ws0 + urow * ws1;
    float ag[MF_FP8_TM], au[MF_FP8_TM];
    for (int i = 0; i < MF_FP8_TM; i++)
        ag[i] = au[i] = 0.0f;
    for (long kb = 0; kb < kdim / 128; kb++) {
        mf_fp8_stage_rows(cnt, r, sa, nan_a, n, x, xsc, xso, xss0, xss1, xs_layout, xs_kind, kb);
        long sg[MF_FP8_TM], su[MF_FP8_TM];
        int ng, nu;
        mf_fp8_dot_rows(cnt, wg + kb * 128, n, sg, &ng);
        mf_fp8_dot_rows(cnt, wu + kb * 128, n, su, &nu);
        const float swg = mf_fp8_wsc(wsc, wso, wss0, wss1, wsc_u8, e, grow / 128, kb);
        const float swu = mf_fp8_wsc(wsc, wso, wss0, wss1, wsc_u8, e, urow / 128, kb);
        for (int i = 0; i < MF_FP8_TM; i++)
            if (i < n) {
                const float pg = mf_fp8_block_sum(sg[i], ng | nan_a[i]);
                const float pu = mf_fp8_block_sum(su[i], nu | nan_a[i]);
                ag[i] = mf_fp8_fma(pg, mf_mul(sa[i], swg), ag[i]);
                au[i] = mf_fp8_fma(pu, mf_mul(sa[i], swu), au[i]);
            }
    }
    float hv[MF_FP8_TM];
    const mf_gate_fn fn = mf_gate_fn_of(act, alpha, limit, beta);
    for (int i = 0; i < MF_FP8_TM; i++) {
        hv[i] = i < n ? mf_gate_out(ag[i], au[i], b1, bdt, bo + e * bs0, has_b, gate_row, up_row,
                                    step, col, fn)
                      : 0.0f;
        red[i][c] = mf_is_finite(hv[i]) ? fabs(hv[i]) : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int m = 64; m > 0; m >>= 1) { /* max: exact, so any order */
        if (c < m)
            for (int i = 0; i < MF_FP8_TM; i++)
                red[i][c] = fmax(red[i][c], red[i][c + m]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int i = 0; i < MF_FP8_TM; i++) {
        if (i >= n)
            break;
        const float amax = red[i][0] > eps ? red[i][0] : eps;
        float s = amax / 448.0f;
        uint ue = 0u;
        if (ue8m0) {
            ue = mf_ue8m0_exponent(s);
            s = as_float(ue << 23);
        }
        const long p = r[MF_R_P + i], q = r[MF_R_Q + i];
        h[ho + p * hs0 + q * hs1 + col] = mf_fp8_code(hv[i], s);
        if (c == i) /* h's scale rows: routed slot s (block 0), masked (e, t) */
            mf_fp8_sc_store(hsc, hso, hss0, hss1, hs_layout, hs_kind, masked ? p : 0,
                            masked ? q : p * topk + q, g, gn, s, ue);
    }
}

/*
 * Final: global (round_up(K, 64), tiles), local (64, 1): a tile's rows, work-item c their
 * output column; y rounded into out (un-reduced; routed, or masked out[e, t]) or in f32 into
 * ybuf at the slot's row (reduced: mf_moe_reduce sums it). moe_fp8.cl's final arguments, then
 * the route.
 */
__kernel __attribute__((reqd_work_group_size(64, 1, 1)))
void mf_moe_fp8_final_tiled(MF_FP8_FINAL_PARAMS, __global const long *route)
{
    __local long cnt[MF_FP8_TM][128];
    __local long r[MF_FP8_ROWS];
    __local float sa[MF_FP8_TM];
    __local int nan_a[MF_FP8_TM];
    const int c = (int)get_local_id(0);
    const int n =
        mf_fp8_tile(route, masked, experts, topk, tmax, counts, co, cs0, 0, ho, hs0, hs1, r, c);
    if (n == 0)
        return;
    const long e = r[MF_R_E], col = (long)get_global_id(0);
    __global const uchar *wr = w + wo + e * ws0 + col * ws1;
    float acc[MF_FP8_TM];
    for (int i = 0; i < MF_FP8_TM; i++)
        acc[i] = 0.0f;
    for (long kb = 0; kb < idim / 128; kb++) {
        mf_fp8_stage_rows(cnt, r, sa, nan_a, n, hp, hsc, hso, hss0, hss1, hs_layout, hs_kind, kb);
        if (col >= kdim)
            continue; /* past K: the work-group's barriers still need this item */
        long sums[MF_FP8_TM];
        int nw;
        mf_fp8_dot_rows(cnt, wr + kb * 128, n, sums, &nw);
        const float sw = mf_fp8_wsc(wsc, wso, wss0, wss1, wsc_u8, e, col / 128, kb);
        for (int i = 0; i < MF_FP8_TM; i++)
            if (i < n)
                acc[i] = mf_fp8_fma(mf_fp8_block_sum(sums[i], nw | nan_a[i]),
                                    mf_mul(sa[i], sw), acc[i]);
    }
    if (col >= kdim)
        return;
    const float bias = has_b ? mf_load(b2, bdt, bo + e * bs0 + col) : 0.0f;
    for (int i = 0; i < n; i++) {
        const float v = has_b ? acc[i] + bias : acc[i];
        if (reduce)
            ybuf[ybo + (r[MF_R_P + i] * topk + r[MF_R_Q + i]) * kdim + col] = v;
        else
            mf_store(out, odt, oo + r[MF_R_P + i] * os0 + r[MF_R_Q + i] * os1 + col, v);
    }
}
