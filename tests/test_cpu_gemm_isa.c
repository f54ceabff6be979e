/*
 * The CPU backend's MoE GEMMs at every instruction-set level this machine has
 * (src/cpu/rows_isa.h: scalar reference, AVX2, AVX-512): moe_forward gives the
 * scalar level's bytes, and each vector level's weight-stream tile gives the
 * fmaf chain of its contract bit for bit. The row kernels' levels are
 * test_cpu_isa.c's.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/gemm.h"
#include "cpu/numerics.h"
#include "cpu/rows_isa.h"
#include "harness.h"

/*
 * moe_forward at every level gives the scalar level's bytes. The vector levels stream the
 * weights of every tile (MF_GEMM_STREAM_TILE slots at most) unpacked (gemm_stream_x86.h, in
 * groups of 4 rows at AVX2 and 8 at AVX-512) where the scalar level packs them; f16 weights take
 * the packed GEMM at every level.
 * Depths cover tails of 1..7, one and several cache blocks of MF_GEMM_KC and of the streamed
 * MF_GEMM_STREAM_KC, and depths shorter than the stream's lag between its two halves.
 */
START_TEST(t_moe_gemm_levels)
{
    static const moefuse_dtype DTS[] = {MOEFUSE_F32, MOEFUSE_BF16, MOEFUSE_F16};
    /* 17 tokens: streamed tiles of several row groups; 70: experts of up to 210 slots, in
     * tiles of more than 32 rows (32 columns a panel at AVX-512) */
    static const int64_t Ms[] = {1, 2, 3, 4, 9, 17, 70},
                         Ks[] = {8, 13, 40, 256, 300, 517, 2100}, Is[] = {8, 24, 70};
    for (int n = 0; n < 36; n++) {
        const int64_t M = Ms[h_randint(0, 6)], E = h_randint(1, 4), k = h_randint(1, 3);
        const int64_t K = Ks[h_randint(0, 6)], I = Is[h_randint(0, 2)]; /* 2100: two streamed blocks */
        const moefuse_dtype dt = DTS[h_randint(0, 2)];
        tbuf *x = tb_upload_unif(tb_new2("x", dt, M, K, 0, 1), -1, 1);
        tbuf *w1 = tb_upload_unif(tb_new3("w1", dt, E, 2 * I, K, 0, 1), -1, 1);
        tbuf *w2 = tb_upload_unif(tb_new3("w2", dt, E, K, I, 0, 1), -1, 1);
        tbuf *ids = tb_new2("ids", MOEFUSE_I32, M, k, 0, 1);
        tbuf *wts = tb_new2("wts", MOEFUSE_F32, M, k, 0, 1);
        h_fill_random_routing(ids, wts, M, k, E, h_randint(0, 1), -1);
        tbuf *out = tb_new2("out", dt, M, K, h_randint(0, 2), 0);
        moefuse_routing r;
        memset(&r, 0, sizeof r);
        r.topk_ids = ids->t;
        r.topk_weights = wts->t;
        /* the gate's epilogue (bias, clamp, up offset, each activation: the row kernels'
         * act_mul at the vector levels) in the same comparison */
        tbuf *b1 = h_randint(0, 1) ? tb_upload_unif(tb_new2("b1", dt, E, 2 * I, 0, 1), -1, 1)
                                   : NULL;
        const moefuse_moe_options o = {
            .activation = (moefuse_activation)h_randint(0, MOEFUSE_ACT_COUNT_ - 1),
            .order = h_randint(0, 1) ? MOEFUSE_GATE_INTERLEAVED : MOEFUSE_GATE_FIRST,
            .limit = h_randint(0, 1) ? 4.0f : 0.0f,
            .up_offset = h_randint(0, 1) ? 1.0f : 0.0f};
        unsigned char *pristine = malloc(out->total), *ref = malloc(out->total);
        memcpy(pristine, out->full, out->total);
        for (int lvl = MF_CPU_ISA_SCALAR; lvl < MF_CPU_ISA_COUNT; lvl++) {
            if (!mf_cpu_isa_force((mf_cpu_isa)lvl))
                continue;
            memcpy(out->full, pristine, out->total);
            tb_upload(out);
            const moefuse_status st =
                CALL(moefuse_moe_forward(g_ctx, T(x), T(w1), T(w2), b1 ? T(b1) : NULL, NULL, &r,
                                         T(out), &o));
            HCHECK(st == MOEFUSE_OK, "moe_forward at %s: %s (%s)", mf_cpu_isa_name((mf_cpu_isa)lvl),
                   moefuse_status_name(st), moefuse_last_error(g_ctx));
            if (lvl == MF_CPU_ISA_SCALAR) {
                memcpy(ref, out->full, out->total);
                continue;
            }
            size_t b = 0;
            while (b < out->total && out->full[b] == ref[b])
                b++;
            HCHECK(b == out->total,
                   "moe_forward M=%lld E=%lld k=%lld K=%lld I=%lld dtype %d (bias %d, act %d, "
                   "order %d, limit %g, up offset %g): %s differs from scalar at byte %zu of %zu",
                   (long long)M, (long long)E, (long long)k, (long long)K, (long long)I, (int)dt,
                   b1 != NULL, (int)o.activation, (int)o.order, (double)o.limit,
                   (double)o.up_offset, mf_cpu_isa_name((mf_cpu_isa)lvl), b, out->total);
        }
        free(pristine);
        free(ref);
        tb_free_all();
    }
}
END_TEST

