/* Clamp and gated activations of docs/NUMERICS.md, in f32, in the documented order. */
#ifndef MOEFUSE_CPU_ACTIVATION_H
#define MOEFUSE_CPU_ACTIVATION_H

#include "moefuse.h"

#include <math.h>

/* Comparisons, so that NaN passes through. */
static inline float mf_clamp_gate(float g, float limit) { return (g > limit) ? limit : g; }

static inline float mf_clamp_up(float u, float limit)
{
    return (u > limit) ? limit : (u < -limit ? -limit : u);
}

static inline float mf_activate(moefuse_activation act, float g)
{
    switch (act) {
    case MOEFUSE_ACT_GELU: {
        float t = g * 0.70710678118654752f;
        float a = 0.5f * g;
        float b = 1.0f + erff(t);
        return a * b;
    }
    case MOEFUSE_ACT_GELU_TANH: {
        float g2 = g * g;
        float g3 = g2 * g;
        float c = 0.044715f * g3;
        float inner = g + c;
        float t = tanhf(0.7978845608028654f * inner);
        float a = 0.5f * g;
        float b = 1.0f + t;
        return a * b;
    }
    case MOEFUSE_ACT_SILU:
    default: {
        float d = 1.0f + expf(-g);
        return g / d;
    }
    }
}

#endif /* MOEFUSE_CPU_ACTIVATION_H */
