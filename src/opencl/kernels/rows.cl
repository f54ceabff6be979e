/*
 * Row kernels behind act_quant (2-D and masked 3-D), quant and act_mul.
 *
 * Valid rows are flattened: offs[E+1] (mf_count_prefix, on the device) holds
 * the prefix sum of the clamped counts; without counts (2-D calls, E = 1) row
 * i is t = i. A row is cut into items of up to 8 x (work-group size) channels
 * and a fixed grid of work-groups walks the items grid-stride, so work
 * follows sum(n), not E * Tmax, and the host never reads the counts.
 *
 * In an item, each work-item (lane) owns 8 consecutive channels: one 16-byte
 * load of gate and one of up (bf16/f16; two each for f32) where the host
 * found every such chunk 16-byte aligned ("vec"), element loads otherwise.
 * The h values stay in registers between the group's amax and its codes.
 *
 * Tensors arrive as a buffer plus offsets and strides in elements (long).
 * This file holds their pieces (the exp table, loading h, the walks, the
 * quantization); rows_kernels.cl the kernels.
 */

#define MF_PER_LANE 8 /* channels of one lane: ops_rows.c's PER_LANE */
#define MF_MAX_WG 128  /* work-group size at most (program.c) */

/* Everything needed to compute h of a row; built once per item. */
typedef struct mf_hrow {
    __global const uchar *x;
    long base;   /* element index of x[e, t, 0] */
    long goff;   /* channel of gate value 0 */
    long uoff;   /* channel of up value 0 */
    int xdt, act, activate, round_bf16, has_rs, has_es, vec;
    int interleaved; /* gate i at channel 2i, up i at 2i + 1 (goff 0, uoff 1) */
    float limit, rs, es, alpha, beta;
} mf_hrow;

/* ------------------------------------------------------------ the exp table */

/*
 * mf_exp_f32 (src/numerics/mf_exp.h) for |x| < MF_EXP_FAST_LIMIT, step for
 * step, with its table read from a copy in local memory: on GPUs a __constant
 * table read at 32 different indices by one warp is serialised.
 */
inline float mf_exp_fast_local(float x, __local const float *tab)
{
    const mf_u32 kb = mf_exp_kbits(x);
    const float2 t = vload2(kb & 31u, tab); /* T[j], T_lo[j] */
    return mf_exp_scale_fast(mf_exp_mantissa(mf_exp_poly(x, kb), t.x, t.y), kb);
}

/* mf_exp_f32, every x: the same branches, the table in local memory. */
inline float mf_exp_local(float x, __local const float *tab)
{
    if (!(mf_fabsf(x) < MF_EXP_FAST_LIMIT))
        return mf_exp_edge(x);
    return mf_exp_fast_local(x, tab);
}

/* g / (1 + exp(-s)) for |s| < MF_EXP_FAST_LIMIT (then d >= 1 and finite: no NaN): with
 * s = g mf_silu_formula, with s = alpha * g mf_silu_alpha_formula. */
inline float mf_silu_local(float g, float s, __local const float *tab)
{
    const float d = 1.0f + mf_exp_fast_local(-s, tab);
    return g / d;
}

/* Copy the exp table to local memory; every work-item of the group calls this (a barrier)
 * before its first exp. */
inline void mf_exp_table_to_local(__local float *tab)
{
    for (int i = (int)get_local_id(0); i < 64; i += (int)get_local_size(0))
        tab[i] = mf_exp_table[i];
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* ------------------------------------------------------------- loading h */

/* Eight elements of x as stored (b: the second 16 bytes, f32 only), so that a load can be
 * issued an item ahead of its use. i % 8 == 0, the buffer 16-byte aligned. */
typedef struct mf_raw8 {
    uint4 a, b;
} mf_raw8;

inline mf_raw8 mf_load_raw8(__global const uchar *x, int dt, long i)
{
    mf_raw8 w;
    w.a = *(__global const uint4 *)(x + (dt == MF_F32 ? 4 : 2) * i);
    w.b = dt == MF_F32 ? *(__global const uint4 *)(x + 4 * i + 16) : (uint4)(0u);
    return w;
}

inline void mf_unpack_raw8(mf_raw8 w, int dt, float v[8])
{
    const uint u[4] = {w.a.x, w.a.y, w.a.z, w.a.w}; /* bf16 / f16: the low half first */
    if (dt == MF_BF16) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            v[2 * k] = as_float(u[k] << 16);
            v[2 * k + 1] = as_float(u[k] & 0xFFFF0000u);
        }
    } else if (dt == MF_F16) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            v[2 * k] = mf_f16_to_f32((ushort)u[k]);
            v[2 * k + 1] = mf_f16_to_f32((ushort)(u[k] >> 16));
        }
    } else {
        const uint b[4] = {w.b.x, w.b.y, w.b.z, w.b.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            v[k] = as_float(u[k]);
            v[4 + k] = as_float(b[k]);
        }
    }
}

