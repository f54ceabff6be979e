/* Results bitwise equal run to run (SPEC 4.3); on the cpu backend the two runs
 * use 1 and 2 OpenMP threads. Device backends get the same two runs (the thread
 * count changes nothing there): their work split and atomics must not change a bit. */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "harness.h"

static void set_threads(int n)
{
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* Only the cpu backend's test is about threads. */
static int skip_no_omp(void)
{
    if (!h_have_openmp() && strcmp(h_backend(), "cpu") == 0) {
        fprintf(stderr, "SKIP: built without OpenMP; thread-count determinism not tested\n");
        return 1;
    }
    return 0;
}

/* snapshot of the payload bytes of a tbuf after a call */
static unsigned char *snap(tbuf *tb)
{
    unsigned char *p = malloc(tb->total);
    memcpy(p, tb->full, tb->total);
    return p;
}
static void same(tbuf *tb, const unsigned char *a, const char *what)
{
    for (size_t i = 0; i < tb->total; i++)
        HCHECK(tb->full[i] == a[i], "%s: '%s' byte %zu differs between run 1 (1 thread) and run 2 (2 threads) (0x%02x vs 0x%02x)", what,
               tb->name, i, a[i], tb->full[i]);
}

START_TEST(t_act_quant)
{
    if (skip_no_omp()) return;
    tbuf *x = tb_new2("x", MOEFUSE_BF16, 67, 512, 1, 1);
    tb_fill_unif(x, -4, 4);
    tb_upload(x);
    tbuf *q = tb_new2("q", MOEFUSE_F8_E4M3, 67, 256, 0, 0);
    tbuf *sc = h_new_scales("scales", MOEFUSE_SCALE_PACKED_UE8M0, 0, 0, 67, 8, 0);
    moefuse_act_quant_options o = {0};
    o.quant.group_size = 32;
    o.quant.scale_layout = MOEFUSE_SCALE_PACKED_UE8M0;
    o.act.activation = MOEFUSE_ACT_GELU;
    set_threads(1);
    HCHECK(CALL(moefuse_act_quant(g_ctx, T(x), NULL, T(q), T(sc), &o)) == MOEFUSE_OK, "act_quant: %s", moefuse_last_error(g_ctx));
    unsigned char *a = snap(q), *b = snap(sc);
    set_threads(2);
    HCHECK(CALL(moefuse_act_quant(g_ctx, T(x), NULL, T(q), T(sc), &o)) == MOEFUSE_OK, "act_quant: %s", moefuse_last_error(g_ctx));
    same(q, a, "act_quant");
    same(sc, b, "act_quant");
    free(a);
    free(b);

    /* masked */
    const int64_t E = 4, Tm = 33, H = 128;
    tbuf *x3 = tb_new3("x3", MOEFUSE_F32, E, Tm, 2 * H, 0, 1);
    tb_fill_unif(x3, -3, 3);
    tb_upload(x3);
    tbuf *cn = tb_new1("counts", MOEFUSE_I32, E, 1);
    for (int e = 0; e < E; e++) tb_set(cn, e, 0, 0, (double)(e * 11 % 40));
    tb_upload(cn);
    tbuf *q3 = tb_new3("q3", MOEFUSE_F8_E4M3, E, Tm, H, 0, 0);
    tbuf *s3 = h_new_scales("s3", MOEFUSE_SCALE_COLUMN_MAJOR, 0, E, Tm, 2, 0);
    moefuse_act_quant_options o3 = {0};
    o3.quant.group_size = 64;
    o3.quant.scale_layout = MOEFUSE_SCALE_COLUMN_MAJOR;
    set_threads(1);
    HCHECK(CALL(moefuse_act_quant_masked(g_ctx, T(x3), T(cn), NULL, NULL, T(q3), T(s3), &o3)) == MOEFUSE_OK, "masked: %s", moefuse_last_error(g_ctx));
    a = snap(q3);
    b = snap(s3);
    set_threads(2);
    HCHECK(CALL(moefuse_act_quant_masked(g_ctx, T(x3), T(cn), NULL, NULL, T(q3), T(s3), &o3)) == MOEFUSE_OK, "masked: %s", moefuse_last_error(g_ctx));
    same(q3, a, "act_quant_masked");
    same(s3, b, "act_quant_masked");
    free(a);
    free(b);
}
END_TEST

START_TEST(t_moe)
{
    if (skip_no_omp()) return;
    const int64_t M = 37, K = 96, I = 80, E = 5, k = 3;
    moefuse_dtype dts[2] = {MOEFUSE_F32, MOEFUSE_BF16};
    for (int d = 0; d < 2; d++) {
        moefuse_dtype dt = dts[d];
        tbuf *x = tb_new2("x", dt, M, K, 0, 1);
        tbuf *w1 = tb_new3("w1", dt, E, 2 * I, K, 0, 1);
        tbuf *w2 = tb_new3("w2", dt, E, K, I, 0, 1);
        tbuf *b1 = tb_new2("b1", dt, E, 2 * I, 0, 1);
        tbuf *b2 = tb_new2("b2", dt, E, K, 0, 1);
        tbuf *ids = tb_new2("ids", MOEFUSE_I32, M, k, 0, 1);
        tbuf *wt = tb_new2("wts", MOEFUSE_F32, M, k, 0, 1);
        tb_fill_unif(x, -1, 1);
        tb_fill_unif(w1, -0.2, 0.2);
        tb_fill_unif(w2, -0.2, 0.2);
        tb_fill_unif(b1, -0.2, 0.2);
        tb_fill_unif(b2, -0.2, 0.2);
        tb_fill_unif(wt, 0, 1);
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < k; j++) tb_set(ids, m, j, 0, (double)h_randint(-1, E));
        tb_upload(x); tb_upload(w1); tb_upload(w2); tb_upload(b1); tb_upload(b2); tb_upload(ids); tb_upload(wt);
        moefuse_routing R;
        memset(&R, 0, sizeof R);
        R.topk_ids = ids->t;
        R.topk_weights = wt->t;
        tbuf *h = tb_new3("h", dt, M, k, I, 0, 0);
        tbuf *out = tb_new2("out", dt, M, K, 0, 0);
        tbuf *y = tb_new3("y", MOEFUSE_F32, M, k, K, 0, 0);
        tbuf *fo = tb_new2("fwd", dt, M, K, 0, 0);
        unsigned char *s[4];
        for (int rep = 0; rep < 2; rep++) {
            set_threads(rep + 1);
            HCHECK(CALL(moefuse_moe_gate(g_ctx, T(x), T(w1), T(b1), &R, T(h), NULL)) == MOEFUSE_OK, "gate: %s", moefuse_last_error(g_ctx));
            HCHECK(CALL(moefuse_moe_final(g_ctx, T(h), T(w2), T(b2), &R, T(out), NULL)) == MOEFUSE_OK, "final: %s", moefuse_last_error(g_ctx));
            if (dt == MOEFUSE_F32)
                HCHECK(CALL(moefuse_moe_final(g_ctx, T(h), T(w2), T(b2), &R, T(y), NULL)) == MOEFUSE_OK, "final y: %s", moefuse_last_error(g_ctx));
            HCHECK(CALL(moefuse_moe_forward(g_ctx, T(x), T(w1), T(w2), T(b1), T(b2), &R, T(fo), NULL)) == MOEFUSE_OK, "forward: %s", moefuse_last_error(g_ctx));
            if (rep == 0) {
                s[0] = snap(h); s[1] = snap(out); s[2] = snap(y); s[3] = snap(fo);
            } else {
                same(h, s[0], "moe_gate");
                same(out, s[1], "moe_final");
                same(y, s[2], "moe_final unreduced");
                same(fo, s[3], "moe_forward");
                for (int i = 0; i < 4; i++) free(s[i]);
            }
        }
        tb_free_all();
    }
}
END_TEST

