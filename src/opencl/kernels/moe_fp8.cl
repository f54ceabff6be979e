/*
 * FP8 MoE (docs/NUMERICS.md "FP8 MoE"): moe_gate_fp8 and moe_final_fp8, routed or masked.
 * A block's 128 products are summed exactly as 64-bit integer counts of 2^-18 (each e4m3 code
 * is an integer count of 2^-9), so no order and no fp64 is needed to match the CPU's exact
 * sums; the count is rounded once to f32 (convert_float_rte), then
 * acc = fma(p_b, sa * sw, acc) in block order. A block with a NaN code sums to NaN.
 * With `specials`, the kernels write only the rows no tile of moe_fp8_tiled.cl holds (invalid
 * slots, scale padding); without, every row, one work-group a row.
 */

/* Code b as a signed count of 2^-9: subnormal m, normal (8 + m) << (e - 1); NaN codes 0. */
inline long mf_fp8_count(uint b)
{
    const uint e = (b >> 3) & 15u, m = b & 7u;
    long v = e == 0u ? (long)m : (long)((8u | m) << (e - 1u));
    v = (b & 0x7Fu) == 0x7Fu ? 0 : v;
    return (b & 0x80u) ? -v : v;
}

inline int mf_fp8_is_nan(uint b) { return (b & 0x7Fu) == 0x7Fu; }

/* The block sum from its exact count, or NaN. */
inline float mf_fp8_block_sum(long count, int nan)
{
    return nan ? as_float(0x7FC00000u) : convert_float_rte(count) * 0x1p-18f;
}

/* fma(p, s, acc) with the CPU's NaN bits (the first NaN of p, s, acc, quieted). */
inline float mf_fp8_fma(float p, float s, float acc)
{
    const float r = fma(p, s, acc);
    if (!mf_is_nan(r))
        return r;
    if (mf_is_nan(p))
        return mf_quiet(p);
    return mf_nan_of(r, s, acc);
}

/*
 * Scale views. Activations (act layouts, NUMERICS.md "Scale layouts"): layout 0 row-major,
 * 1 column-major, 2 packed; kind 0 f32, 1 u8 exponents, 2 packed words (bytes). off, s0, s1
 * in elements of the tensor (words for packed). Index of (expert block, row t, group g).
 */
inline long mf_fp8_sc_index(long off, long s0, long s1, int layout, long blk, long t, long g)
{
    if (layout == 2)
        return (off + blk * s0 + (g >> 2) * s1 + t) * 4 + (g & 3);
    if (layout == 1)
        return off + blk * s0 + g * s1 + t;
    return off + blk * s0 + t * s1 + g;
}

inline float mf_fp8_sc_read(__global const uchar *p, int kind, long i)
{
    return kind == 0 ? ((__global const float *)p)[i] : mf_ue8m0_read(p[i]);
}

/* Weight block scale (e, row block rb, depth block db): f32 or u8. */
inline float mf_fp8_wsc(__global const uchar *p, long off, long s0, long s1, int u8, long e,
                        long rb, long db)
{
    const long i = off + e * s0 + rb * s1 + db;
    return u8 ? mf_ue8m0_read(p[i]) : ((__global const float *)p)[i];
}

/* Store the scale of (blk, t, g) of gn groups; the unused bytes of a packed row's last word
 * go with its last group. */
inline void mf_fp8_sc_store(__global uchar *p, long off, long s0, long s1, int layout, int kind,
                            long blk, long t, long g, long gn, float s, uint ue)
{
    const long i = mf_fp8_sc_index(off, s0, s1, layout, blk, t, g);
    if (kind == 0) {
        ((__global float *)p)[i] = s;
        return;
    }
    p[i] = (uchar)ue;
    if (kind == 2 && g == gn - 1)
        for (long b = (g & 3) + 1; b < 4; b++)
            p[i - (g & 3) + b] = 0;
}

/* The code of h with scale s: NaN keeps its sign, else h / s (one division) converted. */
inline uchar mf_fp8_code(float h, float s)
{
    if (mf_is_nan(h))
        return (uchar)(((as_uint(h) >> 24) & 0x80u) | 0x7Fu);
    return (uchar)mf_f32_to_e4m3(h / s);
}

/*
 * The activation row of this work-group: where its codes start and which scale row it reads.
 * Routed row r = slot s = m * k + j: x row m (gate), h row (m, j) (final), scale rows m or s.
 * Masked row r = e * tpad + t. Returns the local expert, -1 for an invalid slot, -2 for a row
 * that is not computed (masked t >= n[e], or padding).
 */
inline long mf_fp8_row(long r, int masked, long tpad, long tmax, __global const int *counts,
                       long co, long cs0, __global const int *ids, long io, long is0,
                       __global const int *map, long mo, long ms0, int has_map, long topk,
                       long experts, long global_experts, long *p, long *q)
{
    if (masked) {
        const long e = r / tpad, t = r % tpad;
        *p = e, *q = t;
        if (t >= tmax)
            return -2;
        long n = counts[co + e * cs0];
        n = n < 0 ? 0 : (n > tmax ? tmax : n);
        return t < n ? e : -2;
    }
    *p = r / topk, *q = r % topk;
    return mf_slot_expert(ids, io, is0, *p, *q, map, mo, ms0, has_map, experts, global_experts);
}

