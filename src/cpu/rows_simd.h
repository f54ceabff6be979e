/*
 * The vector row kernels, written once over W-lane operations that the
 * including file defines (rows_avx2.c: 8 lanes, rows_avx512.c: 16), and
 * compiled there for its instruction set. Every lane performs the
 * reference's operations (rows_ref.c, src/numerics) in the same order, so
 * the bytes are the reference's:
 *  - act(g) of a bf16 gate without clamp (silu only where the level gathers
 *    faster than it computes, SIMD_ACT_TABLE): read from the plan's table
 *    (mf_act_table.h: entries are mf_activate_f32 of their gates) by a gather;
 *    gates it does not cover go to the reference, as below.
 *  - silu and silu_alpha otherwise: mf_exp_f32's fast path (|a| < 86.5, a = g or
 *    alpha * g) step for step, then the IEEE division g / (1 + e); the clamp, up
 *    offset (vaddps returns a NaN u quieted, as the reference's addition does),
 *    factors and bf16 roundings as written.
 *    Lanes the fast path does not cover (NaN, |a| >= 86.5) and the gelu forms
 *    are handed to the reference's own mf_cpu_h_channel, as are whole rows
 *    whose row or expert factor is NaN (a product of two NaNs keeps the
 *    operand the compiler placed first, and only the reference's code knows).
 *  - the interleaved order: the row's gate and up values are first copied apart
 *    (row_halves), so every kernel reads two contiguous halves.
 *  - amax over the finite values (max is exact, so lane order does not matter);
 *    the scale by the reference's mf_group_scale.
 *  - codes: h / s by the IEEE division, then the integer e4m3 rounding of
 *    numerics.h without branches, or RNE and a clamp for i8.
 * Channels past the last full vector take the reference's scalar code.
 *
 * The including file provides, for SIMD_W lanes:
 *   vf (f32), vi (i32), vm (lane mask) and the operations used below;
 *   simd_exp_table, simd_exp_table_init, simd_exp_lookup (mf_exp.h's table);
 *   SIMD_FN (function qualifiers), SIMD_ISA and SIMD_ISA_NAME (the level),
 *   SIMD_NAME (prefix of the kernels) and SIMD_TABLE (the kernel table's name);
 *   SIMD_ACT_TABLE: 1 where silu is faster gathered from the activation table than computed;
 *   optionally SIMD_GEMM_STREAM, the level's weight-stream tile (rows_isa.h: gemm_stream; by
 *   default AVX2's);
 *   optionally SIMD_SILU_ONE_PASS 1: the computed silu in one pass, not two (needs 32
 *   registers: AVX2 was 10% slower with it, AVX-512 2-3% faster).
 */
#ifndef SIMD_SILU_ONE_PASS
#define SIMD_SILU_ONE_PASS 0
#endif
#ifndef SIMD_GEMM_STREAM
#define SIMD_GEMM_STREAM mf_cpu_gemm_stream_avx2
#endif

#if !defined(SIMD_TABLE) || !defined(SIMD_ACT_TABLE)
#error "rows_simd.h is included by rows_avx2.c and rows_avx512.c only"
#endif

#include "cpu/activation.h"
#include "cpu/numerics.h"
#include "cpu/rows_isa.h"
#include "cpu/tensor_cpu.h"
#include "numerics/mf_act_table.h"
#include "numerics/mf_exp.h"

#define SIMD_INLINE SIMD_FN inline __attribute__((always_inline))

/* ------------------------------------------------------------ elements */

/* W values of dt (f32, bf16 or f16) from p[c..c+W), exactly as mf_load_elem converts. */
SIMD_INLINE vf load_in(const void *p, int64_t c, moefuse_dtype dt)
{
    if (dt == MOEFUSE_F32)
        return vf_loadu((const float *)p + c);
    const vi h = vi_load_u16((const uint16_t *)p + c); /* zero-extended */
    if (dt == MOEFUSE_BF16)
        return vi_as_vf(vi_sll(h, 16));
    /* f16: normal, Inf/NaN (mantissa kept), zero and subnormal (m * 2^-24, exact) */
    const vi sign = vi_sll(vi_and(h, vi_set(0x8000)), 16);
    const vi e = vi_and(h, vi_set(0x7C00));
    const vi m = vi_and(h, vi_set(0x3FF));
    const vi normal = vi_add(vi_sll(vi_and(h, vi_set(0x7FFF)), 13), vi_set(112 << 23));
    const vi special = vi_or(vi_set(0x7F800000), vi_sll(m, 13));
    const vi tiny = vf_bits(vf_mul(vi_to_vf(m), vf_set(5.9604644775390625e-8f)));
    vi r = vi_blend(vi_eq(e, vi_set(0x7C00)), special, normal);
    r = vi_blend(vi_eq(e, vi_set(0)), tiny, r);
    return vi_as_vf(vi_or(r, sign));
}

