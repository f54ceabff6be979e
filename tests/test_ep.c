/*
 * Expert parallelism on the CPU backend, ranks as threads (the library's in-process transport):
 * the layer against the one-device layer bit for bit (bf16 and FP8, world sizes 1, 2 and 4,
 * uneven loads, a rank without experts, every scale layout of an f8 x), and here the world's
 * plumbing; test_ep_dispatch.c tests dispatch and combine on their own, capacity overflow and
 * the refusals. Output buffers carry canary bytes on both sides.
 */
#include "test_ep.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

#define CANARY 0xA5
#define GUARD EP_GUARD

/* ------------------------------------------------------------------ world */

typedef struct rank_arg {
    ep_world *w;
    int32_t rank;
} rank_arg;

static void *rank_main(void *p)
{
    rank_arg *a = p;
    a->w->run(a->w, a->rank);
    return NULL;
}

void ep_run(int32_t world, int32_t experts, const int32_t *owner,
            void (*run)(ep_world *, int32_t), void *arg)
{
    ep_world w;
    memset(&w, 0, sizeof w);
    w.world = world;
    w.experts = experts;
    w.owner = owner;
    w.run = run;
    w.arg = arg;
    w.w = mf_ep_inproc_world_create(world);
    ck_assert_ptr_nonnull(w.w);
    for (int32_t r = 0; r < world; r++) {
        ck_assert_int_eq(moefuse_context_create(&w.ctx[r], h_backend()), MOEFUSE_OK);
        moefuse_ep_config c = {r, world, experts, owner, {0}};
        ck_assert_int_eq(mf_ep_group_create_inproc(w.ctx[r], w.w, &c, &w.group[r]), MOEFUSE_OK);
    }
    pthread_t th[EP_MAX_WORLD];
    rank_arg args[EP_MAX_WORLD];
    for (int32_t r = 0; r < world; r++) {
        args[r] = (rank_arg){&w, r};
        ck_assert_int_eq(pthread_create(&th[r], NULL, rank_main, &args[r]), 0);
    }
    for (int32_t r = 0; r < world; r++)
        pthread_join(th[r], NULL);
    for (int32_t r = 0; r < world; r++) {
        moefuse_ep_group_destroy(w.group[r]);
        moefuse_context_destroy(w.ctx[r]);
    }
    mf_ep_inproc_world_destroy(w.w);
}

int32_t ep_owner(const ep_world *w, int32_t g)
{
    return w->owner ? w->owner[g] : g / (w->experts / w->world);
}

int32_t ep_local(const ep_world *w, int32_t g)
{
    int32_t n = 0;
    for (int32_t e = 0; e < g; e++)
        n += ep_owner(w, e) == ep_owner(w, g);
    return n;
}

void *ep_put(moefuse_context *ctx, const void *host, size_t bytes)
{
    unsigned char *tmp = malloc(bytes + 2 * GUARD);
    ck_assert_ptr_nonnull(tmp);
    memset(tmp, CANARY, bytes + 2 * GUARD);
    if (host && bytes)
        memcpy(tmp + GUARD, host, bytes);
    void *buf = NULL;
    ck_assert_int_eq(moefuse_buffer_alloc(ctx, bytes + 2 * GUARD, &buf), MOEFUSE_OK);
    ck_assert_int_eq(moefuse_buffer_write(ctx, buf, 0, tmp, bytes + 2 * GUARD), MOEFUSE_OK);
    free(tmp);
    return buf;
}

unsigned char *ep_get(moefuse_context *ctx, void *buffer, size_t bytes)
{
    unsigned char *copy = malloc(bytes + 2 * GUARD);
    ck_assert_ptr_nonnull(copy);
    ck_assert_int_eq(moefuse_buffer_read(ctx, buffer, 0, copy, bytes + 2 * GUARD), MOEFUSE_OK);
    return copy;
}