/* Elements i .. i + 7 of x as f32: one 16-byte load (two for f32) when vec, else the
 * first n elements one by one (the others 0). vec: i % 8 == 0, the buffer 16-byte aligned.
 * The vec branches repeat mf_unpack_raw8 on purpose: written through it, the same values
 * cost act_mul 2 points and quant 9 on NVIDIA's driver (PERFORMANCE.md, 25 November). */
inline void mf_load_chunk(__global const uchar *x, int dt, long i, int vec, int n, float v[8])
{
    if (vec && dt == MF_BF16) {
        const uint4 w = *(__global const uint4 *)(x + 2 * i);
        v[0] = as_float(w.x << 16);
        v[1] = as_float(w.x & 0xFFFF0000u);
        v[2] = as_float(w.y << 16);
        v[3] = as_float(w.y & 0xFFFF0000u);
        v[4] = as_float(w.z << 16);
        v[5] = as_float(w.z & 0xFFFF0000u);
        v[6] = as_float(w.w << 16);
        v[7] = as_float(w.w & 0xFFFF0000u);
    } else if (vec && dt == MF_F16) {
        const uint4 w = *(__global const uint4 *)(x + 2 * i);
        v[0] = mf_f16_to_f32((ushort)w.x);
        v[1] = mf_f16_to_f32((ushort)(w.x >> 16));
        v[2] = mf_f16_to_f32((ushort)w.y);
        v[3] = mf_f16_to_f32((ushort)(w.y >> 16));
        v[4] = mf_f16_to_f32((ushort)w.z);
        v[5] = mf_f16_to_f32((ushort)(w.z >> 16));
        v[6] = mf_f16_to_f32((ushort)w.w);
        v[7] = mf_f16_to_f32((ushort)(w.w >> 16));
    } else if (vec) {
        const float4 a = *(__global const float4 *)(x + 4 * i);
        const float4 b = *(__global const float4 *)(x + 4 * i + 16);
        v[0] = a.x;
        v[1] = a.y;
        v[2] = a.z;
        v[3] = a.w;
        v[4] = b.x;
        v[5] = b.y;
        v[6] = b.z;
        v[7] = b.w;
    } else {
        for (int k = 0; k < MF_PER_LANE; k++)
            v[k] = k < n ? mf_load(x, dt, i + k) : 0.0f;
    }
}

/* Eight values passed by value: an array argument of an out-of-line call would keep the
 * caller's arrays in memory on every path. */
typedef struct mf_vals8 {
    float v[MF_PER_LANE];
} mf_vals8;

/*
 * a = silu(g) or silu_alpha(g) where mf_silu_local does not apply (exp's argument
 * -s with |s| >= 86.5, or NaN; s = g or alpha g): rare, and out of line, so that a GPU
 * compiler neither interleaves its eight copies with the hot path nor counts their
 * registers there.
 */
__attribute__((noinline)) mf_vals8 mf_silu_slow8(mf_vals8 g, mf_vals8 s, mf_vals8 a, int act,
                                                 float alpha)
{
    for (int k = 0; k < MF_PER_LANE; k++)
        if (!(mf_fabsf(s.v[k]) < MF_EXP_FAST_LIMIT))
            a.v[k] = mf_activate_f32(act, alpha, g.v[k]);
    return a;
}

/* Gate and up values c .. c + 7 of an interleaved row (channels 2c .. 2c + 15): two chunk
 * loads when vec (2c is then a multiple of 16), else the first n pairs one by one. */
