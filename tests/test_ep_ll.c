/*
 * The low-latency mode of moefuse_ep_dispatch and moefuse_ep_combine (ranks as threads): the
 * rows, counts and scales exactly where the normal mode puts them, the combine's sum by rank,
 * rows lost past Tmax made loud (their count, NaN in their tokens), and the refusals.
 */
#include "test_ep.h"

#include "core/core.h" /* the backend's steps, called on hand-made blocks */

#include <math.h>
#include <string.h>

static void ll_case(disp_case *c, const int32_t *owner)
{
    c->ll = 1;
    ep_disp_run(c, owner);
    ep_disp_check(c);
}

START_TEST(t_ll_rows)
{
    static const int32_t worlds[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++) { /* Tmax 200 >= world x 38 tokens */
        disp_case c = ep_disp_case(worlds[i], 23, 200);
        ll_case(&c, NULL);
        ep_disp_free(&c);
    }
    disp_case y = ep_disp_case(4, 9, 100); /* the experts' outputs in bf16 */
    y.y_bf16 = 1;
    ll_case(&y, NULL);
    ep_disp_free(&y);
    disp_case o = ep_disp_case(2, 9, 100); /* K = 202: the GPU kernels' plain loops */
    o.K = 202;
    ll_case(&o, NULL);
    ep_disp_free(&o);
    static const moefuse_dtype dts[2] = {MOEFUSE_F16, MOEFUSE_F32};
    for (int i = 0; i < 2; i++) {
        disp_case f = ep_disp_case(2, 17, 44); /* exactly world x max_tokens */
        f.dt = dts[i];
        ll_case(&f, NULL);
        ep_disp_free(&f);
    }
    static const int32_t owner[8] = {3, 0, 0, 3, 2, 0, 2, 3}; /* rank 1 holds none */
    disp_case d = ep_disp_case(4, 0, 76);                     /* rank 0 sends no token */
    d.M[1] = 1;
    d.M[3] = 19;
    ll_case(&d, owner);
    ep_disp_free(&d);
}
END_TEST

START_TEST(t_ll_fp8)
{
    for (int l = 0; l < 5; l++) { /* quantized on the way; Tmax 41: the padded layouts pad 3 */
        disp_case c = ep_disp_case(2, 13, 41);
        c.quantize = 1;
        c.lay = l;
        c.opt.quantize = 1;
        c.opt.act.scale_layout = (moefuse_scale_layout)LAYS[l].layout;
        c.opt.act.ue8m0 = LAYS[l].ue8m0;
        ll_case(&c, NULL);
        ep_disp_check_padding(&c);
        ep_disp_free(&c);
    }
    for (int l = 0; l < 5; l++) { /* an f8 x with its scales in each layout */
        disp_case c = ep_disp_case(4, 11, 105);
        c.f8x = 1;
        c.lay = l;
        c.opt.act.scale_layout = (moefuse_scale_layout)LAYS[l].layout;
        c.opt.act.ue8m0 = LAYS[l].ue8m0;
        ll_case(&c, NULL);
        ep_disp_check_padding(&c);
        ep_disp_free(&c);
    }
}
END_TEST

/* Every slot of both ranks (M = 9 and 14 tokens, k = 4) names expert 1 of rank 0: 92 rows for
   a Tmax of 2 x 14. Rows 0 .. 27 are rank 0's first 28 slots; the rest are lost. */
START_TEST(t_ll_lost_rows)
{
    disp_case c = ep_disp_case(2, 9, 28);
    c.ll = 1; /* max_tokens 14 */
    c.busy = 1;
    ep_disp_run(&c, NULL);
    const size_t row = 2 * (size_t)c.K;
    for (int32_t r = 0; r < 2; r++) {
        ck_assert_msg(c.st[r] == MOEFUSE_OK && c.st_combine[r] == MOEFUSE_OK, "rank %d: %s",
                      (int)r, c.msg[r]);
        const int32_t *counts = (const int32_t *)(c.counts[r] + EP_GUARD);
        for (int32_t e = 0; e < c.local[r]; e++)
            ck_assert_int_eq(counts[e], r == 0 && e == 1 ? 92 : 0);
        /* every token of rank 1, and rank 0's tokens 7 and 8, lost a row: NaN; the rest not */
        for (int64_t m = 0; m < c.M[r]; m++)
            for (int64_t ch = 0; ch < c.K; ch++) {
                const float v = ((const float *)(c.out[r] + EP_GUARD))[m * c.K + ch];
                ck_assert_msg((r == 1 || m >= 7) == (bool)isnan(v), "rank %d token %lld", (int)r,
                              (long long)m);
            }
    }
    for (int64_t t = 0; t < 28; t++) /* slot t of rank 0: token t / 4 */
        ck_assert(memcmp(c.recv[0] + EP_GUARD + row * (size_t)(1 * 28 + t),
                         (const char *)c.x[0] + row * (size_t)(t / 4), row) == 0);
    ck_assert(ep_guards_ok(c.recv[0], row * (size_t)(c.local[0] * 28)));
    ep_disp_free(&c);
}
END_TEST

