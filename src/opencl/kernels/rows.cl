/*
 * Row kernels behind act_quant (2-D and masked 3-D), quant and act_mul.
 *
 * Valid rows are flattened: offs[E+1] (mf_count_prefix, on the device) holds
 * the prefix sum of the clamped counts, and a fixed grid of work-groups walks
 * rows i = group, group + groups, ... < offs[E], finding (e, t) by binary
 * search. Work therefore follows sum(n), not E * Tmax, and the host never
 * reads the counts. Without counts (2-D calls, E = 1) row i is t = i.
 *
 * Tensors arrive as a buffer plus offsets and strides in elements (long).
 */

/* Everything needed to compute h of one channel; built once per row. */
typedef struct mf_hrow {
    __global const uchar *x;
    long base;   /* element index of x[e, t, 0] */
    long goff;   /* channel offset of the gate half */
    long uoff;   /* channel offset of the up half */
    int xdt, act, activate, round_bf16, has_rs, has_es;
    float limit, rs, es;
} mf_hrow;

inline float mf_h(const mf_hrow *r, long c)
{
    if (!r->activate)
        return mf_load(r->x, r->xdt, r->base + c);
    float g = mf_load(r->x, r->xdt, r->base + r->goff + c);
    float u = mf_load(r->x, r->xdt, r->base + r->uoff + c);
    if (r->limit > 0.0f) {
        g = mf_clamp_gate(g, r->limit);
        u = mf_clamp_up(u, r->limit);
    }
    float a = mf_activate_f32(r->act, g);
    if (r->round_bf16)
        a = mf_round_bf16(a);
    float h = mf_mul(a, u); /* x86 NaN bits (numerics.cl) */
    if (r->has_rs)
        h = mf_mul(h, r->rs);
    if (r->has_es)
        h = mf_mul(h, r->es);
    if (r->round_bf16)
        h = mf_round_bf16(h);
    return h;
}

/* Clamped counts -> offs[0..E]. One work-item: E is small next to the rows. */
__kernel void mf_count_prefix(__global const int *counts, long co, long cs0, long experts,
                              long rows, __global long *offs)
{
    if (get_global_id(0) != 0)
        return;
    long acc = 0;
    offs[0] = 0;
    for (long e = 0; e < experts; e++) {
        long n = counts[co + e * cs0];
        n = n < 0 ? 0 : (n > rows ? rows : n);
        acc += n;
        offs[e + 1] = acc;
    }
}

/* Set up the h context of row (e, t). */
inline mf_hrow mf_row_setup(__global const uchar *x, long xo, long xs0, long xs1, int xdt,
                            __global const float *rs, long rso, long rss0, long rss1, int has_rs,
                            __global const uchar *es, long eso, long ess0, int esdt, int has_es,
                            long hidden, int activate, int act, int order, float limit,
                            int round_bf16, long e, long t)
{
    mf_hrow r;
    r.x = x;
    r.base = xo + e * xs0 + t * xs1;
    r.goff = order == 1 ? hidden : 0;
    r.uoff = order == 1 ? 0 : hidden;
    r.xdt = xdt;
    r.act = act;
    r.activate = activate;
    r.round_bf16 = round_bf16;
    r.has_rs = has_rs;
    r.has_es = has_es;
    r.limit = limit;
    r.rs = has_rs ? rs[rso + e * rss0 + t * rss1] : 1.0f;
    r.es = has_es ? mf_load(es, esdt, eso + e * ess0) : 1.0f;
    return r;
}

/* Store scale s (or exponent ue) of (e, t, g) in the requested layout. */
inline void mf_put_scale(__global uchar *sc, long sco, long scs0, long scs1, int scdt, int layout,
                         long e, long t, long g, float s, uint ue)
{
    if (layout == MF_PACKED) {
        long word = sco + e * scs0 + (g / 4) * scs1 + t;
        sc[word * 4 + (g % 4)] = (uchar)ue; /* byte g % 4 of a little-endian word */
        return;
    }
    long idx = sco + e * scs0 + (layout == MF_COLUMN_MAJOR ? g * scs1 + t : t * scs1 + g);
    if (scdt == MF_F32)
        ((__global float *)sc)[idx] = s;
    else
        sc[idx] = (uchar)ue;
}

#define MF_PRIV 8 /* h values a lane keeps in registers (see mf_rows_quant) */

/*
 * Quantize rows. The work-group splits into segments of `lanes` (a power of
 * two dividing the work-group size, chosen by the host); each segment takes
 * one quantization group, reduces its amax in local memory, then quantizes.
 * A lane keeps its up to MF_PRIV values of h in registers; a wider group (a
 * whole row, say) recomputes h for the second loop instead.
 */
