/*
 * The low-latency mode of moefuse_ep_dispatch and moefuse_ep_combine (ranks as threads): the
 * rows, counts and scales exactly where the normal mode puts them, the combine's sum by rank,
 * rows lost past Tmax made loud (their count, NaN in their tokens), and the refusals.
 */
#include "test_ep.h"

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
    c.ll = 1;
    c.opt.mode = MOEFUSE_EP_LOW_LATENCY;
    c.opt.max_tokens = 14;
    for (int32_t r = 0; r < 2; r++) {
        const int64_t M = c.M[r];
        c.x[r] = malloc(2 * (size_t)(M * c.K));
        c.ids[r] = malloc(sizeof(int32_t) * (size_t)(M * c.k));
        c.wts[r] = malloc(sizeof(float) * (size_t)(M * c.k));
        ep_fill(c.x[r], c.dt, M * c.K);
        for (int64_t s = 0; s < M * c.k; s++) {
            c.ids[r][s] = 1;
            c.wts[r][s] = 0.5f;
        }
    }
    ep_run(2, c.E, NULL, ep_disp_rank, &c);
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
    tcase_add_test(tc, t_ll_refusals);
}