inline void mf_load_pairs(__global const uchar *x, int dt, long base, long c, int vec, int n,
                          float g[8], float u[8])
{
    float lo[MF_PER_LANE], hi[MF_PER_LANE];
    const int whole = vec && n == MF_PER_LANE;
    mf_load_chunk(x, dt, base + 2 * c, whole, whole ? 8 : min(2 * n, 8), lo);
    mf_load_chunk(x, dt, base + 2 * c + 8, whole, whole ? 8 : max(2 * n - 8, 0), hi);
#pragma unroll
    for (int k = 0; k < MF_PER_LANE / 2; k++) {
        g[k] = lo[2 * k];
        u[k] = lo[2 * k + 1];
        g[4 + k] = hi[2 * k];
        u[4 + k] = hi[2 * k + 1];
    }
}

/*
 * h of channels c .. c + 7 of the row (the first n of them), in NUMERICS.md's
 * order: clamp, up offset, act(g), bf16 rounding, * u, * row_scale,
 * * expert_scale, bf16 rounding. Each option is one uniform branch around a
 * loop over the 8 values. silu and silu_alpha take the local-table exp where
 * |g| (or |alpha g|) < 86.5 (all but NaN and huge g); the rare others, and any
 * NaN in h (whose bits must be the x86 reference's: mf_mul), are redone one by
 * one.
 */
inline void mf_h8(const mf_hrow *r, __local const float *tab, long c, int n, float h[8],
                  __local const float *ltab, __global const float *gtab, const int tabmode,
                  const mf_raw8 *pre)
{
    if (!r->activate) {
        mf_load_chunk(r->x, r->xdt, r->base + c, r->vec, n, h);
        return;
    }
    float g[MF_PER_LANE], u[MF_PER_LANE], a[MF_PER_LANE];
    if (pre) {
        mf_unpack_raw8(pre[0], r->xdt, g);
        mf_unpack_raw8(pre[1], r->xdt, u);
    } else if (r->interleaved) {
        mf_load_pairs(r->x, r->xdt, r->base, c, r->vec, n, g, u);
    } else {
        mf_load_chunk(r->x, r->xdt, r->base + r->goff + c, r->vec, n, g);
        mf_load_chunk(r->x, r->xdt, r->base + r->uoff + c, r->vec, n, u);
    }
    if (r->limit > 0.0f) {
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++) {
            g[k] = mf_clamp_gate(g[k], r->limit);
            u[k] = mf_clamp_up(u[k], r->limit);
        }
    }
    if (r->beta != 0.0f) {
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++)
            u[k] = mf_add_up_offset(u[k], r->beta);
    }
    if (tabmode) {
        /* bf16 gates (their f32 bits are the 16 bits shifted up): act(g) from the table, one
         * computed chunk where a gate is not covered (mf_act_table.h) */
        mf_u32 miss = 0u, off[MF_PER_LANE];
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++)
            off[k] = mf_act_table_offset(as_uint(g[k]), &miss) >> 2;
        if (!(miss & MF_TAB_MISS)) {
#pragma unroll
            for (int k = 0; k < MF_PER_LANE; k++)
                a[k] = tabmode == 1 ? ltab[off[k]] : gtab[off[k]];
        } else {
            for (int k = 0; k < MF_PER_LANE; k++)
                a[k] = mf_activate_f32(r->act, r->alpha, g[k]);
        }
    } else if (r->act == MF_ACT_SILU || r->act == MF_ACT_SILU_ALPHA) {
        /* exp's argument is -s: s = g, or alpha * g (mf_silu_alpha_formula's a) */
        const int scaled = r->act == MF_ACT_SILU_ALPHA;
        float s[MF_PER_LANE];
        int slow = 0;
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++) {
            s[k] = scaled ? r->alpha * g[k] : g[k];
            slow |= !(mf_fabsf(s[k]) < MF_EXP_FAST_LIMIT);
            a[k] = mf_silu_local(g[k], s[k], tab);
        }
        if (slow) {
            mf_vals8 gv, sv, av;
#pragma unroll
            for (int k = 0; k < MF_PER_LANE; k++) {
                gv.v[k] = g[k];
                sv.v[k] = s[k];
                av.v[k] = a[k];
            }
            av = mf_silu_slow8(gv, sv, av, r->act, r->alpha);
#pragma unroll
            for (int k = 0; k < MF_PER_LANE; k++)
                a[k] = av.v[k];
        }
    } else {
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++)
            a[k] = mf_activate_f32(r->act, r->alpha, g[k]);
    }
    if (r->round_bf16) {
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++)
            a[k] = mf_round_bf16(a[k]);
    }
    int any_nan = 0;
