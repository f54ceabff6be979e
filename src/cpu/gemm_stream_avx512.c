/*
 * The weight-stream GEMM tile of the AVX-512 level: the same eight-wide text (gemm_stream_x86.h)
 * with AVX512VL's 32 vector registers, which hold the accumulators of 8 rows where AVX2's 16
 * hold 4. A tile of 5 to 8 rows (Mixtral at M = 32: 8 slots an expert) then streams its
 * weights instead of packing them for the packed GEMM. Tiles of more rows go over a panel,
 * which this level transposes and multiplies 16 columns wide (GS_ZMM).
 */
#include "cpu/gemm.h"
#include "cpu/rows_isa.h"

#if defined(MF_CPU_HAVE_X86_SIMD)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx2,fma"))),           \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx2,fma")
#endif

#define GS_FN mf_cpu_gemm_stream_avx512
#define GS_MS 8
#define GS_ZMM 1 /* the panel transposed and multiplied in 512-bit registers */
#include "cpu/gemm_stream_x86.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif /* MF_CPU_HAVE_X86_SIMD */