int ep_guards_ok(const unsigned char *copy, size_t bytes)
{
    for (size_t i = 0; i < GUARD; i++)
        if (copy[i] != CANARY || copy[GUARD + bytes + i] != CANARY)
            return 0;
    return 1;
}

void *ep_alloc(size_t bytes)
{
    unsigned char *p = malloc(bytes + 2 * GUARD + sizeof(size_t));
    ck_assert_ptr_nonnull(p);
    memcpy(p, &bytes, sizeof bytes);
    memset(p + sizeof bytes, CANARY, bytes + 2 * GUARD);
    return p + sizeof bytes + GUARD;
}

int ep_canaries_ok(const void *q)
{
    const unsigned char *p = (const unsigned char *)q - GUARD - sizeof(size_t);
    size_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    for (size_t i = 0; i < GUARD; i++)
        if (p[sizeof bytes + i] != CANARY || p[sizeof bytes + GUARD + bytes + i] != CANARY)
            return 0;
    return 1;
}

void ep_free(void *q)
{
    if (q)
        free((unsigned char *)q - GUARD - sizeof(size_t));
}

void ep_fill(void *p, moefuse_dtype dt, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const float v = (float)h_unif(-1.0, 1.0);
        uint32_t b;
        memcpy(&b, &v, sizeof b);
        switch (dt) {
        case MOEFUSE_F32:
            ((float *)p)[i] = v;
            break;
        case MOEFUSE_BF16:
            ((uint16_t *)p)[i] = (uint16_t)(b >> 16);
            break;
        case MOEFUSE_F16:
            ((uint16_t *)p)[i] = (uint16_t)(h_randint(0, 0x3BFF) | (h_randint(0, 1) << 15));
            break;
        default: { /* e4m3 codes: any but the NaNs 0x7F and 0xFF */
            const int c = (int)h_randint(0, 0x7E);
            ((uint8_t *)p)[i] = (uint8_t)(c | (h_randint(0, 1) << 7));
        }
        }
    }
}

void ep_routing(int32_t *ids, float *w, int64_t M, int64_t k, int32_t lo, int32_t hi, int32_t E)
{
    for (int64_t s = 0; s < M * k; s++) {
        const int64_t r = h_randint(0, 15);
        ids[s] = r == 0 ? -1 : r == 1 ? E + 3 : (int32_t)h_randint(lo, hi - 1);
        w[s] = (float)h_unif(0.05, 1.0);
    }
}

void *ep_slice(const ep_world *w, int32_t rank, const void *global, int64_t rows, int64_t cols,
               size_t elem, int32_t *local_count)
{
    return ep_slice_shared(w, rank, global, rows, cols, elem, 0, local_count);
}

void *ep_slice_shared(const ep_world *w, int32_t rank, const void *global, int64_t rows,
                      int64_t cols, size_t elem, int32_t shared, int32_t *local_count)
{
    int32_t n = 0;
    for (int32_t g = 0; g < w->experts; g++)
        n += ep_owner(w, g) == rank;
    const size_t block = (size_t)(rows * cols) * elem;
    char *out = malloc(block * (size_t)(n + shared > 0 ? n + shared : 1));
    ck_assert_ptr_nonnull(out);
    int32_t at = 0;
    for (int32_t g = 0; g < w->experts; g++)
        if (ep_owner(w, g) == rank)
            memcpy(out + block * (size_t)at++, (const char *)global + block * (size_t)g, block);
    for (int32_t j = 0; j < shared; j++) /* the shared experts: every rank's, after its own */
        memcpy(out + block * (size_t)at++, (const char *)global + block * (size_t)(w->experts + j),
               block);
    *local_count = n;
    return out;
}

/* ------------------------------------------------------------------ layer */

/* x forms of the FP8 layer: quantized on the way, or f8 with scales in one of LAYS */
#define XFORM_QUANTIZE (-1)

