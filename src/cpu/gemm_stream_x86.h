/*
 * The weight-stream GEMM tile for few activation rows, the text of the x86 levels: each weight
 * row is read once, straight from the expert's matrix, eight rows at a time transposed in
 * registers so that a vector holds one depth position of eight columns. The packed GEMM
 * (gemm.c) copies every weight twice before its micro-kernel reads it, which for a few rows
 * costs more than the arithmetic. Same bits: every output is one fmaf chain over k = 0, 1, ...
 * from the value in c.
 *
 * Included by gemm_stream_avx2.c and gemm_stream_avx512.c after their target pragma, with
 * GS_FN (the function's name) and GS_MS (the A rows of a group): each row keeps two
 * accumulators, so AVX2's 16 registers hold 4 rows and AVX-512's 32 (AVX512VL) hold 8. A tile
 * of more rows (up to MF_GEMM_STREAM_TILE) goes in groups over a shared transposed panel;
 * GS_ZMM (AVX-512F) transposes sixteen by sixteen, the panel and the few-row tiles' depth
 * positions alike (columns16z), and keeps one 16-wide accumulator a row; tiles of more than
 * GS_WIDE_ROWS rows take two such halves a panel (columns32_groups). GS_PACK_FN, where
 * defined, names the packed GEMM's panel transpose built from the same transposes.
 */
#include <immintrin.h>

#define L static inline __attribute__((always_inline))

/* What a padding column reads: zeros, as many as a cache block of depth holds. */
static const float zero_row[MF_GEMM_STREAM_KC];

/* Eight values of a weight row from depth k (f32 or bf16, widened exactly). */
L __m256 load8(const char *row, int64_t k, int bf16)
{
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)row + k);
}

L float load1(const char *row, int64_t k, int bf16)
{
    return bf16 ? mf_bf16_to_f32(((const uint16_t *)row)[k]) : ((const float *)row)[k];
}

/* r[j][q] -> r[q][j]: rows of eight depth positions into depth positions of eight rows. */
L void transpose8(__m256 r[8])
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* Depth positions k..k+7 of half h (eight columns) of MS rows: acc[i][h] += a[i][k] * w[k]. */
L void step8(const float *a, int64_t lda, const char *const rows[16], int bf16, int64_t k,
           __m256 acc[][2], const int h, const int ms)
{
    __m256 r[8];
    for (int j = 0; j < 8; j++)
        r[j] = load8(rows[8 * h + j], k, bf16);
    transpose8(r);
    /* unrolled: a loop over q keeps r in memory, and its chains apart from the other half's */
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++)
#pragma GCC unroll 8
        for (int i = 0; i < ms; i++)
            acc[i][h] = _mm256_fmadd_ps(_mm256_set1_ps(a[i * lda + k + q]), r[q], acc[i][h]);
}

/*
 * Sixteen columns (two halves of eight) of MS rows: acc[i][h] += a[i][k] * w[k] in k order.
 * Half 1 runs two cache lines of depth behind half 0. Weight rows are often a multiple of
 * 4 KiB apart (rows of 2048, 4096 or 14336 bf16 values), so that the sixteen rows' lines at
 * one depth share one set of the 8-way L1 and evict each other before they are used up; with
 * the lag each set holds eight (2-core EPYC, one thread, rows 8 KiB apart: 4.4 -> 6.3 G bf16
 * weights a second).
 */
