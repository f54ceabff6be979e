/*
 * The row kernels behind act_quant (2-D and masked 3-D), quant and act_mul,
 * and the tail and padding rows, from the pieces of rows.cl (whose comment
 * describes the walk over items).
 */

/*
 * Variants of the quantizing kernel. The body is one function; each kernel
 * calls it with a constant `spec`, so the compiler drops what that variant
 * cannot meet (registers on a GPU are counted for the whole kernel, rare
 * paths included):
 *   MF_SPEC_ANY   every option;
 *   MF_SPEC_SILU  silu, no clamp, factors or bf16 rounding;
 *   MF_SPEC_H     quant (no activation);
 *   MF_SPEC_TAB_LOCAL, MF_SPEC_TAB_GLOBAL  bf16 x, any activation, no clamp,
 *                 factors or bf16 rounding: act(g) from the activation's
 *                 table (mf_act_table.h), copied to local memory by every
 *                 work-group (GPUs) or read where it is (CPU devices);
 * all with vec_x, vec_q, lanes <= 32 and G <= 8 x lanes (ops_rows.c picks).
 * The input dtype stays a (uniform) branch but in the table kernels: it costs no registers.
 */
#define MF_SPEC_ANY 0
#define MF_SPEC_SILU 1
#define MF_SPEC_H 2
#define MF_SPEC_TAB_LOCAL 3
#define MF_SPEC_TAB_GLOBAL 4

/* Fills tables[act * MF_TAB_ENTRIES + j] for every activation (once per context). */
__kernel void mf_build_act_tables(__global float *tables)
{
    const uint n = MF_TAB_ACTS * MF_TAB_ENTRIES;
    for (uint i = (uint)get_global_id(0); i < n; i += (uint)get_global_size(0))
        tables[i] = mf_act_table_entry((int)(i / MF_TAB_ENTRIES), i % MF_TAB_ENTRIES);
}

/*
 * The look-ahead of the quantizing kernels with an activation: (pe, pt) := the expert and
 * token of item f of the walk (searched from *pe on), and pre := this lane's gate and up words
 * of it, when f is an item and the lane has channels in it; nothing otherwise.
 */
inline void mf_load_ahead(mf_walk f, long total, __global const uchar *x, long xo, long xs0,
                          long xs1, int xdt, __global const long *offs, __local const long *loffs,
                          int has_counts, int loffs_on, long experts, long per_item, int seg,
                          long groups, long group, long lane_c, long goff, long uoff, long *pe,
                          long *pt, mf_raw8 pre[2])
{
    if (f.i >= total)
        return;
    *pe = mf_row_expert(offs, loffs, has_counts, loffs_on, experts, *pe, f.i);
    *pt = mf_row_token(offs, loffs, has_counts, loffs_on, *pe, f.i);
    const long g = f.p * per_item + seg;
    if (g < groups && lane_c < group) {
        const long b = xo + *pe * xs0 + *pt * xs1 + g * group + lane_c;
        pre[0] = mf_load_raw8(x, xdt, b + goff);
        pre[1] = mf_load_raw8(x, xdt, b + uoff);
    }
}

/*
 * Quantize rows. Lanes form segments of `lanes` (a power of two dividing the
 * work-group, chosen by the host: G / 8 rounded up, at most the work-group),
 * one quantization group per segment and wg / lanes groups per item. A lane
 * holds channels [8 sl, 8 sl + 8) of its group in registers ("chunks" = 1);
 * a group wider than 8 x the work-group is a whole item, its lanes taking
 * every wg-th chunk, and h is computed again for the codes (chunks > 1).
 * vec_x / vec_q: 16-byte loads of x, 8-byte stores of codes (host-checked
 * alignment, G % 8 == 0).
 */
