/*
 * test_cuda_tiles' FP8 part: the Hopper FP8 GEMM (src/cuda/moe_fp8_ws.cu) gives a row the
 * same bytes whether its tile is a half tile (at most 64 slots: both warpgroups on rows 0..63,
 * each on 128 of the 256 weight rows, the gate's row amax met across them) or a full one
 * (each warpgroup its own 64 rows by all 256 weight rows). Every output of a row is a sum of
 * that row's products alone, so the tile it shares must not change a bit of it.
 *
 * Routed (top-1, so that every token's expert is chosen): tokens T (n of them, n <= 64) alone
 * on expert 1 make a half tile; the same T among 128 tokens of expert 1 make a full one; the
 * 128 and T again (129 to 192 rows) make a full tile and a half one after it. Expert 2 does
 * the same with other tokens; expert 0 has none. Their h codes, h scales, reduced out and
 * un-reduced y must be equal byte for byte, and the half-tile call's outputs start from other
 * poison than the others'. K = 384 leaves the final's second column block half past the
 * output (its second wave's rows are zeros). A wide gate (I = 9216: 144 column blocks) gives
 * each block several half tiles in a row, where the amax exchange's shared memory is reused.
 * Masked: experts 0 and 1 have the same weights and the same first n rows of x, with counts
 * n and 128: their first n rows of out must be equal.
 *
 * The large-tile kernel is forced (MOEFUSE_CUDA_FP8=wgmma), with A gathered and by TMA.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "test_cuda_tiles.h"

enum { FE = 3, FK = 384, FBLK = 128, FULL = 128 };

/* g_ctx on the large FP8 tile with A loaded as `a_load` says; the switches' values restored. */
static void setup_fp8(const char *a_load)
{
    const char *names[2] = {"MOEFUSE_CUDA_FP8", "MOEFUSE_CUDA_FP8_A"};
    const char *values[2] = {"wgmma", a_load};
    char *saved[2];
    for (int i = 0; i < 2; i++) {
        const char *was = getenv(names[i]);
        saved[i] = was ? strdup(was) : NULL;
        setenv(names[i], values[i], 1);
    }
    h_setup();
    for (int i = 0; i < 2; i++) {
        if (saved[i])
            setenv(names[i], saved[i], 1);
        else
            unsetenv(names[i]);
        free(saved[i]);
    }
}
static void setup_gather(void) { setup_fp8("gather"); }
static void setup_tma(void) { setup_fp8("tma"); }

typedef struct {
    tbuf *w1, *w1s, *w2, *w2s, *b1, *b2;
} weights;

/* Random e4m3 codes, none of them NaN (0x7F, 0xFF). */
static void fill_codes(tbuf *tb, int64_t a, int64_t b, int64_t c)
{
    for (int64_t i = 0; i < a; i++)
        for (int64_t j = 0; j < b; j++)
            for (int64_t k = 0; k < c; k++) {
                uint8_t v = (uint8_t)h_randint(0, 255);
                if ((v & 0x7F) == 0x7F)
                    v ^= 1;
                *(uint8_t *)tb_el(tb, i, j, k) = v;
            }
}

/* Block scales near 1 / (64 sqrt(depth)): f32, or UE8M0 exponents. */
static void fill_block_scales(tbuf *tb, int64_t a, int64_t b, int64_t c, int64_t depth)
{
    const double base = 1.0 / (64.0 * sqrt((double)depth));
    for (int64_t i = 0; i < a; i++)
        for (int64_t j = 0; j < b; j++)
            for (int64_t k = 0; k < c; k++) {
                if (tb->t.dtype == MOEFUSE_U8)
                    *(uint8_t *)tb_el(tb, i, j, k) =
                        (uint8_t)(127 + (int)floor(log2(base)) + (int)h_randint(0, 1));
                else
                    tb_set(tb, i, j, k, base * h_unif(0.5, 1.5));
            }
}

