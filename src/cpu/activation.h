/*
 * Clamp and gated activations of docs/NUMERICS.md for the CPU backend: the
 * library's own definition (src/numerics/mf_activation.h), the text every
 * backend runs, with its own exp, erf and tanh (never the C library's).
 */
#ifndef MOEFUSE_CPU_ACTIVATION_H
#define MOEFUSE_CPU_ACTIVATION_H

#include "moefuse.h"
#include "numerics/mf_activation.h"

static inline float mf_activate(moefuse_activation act, float alpha, float g)
{
    return mf_activate_f32((int)act, alpha, g);
}

#endif /* MOEFUSE_CPU_ACTIVATION_H */