/* Every slot of both ranks names expert 1: 1220 rows, more than a GPU block lists at once. */
START_TEST(t_ll_many_rows)
{
    disp_case c = ep_disp_case(2, 150, 1300);
    c.K = 128;
    c.busy = 1;
    ll_case(&c, NULL);
    ep_disp_free(&c);
}
END_TEST

/* Shapes that take the GPU kernels' other paths: placements past what pack keeps in shared
   memory (E = 4096), more slots than partial lists (k = 70), and a bf16 out for sum. */
START_TEST(t_ll_other_paths)
{
    disp_case c = ep_disp_case(2, 7, 64);
    c.E = 4096;
    ll_case(&c, NULL);
    ep_disp_free(&c);
    c = ep_disp_case(2, 5, 64); /* 700 slots over 256 experts: none near Tmax */
    c.E = 256;
    c.k = 70;
    c.K = 128;
    ll_case(&c, NULL);
    ep_disp_free(&c);
    c = ep_disp_case(4, 6, 96);
    c.out_bf16 = 1;
    ll_case(&c, NULL);
    ep_disp_free(&c);
}
END_TEST

/* Every slot of both ranks (150 and 155 tokens, k = 4) names expert 1 of rank 0: 1220 rows for
   a Tmax of 1100, more than a GPU block lists at once, and the last 120 lost. Rows 0 .. 599 are
   rank 0's slots, then rank 1's. */
START_TEST(t_ll_many_lost)
{
    disp_case c = ep_disp_case(2, 150, 1100);
    c.ll = 1; /* max_tokens 155 */
    c.busy = 1;
    c.K = 128;
    ep_disp_run(&c, NULL);
    const size_t row = 2 * (size_t)c.K;
    for (int32_t r = 0; r < 2; r++)
        ck_assert_msg(c.st[r] == MOEFUSE_OK && c.st_combine[r] == MOEFUSE_OK, "rank %d: %s",
                      (int)r, c.msg[r]);
    ck_assert_int_eq(((const int32_t *)(c.counts[0] + EP_GUARD))[1], 1220);
    for (int64_t t = 0; t < 1100; t++) {
        const int32_t p = t < 600 ? 0 : 1;
        const int64_t m = (t - 600 * p) / 4;
        ck_assert_msg(memcmp(c.recv[0] + EP_GUARD + row * (size_t)(1 * 1100 + t),
                             (const char *)c.x[p] + row * (size_t)m, row) == 0,
                      "row %lld", (long long)t);
    }
    for (int32_t r = 0; r < 2; r++) /* rank 1's slots 500 .. 619 (tokens 125 ..) were lost */
        for (int64_t m = 0; m < c.M[r]; m++) {
            const float v = ((const float *)(c.out[r] + EP_GUARD))[m * c.K];
            ck_assert_msg((r == 1 && m >= 125) == (bool)isnan(v), "rank %d token %lld", (int)r,
                          (long long)m);
        }
    ep_disp_free(&c);
}
END_TEST

/* ---------------------------------------------- the steps on another rank's bad data */

/* Backend memory of `bytes` holding host's bytes; its data starts EP_GUARD in (ep_put). */
static char *at_guard(void *buffer) { return (char *)buffer + EP_GUARD; }

/* Rank 0 of 2, blocks of 4 rows, k = 2, K = 16 bf16 rows, 2 local experts, Tmax 8. Rank 1's
   block says it holds 7 rows (4 are read), names experts 5 and -3 (skipped); the rank's own
   block says -1 rows (none). Place, partial and sum are called on the test's backend and
   checked against what the contract gives for the data that can be trusted. */