#pragma unroll
    for (int k = 0; k < MF_PER_LANE; k++) {
        float v = a[k] * u[k];
        if (r->has_rs)
            v = v * r->rs;
        if (r->has_es)
            v = v * r->es;
        h[k] = v;
        any_nan |= mf_is_nan(v);
    }
    if (any_nan) { /* a NaN anywhere stays NaN to the end: rebuild its x86 bits */
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++)
            if (mf_is_nan(h[k])) {
                float v = mf_mul(a[k], u[k]);
                if (r->has_rs)
                    v = mf_mul(v, r->rs);
                if (r->has_es)
                    v = mf_mul(v, r->es);
                h[k] = v;
            }
    }
    if (r->round_bf16) {
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++)
            h[k] = mf_round_bf16(h[k]);
    }
}

/*
 * The grid-stride walk of a work-group over items (i, p): p = 0 .. parts - 1
 * of row i, item number i * parts + p. The stride splits once into whole
 * rows and parts, so a step costs no 64-bit division (a long software
 * routine on GPUs, once per item and lane).
 */
typedef struct mf_walk {
    long i, p, parts, di, dp;
} mf_walk;

inline mf_walk mf_walk_start(long parts)
{
    const long first = (long)get_group_id(0), stride = (long)get_num_groups(0);
    mf_walk w;
    w.parts = parts;
    w.i = first / parts;
    w.p = first - w.i * parts;
    w.di = stride / parts;
    w.dp = stride - w.di * parts;
    return w;
}

