/*
 * The row kernels of the CPU backend at three instruction-set levels: the
 * scalar reference (rows.c, the readable text of docs/NUMERICS.md) and
 * vector versions for AVX2+FMA and AVX-512 (rows_simd.h compiled twice) that
 * give the same bytes for every input. One table per level; the level is
 * chosen once from what the processor supports, or forced with
 * MOEFUSE_CPU_ISA=scalar|avx2|avx512 (or mf_cpu_isa_force, for tests).
 */
#ifndef MOEFUSE_CPU_ROWS_ISA_H
#define MOEFUSE_CPU_ROWS_ISA_H

#include "cpu/numerics.h"
#include "moefuse.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

/* The vector levels are built where GCC or Clang target x86-64 (function-level target
 * attributes: no flags needed for the whole library). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MF_CPU_HAVE_X86_SIMD 1
#endif

typedef enum mf_cpu_isa {
    MF_CPU_ISA_SCALAR = 0,
    MF_CPU_ISA_AVX2 = 1,   /* AVX2 + FMA, 8 lanes */
    MF_CPU_ISA_AVX512 = 2, /* AVX-512 F, 16 lanes */
    MF_CPU_ISA_COUNT
} mf_cpu_isa;

/* What a row op does to each row, fixed for the whole call. */
typedef struct mf_row_plan {
    int64_t hidden, group, groups; /* H, G, Gn */
    moefuse_dtype in_dtype;        /* x: f32, f16 or bf16 */
    moefuse_dtype out_dtype;       /* codes (f8 / i8) or act_mul's output dtype */
    bool activate;                 /* h = act(g) * u (x rows of 2H), else h = x */
    int order;                     /* moefuse_gate_order: where gate and up lie in x's rows */
    int activation;                /* moefuse_activation */
    float alpha;                   /* silu_alpha's alpha (the core's default filled in) */
    float limit;                   /* clamp when > 0 */
    float up_offset;               /* added to u after the clamp; 0: nothing added */
    bool has_row_scale, has_expert_scale, round_bf16;
    bool ue8m0; /* scales rounded up to powers of two */
    float eps;
    /* bf16 x with an activation that has a table: act(g) of the gates the table covers
     * (mf_act_table.h), for the vector kernels; NULL otherwise (silu_alpha has none). The
     * scalar reference computes every gate. */
    const float *act_table;
} mf_row_plan;

/* How far ahead of their channel the vector row kernels ask for their input (rows_simd.h);
 * the driver asks for each stream's first this many bytes of the next row (rows.c). */
#define MF_ROW_PREFETCH_AHEAD 2048 /* bytes */

/* Floats of a row kernel's scratch: 3H, and 2H more with the interleaved order, where the
 * vector kernels first copy a row's gate and up values apart. */
static inline int64_t mf_row_scratch_floats(const mf_row_plan *p)
{
    const bool apart = p->activate && p->order == MOEFUSE_GATE_INTERLEAVED;
    return (apart ? 5 : 3) * p->hidden;
}

typedef struct mf_cpu_row_kernels {
    mf_cpu_isa isa;
    const char *name;
    /*
     * One row: x holds 2H (activate) or H values of in_dtype; rs and es are the row's and
     * the expert's factors (used when the plan has them). quant_row writes the H codes to q
     * and each group's scale s[g] and, with ue8m0, its exponent byte ue[g]; act_mul_row
     * writes h rounded to out_dtype. scratch holds mf_row_scratch_floats(p) floats.
     */
    void (*quant_row)(const mf_row_plan *p, const void *x, float rs, float es, void *q, float *s,
                      uint8_t *ue, float *scratch);
    void (*act_mul_row)(const mf_row_plan *p, const void *x, float rs, float es, void *out,
                        float *scratch);
    /* dequant of n codes (f8 e4m3 or i8) of one group with scale s: out = f32(q) * s */
    void (*dequant_span)(const void *q, bool fp8, float s, int64_t n, moefuse_dtype out_dtype,
                         void *out);
    /* y[i] = mf_exp_f32(x[i]) (for the exhaustive check of the vector exp) */
    void (*exp_array)(const float *x, float *y, int64_t n);
    /*
     * Optional (NULL: the packed GEMM of gemm.c). c[i][n] (i < ms <= MF_GEMM_STREAM_TILE, n <
     * ncols, row stride ldc) += a[i][k] * w_n[k] for k = 0 .. kc-1 in order, one fmaf each
     * (the packed GEMM's bits): a holds ms rows of kc floats (stride lda), w_n is the weight
     * row of b_rows[n] at wbase + b_rows[n] * wrow_bytes (f32 or bf16; b_rows[n] < 0 or n past
     * the rows: zeros), kc <= MF_GEMM_STREAM_KC. Each row of c has room for ncols rounded up
     * to 16 columns: the tile reads and writes them all (those past ncols as c + 0 * a).
     */
    void (*gemm_stream)(const float *a, int64_t lda, int64_t ms, const char *wbase,
                        int64_t wrow_bytes, moefuse_dtype wdt, const int64_t *b_rows,
                        int64_t ncols, int64_t kc, float *c, int64_t ldc);
    /*
     * Optional (NULL: a scalar loop in gemm.c). The packed GEMM's weight panel from 16 rows of
     * kc floats: d[k * 16 + i] = tmp[i * kc + k] for i < 16 and k < kc.
     */
    void (*pack_panel16)(float *restrict d, const float *restrict tmp, int64_t kc);
} mf_cpu_row_kernels;