/* mf_round_bf16: nearest even bf16, NaN quieted to sign | 0x7FC00000. */
SIMD_INLINE vf round_bf16(vf f)
{
    const vi u = vf_bits(f);
    const vi ax = vi_and(u, vi_set(0x7FFFFFFF));
    const vi r = vi_and(vi_add(vi_add(u, vi_set(0x7FFF)), vi_and(vi_srl(u, 16), vi_set(1))),
                        vi_set((int32_t)0xFFFF0000u));
    const vi qnan = vi_or(vi_and(u, vi_set((int32_t)0x80000000u)), vi_set(0x7FC00000));
    return vi_as_vf(vi_blend(vi_gt(ax, vi_set(0x7F800000)), qnan, r));
}

/* mf_f32_to_f16 of W lanes (16-bit codes in 32-bit lanes). */
SIMD_INLINE vi f16_codes(vf f)
{
    const vi u = vf_bits(f);
    const vi sign = vi_and(vi_srl(u, 16), vi_set(0x8000));
    const vi ax = vi_and(u, vi_set(0x7FFFFFFF));
    /* normal half: (ax - 0x38000000 + 0xFFF + bit 13) >> 13, bit 13 of ax being that of
     * ax - 0x38000000; a carry into the exponent gives Inf as IEEE rounding does */
    const vi v = vi_srl(vi_add(vi_sub(ax, vi_set(0x37FFF001)), vi_and(vi_srl(ax, 13), vi_set(1))), 13);
    /* below 2^-14: |f| + 0.5 rounds |f| to a multiple of 2^-24 (that binade's spacing) */
    const vi sub = vi_sub(vf_bits(vf_add(vi_as_vf(ax), vf_set(0.5f))), vi_set(0x3F000000));
    vi r = vi_blend(vi_gt(ax, vi_set(0x387FFFFF)), v, sub);
    r = vi_blend(vi_gt(ax, vi_set(0x477FFFFF)), vi_set(0x7C00), r); /* >= 2^16, Inf */
    r = vi_blend(vi_gt(ax, vi_set(0x7F800000)), vi_set(0x7E00), r); /* NaN */
    return vi_or(r, sign);
}

/* mf_e4m3_to_f32 of W codes (zero-extended bytes). */
SIMD_INLINE vf e4m3_values(vi b)
{
    const vi sign = vi_sll(vi_and(b, vi_set(0x80)), 24);
    const vi mag = vi_and(b, vi_set(0x7F));
    const vi normal = vi_add(vi_sll(mag, 20), vi_set(120 << 23));
    const vi sub = vf_bits(vf_mul(vi_to_vf(vi_and(b, vi_set(7))), vf_set(0.001953125f)));
    vi r = vi_blend(vi_gt(mag, vi_set(7)), normal, sub);
    r = vi_blend(vi_eq(mag, vi_set(0x7F)), vi_set(0x7FC00000), r);
    return vi_as_vf(vi_or(r, sign));
}

/* W values rounded to dt (bf16 or f16), stored. */
SIMD_INLINE void store_half(uint16_t *o, vf v, moefuse_dtype dt)
{
    store_u16(o, dt == MOEFUSE_BF16 ? vi_srl(vf_bits(round_bf16(v)), 16) : f16_codes(v));
}

/*
 * mf_exp_f32(-g) for lanes with |g| < MF_EXP_FAST_LIMIT: mf_exp_kbits, mf_exp_poly,
 * mf_exp_mantissa and mf_exp_scale_fast, operation for operation on x = -g, with the
 * negation folded into the first two fused operations (fmaf(x, c, m) is -(g c) + m and
 * fmaf(-k, c, x) is -(k c) - g: the same exact values, rounded once).
 */