inline void mf_walk_next(mf_walk *w)
{
    w->i += w->di;
    w->p += w->dp;
    if (w->p >= w->parts) {
        w->p -= w->parts;
        w->i++;
    }
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

/*
 * Last e >= lo with offs[e] <= i (offs[lo] <= i): the expert of flattened valid row i.
 * A work-group's rows only grow, so its search starts from its last expert and gallops
 * (1, 2, 4, ... ahead) before halving: the next item is mostly in the same expert or a
 * near one, one or two dependent loads instead of log2(E). For offs in either space.
 */
#define MF_FIND_EXPERT_FROM(name, space) \
    inline long name(space const long *offs, long lo, long experts, long i) \
    { \
        long step = 1; \
        while (lo + step < experts && offs[lo + step] <= i) { \
            lo += step; \
            step *= 2; \
        } \
        long hi = min(lo + step - 1, experts - 1); \
        while (lo < hi) { \
            const long mid = (lo + hi + 1) / 2; \
            if (offs[mid] <= i) \
                lo = mid; \
            else \
                hi = mid - 1; \
        } \
        return lo; \
    }
MF_FIND_EXPERT_FROM(mf_find_expert_from, __global)
MF_FIND_EXPERT_FROM(mf_find_expert_from_local, __local)

#define MF_LOCAL_EXPERTS 1024 /* row offsets of up to this many experts in local memory */

/* Expert of row i of the walk, searched from expert e on (2-D: 0); its token is i - offs[e]. */
inline long mf_row_expert(__global const long *offs, __local const long *loffs, int has_counts,
                          int loffs_on, long experts, long e, long i)
{
    return !has_counts ? 0
           : loffs_on  ? mf_find_expert_from_local(loffs, e, experts, i)
                       : mf_find_expert_from(offs, e, experts, i);
}

inline long mf_row_token(__global const long *offs, __local const long *loffs, int has_counts,
                         int loffs_on, long e, long i)
{
    return !has_counts ? i : loffs_on ? i - loffs[e] : i - offs[e];
}

/* Set up the h context of row (e, t). */
inline mf_hrow mf_row_setup(__global const uchar *x, long xo, long xs0, long xs1, int xdt,
                            __global const float *rs, long rso, long rss0, long rss1, int has_rs,
                            __global const uchar *es, long eso, long ess0, int esdt, int has_es,
                            long hidden, int activate, int act, int order, float limit,
                            float alpha, float beta, int round_bf16, int vec, long e, long t)
{
    mf_hrow r;
    r.x = x;
    r.base = xo + e * xs0 + t * xs1;
    r.goff = mf_gate_at(order, hidden);
    r.uoff = mf_up_at(order, hidden);
    r.interleaved = order == MF_ORDER_INTERLEAVED;
    r.alpha = alpha;
    r.beta = beta;
    r.xdt = xdt;
    r.act = act;
    r.activate = activate;
    r.round_bf16 = round_bf16;
    r.has_rs = has_rs;
    r.has_es = has_es;
    r.vec = vec;
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

/* ----------------------------------------------------------- quantization */

/* Bits of the largest finite |h[j]| (0 if none): an amax of non-negative floats by unsigned
 * max. Sets *nonfinite where some h[j] is NaN or +-Inf (rare: then a second pass). */
inline uint mf_amax_bits8(const float h[8], int *nonfinite)
{
    uint all = 0u;
#pragma unroll
    for (int j = 0; j < MF_PER_LANE; j++)
        all = max(all, as_uint(h[j]) & 0x7FFFFFFFu);
    if (all < 0x7F800000u)
        return all;
    *nonfinite = 1;
    uint m = 0u;
#pragma unroll
    for (int j = 0; j < MF_PER_LANE; j++) {
        const uint ab = as_uint(h[j]) & 0x7FFFFFFFu;
        m = max(m, ab < 0x7F800000u ? ab : 0u);
    }
    return m;
}

/*
 * h / s for finite h, given y = RN(1 / s) (one IEEE division per group):
 * q0 = RN(h y) is within 1.5 ulp of h / s, the residual h - q0 s is exact in
 * an fma and RN(q0 + res y) is then within 2^-46 (relative) of h / s beyond
 * its own rounding. A code changes only where h / s crosses a rounding
 * boundary m of the code (an e4m3 value with one more bit, or k + 1/2): when
 * h / s = m exactly the result is m exactly (res = +-ulp s, exact), and
 * otherwise h - s m is a nonzero multiple of ulp(s) ulp(m), so h / s is at
 * least 2^-29 m away from m (e4m3; 2^-32 for i8), far more than the error.
 * So the codes are those of the IEEE quotient. This holds while every term is
 * a normal number: the callers take it for s in [2^-60, 2^60] (|h| <= amax <=
 * 448 s, and a quotient below 2^-11 gives code 0 either way). The sign of a
 * zero quotient may be lost: the e4m3 code takes its sign from h.
 */
inline float mf_div_by_scale(float h, float s, float y)
{
    const float q0 = h * y;
    const float res = fma(-q0, s, h);
    return fma(res, y, q0);
}

inline int mf_div_by_scale_ok(float s) { return s >= 0x1p-60f && s <= 0x1p+60f; }

/*
 * mf_f32_to_e4m3 of a value of magnitude |d| with the sign of sgn, without
 * branches (the same byte for every f32: README.md). Normal codes round the
 * low 20 mantissa bits half to even (the parity is bit 20), from 2^-6 up;
 * below 2^-6 the codes are the multiples of 2^-9, which adding 1.5 * 2^14
 * (ulp 2^-9) rounds to, half to even. _finite: |d| < 464 and not NaN (no
 * saturation, no NaN code).
 */
inline uint mf_e4m3_code_finite(float d, float sgn)
{
    const uint ax = as_uint(d) & 0x7FFFFFFFu;
    const uint nrm = (ax + (0x7FFFFu - 0x3C000000u) + ((ax >> 20) & 1u)) >> 20;
    const uint sub = as_uint(as_float(ax) + 24576.0f) - 0x46C00000u;
    return ((as_uint(sgn) >> 24) & 0x80u) | (ax < 0x3C800000u ? sub : nrm);
}

/* Any f32: saturates at 448 (0x7E, Inf too), NaN gives 0x7F with sgn's sign. */
inline uint mf_e4m3_code(float d, float sgn)
{
    const uint ax = as_uint(d) & 0x7FFFFFFFu;
    const uint nrm = min((ax + (0x7FFFFu - 0x3C000000u) + ((ax >> 20) & 1u)) >> 20, 0x7Eu);
    const uint sub = as_uint(as_float(ax) + 24576.0f) - 0x46C00000u;
    const uint mag = ax < 0x3C800000u ? sub : nrm;
    return ((as_uint(sgn) >> 24) & 0x80u) | (ax > 0x7F800000u ? 0x7Fu : mag);
}

/* mf_f32_to_i8 without branches: NaN 0, clamp to [-127, 127], round half to even by adding
 * 1.5 * 2^23 (ulp 1). _finite: |d| < 127.5 and not NaN (no clamp needed). */
inline uint mf_i8_code_finite(float d) { return (as_uint(d + 12582912.0f) - 0x4B400000u) & 0xFFu; }

inline uint mf_i8_code(float d)
{
    const float c = fmin(fmax(d, -127.0f), 127.0f);
    return mf_is_nan(d) ? 0u : mf_i8_code_finite(c);
}

/* Bytes c[0..7] as two little-endian words. */
inline uint2 mf_pack8(const uint c[8])
{
    return (uint2)(c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24),
                   c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24));
}

