/*
 * The gated activation of a bf16 gate by table lookup (rows.cu's hot kernels).
 *
 * act(g) of a bf16 g depends on its 16 bits only, so a table of the exact
 * values, each computed once by the shared text (mf_activate_f32), gives the
 * same bits as evaluating exp and a division per element, for a load and a
 * few integer operations instead of about twenty floating-point ones.
 *
 * The table covers the magnitudes [MF_TAB_LO, MF_TAB_LO + MF_TAB_SPAN) of
 * each sign: 2^-25 <= |g| < 2^7, where the gates of real data lie. Any other
 * gate (zero, tiny, huge, Inf, NaN) is a miss, and its 8 channels take the
 * computed path, which gives the same bits. test_cross_backend runs every
 * bf16 gate through both.
 *
 * Entry i < MF_TAB_SPAN is act(+m) with m = MF_TAB_LO + i; entry
 * MF_TAB_SPAN + i is act(-m). The lookup is also host C, so that
 * tools/check_numerics.c can check the offsets and misses for every gate.
 */
#ifndef MOEFUSE_CUDA_ACT_TABLE_CUH
#define MOEFUSE_CUDA_ACT_TABLE_CUH

#include "cuda/numerics.cuh"

#define MF_TAB_LO 0x3300u   /* bf16 bits of 2^-25 */
#define MF_TAB_SPAN 0x1000u /* magnitudes per sign: up to 2^7 (0x4300), excluded */
#define MF_TAB_ENTRIES (2u * MF_TAB_SPAN)
#define MF_TAB_BYTES (MF_TAB_ENTRIES * 4u)
#define MF_TAB_ACTS 3 /* silu, gelu, gelu_tanh: one table each */

/* The value of entry j of activation act's table. */
MF_HD float mf_tab_entry(int act, uint32_t j)
{
    const uint32_t sign = j < MF_TAB_SPAN ? 0u : 0x8000u;
    return mf_activate_f32(act, mf_bf16_to_f32(sign | (MF_TAB_LO + j % MF_TAB_SPAN)));
}

#if defined(__CUDACC__)
/* Fills tables[act * MF_TAB_ENTRIES + j] for every activation (grid-stride). */
__global__ void mf_k_build_act_tables(float *tables)
{
    const uint32_t n = MF_TAB_ACTS * MF_TAB_ENTRIES;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        tables[i] = mf_tab_entry((int)(i / MF_TAB_ENTRIES), i % MF_TAB_ENTRIES);
}
#endif

/*
 * Byte offset in the table of the bf16 gate held in the high half of x (the
 * low half 0). d = x - LO << 16 has (m - LO) in bits 16..27 and the sign in
 * bit 31 when the gate is covered, and a bit of 28..30 set otherwise (m < LO
 * borrows, m >= LO + SPAN carries): the caller ORs every d into *miss and
 * tests MF_TAB_MISS before it reads the table. The offset is (m - LO) * 4
 * with the sign moved to bit 14 (MF_TAB_SPAN * 4): one lop3.
 */
#define MF_TAB_MISS 0x70000000u

MF_HD uint32_t mf_tab_offset(uint32_t x, uint32_t *miss)
{
    const uint32_t d = x - (MF_TAB_LO << 16);
    *miss |= d;
    return ((d >> 14) & 0x3FFFu) | ((d >> 17) & ~0x3FFFu);
}

/*
 * h = act(g) * u of the 8 channels whose bf16 gates are the words gw (channel
 * 2i in the low half of gw[i]); tab is the table in shared memory. Returns 0,
 * with h untouched, when a gate is not covered.
 */
MF_HD int mf_act8_table(const float *tab, const uint32_t gw[4], const float u[8], float h[8])
{
    uint32_t miss = 0u, off[8];
    for (int i = 0; i < 4; i++) {
        off[2 * i] = mf_tab_offset(gw[i] << 16, &miss);
        off[2 * i + 1] = mf_tab_offset(gw[i] & 0xFFFF0000u, &miss);
    }
    if (miss & MF_TAB_MISS)
        return 0;
    for (int i = 0; i < 8; i++)
        h[i] = *(const float *)((const char *)tab + off[i]) * u[i];
    return 1;
}

#endif /* MOEFUSE_CUDA_ACT_TABLE_CUH */
