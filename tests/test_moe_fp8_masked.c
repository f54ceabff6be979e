/* test_moe_fp8: the masked call, and the decode shapes of the routed ones. */
#include "test_moe_fp8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ masked */

static void run_masked(cfg c, int64_t Tmax, const int32_t *counts)
{
    const int64_t K = c.K, I = c.I, E = c.E, GK = K / BLK, GI = I / BLK;
    tbuf *x = tb_new3("x", c.xdt, E, Tmax, K, 1, 1), *xs = NULL;
    if (c.xdt == MOEFUSE_F8_E4M3) {
        xs = h_new_scales("x_scales", c.layout, c.ue8m0, E, Tmax, GK, 0);
        xs->is_input = 1;
        zero_logical(xs);
    }
    for (int64_t e = 0; e < E; e++)
        for (int64_t t = 0; t < Tmax; t++) fill_x_row(&c, x, xs, e, t);
    tb_upload(x);
    if (xs) tb_upload(xs);
    tbuf *cn = tb_new1("counts", MOEFUSE_I32, E, 1);
    for (int64_t e = 0; e < E; e++) tb_set(cn, e, 0, 0, counts[e]);
    tb_upload(cn);
    tbuf *w1 = tb_new3("w1", MOEFUSE_F8_E4M3, E, 2 * I, K, 0, 1), *w1s = tb_new3("w1_scales", c.wsdt, E, 2 * I / BLK, GK, 0, 1);
    fill_weight(w1, w1s, E, 2 * I, K, c.nan_w);
    tbuf *w2 = tb_new3("w2", MOEFUSE_F8_E4M3, E, K, I, 0, 1), *w2s = tb_new3("w2_scales", c.wsdt, E, K / BLK, GI, 0, 1);
    fill_weight(w2, w2s, E, K, I, c.nan_w);
    tbuf *b1 = NULL, *b2 = NULL;
    if (c.bias) {
        b1 = tb_upload_unif(tb_new2("b1", MOEFUSE_F32, E, 2 * I, 0, 1), -0.5, 0.5);
        b2 = tb_upload_unif(tb_new2("b2", MOEFUSE_BF16, E, K, 0, 1), -0.5, 0.5);
    }
    tbuf *out = tb_new3("out", c.odt, E, Tmax, K, 2, 0);
    pair px = mk(x), pxs = xs ? mk(xs) : (pair){0}, pcn = mk(cn), pw1 = mk(w1), pw1s = mk(w1s), pw2 = mk(w2);
    pair pw2s = mk(w2s), pb1 = b1 ? mk(b1) : (pair){0}, pb2 = b2 ? mk(b2) : (pair){0}, pout = mk(out);
    const moefuse_fp8_moe_options o = options_of(&c); /* eps: 0 in every masked case */
    expect_ok(CALL(moefuse_moe_masked_fp8(g_ctx, T(x), T(xs), T(cn), T(w1), T(w1s), T(w2), T(w2s), T(b1), T(b2),
                                          T(out), &o)),
              "moe_masked_fp8", g_ctx);
    /* rows n[e] <= t < Tmax keep their bytes; rows t < n[e] against the oracle */
    uint8_t *qa = malloc((size_t)K), hq[4096];
    double *sa = malloc(sizeof(double) * (size_t)GK), hsd[64], *yr = malloc(sizeof(double) * (size_t)K);
    double *got = malloc(sizeof(double) * (size_t)(E * Tmax * K + 1)), *ref = malloc(sizeof(double) * (size_t)(E * Tmax * K + 1));
    size_t n = 0;
    const size_t osz = c.odt == MOEFUSE_F32 ? 4 : 2;
    for (int64_t e = 0; e < E; e++) {
        const int64_t ne = counts[e] < 0 ? 0 : (counts[e] > Tmax ? Tmax : counts[e]);
        for (int64_t t = ne; t < Tmax; t++) {
            const size_t at = (size_t)((unsigned char *)tb_el(out, e, t, 0) - out->full);
            HCHECK(memcmp(out->full + at, out->shadow + at, (size_t)K * osz) == 0,
                   "masked out row (e=%lld, t=%lld) past the count %lld was written %s", (long long)e, (long long)t,
                   (long long)ne, desc(&c));
        }
        for (int64_t t = 0; t < ne; t++) {
            oracle_x_row(&c, x, xs, e, t, qa, sa);
            oracle_gate(&c, qa, sa, w1, w1s, b1, e, hq, hsd, NULL, NULL);
            oracle_final(&c, hq, hsd, w2, w2s, b2, e, yr);
            for (int64_t r = 0; r < K; r++) {
                got[n] = tb_get(out, e, t, r);
                ref[n++] = yr[r];
            }
        }
    }
    const double err = rel_err_nan("masked out", &c, got, ref, n, h_gemm_floor(c.odt));
    HCHECK(err <= FP8_BOUND, "masked out %s: rel err %.3g > %.3g", desc(&c), err, FP8_BOUND);
    if (getenv("MOEFUSE_FP8_REPORT")) fprintf(stderr, "fp8 masked %s %s: out %.3g\n", h_backend(), desc(&c), err);
    if (g_ref) {
        expect_ok(CALL(moefuse_moe_masked_fp8(g_ref, T(px.c), T(pxs.c), T(pcn.c), T(pw1.c), T(pw1s.c), T(pw2.c),
                                              T(pw2s.c), T(pb1.c), T(pb2.c), T(pout.c), &o)),
                  "moe_masked_fp8 on the CPU", g_ref);
        if (exact_backend()) {
            same_values("masked out", &c, out, pout.c, E, Tmax, K);
        } else {
            const double d = rel_between(out, pout.c, E, Tmax, K);
            HCHECK(d <= FP8_BOUND, "masked out vs the CPU %s: %.3g", desc(&c), d);
        }
    }
    free(qa), free(sa), free(yr), free(got), free(ref);
    tb_free_all();
}