/* The table of an activation (MOEFUSE_ACT_*), built on first use (act_table.c); NULL for an
 * activation without one (mf_act_table_has). */
const float *mf_cpu_act_table(int activation);

/* The kernels of the level in use (chosen on first use). */
const mf_cpu_row_kernels *mf_cpu_row_kernels_active(void);
/* The kernels of a level, or NULL when this build or this processor lacks it. */
const mf_cpu_row_kernels *mf_cpu_row_kernels_of(mf_cpu_isa isa);
/* Use level isa from now on (tests); false, and nothing changes, when it is unavailable. */
bool mf_cpu_isa_force(mf_cpu_isa isa);
const char *mf_cpu_isa_name(mf_cpu_isa isa);

/* The scalar reference (rows.c). */
extern const mf_cpu_row_kernels mf_cpu_rows_scalar;
#if defined(MF_CPU_HAVE_X86_SIMD)
/* The weight-stream GEMM tiles of the AVX2 (4 rows) and AVX-512 (8 rows) levels
 * (gemm_stream_x86.h). */
void mf_cpu_gemm_stream_avx2(const float *a, int64_t lda, int64_t ms, const char *wbase,
                             int64_t wrow_bytes, moefuse_dtype wdt, const int64_t *b_rows,
                             int64_t ncols, int64_t kc, float *c, int64_t ldc);
void mf_cpu_gemm_stream_avx512(const float *a, int64_t lda, int64_t ms, const char *wbase,
                               int64_t wrow_bytes, moefuse_dtype wdt, const int64_t *b_rows,
                               int64_t ncols, int64_t kc, float *c, int64_t ldc);
/* pack_panel16 of both levels: eight-by-eight transposes in AVX registers (gemm_stream_x86.h) */
void mf_cpu_pack_panel16_avx2(float *restrict d, const float *restrict tmp, int64_t kc);
#endif
/* h of one channel, by the reference's own compiled code: the vector kernels hand it every
 * lane they do not compute themselves (NaN, |g| >= 86.5, the gelu forms), so those lanes
 * carry the reference's bits, NaN choices included. */
float mf_cpu_h_channel(const mf_row_plan *p, float g, float u, float rs, float es);

/* Scale of a group from the largest finite |h| (steps 2-4 of the quantization); *ue gets
 * the exponent byte when the plan rounds scales to powers of two, else 0. */
static inline float mf_group_scale(const mf_row_plan *p, float amax, uint8_t *ue)
{
    amax = amax > p->eps ? amax : p->eps;
    float s = p->out_dtype == MOEFUSE_F8_E4M3 ? amax / 448.0f : amax / 127.0f;
    *ue = 0;
    if (p->ue8m0) {
        const uint32_t ex = mf_ue8m0_exponent(s);
        *ue = (uint8_t)ex;
        s = mf_ue8m0_value(ex);
    }
    return s;
}

/* Code of one element (step 5): finite values are divided by the scale, once. */
static inline uint8_t mf_e4m3_code(float v, float s)
{
    return (uint8_t)(isfinite(v) ? mf_f32_to_e4m3(v / s) : mf_f32_to_e4m3(v));
}

static inline int8_t mf_i8_code(float v, float s)
{
    return (int8_t)(isfinite(v) ? mf_f32_to_i8(v / s) : mf_f32_to_i8(v));
}

#endif /* MOEFUSE_CPU_ROWS_ISA_H */
