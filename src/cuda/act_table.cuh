/*
 * The CUDA side of the activation tables (src/numerics/mf_act_table.h): the
 * kernel that fills them at context creation, their layout in shared memory
 * (two halves 128 KiB apart) and the lookup of 8 channels for rows.cu's
 * table kernels. Also host C, so that tools/check_numerics.c
 * can check the lookup for every gate.
 */
#ifndef MOEFUSE_CUDA_ACT_TABLE_CUH
#define MOEFUSE_CUDA_ACT_TABLE_CUH

#include "cuda/numerics.cuh"
#include "numerics/mf_act_table.h"

#if defined(__CUDACC__)
/* Fills tables[act * MF_TAB_ENTRIES + j] for every activation (grid-stride). */
__global__ void mf_k_build_act_tables(float *tables)
{
    const uint32_t n = MF_TAB_ACTS * MF_TAB_ENTRIES;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        tables[i] = mf_act_table_entry((int)(i / MF_TAB_ENTRIES), i % MF_TAB_ENTRIES);
}
#endif

/*
 * The table's layout in shared memory: the positive half (16 KiB) at byte 0
 * and the negative half at MF_TAB_NEG, so that the byte offset of a covered
 * gate is a shift and a mask of its d (mf_act_table_offset's): bits 16..27
 * of d (m - LO) land at 2..13, the sign (bit 31) at 17. The 112 KiB between
 * the halves hold the kernels' staging rings.
 */
#define MF_TAB_NEG 0x20000u
#define MF_TAB_SMEM_SPAN (MF_TAB_NEG + MF_TAB_SPAN * 4u) /* first entry to past the last */

/* Byte offset of entry j (mf_act_table_entry's numbering) in the shared layout. */
MF_HD uint32_t mf_tab_smem_offset(uint32_t j)
{
    return j < MF_TAB_SPAN ? j * 4u : MF_TAB_NEG + (j - MF_TAB_SPAN) * 4u;
}

/* Byte offset of a gate with d = x - (MF_TAB_LO << 16) (x: its f32 bits), when covered. */
MF_HD uint32_t mf_tab_smem_at(uint32_t d) { return (d >> 14) & (MF_TAB_NEG | 0x3FFCu); }

/*
 * Byte offsets in the shared layout of the 8 bf16 gates in the words gw
 * (channel 2i in the low half of gw[i]); returns nonzero when a gate is not
 * covered, and the offsets are then meaningless: read the table only on 0.
 * The low half's d has its own low 16 bits 0, so its shift needs no mask
 * once no miss bit is set; the high half's word never borrows from the low.
 */
MF_HD uint32_t mf_tab_offsets8(const uint32_t gw[4], uint32_t off[8])
{
    uint32_t miss = 0u;
    for (int i = 0; i < 4; i++) {
        const uint32_t dl = (gw[i] << 16) - (MF_TAB_LO << 16);
        const uint32_t dh = gw[i] - (MF_TAB_LO << 16);
        miss |= dl | dh;
        off[2 * i] = dl >> 14;
        off[2 * i + 1] = mf_tab_smem_at(dh);
    }
    return miss & MF_TAB_MISS;
}

/*
 * h = act(g) * u of the 8 channels whose bf16 gates are the words gw; tab is
 * the table in the shared layout. Returns 0, with h untouched, when a gate is
 * not covered.
 */
MF_HD int mf_act8_table(const char *tab, const uint32_t gw[4], const float u[8], float h[8])
{
    uint32_t off[8];
    if (mf_tab_offsets8(gw, off))
        return 0;
    for (int i = 0; i < 8; i++)
        h[i] = *(const float *)(tab + off[i]) * u[i];
    return 1;
}

#endif /* MOEFUSE_CUDA_ACT_TABLE_CUH */
