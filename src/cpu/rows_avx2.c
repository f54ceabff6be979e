/*
 * The row kernels for AVX2 + FMA (8 lanes): the lane operations rows_simd.h
 * is written over, then rows_simd.h itself. Only this file's functions use
 * AVX2 (target pragma), so the library runs on any x86-64; rows_isa.c picks
 * them when the processor has AVX2 and FMA.
 */
#include "cpu/rows_isa.h"

#if defined(MF_CPU_HAVE_X86_SIMD)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#include <immintrin.h>
#include <string.h>

#include "numerics/mf_exp.h"

#define SIMD_W 8
#define SIMD_FN static
#define SIMD_ISA MF_CPU_ISA_AVX2
#define SIMD_ISA_NAME "avx2"
#define SIMD_NAME(f) avx2_##f
#define SIMD_TABLE mf_cpu_rows_avx2
/* silu looked up: the 8-lane gather beats the computation, whose exp table needs gathers
 * too at this width (Zen 4: act_quant 24% slower computed) */
#define SIMD_ACT_TABLE 1

typedef __m256 vf;
typedef __m256i vi;
typedef __m256 vm; /* all-ones lanes */

#define L static inline __attribute__((always_inline))

L vf vf_set(float a) { return _mm256_set1_ps(a); }
L vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
/*
 * The floats at byte offsets off from base: offsets out by vmovq / vpextrq, one vmovss or
 * vinsertps per lane. On Zen 3 this is faster than vgatherdps (microcoded there).
 */
L vf vf_gather(const float *base, vi off)
{
    const char *b = (const char *)base;
    const __m128i o03 = _mm256_castsi256_si128(off), o47 = _mm256_extracti128_si256(off, 1);
    const uint64_t a = (uint64_t)_mm_cvtsi128_si64(o03), c = (uint64_t)_mm_extract_epi64(o03, 1);
    const uint64_t d = (uint64_t)_mm_cvtsi128_si64(o47), e = (uint64_t)_mm_extract_epi64(o47, 1);
    __m128 x = _mm_load_ss((const float *)(b + (uint32_t)a));
    x = _mm_insert_ps(x, _mm_load_ss((const float *)(b + (a >> 32))), 0x10);
    x = _mm_insert_ps(x, _mm_load_ss((const float *)(b + (uint32_t)c)), 0x20);
    x = _mm_insert_ps(x, _mm_load_ss((const float *)(b + (c >> 32))), 0x30);
    __m128 y = _mm_load_ss((const float *)(b + (uint32_t)d));
    y = _mm_insert_ps(y, _mm_load_ss((const float *)(b + (d >> 32))), 0x10);
    y = _mm_insert_ps(y, _mm_load_ss((const float *)(b + (uint32_t)e)), 0x20);
    y = _mm_insert_ps(y, _mm_load_ss((const float *)(b + (e >> 32))), 0x30);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(x), y, 1);
}
L void vf_storeu(float *p, vf a) { _mm256_storeu_ps(p, a); }
L vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
L vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
L vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
L vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
L vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
L vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); } /* -(a b) + c */
L vf vf_fnms(vf a, vf b, vf c) { return _mm256_fnmsub_ps(a, b, c); } /* -(a b) - c */
L vf vf_neg(vf a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
L vf vf_abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
L vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); } /* no NaN reaches it */
L vf vf_round_even(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
L vi vf_to_vi(vf a) { return _mm256_cvtps_epi32(a); } /* integral values only */
L vf vi_to_vf(vi a) { return _mm256_cvtepi32_ps(a); }
L vi vf_bits(vf a) { return _mm256_castps_si256(a); }
L vf vi_as_vf(vi a) { return _mm256_castsi256_ps(a); }

L vi vi_set(int32_t a) { return _mm256_set1_epi32(a); }
L vi vi_load_u16(const uint16_t *p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)); }
L vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
L vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
L vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
L vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
L vi vi_max(vi a, vi b) { return _mm256_max_epi32(a, b); } /* signed */
#define vi_sll(a, n) _mm256_slli_epi32((a), (n))
#define vi_srl(a, n) _mm256_srli_epi32((a), (n))

