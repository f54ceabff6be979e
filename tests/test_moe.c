/* MoE gate / final / forward against the float64 oracle. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

typedef struct {
    moefuse_dtype xdt, hdt, odt;
    int64_t M, K, I, E, k, Eg;
    int use_map, bias, reduce, act, order;
    float limit;
    int invalid; /* inject -1 and >= Eg ids */
    int dense;   /* no row padding: rows stay 16-byte aligned when K and I are multiples of 8 */
    float alpha, up_offset;
} cfg;

static double *get_all(tbuf *tb, int64_t n0, int64_t n1, int64_t n2)
{
    double *v = malloc(sizeof(double) * (size_t)(n0 * n1 * n2 + 1));
    for (int64_t a = 0; a < n0; a++)
        for (int64_t b = 0; b < n1; b++)
            for (int64_t c = 0; c < n2; c++) v[(a * n1 + b) * n2 + c] = tb_get(tb, a, b, c);
    return v;
}

/* extra_dt: a dtype an intermediate was rounded to (moe_forward's h), or -1 */
static void cmp_norm2(const char *what, const cfg *c, tbuf *out, const double *ref, int64_t n0, int64_t n1,
                      int64_t n2, const int64_t *valid, int rows_are_slots, int extra_dt)
{
    double bnd = h_gemm_bound(out->t.dtype), floor = h_gemm_floor(out->t.dtype);
    if (extra_dt >= 0) {
        bnd = fmax(bnd, h_gemm_bound((moefuse_dtype)extra_dt));
        floor = fmax(floor, h_gemm_floor((moefuse_dtype)extra_dt));
    }
    double *got = get_all(out, n0, n1, n2);
    for (int64_t a = 0; a < n0; a++)
        for (int64_t b = 0; b < n1; b++)
            for (int64_t d = 0; d < n2; d++) {
                const double v = got[(a * n1 + b) * n2 + d];
                HCHECK(isfinite(v), "%s: non-finite output at [%lld,%lld,%lld]", what, (long long)a, (long long)b, (long long)d);
                if (rows_are_slots && valid[a * n1 + b] < 0)
                    HCHECK(v == 0.0, "%s: invalid slot (m=%lld, j=%lld) row not zero: %g", what, (long long)a, (long long)b, v);
            }
    const double rel = h_rel_err_floor(got, ref, (size_t)(n0 * n1 * n2), floor);
    free(got);
    HCHECK(rel <= bnd, "%s [M=%lld K=%lld I=%lld E=%lld k=%lld xdt=%d map=%d bias=%d act=%d alpha=%g beta=%g ord=%d lim=%g]: rel err %.3g > %.3g",
           what, (long long)c->M, (long long)c->K, (long long)c->I, (long long)c->E, (long long)c->k, c->xdt,
           c->use_map, c->bias, c->act, c->alpha, c->up_offset, c->order, c->limit, rel, bnd);
}
static void cmp_norm(const char *what, const cfg *c, tbuf *out, const double *ref, int64_t n0, int64_t n1,
                     int64_t n2, const int64_t *valid, int rows_are_slots)
{
    cmp_norm2(what, c, out, ref, n0, n1, n2, valid, rows_are_slots, -1);
}