/* E experts' weights of I h columns; `same`: expert 1's bytes are expert 0's (the masked case). */
static weights new_weights(int64_t E, int64_t I, moefuse_dtype wsdt, int bias, int same)
{
    weights W;
    W.w1 = tb_new3("w1", MOEFUSE_F8_E4M3, E, 2 * I, FK, 0, 1);
    W.w1s = tb_new3("w1_scales", wsdt, E, 2 * I / FBLK, FK / FBLK, 0, 1);
    W.w2 = tb_new3("w2", MOEFUSE_F8_E4M3, E, FK, I, 0, 1);
    W.w2s = tb_new3("w2_scales", wsdt, E, FK / FBLK, I / FBLK, 0, 1);
    fill_codes(W.w1, E, 2 * I, FK);
    fill_codes(W.w2, E, FK, I);
    fill_block_scales(W.w1s, E, 2 * I / FBLK, FK / FBLK, FK);
    fill_block_scales(W.w2s, E, FK / FBLK, I / FBLK, I);
    W.b1 = W.b2 = NULL;
    if (bias) {
        W.b1 = tb_new2("b1", MOEFUSE_F32, E, 2 * I, 0, 1);
        W.b2 = tb_new2("b2", MOEFUSE_F32, E, FK, 0, 1);
        tb_fill_unif(W.b1, -0.5, 0.5);
        tb_fill_unif(W.b2, -0.5, 0.5);
    }
    tbuf *all[6] = {W.w1, W.w1s, W.w2, W.w2s, W.b1, W.b2};
    for (int i = 0; i < 6; i++) {
        if (!all[i])
            continue;
        const size_t esz = all[i]->t.dtype == MOEFUSE_F32 ? 4 : 1;
        if (same)
            memcpy(tb_el(all[i], 1, 0, 0), tb_el(all[i], 0, 0, 0),
                   (size_t)all[i]->t.stride[0] * esz);
        tb_upload(all[i]);
    }
    return W;
}

typedef struct {
    moefuse_dtype wsdt, odt;
    int ue8m0, bias;
    int64_t I; /* h columns: 128 x the gate's column blocks */
} fp8_case;

static moefuse_fp8_moe_options options(fp8_case c)
{
    moefuse_fp8_moe_options o;
    memset(&o, 0, sizeof o);
    o.act.scale_layout = MOEFUSE_SCALE_ROW_MAJOR;
    o.act.ue8m0 = c.ue8m0;
    return o;
}

/* The bytes of a row in a half tile (pa) and in a full one (pb), or a failure naming them. */
static int same_row(const void *pa, const void *pb, size_t bytes, const char *what,
                    const char *name, int64_t row)
{
    for (size_t i = 0; i < bytes; i++)
        if (((const uint8_t *)pa)[i] != ((const uint8_t *)pb)[i]) {
            HCHECK(0, "%s: byte %zu of %s row %lld is 0x%02x in a half tile, 0x%02x in a full one",
                   what, i, name, (long long)row, ((const uint8_t *)pa)[i],
                   ((const uint8_t *)pb)[i]);
            return 0;
        }
    return 1;
}

typedef struct {
    tbuf *ids, *wts, *h, *hs, *out, *y;
} routed_call;

/* An output whose poison differs in every byte from a fresh tbuf's (the half-tile call's). */
static tbuf *repoison(tbuf *tb)
{
    for (size_t b = 0; b < tb->total; b++)
        if (tb->logical[b])
            tb->full[b] ^= 0xA5;
    tb_upload(tb);
    return tb;
}

/*
 * Gate, then the final reduced and un-reduced, on M tokens of x (bf16), token m on expert
 * expert_of[m] with weight wt[m]; `flip`: outputs with the other poison.
 */