typedef struct layer_case {
    int32_t world, E, k;
    int64_t K, I, M[EP_MAX_WORLD];
    int32_t lo, hi; /* the ids' range (skewed loads: one rank's experts) */
    int fp8, xform, bias;
    int32_t shared;     /* n_shared: the last experts of the global weights */
    int shared_weights; /* a per-token factor on them */
    float *sw[EP_MAX_WORLD];
    moefuse_dtype dt, out_dt;
    void *w1, *w2, *b1, *b2, *w1s, *w2s; /* global */
    void *x[EP_MAX_WORLD], *xs[EP_MAX_WORLD];
    int32_t *ids[EP_MAX_WORLD];
    float *wts[EP_MAX_WORLD];
    void *out[EP_MAX_WORLD], *ref[EP_MAX_WORLD];
    moefuse_status st[EP_MAX_WORLD];
    int out_guards_ok[EP_MAX_WORLD];
    moefuse_quant_options act;
} layer_case;

static moefuse_tensor dense(void *p, moefuse_dtype dt, int32_t rank, int64_t a, int64_t b,
                            int64_t c)
{
    const int64_t shape[3] = {a, b, c};
    return moefuse_tensor_dense(p, dt, rank, shape);
}

static moefuse_tensor absent(void)
{
    moefuse_tensor t;
    memset(&t, 0, sizeof t);
    return t;
}

/* The scales tensor of an f8 x [M, K] in layout l. */
static moefuse_tensor x_scales_of(void *p, const lay *l, int64_t M, int64_t K)
{
    const int64_t G = K / 128, Ma = (M + 3) / 4 * 4;
    if (l->layout == MOEFUSE_SCALE_ROW_MAJOR)
        return dense(p, l->ue8m0 ? MOEFUSE_U8 : MOEFUSE_F32, 2, M, G, 0);
    if (l->layout == MOEFUSE_SCALE_COLUMN_MAJOR)
        return dense(p, l->ue8m0 ? MOEFUSE_U8 : MOEFUSE_F32, 2, G, Ma, 0);
    return dense(p, MOEFUSE_I32, 2, (G + 3) / 4, Ma, 0);
}

/* A tensor over host bytes, moved into the rank's backend memory (ep_put); NULL host: absent. */
static moefuse_tensor moved(moefuse_context *ctx, const void *host, moefuse_tensor t,
                            void **keep)
{
    *keep = NULL;
    if (!host)
        return absent();
    const int64_t span = moefuse_tensor_span_bytes(&t);
    *keep = ep_put(ctx, host, (size_t)(span > 0 ? span : 0));
    t.data = *keep;
    t.offset = GUARD;
    return t;
}