static void run(cfg c)
{
    int64_t M = c.M, K = c.K, I = c.I, E = c.E, k = c.k, Eg = c.use_map ? c.Eg : E;
#define RP(n) (c.dense ? 0 : (n)) /* a tensor's row padding */
    double sx = 1.0, sw = 1.0 / sqrt((double)K), sw2 = 1.0 / sqrt((double)I);
    tbuf *x = tb_upload_unif(tb_new2("x", c.xdt, M, K, RP(3), 1), -sx, sx);
    tbuf *w1 = tb_upload_unif(tb_new3("w1", c.xdt, E, 2 * I, K, RP(1), 1), -2 * sw, 2 * sw);
    tbuf *w2 = tb_upload_unif(tb_new3("w2", c.hdt, E, K, I, 0, 1), -2 * sw2, 2 * sw2);
    tbuf *b1 = NULL, *b2 = NULL;
    if (c.bias) {
        b1 = tb_upload_unif(tb_new2("b1", c.xdt, E, 2 * I, RP(2), 1), -0.5, 0.5);
        b2 = tb_upload_unif(tb_new2("b2", c.hdt, E, K, 0, 1), -0.5, 0.5);
    }
    tbuf *ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, RP(1), 1);
    tbuf *wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    h_fill_random_routing(ids, wts, M, k, Eg, c.invalid, -1);
    tbuf *map = NULL;
    int32_t *mapv = NULL;
    if (c.use_map)
        map = h_new_expert_map(Eg, E, &mapv);
    moefuse_routing R;
    memset(&R, 0, sizeof R);
    R.topk_ids = ids->t;
    R.topk_weights = wts->t;
    if (map) R.expert_map = map->t;
    moefuse_moe_options o = {.activation = c.act, .order = c.order, .limit = c.limit,
                             .alpha = c.alpha, .up_offset = c.up_offset};

    /* oracle */
    double *xd = get_all(x, M, K, 1), *w1d = get_all(w1, E, 2 * I, K), *w2d = get_all(w2, E, K, I);
    double *b1d = b1 ? get_all(b1, E, 2 * I, 1) : NULL, *b2d = b2 ? get_all(b2, E, K, 1) : NULL;
    int32_t *idv = malloc(sizeof(int32_t) * (size_t)(M * k + 1));
    double *wd = get_all(wts, M, k, 1);
    for (int64_t i = 0; i < M * k; i++) idv[i] = (int32_t)tb_get(ids, i / k, i % k, 0);
    double *href = malloc(sizeof(double) * (size_t)(M * k * I + 1));
    int64_t *valid = malloc(sizeof(int64_t) * (size_t)(M * k + 1));
    or_act_opt ao = {c.act, c.order, c.limit, 0, c.alpha, c.up_offset};
    or_moe_gate(M, K, I, E, k, xd, w1d, b1d, idv, mapv, Eg, &ao, href, valid);

    /* gate */
    tbuf *h = tb_new3("h", c.hdt, M, k, I, RP(1), 0);
    moefuse_status st = CALL(moefuse_moe_gate(g_ctx, T(x), T(w1), T(b1), &R, T(h), &o));
    HCHECK(st == MOEFUSE_OK, "moe_gate: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    cmp_norm("moe_gate h", &c, h, href, M, k, I, valid, 1);

    /* final from the library's h (isolates the final kernel's error) */
    double *hd = get_all(h, M, k, I);
    double *yref = malloc(sizeof(double) * (size_t)(M * k * K + 1)), *oref = malloc(sizeof(double) * (size_t)(M * K + 1));
    or_moe_final(M, K, I, E, k, hd, w2d, b2d, valid, wd, yref, oref);
    tbuf *out = c.reduce ? tb_new2("out", c.odt, M, K, RP(2), 0) : tb_new3("y", c.odt, M, k, K, RP(2), 0);
    st = CALL(moefuse_moe_final(g_ctx, T(h), T(w2), T(b2), &R, T(out), &o));
    HCHECK(st == MOEFUSE_OK, "moe_final: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    if (c.reduce) {
        cmp_norm("moe_final out", &c, out, oref, M, K, 1, valid, 0);
        for (int64_t m = 0; m < M; m++) {
            int any = 0;
            for (int64_t j = 0; j < k; j++) any |= valid[m * k + j] >= 0;
            if (!any)
                for (int64_t r = 0; r < K; r++)
                    HCHECK(tb_get(out, m, r, 0) == 0.0, "moe_final: token %lld has no valid slot but out[%lld,%lld] = %g",
                           (long long)m, (long long)m, (long long)r, tb_get(out, m, r, 0));
        }
    }
    else cmp_norm("moe_final y", &c, out, yref, M, k, K, valid, 1);

    /* forward == gate (h in x's dtype) then final, bitwise */
    if (c.hdt == c.xdt && c.reduce) {
        tbuf *fo = tb_new2("fwd_out", c.odt, M, K, RP(1), 0);
        st = CALL(moefuse_moe_forward(g_ctx, T(x), T(w1), T(w2), T(b1), T(b2), &R, T(fo), &o));
        HCHECK(st == MOEFUSE_OK, "moe_forward: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
        for (int64_t m = 0; m < M; m++)
            for (int64_t r = 0; r < K; r++)
                HCHECK(memcmp(tb_el(fo, m, r, 0), tb_el(out, m, r, 0), moefuse_dtype_size(c.odt)) == 0,
                       "moe_forward out[%lld,%lld]=%a differs from gate+final %a", (long long)m, (long long)r,
                       tb_get(fo, m, r, 0), tb_get(out, m, r, 0));
        /* and against the oracle end to end */
        double *fref = malloc(sizeof(double) * (size_t)(M * K + 1));
        double *yy = malloc(sizeof(double) * (size_t)(M * k * K + 1));
        or_moe_final(M, K, I, E, k, href, w2d, b2d, valid, wd, yy, fref);
        cmp_norm2("moe_forward vs oracle", &c, fo, fref, M, K, 1, valid, 0, (int)c.xdt);
        free(fref);
        free(yy);
    }
    free(xd); free(w1d); free(w2d); free(b1d); free(b2d); free(idv); free(wd); free(href); free(valid);
    free(hd); free(yref); free(oref); free(mapv);
    tb_free_all();
#undef RP
}

static cfg base(moefuse_dtype dt)
{
    cfg c = {dt, dt, dt, 5, 37, 45, 4, 2, 6, 0, 0, 1, 0, 0, 0.0f, 0, 0, 0.0f, 0.0f};
    return c;
}

START_TEST(t_small_odd)
{
    for (int d = 0; d < 3; d++)
        for (int v = 0; v < 4; v++) {
            cfg c = base(FLOATS[d]);
            c.M = v == 0 ? 1 : 5;
            c.bias = v & 1;
            c.reduce = v != 3;
            c.act = v;
            c.order = v % 3;
            c.up_offset = v == 3 ? 1.0f : 0.0f;
            run(c);
        }
}
END_TEST

START_TEST(t_invalid_slots_map)
{
    for (int d = 0; d < 3; d++)
        for (int red = 0; red < 2; red++) {
            cfg c = base(FLOATS[d]);
            c.M = 9;
            c.k = 3;
            c.invalid = 1;
            c.use_map = 1;
            c.Eg = 10;
            c.reduce = red;
            c.bias = 1;
            run(c);
            c.use_map = 0;
            run(c);
        }
}
END_TEST

START_TEST(t_clamp_acts)
{
    for (int a = 0; a < 4; a++) {
        cfg c = base(MOEFUSE_F32);
        c.act = a;
        c.limit = 0.3f;
        c.bias = 1;
        c.order = 1;
        run(c);
        c.order = MOEFUSE_GATE_INTERLEAVED;
        c.up_offset = a == 2 ? -0.125f : 1.0f;
        c.alpha = a == 3 ? 2.5f : 0.0f;
        run(c);
    }
}
END_TEST

START_TEST(t_mixed_dtypes)
{
    /* h in f32 from bf16 x, output f32 / bf16 */
    cfg c = base(MOEFUSE_BF16);
    c.hdt = MOEFUSE_F32;
    c.odt = MOEFUSE_F32;
    c.bias = 1;
    run(c);
    c.hdt = MOEFUSE_F16;
    c.odt = MOEFUSE_BF16;
    c.reduce = 0;
    run(c);
    c = base(MOEFUSE_F32);
    c.odt = MOEFUSE_BF16;
    run(c);
}
END_TEST

START_TEST(t_medium_random)
{
    for (int r = 0; r < 9; r++) {
        cfg c = base(FLOATS[r % 3]);
        c.M = h_randint(1, 64);
        c.E = h_randint(1, 8);
        c.k = h_randint(1, c.E < 4 ? c.E : 4);
        c.K = h_randint(1, 256);
        c.I = h_randint(1, 256);
        c.bias = (int)h_randint(0, 1);
        c.act = (int)h_randint(0, 3);
        c.alpha = c.act == MOEFUSE_ACT_SILU_ALPHA && h_randint(0, 1) ? (float)h_unif(0.2, 3) : 0.0f;
        c.up_offset = h_randint(0, 1) ? (float)h_unif(-1.5, 1.5) : 0.0f;
        c.limit = h_randint(0, 2) == 0 ? (float)h_unif(0.2, 2) : 0.0f;
        c.order = (int)h_randint(0, 2);
        c.invalid = (int)h_randint(0, 1);
        c.use_map = (int)h_randint(0, 1);
        c.Eg = c.E + 3;
        c.reduce = r % 4 != 1;
        c.hdt = c.odt = c.xdt;
        if (r >= 6) c.odt = FLOATS[(r + 1) % 3];
        run(c);
    }
}
END_TEST

/*
 * Shapes for the large-tile GEMM paths (CUDA mma_l, wgmma, ws; MOEFUSE_CUDA_GEMM forces each):
 * many slots per expert (M = 320, k = 2, E = 8, a third of the slots invalid: about 53 valid
 * slots an expert, ragged against any tile), depth beyond the deepest pipeline (64 of depth a
 * stage, at most 6 stages: over 384; the gate's depth is K, the final's I), ragged N and depth.
 * K, I = 584, 328 and 456, 392: multiples of 8, not of 64, rows unpadded, so 16-byte loads stay
 * allowed (392 makes the final GEMM deep too); 523, 301 with padded rows: odd, the scalar
 * fallback. Biases on; both output forms across the cases.
 */
START_TEST(t_deep_ragged)
{
    static const int64_t KI[3][2] = {{584, 328}, {523, 301}, {456, 392}};
    moefuse_dtype dts[2] = {MOEFUSE_BF16, MOEFUSE_F16};
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < 3; s++) {
            cfg c = base(dts[d]);
            c.M = 320;
            c.E = 8;
            c.k = 2;
            c.K = KI[s][0];
            c.I = KI[s][1];
            c.dense = c.K % 8 == 0 && c.I % 8 == 0;
            c.bias = 1;
            c.invalid = 1;
            c.reduce = (d + s) % 2 == 0;
            c.act = s % 3;
            c.order = d;
            if (s == 2) { /* gpt-oss's activation (the CUDA tiles index interleaved rows) */
                c.act = MOEFUSE_ACT_SILU_ALPHA, c.order = MOEFUSE_GATE_INTERLEAVED;
                c.limit = 0.5f, c.up_offset = 1.0f;
            }
            run(c);
        }
}
END_TEST

