/*
 * moefuse_ep_dispatch and moefuse_ep_combine on their own (ranks as threads): every received
 * row, count and scale against the senders' rows in the contract's order (source rank, token,
 * slot), rows past the counts untouched, the combine's sum against the same sum taken here;
 * an expert over its capacity failing every rank with nothing written; and the refusals.
 */
#include "test_ep.h"

#include "cpu/scales.h"

#include <math.h>
#include <string.h>


static moefuse_tensor dense(void *p, moefuse_dtype dt, int32_t rank, int64_t a, int64_t b,
                            int64_t c)
{
    const int64_t shape[3] = {a, b, c};
    return moefuse_tensor_dense(p, dt, rank, shape);
}

/* recv_scales of E experts in layout l: its dtype, shape and bytes */
static moefuse_tensor rscales_of(void *p, const lay *l, int64_t E, int64_t T, int64_t K)
{
    const int64_t G = K / 128, Ta = (T + 3) / 4 * 4;
    if (l->layout == MOEFUSE_SCALE_ROW_MAJOR)
        return dense(p, l->ue8m0 ? MOEFUSE_U8 : MOEFUSE_F32, 3, E, T, G);
    if (l->layout == MOEFUSE_SCALE_COLUMN_MAJOR)
        return dense(p, l->ue8m0 ? MOEFUSE_U8 : MOEFUSE_F32, 3, E, G, Ta);
    return dense(p, MOEFUSE_I32, 3, E, (G + 3) / 4, Ta);
}

/* The value the experts "compute" for row t of local expert e on rank r, channel c: a bf16
   value (its low 16 bits zero), so that a bf16 y holds it exactly. */
static float y_of(int32_t r, int64_t e, int64_t t, int64_t c)
{
    const float v = (float)((r * 131 + e * 31 + t * 7 + c) % 97) / 97.0f - 0.5f;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits &= 0xFFFF0000u;
    float b;
    memcpy(&b, &bits, sizeof b);
    return b;
}

/* A tensor over backend memory from ep_put (its data past the guard). */
static moefuse_tensor on(void *buf, moefuse_dtype dt, int32_t rank, int64_t a, int64_t b,
                         int64_t c)
{
    moefuse_tensor t = dense(buf, dt, rank, a, b, c);
    t.offset = EP_GUARD;
    return t;
}

/* One rank: its inputs into its backend's memory, dispatch, the experts' outputs y as a
   function of (rank, e, t, c), combine; every output read back with its guards. */
