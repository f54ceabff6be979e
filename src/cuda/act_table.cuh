/*
 * The CUDA side of the activation tables (src/numerics/mf_act_table.h): the
 * kernel that fills them at context creation, and the lookup of 8 channels
 * for rows.cu's table kernels. Also host C, so that tools/check_numerics.c
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
 * h = act(g) * u of the 8 channels whose bf16 gates are the words gw (channel
 * 2i in the low half of gw[i]); tab is the table in shared memory. Returns 0,
 * with h untouched, when a gate is not covered.
 */
MF_HD int mf_act8_table(const float *tab, const uint32_t gw[4], const float u[8], float h[8])
{
    uint32_t miss = 0u, off[8];
    for (int i = 0; i < 4; i++) {
        off[2 * i] = mf_act_table_offset(gw[i] << 16, &miss);
        off[2 * i + 1] = mf_act_table_offset(gw[i] & 0xFFFF0000u, &miss);
    }
    if (miss & MF_TAB_MISS)
        return 0;
    for (int i = 0; i < 8; i++)
        h[i] = *(const float *)((const char *)tab + off[i]) * u[i];
    return 1;
}

#endif /* MOEFUSE_CUDA_ACT_TABLE_CUH */
