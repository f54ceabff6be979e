/*
 * The row kernels' h values (rows.cu): a row's factors, the activation of a gate and up
 * pair, and the loads of x's elements.
 */
#ifndef MOEFUSE_CUDA_ROWS_VALUES_CUH
#define MOEFUSE_CUDA_ROWS_VALUES_CUH

#include "cuda/rows.cuh"

/* ------------------------------------------------------------- h values */

/* Factors of row (e, t): row_scale and expert_scale, 1 when absent. */
static __device__ __forceinline__ void row_factors(const rows_params &p, int64_t e, int64_t t,
                                                   float *rs, float *es)
{
    *rs = p.has_rs ? *(const float *)(p.rs + (e * p.rss0 + t * p.rss1) * 4) : 1.0f;
    *es = 1.0f;
    if (p.has_es) {
        const char *a = p.es + e * p.ess0 * (p.esdt == MF_DT_F32 ? 4 : 2);
        *es = p.esdt == MF_DT_F32 ? *(const float *)a : mf_bf16_to_f32(*(const uint16_t *)a);
    }
}

/*
 * h of 8 channels in place of g: the NUMERICS.md steps in the CPU's order,
 * with the GPU's NaN bits (a NaN result is redone by h_exact). Each option is
 * one uniform branch around a loop, so the 8 channels stay independent;
 * `plain` (a constant in the kernels for silu without options) drops them.
 */
/* silu of the inputs the fast path does not take: out of line, so the compiler shares (and
 * keeps in registers) nothing between the two paths. */
static __device__ __noinline__ float silu_slow(float g)
{
    return mf_silu_formula(g);
}

static __device__ __forceinline__ void act8(const rows_params &p, int act, int plain,
                                            const float *tab, float g[8], float u[8], float rs,
                                            float es)
{
    if (!plain && p.limit > 0.0f) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            g[i] = mf_clamp_gate(g[i], p.limit);
            u[i] = mf_clamp_up(u[i], p.limit);
        }
    }
    if (!plain && p.beta != 0.0f) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            u[i] = mf_add_up_offset(u[i], p.beta);
    }
    if (act == MF_ACT_SILU) {
        /* branch-free for |g| < 64; the others (rare) take the reference path afterwards */
        const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(tab);
        float r[8];
        int ok = 1;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            ok &= mf_silu_fast_ok(g[i]);
            r[i] = mf_silu_fast(g[i], tabs);
        }
        if (!ok) {
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (!mf_silu_fast_ok(g[i]))
                    r[i] = silu_slow(g[i]);
        }
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = r[i];
    } else if (act == MF_ACT_GELU) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_gelu_formula(g[i]);
    } else if (act == MF_ACT_SILU_ALPHA) { /* (a NaN h is redone by h_exact) */
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_silu_alpha_formula(g[i], p.alpha);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_gelu_tanh_formula(g[i]);
    }
    if (!plain && p.round_bf16) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_round_bf16(g[i]);
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        g[i] = g[i] * u[i];
    if (!plain && p.has_rs) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = g[i] * rs;
    }
    if (!plain && p.has_es) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = g[i] * es;
    }
    if (!plain && p.round_bf16) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_round_bf16(g[i]);
    }
}

/* What h_exact needs, passed by value: a reference to the kernel's parameters would put them
 * in local memory (a stack frame) for the out-of-line call. */
typedef struct act_opts {
    const char *xrow;
    int64_t goff, uoff, cstep;
    float limit, rs, es, alpha, beta;
    int xdt, act, activate, round_bf16, has_rs, has_es;
} act_opts;

static __device__ __forceinline__ act_opts make_opts(const rows_params &p, const char *xrow,
                                                     float rs, float es)
{
    act_opts o;
    o.xrow = xrow;
    o.goff = p.goff;
    o.uoff = p.uoff;
    o.cstep = p.cstep;
    o.limit = p.limit;
    o.alpha = p.alpha;
    o.beta = p.beta;
    o.rs = rs;
    o.es = es;
    o.xdt = p.xdt;
    o.act = p.act;
    o.activate = p.activate;
    o.round_bf16 = p.round_bf16;
    o.has_rs = p.has_rs;
    o.has_es = p.has_es;
    return o;
}

/* h of channel c with the CPU's (x86) NaN bits, from memory: the rare NaN path. */
static __device__ __noinline__ float h_exact(act_opts o, int64_t c)
{
    if (!o.activate)
        return load_elem(o.xrow, c, o.xdt);
    float g = load_elem(o.xrow, o.goff + c * o.cstep, o.xdt);
    float u = load_elem(o.xrow, o.uoff + c * o.cstep, o.xdt);
    if (o.limit > 0.0f) {
        g = mf_clamp_gate(g, o.limit);
        u = mf_clamp_up(u, o.limit);
    }
    u = mf_add_up_offset(u, o.beta);
    float a = mf_activate_f32(o.act, o.alpha, g);
    if (o.round_bf16)
        a = mf_round_bf16(a);
    float h = mf_mul(a, u);
    if (o.has_rs)
        h = mf_mul(h, o.rs);
    if (o.has_es)
        h = mf_mul(h, o.es);
    if (o.round_bf16)
        h = mf_round_bf16(h);
    return h;
}

/* h of one channel (the block-per-row kernel): fast path, exact NaN bits. */
static __device__ __forceinline__ float h_one(const rows_params &p, const float *tab,
                                              const char *xrow, int64_t c, float rs, float es)
{
    float v[8], u[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = u[i] = 0.0f;
    if (!p.activate) {
        v[0] = load_elem(xrow, c, p.xdt);
        return v[0];
    }
    v[0] = load_elem(xrow, p.goff + c * p.cstep, p.xdt);
    u[0] = load_elem(xrow, p.uoff + c * p.cstep, p.xdt);
    act8(p, p.act, 0, tab, v, u, rs, es); /* the other 7 lanes of the arrays are dead code */
    return mf_is_nan(v[0]) ? h_exact(make_opts(p, xrow, rs, es), c) : v[0];
}

/*
 * Gate (off = goff) or up (off = uoff) values c0 .. c0 + n - 1 of a row, for the direct
 * kernels: load8's vectors for consecutive values, one element at a time for the interleaved
 * order's every second channel (a uniform branch).
 */
static __device__ __forceinline__ void load8_values(const rows_params &p, const char *xrow,
                                                    int64_t off, int64_t c0, int xdt, int n,
                                                    float v[8])
{
    if (p.cstep == 1) {
        load8(xrow + off * p.xes, c0, xdt, p.vec_x, n, v);
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = i < n ? load_elem(xrow, off + (c0 + i) * p.cstep, xdt) : 0.0f;
}


#endif /* MOEFUSE_CUDA_ROWS_VALUES_CUH */
