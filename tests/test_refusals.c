/*
 * What the core refuses or accepts beyond shapes and dtypes, each rule with the
 * call that broke it before the rule existed:
 *  - a tensor that runs past the end of its buffer (backends that know sizes);
 *  - an output sharing bytes with another operand, for every operation;
 *  - an eps so small that an all-zero group would get NaN codes;
 *  - empty tensors with any strides (numpy's [0, N] arrays), and unit dimensions with any
 *    stride;
 *  - a second thread inside a call on the same context.
 * Refused calls leave every output and canary untouched (h_check_all).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h" /* the context's in_call flag, to hold a context busy on purpose */
#include "harness.h"

/* Refused with `want`, a message naming the operation and each of `names`, nothing written. */
static void expect_refused(moefuse_status got, moefuse_status want, const char *op,
                           const char *name1, const char *name2, const char *desc)
{
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", moefuse_last_error(g_ctx));
    h_check_all(1);
    HCHECK(got == want, "%s: %s returned %s, want %s (\"%s\")", op, desc, moefuse_status_name(got),
           moefuse_status_name(want), msg);
    HCHECK(strstr(msg, op) != NULL, "%s: %s: message \"%s\" does not name the call", op, desc, msg);
    HCHECK(!name1 || strstr(msg, name1), "%s: %s: message \"%s\" does not name %s", op, desc, msg,
           name1);
    HCHECK(!name2 || strstr(msg, name2), "%s: %s: message \"%s\" does not name %s", op, desc, msg,
           name2);
}

static void expect_ok(moefuse_status got, const char *desc)
{
    HCHECK(CALL(got) == MOEFUSE_OK, "%s: %s (%s)", desc, moefuse_status_name(got),
           moefuse_last_error(g_ctx));
}

/* A view of `rank` dims inside tb's buffer, starting `byte_offset` bytes into its payload. */
static moefuse_tensor view_in(tbuf *tb, moefuse_dtype dt, int rank, const int64_t *shape,
                              int64_t byte_offset)
{
    moefuse_tensor t = moefuse_tensor_dense(tb->buf, dt, rank, shape);
    t.offset = tb->t.offset + byte_offset;
    return t;
}

/* ------------------------------------------------------------- bounds */

/* The backends that know how large a buffer is: OpenCL (the cl_mem) and CUDA (the allocation). */
static int knows_buffer_sizes(void)
{
    return strcmp(h_backend(), "cpu") != 0;
}

START_TEST(t_offset_past_buffer_end)
{
    /* act_quant with q.offset = 65536 on a small buffer returned OK and wrote past its end */
    tbuf *x = tb_upload_unif(tb_new2("x", MOEFUSE_F32, 4, 256, 0, 1), -1, 1);
    tbuf *q = tb_new2("q", MOEFUSE_F8_E4M3, 4, 128, 0, 0);
    tbuf *sc = tb_new2("scales", MOEFUSE_F32, 4, 1, 0, 0);
    moefuse_tensor far = q->t;
    far.offset = 65536;
    expect_refused(moefuse_act_quant(g_ctx, T(x), NULL, &far, T(sc), NULL),
                   MOEFUSE_ERR_OUT_OF_BOUNDS, "act_quant", "q", NULL, "q.offset 65536");
    if (strcmp(h_backend(), "opencl") == 0) {
        /* to the byte: a cl_mem has exactly the size it was created with (a CUDA allocation
         * may be rounded up, so there only the far case above is certain) */
        moefuse_tensor late = x->t;
        late.offset = (int64_t)x->total - moefuse_tensor_span_bytes(&x->t) + 4;
        expect_refused(moefuse_act_quant(g_ctx, &late, NULL, T(q), T(sc), NULL),
                       MOEFUSE_ERR_OUT_OF_BOUNDS, "act_quant", "x", NULL, "x ends 4 bytes late");
        late.offset -= 4; /* ending exactly at the buffer's end is fine */
        expect_ok(moefuse_act_quant(g_ctx, &late, NULL, T(q), T(sc), NULL), "x ending at the end");
        tb_upload(q);
        tb_upload(sc);
    }
    /* the same rule on the MoE calls, for a weight */
    tbuf *logits = tb_upload_unif(tb_new2("logits", MOEFUSE_F32, 3, 8, 0, 1), -2, 2);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, 3, 2, 0, 0);
    tbuf *w = tb_new2("weights", MOEFUSE_F32, 3, 2, 0, 0);
    moefuse_tensor wfar = w->t;
    wfar.offset = (int64_t)w->total;
    expect_refused(moefuse_topk_softmax(g_ctx, T(logits), 1, T(ids), &wfar),
                   MOEFUSE_ERR_OUT_OF_BOUNDS, "topk_softmax", "weights", NULL, "weights past end");
}
END_TEST