void ep_disp_rank(ep_world *w, int32_t r)
{
    disp_case *c = w->arg;
    moefuse_context *ctx = w->ctx[r];
    const int64_t K = c->K, T = c->tmax, M = c->M[r];
    const int32_t El = moefuse_ep_local_experts(w->group[r]);
    const bool fp8 = c->quantize || c->f8x;
    const moefuse_dtype rdt = fp8 ? MOEFUSE_F8_E4M3 : c->dt;
    c->local[r] = El;
    const size_t xb = (c->f8x ? 1 : moefuse_dtype_size(c->dt)) * (size_t)(M * K);
    const size_t rb = moefuse_dtype_size(rdt) * (size_t)(El * T * K);
    const size_t cb = sizeof(int32_t) * (size_t)El, sb = sizeof(int32_t) * (size_t)(M * c->k);
    void *dx = ep_put(ctx, c->f8x ? c->xq[r] : c->x[r], xb), *dids = ep_put(ctx, c->ids[r], sb);
    void *dxs = c->f8x ? ep_put(ctx, c->xs[r], c->xs_bytes[r]) : NULL;
    void *dwts = ep_put(ctx, c->wts[r], sizeof(float) * (size_t)(M * c->k));
    void *drecv = ep_put(ctx, NULL, rb), *dcounts = ep_put(ctx, NULL, cb), *dscales = NULL;
    moefuse_tensor x = on(dx, c->f8x ? MOEFUSE_F8_E4M3 : c->dt, 2, M, K, 0);
    moefuse_tensor xs;
    memset(&xs, 0, sizeof xs);
    if (c->f8x) {
        xs = rscales_of(dxs, &LAYS[c->lay], 1, M, K); /* [1, ...]: the 2-D layout's */
        xs.rank = 2;
        xs.shape[0] = xs.shape[1], xs.shape[1] = xs.shape[2];
        xs.stride[0] = xs.stride[1], xs.stride[1] = xs.stride[2];
        xs.offset = EP_GUARD;
    }
    moefuse_tensor rx = on(drecv, rdt, 3, El, T, K);
    moefuse_tensor rc = on(dcounts, MOEFUSE_I32, 1, El, 0, 0);
    moefuse_tensor rs;
    memset(&rs, 0, sizeof rs);
    if (fp8) {
        rs = rscales_of(NULL, &LAYS[c->lay], El, T, K);
        c->scale_bytes[r] = (size_t)moefuse_tensor_span_bytes(&rs);
        dscales = ep_put(ctx, NULL, c->scale_bytes[r]);
        rs.data = dscales;
        rs.offset = EP_GUARD;
    }
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = on(dids, MOEFUSE_I32, 2, M, c->k, 0);
    rt.topk_weights = on(dwts, MOEFUSE_F32, 2, M, c->k, 0);
    moefuse_ep_handle *h = NULL;
    c->st[r] = moefuse_ep_dispatch(ctx, w->group[r], &x, c->f8x ? &xs : NULL, &rt, &rx, &rs, &rc,
                                   &c->opt, &h);
    snprintf(c->msg[r], sizeof c->msg[r], "%s", moefuse_last_error(ctx));
    c->recv[r] = ep_get(ctx, drecv, rb);
    c->counts[r] = ep_get(ctx, dcounts, cb);
    if (dscales)
        c->scales[r] = ep_get(ctx, dscales, c->scale_bytes[r]);
    if (c->st[r] == MOEFUSE_OK) {
        const int32_t *counts = (const int32_t *)(c->counts[r] + EP_GUARD);
        float *y = malloc(sizeof(float) * (size_t)(El * T * K) + 1);
        for (int64_t e = 0; e < El; e++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t ch = 0; ch < K; ch++)
                    y[(e * T + t) * K + ch] = t < counts[e] ? y_of(r, e, t, ch) : NAN;
        size_t yb = sizeof(float) * (size_t)(El * T * K);
        if (c->y_bf16) { /* the same values as bf16 (exact: y_of's are rounded to them) */
            uint16_t *h = (uint16_t *)y;
            for (int64_t i = 0; i < El * T * K; i++) {
                uint32_t bits;
                memcpy(&bits, &y[i], sizeof bits);
                h[i] = (uint16_t)(bits >> 16);
            }
            yb /= 2;
        }
        const size_t ob = (c->out_bf16 ? 2 : sizeof(float)) * (size_t)(M * K);
        void *dy = ep_put(ctx, y, yb), *dout = ep_put(ctx, NULL, ob);
        moefuse_tensor ty = on(dy, c->y_bf16 ? MOEFUSE_BF16 : MOEFUSE_F32, 3, El, T, K);
        moefuse_tensor out = on(dout, c->out_bf16 ? MOEFUSE_BF16 : MOEFUSE_F32, 2, M, K, 0);
        c->st_combine[r] = moefuse_ep_combine(ctx, w->group[r], h, &ty, &out);
        c->out[r] = ep_get(ctx, dout, ob);
        moefuse_buffer_free(ctx, dy);
        moefuse_buffer_free(ctx, dout);
        free(y);
    } else {
        ck_assert_ptr_null(h);
    }
    moefuse_ep_handle_destroy(h);
    void *all[] = {dx, dxs, dids, dwts, drecv, dcounts, dscales};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i])
            moefuse_buffer_free(ctx, all[i]);
}

int ep_untouched(const void *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (((const unsigned char *)p)[i] != 0xA5)
            return 0;
    return 1;
}