L vm vm_gt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
L vm vm_lt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
L vm vm_not_lt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_NLT_UQ); } /* NaN: true */
L vm vm_unordered(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }
L vm vi_gt(vi a, vi b) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b)); } /* signed */
L vm vi_eq(vi a, vi b) { return _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)); }
L unsigned vm_bits(vm m) { return (unsigned)_mm256_movemask_ps(m); }
L vf vf_blend(vm m, vf t, vf f) { return _mm256_blendv_ps(f, t, m); }
L vi vi_blend(vm m, vi t, vi f) { return _mm256_blendv_epi8(f, t, _mm256_castps_si256(m)); }
/* a | (b & c) */
L vi vi_or_and(vi a, vi b, vi c) { return _mm256_or_si256(a, _mm256_and_si256(b, c)); }
/* b - c in the lanes of m, a elsewhere */
L vi vi_sub_where(vm m, vi a, vi b, vi c) { return vi_blend(m, _mm256_sub_epi32(b, c), a); }
L vf vf_zero_unless(vm m, vf a) { return _mm256_and_ps(m, a); }

L int32_t vi_hmax(vi a)
{
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
    return _mm_cvtsi128_si32(m);
}

L float vf_hmax(vf a)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* 8 codes (0..255) as bytes */
L void store_u8(uint8_t *p, vi c)
{
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(w, w));
}

/* 32 codes (0..255) as bytes: packs interleave the 128-bit halves, one permute restores order */
L void store_u8x4(uint8_t *p, vi a, vi b, vi c, vi d)
{
    const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    _mm256_storeu_si256((__m256i *)p,
                        _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* 8 codes (-127..127) as bytes */
L void store_i8(int8_t *p, vi c)
{
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}

/* 8 values 0..65535 as 16-bit words */
L void store_u16(uint16_t *p, vi a)
{
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
}

/* 8 bytes, zero- or sign-extended */
L vi vi_load_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
L vi vi_load_i8(const int8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/*
 * mf_exp.h's 32 (hi, lo) pairs, read as 64-bit loads: lane indices come out by vmovq /
 * vpextrq, each lane's pair is one vmovsd or vmovhpd, and two vshufps split the pairs
 * into hi and lo. On Zen 3 this costs less than the in-register alternative (eight
 * vpermps and six vblendvps share the shuffle pipes with the rest of the kernel) or
 * vgatherdps. The pairs are held as doubles only to be moved: never computed with.
 */
typedef struct {
    double pair[32]; /* the bits of (hi, lo): hi in the low half */
} simd_exp_table;

L void simd_exp_table_init(simd_exp_table *t) { memcpy(t->pair, MF_EXP_TABLE, sizeof t->pair); }

L void simd_exp_lookup(const simd_exp_table *t, vi kb, vf *hi, vf *lo)
{
    const __m256i j = _mm256_and_si256(kb, _mm256_set1_epi32(31));
    const __m128i j03 = _mm256_castsi256_si128(j), j47 = _mm256_extracti128_si256(j, 1);
    const uint64_t a = (uint64_t)_mm_cvtsi128_si64(j03), b = (uint64_t)_mm_extract_epi64(j03, 1);
    const uint64_t c = (uint64_t)_mm_cvtsi128_si64(j47), d = (uint64_t)_mm_extract_epi64(j47, 1);
    const double *pr = t->pair;
    /* x = [p0 p1 | p4 p5], y = [p2 p3 | p6 p7]: vshufps then gives lanes 0..7 in order */
    const __m128d p01 = _mm_loadh_pd(_mm_load_sd(pr + (uint32_t)a), pr + (a >> 32));
    const __m128d p23 = _mm_loadh_pd(_mm_load_sd(pr + (uint32_t)b), pr + (b >> 32));
    const __m128d p45 = _mm_loadh_pd(_mm_load_sd(pr + (uint32_t)c), pr + (c >> 32));
    const __m128d p67 = _mm_loadh_pd(_mm_load_sd(pr + (uint32_t)d), pr + (d >> 32));
    const __m256 x = _mm256_castpd_ps(_mm256_insertf128_pd(_mm256_castpd128_pd256(p01), p45, 1));
    const __m256 y = _mm256_castpd_ps(_mm256_insertf128_pd(_mm256_castpd128_pd256(p23), p67, 1));
    *hi = _mm256_shuffle_ps(x, y, 0x88);
    *lo = _mm256_shuffle_ps(x, y, 0xDD);
}

#undef L

#include "cpu/rows_simd.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif /* MF_CPU_HAVE_X86_SIMD */