inline void mf_rows_quant_body(__global const uchar *x, long xo, long xs0, long xs1, int xdt,
                               __global const float *rs, long rso, long rss0, long rss1,
                               int has_rs, __global const uchar *es, long eso, long ess0,
                               int esdt, int has_es, __global const long *offs, int has_counts,
                               long experts, long rows, long hidden, long group, long groups,
                               int activate, int act, int order, float limit, float alpha,
                               float beta, int round_bf16,
                               __global uchar *q, long qo, long qs0, long qs1, int qdt,
                               __global uchar *sc, long sco, long scs0, long scs1, int scdt,
                               int layout, int ue8m0, float eps, int lanes, int vec_x, int vec_q,
                               __local uint *red, __local float *tab, __global const float *gtab,
                               __local float *ltab, __local long *loffs, const int spec)
{
    const int tabmode = spec == MF_SPEC_TAB_LOCAL ? 1 : spec == MF_SPEC_TAB_GLOBAL ? 2 : 0;
    if (spec != MF_SPEC_ANY) {
        activate = spec != MF_SPEC_H;
        act = tabmode ? act : MF_ACT_SILU;
        xdt = tabmode ? MF_BF16 : xdt;
        /* the host never sends these the interleaved order: the compiler drops its loads */
        order = order == MF_ORDER_UP_FIRST ? order : MF_ORDER_GATE_FIRST;
        limit = beta = 0.0f;
        round_bf16 = has_rs = has_es = 0;
        vec_x = vec_q = 1;
    }
    if (tabmode == 1) /* (both copies are published by mf_exp_table_to_local's barrier) */
        for (int i = (int)get_local_id(0); i < (int)(MF_TAB_ENTRIES / 4);
             i += (int)get_local_size(0))
            vstore4(vload4(i, gtab), i, ltab);
    /* the row offsets in local memory when they fit: every item searches them */
    const int loffs_on = has_counts && experts <= MF_LOCAL_EXPERTS;
    if (loffs_on)
        for (long j = get_local_id(0); j <= experts; j += get_local_size(0))
            loffs[j] = offs[j];
    mf_exp_table_to_local(tab);
    const int lane = (int)get_local_id(0), wg = (int)get_local_size(0);
    const int seg = lane / lanes, sl = lane % lanes, per_item = wg / lanes;
    const long chunks = spec != MF_SPEC_ANY ? 1
                        : (group + (long)MF_PER_LANE * lanes - 1) / ((long)MF_PER_LANE * lanes);
    const int fp8 = qdt == MF_F8;
    const long total = has_counts ? offs[experts] : rows;
    const long items_per_row = (groups + per_item - 1) / per_item;
    const long slots = layout == MF_PACKED ? (groups + 3) / 4 * 4 : groups;
    long e = 0;
    int part = 0; /* which half of red: mf_segment_max */
    /* The activation kernels but the general one (one chunk per lane, 16-byte loads): each
     * item's words are loaded an item ahead, into `pre`, so that they are in flight while the
     * item before waits at the barrier and stores its codes; (pe, pt) is that row's expert and
     * token. (On the H100 through NVIDIA's driver this took act_quant from 44-46% of copy to
     * 47-50%; quant, with half the words per item, lost 2 points to it and does without.) */
    const int ahead = spec != MF_SPEC_ANY && spec != MF_SPEC_H; /* (these always activate) */
    const long goff = mf_gate_at(order, hidden), uoff = mf_up_at(order, hidden);
    const long lane_c = (long)sl * MF_PER_LANE; /* the lane's channel in its group */
    mf_raw8 pre[2];
    pre[0].a = pre[0].b = pre[1].a = pre[1].b = (uint4)(0u);
    long pe = 0, pt = 0;
    mf_walk w = mf_walk_start(items_per_row);
    if (ahead)
        mf_load_ahead(w, total, x, xo, xs0, xs1, xdt, offs, loffs, has_counts, loffs_on, experts,
                      per_item, seg, groups, group, lane_c, goff, uoff, &pe, &pt, pre);
    for (; w.i < total; mf_walk_next(&w)) {
        const long i = w.i, g = w.p * per_item + seg;
        e = ahead ? pe : mf_row_expert(offs, loffs, has_counts, loffs_on, experts, e, i);
        const long t = ahead ? pt : mf_row_token(offs, loffs, has_counts, loffs_on, e, i);
        const mf_hrow r = mf_row_setup(x, xo, xs0, xs1, xdt, rs, rso, rss0, rss1, has_rs, es, eso,
                                       ess0, esdt, has_es, hidden, activate, act, order, limit,
                                       alpha, beta, round_bf16, vec_x, e, t);
        const long qrow = qo + e * qs0 + t * qs1;
        const int active = g < groups;
        float h[MF_PER_LANE];
        uint m = 0u;
        int nonfinite = 0; /* in this lane's values: they take the reference's path */
        if (active)
            for (long k = 0; k < chunks; k++) {
                const long c = (sl + k * lanes) * MF_PER_LANE; /* channel in the group */
                const int n = (int)clamp(group - c, 0L, (long)MF_PER_LANE);
                if (n > 0) {
                    mf_h8(&r, tab, g * group + c, n, h, ltab, gtab, tabmode, ahead ? pre : 0);
                    m = max(m, mf_amax_bits8(h, &nonfinite));
                }
            }
        if (ahead) { /* the next item's words, before this one's barrier */
            mf_walk f = w;
            mf_walk_next(&f);
            mf_load_ahead(f, total, x, xo, xs0, xs1, xdt, offs, loffs, has_counts, loffs_on,
                          experts, per_item, seg, groups, group, lane_c, goff, uoff, &pe, &pt,
                          pre);
        }
        m = mf_segment_max(red + part * wg, m, lane, spec != MF_SPEC_ANY ? 32 : lanes, lanes, seg);
        part ^= 1;
        if (!active)
            continue;
        float amax = as_float(m);
        amax = amax > eps ? amax : eps;
        float s = fp8 ? amax / 448.0f : amax / 127.0f;
        uint ue = 0u;
        if (ue8m0) {
            ue = mf_ue8m0_exponent(s);
            s = as_float(ue << 23);
        }
        const float y = 1.0f / s;
        const int plain = !nonfinite && mf_div_by_scale_ok(s);
        for (long k = 0; k < chunks; k++) {
            const long c = (sl + k * lanes) * MF_PER_LANE;
            const int n = (int)clamp(group - c, 0L, (long)MF_PER_LANE);
            if (n <= 0)
                continue;
            if (chunks > 1)
                mf_h8(&r, tab, g * group + c, n, h, ltab, gtab, tabmode, 0);
            mf_store_codes8(q, qrow + g * group + c, mf_codes8(h, s, y, plain, fp8), vec_q, n);
        }
        if (sl == 0) {
            mf_put_scale(sc, sco, scs0, scs1, scdt, layout, e, t, g, s, ue);
            if (g == groups - 1) /* unused bytes of the row's last packed word */
                for (long gg = groups; gg < slots; gg++)
                    mf_put_scale(sc, sco, scs0, scs1, scdt, layout, e, t, gg, 0.0f, 0u);
        }
    }
}