static routed_call run_routed(const weights *W, fp8_case c, int64_t M, const int32_t *expert_of,
                              const float *wt, tbuf *x, int flip, const char *what)
{
    routed_call r;
    r.ids = tb_new2("topk_ids", MOEFUSE_I32, M, 1, 0, 1);
    r.wts = tb_new2("topk_weights", MOEFUSE_F32, M, 1, 0, 1);
    for (int64_t m = 0; m < M; m++) {
        tb_set(r.ids, m, 0, 0, expert_of[m]);
        tb_set(r.wts, m, 0, 0, wt[m]);
    }
    tb_upload(r.ids);
    tb_upload(r.wts);
    r.h = tb_new3("h", MOEFUSE_F8_E4M3, M, 1, c.I, 0, 0);
    r.hs = h_new_scales("h_scales", MOEFUSE_SCALE_ROW_MAJOR, c.ue8m0, 0, M, c.I / FBLK, 0);
    r.out = tb_new2("out", c.odt, M, FK, 0, 0);
    r.y = tb_new3("y", c.odt, M, 1, FK, 0, 0);
    if (flip) {
        repoison(r.h);
        repoison(r.hs);
        repoison(r.out);
        repoison(r.y);
    }
    moefuse_routing R;
    memset(&R, 0, sizeof R);
    R.topk_ids = r.ids->t;
    R.topk_weights = r.wts->t;
    const moefuse_fp8_moe_options o = options(c);
    moefuse_status st = CALL(moefuse_moe_gate_fp8(g_ctx, T(x), NULL, T(W->w1), T(W->w1s),
                                                  T(W->b1), &R, T(r.h), T(r.hs), &o));
    HCHECK(st == MOEFUSE_OK, "%s: gate: %s", what, moefuse_last_error(g_ctx));
    h_check_all(0);
    st = CALL(moefuse_moe_final_fp8(g_ctx, T(r.h), T(r.hs), T(W->w2), T(W->w2s), T(W->b2), &R,
                                    T(r.out), &o));
    HCHECK(st == MOEFUSE_OK, "%s: final: %s", what, moefuse_last_error(g_ctx));
    h_check_all(0);
    st = CALL(moefuse_moe_final_fp8(g_ctx, T(r.h), T(r.hs), T(W->w2), T(W->w2s), T(W->b2), &R,
                                    T(r.y), &o));
    HCHECK(st == MOEFUSE_OK, "%s: final, un-reduced: %s", what, moefuse_last_error(g_ctx));
    h_check_all(0);
    return r;
}

/* Row ra of call a against row rb of call b: h, h scales, out and y. */
static int same_token(const routed_call *a, int64_t ra, const routed_call *b, int64_t rb,
                      fp8_case c, const char *what)
{
    const size_t osz = c.odt == MOEFUSE_F32 ? 4 : 2, ssz = c.ue8m0 ? 1 : 4;
    return same_row(tb_el(a->h, ra, 0, 0), tb_el(b->h, rb, 0, 0), (size_t)c.I, what, "h", ra) &&
           same_row(tb_el(a->hs, ra, 0, 0), tb_el(b->hs, rb, 0, 0), ssz * (size_t)(c.I / FBLK),
                    what, "h_scales", ra) &&
           same_row(tb_el(a->out, ra, 0, 0), tb_el(b->out, rb, 0, 0), osz * FK, what, "out", ra) &&
           same_row(tb_el(a->y, ra, 0, 0), tb_el(b->y, rb, 0, 0), osz * FK, what, "y", ra);
}

/*
 * n tokens of expert 1 and n2 of expert 2 alone (half tiles, call a); among 128 of each (full
 * tiles, call b: a's tokens first, with the same router weights); then b's tokens and a's
 * again (a full tile and a half one after it on each expert, call c).
 */
static void routed_case(fp8_case c, int64_t n, int64_t n2)
{
    const char *what = h_fmt("routed n=%lld,%lld I=%lld ws=%d odt=%d ue8m0=%d bias=%d",
                             (long long)n, (long long)n2, (long long)c.I, c.wsdt, c.odt,
                             c.ue8m0, c.bias);
    char at[160];
    snprintf(at, sizeof at, "%s", what); /* h_fmt's buffers are reused */
    const weights W = new_weights(FE, c.I, c.wsdt, c.bias, 0);
    const int64_t Ma = n + n2, Mb = 2 * FULL, Mc = Mb + Ma;
    int32_t *ex = malloc(sizeof(int32_t) * (size_t)Mc);
    float *wt = malloc(sizeof(float) * (size_t)Mc);
    tbuf *xa = tb_new2("x_half", MOEFUSE_BF16, Ma, FK, 0, 1);
    tbuf *xb = tb_new2("x_full", MOEFUSE_BF16, Mb, FK, 0, 1);
    tbuf *xc = tb_new2("x_both", MOEFUSE_BF16, Mc, FK, 0, 1);
    tb_fill_unif(xa, -1.0, 1.0);
    tb_fill_unif(xb, -1.0, 1.0);
    /* x_half: T (expert 1) then U (expert 2); x_full: T, U, then expert 1's and 2's others;
     * x_both: x_full, then x_half again */
    for (int64_t m = 0; m < Mb; m++) {
        ex[m] = m < Ma ? (m < n ? 1 : 2) : (m - Ma < FULL - n ? 1 : 2);
        wt[m] = (float)h_unif(0.05, 1.0);
        if (m < Ma)
            memcpy(tb_el(xb, m, 0, 0), tb_el(xa, m, 0, 0), FK * 2);
    }
    for (int64_t m = 0; m < Mc; m++) {
        if (m >= Mb) {
            ex[m] = ex[m - Mb];
            wt[m] = wt[m - Mb];
        }
        memcpy(tb_el(xc, m, 0, 0), m < Mb ? tb_el(xb, m, 0, 0) : tb_el(xa, m - Mb, 0, 0), FK * 2);
    }
    tb_upload(xa);
    tb_upload(xb);
    tb_upload(xc);
    const routed_call a = run_routed(&W, c, Ma, ex, wt, xa, 1, at);
    const routed_call b = run_routed(&W, c, Mb, ex, wt, xb, 0, at);
    const routed_call cc = run_routed(&W, c, Mc, ex, wt, xc, 0, at);
    int ok = 1;
    for (int64_t m = 0; ok && m < Ma; m++)
        ok = same_token(&a, m, &b, m, c, at) && same_token(&a, m, &cc, Mb + m, c, at);
    for (int64_t m = 0; ok && m < Mb; m++)
        ok = same_token(&b, m, &cc, m, c, at);
    free(ex), free(wt);
    tb_free_all();
}