static void layer_rank(ep_world *w, int32_t r)
{
    layer_case *c = w->arg;
    moefuse_context *ctx = w->ctx[r];
    const int64_t K = c->K, I = c->I, M = c->M[r];
    const moefuse_dtype wdt = c->fp8 ? MOEFUSE_F8_E4M3 : c->dt;
    const size_t es = moefuse_dtype_size(wdt);
    int32_t El;
    const int32_t S = c->shared;
    void *w1 = ep_slice_shared(w, r, c->w1, 2 * I, K, es, S, &El);
    void *w2 = ep_slice_shared(w, r, c->w2, K, I, es, S, &El);
    void *b1 = c->bias ? ep_slice_shared(w, r, c->b1, 1, 2 * I, 4, S, &El) : NULL;
    void *b2 = c->bias ? ep_slice_shared(w, r, c->b2, 1, K, 4, S, &El) : NULL;
    void *w1s = c->fp8 ? ep_slice_shared(w, r, c->w1s, 2 * I / 128, K / 128, 4, S, &El) : NULL;
    void *w2s = c->fp8 ? ep_slice_shared(w, r, c->w2s, K / 128, I / 128, 4, S, &El) : NULL;
    El += S; /* the weights' experts: the rank's, then the shared ones */
    void *keep[11];
    moefuse_tensor tw1 = moved(ctx, w1, dense(NULL, wdt, 3, El, 2 * I, K), &keep[0]);
    moefuse_tensor tw2 = moved(ctx, w2, dense(NULL, wdt, 3, El, K, I), &keep[1]);
    moefuse_tensor tb1 = moved(ctx, b1, dense(NULL, MOEFUSE_F32, 2, El, 2 * I, 0), &keep[2]);
    moefuse_tensor tb2 = moved(ctx, b2, dense(NULL, MOEFUSE_F32, 2, El, K, 0), &keep[3]);
    moefuse_tensor tw1s =
        moved(ctx, w1s, dense(NULL, MOEFUSE_F32, 3, El, 2 * I / 128, K / 128), &keep[4]);
    moefuse_tensor tw2s =
        moved(ctx, w2s, dense(NULL, MOEFUSE_F32, 3, El, K / 128, I / 128), &keep[5]);
    moefuse_routing rt;
    memset(&rt, 0, sizeof rt);
    rt.topk_ids = moved(ctx, c->ids[r], dense(NULL, MOEFUSE_I32, 2, M, c->k, 0), &keep[6]);
    rt.topk_weights = moved(ctx, c->wts[r], dense(NULL, MOEFUSE_F32, 2, M, c->k, 0), &keep[7]);
    rt.n_shared = S;
    rt.shared_scale = S ? 0.75f : 0.0f;
    rt.shared_weights = moved(ctx, c->shared_weights ? c->sw[r] : NULL,
                              dense(NULL, MOEFUSE_F32, 1, M, 0, 0), &keep[10]);
    const size_t ob = moefuse_dtype_size(c->out_dt) * (size_t)(M * K);
    void *dout = ep_put(ctx, NULL, ob);
    moefuse_tensor out = dense(dout, c->out_dt, 2, M, K, 0);
    out.offset = GUARD;
    const bool f8x = c->fp8 && c->xform != XFORM_QUANTIZE;
    moefuse_tensor x =
        moved(ctx, c->x[r], dense(NULL, f8x ? MOEFUSE_F8_E4M3 : c->dt, 2, M, K, 0), &keep[8]);
    moefuse_tensor xs = f8x ? moved(ctx, c->xs[r], x_scales_of(NULL, &LAYS[c->xform], M, K),
                                    &keep[9])
                            : (keep[9] = NULL, absent());
    if (!c->fp8) {
        c->st[r] = moefuse_ep_moe_forward(ctx, w->group[r], &x, &tw1, &tw2, &tb1, &tb2, &rt,
                                          &out, NULL);
    } else {
        moefuse_fp8_moe_options o;
        memset(&o, 0, sizeof o);
        o.act = c->act;
        c->st[r] = moefuse_ep_moe_forward_fp8(ctx, w->group[r], &x, &xs, &tw1, &tw1s, &tw2, &tw2s,
                                              &tb1, &tb2, &rt, &out, &o);
    }
    if (c->st[r] != MOEFUSE_OK)
        fprintf(stderr, "rank %d: %s\n", (int)r, moefuse_last_error(ctx));
    unsigned char *back = ep_get(ctx, dout, ob);
    c->out_guards_ok[r] = ep_guards_ok(back, ob);
    memcpy(c->out[r], back + GUARD, ob);
    free(back);
    moefuse_buffer_free(ctx, dout);
    for (int i = 0; i < 11; i++)
        if (keep[i])
            moefuse_buffer_free(ctx, keep[i]);
    free(w1);
    free(w2);
    free(b1);
    free(b2);
    free(w1s);
    free(w2s);
}

/* out as a double (f32 or bf16) */
static double out_at(const void *p, moefuse_dtype dt, int64_t i)
{
    if (dt == MOEFUSE_F32)
        return ((const float *)p)[i];
    const uint32_t b = (uint32_t)((const uint16_t *)p)[i] << 16;
    float v;
    memcpy(&v, &b, sizeof v);
    return v;
}