/* The kernels: the same arguments (atab + tab_base: the activation's table, read by the table
 * variants only), the body with each constant spec; local_entries: the local copy's size. */
#define MF_ROWS_QUANT_KERNEL(name, spec, local_entries) \
    __kernel void name(__global const uchar *x, long xo, long xs0, long xs1, int xdt, \
                       __global const float *rs, long rso, long rss0, long rss1, int has_rs, \
                       __global const uchar *es, long eso, long ess0, int esdt, int has_es, \
                       __global const long *offs, int has_counts, long experts, long rows, \
                       long hidden, long group, long groups, int activate, int act, int order, \
                       float limit, float alpha, float beta, int round_bf16, __global uchar *q, \
                       long qo, long qs0, \
                       long qs1, int qdt, __global uchar *sc, long sco, long scs0, long scs1, \
                       int scdt, int layout, int ue8m0, float eps, int lanes, int vec_x, \
                       int vec_q, __global const float *atab, int tab_base) \
    { \
        __local float tab[64]; \
        __local uint4 red[2 * MF_MAX_WG / 4]; \
        __local float4 ltab[local_entries / 4]; \
        __local long loffs[MF_LOCAL_EXPERTS + 1]; \
        mf_rows_quant_body(x, xo, xs0, xs1, xdt, rs, rso, rss0, rss1, has_rs, es, eso, ess0, \
                           esdt, has_es, offs, has_counts, experts, rows, hidden, group, groups, \
                           activate, act, order, limit, alpha, beta, round_bf16, q, qo, qs0, \
                           qs1, qdt, sc, \
                           sco, scs0, scs1, scdt, layout, ue8m0, eps, lanes, vec_x, vec_q, \
                           (__local uint *)red, tab, atab + tab_base, (__local float *)ltab, \
                           loffs, spec); \
    }

MF_ROWS_QUANT_KERNEL(mf_rows_quant, MF_SPEC_ANY, 4)
MF_ROWS_QUANT_KERNEL(mf_rows_quant_silu, MF_SPEC_SILU, 4)
MF_ROWS_QUANT_KERNEL(mf_rows_quant_h, MF_SPEC_H, 4)
MF_ROWS_QUANT_KERNEL(mf_rows_quant_tab_local, MF_SPEC_TAB_LOCAL, MF_TAB_ENTRIES)
MF_ROWS_QUANT_KERNEL(mf_rows_quant_tab_global, MF_SPEC_TAB_GLOBAL, 4)

/* ----------------------------------------------------------------- act_mul */

