/*
 * The CPU backend's element access over the number formats of docs/NUMERICS.md, whose
 * conversions are the text every backend compiles (src/numerics/mf_convert.h).
 */
#ifndef MOEFUSE_CPU_NUMERICS_H
#define MOEFUSE_CPU_NUMERICS_H

#include "moefuse.h"
#include "numerics/mf_convert.h" /* the conversions: shared with every backend */

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float mf_ue8m0_value(uint32_t e) { return mf_bits_f32(e << 23); }

/* ------------------------------------------------------- generic element */

static inline float mf_load_elem(const void *p, moefuse_dtype dt)
{
    switch (dt) {
    case MOEFUSE_F32: return *(const float *)p;
    case MOEFUSE_F16: return mf_f16_to_f32(*(const uint16_t *)p);
    case MOEFUSE_BF16: return mf_bf16_to_f32(*(const uint16_t *)p);
    default: return 0.0f;
    }
}

static inline void mf_store_elem(void *p, moefuse_dtype dt, float v)
{
    switch (dt) {
    case MOEFUSE_F32: *(float *)p = v; break;
    case MOEFUSE_F16: *(uint16_t *)p = (uint16_t)mf_f32_to_f16(v); break;
    case MOEFUSE_BF16: *(uint16_t *)p = (uint16_t)mf_f32_to_bf16(v); break;
    default: break;
    }
}

#endif /* MOEFUSE_CPU_NUMERICS_H */