/* ------------------------------------------------------------ overlap */

START_TEST(t_overlap_rows)
{
    const int64_t Tn = 4, H = 256;
    tbuf *x = tb_upload_unif(tb_new2("x", MOEFUSE_F32, Tn, 2 * H, 0, 1), -1, 1);
    /* one output buffer holding q and, 32 bytes into q's last row, the scales: on the cpu
     * backend this call used to corrupt 32 codes */
    tbuf *arena = tb_new1("arena", MOEFUSE_U8, 4096, 0);
    int64_t qs[2] = {Tn, H}, ss[2] = {Tn, H / 128}, hs[2] = {Tn, H};
    moefuse_tensor q = view_in(arena, MOEFUSE_F8_E4M3, 2, qs, 0);
    moefuse_tensor sc = view_in(arena, MOEFUSE_F32, 2, ss, (Tn - 1) * H + 32);
    expect_refused(moefuse_act_quant(g_ctx, T(x), NULL, &q, &sc, NULL), MOEFUSE_ERR_OVERLAP,
                   "act_quant", "q", "scales", "scales inside q");
    moefuse_tensor sc_ok = view_in(arena, MOEFUSE_F32, 2, ss, Tn * H); /* right after q */
    expect_ok(moefuse_act_quant(g_ctx, T(x), NULL, &q, &sc_ok, NULL), "scales right after q");
    tb_upload(arena); /* what the call wrote is the new state later refusals must keep */

    /* an output over an input: q on top of x's bytes */
    moefuse_tensor q_on_x = moefuse_tensor_dense(x->buf, MOEFUSE_F8_E4M3, 2, qs);
    q_on_x.offset = x->t.offset + 64;
    expect_refused(moefuse_act_quant(g_ctx, T(x), NULL, &q_on_x, &sc_ok, NULL),
                   MOEFUSE_ERR_OVERLAP, "act_quant", "q", "x", "q over x");

    /* act_mul in place over the gate half of x: refused, as every in-place call */
    moefuse_tensor out_on_x = x->t;
    out_on_x.shape[1] = H;
    expect_refused(moefuse_act_mul(g_ctx, T(x), NULL, &out_on_x, NULL), MOEFUSE_ERR_OVERLAP,
                   "act_mul", "out", "x", "out over x's gate half");

    /* quant and dequant: q / scales, out over q */
    tbuf *xh = tb_upload_unif(tb_new2("xh", MOEFUSE_F32, Tn, H, 0, 1), -1, 1);
    expect_refused(moefuse_quant(g_ctx, T(xh), &q, &sc, NULL), MOEFUSE_ERR_OVERLAP, "quant", "q",
                   "scales", "scales inside q");
    moefuse_tensor deq = view_in(arena, MOEFUSE_F32, 2, hs, 0);
    expect_refused(moefuse_dequant(g_ctx, &q, &sc_ok, &deq, NULL), MOEFUSE_ERR_OVERLAP, "dequant",
                   "out", "q", "out over q");

    /* masked: scales over the counts */
    const int64_t E = 2;
    tbuf *xm = tb_upload_unif(tb_new3("xm", MOEFUSE_F32, E, Tn, 2 * H, 0, 1), -1, 1);
    tbuf *counts = tb_new1("counts", MOEFUSE_I32, 64, 1);
    for (int64_t e = 0; e < 64; e++)
        tb_set(counts, e, 0, 0, 1);
    tb_upload(counts);
    tbuf *qm = tb_new3("qm", MOEFUSE_F8_E4M3, E, Tn, H, 0, 0);
    int64_t cs[1] = {E}, sms[3] = {E, Tn, H / 128};
    moefuse_tensor cnt = moefuse_tensor_dense(counts->buf, MOEFUSE_I32, 1, cs);
    cnt.offset = counts->t.offset;
    moefuse_tensor sm = moefuse_tensor_dense(counts->buf, MOEFUSE_F32, 3, sms);
    sm.offset = counts->t.offset + 4;
    expect_refused(moefuse_act_quant_masked(g_ctx, T(xm), &cnt, NULL, NULL, T(qm), &sm, NULL),
                   MOEFUSE_ERR_OVERLAP, "act_quant_masked", "scales", "counts",
                   "scales over counts");

    /* two inputs may share memory: x and row_scale from one buffer */
    tbuf *shared = tb_upload_unif(tb_new1("shared", MOEFUSE_F32, Tn * 2 * H + Tn, 1), 0.5, 1);
    int64_t xs[2] = {Tn, 2 * H}, rs[1] = {Tn};
    moefuse_tensor x2 = view_in(shared, MOEFUSE_F32, 2, xs, 0);
    moefuse_tensor r2 = view_in(shared, MOEFUSE_F32, 1, rs, 16); /* inside x: read twice */
    expect_ok(moefuse_act_quant(g_ctx, &x2, &r2, &q, &sc_ok, NULL), "overlapping inputs");
}
END_TEST