/*
 * More tiles than a GPU has multiprocessors (128 experts of a few slots, two column blocks):
 * a persistent kernel's blocks each take several tiles, so the hand-over of tiles and the
 * pipeline's phases carry from one tile to the next (MOEFUSE_CUDA_GEMM=ws).
 */
START_TEST(t_many_tiles)
{
    for (int r = 0; r < 2; r++) {
        cfg c = base(MOEFUSE_BF16);
        c.M = 48;
        c.E = 128;
        c.Eg = 128;
        c.k = 8;
        c.K = r ? 392 : 256;
        c.I = 136;
        c.dense = 1;
        c.bias = 1;
        c.invalid = 1;
        c.reduce = r == 0;
        c.act = r ? MOEFUSE_ACT_SILU_ALPHA : 0;
        c.order = r ? MOEFUSE_GATE_INTERLEAVED : 0;
        c.up_offset = r ? 1.0f : 0.0f;
        run(c);
    }
}
END_TEST

/*
 * More experts than the CUDA route counts in shared memory (4096): 4100 experts, 2400 slots
 * (more than one block's 2048), so the route takes its global atomics; invalid slots, both
 * output forms.
 */
START_TEST(t_many_experts)
{
    for (int r = 0; r < 2; r++) {
        cfg c = base(MOEFUSE_BF16);
        c.M = 600;
        c.E = 4100;
        c.Eg = 4100;
        c.k = 4;
        c.K = 16;
        c.I = 8;
        c.dense = 1;
        c.invalid = 1;
        c.reduce = r;
        run(c);
    }
}
END_TEST