/* Store the first n of 8 values at out[i] rounded to dt: 16-byte stores when vec. */
inline void mf_store_chunk(__global uchar *out, int dt, long i, const float v[8], int vec, int n)
{
    if (vec && dt == MF_F32) {
        *(__global float4 *)(out + 4 * i) = (float4)(v[0], v[1], v[2], v[3]);
        *(__global float4 *)(out + 4 * i + 16) = (float4)(v[4], v[5], v[6], v[7]);
    } else if (vec) {
        uint w[4];
        for (int k = 0; k < 4; k++) {
            const uint lo = dt == MF_BF16 ? mf_f32_to_bf16(v[2 * k]) : mf_f32_to_f16(v[2 * k]);
            const uint hi = dt == MF_BF16 ? mf_f32_to_bf16(v[2 * k + 1])
                                          : mf_f32_to_f16(v[2 * k + 1]);
            w[k] = lo | (hi << 16);
        }
        *(__global uint4 *)(out + 2 * i) = (uint4)(w[0], w[1], w[2], w[3]);
    } else {
        for (int k = 0; k < n; k++)
            mf_store(out, dt, i + k, v[k]);
    }
}

/* act_mul: h rounded once to out's dtype. Items of 8 x wg channels, 8 per lane. */
__kernel void mf_rows_act_mul(__global const uchar *x, long xo, long xs0, long xs1, int xdt,
                              __global const float *rs, long rso, long rss0, long rss1, int has_rs,
                              long rows, long hidden, int act, int order, float limit,
                              float alpha, float beta, int round_bf16, __global uchar *out,
                              long oo, long os0, long os1,
                              int odt, int vec_x, int vec_out)
{
    __local float tab[64];
    mf_exp_table_to_local(tab);
    const long lane = (long)get_local_id(0), wg = (long)get_local_size(0);
    const long width = MF_PER_LANE * wg;
    const long items_per_row = (hidden + width - 1) / width;
    for (mf_walk w = mf_walk_start(items_per_row); w.i < rows; mf_walk_next(&w)) {
        const long t = w.i;
        const long c = w.p * width + lane * MF_PER_LANE;
        const int n = (int)clamp(hidden - c, 0L, (long)MF_PER_LANE);
        if (n <= 0)
            continue;
        const mf_hrow r = mf_row_setup(x, xo, xs0, xs1, xdt, rs, rso, rss0, rss1, has_rs, 0, 0, 0,
                                       MF_F32, 0, hidden, 1, act, order, limit, alpha, beta,
                                       round_bf16, vec_x, 0, t);
        float h[MF_PER_LANE];
        mf_h8(&r, tab, c, n, h, 0, 0, 0, 0);
        mf_store_chunk(out, odt, oo + t * os1 + c, h, vec_out, n);
    }
    (void)os0;
}

/*
 * Rows [t_begin, t_end) of every expert that are not computed: with zero_tail
 * the rows t >= n[e] (q and scales), and the padding rows T..Ta-1 of the
 * column-major and packed layouts (scales only). A work-group per row, its
 * lanes zeroing 8 bytes of codes each (vec_q: 8-byte aligned rows, H % 8 == 0)
 * or one, rows walked grid-stride.
 */
__kernel void mf_rows_tail(__global const long *offs, int has_counts, int zero_tail, long experts,
                           long rows, long t_begin, long t_end, long hidden, long groups,
                           __global uchar *q, long qo, long qs0, long qs1,
                           __global uchar *sc, long sco, long scs0, long scs1, int scdt, int layout,
                           int vec_q)
{
    const long span = t_end - t_begin;
    const long lane = (long)get_local_id(0), wg = (long)get_local_size(0);
    const long slots = layout == MF_PACKED ? (groups + 3) / 4 * 4 : groups;
    for (mf_walk w = mf_walk_start(span); w.i < experts; mf_walk_next(&w)) {
        const long e = w.i, t = t_begin + w.p;
        if (t < rows) {
            const long n = has_counts ? offs[e + 1] - offs[e] : rows;
            if (!zero_tail || t < n)
                continue;
            const long qrow = qo + e * qs0 + t * qs1;
            if (vec_q)
                for (long c = lane * 8; c < hidden; c += wg * 8)
                    *(__global uint2 *)(q + qrow + c) = (uint2)(0u, 0u);
            else
                for (long c = lane; c < hidden; c += wg)
                    q[qrow + c] = 0;
        }
        for (long g = lane; g < slots; g += wg)
            mf_put_scale(sc, sco, scs0, scs1, scdt, layout, e, t, g, 0.0f, 0u);
    }
}