/* f rounded to bf16 (to nearest, ties to even), as f32. */
static float bf16_rne(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    if ((b & 0x7F800000u) != 0x7F800000u) /* finite: round; Inf and NaN as they are */
        b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* Element i of rank p's out, read back (f32, or bf16 widened). */
static float out_at(const disp_case *c, int32_t p, int64_t i)
{
    const unsigned char *o = c->out[p] + EP_GUARD;
    if (!c->out_bf16)
        return ((const float *)o)[i];
    uint16_t h;
    memcpy(&h, o + 2 * i, sizeof h);
    const uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* What the experts gave slot (m, j) of rank p: y of its row t, the rows of its expert from
   ranks before p, then from this rank's slots before it. */
static float slot_y(const disp_case *c, const ep_world *wv, int32_t p, int64_t m, int64_t j,
                    int64_t ch)
{
    const int32_t g = c->ids[p][m * c->k + j], r = ep_owner(wv, g), e = ep_local(wv, g);
    int64_t t = 0;
    for (int32_t q = 0; q < p; q++)
        for (int64_t s = 0; s < c->M[q] * c->k; s++)
            t += c->ids[q][s] >= 0 && c->ids[q][s] < c->E && ep_owner(wv, c->ids[q][s]) == r &&
                 ep_local(wv, c->ids[q][s]) == e;
    for (int64_t s = 0; s < m * c->k + j; s++)
        t += c->ids[p][s] >= 0 && c->ids[p][s] < c->E && ep_owner(wv, c->ids[p][s]) == r &&
             ep_local(wv, c->ids[p][s]) == e;
    return y_of(r, e, t, ch);
}

static void check_dispatch(disp_case *c, ep_world *wv)
{
    const int64_t K = c->K, T = c->tmax, G = K / 128;
    moefuse_context *ref;
    ck_assert_int_eq(moefuse_context_create(&ref, "cpu"), MOEFUSE_OK);
    /* the senders' FP8 rows, as moefuse_quant forms them (row-major f32 scales) */
    unsigned char *codes[EP_MAX_WORLD] = {0};
    float *qs[EP_MAX_WORLD] = {0};
    const bool fp8 = c->quantize || c->f8x;
    for (int32_t p = 0; p < c->world && fp8; p++) {
        const int64_t M = c->M[p];
        codes[p] = malloc((size_t)(M * K) + 1);
        qs[p] = malloc(sizeof(float) * (size_t)(M * G) + 1);
        moefuse_tensor x = dense(c->x[p], c->dt, 2, M, K, 0);
        moefuse_tensor q = dense(codes[p], MOEFUSE_F8_E4M3, 2, M, K, 0);
        moefuse_tensor s = dense(qs[p], MOEFUSE_F32, 2, M, G, 0);
        moefuse_quant_options o = c->opt.act;
        o.scale_layout = MOEFUSE_SCALE_ROW_MAJOR;
        o.ue8m0 = LAYS[c->lay].ue8m0;
        ck_assert_int_eq(moefuse_quant(ref, &x, &q, &s, &o), MOEFUSE_OK);
    }
    moefuse_context_destroy(ref);
    const size_t rs = moefuse_dtype_size(fp8 ? MOEFUSE_F8_E4M3 : c->dt) * (size_t)K;
    for (int32_t r = 0; r < c->world; r++) {
        const int32_t El = c->local[r];
        ck_assert_msg(c->st[r] == MOEFUSE_OK, "rank %d: dispatch %s: %s", (int)r,
                      moefuse_status_name(c->st[r]), c->msg[r]);
        ck_assert_msg(c->st_combine[r] == MOEFUSE_OK, "rank %d: combine %s", (int)r,
                      moefuse_status_name(c->st_combine[r]));
        moefuse_tensor sc = fp8 ? rscales_of(c->scales[r] + EP_GUARD, &LAYS[c->lay], El, T, K)
                                : dense(NULL, MOEFUSE_F32, 1, 0, 0, 0);
        moefuse_tensor sc3 = sc;
        for (int32_t e = 0; e < El; e++) {
            int64_t t = 0;
            for (int32_t p = 0; p < c->world; p++)
                for (int64_t s = 0; s < c->M[p] * c->k; s++) {
                    const int32_t g = c->ids[p][s];
                    if (g < 0 || g >= c->E || ep_owner(wv, g) != r || ep_local(wv, g) != e)
                        continue;
                    const int64_t m = s / c->k;
                    const char *got =
                        (const char *)c->recv[r] + EP_GUARD + rs * (size_t)(e * T + t);
                    const void *want = fp8 ? (const void *)(codes[p] + m * K)
                                                   : (const void *)((const char *)c->x[p] +
                                                                    rs * (size_t)m);
                    ck_assert_msg(memcmp(got, want, rs) == 0,
                                  "rank %d expert %d row %lld: not row %lld of rank %d", (int)r,
                                  (int)e, (long long)t, (long long)m, (int)p);
                    for (int64_t gi = 0; gi < G && fp8; gi++) {
                        const moefuse_scale_layout L = (moefuse_scale_layout)LAYS[c->lay].layout;
                        const float v = mf_scale_read(&sc3, L, e, t, gi);
                        ck_assert_msg(v == qs[p][m * G + gi],
                                      "rank %d expert %d row %lld: scale %lld", (int)r, (int)e,
                                      (long long)t, (long long)gi);
                    }
                    t++;
                }
            ck_assert_int_eq(((const int32_t *)(c->counts[r] + EP_GUARD))[e], t);
            const char *past = (const char *)c->recv[r] + EP_GUARD + rs * (size_t)(e * T + t);
            ck_assert_msg(ep_untouched(past, rs * (size_t)(T - t)),
                          "rank %d expert %d: rows past the count were written", (int)r, (int)e);
        }
        ck_assert(ep_guards_ok(c->recv[r], rs * (size_t)(El * T)) &&
                  ep_guards_ok(c->counts[r], sizeof(int32_t) * (size_t)El));
        if (fp8)
            ck_assert(ep_guards_ok(c->scales[r], c->scale_bytes[r]));
    }
    /* combine: out[m] = sum over valid j of w * y of the slot, taken here the same way; the
       low-latency mode sums each rank's slots (in slot order), then those sums in rank order */
    for (int32_t p = 0; p < c->world; p++) {
        for (int64_t m = 0; m < c->M[p]; m++) {
            for (int64_t ch = 0; ch < K; ch++) {
                float acc = 0.0f;
                for (int32_t q = 0; q < (c->ll ? c->world : 1); q++) {
                    float part = 0.0f;
                    bool any = false;
                    for (int64_t j = 0; j < c->k; j++) {
                        const int32_t g = c->ids[p][m * c->k + j];
                        if (g < 0 || g >= c->E || (c->ll && ep_owner(wv, g) != q))
                            continue;
                        const float prod = c->wts[p][m * c->k + j] * slot_y(c, wv, p, m, j, ch);
                        part = part + prod;
                        any = true;
                    }
                    if (!c->ll)
                        acc = part;
                    else if (any)
                        acc = acc + part;
                }
                const float got = out_at(c, p, m * K + ch);
                const float want = c->out_bf16 ? bf16_rne(acc) : acc;
                ck_assert_msg(got == want || (want != want && got != got),
                              "rank %d token %lld: combine", (int)p, (long long)m);
            }
        }
        ck_assert(ep_guards_ok(c->out[p], (c->out_bf16 ? 2 : sizeof(float)) *
                                              (size_t)(c->M[p] * K)));
    }
    for (int32_t p = 0; p < c->world; p++) {
        free(codes[p]);
        free(qs[p]);
    }
}

/* The placement check_dispatch reads (ep_owner, ep_local) */
static ep_world placement;

void ep_disp_check(disp_case *c) { check_dispatch(c, &placement); }

void ep_disp_run(disp_case *c, const int32_t *owner)
{
    if (c->ll) {
        c->opt.mode = MOEFUSE_EP_LOW_LATENCY;
        for (int32_t r = 0; r < c->world; r++)
            c->opt.max_tokens = c->M[r] > c->opt.max_tokens ? (int32_t)c->M[r] : c->opt.max_tokens;
        c->opt.max_tokens += c->opt.max_tokens == 0; /* at least 1 */
    }
    for (int32_t r = 0; r < c->world; r++) {
        const int64_t M = c->M[r];
        c->x[r] = malloc(moefuse_dtype_size(c->dt) * (size_t)(M * c->K) + 1);
        c->ids[r] = malloc(sizeof(int32_t) * (size_t)(M * c->k) + 1);
        c->wts[r] = malloc(sizeof(float) * (size_t)(M * c->k) + 1);
        ep_fill(c->x[r], c->dt, M * c->K);
        ep_routing(c->ids[r], c->wts[r], M, c->k, 0, c->E, c->E);
        for (int64_t s = 0; c->busy && s < M * c->k; s++)
            c->ids[r][s] = 1;
        if (c->f8x) { /* x quantized here, its scales in the case's layout */
            moefuse_context *ref;
            ck_assert_int_eq(moefuse_context_create(&ref, "cpu"), MOEFUSE_OK);
            moefuse_tensor s2 = rscales_of(NULL, &LAYS[c->lay], 1, M, c->K);
            c->xs_bytes[r] = (size_t)moefuse_tensor_span_bytes(&s2);
            c->xq[r] = malloc((size_t)(M * c->K) + 1);
            c->xs[r] = calloc(c->xs_bytes[r] + 1, 1);
            s2.data = c->xs[r];
            s2.rank = 2;
            s2.shape[0] = s2.shape[1], s2.shape[1] = s2.shape[2];
            s2.stride[0] = s2.stride[1], s2.stride[1] = s2.stride[2];
            moefuse_tensor x = dense(c->x[r], c->dt, 2, M, c->K, 0);
            moefuse_tensor q = dense(c->xq[r], MOEFUSE_F8_E4M3, 2, M, c->K, 0);
            ck_assert_int_eq(moefuse_quant(ref, &x, &q, &s2, &c->opt.act), MOEFUSE_OK);
            moefuse_context_destroy(ref);
        }
    }
    ep_run(c->world, c->E, owner, ep_disp_rank, c);
    memset(&placement, 0, sizeof placement);
    placement.owner = owner;
    placement.world = c->world;
    placement.experts = c->E;
}

void ep_disp_free(disp_case *c)
{
    for (int32_t r = 0; r < c->world; r++) {
        free(c->x[r]);
        free(c->xq[r]);
        free(c->xs[r]);
        free(c->ids[r]);
        free(c->wts[r]);
        free(c->recv[r]);
        free(c->scales[r]);
        free(c->counts[r]);
        free(c->out[r]);
    }
}

disp_case ep_disp_case(int32_t world, int64_t M, int64_t tmax)
{
    disp_case c;
    memset(&c, 0, sizeof c);
    c.world = world;
    c.E = 8;
    c.k = 4;
    c.K = 256;
    c.tmax = tmax;
    for (int32_t r = 0; r < world; r++)
        c.M[r] = M + 5 * r;
    c.dt = MOEFUSE_BF16;
    return c;
}

void ep_disp_check_padding(const disp_case *c)
{
    const lay *l = &LAYS[c->lay];
    for (int32_t r = 0; r < c->world && l->layout != MOEFUSE_SCALE_ROW_MAJOR; r++) {
        moefuse_tensor s = rscales_of(NULL, l, c->local[r], c->tmax, c->K);
        const unsigned char *sb = c->scales[r] + EP_GUARD;
        const size_t es = moefuse_dtype_size(s.dtype);
        for (int64_t e = 0; e < s.shape[0]; e++)
            for (int64_t w = 0; w < s.shape[1]; w++)
                for (int64_t t = c->tmax; t < s.shape[2]; t++)
                    for (size_t b = 0; b < es; b++)
                        ck_assert_int_eq(sb[((e * s.shape[1] + w) * s.shape[2] + t) * es + b], 0);
    }
}

START_TEST(t_dispatch_rows)
{
    static const int32_t worlds[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        disp_case c = ep_disp_case(worlds[i], 23, 200);
        ep_disp_run(&c, NULL);
        ep_disp_check(&c);
        ep_disp_free(&c);
    }
    disp_case y = ep_disp_case(2, 17, 200); /* the experts' outputs in bf16 */
    y.y_bf16 = 1;
    ep_disp_run(&y, NULL);
    ep_disp_check(&y);
    ep_disp_free(&y);
    disp_case f = ep_disp_case(2, 17, 200); /* f16 and f32 rows: the same bytes */
    f.dt = MOEFUSE_F16;
    ep_disp_run(&f, NULL);
    ep_disp_check(&f);
    ep_disp_free(&f);
    f = ep_disp_case(2, 17, 200);
    f.dt = MOEFUSE_F32;
    ep_disp_run(&f, NULL);
    ep_disp_check(&f);
    ep_disp_free(&f);
    static const int32_t owner[8] = {3, 0, 0, 3, 2, 0, 2, 3}; /* rank 1 holds none */
    disp_case d = ep_disp_case(4, 0, 100);
    d.M[1] = 1;
    d.M[3] = 19;
    ep_disp_run(&d, owner);
    ep_disp_check(&d);
    ep_disp_free(&d);
}
END_TEST

START_TEST(t_dispatch_fp8_layouts)
{
    for (int l = 0; l < 5; l++) {
        disp_case c = ep_disp_case(2, 13, 41); /* Tmax 41: the padded layouts pad 3 rows */
        c.quantize = 1;
        c.lay = l;
        c.opt.quantize = 1;
        c.opt.act.scale_layout = (moefuse_scale_layout)LAYS[l].layout;
        c.opt.act.ue8m0 = LAYS[l].ue8m0;
        ep_disp_run(&c, NULL);
        ep_disp_check(&c);
        ep_disp_check_padding(&c);
        ep_disp_free(&c);
    }
}
END_TEST

START_TEST(t_dispatch_f8_x)
{
    for (int l = 0; l < 5; l++) { /* an f8 x, its scales in each layout, recv_scales likewise */
        disp_case c = ep_disp_case(4, 11, 64);
        c.f8x = 1;
        c.lay = l;
        c.opt.act.scale_layout = (moefuse_scale_layout)LAYS[l].layout;
        c.opt.act.ue8m0 = LAYS[l].ue8m0;
        ep_disp_run(&c, NULL);
        ep_disp_check(&c);
        ep_disp_free(&c);
    }
}
END_TEST

/* Every slot of both ranks (M = 9 and 14 tokens, k = 4) to expert 1, held by rank 0: 92 rows,
   against a Tmax of tmax. */
static void one_busy_expert(disp_case *c, int64_t tmax)
{
    *c = ep_disp_case(2, 9, tmax);
    c->busy = 1;
    ep_disp_run(c, NULL);
}

START_TEST(t_dispatch_overflow)
{
    /* one row over Tmax: every rank fails, nothing is written anywhere */
    disp_case c;
    one_busy_expert(&c, 91);
    for (int32_t r = 0; r < 2; r++) {
        ck_assert_int_eq(c.st[r], MOEFUSE_ERR_SHAPE);
        ck_assert_msg(strstr(c.msg[r], "local expert 1 of rank 0 receives 92 rows"), "%s",
                      c.msg[r]);
        const size_t n = 2 * (size_t)(c.local[r] * c.tmax * c.K);
        ck_assert(ep_untouched(c.recv[r], n + 2 * EP_GUARD));
        ck_assert(ep_untouched(c.counts[r], sizeof(int32_t) * (size_t)c.local[r] + 2 * EP_GUARD));
    }
    ep_disp_free(&c);
    /* exactly Tmax rows: taken */
    one_busy_expert(&c, 92);
    for (int32_t r = 0; r < 2; r++)
        ck_assert_msg(c.st[r] == MOEFUSE_OK && c.st_combine[r] == MOEFUSE_OK, "rank %d: %s",
                      (int)r, c.msg[r]);
    ck_assert_int_eq(((const int32_t *)(c.counts[0] + EP_GUARD))[1], 92);
    ep_disp_free(&c);
}
END_TEST

/* ------------------------------------------------------------------ refusals */

typedef struct refusal {
    int what; /* 0 low-latency without max_tokens, 1 expert_map on rank 1 only, 2 shared experts */
    moefuse_status st[EP_MAX_WORLD];
    char msg[EP_MAX_WORLD][512];
} refusal;

static void refusal_rank(ep_world *w, int32_t r)
{
    refusal *f = w->arg;
    moefuse_context *ctx = w->ctx[r];
    const int32_t ids[8] = {0, 1, 2, 3, 4, 5, 6, 7}, map[8] = {0};
    const float wts[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    const int32_t El = moefuse_ep_local_experts(w->group[r]);
    void *dx = ep_put(ctx, NULL, 2 * 4 * 128), *dids = ep_put(ctx, ids, sizeof ids);
    void *dwts = ep_put(ctx, wts, sizeof wts), *dmap = ep_put(ctx, map, sizeof map);
    void *drecv = ep_put(ctx, NULL, 2 * (size_t)(El * 2 * 128));
    void *dcounts = ep_put(ctx, NULL, sizeof(int32_t) * (size_t)El);
    moefuse_tensor tx = on(dx, MOEFUSE_BF16, 2, 4, 128, 0);
    moefuse_tensor rx = on(drecv, MOEFUSE_BF16, 3, El, 2, 128);
    moefuse_tensor rc = on(dcounts, MOEFUSE_I32, 1, El, 0, 0);
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = on(dids, MOEFUSE_I32, 2, 4, 2, 0);
    rt.topk_weights = on(dwts, MOEFUSE_F32, 2, 4, 2, 0);
    moefuse_ep_dispatch_options o;
    memset(&o, 0, sizeof o);
    if (f->what == 0)
        o.mode = MOEFUSE_EP_LOW_LATENCY;
    if (f->what == 1 && r == 1)
        rt.expert_map = on(dmap, MOEFUSE_I32, 1, 8, 0, 0);
    if (f->what == 2)
        rt.n_shared = 1;
    moefuse_ep_handle *h = NULL;
    f->st[r] = moefuse_ep_dispatch(ctx, w->group[r], &tx, NULL, &rt, &rx, NULL, &rc, &o, &h);
    snprintf(f->msg[r], sizeof f->msg[r], "%s", moefuse_last_error(ctx));
    moefuse_ep_handle_destroy(h);
    void *all[] = {dx, dids, dwts, dmap, drecv, dcounts};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        moefuse_buffer_free(ctx, all[i]);
}

START_TEST(t_refusals)
{
    refusal f;
    memset(&f, 0, sizeof f);
    ep_run(2, 8, NULL, refusal_rank, &f);
    for (int r = 0; r < 2; r++) { /* the low-latency mode without its max_tokens */
        ck_assert_int_eq(f.st[r], MOEFUSE_ERR_INVALID_ARGUMENT);
        ck_assert_msg(strstr(f.msg[r], "max_tokens"), "%s", f.msg[r]);
    }
    f.what = 1; /* one rank's bad argument stops both, the other's message names it */
    ep_run(2, 8, NULL, refusal_rank, &f);
    ck_assert_int_eq(f.st[1], MOEFUSE_ERR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(f.msg[1], "expert_map"), "%s", f.msg[1]);
    ck_assert_int_eq(f.st[0], MOEFUSE_ERR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(f.msg[0], "rank 1"), "%s", f.msg[0]);
    f.what = 2;
    ep_run(4, 8, NULL, refusal_rank, &f);
    for (int r = 0; r < 4; r++)
        ck_assert_int_eq(f.st[r], MOEFUSE_ERR_UNSUPPORTED);

    /* groups: configs refused with a message; NCCL not built yet */
    moefuse_context *ctx;
    ck_assert_int_eq(moefuse_context_create(&ctx, h_backend()), MOEFUSE_OK);
    mf_ep_inproc_world *w = mf_ep_inproc_world_create(2);
    moefuse_ep_group *g = (moefuse_ep_group *)&g;
    const int32_t bad_owner[4] = {0, 1, 2, 0};
    const moefuse_ep_config bad[] = {
        {0, 3, 8, NULL, {0}},       /* another world size */
        {2, 2, 8, NULL, {0}},       /* rank out of range */
        {0, 2, 7, NULL, {0}},       /* 7 experts in 2 blocks */
        {0, 2, 4, bad_owner, {0}},  /* an owner out of range */
        {0, 2, 0, NULL, {0}},       /* no experts */
        {0, 2, 8, NULL, {0, 1, 0, 0}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        g = (moefuse_ep_group *)&g;
        const moefuse_status st = mf_ep_group_create_inproc(ctx, w, &bad[i], &g);
        ck_assert_msg(st != MOEFUSE_OK && strlen(moefuse_last_error(ctx)) > 0, "config %zu", i);
        ck_assert_ptr_null(g);
    }
    moefuse_ep_unique_id id;
    memset(&id, 0, sizeof id);
    const moefuse_ep_config ok = {0, 2, 8, NULL, {0}};
    ck_assert_int_eq(moefuse_ep_group_create(ctx, NULL, &ok, &g), MOEFUSE_ERR_NULL_POINTER);
    ck_assert_ptr_null(g);
    ck_assert_int_eq(moefuse_ep_group_adopt(ctx, NULL, &ok, &g), MOEFUSE_ERR_NULL_POINTER);
    ck_assert_int_eq(moefuse_ep_unique_id_create(ctx, NULL), MOEFUSE_ERR_NULL_POINTER);
    if (strcmp(h_backend(), "cpu") == 0) { /* NCCL groups are the cuda backend's */
        ck_assert_int_eq(moefuse_ep_unique_id_create(ctx, &id), MOEFUSE_ERR_UNSUPPORTED);
        ck_assert_int_eq(moefuse_ep_group_create(ctx, &id, &ok, &g), MOEFUSE_ERR_UNSUPPORTED);
        ck_assert_ptr_null(g);
        ck_assert_msg(strstr(moefuse_last_error(ctx), "NCCL"), "%s", moefuse_last_error(ctx));
    } else if (strcmp(h_backend(), "cuda") == 0) {
        /* NCCL not found: the file looked for is named (this process has not loaded NCCL) */
        setenv("MOEFUSE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
        ck_assert_int_eq(moefuse_ep_unique_id_create(ctx, &id), MOEFUSE_ERR_BACKEND_UNAVAILABLE);
        ck_assert_msg(strstr(moefuse_last_error(ctx), "/nonexistent/libnccl.so.2"), "%s",
                      moefuse_last_error(ctx));
        ck_assert_int_eq(moefuse_ep_group_create(ctx, &id, &ok, &g),
                         MOEFUSE_ERR_BACKEND_UNAVAILABLE);
        ck_assert_ptr_null(g);
        unsetenv("MOEFUSE_NCCL_LIBRARY");
    }
    ck_assert_int_eq(moefuse_ep_local_experts(NULL), 0);
    moefuse_ep_group_destroy(NULL);
    moefuse_ep_handle_destroy(NULL);
    mf_ep_inproc_world_destroy(w);
    moefuse_context_destroy(ctx);
}
END_TEST

void ep_add_dispatch_tests(Suite *s)
{
    TCase *tc = h_add_tcase(s, "ep_dispatch", NULL, 120);
    tcase_add_test(tc, t_dispatch_rows);
    tcase_add_test(tc, t_dispatch_fp8_layouts);
    tcase_add_test(tc, t_dispatch_f8_x);
    tcase_add_test(tc, t_dispatch_overflow);
    tcase_add_test(tc, t_refusals);
}
