/*
 * The warp-specialised Hopper GEMM (src/cuda/moe_ws.cu) against the wgmma tile
 * (src/cuda/moe_wgmma.cu), bit for bit. moe_ws.cu splits a tile of at most 64 slots by
 * columns (each warpgroup m64n128 on all 64 rows, the gate's weight rows staged in boxes of
 * 64 for it); moe_wgmma.cu multiplies every tile m64n256. Both add each output's products in
 * the same k16 steps, in order, so they must agree in every byte of h, y and the reduced out.
 *
 * Experts get 1, 63, 64, 65, 127, 128, 129, 191, 192, 200, 0 and 37 slots (half tiles, full
 * tiles, a full tile then a half one, an empty expert), plus invalid slots; bf16 and f16;
 * depths and widths that fill whole tiles and ragged ones; biases, both gate orders that
 * moe_ws.cu takes, and the output forms. The wgmma side's outputs start from other poison
 * than the ws side's, so a byte that neither writes fails too.
 *
 * test_cuda_tiles_fp8.c holds the FP8 kernel's half tiles to its full ones the same way.
 *
 * Runs on "cuda" only, on a Hopper GPU (sm_90a code); elsewhere it skips, saying why.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "test_cuda_tiles.h"

static const int64_t COUNTS[] = {1, 63, 64, 65, 127, 128, 129, 191, 192, 200, 0, 37};
enum { E = sizeof COUNTS / sizeof COUNTS[0], TOPK = 2, INVALID = 3 };

/* g_ctx forced onto moe_ws.cu, g_ref onto moe_wgmma.cu; the switch's own value is restored. */
static void setup(void)
{
    const char *was = getenv("MOEFUSE_CUDA_GEMM");
    char *saved = was ? strdup(was) : NULL;
    setenv("MOEFUSE_CUDA_GEMM", "ws", 1);
    h_setup();
    setenv("MOEFUSE_CUDA_GEMM", "wgmma", 1);
    const moefuse_status st = moefuse_context_create(&g_ref, "cuda");
    ck_assert_msg(st == MOEFUSE_OK && g_ref, "context_create(cuda, wgmma): %s",
                  moefuse_last_error(NULL));
    if (saved)
        setenv("MOEFUSE_CUDA_GEMM", saved, 1);
    else
        unsetenv("MOEFUSE_CUDA_GEMM");
    free(saved);
}

/* An input of both sides: uniform values in [-a, a]. */
static tbuf *input(tbuf *tb, double a)
{
    tb_fill_unif(tb, -a, a);
    tb_twin(tb, g_ref);
    tb_upload(tb);
    return tb;
}

/* An output of both sides, the wgmma side's poison every byte unlike the ws side's. */
static tbuf *output(tbuf *tb)
{
    tbuf *tw = tb_twin(tb, g_ref);
    for (size_t b = 0; b < tw->total; b++)
        if (tw->logical[b])
            tw->full[b] ^= 0xA5;
    tb_upload(tw);
    return tb;
}

static void same_bytes(const tbuf *tb, const char *what)
{
    for (size_t b = 0; b < tb->total; b++)
        if (tb->logical[b] && tb->full[b] != tb->twin->full[b]) {
            HCHECK(0, "%s: byte %zu of %s is 0x%02x on moe_ws.cu, 0x%02x on moe_wgmma.cu", what,
                   b - tb->pad, tb->name, tb->full[b], tb->twin->full[b]);
            return;
        }
}

/* Slot ids: COUNTS[e] slots of expert e and INVALID invalid ones, in a random order. */
static int64_t routing(tbuf **ids, tbuf **wts)
{
    int64_t S = INVALID;
    for (int e = 0; e < E; e++)
        S += COUNTS[e];
    S += S % TOPK;
    int32_t *list = malloc(sizeof(int32_t) * (size_t)S);
    int64_t n = 0;
    for (int e = 0; e < E; e++)
        for (int64_t i = 0; i < COUNTS[e]; i++)
            list[n++] = e;
    for (; n < S; n++) /* below 0, or a global id past the E experts */
        list[n] = n % 2 ? -1 : E + (int32_t)n;
    for (int64_t i = S - 1; i > 0; i--) {
        const int64_t j = h_randint(0, i);
        const int32_t t = list[i];
        list[i] = list[j], list[j] = t;
    }
    const int64_t M = S / TOPK;
    *ids = tb_new2("topk_ids", MOEFUSE_I32, M, TOPK, 0, 1);
    *wts = tb_new2("topk_weights", MOEFUSE_F32, M, TOPK, 0, 1);
    for (int64_t s = 0; s < S; s++) {
        tb_set(*ids, s / TOPK, s % TOPK, 0, list[s]);
        tb_set(*wts, s / TOPK, s % TOPK, 0, h_unif(0.05, 1));
    }
    free(list);
    tb_twin(*ids, g_ref);
    tb_twin(*wts, g_ref);
    tb_upload(*ids);
    tb_upload(*wts);
    return M;
}

typedef struct {
    moefuse_dtype dt, odt;
    int64_t K, I;
    int bias, order, reduce;
} shape;