/*
 * The weight-stream GEMM tile of each vector level against the fmaf chain its contract states
 * (rows_isa.h): c[i][n] += a[i][k] * w_n[k], k = 0, 1, ... in order, one fmaf each, in f32, so
 * that an order the kernel changes shows in the bits (moe_forward's bf16 outputs round most
 * such changes away). f32 and bf16 weights, 1 to MF_GEMM_STREAM_TILE rows (one group, several
 * over a panel), depths with tails of 1..15 and shorter than the lag between the tile's two
 * halves, missing weight rows (zeros) and column tails (up to 72 columns: two wide panels of 32
 * and a tail of 16).
 */
START_TEST(t_gemm_stream_exact)
{
    static const int64_t Ks[] = {1, 7, 15, 16, 33, 64, 100, 129, 515, 2048};
    int levels = 0;
    for (int lvl = MF_CPU_ISA_SCALAR + 1; lvl < MF_CPU_ISA_COUNT; lvl++) {
        const mf_cpu_row_kernels *kern = mf_cpu_row_kernels_of((mf_cpu_isa)lvl);
        if (!kern || !kern->gemm_stream)
            continue;
        levels++;
        for (int n = 0; n < 40; n++) {
            const int bf16 = n % 2;
            const int64_t ms = h_randint(1, MF_GEMM_STREAM_TILE), kc = Ks[h_randint(0, 9)];
            /* c's rows have room for the columns up to the next multiple of 16 (rows_isa.h) */
            const int64_t lda = kc + h_randint(0, 3), ncols = h_randint(1, 72);
            const int64_t ldc = (ncols + 15) / 16 * 16 + h_randint(0, 3);
            const int64_t nrows = 48, wrow = kc + h_randint(0, 5); /* elements */
            float *a = malloc(sizeof(float) * (size_t)(ms * lda));
            float *c = malloc(sizeof(float) * (size_t)(ms * ldc));
            float *ref = malloc(sizeof(float) * (size_t)(ms * ldc));
            char *w = malloc((size_t)(nrows * wrow * (bf16 ? 2 : 4)));
            int64_t *rows = malloc(sizeof(int64_t) * (size_t)ncols);
            for (int64_t i = 0; i < ms * lda; i++)
                a[i] = (float)h_unif(-1, 1);
            for (int64_t i = 0; i < nrows * wrow; i++) {
                const float v = (float)h_unif(-1, 1);
                if (bf16)
                    ((uint16_t *)w)[i] = (uint16_t)mf_f32_to_bf16(v);
                else
                    ((float *)w)[i] = v;
            }
            for (int64_t j = 0; j < ncols; j++)
                rows[j] = h_randint(0, 9) == 0 ? -1 : h_randint(0, nrows - 1);
            for (int64_t i = 0; i < ms * ldc; i++)
                c[i] = ref[i] = (float)h_unif(-1, 1);
            for (int64_t i = 0; i < ms; i++)
                for (int64_t j = 0; j < ncols; j++) {
                    float acc = ref[i * ldc + j];
                    for (int64_t k = 0; k < kc; k++) {
                        const int64_t at = rows[j] * wrow + k;
                        const float wv = rows[j] < 0 ? 0.0f
                                         : bf16    ? mf_bf16_to_f32(((const uint16_t *)w)[at])
                                                   : ((const float *)w)[at];
                        acc = fmaf(a[i * lda + k], wv, acc);
                    }
                    ref[i * ldc + j] = acc;
                }
            kern->gemm_stream(a, lda, ms, w, wrow * (bf16 ? 2 : 4),
                              bf16 ? MOEFUSE_BF16 : MOEFUSE_F32, rows, ncols, kc, c, ldc);
            int64_t bad = -1;
            for (int64_t i = 0; i < ms && bad < 0; i++)
                for (int64_t j = 0; j < ncols && bad < 0; j++)
                    if (memcmp(&c[i * ldc + j], &ref[i * ldc + j], sizeof(float)) != 0)
                        bad = i * ldc + j;
            HCHECK(bad < 0,
                   "gemm_stream at %s, %s weights, ms=%lld kc=%lld ncols=%lld: element %lld is "
                   "%.9g, the fmaf chain's %.9g",
                   mf_cpu_isa_name((mf_cpu_isa)lvl), bf16 ? "bf16" : "f32", (long long)ms,
                   (long long)kc, (long long)ncols, (long long)bad, bad < 0 ? 0.0 : (double)c[bad],
                   bad < 0 ? 0.0 : (double)ref[bad]);
            free(a);
            free(c);
            free(ref);
            free(w);
            free(rows);
        }
    }
    if (levels == 0)
        fprintf(stderr, "t_gemm_stream_exact: no level with the stream tile here\n");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("cpu_gemm_isa");
    TCase *tc = h_add_tcase(s, "cpu_gemm_isa", h_setup, 240);
    tcase_add_test(tc, t_moe_gemm_levels);
    tcase_add_test(tc, t_gemm_stream_exact);
    return h_run(s);
}