START_TEST(t_ll_untrusted)
{
    moefuse_context *ctx;
    ck_assert_int_eq(moefuse_context_create(&ctx, h_backend()), MOEFUSE_OK);
    enum { C = 4, KS = 2, KD = 16, EL = 2, T = 8, W2 = 2, M = 3 };
    mf_ep_ll_wire w;
    ck_assert(mf_ep_ll_wire_of(C, KS, 2 * KD, &w));
    unsigned char *own = calloc(1, 2 * w.bytes), *peer = calloc(1, 2 * w.bytes);
    const int32_t minus = -1, seven = 7;
    memcpy(own, &minus, 4);              /* block 0 of the send blocks: this rank's own */
    memcpy(peer + w.bytes, &seven, 4);   /* block 1 of the received: rank 1's */
    static const int32_t experts[C][KS] = {{0, 1}, {5, -3}, {1, 1}, {0, -1}};
    for (int i = 0; i < C; i++)
        for (int j = 0; j < KS; j++) {
            const float wt = 0.5f * (float)(i + 1) + (float)j;
            memcpy(peer + w.bytes + w.off_expert + 4 * (size_t)(i * KS + j), &experts[i][j], 4);
            memcpy(peer + w.bytes + w.off_weight + 4 * (size_t)(i * KS + j), &wt, 4);
            for (int c = 0; c < KD; c++) { /* row i: bf16 of i + c / 16 */
                const float v = (float)i + (float)c / 16.0f;
                uint32_t b;
                memcpy(&b, &v, 4);
                const uint16_t h = (uint16_t)(b >> 16);
                memcpy(peer + w.bytes + w.off_rows + w.row_bytes * (size_t)i + 2 * c, &h, 2);
            }
        }
    float y[EL * T * KD], back[W2 * C * KD], partial0[W2 * C * KD];
    for (int i = 0; i < EL * T * KD; i++)
        y[i] = (float)(i % 37) - 18.0f;
    for (int i = 0; i < W2 * C * KD; i++) {
        back[i] = (float)(i % 11) + 0.25f;
        partial0[i] = (float)(i % 7) - 3.0f; /* the own rows sum reads from partial */
    }
    const int32_t pos[M * W2] = {0, 2, -1, 9, 5, -1}; /* token 2 sums nothing */
    void *dsend = ep_put(ctx, own, 2 * w.bytes), *drecv = ep_put(ctx, peer, 2 * w.bytes);
    void *drx = ep_put(ctx, NULL, 2 * EL * T * KD), *dcnt = ep_put(ctx, NULL, 4 * EL);
    void *drow = ep_put(ctx, NULL, 4 * W2 * C * KS), *dy = ep_put(ctx, y, sizeof y);
    void *dpart = ep_put(ctx, partial0, sizeof partial0), *dback = ep_put(ctx, back, sizeof back);
    void *dpos = ep_put(ctx, pos, sizeof pos), *dout = ep_put(ctx, NULL, 4 * M * KD);
    const int64_t rx_shape[3] = {EL, T, KD}, cnt_shape[1] = {EL}, out_shape[2] = {M, KD};
    mf_ep_ll_args a;
    memset(&a, 0, sizeof a);
    a.wire = w;
    a.world = W2;
    a.rank = 0;
    a.tokens = M;
    a.model_dim = KD;
    a.send = at_guard(dsend);
    a.recv = at_guard(drecv);
    a.recv_x = moefuse_tensor_dense(drx, MOEFUSE_BF16, 3, rx_shape);
    a.recv_counts = moefuse_tensor_dense(dcnt, MOEFUSE_I32, 1, cnt_shape);
    a.y = moefuse_tensor_dense(dy, MOEFUSE_F32, 3, rx_shape);
    a.out = moefuse_tensor_dense(dout, MOEFUSE_F32, 2, out_shape);
    a.recv_x.offset = a.recv_counts.offset = a.y.offset = a.out.offset = EP_GUARD;
    a.row_of = (int32_t *)at_guard(drow);
    a.partial = (float *)at_guard(dpart);
    a.back = (const float *)at_guard(dback);
    a.pos = (int32_t *)at_guard(dpos);
    const moefuse_backend_i *b = ctx->backend;
    ck_assert_int_eq(b->ep_ll_place(ctx, ctx->state, &a), MOEFUSE_OK);
    /* expert 0: rows 0 and 3; expert 1: rows 0, 2 and 2 (slot by slot) */
    static const int rows_of[EL][3] = {{0, 3, -1}, {0, 2, 2}};
    static const int32_t counts[EL] = {2, 3};
    unsigned char *rx = ep_get(ctx, drx, 2 * EL * T * KD), *cnt = ep_get(ctx, dcnt, 4 * EL);
    ck_assert(memcmp(cnt + EP_GUARD, counts, sizeof counts) == 0);
    for (int e = 0; e < EL; e++)
        for (int t = 0; t < T; t++) {
            const unsigned char *got = rx + EP_GUARD + 2 * (size_t)((e * T + t) * KD);
            if (t < counts[e])
                ck_assert_msg(memcmp(got, peer + w.bytes + w.off_rows +
                                              w.row_bytes * (size_t)rows_of[e][t],
                                     w.row_bytes) == 0,
                              "expert %d row %d", e, t);
            else
                ck_assert_msg(ep_untouched(got, 2 * KD), "expert %d row %d written", e, t);
        }
    ck_assert_int_eq(b->ep_ll_partial(ctx, ctx->state, &a), MOEFUSE_OK);
    unsigned char *part = ep_get(ctx, dpart, sizeof partial0);
    const float *pg = (const float *)(part + EP_GUARD);
    static const int t_of[C][KS] = {{0, 0}, {-1, -1}, {1, 2}, {1, -1}}; /* each slot's row */
    for (int i = 0; i < C; i++)
        for (int c = 0; c < KD; c++) {
            float acc = 0.0f;
            for (int j = 0; j < KS; j++) {
                if (t_of[i][j] < 0)
                    continue;
                const float wt = 0.5f * (float)(i + 1) + (float)j;
                const float prod = wt * y[(experts[i][j] * T + t_of[i][j]) * KD + c];
                acc = acc + prod;
            }
            ck_assert_msg(pg[(1 * C + i) * KD + c] == acc, "partial row %d column %d", i, c);
            /* the own block held no rows: its partial rows are as they were */
            ck_assert(pg[(0 * C + i) * KD + c] == partial0[(0 * C + i) * KD + c]);
        }
    ck_assert_int_eq(b->ep_ll_sum(ctx, ctx->state, &a), MOEFUSE_OK);
    unsigned char *out = ep_get(ctx, dout, 4 * M * KD);
    const float *og = (const float *)(out + EP_GUARD);
    for (int c = 0; c < KD; c++) {
        const float t0 = 0.0f + pg[(0 * C + 0) * KD + c]; /* token 0: its own row 0, ... */
        ck_assert(og[0 * KD + c] == t0 + back[(1 * C + 2) * KD + c]); /* ... rank 1's row 2 */
        ck_assert(og[1 * KD + c] == 0.0f && og[2 * KD + c] == 0.0f);
    }
    ck_assert(ep_guards_ok(out, 4 * M * KD) && ep_guards_ok(rx, 2 * EL * T * KD));
    ck_assert(ep_guards_ok(part, sizeof partial0)); /* no row past the 4 a block holds */
    unsigned char *row = ep_get(ctx, drow, 4 * W2 * C * KS);
    ck_assert(ep_guards_ok(row, 4 * W2 * C * KS));
    free(row);
    free(rx);
    free(cnt);
    free(part);
    free(out);
    free(own);
    free(peer);
    void *all[] = {dsend, drecv, drx, dcnt, drow, dy, dpart, dback, dpos, dout};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        moefuse_buffer_free(ctx, all[i]);
    moefuse_context_destroy(ctx);
}
END_TEST