L void columns16(const float *a, int64_t lda, const char *const rows[16], int bf16, int64_t kc,
                 float *c, int64_t ldc, const int ms)
{
    __m256 acc[GS_MS][2];
    for (int i = 0; i < ms; i++)
        for (int h = 0; h < 2; h++)
            acc[i][h] = _mm256_loadu_ps(c + i * ldc + 8 * h);
    const int64_t k8 = kc & ~(int64_t)7, lag = bf16 ? 64 : 32; /* 128 bytes */
    int64_t k = 0;
    for (; k < k8 + lag; k += 8) {
        if (k < k8)
            step8(a, lda, rows, bf16, k, acc, 0, ms);
        if (k >= lag)
            step8(a, lda, rows, bf16, k - lag, acc, 1, ms);
    }
    k = k8;
    for (; k < kc; k++) /* the block's last depth positions, one at a time */
        for (int h = 0; h < 2; h++) {
            float v[8];
            for (int j = 0; j < 8; j++)
                v[j] = load1(rows[8 * h + j], k, bf16);
            const __m256 w = _mm256_loadu_ps(v);
            for (int i = 0; i < ms; i++)
                acc[i][h] = _mm256_fmadd_ps(_mm256_set1_ps(a[i * lda + k]), w, acc[i][h]);
        }
    for (int i = 0; i < ms; i++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(c + i * ldc + 8 * h, acc[i][h]);
}

/* Depth positions of a transposed panel: 16 columns of them are 4 KiB, in L1. */
#define GS_PANEL_K 64
/* Panels ahead whose weight lines are asked for in L2 (2-core EPYC, Qwen3-30B-A3B M = 256,
 * docs/PERFORMANCE.md: one ahead gained 3% f32, two 10%, three no more; two into L1 lost f32's) */
#define GS_PREFETCH 2

#ifdef GS_ZMM
/* Sixteen values of a weight row from depth k (f32 or bf16, widened exactly). */
L __m512 load16(const char *row, int64_t k, int bf16)
{
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(row + 2 * k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + k);
}

/* r[j][q] -> r[q][j] for sixteen rows of sixteen: 64 shuffles for 256 values, where the
 * 8 x 8 transposes of 256-bit halves take 96 (and twice the loads and stores). */
L void transpose16(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) { /* lane L: rows i, i + 1 at 4 L, 4 L + 1 | 4 L + 2, 4 L + 3 */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* r[4 g + c], lane L: rows 4 g .. 4 g + 3 at column 4 L + c */
        r[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        r[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
        r[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        r[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) { /* the 4 x 4 transpose of 128-bit lanes: column 4 L + c */
        const __m512 p0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        const __m512 p1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        const __m512 p2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        const __m512 p3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_f32x4(p0, p2, 0x88);      /* column c */
        t[4 + c] = _mm512_shuffle_f32x4(p1, p3, 0x88);  /* column 4 + c */
        t[8 + c] = _mm512_shuffle_f32x4(p0, p2, 0xDD);  /* column 8 + c */
        t[12 + c] = _mm512_shuffle_f32x4(p1, p3, 0xDD); /* column 12 + c */
    }
    for (int q = 0; q < 16; q++)
        r[q] = t[q];
}
#endif

/* panel[q * ld + j] = w_j[k + q], q < kb: sixteen columns' weights transposed once (ld 16, or
 * 32 where two such halves make one wide panel). */
L void panel16(const char *const rows[16], int bf16, int64_t k, int64_t kb, float *panel,
               const int64_t ld)
{
    int64_t q = 0;
#ifdef GS_ZMM
    for (; q + 16 <= kb; q += 16) {
        __m512 r[16];
        for (int j = 0; j < 16; j++)
            r[j] = load16(rows[j], k + q, bf16);
        transpose16(r);
        for (int t = 0; t < 16; t++)
            _mm512_storeu_ps(panel + (q + t) * ld, r[t]);
    }
#endif
    for (; q + 8 <= kb; q += 8)
        for (int h = 0; h < 2; h++) {
            __m256 r[8];
            for (int j = 0; j < 8; j++)
                r[j] = load8(rows[8 * h + j], k + q, bf16);
            transpose8(r);
            for (int t = 0; t < 8; t++)
                _mm256_storeu_ps(panel + (q + t) * ld + 8 * h, r[t]);
        }
    for (; q < kb; q++)
        for (int j = 0; j < 16; j++)
            panel[q * ld + j] = load1(rows[j], k + q, bf16);
}

#ifdef GS_ZMM
/* columns16 with the 16 columns in one register: sixteen depth positions of the sixteen rows
 * transposed at once, then MS FMAs a position. */
L void columns16z(const float *a, int64_t lda, const char *const rows[16], int bf16, int64_t kc,
                  float *c, int64_t ldc, const int ms)
{
    __m512 acc[GS_MS];
    for (int i = 0; i < ms; i++)
        acc[i] = _mm512_loadu_ps(c + i * ldc);
    const int64_t k16 = kc & ~(int64_t)15;
    for (int64_t k = 0; k < k16; k += 16) {
        __m512 r[16];
        for (int j = 0; j < 16; j++)
            r[j] = load16(rows[j], k, bf16);
        transpose16(r);
#pragma GCC unroll 16
        for (int q = 0; q < 16; q++)
#pragma GCC unroll 8
            for (int i = 0; i < ms; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + k + q]), r[q], acc[i]);
    }
    for (int64_t k = k16; k < kc; k++) { /* the block's last depth positions, one at a time */
        float v[16];
        for (int j = 0; j < 16; j++)
            v[j] = load1(rows[j], k, bf16);
        const __m512 w = _mm512_loadu_ps(v);
        for (int i = 0; i < ms; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + k]), w, acc[i]);
    }
    for (int i = 0; i < ms; i++)
        _mm512_storeu_ps(c + i * ldc, acc[i]);
}
#define GS_COLUMNS columns16z
#else
#define GS_COLUMNS columns16
#endif

