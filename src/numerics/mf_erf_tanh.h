/* PLACEHOLDER until the own erf/tanh land: NOT the contract (uses the C library). */
#ifndef MOEFUSE_NUMERICS_ERF_TANH_H
#define MOEFUSE_NUMERICS_ERF_TANH_H
#include "mf_exp.h"
#if defined(__OPENCL_VERSION__)
MF_FN float mf_erf_f32(float t) { return fabs(t) > 3.9193f ? copysign(1.0f, t) : erf(t); }
MF_FN float mf_tanh_f32(float z) { return fabs(z) > 9.0110f ? copysign(1.0f, z) : tanh(z); }
#else
MF_FN float mf_erf_f32(float t) { return fabsf(t) > 3.9193f ? copysignf(1.0f, t) : erff(t); }
MF_FN float mf_tanh_f32(float z) { return fabsf(z) > 9.0110f ? copysignf(1.0f, z) : tanhf(z); }
#endif
#endif
