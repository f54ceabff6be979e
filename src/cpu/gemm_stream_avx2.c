/* The weight-stream GEMM tile of the AVX2 level: 4 rows (gemm_stream_x86.h). */
#include "cpu/gemm.h"
#include "cpu/rows_isa.h"

#if defined(MF_CPU_HAVE_X86_SIMD)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#define GS_FN mf_cpu_gemm_stream_avx2
#define GS_MS 4
#define GS_PACK_FN mf_cpu_pack_panel16_avx2 /* the AVX-512 level's too: the same text */
#include "cpu/gemm_stream_x86.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif /* MF_CPU_HAVE_X86_SIMD */