START_TEST(t_overlap_moe)
{
    const int64_t M = 3, E = 4, k = 2, K = 32, I = 16;
    tbuf *x = tb_new2("x", MOEFUSE_F32, M, K, 0, 1);
    tbuf *w1 = tb_new3("w1", MOEFUSE_F32, E, 2 * I, K, 0, 1);
    tbuf *w2 = tb_new3("w2", MOEFUSE_F32, E, K, I, 0, 1);
    tb_fill_unif(x, -1, 1);
    tb_fill_unif(w1, -1, 1);
    tb_fill_unif(w2, -1, 1);
    tb_upload(x);
    tb_upload(w1);
    tb_upload(w2);
    /* rows padded so that the h and out placed over them below still fit in their buffers */
    tbuf *ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 200, 1);
    tbuf *wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 200, 1);
    h_fill_simple_routing(ids, wts, M, k, E);
    moefuse_routing r;
    memset(&r, 0, sizeof r);
    r.topk_ids = ids->t;
    r.topk_weights = wts->t;

    /* h and out placed over the routing and the activations */
    int64_t hs[3] = {M, k, I}, os[2] = {M, K};
    moefuse_tensor h_on_ids = moefuse_tensor_dense(ids->buf, MOEFUSE_F32, 3, hs);
    h_on_ids.offset = ids->t.offset;
    expect_refused(moefuse_moe_gate(g_ctx, T(x), T(w1), NULL, &r, &h_on_ids, NULL),
                   MOEFUSE_ERR_OVERLAP, "moe_gate", "h", "topk_ids", "h over topk_ids");
    tbuf *h = tb_new3("h", MOEFUSE_F32, M, k, I, 0, 0);
    expect_ok(moefuse_moe_gate(g_ctx, T(x), T(w1), NULL, &r, T(h), NULL), "moe_gate");
    tb_upload(h);
    h->is_input = 1; /* written by the gate above; the final only reads it */
    moefuse_tensor out_on_h = moefuse_tensor_dense(h->buf, MOEFUSE_F32, 2, os);
    out_on_h.offset = h->t.offset;
    expect_refused(moefuse_moe_final(g_ctx, T(h), T(w2), NULL, &r, &out_on_h, NULL),
                   MOEFUSE_ERR_OVERLAP, "moe_final", "out", "h", "out over h");
    moefuse_tensor out_on_w = moefuse_tensor_dense(wts->buf, MOEFUSE_F32, 2, os);
    out_on_w.offset = wts->t.offset;
    expect_refused(moefuse_moe_forward(g_ctx, T(x), T(w1), T(w2), NULL, NULL, &r, &out_on_w, NULL),
                   MOEFUSE_ERR_OVERLAP, "moe_forward", "out", "topk_weights",
                   "out over topk_weights");
    moefuse_tensor out_on_x = x->t;
    expect_refused(moefuse_moe_forward(g_ctx, T(x), T(w1), T(w2), NULL, NULL, &r, &out_on_x, NULL),
                   MOEFUSE_ERR_OVERLAP, "moe_forward", "out", "x", "out is x");

    /* topk_softmax: ids and weights in the same bytes */
    tbuf *logits = tb_upload_unif(tb_new2("logits", MOEFUSE_F32, M, E, 0, 1), -2, 2);
    tbuf *res = tb_new2("res", MOEFUSE_I32, M, k, 0, 0);
    moefuse_tensor w_on_ids = res->t;
    w_on_ids.dtype = MOEFUSE_F32;
    expect_refused(moefuse_topk_softmax(g_ctx, T(logits), 0, T(res), &w_on_ids),
                   MOEFUSE_ERR_OVERLAP, "topk_softmax", "ids", "weights", "weights are ids");
}
END_TEST