/*
 * Decode (16 slots or fewer: the GEMM blocks route themselves) with a deep, ragged depth:
 * on sm_90 the CUDA backend splits each tile's depth over a cluster of blocks (by shape, or
 * MOEFUSE_CUDA_SPLIT), so the depth here spans several blocks' shares, one share ragged, and
 * a forced split of 8 leaves some blocks without depth. 1, 3 and 8 tokens, invalid slots and
 * a map, both output forms.
 */
START_TEST(t_decode_deep)
{
    static const int64_t KI[3][2] = {{1000, 584}, {1544, 1032}, {777, 459}};
    static const int64_t Ms[3] = {1, 3, 8};
    moefuse_dtype dts[2] = {MOEFUSE_BF16, MOEFUSE_F16};
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < 3; s++) {
            cfg c = base(dts[d]);
            c.M = Ms[s];
            c.E = 8;
            c.k = s == 2 ? 2 : 4;
            c.K = KI[s][0];
            c.I = KI[s][1];
            c.dense = c.K % 8 == 0 && c.I % 8 == 0;
            c.bias = (d + s) % 2;
            c.invalid = s > 0;
            c.use_map = s == 1;
            c.Eg = 11;
            c.reduce = s != 1 || d == 1;
            c.act = s % 3;
            c.order = d;
            if (s == 1) /* gpt-oss's activation */
                c.act = MOEFUSE_ACT_SILU_ALPHA, c.order = MOEFUSE_GATE_INTERLEAVED,
                c.limit = 0.5f, c.up_offset = 1.0f, c.bias = 1;
            run(c);
        }
}
END_TEST

