/* Packing and register-tiled micro-kernel of the MoE GEMMs (see gemm.h). */
#include "cpu/gemm.h"
#include "cpu/rows_isa.h"
#include "cpu/tensor_cpu.h"

#include <math.h>
#include <string.h>

enum { MR = MF_GEMM_MR, NR = MF_GEMM_NR, KC = MF_GEMM_KC };
_Static_assert(MF_GEMM_STREAM_TILE * MF_GEMM_STREAM_LDA(MF_GEMM_STREAM_KC) <= MF_GEMM_A_PACK,
               "a streamed block's A rows fit a_pack");

/* c[MR x NR] (stride ldc) += a_panel[kc x MR] * b_panel[kc x NR], k in order. */
static inline __attribute__((always_inline)) void micro_kernel(int64_t kc,
                                                                const float *restrict ap,
                                                                const float *restrict bp,
                                                                float *restrict c, int64_t ldc)
{
    float acc[MR][NR];
    for (int i = 0; i < MR; i++)
MF_OMP(simd)
        for (int j = 0; j < NR; j++)
            acc[i][j] = c[i * ldc + j];
    for (int64_t k = 0; k < kc; k++) {
        const float *b = bp + k * NR;
        for (int i = 0; i < MR; i++) {
            const float av = ap[k * MR + i];
MF_OMP(simd)
            for (int j = 0; j < NR; j++)
                acc[i][j] = fmaf(av, b[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
MF_OMP(simd)
        for (int j = 0; j < NR; j++)
            c[i * ldc + j] = acc[i][j];
}

/* The loop over the micro-tiles of one cache block, instantiated per instruction set. */
#define MF_BLOCK_KERNEL_BODY                                                                      \
    for (int64_t jp = 0; jp < npanels; jp++)                                                      \
        for (int64_t ip = 0; ip < mpanels; ip++)                                                  \
            micro_kernel(kc, a_pack + ip * MR * kc, b_pack + jp * NR * kc,                        \
                         c + ip * MR * ldc + jp * NR, ldc);

#define MF_BLOCK_KERNEL_ARGS                                                                      \
    int64_t kc, int64_t mpanels, int64_t npanels, const float *restrict a_pack,                   \
        const float *restrict b_pack, float *restrict c, int64_t ldc

static void block_kernel_generic(MF_BLOCK_KERNEL_ARGS) { MF_BLOCK_KERNEL_BODY }

/*
 * On x86-64, the same code is also compiled for AVX2+FMA and AVX-512+FMA and
 * picked at run time. fmaf is exactly rounded on every path (the generic one
 * calls the C library's fmaf where the target has no FMA instruction: slow,
 * but the same bits), so the choice changes speed only.
 */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(MOEFUSE_NO_CLONES)
#define MF_GEMM_DISPATCH 1
__attribute__((target("avx2,fma"))) static void block_kernel_avx2(MF_BLOCK_KERNEL_ARGS)
{
    MF_BLOCK_KERNEL_BODY
}

__attribute__((target("avx512f,avx2,fma"))) static void block_kernel_avx512(MF_BLOCK_KERNEL_ARGS)
{
    MF_BLOCK_KERNEL_BODY
}
#endif

static void block_kernel(MF_BLOCK_KERNEL_ARGS)
{
#ifdef MF_GEMM_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) {
        block_kernel_avx512(kc, mpanels, npanels, a_pack, b_pack, c, ldc);
        return;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        block_kernel_avx2(kc, mpanels, npanels, a_pack, b_pack, c, ldc);
        return;
    }
#endif
    block_kernel_generic(kc, mpanels, npanels, a_pack, b_pack, c, ldc);
}

/* The A row of slot id (x row of its token, or its h row) from depth k0. */
static const char *a_row(const moefuse_tensor *t, int rank3, int64_t topk, int64_t id, int64_t k0)
{
    return rank3 ? mf_at3(t, id / topk, id % topk, k0) : mf_at2(t, id / topk, k0);
}

/* Pack rows[0..n) (padded with zero rows to a multiple of p <= MF_GEMM_NR) of depth
 * [k0, k0+kc) as panels [n/p][kc][p]. tmp holds p * KC floats. */
static void pack(float *restrict dst, int64_t p, const moefuse_tensor *t, int rank3, int64_t lead,
                 int64_t topk, const int64_t *rows, int64_t n, int64_t k0, int64_t kc,
                 float *restrict tmp)
{
    void (*panel16)(float *restrict, const float *restrict, int64_t) =
        p == 16 ? mf_cpu_row_kernels_active()->pack_panel16 : NULL;
    for (int64_t r0 = 0; r0 < n; r0 += p) {
        /* convert the panel's rows into tmp[i][k], then interleave as dst[k][i] */
        for (int64_t i = 0; i < p; i++) {
            const int64_t id = r0 + i < n ? rows[r0 + i] : -1;
            float *row = tmp + i * kc;
            if (id < 0) {
                memset(row, 0, (size_t)kc * sizeof(float));
                continue;
            }
            mf_load_row(row, lead >= 0 ? mf_at3(t, lead, id, k0) : a_row(t, rank3, topk, id, k0),
                        t->dtype, kc);
        }
        float *d = dst + r0 * kc;
        if (panel16) {
            panel16(d, tmp, kc);
            continue;
        }
        for (int64_t k = 0; k < kc; k++)
            for (int64_t i = 0; i < p; i++)
                d[k * p + i] = tmp[i * kc + k];
    }
}

/* Few A rows: the weights streamed unpacked by the level's kernel, the A rows widened to f32
 * per cache block of depth (the kernel takes them in groups, 16 columns at a time). False where
 * the level or the weights' dtype has no such kernel. */
static bool gemm_stream(const moefuse_tensor *a, int a_rank3, int64_t topk,
                        const int64_t *a_rows, int64_t ms, const moefuse_tensor *b, int64_t lead,
                        const int64_t *b_rows, int64_t ncols, int64_t depth, float *c,
                        int64_t ldc, mf_gemm_scratch *s)
{
    const mf_cpu_row_kernels *kern = mf_cpu_row_kernels_active();
    /* rows are contiguous: the core refuses any other innermost stride */
    if (ms < 1 || !kern->gemm_stream || ms > MF_GEMM_STREAM_TILE ||
        (b->dtype != MOEFUSE_F32 && b->dtype != MOEFUSE_BF16))
        return false;
    /* a dimension of one row is never stepped, and the core accepts any stride for it */
    const int64_t wrow_bytes =
        b->shape[1] > 1 ? b->stride[1] * (int64_t)mf_cpu_elem_size(b->dtype) : 0;
    /* The A rows over the whole depth where they fit a_pack, widened once: the thread's next
     * tiles are mostly the next column blocks of the same slots (moe.c), which reuse them. */
    const int64_t lda_all = MF_GEMM_STREAM_LDA(depth);
    if (ms * lda_all <= MF_GEMM_A_PACK) {
        if (s->a_from != a || s->a_rows != a_rows || s->a_ms != ms || s->a_depth != depth) {
            for (int64_t i = 0; i < ms; i++) {
                if (a_rows[i] < 0)
                    memset(s->a_pack + i * lda_all, 0, (size_t)depth * sizeof(float));
                else
                    mf_load_row(s->a_pack + i * lda_all, a_row(a, a_rank3, topk, a_rows[i], 0),
                                a->dtype, depth);
            }
            s->a_from = a, s->a_rows = a_rows, s->a_ms = ms, s->a_depth = depth;
        }
        for (int64_t k0 = 0; k0 < depth; k0 += MF_GEMM_STREAM_KC) {
            const int64_t kc = depth - k0 < MF_GEMM_STREAM_KC ? depth - k0 : MF_GEMM_STREAM_KC;
            kern->gemm_stream(s->a_pack + k0, lda_all, ms, mf_at3(b, lead, 0, k0), wrow_bytes,
                              b->dtype, b_rows, ncols, kc, c, ldc);
        }
        return true;
    }
    s->a_from = NULL; /* a_pack is overwritten below */
    for (int64_t k0 = 0; k0 < depth; k0 += MF_GEMM_STREAM_KC) {
        const int64_t kc = depth - k0 < MF_GEMM_STREAM_KC ? depth - k0 : MF_GEMM_STREAM_KC;
        const int64_t lda = MF_GEMM_STREAM_LDA(kc);
        for (int64_t i = 0; i < ms; i++) {
            if (a_rows[i] < 0)
                memset(s->a_pack + i * lda, 0, (size_t)kc * sizeof(float));
            else
                mf_load_row(s->a_pack + i * lda, a_row(a, a_rank3, topk, a_rows[i], k0),
                            a->dtype, kc);
        }
        kern->gemm_stream(s->a_pack, lda, ms, mf_at3(b, lead, 0, k0), wrow_bytes, b->dtype,
                          b_rows, ncols, kc, c, ldc);
    }
    return true;
}

void mf_gemm_tile(const moefuse_tensor *a, int a_rank3, int64_t topk, const int64_t *a_rows,
                  int64_t ms, const moefuse_tensor *b, int64_t lead, const int64_t *b_rows,
                  int64_t ncols, int64_t depth, float *c, mf_gemm_scratch *s)
{
    const int64_t mpanels = (ms + MR - 1) / MR, npanels = (ncols + NR - 1) / NR;
    const int64_t ldc = npanels * NR;
    memset(c, 0, (size_t)(mpanels * MR * ldc) * sizeof(float));
    if (gemm_stream(a, a_rank3, topk, a_rows, ms, b, lead, b_rows, ncols, depth, c, ldc, s))
        return;
    s->a_from = NULL; /* the packed GEMM overwrites a_pack */
    for (int64_t k0 = 0; k0 < depth; k0 += KC) {
        const int64_t kc = depth - k0 < KC ? depth - k0 : KC;
        pack(s->a_pack, MR, a, a_rank3, -1, topk, a_rows, ms, k0, kc, s->tmp);
        pack(s->b_pack, NR, b, 1, lead, 1, b_rows, ncols, k0, kc, s->tmp);
        block_kernel(kc, mpanels, npanels, s->a_pack, s->b_pack, c, ldc);
    }
}
