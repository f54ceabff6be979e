/* Results bitwise equal run to run (NUMERICS.md: the summation order is fixed); on the cpu backend the two runs
 * use 1 and 2 OpenMP threads. Device backends get the same two runs (the thread
 * count changes nothing there): their work split and atomics must not change a bit.
 *
 * Every output is poisoned before every run, with a pattern that differs from
 * run to run in every byte: a byte the call should write but leaves alone then
 * differs between the runs, so a kernel that writes nothing cannot pass. Bytes
 * a call must leave alone (the masked tail rows) must keep each run's poison.
 * Without OpenMP the cpu program has nothing to test and exits 77 (SKIP). */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "harness.h"

enum { RUNS = 2, MAX_OUTPUTS = 4 };

static void set_threads(int n)
{
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* Poison of byte i in a run: the two runs differ in every byte. */
static unsigned char poison_byte(size_t i, int run)
{
    return (unsigned char)((0x5A ^ (i * 0x3B)) ^ (run ? 0xFF : 0x00));
}

/* The outputs of one call, what the first run left in them, and the bytes the call may leave alone. */
typedef struct {
    const char *what;
    int n;
    tbuf *tb[MAX_OUTPUTS];
    unsigned char *keep[MAX_OUTPUTS]; /* NULL: every element byte must be written */
    unsigned char *first[MAX_OUTPUTS];
} outputs;

static outputs outputs_of(const char *what, tbuf *a, tbuf *b, tbuf *c, tbuf *d)
{
    outputs o;
    memset(&o, 0, sizeof o);
    o.what = what;
    tbuf *all[MAX_OUTPUTS] = {a, b, c, d};
    for (int i = 0; i < MAX_OUTPUTS && all[i]; i++) o.tb[o.n++] = all[i];
    return o;
}

/* Before run `run`: fresh poison in every element byte of every output, and the thread count. */
static void begin_run(outputs *o, int run)
{
    for (int i = 0; i < o->n; i++) {
        tbuf *tb = o->tb[i];
        for (size_t b = 0; b < tb->total; b++)
            if (tb->logical[b]) tb->full[b] = poison_byte(b, run);
        tb_upload(tb);
    }
    set_threads(run + 1);
}

/* After run `run` (its call went through CALL, so tb->full holds what the backend wrote). */
static void end_run(outputs *o, int run)
{
    for (int i = 0; i < o->n; i++) {
        tbuf *tb = o->tb[i];
        if (run == 0) {
            o->first[i] = malloc(tb->total);
            memcpy(o->first[i], tb->full, tb->total);
            continue;
        }
        /* pads and canaries are h_check_all's; Check is slow at assertions that pass, hence the ifs */
        for (size_t b = 0; b < tb->total; b++) {
            const unsigned char was = o->first[i][b], now = tb->full[b];
            if (!tb->logical[b]) continue;
            if (o->keep[i] && o->keep[i][b]) {
                if (was != poison_byte(b, 0) || now != poison_byte(b, 1))
                    HCHECK(0, "%s: '%s' byte %zu must be left alone, but holds 0x%02x after run 1 "
                              "(poison 0x%02x) and 0x%02x after run 2 (poison 0x%02x)",
                           o->what, tb->name, b, was, poison_byte(b, 0), now, poison_byte(b, 1));
            } else if (now != was) {
                HCHECK(0, "%s: '%s' byte %zu differs between run 1 (1 thread) and run 2 (2 threads) "
                          "(0x%02x vs 0x%02x; the poison was 0x%02x, then 0x%02x)",
                       o->what, tb->name, b, was, now, poison_byte(b, 0), poison_byte(b, 1));
            }
        }
        free(o->first[i]);
        free(o->keep[i]);
        o->first[i] = o->keep[i] = NULL;
    }
}

/* `call` in each run, its outputs `o` poisoned before it and compared after */
#define EACH_RUN(o, call)                                                                          \
    for (int run_ = 0; run_ < RUNS; run_++) {                                                      \
        begin_run(&(o), run_);                                                                     \
        HCHECK(CALL(call) == MOEFUSE_OK, "%s: %s", (o).what, moefuse_last_error(g_ctx));           \
        end_run(&(o), run_);                                                                       \
    }

/* Marks the bytes of element (i0, i1, i2) of tb as ones the call may leave alone. */
static void keep_element(unsigned char *keep, tbuf *tb, int64_t i0, int64_t i1, int64_t i2)
{
    size_t at = (size_t)((unsigned char *)tb_el(tb, i0, i1, i2) - tb->full);
    memset(keep + at, 1, moefuse_dtype_size(tb->t.dtype));
}

START_TEST(t_act_quant)
{
    tbuf *x = tb_upload_unif(tb_new2("x", MOEFUSE_BF16, 67, 512, 1, 1), -4, 4);
    tbuf *q = tb_new2("q", MOEFUSE_F8_E4M3, 67, 256, 0, 0);
    tbuf *sc = h_new_scales("scales", MOEFUSE_SCALE_PACKED_UE8M0, 0, 0, 67, 8, 0);
    moefuse_act_quant_options o = {0};
    o.quant.group_size = 32;
    o.quant.scale_layout = MOEFUSE_SCALE_PACKED_UE8M0;
    o.act.activation = MOEFUSE_ACT_GELU;
    outputs out = outputs_of("act_quant", q, sc, NULL, NULL);
    EACH_RUN(out, moefuse_act_quant(g_ctx, T(x), NULL, T(q), T(sc), &o));

    /* masked: rows t >= counts[e] are not written (no zero_tail) */
    const int64_t E = 4, Tm = 33, H = 128, Gn = 2;
    tbuf *x3 = tb_upload_unif(tb_new3("x3", MOEFUSE_F32, E, Tm, 2 * H, 0, 1), -3, 3);
    tbuf *cn = tb_new1("counts", MOEFUSE_I32, E, 1);
    for (int e = 0; e < E; e++) tb_set(cn, e, 0, 0, (double)(e * 11 % 40));
    tb_upload(cn);
    tbuf *q3 = tb_new3("q3", MOEFUSE_F8_E4M3, E, Tm, H, 0, 0);
    tbuf *s3 = h_new_scales("s3", MOEFUSE_SCALE_COLUMN_MAJOR, 0, E, Tm, Gn, 0);
    moefuse_act_quant_options o3 = {0};
    o3.quant.group_size = 64;
    o3.quant.scale_layout = MOEFUSE_SCALE_COLUMN_MAJOR;
    outputs out3 = outputs_of("act_quant_masked", q3, s3, NULL, NULL);
    out3.keep[0] = calloc(q3->total, 1);
    out3.keep[1] = calloc(s3->total, 1);
    for (int64_t e = 0; e < E; e++)
        for (int64_t t = e * 11 % 40; t < Tm; t++) {
            for (int64_t c = 0; c < H; c++) keep_element(out3.keep[0], q3, e, t, c);
            for (int64_t g = 0; g < Gn; g++) keep_element(out3.keep[1], s3, e, g, t);
        }
    EACH_RUN(out3, moefuse_act_quant_masked(g_ctx, T(x3), T(cn), NULL, NULL, T(q3), T(s3), &o3));
}
END_TEST

START_TEST(t_moe)
{
    const int64_t M = 37, K = 96, I = 80, E = 5, k = 3;
    moefuse_dtype dts[2] = {MOEFUSE_F32, MOEFUSE_BF16};
    for (int d = 0; d < 2; d++) {
        moefuse_dtype dt = dts[d];
        tbuf *x = tb_upload_unif(tb_new2("x", dt, M, K, 0, 1), -1, 1);
        tbuf *w1 = tb_upload_unif(tb_new3("w1", dt, E, 2 * I, K, 0, 1), -0.2, 0.2);
        tbuf *w2 = tb_upload_unif(tb_new3("w2", dt, E, K, I, 0, 1), -0.2, 0.2);
        tbuf *b1 = tb_upload_unif(tb_new2("b1", dt, E, 2 * I, 0, 1), -0.2, 0.2);
        tbuf *b2 = tb_upload_unif(tb_new2("b2", dt, E, K, 0, 1), -0.2, 0.2);
        tbuf *wt = tb_upload_unif(tb_new2("wts", MOEFUSE_F32, M, k, 0, 1), 0, 1);
        tbuf *ids = tb_new2("ids", MOEFUSE_I32, M, k, 0, 1); /* drawn after the weights */
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < k; j++) tb_set(ids, m, j, 0, (double)h_randint(-1, E));
        tb_upload(ids);
        moefuse_routing R;
        memset(&R, 0, sizeof R);
        R.topk_ids = ids->t;
        R.topk_weights = wt->t;
        tbuf *h = tb_new3("h", dt, M, k, I, 0, 0);
        tbuf *out = tb_new2("out", dt, M, K, 0, 0);
        tbuf *y = tb_new3("y", MOEFUSE_F32, M, k, K, 0, 0);
        tbuf *fo = tb_new2("fwd", dt, M, K, 0, 0);
        outputs gate = outputs_of("moe_gate", h, NULL, NULL, NULL);
        EACH_RUN(gate, moefuse_moe_gate(g_ctx, T(x), T(w1), T(b1), &R, T(h), NULL));
        /* h now holds the gate's result: the final's input */
        outputs final = outputs_of("moe_final", out, NULL, NULL, NULL);
        EACH_RUN(final, moefuse_moe_final(g_ctx, T(h), T(w2), T(b2), &R, T(out), NULL));
        if (dt == MOEFUSE_F32) { /* un-reduced y must have h's dtype */
            outputs unreduced = outputs_of("moe_final unreduced", y, NULL, NULL, NULL);
            EACH_RUN(unreduced, moefuse_moe_final(g_ctx, T(h), T(w2), T(b2), &R, T(y), NULL));
        }
        outputs forward = outputs_of("moe_forward", fo, NULL, NULL, NULL);
        EACH_RUN(forward,
                 moefuse_moe_forward(g_ctx, T(x), T(w1), T(w2), T(b1), T(b2), &R, T(fo), NULL));
        tb_free_all();
    }
}
END_TEST

START_TEST(t_topk)
{
    tbuf *lg = tb_upload_unif(tb_new2("logits", MOEFUSE_F32, 200, 16, 0, 1), -3, 3);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, 200, 4, 0, 0);
    tbuf *w = tb_new2("w", MOEFUSE_F32, 200, 4, 0, 0);
    outputs out = outputs_of("topk", ids, w, NULL, NULL);
    EACH_RUN(out, moefuse_topk_softmax(g_ctx, T(lg), 1, T(ids), T(w)));
}
END_TEST

int main(void)
{
    /* Only the cpu backend's test is about threads: without OpenMP it would prove nothing. */
    if (!h_have_openmp() && strcmp(h_backend(), "cpu") == 0) {
        printf("SKIP: built without OpenMP: the cpu backend has one thread, so there is no "
               "thread-count determinism to test\n");
        return 77;
    }
    Suite *s = suite_create("determinism");
    TCase *tc = h_add_tcase(s, "determinism", h_setup, 120);
    tcase_add_test(tc, t_act_quant);
    tcase_add_test(tc, t_moe);
    tcase_add_test(tc, t_topk);
    return h_run(s);
}