/*
 * Codes of 8 values of h with scale s (y = 1 / s). `plain`: every value
 * finite and s in mf_div_by_scale's range, the common case, with one
 * division-free quotient per value (|h / s| <= 448 (1 + 2^-23), or 127
 * (1 + 2^-23): the _finite conversions apply). Otherwise each value takes the
 * reference's path: NaN the NaN code, +-Inf +-448 / +-127, finite h / s.
 */
inline uint2 mf_codes8(const float h[8], float s, float y, int plain, int fp8)
{
    uint c[MF_PER_LANE];
    if (plain && fp8) {
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++)
            c[k] = mf_e4m3_code_finite(mf_div_by_scale(h[k], s, y), h[k]);
    } else if (plain) {
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++)
            c[k] = mf_i8_code_finite(mf_div_by_scale(h[k], s, y));
    } else {
        const int fast = mf_div_by_scale_ok(s);
#pragma unroll
        for (int k = 0; k < MF_PER_LANE; k++) {
            const float v = h[k];
            float d = fast ? mf_div_by_scale(v, s, y) : v / s;
            d = mf_is_finite(v) ? d : v;
            c[k] = fp8 ? mf_e4m3_code(d, v) : mf_i8_code(d);
        }
    }
    return mf_pack8(c);
}

/* Store the first n of 8 codes at q[i]: one 8-byte store when vec (i % 8 == 0). */
inline void mf_store_codes8(__global uchar *q, long i, uint2 w, int vec, int n)
{
    if (vec) {
        *(__global uint2 *)(q + i) = w;
        return;
    }
    for (int k = 0; k < n; k++)
        q[i + k] = (uchar)((k < 4 ? w.x : w.y) >> (8 * (k % 4)));
}

/*
 * Largest m over the `lanes` lanes of each segment (lanes a power of two
 * dividing the work-group, lanes * seg the segment's first lane) through
 * red[0..wg): one barrier, then each lane reads its segment's values (up to
 * 32; more by a halving tree; max_lanes: a bound the caller knows). red is
 * 16-byte aligned, and alternates between two halves from one call to the
 * next, so a call's writes never race the previous call's reads.
 */
inline uint mf_segment_max(__local uint *red, uint m, int lane, int max_lanes, int lanes,
                           int seg)
{
    red[lane] = m;
    barrier(CLK_LOCAL_MEM_FENCE);
    __local const uint *mine = red + seg * lanes;
    if (max_lanes <= 32 || lanes <= 32) {
        if (lanes >= 4) {
            for (int j = 0; j < lanes; j += 4) {
                const uint4 v = ((__local const uint4 *)mine)[j / 4]; /* 16-byte aligned */
                m = max(m, max(max(v.x, v.y), max(v.z, v.w)));
            }
        } else {
            for (int j = 0; j < lanes; j++)
                m = max(m, mine[j]);
        }
        return m;
    }
    const int sl = lane - seg * lanes;
    for (int s = lanes / 2; s > 0; s >>= 1) {
        if (sl < s)
            red[lane] = max(red[lane], red[lane + s]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return mine[0];
}