/* On a GPU the layer's GEMMs add in their own order: the CPU's one-device layer within the
   relative error docs/NUMERICS.md allows across backends (bf16 8e-3; FP8 blocks rounded by
   the tensor cores: 2e-2). */
static void check_close(const layer_case *c, int32_t r)
{
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < c->M[r] * c->K; i++) {
        const double a = out_at(c->out[r], c->out_dt, i), b = out_at(c->ref[r], c->out_dt, i);
        num += (a - b) * (a - b);
        den += b * b;
    }
    const double tol = c->fp8 ? 2e-2 : 1e-2;
    ck_assert_msg(num <= tol * tol * (den > 0 ? den : 1e-30), "rank %d: relative error %g",
                  (int)r, den > 0 ? sqrt(num / den) : sqrt(num));
}

/* Draws the case's data, runs the one-device reference per rank's tokens, then the EP layer,
   and compares every output byte. */
static void run_layer(layer_case *c, const int32_t *owner)
{
    const int64_t K = c->K, I = c->I;
    const int32_t E = c->E, Et = c->E + c->shared; /* the weights hold the shared ones last */
    const moefuse_dtype wdt = c->fp8 ? MOEFUSE_F8_E4M3 : c->dt;
    const size_t es = moefuse_dtype_size(wdt), os = moefuse_dtype_size(c->out_dt);
    c->w1 = malloc(es * (size_t)(Et * 2 * I * K));
    c->w2 = malloc(es * (size_t)(Et * K * I));
    c->b1 = malloc(4 * (size_t)(Et * 2 * I));
    c->b2 = malloc(4 * (size_t)(Et * K));
    ep_fill(c->w1, wdt, Et * 2 * I * K);
    ep_fill(c->w2, wdt, Et * K * I);
    ep_fill(c->b1, MOEFUSE_F32, Et * 2 * I);
    ep_fill(c->b2, MOEFUSE_F32, Et * K);
    if (c->fp8) {
        c->w1s = malloc(4 * (size_t)(Et * (2 * I / 128) * (K / 128)));
        c->w2s = malloc(4 * (size_t)(Et * (K / 128) * (I / 128)));
        for (int64_t i = 0; i < Et * (2 * I / 128) * (K / 128); i++)
            ((float *)c->w1s)[i] = (float)h_unif(0.002, 0.01);
        for (int64_t i = 0; i < Et * (K / 128) * (I / 128); i++)
            ((float *)c->w2s)[i] = (float)h_unif(0.002, 0.01);
        if (c->xform >= 0) {
            c->act.scale_layout = (moefuse_scale_layout)LAYS[c->xform].layout;
            c->act.ue8m0 = LAYS[c->xform].ue8m0;
        }
    }
    moefuse_context *ref;
    ck_assert_int_eq(moefuse_context_create(&ref, "cpu"), MOEFUSE_OK);
    moefuse_tensor tw1 = dense(c->w1, wdt, 3, Et, 2 * I, K), tw2 = dense(c->w2, wdt, 3, Et, K, I);
    moefuse_tensor tb1 = c->bias ? dense(c->b1, MOEFUSE_F32, 2, Et, 2 * I, 0) : absent();
    moefuse_tensor tb2 = c->bias ? dense(c->b2, MOEFUSE_F32, 2, Et, K, 0) : absent();
    for (int32_t r = 0; r < c->world; r++) {
        const int64_t M = c->M[r];
        c->x[r] = malloc(moefuse_dtype_size(c->dt) * (size_t)(M * K) + 1);
        c->ids[r] = malloc(sizeof(int32_t) * (size_t)(M * c->k) + 1);
        c->wts[r] = malloc(sizeof(float) * (size_t)(M * c->k) + 1);
        ep_fill(c->x[r], c->dt, M * K);
        ep_routing(c->ids[r], c->wts[r], M, c->k, c->lo, c->hi, E);
        c->out[r] = ep_alloc(os * (size_t)(M * K));
        c->ref[r] = malloc(os * (size_t)(M * K) + 1);
        moefuse_routing rt;
        memset(&rt, 0, sizeof rt);
        rt.topk_ids = dense(c->ids[r], MOEFUSE_I32, 2, M, c->k, 0);
        rt.topk_weights = dense(c->wts[r], MOEFUSE_F32, 2, M, c->k, 0);
        rt.n_shared = c->shared;
        rt.shared_scale = c->shared ? 0.75f : 0.0f;
        if (c->shared_weights) {
            c->sw[r] = malloc(sizeof(float) * (size_t)M + 1);
            for (int64_t m = 0; m < M; m++)
                c->sw[r][m] = (float)h_unif(0.1, 1.0);
            rt.shared_weights = dense(c->sw[r], MOEFUSE_F32, 1, M, 0, 0);
        }
        moefuse_tensor x = dense(c->x[r], c->dt, 2, M, K, 0);
        moefuse_tensor out = dense(c->ref[r], c->out_dt, 2, M, K, 0);
        if (!c->fp8) {
            ck_assert_int_eq(moefuse_moe_forward(ref, &x, &tw1, &tw2, &tb1, &tb2, &rt, &out, NULL),
                             MOEFUSE_OK);
            continue;
        }
        moefuse_tensor xs = absent();
        if (c->xform >= 0) { /* an f8 x: quantized here, in the case's layout */
            void *codes = malloc((size_t)(M * K) + 1);
            c->xs[r] = calloc((size_t)((M + 4) * (K / 128) + 16), 4);
            moefuse_tensor q = dense(codes, MOEFUSE_F8_E4M3, 2, M, K, 0);
            xs = x_scales_of(c->xs[r], &LAYS[c->xform], M, K);
            ck_assert_int_eq(moefuse_quant(ref, &x, &q, &xs, &c->act), MOEFUSE_OK);
            free(c->x[r]);
            c->x[r] = codes;
            x = q;
        }
        moefuse_fp8_moe_options o;
        memset(&o, 0, sizeof o);
        o.act = c->act;
        moefuse_tensor tw1s = dense(c->w1s, MOEFUSE_F32, 3, Et, 2 * I / 128, K / 128);
        moefuse_tensor tw2s = dense(c->w2s, MOEFUSE_F32, 3, Et, K / 128, I / 128);
        ck_assert_int_eq(moefuse_moe_forward_fp8(ref, &x, &xs, &tw1, &tw1s, &tw2, &tw2s, &tb1,
                                                 &tb2, &rt, &out, &o),
                         MOEFUSE_OK);
    }
    moefuse_context_destroy(ref);
    ep_run(c->world, E, owner, layer_rank, c);
    for (int32_t r = 0; r < c->world; r++) {
        ck_assert_msg(c->st[r] == MOEFUSE_OK, "rank %d: %s", (int)r,
                      moefuse_status_name(c->st[r]));
        if (strcmp(h_backend(), "cpu") == 0)
            ck_assert_msg(memcmp(c->out[r], c->ref[r], os * (size_t)(c->M[r] * K)) == 0,
                          "rank %d of %d: the EP layer differs from the one-device layer",
                          (int)r, (int)c->world);
        else
            check_close(c, r);
        ck_assert_msg(c->out_guards_ok[r] && ep_canaries_ok(c->out[r]), "rank %d: out's guards",
                      (int)r);
        free(c->x[r]);
        free(c->xs[r]);
        free(c->sw[r]);
        free(c->ids[r]);
        free(c->wts[r]);
        ep_free(c->out[r]);
        free(c->ref[r]);
    }
    free(c->w1);
    free(c->w2);
    free(c->b1);
    free(c->b2);
    free(c->w1s);
    free(c->w2s);
}

