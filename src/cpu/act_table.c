/*
 * The activation tables of the vector row kernels (src/numerics/mf_act_table.h),
 * built once per process on first use: entries are mf_activate_f32 of their
 * gates, so every thread and context reads the same constant bits.
 */
#include "cpu/rows_isa.h"
#include "numerics/mf_act_table.h"

#include <pthread.h>

static float tables[MF_TAB_ACTS][MF_TAB_ENTRIES];
static pthread_once_t built = PTHREAD_ONCE_INIT;

static void build(void)
{
    for (int act = 0; act < MF_TAB_ACTS; act++)
        for (uint32_t j = 0; j < MF_TAB_ENTRIES; j++)
            tables[act][j] = mf_act_table_entry(act, j);
}

const float *mf_cpu_act_table(int activation)
{
    if (!mf_act_table_has(activation))
        return NULL; /* silu_alpha: its values depend on the call's alpha */
    pthread_once(&built, build);
    return tables[activation];
}