START_TEST(t_topk)
{
    if (skip_no_omp()) return;
    tbuf *lg = tb_new2("logits", MOEFUSE_F32, 200, 16, 0, 1);
    tb_fill_unif(lg, -3, 3);
    tb_upload(lg);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, 200, 4, 0, 0);
    tbuf *w = tb_new2("w", MOEFUSE_F32, 200, 4, 0, 0);
    set_threads(1);
    HCHECK(CALL(moefuse_topk_softmax(g_ctx, T(lg), 1, T(ids), T(w))) == MOEFUSE_OK, "topk: %s", moefuse_last_error(g_ctx));
    unsigned char *a = snap(ids), *b = snap(w);
    set_threads(2);
    HCHECK(CALL(moefuse_topk_softmax(g_ctx, T(lg), 1, T(ids), T(w))) == MOEFUSE_OK, "topk: %s", moefuse_last_error(g_ctx));
    same(ids, a, "topk");
    same(w, b, "topk");
    free(a);
    free(b);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("determinism");
    TCase *tc = tcase_create("determinism");
    tcase_add_checked_fixture(tc, h_setup, h_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, t_act_quant);
    tcase_add_test(tc, t_moe);
    tcase_add_test(tc, t_topk);
    suite_add_tcase(s, tc);
    return h_run(s);
}
