/*
 * The gated activations of docs/NUMERICS.md ("Gated activation", steps 1 and
 * 2), complete with their NaN bits, and where a gated row keeps its gate and
 * up values: one text for every backend.
 */
#ifndef MOEFUSE_NUMERICS_ACTIVATION_H
#define MOEFUSE_NUMERICS_ACTIVATION_H

#include "mf_erf_tanh.h"
#include "mf_exp.h"
#include "mf_portable.h"

/* moefuse_activation values (moefuse.h) */
#define MF_ACT_SILU 0
#define MF_ACT_GELU 1
#define MF_ACT_GELU_TANH 2
#define MF_ACT_SILU_ALPHA 3

/* moefuse_gate_order values (moefuse.h) */
#define MF_ORDER_GATE_FIRST 0
#define MF_ORDER_UP_FIRST 1
#define MF_ORDER_INTERLEAVED 2

/*
 * Gate value i of a gated row of 2 n values (x's channels, or w1's and b1's rows) lies at
 * mf_gate_at(order, n) + i * mf_gate_step(order), up value i at mf_up_at(order, n) +
 * i * mf_gate_step(order). (Not `half`: a type in OpenCL C.)
 */
MF_FN mf_i64 mf_gate_at(int order, mf_i64 n) { return order == MF_ORDER_UP_FIRST ? n : 0; }

MF_FN mf_i64 mf_up_at(int order, mf_i64 n)
{
    return order == MF_ORDER_UP_FIRST ? 0 : (order == MF_ORDER_INTERLEAVED ? 1 : n);
}

MF_FN mf_i64 mf_gate_step(int order) { return order == MF_ORDER_INTERLEAVED ? 2 : 1; }

/* Comparisons, so that NaN passes through. */
MF_FN float mf_clamp_gate(float g, float limit) { return (g > limit) ? limit : g; }

MF_FN float mf_clamp_up(float u, float limit)
{
    return (u > limit) ? limit : (u < -limit ? -limit : u);
}

/*
 * u + beta after the clamp (the up offset). beta == 0 adds nothing, so u keeps every bit
 * (-0.0 included). beta is finite (the core checks it), so a NaN u is the only NaN: it comes
 * back quieted, as x86 returns it; a GPU's add would give its canonical NaN instead.
 */
MF_FN float mf_add_up_offset(float u, float beta)
{
    if (beta == 0.0f)
        return u;
    return mf_is_nan(u) ? mf_quiet(u) : u + beta;
}

/* The formulas, for g that is not NaN (a NaN result is an invalid operation). */
MF_FN float mf_silu_formula(float g)
{
    const float d = 1.0f + mf_exp_f32(-g);
    return g / d;
}

/* g sigmoid(alpha g), alpha finite and > 0 (gpt-oss: 1.702). */
MF_FN float mf_silu_alpha_formula(float g, float alpha)
{
    const float a = alpha * g;
    const float d = 1.0f + mf_exp_f32(-a);
    return g / d;
}

MF_FN float mf_gelu_formula(float g)
{
    const float t = g * 0.70710678118654752f;
    const float a = 0.5f * g;
    const float b = 1.0f + mf_erf_f32(t);
    return a * b;
}

MF_FN float mf_gelu_tanh_formula(float g)
{
    const float g2 = g * g;
    const float g3 = g2 * g;
    const float c = 0.044715f * g3;
    const float inner = g + c;
    const float th = mf_tanh_f32(0.7978845608028654f * inner);
    const float a = 0.5f * g;
    const float b = 1.0f + th;
    return a * b;
}

/*
 * act(g) with the reference's NaN bits: a NaN g comes back quieted (sign and
 * payload kept); the only invalid operations, at g = -Inf (-Inf / Inf for
 * the silu forms, -Inf * 0 for the gelu forms), give the default NaN. alpha
 * is read by MF_ACT_SILU_ALPHA only.
 */
MF_FN float mf_activate_f32(int act, float alpha, float g)
{
    if (mf_is_nan(g))
        return mf_quiet(g);
    float r;
    if (act == MF_ACT_GELU)
        r = mf_gelu_formula(g);
    else if (act == MF_ACT_GELU_TANH)
        r = mf_gelu_tanh_formula(g);
    else if (act == MF_ACT_SILU_ALPHA)
        r = mf_silu_alpha_formula(g, alpha);
    else
        r = mf_silu_formula(g);
    return mf_is_nan(r) ? mf_bits_f32(MF_DEFAULT_NAN_BITS) : r;
}

#endif /* MOEFUSE_NUMERICS_ACTIVATION_H */