SIMD_INLINE vf exp_neg_fast(vf g, const simd_exp_table *t)
{
    const vf kf = vf_fnma(g, vf_set(MF_EXP_INV32), vf_set(MF_EXP_MAGIC));
    const vi kb = vf_bits(kf);
    const vf k = vf_sub(kf, vf_set(MF_EXP_MAGIC));
    const vf r0 = vf_fnms(k, vf_set(MF_EXP_L32H), g);
    const vf r = vf_fnma(k, vf_set(MF_EXP_L32L), r0);
    const vf p = vf_fma(r, vf_set(MF_EXP_C3), vf_set(MF_EXP_C2));
    const vf r2 = vf_mul(r, r);
    const vf q = vf_fma(r2, p, r);
    vf hi, lo;
    simd_exp_lookup(t, kb, &hi, &lo); /* entries of j = kb & 31 */
    const vf m = vf_add(hi, vf_fma(hi, q, lo));
    return vi_as_vf(vi_add(vf_bits(m), vi_sll(vi_srl(kb, 5), 23)));
}

/* Lanes where exp_neg_fast(-x) is not mf_exp_f32(x) (NaN included). */
SIMD_INLINE vm exp_edge(vf x) { return vm_not_lt(vf_abs(x), vf_set(MF_EXP_FAST_LIMIT)); }

/* mf_f32_to_e4m3 of W lanes. */
SIMD_INLINE vi e4m3_codes(vf f)
{
    const vi u = vf_bits(f);
    const vi sign = vi_and(vi_srl(u, 24), vi_set(0x80));
    const vi ax = vi_and(u, vi_set(0x7FFFFFFF));
    /* normal e4m3 (>= 2^-6): drop 20 mantissa bits, nearest even */
    vi v = vi_sub(ax, vi_set(0x3C000000));
    v = vi_srl(vi_add(vi_add(v, vi_set(0x7FFFF)), vi_and(vi_srl(v, 20), vi_set(1))), 20);
    /* below 2^-6: the code is the integer nearest (even) to |f| 2^9, exact in f32 */
    const vi sub = vf_to_vi(vf_round_even(vf_mul(vi_as_vf(ax), vf_set(512.0f))));
    vi r = vi_blend(vi_gt(ax, vi_set(0x3C7FFFFF)), v, sub);
    r = vi_blend(vi_gt(ax, vi_set(0x43E00000)), vi_set(0x7E), r); /* > 448, Inf: saturate */
    r = vi_blend(vi_gt(ax, vi_set(0x7F800000)), vi_set(0x7F), r); /* NaN */
    return vi_or(r, sign);
}

/* mf_f32_to_i8 of W lanes (as int32 in -127..127). */
SIMD_INLINE vi i8_codes(vf f)
{
    vf r = vf_round_even(f);
    r = vf_blend(vm_gt(r, vf_set(127.0f)), vf_set(127.0f), r);
    r = vf_blend(vm_lt(r, vf_set(-127.0f)), vf_set(-127.0f), r);
    const vi c = vf_to_vi(r);
    return vi_blend(vm_unordered(f, f), vi_set(0), c);
}

/* Finite lanes of h. */
SIMD_INLINE vm finite_lanes(vf h) { return vi_gt(vi_set(0x7F800000), vi_and(vf_bits(h), vi_set(0x7FFFFFFF))); }

/* ---------------------------------------------------------------- rows */

/* One input value, converted as the reference does. */
static float in_value(const void *p, int64_t c, moefuse_dtype dt)
{
    switch (dt) {
    case MOEFUSE_F32: return ((const float *)p)[c];
    case MOEFUSE_BF16: return mf_bf16_to_f32(((const uint16_t *)p)[c]);
    default: return mf_f16_to_f32(((const uint16_t *)p)[c]);
    }
}

/* The clamp, up offset, factors and roundings of a row, fixed for its whole length. */
typedef struct {
    bool clamp, round_bf16, has_rs, has_es, has_beta;
    float limit, rs, es, beta;
} h_opts;

/* u + beta where the row has an up offset (mf_add_up_offset: a NaN u comes back quieted). */
SIMD_INLINE vf up_offset(const h_opts *o, vf u)
{
    return (o && o->has_beta) ? vf_add(u, vf_set(o->beta)) : u;
}

/* mf_clamp_gate and mf_clamp_up of W lanes, lim the call's limit and nlim its negation. */
SIMD_INLINE vf clamp_gate(vf g, vf lim) { return vf_blend(vm_gt(g, lim), lim, g); }
SIMD_INLINE vf clamp_up(vf u, vf lim, vf nlim)
{
    return vf_blend(vm_gt(u, lim), lim, vf_blend(vm_lt(u, nlim), nlim, u));
}

/* h from a = act(g) and u: the intermediate rounding and factors of NUMERICS.md, in order. */
SIMD_INLINE vf product(const h_opts *o, vf a, vf u, float rs, float es)
{
    if (o && o->round_bf16)
        a = round_bf16(a);
    vf hv = vf_mul(a, u);
    if (o && o->has_rs)
        hv = vf_mul(hv, vf_set(rs));
    if (o && o->has_es)
        hv = vf_mul(hv, vf_set(es));
    if (o && o->round_bf16)
        hv = round_bf16(hv);
    return hv;
}

