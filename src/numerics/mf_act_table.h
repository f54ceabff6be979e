/*
 * The gated activation of a bf16 gate by table lookup: one text for every
 * backend's fast kernels (the CPU's vector kernels, CUDA's table kernels).
 *
 * act(g) of a bf16 g depends on its 16 bits only, so a table whose entries
 * are mf_activate_f32 of their gates gives the same bits as evaluating the
 * activation (docs/NUMERICS.md is unchanged), for a load and a few integer
 * operations instead of exp and a division.
 *
 * The table covers the magnitudes [MF_TAB_LO, MF_TAB_LO + MF_TAB_SPAN) of
 * each sign: 2^-25 <= |g| < 2^7, where the gates of real data lie. Any other
 * gate (zero, tiny, huge, Inf, NaN) is a miss, which the kernels compute.
 * Entry j < MF_TAB_SPAN is act(+m) with m = MF_TAB_LO + j; entry
 * MF_TAB_SPAN + j is act(-m). 32 KiB per activation.
 *
 * The tables are keyed by activation alone, so they exist for the
 * activations without a parameter (MF_TAB_ACTS of them); silu_alpha, whose
 * values depend on the call's alpha, has none and is always computed
 * (mf_act_table_has).
 */
#ifndef MOEFUSE_NUMERICS_ACT_TABLE_H
#define MOEFUSE_NUMERICS_ACT_TABLE_H

#include "mf_activation.h"
#include "mf_portable.h"

#define MF_TAB_LO 0x3300u   /* bf16 bits of 2^-25 */
#define MF_TAB_SPAN 0x1000u /* magnitudes per sign: up to 2^7 (0x4300), excluded */
#define MF_TAB_ENTRIES (2u * MF_TAB_SPAN)
#define MF_TAB_BYTES (MF_TAB_ENTRIES * 4u)
#define MF_TAB_ACTS 3 /* silu, gelu, gelu_tanh (MF_ACT_*): one table each */
#define MF_TAB_MISS 0x70000000u

/* Whether activation act has a table (not silu_alpha: its values depend on alpha). */
MF_FN int mf_act_table_has(int act) { return act >= 0 && act < MF_TAB_ACTS; }

/* Entry j of activation act's table (act < MF_TAB_ACTS: no alpha). */
MF_FN float mf_act_table_entry(int act, mf_u32 j)
{
    const mf_u32 sign = j < MF_TAB_SPAN ? 0u : 0x8000u;
    return mf_activate_f32(act, 0.0f, mf_bits_f32((sign | (MF_TAB_LO + j % MF_TAB_SPAN)) << 16));
}

/*
 * Byte offset in the table of the bf16 gate whose f32 bits are x (its 16
 * bits in the high half, the low half 0). d = x - (LO << 16) holds m - LO in
 * bits 16..27 and the sign in bit 31 when the gate is covered, and sets a bit
 * of MF_TAB_MISS otherwise (m < LO borrows, m >= LO + SPAN carries): callers
 * OR every d into *miss and read the table only when no miss bit is set. The
 * offset is (m - LO) * 4 with the sign moved to bit 14 (MF_TAB_SPAN * 4), so
 * it is below MF_TAB_BYTES and a multiple of 4 for every x.
 */
MF_FN mf_u32 mf_act_table_offset(mf_u32 x, mf_u32 *miss)
{
    const mf_u32 d = x - (MF_TAB_LO << 16);
    *miss |= d;
    return ((d >> 14) & 0x3FFCu) | ((d >> 17) & 0x4000u);
}

#endif /* MOEFUSE_NUMERICS_ACT_TABLE_H */
