/*
 * One group scale of a scales tensor in any of moefuse_scale_layout's layouts (normalised to
 * rank 3 [E or 1, ...] as mf_check_scales returns it), read as its f32 value or written from
 * one. Exponent bytes (u8 and the packed words) read as mf_ue8m0_read does; written from a
 * power of two (or NaN) as the byte that reads back to it, the only values UE8M0 scales take.
 */
#ifndef MOEFUSE_CPU_SCALES_H
#define MOEFUSE_CPU_SCALES_H

#include "cpu/numerics.h"
#include "cpu/tensor_cpu.h"

#include <math.h>
#include <string.h>

static inline unsigned char *mf_scale_at(const moefuse_tensor *s, moefuse_scale_layout layout,
                                            int64_t e, int64_t t, int64_t g)
{
    switch (layout) {
    case MOEFUSE_SCALE_ROW_MAJOR:
        return (unsigned char *)mf_at3(s, e, t, g);
    case MOEFUSE_SCALE_COLUMN_MAJOR:
        return (unsigned char *)mf_at3(s, e, g, t);
    default: /* PACKED_UE8M0: byte g % 4 (little-endian) of word (g / 4, t) */
        return (unsigned char *)mf_at3(s, e, g / 4, t) + g % 4;
    }
}

static inline float mf_scale_read(const moefuse_tensor *s, moefuse_scale_layout layout,
                                     int64_t e, int64_t t, int64_t g)
{
    const unsigned char *p = mf_scale_at(s, layout, e, t, g);
    if (s->dtype == MOEFUSE_F32) {
        float v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    return mf_ue8m0_read(*p); /* u8, or a byte of a packed word */
}

static inline void mf_scale_write(const moefuse_tensor *s, moefuse_scale_layout layout,
                                     int64_t e, int64_t t, int64_t g, float v)
{
    unsigned char *p = mf_scale_at(s, layout, e, t, g);
    if (s->dtype == MOEFUSE_F32) {
        memcpy(p, &v, sizeof v);
        return;
    }
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    *p = isnan(v) ? 255 : bits == 0x00400000u ? 0 : (unsigned char)(bits >> 23);
}

#endif