/* Stage one 128-deep block of an activation row as counts; returns whether it holds a NaN. */
inline int mf_fp8_stage(__local long *cnt, __local int *nan, __global const uchar *row,
                        long kb)
{
    const int c = (int)get_local_id(0), n = (int)get_local_size(0);
    if (c == 0)
        *nan = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = c; k < 128; k += n) {
        const uint b = row[kb * 128 + k];
        cnt[k] = mf_fp8_count(b);
        if (mf_fp8_is_nan(b))
            *nan = 1;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    return *nan;
}

/* The exact block sum of the staged activation block with weight row w (128 codes). */
inline float mf_fp8_dot_block(__local const long *cnt, int nan_a, __global const uchar *w)
{
    long sum = 0;
    int nan = nan_a;
    for (int k = 0; k < 128; k++) {
        const uint b = w[k];
        nan |= mf_fp8_is_nan(b);
        sum += cnt[k] * mf_fp8_count(b);
    }
    return mf_fp8_block_sum(sum, nan);
}

/*
 * The argument lists of the FP8 gate and final, here and in moe_fp8_tiled.cl (whose kernels
 * take the route after them): ops_moe_fp8.c fills them with the same calls for both.
 */
#define MF_FP8_GATE_PARAMS                                                                     \
    __global const uchar *x, long xo, long xs0, long xs1, __global const uchar *xsc, long xso,  \
        long xss0, long xss1, int xs_layout, int xs_kind, __global const uchar *w, long wo,     \
        long ws0, long ws1, __global const uchar *wsc, long wso, long wss0, long wss1,          \
        int wsc_u8, __global const uchar *b1, long bo, long bs0, int bdt, int has_b,            \
        __global const int *ids, long io, long is0, __global const int *map, long mo,           \
        long ms0, int has_map, long topk, long experts, long global_experts,                    \
        __global const int *counts, long co, long cs0, int masked, long tmax, long tpad,        \
        long rows, long kdim, long idim, int order, int act, float alpha, float limit,          \
        float beta, __global uchar *h, long ho, long hs0, long hs1, __global uchar *hsc,        \
        long hso, long hss0, long hss1, int hs_layout, int hs_kind, int ue8m0, float eps,       \
        int specials
#define MF_FP8_FINAL_PARAMS                                                                    \
    __global const uchar *hp, long ho, long hs0, long hs1, __global const uchar *hsc, long hso, \
        long hss0, long hss1, int hs_layout, int hs_kind, __global const uchar *w, long wo,     \
        long ws0, long ws1, __global const uchar *wsc, long wso, long wss0, long wss1,          \
        int wsc_u8, __global const uchar *b2, long bo, long bs0, int bdt, int has_b,            \
        __global const int *ids, long io, long is0, __global const int *map, long mo,           \
        long ms0, int has_map, long topk, long experts, long global_experts,                    \
        __global const int *counts, long co, long cs0, int masked, long tmax, long kdim,        \
        long idim, int reduce, __global float *ybuf, long ybo, __global uchar *out, long oo,    \
        long os0, long os1, int odt, int specials

/*
 * Gate: global (128 * I / 128, rows), local (128, 1). Work-group (g, r): the 128 h columns of
 * group g of row r; work-item c the column g * 128 + c, from its gate and up weight rows.
 */