/* MS rows times a panel: acc[i][h] += a[i][k + q] * panel[q][8 h ..] in q order. */
L void rows_panel(const float *a, int64_t lda, const float *panel, int64_t k, int64_t kb,
                  float *c, int64_t ldc, const int ms)
{
#ifdef GS_ZMM
    /* the 16 columns in one register: a depth step is one load and MS FMAs, each with its A
     * value broadcast from memory, where two halves take twice the FMAs and a broadcast each
     * (the loop's instructions, not the FMA pipes, set its pace: 2-core EPYC, 16 rows, weights
     * from DRAM, 62 -> 67 GFLOP/s) */
    __m512 acc[GS_MS];
    for (int i = 0; i < ms; i++)
        acc[i] = _mm512_loadu_ps(c + i * ldc);
#pragma GCC unroll 2
    for (int64_t q = 0; q < kb; q++) {
        const __m512 w = _mm512_load_ps(panel + q * 16);
#pragma GCC unroll 8
        for (int i = 0; i < ms; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + k + q]), w, acc[i]);
    }
    for (int i = 0; i < ms; i++)
        _mm512_storeu_ps(c + i * ldc, acc[i]);
#else
    __m256 acc[GS_MS][2];
    for (int i = 0; i < ms; i++)
        for (int h = 0; h < 2; h++)
            acc[i][h] = _mm256_loadu_ps(c + i * ldc + 8 * h);