static void run(shape c)
{
    tbuf *ids, *wts;
    const int64_t M = routing(&ids, &wts), K = c.K, I = c.I;
    tbuf *x = input(tb_new2("x", c.dt, M, K, 0, 1), 1.0);
    tbuf *w1 = input(tb_new3("w1", c.dt, E, 2 * I, K, 0, 1), 2.0 / sqrt((double)K));
    tbuf *w2 = input(tb_new3("w2", c.dt, E, K, I, 0, 1), 2.0 / sqrt((double)I));
    tbuf *b1 = c.bias ? input(tb_new2("b1", c.dt, E, 2 * I, 0, 1), 0.5) : NULL;
    tbuf *b2 = c.bias ? input(tb_new2("b2", c.dt, E, K, 0, 1), 0.5) : NULL;
    tbuf *h = output(tb_new3("h", c.dt, M, TOPK, I, 0, 0));
    tbuf *out = output(c.reduce ? tb_new2("out", c.odt, M, K, 0, 0)
                                : tb_new3("y", c.odt, M, TOPK, K, 0, 0));
    moefuse_routing R, Rw;
    memset(&R, 0, sizeof R);
    R.topk_ids = ids->t;
    R.topk_weights = wts->t;
    Rw = R;
    Rw.topk_ids = ids->twin->t;
    Rw.topk_weights = wts->twin->t;
    const moefuse_moe_options o = {.order = c.order};
    const char *what = h_fmt("K=%lld I=%lld dt=%d odt=%d bias=%d order=%d reduce=%d",
                             (long long)K, (long long)I, c.dt, c.odt, c.bias, c.order, c.reduce);
    char at[128];
    snprintf(at, sizeof at, "%s", what); /* h_fmt's buffers are reused */
#define B(tb) ((tb) ? &(tb)->twin->t : NULL)
    moefuse_status st = CALL(moefuse_moe_gate(g_ctx, T(x), T(w1), T(b1), &R, T(h), &o));
    HCHECK(st == MOEFUSE_OK, "%s: gate on ws: %s", at, moefuse_last_error(g_ctx));
    st = CALL(moefuse_moe_gate(g_ref, B(x), B(w1), B(b1), &Rw, B(h), &o));
    HCHECK(st == MOEFUSE_OK, "%s: gate on wgmma: %s", at, moefuse_last_error(g_ref));
    h_check_all(0);
    same_bytes(h, at);
    st = CALL(moefuse_moe_final(g_ctx, T(h), T(w2), T(b2), &R, T(out), &o));
    HCHECK(st == MOEFUSE_OK, "%s: final on ws: %s", at, moefuse_last_error(g_ctx));
    st = CALL(moefuse_moe_final(g_ref, B(h), B(w2), B(b2), &Rw, B(out), &o));
    HCHECK(st == MOEFUSE_OK, "%s: final on wgmma: %s", at, moefuse_last_error(g_ref));
#undef B
    h_check_all(0);
    same_bytes(out, at);
    tb_free_all();
}

/* Whole tiles: K and I multiples of 256, the final's rows straight from the registers. */
START_TEST(whole_tiles)
{
    run((shape){MOEFUSE_BF16, MOEFUSE_BF16, 512, 256, 0, MOEFUSE_GATE_FIRST, 0});
    run((shape){MOEFUSE_BF16, MOEFUSE_F32, 512, 256, 1, MOEFUSE_UP_FIRST, 0});
    run((shape){MOEFUSE_BF16, MOEFUSE_BF16, 512, 256, 1, MOEFUSE_GATE_FIRST, 1});
    run((shape){MOEFUSE_F16, MOEFUSE_F16, 512, 256, 1, MOEFUSE_GATE_FIRST, 0});
}
END_TEST

/* Ragged depth and columns (multiples of 8, as moe_ws.cu's 16-byte rows want): the last
 * column blocks are partial, the last depth tile short. (The interleaved gate order never
 * reaches moe_ws.cu: its 64-row boxes would mix gate and up rows.) */
START_TEST(ragged_tiles)
{
    run((shape){MOEFUSE_BF16, MOEFUSE_BF16, 264, 200, 1, MOEFUSE_GATE_FIRST, 0});
    run((shape){MOEFUSE_F16, MOEFUSE_F32, 264, 200, 0, MOEFUSE_UP_FIRST, 1});
    run((shape){MOEFUSE_BF16, MOEFUSE_BF16, 392, 136, 1, MOEFUSE_UP_FIRST, 1});
}
END_TEST

int main(void)
{
    if (strcmp(h_backend(), "cuda") != 0) {
        printf("SKIP: a test of the cuda backend, run with MOEFUSE_TEST_BACKEND=%s\n",
               h_backend());
        return 77;
    }
    char name[256]; /* (no context: h_run skips, saying why) */
    if (h_probe_backend("cuda", name, sizeof name) == MOEFUSE_OK && !strstr(name, ", sm_90")) {
        printf("SKIP: %s is no Hopper GPU: moe_ws.cu and moe_wgmma.cu run on sm_90a only\n",
               name);
        return 77;
    }
    Suite *s = suite_create("cuda_tiles");
    TCase *tc = h_add_tcase(s, "cuda_tiles", setup, 120);
    tcase_add_test(tc, whole_tiles);
    tcase_add_test(tc, ragged_tiles);
    cuda_tiles_fp8_tests(s);
    return h_run(s);
}