static layer_case bf16_case(int32_t world, int32_t E, int64_t M)
{
    layer_case c;
    memset(&c, 0, sizeof c);
    c.world = world;
    c.E = E;
    c.k = 3;
    c.K = 64;
    c.I = 48;
    for (int32_t r = 0; r < world; r++)
        c.M[r] = M + r * 3;
    c.hi = E;
    c.bias = 1;
    c.dt = MOEFUSE_BF16;
    c.out_dt = MOEFUSE_BF16;
    return c;
}

/* Case c as an FP8 layer (x quantized on the way unless xform says otherwise), at K and I that
   hold whole 128-groups. */
static layer_case fp8_case(layer_case c)
{
    c.fp8 = 1;
    c.xform = XFORM_QUANTIZE;
    c.K = 256;
    c.I = 128;
    return c;
}

START_TEST(t_layer_bf16)
{
    static const int32_t worlds[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        layer_case c = bf16_case(worlds[i], 8, 37);
        run_layer(&c, NULL);
    }
    layer_case f = bf16_case(2, 8, 20); /* f32, out f32, no bias */
    f.dt = f.out_dt = MOEFUSE_F32;
    f.bias = 0;
    run_layer(&f, NULL);
}
END_TEST

START_TEST(t_layer_uneven)
{
    /* every token's experts on rank 0; then a rank without experts; tokens 0, 1, ... */
    layer_case c = bf16_case(4, 8, 29);
    c.hi = 2;
    run_layer(&c, NULL);
    static const int32_t owner[8] = {0, 0, 2, 3, 3, 0, 2, 3}; /* rank 1: none */
    layer_case d = bf16_case(4, 8, 0);
    d.M[1] = 1;
    d.M[2] = 0;
    d.M[3] = 17;
    d.M[0] = 2;
    run_layer(&d, owner);
    /* the FP8 layer's chunks of experts (ep_chunks.h) over the same placements: chunks with
       no expert, a rank with none, every token on rank 0 */
    layer_case f = fp8_case(d);
    run_layer(&f, owner);
    layer_case h = fp8_case(c);
    run_layer(&h, NULL);
}
END_TEST