__kernel __attribute__((reqd_work_group_size(128, 1, 1)))
void mf_moe_fp8_gate(MF_FP8_GATE_PARAMS)
{
    __local long cnt[128];
    __local int nan_a;
    __local float red[128];
    const long g = (long)get_group_id(0), r = (long)get_group_id(1);
    const int c = (int)get_local_id(0);
    const long gn = idim / 128, col = g * 128 + c;
    long p, q;
    /* routed rows past the slots are scale padding (masked padding: mf_fp8_row's t >= tmax) */
    const long e = masked || r < rows
                       ? mf_fp8_row(r, masked, tpad, tmax, counts, co, cs0, ids, io, is0, map, mo,
                                    ms0, has_map, topk, experts, global_experts, &p, &q)
                       : -3;
    /* scale rows: routed slot r (block 0), masked (e, t) */
    const long blk = masked ? r / tpad : 0, t = masked ? r % tpad : r;
    if ((e == -2 && !(masked && t >= tmax)) || (specials && e >= 0))
        return; /* a masked row past n[e]: left as it was; a tile's row (moe_fp8_tiled.cl) */
    if (e < 0) {
        /* an invalid slot: codes 0 and scale bytes 0; a padding row: its scale bytes 0 */
        if (e == -1)
            h[ho + p * hs0 + q * hs1 + col] = 0;
        if (c == 0)
            mf_fp8_sc_store(hsc, hso, hss0, hss1, hs_layout, hs_kind, blk, t, g, gn, 0.0f, 0u);
        return;
    }
    /* x's codes: routed token m (q unused), masked (e, t); its scales the same rows */
    const long xblk = masked ? p : 0, xt = masked ? q : p;
    __global const uchar *xrow = x + xo + (masked ? p * xs0 + q * xs1 : p * xs0);
    /* w1 / b1 rows of h column col; the weight scales of row r are block r / 128 */
    const long gate_row = mf_gate_at(order, idim), up_row = mf_up_at(order, idim);
    const long step = mf_gate_step(order);
    const long grow = gate_row + col * step, urow = up_row + col * step;
    __global const uchar *wg = w + wo + e * ws0 + grow * ws1;
    __global const uchar *wu = w + wo + e * ws0 + urow * ws1;
    float ag = 0.0f, au = 0.0f;
    for (long kb = 0; kb < kdim / 128; kb++) {
        const int na = mf_fp8_stage(cnt, &nan_a, xrow, kb);
        const float sa = mf_fp8_sc_read(
            xsc, xs_kind, mf_fp8_sc_index(xso, xss0, xss1, xs_layout, xblk, xt, kb));
        const float pg = mf_fp8_dot_block(cnt, na, wg + kb * 128);
        const float pu = mf_fp8_dot_block(cnt, na, wu + kb * 128);
        const float sg = mf_mul(sa, mf_fp8_wsc(wsc, wso, wss0, wss1, wsc_u8, e, grow / 128, kb));
        const float su = mf_mul(sa, mf_fp8_wsc(wsc, wso, wss0, wss1, wsc_u8, e, urow / 128, kb));
        ag = mf_fp8_fma(pg, sg, ag);
        au = mf_fp8_fma(pu, su, au);
    }
    const float hv = mf_gate_out(ag, au, b1, bdt, bo + e * bs0, has_b, gate_row, up_row, step,
                                 col, mf_gate_fn_of(act, alpha, limit, beta));
    red[c] = mf_is_finite(hv) ? fabs(hv) : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int n = 64; n > 0; n >>= 1) { /* max: exact, so any order */
        if (c < n)
            red[c] = fmax(red[c], red[c + n]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float amax = red[0] > eps ? red[0] : eps;
    float s = amax / 448.0f;
    uint ue = 0u;
    if (ue8m0) {
        ue = mf_ue8m0_exponent(s);
        s = as_float(ue << 23);
    }
    h[ho + p * hs0 + q * hs1 + col] = mf_fp8_code(hv, s);
    if (c == 0)
        mf_fp8_sc_store(hsc, hso, hss0, hss1, hs_layout, hs_kind, blk, t, g, gn, s, ue);
}

/*
 * Final: global (round_up(K, 64), rows), local (64, 1). Work-group r: one h row (slot or
 * masked row); work-item c its output columns c, c + 64, ... Routed: y rounded into out
 * (un-reduced; an invalid slot's row 0) or y in f32 into ybuf (reduced: mf_moe_reduce sums
 * it); masked: out[e, t].
 */
__kernel __attribute__((reqd_work_group_size(64, 1, 1)))
void mf_moe_fp8_final(MF_FP8_FINAL_PARAMS)
{
    __local long cnt[128];
    __local int nan_a;
    const long r = (long)get_group_id(1);
    const long col = (long)get_global_id(0);
    long p, q;
    const long e = mf_fp8_row(r, masked, tmax, tmax, counts, co, cs0, ids, io, is0, map, mo,
                              ms0, has_map, topk, experts, global_experts, &p, &q);
    if (e == -2 || (specials && e >= 0))
        return; /* a masked row past n[e]; a tile's row (moe_fp8_tiled.cl) */
    if (e < 0) {
        if (!reduce && col < kdim)
            mf_store(out, odt, oo + p * os0 + q * os1 + col, 0.0f);
        return;
    }
    const long blk = masked ? p : 0, t = masked ? q : r;
    __global const uchar *hrow = hp + ho + p * hs0 + q * hs1;
    __global const uchar *wr = w + wo + e * ws0 + col * ws1;
    float acc = 0.0f;
    for (long kb = 0; kb < idim / 128; kb++) {
        const int na = mf_fp8_stage(cnt, &nan_a, hrow, kb);
        if (col >= kdim)
            continue; /* past K: the work-group's barriers still need this item */
        const float sa = mf_fp8_sc_read(
            hsc, hs_kind, mf_fp8_sc_index(hso, hss0, hss1, hs_layout, blk, t, kb));
        const float pb = mf_fp8_dot_block(cnt, na, wr + kb * 128);
        acc = mf_fp8_fma(pb, mf_mul(sa, mf_fp8_wsc(wsc, wso, wss0, wss1, wsc_u8, e, col / 128,
                                                   kb)),
                         acc);
    }
    if (col >= kdim)
        return;
    if (has_b)
        acc = acc + mf_load(b2, bdt, bo + e * bs0 + col);
    if (reduce)
        ybuf[ybo + r * kdim + col] = acc;
    else
        mf_store(out, odt, oo + p * os0 + q * os1 + col, acc);
}
