/*
 * Which row kernels run: the widest level this build has and this processor
 * supports, chosen on first use; MOEFUSE_CPU_ISA=scalar|avx2|avx512 asks for
 * a level (a level the machine lacks gives the best one below it), and
 * mf_cpu_isa_force switches levels for tests.
 */
#include "cpu/rows_isa.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(MF_CPU_HAVE_X86_SIMD)
extern const mf_cpu_row_kernels mf_cpu_rows_avx2;
extern const mf_cpu_row_kernels mf_cpu_rows_avx512;
#endif

static const char *const isa_names[MF_CPU_ISA_COUNT] = {"scalar", "avx2", "avx512"};

const char *mf_cpu_isa_name(mf_cpu_isa isa)
{
    return (unsigned)isa < MF_CPU_ISA_COUNT ? isa_names[isa] : "unknown";
}

const mf_cpu_row_kernels *mf_cpu_row_kernels_of(mf_cpu_isa isa)
{
    switch (isa) {
    case MF_CPU_ISA_SCALAR: return &mf_cpu_rows_scalar;
#if defined(MF_CPU_HAVE_X86_SIMD)
    case MF_CPU_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &mf_cpu_rows_avx2
                                                                               : NULL;
    case MF_CPU_ISA_AVX512:
        __builtin_cpu_init();
        /* VL too: the level's stream tile uses AVX-512's 32 registers at 256 bits */
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
                   ? &mf_cpu_rows_avx512
                   : NULL;
#endif
    default: return NULL;
    }
}

/* The best level at or below want. */
static const mf_cpu_row_kernels *best_up_to(mf_cpu_isa want)
{
    for (int i = (int)want; i > 0; i--) {
        const mf_cpu_row_kernels *k = mf_cpu_row_kernels_of((mf_cpu_isa)i);
        if (k != NULL)
            return k;
    }
    return &mf_cpu_rows_scalar;
}

static const mf_cpu_row_kernels *choose(void)
{
    const char *env = getenv("MOEFUSE_CPU_ISA");
    if (env != NULL && *env != '\0')
        for (int i = 0; i < MF_CPU_ISA_COUNT; i++)
            if (strcmp(env, isa_names[i]) == 0)
                return best_up_to((mf_cpu_isa)i);
    return best_up_to((mf_cpu_isa)(MF_CPU_ISA_COUNT - 1));
}

/* Every thread that races to the first choice computes the same answer. */
static _Atomic(const mf_cpu_row_kernels *) chosen;

const mf_cpu_row_kernels *mf_cpu_row_kernels_active(void)
{
    const mf_cpu_row_kernels *k = atomic_load(&chosen);
    if (k == NULL) {
        k = choose();
        atomic_store(&chosen, k);
    }
    return k;
}

bool mf_cpu_isa_force(mf_cpu_isa isa)
{
    const mf_cpu_row_kernels *k = mf_cpu_row_kernels_of(isa);
    if (k == NULL)
        return false;
    atomic_store(&chosen, k);
    return true;
}
