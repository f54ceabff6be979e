/*
 * The row kernels for AVX-512 F (16 lanes): the lane operations rows_simd.h
 * is written over, then rows_simd.h itself. Only this file's functions use
 * AVX-512 (target pragma); rows_isa.c picks them when the processor has it.
 * mf_exp.h's 32-entry tables fit two registers each: one vpermt2ps per
 * lookup.
 */
#include "cpu/rows_isa.h"

#if defined(MF_CPU_HAVE_X86_SIMD)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#endif

#include <immintrin.h>

#include "numerics/mf_exp.h"

#define SIMD_W 16
#define SIMD_FN static
#define SIMD_ISA MF_CPU_ISA_AVX512
#define SIMD_ISA_NAME "avx512"
#define SIMD_NAME(f) avx512_##f
#define SIMD_TABLE mf_cpu_rows_avx512
/* silu computed, not looked up: the exp table lives in four registers (vpermi2ps), while a
 * 16-lane gather from the 32 KiB activation table costs more than the whole computation
 * (Zen 4: act_quant 25% faster computed) */
#define SIMD_ACT_TABLE 0
/* silu in one pass: 32 registers hold an iteration's chain (rows_simd.h) */
#define SIMD_SILU_ONE_PASS 1
/* groups of 8 rows: AVX512VL's 32 vector registers hold their accumulators
 * (gemm_stream_avx512.c) */
#define SIMD_GEMM_STREAM mf_cpu_gemm_stream_avx512

typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vm;

#define L static inline __attribute__((always_inline))

L vf vf_set(float a) { return _mm512_set1_ps(a); }
L vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
/* the floats at byte offsets off from base (vgatherdps) */
L vf vf_gather(const float *base, vi off) { return _mm512_i32gather_ps(off, base, 1); }
L void vf_storeu(float *p, vf a) { _mm512_storeu_ps(p, a); }
L vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
L vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
L vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
L vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
L vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
L vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* -(a b) + c */
L vf vf_fnms(vf a, vf b, vf c) { return _mm512_fnmsub_ps(a, b, c); } /* -(a b) - c */
L vi vf_bits(vf a) { return _mm512_castps_si512(a); }
L vf vi_as_vf(vi a) { return _mm512_castsi512_ps(a); }
L vf vf_neg(vf a) { return vi_as_vf(_mm512_xor_si512(vf_bits(a), _mm512_set1_epi32((int32_t)0x80000000u))); }
L vf vf_abs(vf a) { return vi_as_vf(_mm512_and_si512(vf_bits(a), _mm512_set1_epi32(0x7FFFFFFF))); }
L vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); } /* no NaN reaches it */
L vf vf_round_even(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
L vi vf_to_vi(vf a) { return _mm512_cvtps_epi32(a); } /* integral values only */
L vf vi_to_vf(vi a) { return _mm512_cvtepi32_ps(a); }

L vi vi_set(int32_t a) { return _mm512_set1_epi32(a); }
L vi vi_load_u16(const uint16_t *p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
L vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
L vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
L vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
L vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
L vi vi_max(vi a, vi b) { return _mm512_max_epi32(a, b); } /* signed */
#define vi_sll(a, n) _mm512_slli_epi32((a), (n))
#define vi_srl(a, n) _mm512_srli_epi32((a), (n))

L vm vm_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
L vm vm_lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
L vm vm_not_lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ); } /* NaN: true */
L vm vm_unordered(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
L vm vi_gt(vi a, vi b) { return _mm512_cmpgt_epi32_mask(a, b); } /* signed */
L vm vi_eq(vi a, vi b) { return _mm512_cmpeq_epi32_mask(a, b); }
L unsigned vm_bits(vm m) { return (unsigned)m; }
L vf vf_blend(vm m, vf t, vf f) { return _mm512_mask_blend_ps(m, f, t); }
L vi vi_blend(vm m, vi t, vi f) { return _mm512_mask_blend_epi32(m, f, t); }
L vf vf_zero_unless(vm m, vf a) { return _mm512_maskz_mov_ps(m, a); }
/* a | (b & c), one vpternlogd */
L vi vi_or_and(vi a, vi b, vi c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }
/* b - c in the lanes of m, a elsewhere: one masked vpsubd */
L vi vi_sub_where(vm m, vi a, vi b, vi c) { return _mm512_mask_sub_epi32(a, m, b, c); }

L float vf_hmax(vf a) { return _mm512_reduce_max_ps(a); }
L int32_t vi_hmax(vi a) { return _mm512_reduce_max_epi32(a); }

/* 16 codes (0..255, or -127..127 as two's complement) as bytes: vpmovdb keeps the low byte */
L void store_u8(uint8_t *p, vi c) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(c)); }
L void store_i8(int8_t *p, vi c) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(c)); }

L void store_u8x4(uint8_t *p, vi a, vi b, vi c, vi d)
{
    store_u8(p, a);
    store_u8(p + 16, b);
    store_u8(p + 32, c);
    store_u8(p + 48, d);
}

/* 16 values 0..65535 as 16-bit words */
L void store_u16(uint16_t *p, vi a) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(a)); }

/* 16 bytes, zero- or sign-extended */
L vi vi_load_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
L vi vi_load_i8(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* mf_exp.h's 32 (hi, lo) pairs as two registers per half */
typedef struct {
    vf hi[2], lo[2];
} simd_exp_table;

L void simd_exp_table_init(simd_exp_table *t)
{
    float hi[32], lo[32];
    for (int j = 0; j < 32; j++) {
        hi[j] = MF_EXP_TABLE[2 * j];
        lo[j] = MF_EXP_TABLE[2 * j + 1];
    }
    t->hi[0] = _mm512_loadu_ps(hi);
    t->hi[1] = _mm512_loadu_ps(hi + 16);
    t->lo[0] = _mm512_loadu_ps(lo);
    t->lo[1] = _mm512_loadu_ps(lo + 16);
}

/* entries of j = kb & 31 per lane: vpermt2ps reads the index's low five bits */
L void simd_exp_lookup(const simd_exp_table *t, vi kb, vf *hi, vf *lo)
{
    *hi = _mm512_permutex2var_ps(t->hi[0], kb, t->hi[1]);
    *lo = _mm512_permutex2var_ps(t->lo[0], kb, t->lo[1]);
}

#undef L

#include "cpu/rows_simd.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif /* MF_CPU_HAVE_X86_SIMD */