/* ------------------------------------------------------------------ refusals */

typedef struct ll_refusal {
    int32_t max_tokens, M, tmax;
    moefuse_ep_mode mode;
    moefuse_status st[EP_MAX_WORLD];
    char msg[EP_MAX_WORLD][512];
} ll_refusal;

/* Every rank makes the same call (a refused low-latency call has no vote: each rank refuses
   it on its own). */
static void ll_refusal_rank(ep_world *w, int32_t r)
{
    ll_refusal *f = w->arg;
    moefuse_context *ctx = w->ctx[r];
    const int32_t El = moefuse_ep_local_experts(w->group[r]);
    const int64_t M = f->M, K = 128, T = f->tmax, ids_shape[2] = {M, 2},
                  x_shape[2] = {M, K}, r_shape[3] = {El, T, K}, c_shape[1] = {El};
    int32_t ids[16];
    float wts[16];
    for (int i = 0; i < 16; i++) {
        ids[i] = i % 8;
        wts[i] = 1.0f;
    }
    void *dx = ep_put(ctx, NULL, 2 * (size_t)(M * K)), *dids = ep_put(ctx, ids, sizeof ids);
    void *dwts = ep_put(ctx, wts, sizeof wts), *drecv = ep_put(ctx, NULL, 2 * (size_t)(El * T * K));
    void *dcounts = ep_put(ctx, NULL, sizeof(int32_t) * (size_t)El);
    moefuse_tensor tx = moefuse_tensor_dense(dx, MOEFUSE_BF16, 2, x_shape);
    moefuse_tensor rx = moefuse_tensor_dense(drecv, MOEFUSE_BF16, 3, r_shape);
    moefuse_tensor rc = moefuse_tensor_dense(dcounts, MOEFUSE_I32, 1, c_shape);
    tx.offset = rx.offset = rc.offset = EP_GUARD;
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = moefuse_tensor_dense(dids, MOEFUSE_I32, 2, ids_shape);
    rt.topk_weights = moefuse_tensor_dense(dwts, MOEFUSE_F32, 2, ids_shape);
    rt.topk_ids.offset = rt.topk_weights.offset = EP_GUARD;
    moefuse_ep_dispatch_options o;
    memset(&o, 0, sizeof o);
    o.mode = f->mode;
    o.max_tokens = f->max_tokens;
    moefuse_ep_handle *h = (moefuse_ep_handle *)&h;
    f->st[r] = moefuse_ep_dispatch(ctx, w->group[r], &tx, NULL, &rt, &rx, NULL, &rc, &o, &h);
    snprintf(f->msg[r], sizeof f->msg[r], "%s", moefuse_last_error(ctx));
    ck_assert_ptr_null(h);
    unsigned char *back = ep_get(ctx, drecv, 2 * (size_t)(El * T * K));
    ck_assert(ep_untouched(back, 2 * (size_t)(El * T * K) + 2 * EP_GUARD));
    free(back);
    back = ep_get(ctx, dcounts, sizeof(int32_t) * (size_t)El);
    ck_assert(ep_untouched(back, sizeof(int32_t) * (size_t)El + 2 * EP_GUARD));
    free(back);
    void *all[] = {dx, dids, dwts, drecv, dcounts};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        moefuse_buffer_free(ctx, all[i]);
}