/* counts negative, 0, over Tmax, partial and full; every x dtype and layout */
START_TEST(test_masked)
{
    static const moefuse_dtype xdts[] = {MOEFUSE_BF16, MOEFUSE_F8_E4M3, MOEFUSE_F32, MOEFUSE_F16};
    for (int i = 0; i < 4; i++) {
        cfg c = base_cfg();
        c.E = 5, c.K = i == 2 ? 384 : 256, c.I = i == 3 ? 256 : 128;
        c.xdt = xdts[i];
        c.layout = i % 3;
        c.ue8m0 = i == 1;
        c.wsdt = i % 2 ? MOEFUSE_U8 : MOEFUSE_F32;
        c.odt = i % 2 ? MOEFUSE_BF16 : MOEFUSE_F32;
        c.act = i % 3, c.order = i % 2, c.limit = i == 2 ? 1.5f : 0.0f, c.bias = i % 2;
        if (i == 3) /* gpt-oss's activation in the masked layout */
            c.act = MOEFUSE_ACT_SILU_ALPHA, c.order = MOEFUSE_GATE_INTERLEAVED, c.limit = 7.0f,
            c.up_offset = 1.0f;
        c.nan_w = i == 3;
        const int64_t Tmax = 9 + i;
        const int32_t counts[5] = {-4, 0, (int32_t)Tmax + 7, (int32_t)h_randint(1, Tmax - 1), (int32_t)Tmax};
        run_masked(c, Tmax, counts);
    }
    /* experts of several 128-row tiles, odd and even counts of them (the CUDA backend's
     * large tile pairs two m-tiles of a column block, and an odd last one by columns) */
    for (int i = 0; i < 2; i++) {
        cfg c = base_cfg();
        c.E = 4, c.K = i ? 640 : 256, c.I = i ? 128 : 256;
        c.xdt = i ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16;
        c.layout = i ? MOEFUSE_SCALE_COLUMN_MAJOR : MOEFUSE_SCALE_ROW_MAJOR;
        c.bias = i;
        const int64_t Tmax = 300;
        const int32_t counts[4] = {300, 129, (int32_t)h_randint(1, 127), 256};
        run_masked(c, Tmax, counts);
    }
}
END_TEST

/*
 * Decode shapes (the CUDA backend's decode kernel, which MOEFUSE_CUDA_FP8=decode forces):
 * M = 1, 2, 7, 31 and 64 in every activation-scale layout, bf16 and FP8 x, invalid ids and
 * an expert_map; slots that route themselves (up to 32) and slots the route kernel lists,
 * more than one tile of an expert (over 32 slots), depths of 5 blocks (a ragged split), and
 * masked experts of several tiles.
 */
START_TEST(test_decode)
{
    static const int64_t Ms[] = {1, 2, 7, 31, 64};
    static const int layouts[][2] = {{MOEFUSE_SCALE_ROW_MAJOR, 0}, {MOEFUSE_SCALE_ROW_MAJOR, 1},
                                     {MOEFUSE_SCALE_COLUMN_MAJOR, 0}, {MOEFUSE_SCALE_COLUMN_MAJOR, 1},
                                     {MOEFUSE_SCALE_PACKED_UE8M0, 0}};
    for (int i = 0; i < 10; i++) {
        cfg c = base_cfg();
        c.M = Ms[i % 5];
        c.k = i < 5 ? 8 : 2;
        c.E = i == 9 ? 3 : 16, c.Eg = c.E + 4;
        c.K = i % 2 ? 640 : 256, c.I = i % 3 ? 256 : 128;
        c.xdt = i % 2 ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16;
        c.layout = layouts[i % 5][0];
        c.ue8m0 = layouts[i % 5][1];
        c.wsdt = i % 3 == 1 ? MOEFUSE_U8 : MOEFUSE_F32;
        c.odt = i % 2 ? MOEFUSE_BF16 : MOEFUSE_F32;
        c.act = i % 3, c.bias = i % 3, c.limit = i == 4 ? 0.75f : 0.0f;
        if (i % 4 == 2) /* gpt-oss's activation on the decode shapes */
            c.act = MOEFUSE_ACT_SILU_ALPHA, c.order = MOEFUSE_GATE_INTERLEAVED, c.limit = 7.0f,
            c.up_offset = 1.0f, c.bias = 2;
        c.use_map = i % 4 == 1, c.invalid = 1, c.unreduced = i % 2 == 0;
        run_routed(c);
    }
    for (int i = 0; i < 2; i++) {
        cfg c = base_cfg();
        c.E = 3, c.K = 384, c.I = 128;
        c.xdt = i ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16;
        c.layout = i ? MOEFUSE_SCALE_PACKED_UE8M0 : MOEFUSE_SCALE_COLUMN_MAJOR;
        c.bias = 1;
        const int64_t Tmax = 70;
        const int32_t counts[3] = {70, 33, (int32_t)h_randint(1, 31)};
        run_masked(c, Tmax, counts);
    }
}
END_TEST

void moe_fp8_masked_tests(TCase *tc)
{
    tcase_add_test(tc, test_masked);
    tcase_add_test(tc, test_decode);
}