#pragma GCC unroll 2
    for (int64_t q = 0; q < kb; q++) {
        const __m256 w0 = _mm256_load_ps(panel + q * 16), w1 = _mm256_load_ps(panel + q * 16 + 8);
#pragma GCC unroll 8
        for (int i = 0; i < ms; i++) {
            const __m256 x = _mm256_set1_ps(a[i * lda + k + q]);
            acc[i][0] = _mm256_fmadd_ps(x, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(x, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < ms; i++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(c + i * ldc + 8 * h, acc[i][h]);
#endif
}

/*
 * Asks for bytes [from, from + len) of the sixteen weight rows in L2, not L1: rows a multiple of
 * 4 KiB apart would put all sixteen lines of one depth in one set of the 8-way L1. Without it
 * the panel's loads wait on DRAM while no product runs, and the products then run while no
 * line is on its way: the layer took about the sum of its weight stream and its FMAs.
 */
L void prefetch_panel(const char *const rows[16], int64_t from, int64_t len)
{
    for (int j = 0; j < 16; j++) {
        for (int64_t b = 0; b < len; b += 64)
            _mm_prefetch(rows[j] + from + b, _MM_HINT_T1);
        _mm_prefetch(rows[j] + from + len - 1, _MM_HINT_T1); /* a row not line-aligned */
    }
}

/*
 * More rows than a group (GS_MS): each 16 columns' weights are transposed once a panel of
 * GS_PANEL_K depth positions, and every group of rows multiplies that panel; streaming each
 * group on its own transposed every weight once a group.
 */
L void columns16_groups(const float *a, int64_t lda, int64_t ms, const char *const rows[16],
                        int bf16, int64_t kc, float *c, int64_t ldc)
{
    float panel[GS_PANEL_K * 16] __attribute__((aligned(64)));
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t k0 = 0; k0 < kc; k0 += GS_PANEL_K) {
        const int64_t kb = kc - k0 < GS_PANEL_K ? kc - k0 : GS_PANEL_K;
        panel16(rows, bf16, k0, kb, panel, 16);
        const int64_t kp = k0 + GS_PREFETCH * GS_PANEL_K; /* while this panel is multiplied */
        if (kp < kc)
            prefetch_panel(rows, kp * esz, (kc - kp < GS_PANEL_K ? kc - kp : GS_PANEL_K) * esz);
        for (int64_t i0 = 0; i0 < ms; i0 += GS_MS) {
            const float *ai = a + i0 * lda;
            float *ci = c + i0 * ldc;
#define GS_PANEL_CASE(n)                                                                          \
    case n: rows_panel(ai, lda, panel, k0, kb, ci, ldc, n); break;
            switch (ms - i0 < GS_MS ? ms - i0 : GS_MS) {
                GS_PANEL_CASE(1)
                GS_PANEL_CASE(2)
                GS_PANEL_CASE(3)
#if GS_MS > 4
                GS_PANEL_CASE(4)
                GS_PANEL_CASE(5)
                GS_PANEL_CASE(6)
                GS_PANEL_CASE(7)
#endif
            default: rows_panel(ai, lda, panel, k0, kb, ci, ldc, GS_MS); break;
            }
#undef GS_PANEL_CASE
        }
    }
}

#ifdef GS_ZMM
/* Tiles of more rows than this take 32 columns a panel (2-core EPYC, Zen 5, Mixtral M=256, tiles
 * of 64 +- 10 rows: bf16 -4%, f32 -1.5%). Qwen3-30B-A3B M=256's tiles of 16 +- 4 rows were
 * 1-2% slower f32 with those past 16 wide: 32 weight rows streamed at once, for few products. */
#define GS_WIDE_ROWS 32

/*
 * A group of rows times a wide panel of 32 columns: acc[i][h] += a[i][k + q] * panel[q][16 h ..]
 * in q order. Each A value is broadcast once for two FMAs, where the 16 columns' loop loads one
 * for each FMA, and a group keeps 16 accumulators in flight instead of 8.
 */
L void rows_panel32(const float *a, int64_t lda, const float *panel, int64_t k, int64_t kb,
                    float *c, int64_t ldc, const int ms)
{
    __m512 acc[GS_MS][2];
    for (int i = 0; i < ms; i++)
        for (int h = 0; h < 2; h++)
            acc[i][h] = _mm512_loadu_ps(c + i * ldc + 16 * h);
#pragma GCC unroll 2
    for (int64_t q = 0; q < kb; q++) {
        const __m512 w0 = _mm512_load_ps(panel + q * 32), w1 = _mm512_load_ps(panel + q * 32 + 16);
#pragma GCC unroll 8
        for (int i = 0; i < ms; i++) {
            const __m512 x = _mm512_set1_ps(a[i * lda + k + q]);
            acc[i][0] = _mm512_fmadd_ps(x, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < ms; i++)
        for (int h = 0; h < 2; h++)
            _mm512_storeu_ps(c + i * ldc + 16 * h, acc[i][h]);
}

/* One out-of-line copy for each group size: inlined into the tile's loops, the group's loop
 * shared the integer registers with theirs and reloaded its row offsets from the stack. */
#define GS_PANEL32_FN(n)                                                                          \
    static __attribute__((noinline)) void rows_panel32_##n(                                       \
        const float *a, int64_t lda, const float *panel, int64_t k, int64_t kb, float *c,         \
        int64_t ldc)                                                                              \
    {                                                                                             \
        rows_panel32(a, lda, panel, k, kb, c, ldc, n);                                            \
    }
GS_PANEL32_FN(1)
GS_PANEL32_FN(2)
GS_PANEL32_FN(3)
GS_PANEL32_FN(4)
GS_PANEL32_FN(5)
GS_PANEL32_FN(6)
GS_PANEL32_FN(7)
GS_PANEL32_FN(8)
#undef GS_PANEL32_FN

/* columns16_groups over 32 columns: two sixteen-column halves transposed side by side into one
 * panel, which every group of rows multiplies. */
L void columns32_groups(const float *a, int64_t lda, int64_t ms, const char *const rows[32],
                        int bf16, int64_t kc, float *c, int64_t ldc)
{
    float panel[GS_PANEL_K * 32] __attribute__((aligned(64)));
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t k0 = 0; k0 < kc; k0 += GS_PANEL_K) {
        const int64_t kb = kc - k0 < GS_PANEL_K ? kc - k0 : GS_PANEL_K;
        panel16(rows, bf16, k0, kb, panel, 32);
        panel16(rows + 16, bf16, k0, kb, panel + 16, 32);
        const int64_t kp = k0 + GS_PREFETCH * GS_PANEL_K; /* while this panel is multiplied */
        if (kp < kc) {
            const int64_t len = (kc - kp < GS_PANEL_K ? kc - kp : GS_PANEL_K) * esz;
            prefetch_panel(rows, kp * esz, len);
            prefetch_panel(rows + 16, kp * esz, len);
        }
        for (int64_t i0 = 0; i0 < ms; i0 += GS_MS) {
            const float *ai = a + i0 * lda;
            float *ci = c + i0 * ldc;
#define GS_PANEL_CASE(n)                                                                          \
    case n: rows_panel32_##n(ai, lda, panel, k0, kb, ci, ldc); break;
            switch (ms - i0 < GS_MS ? ms - i0 : GS_MS) {
                GS_PANEL_CASE(1)
                GS_PANEL_CASE(2)
                GS_PANEL_CASE(3)
                GS_PANEL_CASE(4)
                GS_PANEL_CASE(5)
                GS_PANEL_CASE(6)
                GS_PANEL_CASE(7)
            default: rows_panel32_8(ai, lda, panel, k0, kb, ci, ldc); break;
            }
#undef GS_PANEL_CASE
        }
    }
}
#endif

/*
 * The first GS_PREFETCH panels of weight columns [n1, n1 + w) (w <= 32), asked for in L2 while
 * the group before them runs: a group's own loop asks for each panel GS_PREFETCH ahead, so
 * its first ones would come cold from DRAM. (The few-row groups ask for nothing ahead and
 * leave the rest to the hardware, which needs a row's first lines to find its stream.)
 */
L void prefetch_group_head(const char *wbase, int64_t wrow_bytes, const int64_t *b_rows,
                           int64_t n1, int64_t w, int64_t ncols, int64_t kc, int64_t esz)
{
    const int64_t len = (kc < GS_PREFETCH * GS_PANEL_K ? kc : GS_PREFETCH * GS_PANEL_K) * esz;
    for (int64_t h = n1; h < n1 + w && h < ncols; h += 16) {
        const char *rows[16];
        for (int j = 0; j < 16; j++) {
            const int64_t id = h + j < ncols ? b_rows[h + j] : -1;
            rows[j] = id >= 0 ? wbase + id * wrow_bytes : (const char *)zero_row;
        }
        prefetch_panel(rows, 0, len);
    }
}

void GS_FN(const float *a, int64_t lda, int64_t ms, const char *wbase, int64_t wrow_bytes,
           moefuse_dtype wdt, const int64_t *b_rows, int64_t ncols, int64_t kc, float *c,
           int64_t ldc)
{
    const int bf16 = wdt == MOEFUSE_BF16;
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t n0 = 0; n0 < ncols; n0 += 16) {
#ifdef GS_ZMM
        /* more than 16 columns left (c's rows have room up to the next multiple of 16), and
         * rows enough that the products, not the weights' stream, set the pace */
        if (ms > GS_WIDE_ROWS && ncols - n0 > 16) {
            prefetch_group_head(wbase, wrow_bytes, b_rows, n0 + 32, 32, ncols, kc, esz);
            const char *wide[32];
            for (int j = 0; j < 32; j++) {
                const int64_t id = n0 + j < ncols ? b_rows[n0 + j] : -1;
                wide[j] = id >= 0 ? wbase + id * wrow_bytes : (const char *)zero_row;
            }
            columns32_groups(a, lda, ms, wide, bf16, kc, c + n0, ldc);
            n0 += 16; /* and the loop's 16 */
            continue;
        }
#endif
        const char *rows[16];
        for (int j = 0; j < 16; j++) {
            const int64_t id = n0 + j < ncols ? b_rows[n0 + j] : -1;
            rows[j] = id >= 0 ? wbase + id * wrow_bytes : (const char *)zero_row;
        }
        if (ms > GS_MS) {
            prefetch_group_head(wbase, wrow_bytes, b_rows, n0 + 16, 16, ncols, kc, esz);
            columns16_groups(a, lda, ms, rows, bf16, kc, c + n0, ldc);
            continue;
        }
        prefetch_group_head(wbase, wrow_bytes, b_rows, n0 + 16, 16, ncols, kc, esz);
        /* the row count fixed at compile time: the accumulators stay in registers */
#define GS_CASE(n)                                                                                \
    case n: GS_COLUMNS(a, lda, rows, bf16, kc, c + n0, ldc, n); break;
        switch (ms < GS_MS ? ms : GS_MS) {
            GS_CASE(1)
            GS_CASE(2)
            GS_CASE(3)
#if GS_MS > 4
            GS_CASE(4)
            GS_CASE(5)
            GS_CASE(6)
            GS_CASE(7)
#endif
        default: GS_COLUMNS(a, lda, rows, bf16, kc, c + n0, ldc, GS_MS); break;
        }
#undef GS_CASE
    }
}

#ifdef GS_PACK_FN
/* The packed GEMM's weight panel (rows_isa.h: pack_panel16): the stream tile's panel16 over
 * the 16 f32 rows of tmp. A scalar loop moved each value alone and took as long as the
 * products. */
void GS_PACK_FN(float *restrict d, const float *restrict tmp, int64_t kc)
{
    const char *rows[16];
    for (int j = 0; j < 16; j++)
        rows[j] = (const char *)(tmp + j * kc);
    panel16(rows, 0, 0, kc, d, 16);
}
#endif

#undef L