/* Two low-latency dispatches, then a combine with the first one's handle: its records were
   overwritten, so it is refused and out is left alone; the second's handle is taken. */
static void stale_rank(ep_world *w, int32_t r)
{
    moefuse_context *ctx = w->ctx[r];
    const int32_t El = moefuse_ep_local_experts(w->group[r]);
    const int64_t M = 4, K = 128, T = 8, ids_shape[2] = {M, 2}, x_shape[2] = {M, K},
                  r_shape[3] = {El, T, K}, c_shape[1] = {El};
    const int32_t ids[8] = {0, 5, 1, 6, 2, 7, 3, 4};
    const float wts[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    void *dx = ep_put(ctx, NULL, 2 * (size_t)(M * K)), *dids = ep_put(ctx, ids, sizeof ids);
    void *dwts = ep_put(ctx, wts, sizeof wts), *drecv = ep_put(ctx, NULL, 2 * (size_t)(El * T * K));
    void *dcounts = ep_put(ctx, NULL, sizeof(int32_t) * (size_t)El);
    void *dy = ep_put(ctx, NULL, 4 * (size_t)(El * T * K)), *dout = ep_put(ctx, NULL, 4 * M * K);
    moefuse_tensor tx = moefuse_tensor_dense(dx, MOEFUSE_BF16, 2, x_shape);
    moefuse_tensor rx = moefuse_tensor_dense(drecv, MOEFUSE_BF16, 3, r_shape);
    moefuse_tensor rc = moefuse_tensor_dense(dcounts, MOEFUSE_I32, 1, c_shape);
    moefuse_tensor ty = moefuse_tensor_dense(dy, MOEFUSE_F32, 3, r_shape);
    moefuse_tensor out = moefuse_tensor_dense(dout, MOEFUSE_F32, 2, x_shape);
    tx.offset = rx.offset = rc.offset = ty.offset = out.offset = EP_GUARD;
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = moefuse_tensor_dense(dids, MOEFUSE_I32, 2, ids_shape);
    rt.topk_weights = moefuse_tensor_dense(dwts, MOEFUSE_F32, 2, ids_shape);
    rt.topk_ids.offset = rt.topk_weights.offset = EP_GUARD;
    moefuse_ep_dispatch_options o;
    memset(&o, 0, sizeof o);
    o.mode = MOEFUSE_EP_LOW_LATENCY;
    o.max_tokens = 4;
    moefuse_ep_handle *first = NULL, *second = NULL;
    ck_assert_int_eq(moefuse_ep_dispatch(ctx, w->group[r], &tx, NULL, &rt, &rx, NULL, &rc, &o,
                                         &first),
                     MOEFUSE_OK);
    ck_assert_int_eq(moefuse_ep_dispatch(ctx, w->group[r], &tx, NULL, &rt, &rx, NULL, &rc, &o,
                                         &second),
                     MOEFUSE_OK);
    ck_assert_int_eq(moefuse_ep_combine(ctx, w->group[r], first, &ty, &out),
                     MOEFUSE_ERR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(moefuse_last_error(ctx), "latest"), "%s", moefuse_last_error(ctx));
    unsigned char *back = ep_get(ctx, dout, 4 * M * K);
    ck_assert(ep_untouched(back, 4 * M * K + 2 * EP_GUARD));
    free(back);
    ck_assert_int_eq(moefuse_ep_combine(ctx, w->group[r], second, &ty, &out), MOEFUSE_OK);
    moefuse_ep_handle_destroy(first);
    moefuse_ep_handle_destroy(second);
    void *all[] = {dx, dids, dwts, drecv, dcounts, dy, dout};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        moefuse_buffer_free(ctx, all[i]);
}

START_TEST(t_ll_stale_handle)
{
    ep_run(2, 8, NULL, stale_rank, NULL);
}
END_TEST

START_TEST(t_ll_refusals)
{
    static const struct {
        int32_t max_tokens, M, tmax;
        moefuse_ep_mode mode;
        moefuse_status st;
        const char *says;
    } cases[] = {
        {0, 4, 8, MOEFUSE_EP_LOW_LATENCY, MOEFUSE_ERR_INVALID_ARGUMENT, "max_tokens is 0"},
        {-3, 4, 8, MOEFUSE_EP_LOW_LATENCY, MOEFUSE_ERR_INVALID_ARGUMENT, "max_tokens is -3"},
        {3, 4, 8, MOEFUSE_EP_LOW_LATENCY, MOEFUSE_ERR_SHAPE, "more than max_tokens = 3"},
        {4, 4, 7, MOEFUSE_EP_LOW_LATENCY, MOEFUSE_ERR_SHAPE, "Tmax = 7"},
        {4, 4, 8, MOEFUSE_EP_NORMAL, MOEFUSE_ERR_INVALID_ARGUMENT, "max_tokens is 4"},
        {4, 4, 8, (moefuse_ep_mode)7, MOEFUSE_ERR_INVALID_ARGUMENT, "mode 7"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ll_refusal f;
        memset(&f, 0, sizeof f);
        f.max_tokens = cases[i].max_tokens;
        f.M = cases[i].M;
        f.tmax = cases[i].tmax;
        f.mode = cases[i].mode;
        ep_run(2, 8, NULL, ll_refusal_rank, &f);
        for (int r = 0; r < 2; r++) {
            ck_assert_msg(f.st[r] == cases[i].st, "case %zu rank %d: %s", i, r, f.msg[r]);
            ck_assert_msg(strstr(f.msg[r], cases[i].says), "case %zu: %s", i, f.msg[r]);
        }
    }
}
END_TEST

void ep_add_ll_tests(Suite *s)
{
    TCase *tc = h_add_tcase(s, "ep_low_latency", NULL, 120);
    tcase_add_test(tc, t_ll_rows);
    tcase_add_test(tc, t_ll_fp8);
    tcase_add_test(tc, t_ll_lost_rows);
    tcase_add_test(tc, t_ll_many_rows);
    tcase_add_test(tc, t_ll_stale_handle);
    tcase_add_test(tc, t_ll_other_paths);
    tcase_add_test(tc, t_ll_many_lost);
    tcase_add_test(tc, t_ll_untrusted);
    tcase_add_test(tc, t_ll_refusals);
}