__kernel void mf_rows_quant(__global const uchar *x, long xo, long xs0, long xs1, int xdt,
                            __global const float *rs, long rso, long rss0, long rss1, int has_rs,
                            __global const uchar *es, long eso, long ess0, int esdt, int has_es,
                            __global const long *offs, int has_counts, long experts, long rows,
                            long hidden, long group, long groups, int activate, int act, int order,
                            float limit, int round_bf16,
                            __global uchar *q, long qo, long qs0, long qs1, int qdt,
                            __global uchar *sc, long sco, long scs0, long scs1, int scdt,
                            int layout, int ue8m0, float eps, int lanes, __local float *red)
{
    const int lane = (int)get_local_id(0), wg = (int)get_local_size(0);
    const int seg = lane / lanes, sl = lane % lanes, per_pass = wg / lanes;
    const int fp8 = qdt == MF_F8;
    const long total = has_counts ? offs[experts] : rows;
    for (long i = (long)get_group_id(0); i < total; i += (long)get_num_groups(0)) {
        const long e = has_counts ? mf_find_expert(offs, experts, i) : 0;
        const long t = has_counts ? i - offs[e] : i;
        const mf_hrow r = mf_row_setup(x, xo, xs0, xs1, xdt, rs, rso, rss0, rss1, has_rs, es, eso,
                                       ess0, esdt, has_es, hidden, activate, act, order, limit,
                                       round_bf16, e, t);
        const long qrow = qo + e * qs0 + t * qs1;
        /* up to MF_PRIV values per lane stay in registers between the amax and
         * the quantization (loads issued together, h computed once); wider
         * groups recompute h in the second loop */
        const int cached = group <= (long)lanes * MF_PRIV;
        for (long g0 = 0; g0 < groups; g0 += per_pass) {
            const long g = g0 + seg;
            const int active = g < groups;
            float m = 0.0f;
            float hv[MF_PRIV];
            if (cached) {
                for (int k = 0; k < MF_PRIV; k++) {
                    const long c = sl + (long)k * lanes;
                    hv[k] = (active && c < group) ? mf_h(&r, g * group + c) : 0.0f;
                }
                for (int k = 0; k < MF_PRIV; k++)
                    if (mf_is_finite(hv[k])) {
                        float av = fabs(hv[k]);
                        m = av > m ? av : m;
                    }
            } else if (active) {
                for (long c = sl; c < group; c += lanes) {
                    float v = mf_h(&r, g * group + c);
                    if (mf_is_finite(v)) {
                        float av = fabs(v);
                        m = av > m ? av : m;
                    }
                }
            }
            red[lane] = m;
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int s = lanes / 2; s > 0; s >>= 1) {
                if (sl < s) {
                    float o = red[lane + s];
                    red[lane] = o > red[lane] ? o : red[lane];
                }
                barrier(CLK_LOCAL_MEM_FENCE);
            }
            float amax = red[seg * lanes];
            barrier(CLK_LOCAL_MEM_FENCE); /* red is rewritten by the next pass */
            if (!active)
                continue;
            amax = amax > eps ? amax : eps;
            float s = fp8 ? amax / 448.0f : amax / 127.0f;
            uint ue = 0u;
            if (ue8m0) {
                ue = mf_ue8m0_exponent(s);
                s = as_float(ue << 23);
            }
            for (long c = sl, k = 0; c < group; c += lanes, k++) {
                const long ch = g * group + c;
                float v = cached ? hv[k] : mf_h(&r, ch);
                float d = mf_is_finite(v) ? v / s : v;
                if (fp8)
                    q[qrow + ch] = mf_f32_to_e4m3(d);
                else
                    ((__global char *)q)[qrow + ch] = mf_f32_to_i8(d);
            }
            if (sl == 0)
                mf_put_scale(sc, sco, scs0, scs1, scdt, layout, e, t, g, s, ue);
        }
        if (lane == 0 && layout == MF_PACKED) /* unused bytes of the last packed word */
            for (long g = groups; g < (groups + 3) / 4 * 4; g++)
                mf_put_scale(sc, sco, scs0, scs1, scdt, layout, e, t, g, 0.0f, 0u);
    }
}

/* act_mul: h rounded once to out's dtype. Same row walk, lanes over channels. */
__kernel void mf_rows_act_mul(__global const uchar *x, long xo, long xs0, long xs1, int xdt,
                              __global const float *rs, long rso, long rss0, long rss1, int has_rs,
                              long rows, long hidden, int act, int order, float limit,
                              int round_bf16, __global uchar *out, long oo, long os0, long os1,
                              int odt)
{
    const long lane = (long)get_local_id(0), wg = (long)get_local_size(0);
    for (long t = (long)get_group_id(0); t < rows; t += (long)get_num_groups(0)) {
        const mf_hrow r = mf_row_setup(x, xo, xs0, xs1, xdt, rs, rso, rss0, rss1, has_rs, 0, 0, 0,
                                       MF_F32, 0, hidden, 1, act, order, limit, round_bf16, 0, t);
        const long orow = oo + t * os1;
        for (long c = lane; c < hidden; c += wg)
            mf_store(out, odt, orow + c, mf_h(&r, c));
        (void)os0;
    }
}

/*
 * Rows [t_begin, t_end) of every expert that are not computed: with zero_tail
 * the rows t >= n[e] (q and scales), and the padding rows T..Ta-1 of the
 * column-major and packed layouts (scales only). One work-item per row.
 */
__kernel void mf_rows_tail(__global const long *offs, int has_counts, int zero_tail, long experts,
                           long rows, long t_begin, long t_end, long hidden, long groups,
                           __global uchar *q, long qo, long qs0, long qs1,
                           __global uchar *sc, long sco, long scs0, long scs1, int scdt, int layout)
{
    const long span = t_end - t_begin;
    const long gid = (long)get_global_id(0);
    if (gid >= experts * span)
        return;
    const long e = gid / span, t = t_begin + gid % span;
    if (t < rows) {
        const long n = has_counts ? offs[e + 1] - offs[e] : rows;
        if (!zero_tail || t < n)
            return;
        const long qrow = qo + e * qs0 + t * qs1;
        for (long c = 0; c < hidden; c++)
            q[qrow + c] = 0;
    }
    const long slots = layout == MF_PACKED ? (groups + 3) / 4 * 4 : groups;
    for (long g = 0; g < slots; g++)
        mf_put_scale(sc, sco, scs0, scs1, scdt, layout, e, t, g, 0.0f, 0u);
}