START_TEST(t_layer_fp8)
{
    static const int32_t worlds[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        layer_case c = fp8_case(bf16_case(worlds[i], 8, 11));
        run_layer(&c, NULL);
    }
    layer_case m = fp8_case(bf16_case(2, 24, 23)); /* chunks of several experts: 12 a rank,
                                                       3 a chunk */
    run_layer(&m, NULL);
    for (int l = 0; l < 5; l++) { /* an f8 x with its scales in every layout */
        layer_case c = fp8_case(bf16_case(2, 8, 9));
        c.xform = l;
        c.out_dt = MOEFUSE_F32;
        run_layer(&c, NULL);
    }
}
END_TEST

START_TEST(t_layer_shared)
{
    /* DeepSeek-V3's and Qwen2-MoE's shared experts: every rank's own, after its routed ones */
    static const int32_t worlds[2] = {2, 4};
    for (int i = 0; i < 2; i++) {
        layer_case c = bf16_case(worlds[i], 8, 19);
        c.shared = i + 1;
        c.shared_weights = i == 1;
        run_layer(&c, NULL);
    }
    layer_case f = fp8_case(bf16_case(2, 8, 13));
    f.shared = 1;
    f.shared_weights = 1;
    run_layer(&f, NULL);
    layer_case q = f; /* and an f8 x with its scales column-major */
    q.xform = 1;
    q.out_dt = MOEFUSE_F32;
    run_layer(&q, NULL);
}
END_TEST

void ep_add_layer_tests(Suite *s)
{
    TCase *tc = h_add_tcase(s, "ep_layer", NULL, 120);
    tcase_add_test(tc, t_layer_bf16);
    tcase_add_test(tc, t_layer_uneven);
    tcase_add_test(tc, t_layer_fp8);
    tcase_add_test(tc, t_layer_shared);
}

int main(void)
{
    Suite *s = suite_create("ep");
    ep_add_layer_tests(s);
    ep_add_dispatch_tests(s);
    ep_add_ll_tests(s);
    return h_run(s);
}