/* ---------------------------------------------------------------- eps */

START_TEST(t_eps_minimum)
{
    /* eps = 1e-40 was accepted: the all-zero group's scale underflowed to 0 and 0 / 0 gave
     * NaN codes (0xFF) for finite input */
    const int64_t Tn = 3, H = 256;
    tbuf *x = tb_new2("x", MOEFUSE_F32, Tn, H, 0, 1);
    for (int64_t t = 0; t < Tn; t++)
        for (int64_t c = 0; c < H; c++) /* row 0 zero, row 1 subnormal, row 2 ordinary */
            tb_set(x, t, c, 0, t == 0 ? 0.0 : t == 1 ? ldexp((double)(c % 7) - 3, -140) : 0.01 * (double)(c - 100));
    tb_upload(x);
    tbuf *q = tb_new2("q", MOEFUSE_F8_E4M3, Tn, H, 0, 0);
    tbuf *sc = tb_new2("scales", MOEFUSE_F32, Tn, H / 128, 0, 0);
    moefuse_quant_options o;
    memset(&o, 0, sizeof o);
    const float too_small[] = {1e-40f, 1e-36f, nextafterf(MOEFUSE_QUANT_EPS_MIN, 0.0f)};
    for (size_t i = 0; i < sizeof too_small / sizeof too_small[0]; i++) {
        o.eps = too_small[i];
        expect_refused(moefuse_quant(g_ctx, T(x), T(q), T(sc), &o), MOEFUSE_ERR_INVALID_ARGUMENT,
                       "quant", "eps", NULL, h_fmt("eps %g", (double)too_small[i]));
    }
    /* at the minimum, f8 and i8, every code is finite and every scale a positive number */
    const moefuse_dtype code_types[] = {MOEFUSE_F8_E4M3, MOEFUSE_I8};
    for (int d = 0; d < 2; d++) {
        tbuf *qd = tb_new2("q", code_types[d], Tn, H, 0, 0);
        o.eps = MOEFUSE_QUANT_EPS_MIN;
        expect_ok(moefuse_quant(g_ctx, T(x), T(qd), T(sc), &o), "eps at the minimum");
        for (int64_t t = 0; t < Tn; t++) {
            for (int64_t g = 0; g < H / 128; g++) {
                double s = tb_get(sc, t, g, 0);
                HCHECK(isfinite(s) && s >= 1.17549435e-38, "row %lld: scale %g is not a normal f32",
                       (long long)t, s);
            }
            for (int64_t c = 0; c < H; c++) {
                unsigned char code = *(unsigned char *)tb_el(qd, t, c, 0);
                HCHECK(code_types[d] != MOEFUSE_F8_E4M3 || (code & 0x7F) != 0x7F,
                       "row %lld col %lld: NaN code 0x%02x from finite input", (long long)t,
                       (long long)c, code);
                if (t == 0)
                    HCHECK(code == 0, "all-zero row: code 0x%02x at %lld", code, (long long)c);
            }
        }
    }
}
END_TEST