/*
 * h[0..n) of channels [c0, c0 + n), gp and up the row's gate and up halves (gp the row
 * itself without activation); returns the largest |h| bit pattern (NaN above Inf above
 * every finite value). Inlined per input dtype and, for the common call without clamp,
 * factors or roundings, with o = NULL.
 */
SIMD_INLINE uint32_t h_span_dt(const mf_row_plan *p, const h_opts *o, const void *gp,
                               const void *up, int64_t c0, int64_t n, float *h,
                               const simd_exp_table *t, moefuse_dtype dt)
{
    vi top = vi_set(0);
    int64_t c = 0;
    bool scanned = true; /* top covers every channel of [0, c) */
    /* silu is computed below where the level does that faster than it gathers */
    const bool table = dt == MOEFUSE_BF16 && p->act_table && !(o && o->clamp) &&
                       (SIMD_ACT_TABLE || p->activation != MOEFUSE_ACT_SILU);
    if (table) {
        const float rs = o ? o->rs : 1.0f, es = o ? o->es : 1.0f;
        vi miss = vi_set(0);
        for (; c + SIMD_W <= n; c += SIMD_W) {
            const vi x = vi_sll(vi_load_u16((const uint16_t *)gp + c0 + c), 16);
            /* mf_act_table_offset, lane by lane */
            const vi d = vi_sub(x, vi_set((int32_t)(MF_TAB_LO << 16)));
            miss = vi_or(miss, d);
            const vi off = vi_or(vi_and(vi_srl(d, 14), vi_set(0x3FFC)),
                                 vi_and(vi_srl(d, 17), vi_set(0x4000)));
            const vf hv = product(o, vf_gather(p->act_table, off),
                                  up_offset(o, load_in(up, c0 + c, dt)), rs, es);
            top = vi_max(top, vf_bits(vf_abs(hv)));
            vf_storeu(h + c, hv);
        }
        if (vi_hmax(vi_and(miss, vi_set((int32_t)MF_TAB_MISS))) != 0) {
            /* rare: gates the table does not cover, by the reference; rescan */
            top = vi_set(0);
            for (int64_t l = 0; l < c; l++) {
                const uint16_t b = ((const uint16_t *)gp)[c0 + l];
                if ((uint32_t)(b & 0x7FFFu) - MF_TAB_LO >= MF_TAB_SPAN)
                    h[l] = mf_cpu_h_channel(p, mf_bf16_to_f32(b), in_value(up, c0 + l, dt), rs, es);
            }
            for (int64_t l = 0; l + SIMD_W <= c; l += SIMD_W)
                top = vi_max(top, vf_bits(vf_abs(vf_loadu(h + l))));
        }
    } else if (!p->activate) {
        for (; c + SIMD_W <= n; c += SIMD_W) {
            const vf v = load_in(gp, c0 + c, dt);
            top = vi_max(top, vf_bits(vf_abs(v)));
            vf_storeu(h + c, v);
        }
        for (; c < n; c++)
            h[c] = in_value(gp, c0 + c, dt);
    } else if (p->activation == MOEFUSE_ACT_SILU || p->activation == MOEFUSE_ACT_SILU_ALPHA) {
        const float rs = o ? o->rs : 1.0f, es = o ? o->es : 1.0f;
        /* exp's argument is -a: a = g (silu) or alpha * g (silu_alpha) */
        const bool scaled = p->activation == MOEFUSE_ACT_SILU_ALPHA;
        const vf alpha = vf_set(p->alpha);
        vi atop = vi_set(0); /* largest |a| bit pattern: NaN and |a| >= 86.5 are edges */
        const vf lim = vf_set(o ? o->limit : 0.0f), nlim = vf_set(o ? -o->limit : 0.0f);
#if SIMD_SILU_ONE_PASS
        /* One pass: an iteration's chain (exp, division, product) is long but independent of
         * the next, and with 32 registers the core keeps several in flight */
        for (; c + SIMD_W <= n; c += SIMD_W) {
            vf g = load_in(gp, c0 + c, dt), u = load_in(up, c0 + c, dt);
            if (o && o->clamp) {
                g = clamp_gate(g, lim);
                u = clamp_up(u, lim, nlim);
            }
            const vf a = scaled ? vf_mul(alpha, g) : g;
            atop = vi_max(atop, vf_bits(vf_abs(a)));
            const vf d = vf_add(vf_set(1.0f), exp_neg_fast(a, t));
            const vf hv = product(o, vf_div(g, d), up_offset(o, u), rs, es);
            top = vi_max(top, vf_bits(vf_abs(hv)));
            vf_storeu(h + c, hv);
        }
#else
        /* Two passes, so that each loop's chain is short enough for several iterations to be
         * in flight in 16 registers: d = 1 + exp(-g) into h first, then g / d and the rest */
        for (; c + SIMD_W <= n; c += SIMD_W) {
            vf g = load_in(gp, c0 + c, dt);
            if (o && o->clamp)
                g = clamp_gate(g, lim);
            const vf a = scaled ? vf_mul(alpha, g) : g;
            atop = vi_max(atop, vf_bits(vf_abs(a)));
            vf_storeu(h + c, vf_add(vf_set(1.0f), exp_neg_fast(a, t)));
        }
        for (int64_t l = 0; l < c; l += SIMD_W) {
            vf g = load_in(gp, c0 + l, dt), u = load_in(up, c0 + l, dt);
            if (o && o->clamp) {
                g = clamp_gate(g, lim);
                u = clamp_up(u, lim, nlim);
            }
            const vf hv = product(o, vf_div(g, vf_loadu(h + l)), up_offset(o, u), rs, es);
            top = vi_max(top, vf_bits(vf_abs(hv)));
            vf_storeu(h + l, hv);
        }
#endif
        if ((uint32_t)vi_hmax(atop) >= mf_f32_bits(MF_EXP_FAST_LIMIT)) {
            /* rare: redo those lanes by the reference, rescan */
            top = vi_set(0);
            for (int64_t l = 0; l < c; l++) {
                const float g = in_value(gp, c0 + l, dt);
                const float gc = o && o->clamp ? mf_clamp_gate(g, o->limit) : g;
                const float a = scaled ? p->alpha * gc : gc;
                if (!(fabsf(a) < MF_EXP_FAST_LIMIT))
                    h[l] = mf_cpu_h_channel(p, g, in_value(up, c0 + l, dt), rs, es);
            }
            for (int64_t l = 0; l + SIMD_W <= c; l += SIMD_W)
                top = vi_max(top, vf_bits(vf_abs(vf_loadu(h + l))));
        }
    } else {
        scanned = false; /* the gelu forms: every channel below */
    }
    for (; c < n; c++) /* the tail, and every channel of the gelu forms */
        h[c] = mf_cpu_h_channel(p, in_value(gp, c0 + c, dt), in_value(up, c0 + c, dt),
                                o ? o->rs : 1.0f, o ? o->es : 1.0f);
    uint32_t m = (uint32_t)vi_hmax(top);
    for (int64_t l = n - (n % SIMD_W); l < n; l++) {
        const uint32_t b = mf_f32_bits(h[l]) & 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    if (!scanned)
        for (int64_t l = 0; l < n; l++) {
            const uint32_t b = mf_f32_bits(h[l]) & 0x7FFFFFFFu;
            m = b > m ? b : m;
        }
    return m;
}

static uint32_t h_span(const mf_row_plan *p, const h_opts *o, const void *gp, const void *up,
                       int64_t c0, int64_t n, float *h, const simd_exp_table *t)
{
    const bool plain = !o->clamp && !o->round_bf16 && !o->has_rs && !o->has_es && !o->has_beta;
    switch (p->in_dtype) {
    case MOEFUSE_BF16:
        return plain ? h_span_dt(p, NULL, gp, up, c0, n, h, t, MOEFUSE_BF16)
                     : h_span_dt(p, o, gp, up, c0, n, h, t, MOEFUSE_BF16);
    case MOEFUSE_F32:
        return plain ? h_span_dt(p, NULL, gp, up, c0, n, h, t, MOEFUSE_F32)
                     : h_span_dt(p, o, gp, up, c0, n, h, t, MOEFUSE_F32);
    default:
        return plain ? h_span_dt(p, NULL, gp, up, c0, n, h, t, MOEFUSE_F16)
                     : h_span_dt(p, o, gp, up, c0, n, h, t, MOEFUSE_F16);
    }
}

static h_opts make_opts(const mf_row_plan *p, float rs, float es)
{
    h_opts o = {p->limit > 0.0f, p->round_bf16,  p->has_row_scale, p->has_expert_scale,
                p->up_offset != 0.0f, p->limit, rs, es, p->up_offset};
    return o;
}

/* Copy n elements of esz bytes, every second one from src, to dst. */
static void copy_every_other(void *dst, const void *src, int64_t n, size_t esz)
{
    if (esz == 4)
        for (int64_t c = 0; c < n; c++)
            ((uint32_t *)dst)[c] = ((const uint32_t *)src)[2 * c];
    else
        for (int64_t c = 0; c < n; c++)
            ((uint16_t *)dst)[c] = ((const uint16_t *)src)[2 * c];
}

/* The row's gate and up halves. The interleaved order's are copied apart into `apart` (2H
 * values of the row's dtype: the scratch past its first 3H floats), as the input dtype,
 * so the kernels convert them exactly as they convert the other orders' halves. */
static void row_halves(const mf_row_plan *p, const void *x, float *apart, const void **gp,
                       const void **up)
{
    const size_t esz = mf_cpu_elem_size(p->in_dtype);
    const size_t half = (size_t)p->hidden * esz;
    *gp = x;
    *up = x;
    if (!p->activate)
        return;
    if (p->order == MOEFUSE_GATE_INTERLEAVED) {
        char *g = (char *)apart, *u = g + half;
        copy_every_other(g, x, p->hidden, esz);
        copy_every_other(u, (const char *)x + esz, p->hidden, esz);
        *gp = g;
        *up = u;
        return;
    }
    *gp = (const char *)x + (size_t)mf_gate_at(p->order, p->hidden) * esz;
    *up = (const char *)x + (size_t)mf_up_at(p->order, p->hidden) * esz;
}

/*
 * Prefetch of the input a few KiB ahead of channel c0: the hardware prefetchers alone
 * leave part of the DRAM latency exposed on these two interleaved streams. Addresses
 * past a stream's end run into what follows it (the next row's head, or harmless:
 * prefetches do not fault); the heads that nothing runs into, rows.c asks for a row ahead.
 */
#define SIMD_PREFETCH_AHEAD MF_ROW_PREFETCH_AHEAD
static void prefetch_ahead(const mf_row_plan *p, const void *gp, const void *up, int64_t c0,
                           int64_t n)
{
    const int64_t esz = (int64_t)mf_cpu_elem_size(p->in_dtype);
    for (int64_t b = 0; b < n * esz; b += 64) {
        __builtin_prefetch((const char *)gp + c0 * esz + SIMD_PREFETCH_AHEAD + b);
        if (p->activate)
            __builtin_prefetch((const char *)up + c0 * esz + SIMD_PREFETCH_AHEAD + b);
    }
}

/* A factor that is NaN: the row goes to the reference (see the top of this file). */
static bool nan_factor(const mf_row_plan *p, float rs, float es)
{
    return (p->has_row_scale && isnan(rs)) || (p->has_expert_scale && isnan(es));
}

static float amax_finite(const float *h, int64_t n)
{
    vf m = vf_set(0.0f);
    int64_t c = 0;
    for (; c + SIMD_W <= n; c += SIMD_W) {
        const vf v = vf_loadu(h + c);
        m = vf_max(m, vf_zero_unless(finite_lanes(v), vf_abs(v)));
    }
    float amax = vf_hmax(m);
    for (; c < n; c++)
        if (isfinite(h[c])) {
            const float av = fabsf(h[c]);
            amax = av > amax ? av : amax;
        }
    return amax;
}

/* e4m3 codes of a group, any values. */
static void e4m3_span(const float *h, int64_t n, float s, uint8_t *q)
{
    const vf sv = vf_set(s);
    int64_t c = 0;
    for (; c + SIMD_W <= n; c += SIMD_W) {
        const vf v = vf_loadu(h + c);
        store_u8(q + c, e4m3_codes(vf_blend(finite_lanes(v), vf_div(v, sv), v)));
    }
    for (; c < n; c++)
        q[c] = mf_e4m3_code(h[c], s);
}

/*
 * e4m3 codes of a group whose values are all finite: then |h / s| <= 448 (1 + 2^-22)
 * (s is amax / 448 rounded, or larger), where the normal-code rounding already gives
 * 448's code, so neither the NaN nor the saturation case can occur.
 */
SIMD_INLINE vi e4m3_codes_finite(vf f)
{
    const vi u = vf_bits(f);
    const vi ax = vi_and(u, vi_set(0x7FFFFFFF));
    /* normal codes: (ax - 0x3C000000 + 0x7FFFF + bit 20) >> 20, bit 20 of ax being that of
     * ax - 0x3C000000 */
    const vi v = vi_srl(vi_add(vi_sub(ax, vi_set(0x3BF80001)), vi_and(vi_srl(ax, 20), vi_set(1))), 20);
    /* below 2^-6: |f| + 2^14 rounds |f| to a multiple of 2^-9 (that binade's spacing),
     * nearest even, as the reference's integer rounding does (one masked subtraction at the
     * AVX-512 level, which also does the blend) */
    const vi r = vi_sub_where(vi_gt(vi_set(0x3C800000), ax), v,
                              vf_bits(vf_add(vi_as_vf(ax), vf_set(16384.0f))), vi_set(0x46800000));
    return vi_or_and(r, vi_srl(u, 24), vi_set(0x80)); /* the sign */
}

SIMD_INLINE void e4m3_span_finite(const float *h, int64_t n, float s, uint8_t *q)
{
    const vf sv = vf_set(s);
    int64_t c = 0;
    for (; c + 4 * SIMD_W <= n; c += 4 * SIMD_W)
        store_u8x4(q + c, e4m3_codes_finite(vf_div(vf_loadu(h + c), sv)),
                   e4m3_codes_finite(vf_div(vf_loadu(h + c + SIMD_W), sv)),
                   e4m3_codes_finite(vf_div(vf_loadu(h + c + 2 * SIMD_W), sv)),
                   e4m3_codes_finite(vf_div(vf_loadu(h + c + 3 * SIMD_W), sv)));
    for (; c + SIMD_W <= n; c += SIMD_W)
        store_u8(q + c, e4m3_codes_finite(vf_div(vf_loadu(h + c), sv)));
    for (; c < n; c++)
        q[c] = mf_e4m3_code(h[c], s);
}

static void i8_span(const float *h, int64_t n, float s, int8_t *q)
{
    const vf sv = vf_set(s);
    int64_t c = 0;
    for (; c + SIMD_W <= n; c += SIMD_W) {
        const vf v = vf_loadu(h + c);
        store_i8(q + c, i8_codes(vf_blend(finite_lanes(v), vf_div(v, sv), v)));
    }
    for (; c < n; c++)
        q[c] = mf_i8_code(h[c], s);
}

/* A row's groups, for one input dtype and set of options (inlined per combination). */
SIMD_INLINE void quant_row_dt(const mf_row_plan *p, const h_opts *o, const void *gp,
                              const void *up, void *q, float *s, uint8_t *ue, float *scratch,
                              const simd_exp_table *t, moefuse_dtype dt)
{
    const int64_t G = p->group;
    const bool fp8 = p->out_dtype == MOEFUSE_F8_E4M3;
    /* Group g + 1's h is computed between group g's scale and its codes (two buffers), so
     * that the scale's latency (reduction, division) hides behind independent work. */
    float *buf[2] = {scratch, scratch + G};
    prefetch_ahead(p, gp, up, 0, G);
    uint32_t top = h_span_dt(p, o, gp, up, 0, G, buf[0], t, dt);
    for (int64_t g = 0; g < p->groups; g++) {
        const float *h = buf[g & 1];
        const bool finite = top < 0x7F800000u;
        s[g] = mf_group_scale(p, finite ? mf_bits_f32(top) : amax_finite(h, G), &ue[g]);
        if (g + 1 < p->groups) {
            prefetch_ahead(p, gp, up, (g + 1) * G, G);
            top = h_span_dt(p, o, gp, up, (g + 1) * G, G, buf[(g + 1) & 1], t, dt);
        }
        if (!fp8)
            i8_span(h, G, s[g], (int8_t *)q + g * G);
        else if (finite)
            e4m3_span_finite(h, G, s[g], (uint8_t *)q + g * G);
        else
            e4m3_span(h, G, s[g], (uint8_t *)q + g * G);
    }
}

static void SIMD_NAME(quant_row)(const mf_row_plan *p, const void *x, float rs, float es, void *q,
                                 float *s, uint8_t *ue, float *scratch)
{
    if (nan_factor(p, rs, es)) {
        mf_cpu_rows_scalar.quant_row(p, x, rs, es, q, s, ue, scratch);
        return;
    }
    simd_exp_table t;
    simd_exp_table_init(&t);
    const void *gp, *up;
    row_halves(p, x, scratch + 3 * p->hidden, &gp, &up);
    const h_opts o = make_opts(p, rs, es);
    const bool plain = !o.clamp && !o.round_bf16 && !o.has_rs && !o.has_es && !o.has_beta;
    switch (p->in_dtype) {
    case MOEFUSE_BF16:
        if (plain)
            quant_row_dt(p, NULL, gp, up, q, s, ue, scratch, &t, MOEFUSE_BF16);
        else
            quant_row_dt(p, &o, gp, up, q, s, ue, scratch, &t, MOEFUSE_BF16);
        break;
    case MOEFUSE_F32:
        if (plain)
            quant_row_dt(p, NULL, gp, up, q, s, ue, scratch, &t, MOEFUSE_F32);
        else
            quant_row_dt(p, &o, gp, up, q, s, ue, scratch, &t, MOEFUSE_F32);
        break;
    default:
        if (plain)
            quant_row_dt(p, NULL, gp, up, q, s, ue, scratch, &t, MOEFUSE_F16);
        else
            quant_row_dt(p, &o, gp, up, q, s, ue, scratch, &t, MOEFUSE_F16);
        break;
    }
}

/* Channels of act_mul computed per pass: a few KiB of scratch stay in L1. */
#define SIMD_ACT_MUL_SPAN 512

static void SIMD_NAME(act_mul_row)(const mf_row_plan *p, const void *x, float rs, float es,
                                   void *out, float *scratch)
{
    if (nan_factor(p, rs, es)) {
        mf_cpu_rows_scalar.act_mul_row(p, x, rs, es, out, scratch);
        return;
    }
    simd_exp_table t;
    simd_exp_table_init(&t);
    const void *gp, *up;
    row_halves(p, x, scratch + 3 * p->hidden, &gp, &up);
    const h_opts o = make_opts(p, rs, es);
    const int64_t H = p->hidden;
    for (int64_t c0 = 0; c0 < H; c0 += SIMD_ACT_MUL_SPAN) {
        const int64_t n = H - c0 < SIMD_ACT_MUL_SPAN ? H - c0 : SIMD_ACT_MUL_SPAN;
        prefetch_ahead(p, gp, up, c0, n);
        if (p->out_dtype == MOEFUSE_F32) {
            h_span(p, &o, gp, up, c0, n, (float *)out + c0, &t);
            continue;
        }
        h_span(p, &o, gp, up, c0, n, scratch, &t);
        uint16_t *dst = (uint16_t *)out + c0;
        int64_t c = 0;
        for (; c + SIMD_W <= n; c += SIMD_W)
            store_half(dst + c, vf_loadu(scratch + c), p->out_dtype);
        mf_store_row(dst + c, scratch + c, p->out_dtype, n - c);
    }
}

static void SIMD_NAME(dequant_span)(const void *q, bool fp8, float s, int64_t n,
                                    moefuse_dtype out_dtype, void *out)
{
    if (isnan(s)) { /* a NaN code times a NaN scale: the reference's code decides */
        mf_cpu_rows_scalar.dequant_span(q, fp8, s, n, out_dtype, out);
        return;
    }
    const vf sv = vf_set(s);
    int64_t c = 0;
    for (; c + SIMD_W <= n; c += SIMD_W) {
        const vf v = fp8 ? e4m3_values(vi_load_u8((const uint8_t *)q + c))
                         : vi_to_vf(vi_load_i8((const int8_t *)q + c));
        const vf r = vf_mul(v, sv);
        if (out_dtype == MOEFUSE_F32)
            vf_storeu((float *)out + c, r);
        else
            store_half((uint16_t *)out + c, r, out_dtype);
    }
    mf_cpu_rows_scalar.dequant_span((const uint8_t *)q + c, fp8, s, n - c, out_dtype,
                                    (char *)out + c * (int64_t)mf_cpu_elem_size(out_dtype));
}

static void SIMD_NAME(exp_array)(const float *x, float *y, int64_t n)
{
    simd_exp_table t;
    simd_exp_table_init(&t);
    int64_t i = 0;
    for (; i + SIMD_W <= n; i += SIMD_W) {
        const vf v = vf_loadu(x + i);
        vf_storeu(y + i, exp_neg_fast(vf_neg(v), &t));
        for (unsigned edge = vm_bits(exp_edge(v)); edge != 0; edge &= edge - 1) {
            const int64_t l = i + __builtin_ctz(edge);
            y[l] = mf_exp_f32(x[l]);
        }
    }
    for (; i < n; i++)
        y[i] = mf_exp_f32(x[i]);
}

const mf_cpu_row_kernels SIMD_TABLE = {
    SIMD_ISA,           SIMD_ISA_NAME,        SIMD_NAME(quant_row),
    SIMD_NAME(act_mul_row), SIMD_NAME(dequant_span), SIMD_NAME(exp_array),
    SIMD_GEMM_STREAM,   mf_cpu_pack_panel16_avx2,
};
