/*
 * The gated activations of docs/NUMERICS.md ("Gated activation", step 2),
 * complete with their NaN bits: one text for every backend.
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

/* Comparisons, so that NaN passes through. */
MF_FN float mf_clamp_gate(float g, float limit) { return (g > limit) ? limit : g; }

MF_FN float mf_clamp_up(float u, float limit)
{
    return (u > limit) ? limit : (u < -limit ? -limit : u);
}

/* The formulas, for g that is not NaN (a NaN result is an invalid operation). */
MF_FN float mf_silu_formula(float g)
{
    const float d = 1.0f + mf_exp_f32(-g);
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
 * silu, -Inf * 0 for the gelu forms), give the default NaN.
 */
MF_FN float mf_activate_f32(int act, float g)
{
    if (mf_is_nan(g))
        return mf_quiet(g);
    float r;
    if (act == MF_ACT_GELU)
        r = mf_gelu_formula(g);
    else if (act == MF_ACT_GELU_TANH)
        r = mf_gelu_tanh_formula(g);
    else
        r = mf_silu_formula(g);
    return mf_is_nan(r) ? mf_bits_f32(MF_DEFAULT_NAN_BITS) : r;
}

#endif /* MOEFUSE_NUMERICS_ACTIVATION_H */