/* -------------------------------------------------------------- empty */

START_TEST(t_empty_with_any_strides)
{
    /* numpy gives a [0, N] array zero strides: "innermost stride is 0" refused it */
    const int64_t H = 128;
    tbuf *anchor = tb_new1("anchor", MOEFUSE_U8, 64, 0); /* real memory, never touched */
    int64_t xs[2] = {0, 2 * H}, qs[2] = {0, H}, ss[2] = {0, 1}, zero[2] = {0, 0};
    int64_t odd[2] = {-5, 3};
    moefuse_tensor x = moefuse_tensor_strided(anchor->buf, MOEFUSE_F32, 2, xs, zero);
    moefuse_tensor q = moefuse_tensor_strided(anchor->buf, MOEFUSE_F8_E4M3, 2, qs, zero);
    moefuse_tensor s = moefuse_tensor_strided(NULL, MOEFUSE_F32, 2, ss, odd);
    x.offset = q.offset = anchor->t.offset;
    expect_ok(moefuse_act_quant(g_ctx, &x, NULL, &q, &s, NULL), "empty x, q, scales, any strides");
    moefuse_tensor h = moefuse_tensor_strided(NULL, MOEFUSE_F32, 2, qs, odd);
    expect_ok(moefuse_act_mul(g_ctx, &x, NULL, &h, NULL), "empty act_mul");
    /* a non-empty tensor with a zero innermost stride is still refused */
    int64_t one[2] = {1, 2 * H};
    moefuse_tensor bad = moefuse_tensor_strided(anchor->buf, MOEFUSE_F32, 2, one, zero);
    expect_refused(moefuse_act_mul(g_ctx, &bad, NULL, &h, NULL), MOEFUSE_ERR_STRIDE, "act_mul",
                   "x", NULL, "x [1, 2H] with stride 0");
}
END_TEST

START_TEST(t_sizes_that_overflow)
{
    /* the size helpers say -1 rather than wrap (signed overflow, UB under UBSan) */
    int64_t huge[3] = {INT64_C(1) << 40, INT64_C(1) << 30, 64};
    moefuse_tensor t = moefuse_tensor_dense((void *)16, MOEFUSE_F32, 3, huge);
    HCHECK(moefuse_tensor_numel(&t) == -1, "numel of 2^76 elements gave %lld",
           (long long)moefuse_tensor_numel(&t));
    HCHECK(moefuse_tensor_span_bytes(&t) == -1, "span of 2^76 elements gave %lld",
           (long long)moefuse_tensor_span_bytes(&t));
    /* empty is 0 bytes even where the other dims' strides would overflow */
    int64_t empty_shape[2] = {INT64_C(1) << 24, 0}, wild[2] = {INT64_MAX, 1};
    t = moefuse_tensor_strided((void *)16, MOEFUSE_F32, 2, empty_shape, wild);
    HCHECK(moefuse_tensor_span_bytes(&t) == 0, "an empty tensor spans %lld bytes",
           (long long)moefuse_tensor_span_bytes(&t));
    int64_t fits[2] = {INT64_C(1) << 28, 16};
    t = moefuse_tensor_dense((void *)16, MOEFUSE_F32, 2, fits);
    HCHECK(moefuse_tensor_numel(&t) == INT64_C(1) << 32 &&
               moefuse_tensor_span_bytes(&t) == INT64_C(1) << 34,
           "2^32 f32 elements: numel %lld, span %lld", (long long)moefuse_tensor_numel(&t),
           (long long)moefuse_tensor_span_bytes(&t));
}
END_TEST