/* Masked: expert 0's first n rows (its half tile) against expert 1's (the same weights and
 * rows, in a full tile of 128). */
static void masked_case(fp8_case c, int64_t n)
{
    const char *what = h_fmt("masked n=%lld I=%lld ws=%d odt=%d ue8m0=%d bias=%d", (long long)n,
                             (long long)c.I, c.wsdt, c.odt, c.ue8m0, c.bias);
    char at[128];
    snprintf(at, sizeof at, "%s", what);
    const weights W = new_weights(2, c.I, c.wsdt, c.bias, 1);
    tbuf *x = tb_new3("x", MOEFUSE_BF16, 2, FULL, FK, 0, 1);
    tb_fill_unif(x, -1.0, 1.0);
    for (int64_t t = 0; t < n; t++)
        memcpy(tb_el(x, 0, t, 0), tb_el(x, 1, t, 0), FK * 2);
    tb_upload(x);
    tbuf *counts = tb_new1("counts", MOEFUSE_I32, 2, 1);
    tb_set(counts, 0, 0, 0, (double)n);
    tb_set(counts, 1, 0, 0, FULL);
    tb_upload(counts);
    tbuf *out = tb_new3("out", c.odt, 2, FULL, FK, 0, 0);
    const moefuse_fp8_moe_options o = options(c);
    const moefuse_status st = CALL(moefuse_moe_masked_fp8(g_ctx, T(x), NULL, T(counts), T(W.w1),
                                                          T(W.w1s), T(W.w2), T(W.w2s), T(W.b1),
                                                          T(W.b2), T(out), &o));
    HCHECK(st == MOEFUSE_OK, "%s: %s", at, moefuse_last_error(g_ctx));
    h_check_all(0);
    const size_t osz = c.odt == MOEFUSE_F32 ? 4 : 2;
    for (int64_t t = 0; t < n; t++)
        if (!same_row(tb_el(out, 0, t, 0), tb_el(out, 1, t, 0), osz * FK, at, "out", t))
            break;
    tb_free_all();
}

static const fp8_case CASES[] = {
    {MOEFUSE_F32, MOEFUSE_BF16, 0, 0, 256},
    {MOEFUSE_U8, MOEFUSE_F32, 1, 1, 256},
};

START_TEST(fp8_half_tiles)
{
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        routed_case(CASES[i], 1, 64);
        routed_case(CASES[i], 37, 16);
        routed_case(CASES[i], 64, 33);
        masked_case(CASES[i], 1);
        masked_case(CASES[i], 40);
        masked_case(CASES[i], 64);
    }
    /* 144 gate column blocks: more half tiles than an H100 or H200 has SMs */
    routed_case((fp8_case){MOEFUSE_F32, MOEFUSE_BF16, 0, 1, 144 * 128}, 20, 50);
}
END_TEST

void cuda_tiles_fp8_tests(Suite *s)
{
    TCase *tc = h_add_tcase(s, "fp8_gather", setup_gather, 120);
    tcase_add_test(tc, fp8_half_tiles);
    tc = h_add_tcase(s, "fp8_tma", setup_tma, 120);
    tcase_add_test(tc, fp8_half_tiles);
}