/*
 * Decode shapes (MOEFUSE_CUDA_GEMM=decode forces the CUDA backend's decode path on them):
 * M = 1, 2, 7, 31 and 64 with k = 8 and 2, so slots that route themselves and slots the route
 * lists, bf16 and f16, invalid ids, an expert_map, both output forms.
 */
START_TEST(t_decode_shapes)
{
    static const int64_t Ms[5] = {1, 2, 7, 31, 64};
    for (int i = 0; i < 10; i++) {
        cfg c = base(i % 2 ? MOEFUSE_F16 : MOEFUSE_BF16);
        c.M = Ms[i % 5];
        c.k = i < 5 ? 8 : 2;
        c.E = 16, c.Eg = 20;
        c.K = i % 3 ? 256 : 384;
        c.I = i % 2 ? 128 : 320;
        c.dense = 1;
        c.invalid = 1;
        c.use_map = i % 4 == 1;
        c.bias = i % 2;
        c.reduce = i % 3 != 2;
        c.act = i % 4;
        c.order = (i / 2) % 3;
        c.up_offset = i % 4 == 3 ? 1.0f : 0.0f;
        run(c);
    }
}
END_TEST

/* ------------------------------------------------------ gpt-oss-shaped layer */

/* bf16 of v, nearest even (v finite), and back */
static uint16_t bf16_bits(double v)
{
    const float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static double bf16_value(uint16_t b)
{
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/*
 * A bf16 weight tensor [E, rows, cols] in a buffer of the context: uniform in [-a, a] for the
 * experts a slot routes to (map[e] >= 0), whose values also go to the oracle's copy as
 * doubles at compact index map[e]; NaN (0xFFFF) in every other expert. Fast: a xorshift
 * seeded from the test's seed, since a few hundred million values go through it.
 */
static moefuse_tensor gpt_oss_weights(void **buf, int64_t E, int64_t rows, int64_t cols,
                                      const int32_t *map, double a, double *oracle)
{
    const size_t per = (size_t)(rows * cols), bytes = per * 2;
    HCHECK(moefuse_buffer_alloc(g_ctx, bytes * (size_t)E, buf) == MOEFUSE_OK, "buffer_alloc: %s",
           moefuse_last_error(g_ctx));
    uint16_t *w = malloc(bytes), *nan = malloc(bytes);
    ck_assert_ptr_nonnull(w);
    ck_assert_ptr_nonnull(nan);
    memset(nan, 0xFF, bytes);
    uint64_t s = h_rand() | 1u;
    for (int64_t e = 0; e < E; e++) {
        if (map[e] >= 0) {
            double *o = oracle + (size_t)map[e] * per;
            for (size_t i = 0; i < per; i++) {
                s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                w[i] = bf16_bits(a * ((double)(s >> 11) * 0x1p-52 - 1.0));
                o[i] = bf16_value(w[i]);
            }
        }
        HCHECK(moefuse_buffer_write(g_ctx, *buf, (size_t)e * bytes, map[e] >= 0 ? w : nan, bytes) ==
                   MOEFUSE_OK,
               "buffer_write: %s", moefuse_last_error(g_ctx));
    }
    free(w);
    free(nan);
    const int64_t shape[3] = {E, rows, cols};
    return moefuse_tensor_dense(*buf, MOEFUSE_BF16, 3, shape);
}

/*
 * A gpt-oss-shaped layer (gpt-oss-20b's experts: E = 32, k = 4, K = I = 2880) in bf16 with
 * biases and gpt-oss's activation: silu_alpha (alpha 1.702), up offset 1, limit 7, gate and up
 * rows of w1 and b1 interleaved; gate, final and forward against the oracle. Two tokens
 * routed to the same four experts in other orders (two slots an expert: the weights are read
 * once per routed expert, which is what a forced tiled path on PoCL pays for); w1 is scaled
 * so that a good part of the gates meets the clamp. The weights (1.6 GB) are raw buffers, NaN
 * in the experts no slot routes to (a read of the wrong expert shows as NaN); the oracle gets
 * the routed experts only, through an expert map.
 */
START_TEST(t_gpt_oss_layer)
{
    const int64_t M = 2, K = 2880, I = 2880, E = 32, k = 4;
    cfg c = base(MOEFUSE_BF16);
    c.M = M, c.K = K, c.I = I, c.E = E, c.k = k, c.bias = 1;
    c.act = MOEFUSE_ACT_SILU_ALPHA, c.alpha = 1.702f, c.up_offset = 1.0f, c.limit = 7.0f;
    c.order = MOEFUSE_GATE_INTERLEAVED;
    /* routing: token 0 four distinct experts, token 1 the same four rotated */
    int32_t idv[8];
    int routed[32] = {0};
    const int rot = (int)h_randint(1, 3);
    for (int s = 0; s < 4; s++) {
        int32_t id;
        do id = (int32_t)h_randint(0, E - 1); while (routed[id]);
        idv[s] = id;
        routed[id] = 1;
    }
    for (int s = 4; s < 8; s++) idv[s] = idv[(s + rot) % 4];
    tbuf *x = tb_upload_unif(tb_new2("x", MOEFUSE_BF16, M, K, 0, 1), -1, 1);
    tbuf *ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 0, 1), *wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    for (int s = 0; s < 8; s++) {
        tb_set(ids, s / k, s % k, 0, idv[s]);
        tb_set(wts, s / k, s % k, 0, h_unif(0.05, 1));
    }
    tb_upload(ids);
    tb_upload(wts);
    tbuf *b1 = tb_new2("b1", MOEFUSE_BF16, E, 2 * I, 0, 1), *b2 = tb_new2("b2", MOEFUSE_BF16, E, K, 0, 1);
    tb_fill_unif(b1, -0.5, 0.5);
    tb_fill_unif(b2, -0.5, 0.5);
    tb_upload(b1);
    tb_upload(b2);
    /* the oracle's copies: the routed experts only, at compact indices through a map */
    int32_t map[32];
    int64_t Ec = 0;
    for (int64_t g = 0; g < E; g++) map[g] = routed[g] ? (int32_t)Ec++ : -1;
    double *w1c = malloc(sizeof(double) * (size_t)(Ec * 2 * I * K));
    double *w2c = malloc(sizeof(double) * (size_t)(Ec * K * I));
    double *b1c = malloc(sizeof(double) * (size_t)(Ec * 2 * I)), *b2c = malloc(sizeof(double) * (size_t)(Ec * K));
    ck_assert_ptr_nonnull(w1c);
    ck_assert_ptr_nonnull(w2c);
    void *w1buf = NULL, *w2buf = NULL;
    const moefuse_tensor w1 = gpt_oss_weights(&w1buf, E, 2 * I, K, map, 16 / sqrt((double)K), w1c);
    const moefuse_tensor w2 = gpt_oss_weights(&w2buf, E, K, I, map, 2 / sqrt((double)I), w2c);
    for (int64_t g = 0; g < E; g++) {
        if (map[g] < 0) continue;
        for (int64_t r = 0; r < 2 * I; r++) b1c[map[g] * 2 * I + r] = tb_get(b1, g, r, 0);
        for (int64_t r = 0; r < K; r++) b2c[map[g] * K + r] = tb_get(b2, g, r, 0);
    }
    moefuse_routing R;
    memset(&R, 0, sizeof R);
    R.topk_ids = ids->t;
    R.topk_weights = wts->t;
    const moefuse_moe_options o = {.activation = c.act, .order = c.order, .limit = c.limit,
                                   .alpha = c.alpha, .up_offset = c.up_offset};

    double *xd = get_all(x, M, K, 1), *wd = get_all(wts, M, k, 1);
    double *href = malloc(sizeof(double) * (size_t)(M * k * I));
    int64_t valid[8];
    or_act_opt ao = {c.act, c.order, c.limit, 0, c.alpha, c.up_offset};
    or_moe_gate(M, K, I, Ec, k, xd, w1c, b1c, idv, map, E, &ao, href, valid);
    int64_t clamped = 0; /* of the first 256 gates of each slot: the test means the clamp to act */
    for (int s = 0; s < 8; s++) {
        const int64_t e = valid[s];
        for (int64_t i = 0; i < 256; i++) {
            double a = b1c[e * 2 * I + 2 * i];
            for (int64_t d = 0; d < K; d++) a += xd[(s / k) * K + d] * w1c[(e * 2 * I + 2 * i) * K + d];
            clamped += a > 7.0;
        }
    }
    HCHECK(clamped > 8 * 256 / 20, "only %lld of %d gates above the limit", (long long)clamped, 8 * 256);

    tbuf *h = tb_new3("h", MOEFUSE_BF16, M, k, I, 0, 0);
    moefuse_status st = CALL(moefuse_moe_gate(g_ctx, T(x), &w1, T(b1), &R, T(h), &o));
    HCHECK(st == MOEFUSE_OK, "moe_gate: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    cmp_norm("gpt-oss moe_gate h", &c, h, href, M, k, I, valid, 1);

    double *hd = get_all(h, M, k, I), *yref = malloc(sizeof(double) * (size_t)(M * k * K));
    double *oref = malloc(sizeof(double) * (size_t)(M * K));
    or_moe_final(M, K, I, Ec, k, hd, w2c, b2c, valid, wd, yref, oref);
    tbuf *out = tb_new2("out", MOEFUSE_BF16, M, K, 0, 0);
    st = CALL(moefuse_moe_final(g_ctx, T(h), &w2, T(b2), &R, T(out), &o));
    HCHECK(st == MOEFUSE_OK, "moe_final: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    cmp_norm("gpt-oss moe_final out", &c, out, oref, M, K, 1, valid, 0);

    or_moe_final(M, K, I, Ec, k, href, w2c, b2c, valid, wd, yref, oref);
    tbuf *fo = tb_new2("fwd_out", MOEFUSE_BF16, M, K, 0, 0);
    st = CALL(moefuse_moe_forward(g_ctx, T(x), &w1, &w2, T(b1), T(b2), &R, T(fo), &o));
    HCHECK(st == MOEFUSE_OK, "moe_forward: %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    cmp_norm("gpt-oss moe_forward vs oracle", &c, fo, oref, M, K, 1, valid, 0);
    for (int64_t m = 0; m < M; m++) /* forward == gate then final, bitwise */
        for (int64_t r = 0; r < K; r++)
            HCHECK(memcmp(tb_el(fo, m, r, 0), tb_el(out, m, r, 0), 2) == 0,
                   "gpt-oss moe_forward out[%lld,%lld]=%a differs from gate+final %a", (long long)m,
                   (long long)r, tb_get(fo, m, r, 0), tb_get(out, m, r, 0));
    moefuse_buffer_free(g_ctx, w1buf);
    moefuse_buffer_free(g_ctx, w2buf);
    free(w1c), free(w2c), free(b1c), free(b2c), free(xd), free(wd), free(href), free(hd);
    free(yref), free(oref);
    tb_free_all();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("moe");
    TCase *tc = h_add_tcase(s, "moe", h_setup, 240);
    tcase_add_test(tc, t_small_odd);
    tcase_add_test(tc, t_invalid_slots_map);
    tcase_add_test(tc, t_clamp_acts);
    tcase_add_test(tc, t_mixed_dtypes);
    tcase_add_test(tc, t_medium_random);
    tcase_add_test(tc, t_deep_ragged);
    tcase_add_test(tc, t_many_tiles);
    tcase_add_test(tc, t_many_experts);
    tcase_add_test(tc, t_decode_deep);
    tcase_add_test(tc, t_decode_shapes);
    tcase_add_test(tc, t_gpt_oss_layer);
    return h_run(s);
}