START_TEST(t_unit_dim_any_stride)
{
    /* a unit dimension is never stepped, so the core takes any stride for it: w2 [E, 1, I]
     * with stride[1] = INT64_MAX made the CPU's weight stream multiply that stride by the
     * element size (signed overflow; UBSan in fuzz_api). The same call with the dense w2 gives
     * the same bits. */
    const int64_t M = 3, E = 4, k = 2, K = 1, I = 16;
    tbuf *x = tb_upload_unif(tb_new2("x", MOEFUSE_F32, M, K, 0, 1), -1, 1);
    tbuf *w1 = tb_upload_unif(tb_new3("w1", MOEFUSE_F32, E, 2 * I, K, 0, 1), -1, 1);
    tbuf *w2 = tb_upload_unif(tb_new3("w2", MOEFUSE_F32, E, K, I, 0, 1), -1, 1);
    tbuf *ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 0, 1);
    tbuf *wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    h_fill_simple_routing(ids, wts, M, k, E);
    moefuse_routing r;
    memset(&r, 0, sizeof r);
    r.topk_ids = ids->t;
    r.topk_weights = wts->t;
    tbuf *dense = tb_new2("out_dense", MOEFUSE_F32, M, K, 0, 0);
    tbuf *wild = tb_new2("out_wild", MOEFUSE_F32, M, K, 0, 0);
    expect_ok(moefuse_moe_forward(g_ctx, T(x), T(w1), T(w2), NULL, NULL, &r, T(dense), NULL),
              "moe_forward, dense w2");
    moefuse_tensor w2_wild = w2->t;
    w2_wild.stride[1] = INT64_MAX;
    expect_ok(moefuse_moe_forward(g_ctx, T(x), T(w1), &w2_wild, NULL, NULL, &r, T(wild), NULL),
              "moe_forward, w2 [E, 1, I] with stride[1] INT64_MAX");
    h_check_all(0);
    for (int64_t m = 0; m < M; m++)
        HCHECK(memcmp(tb_el(dense, m, 0, 0), tb_el(wild, m, 0, 0), sizeof(float)) == 0,
               "row %lld: %g with the dense w2, %g with the wild stride", (long long)m,
               tb_get(dense, m, 0, 0), tb_get(wild, m, 0, 0));
}
END_TEST

/* --------------------------------------------------------------- busy */

START_TEST(t_busy_context)
{
    tbuf *x = tb_upload_unif(tb_new2("x", MOEFUSE_F32, 2, 256, 0, 1), -1, 1);
    tbuf *out = tb_new2("out", MOEFUSE_F32, 2, 128, 0, 0);
    /* stand for another thread inside a call on g_ctx */
    atomic_store(&g_ctx->in_call, true);
    moefuse_status st = moefuse_act_mul(g_ctx, T(x), NULL, T(out), NULL);
    const char *thread_msg = moefuse_last_error(NULL);
    HCHECK(st == MOEFUSE_ERR_CONTEXT_BUSY, "act_mul on a busy context returned %s",
           moefuse_status_name(st));
    HCHECK(strstr(thread_msg, "act_mul") && strstr(thread_msg, "another thread"),
           "busy message \"%s\" (in moefuse_last_error(NULL)) should name the call and why",
           thread_msg);
    HCHECK(atomic_load(&g_ctx->in_call), "a refused call released the other thread's context");
    atomic_store(&g_ctx->in_call, false);
    h_check_all(1);
    /* once free, the context takes calls again */
    expect_ok(moefuse_act_mul(g_ctx, T(x), NULL, T(out), NULL), "act_mul after the busy call");
    HCHECK(!atomic_load(&g_ctx->in_call), "a finished call left the context busy");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("refusals");
    TCase *tc = h_add_tcase(s, "refusals", h_setup, 60); /* meson's limit for the program */
    if (knows_buffer_sizes())
        tcase_add_test(tc, t_offset_past_buffer_end);
    else
        printf("t_offset_past_buffer_end not run: the %s backend takes host pointers, whose "
               "allocation size no one can ask\n", h_backend());
    tcase_add_test(tc, t_overlap_rows);
    tcase_add_test(tc, t_overlap_moe);
    tcase_add_test(tc, t_eps_minimum);
    tcase_add_test(tc, t_empty_with_any_strides);
    tcase_add_test(tc, t_sizes_that_overflow);
    tcase_add_test(tc, t_unit_dim_any_stride);
    tcase_add_test(tc, t_busy_context);
    return h_run(s);
}
