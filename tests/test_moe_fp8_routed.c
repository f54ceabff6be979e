/* test_moe_fp8: the routed calls (gate, final, forward) over shapes, options and specials. */
#include "test_moe_fp8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* -------------------------------------------------------------- routed */

/* The call's options for a case: its activation, its activation scales' layout and eps. */
moefuse_fp8_moe_options options_of(const cfg *c)
{
    moefuse_fp8_moe_options o = {0};
    o.moe.activation = c->act;
    o.moe.order = c->order;
    o.moe.limit = c->limit;
    o.moe.alpha = c->alpha;
    o.moe.up_offset = c->up_offset;
    o.act.scale_layout = c->layout;
    o.act.ue8m0 = c->ue8m0;
    o.act.eps = c->eps;
    return o;
}

void run_routed(cfg c)
{
    const int64_t M = c.M, K = c.K, I = c.I, E = c.E, k = c.k, Eg = c.use_map ? c.Eg : E;
    const int64_t S = M * k, GK = K / BLK, GI = I / BLK;
    const int ue = c.ue8m0 || c.layout == MOEFUSE_SCALE_PACKED_UE8M0;
    tbuf *x = tb_new2("x", c.xdt, M, K, 3, 1), *xs = NULL;
    if (c.xdt == MOEFUSE_F8_E4M3) {
        xs = h_new_scales("x_scales", c.layout, c.ue8m0, 0, M, GK, 0);
        xs->is_input = 1;
        zero_logical(xs);
    }
    for (int64_t m = 0; m < M; m++) fill_x_row(&c, x, xs, -1, m);
    tb_upload(x);
    if (xs) tb_upload(xs);
    tbuf *w1 = tb_new3("w1", MOEFUSE_F8_E4M3, E, 2 * I, K, 0, 1);
    tbuf *w1s = tb_new3("w1_scales", c.wsdt, E, 2 * I / BLK, GK, 0, 1);
    fill_weight(w1, w1s, E, 2 * I, K, c.nan_w);
    tbuf *w2 = tb_new3("w2", MOEFUSE_F8_E4M3, E, K, I, 0, 1);
    tbuf *w2s = tb_new3("w2_scales", c.wsdt, E, K / BLK, GI, 0, 1);
    fill_weight(w2, w2s, E, K, I, c.nan_w);
    tbuf *b1 = NULL, *b2 = NULL;
    if (c.bias) {
        const moefuse_dtype bdt = c.bias == 1 ? MOEFUSE_F32 : MOEFUSE_BF16;
        b1 = tb_upload_unif(tb_new2("b1", bdt, E, 2 * I, 0, 1), -0.5, 0.5);
        b2 = tb_upload_unif(tb_new2("b2", bdt, E, K, 1, 1), -0.5, 0.5);
    }
    tbuf *ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 0, 1), *wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    /* with empty_expert, expert E-1 gets no slot */
    h_fill_random_routing(ids, wts, M, k, Eg, c.invalid, c.empty_expert && !c.use_map ? E - 1 : -1);
    tbuf *map = NULL;
    int32_t *mapv = NULL;
    if (c.use_map)
        map = h_new_expert_map(Eg, E, &mapv);
    /* outputs */
    tbuf *h = tb_new3("h", MOEFUSE_F8_E4M3, M, k, I, 1, 0);
    tbuf *hs = h_new_scales("h_scales", c.layout, c.ue8m0, 0, S, GI, 0);
    tbuf *out = tb_new2("out", c.odt, M, K, 2, 0), *fwd = tb_new2("fwd", c.odt, M, K, 0, 0);
    tbuf *y = c.unreduced ? tb_new3("y", c.odt, M, k, K, 0, 0) : NULL;
    /* twins on the CPU backend, before any call */
    pair px = mk(x), pxs = xs ? mk(xs) : (pair){0}, pw1 = mk(w1), pw1s = mk(w1s), pw2 = mk(w2), pw2s = mk(w2s);
    pair pb1 = b1 ? mk(b1) : (pair){0}, pb2 = b2 ? mk(b2) : (pair){0}, pids = mk(ids), pwts = mk(wts);
    pair pmap = map ? mk(map) : (pair){0}, ph = mk(h), phs = mk(hs), pout = mk(out), pfwd = mk(fwd);
    pair py = y ? mk(y) : (pair){0};
    (void)pfwd;
    moefuse_routing R = {0}, RC = {0};
    R.topk_ids = ids->t;
    R.topk_weights = wts->t;
    if (map) R.expert_map = map->t;
    if (g_ref) {
        RC.topk_ids = pids.c->t;
        RC.topk_weights = pwts.c->t;
        if (map) RC.expert_map = pmap.c->t;
    }
    const moefuse_fp8_moe_options o = options_of(&c);

    /* gate, then the final from the library's own h, then forward */
    expect_ok(CALL(moefuse_moe_gate_fp8(g_ctx, T(x), T(xs), T(w1), T(w1s), T(b1), &R, T(h), T(hs), &o)),
              "moe_gate_fp8", g_ctx);
    expect_ok(CALL(moefuse_moe_final_fp8(g_ctx, T(h), T(hs), T(w2), T(w2s), T(b2), &R, T(out), &o)),
              "moe_final_fp8", g_ctx);
    if (y)
        expect_ok(CALL(moefuse_moe_final_fp8(g_ctx, T(h), T(hs), T(w2), T(w2s), T(b2), &R, T(y), &o)),
                  "moe_final_fp8 un-reduced", g_ctx);
    expect_ok(CALL(moefuse_moe_forward_fp8(g_ctx, T(x), T(xs), T(w1), T(w1s), T(w2), T(w2s), T(b1), T(b2), &R,
                                           T(fwd), &o)),
              "moe_forward_fp8", g_ctx);

    /* the oracle: each slot's h from x, quantized in double; out from it (the chain), and
     * out from the library's own h (the final alone) */
    uint8_t *qa = malloc((size_t)K), *hq = malloc((size_t)(S * I + 1));
    double *sa = malloc(sizeof(double) * (size_t)GK), *hsd = malloc(sizeof(double) * (size_t)(S * GI + 1));
    double *got_h = malloc(sizeof(double) * (size_t)(S * I + 1)), *ref_h = malloc(sizeof(double) * (size_t)(S * I + 1));
    double *yr = malloc(sizeof(double) * (size_t)K), *yl = malloc(sizeof(double) * (size_t)K);
    double *out_chain = calloc((size_t)(M * K + 1), sizeof(double)), *out_lib = calloc((size_t)(M * K + 1), sizeof(double));
    double *got_out = malloc(sizeof(double) * (size_t)(M * K + 1));
    double *y_chain = calloc((size_t)(S * K + 1), sizeof(double)), *y_lib = calloc((size_t)(S * K + 1), sizeof(double));
    double *got_y = malloc(sizeof(double) * (size_t)(S * K + 1));
    double *untied_h = malloc(sizeof(double) * (size_t)(S * I + 1)); /* got_h, ties as the oracle's */
    double *bound_h = malloc(sizeof(double) * (size_t)(S * I + 1)); /* a Hopper path's bound, see below */
    size_t nh = 0;
    uint8_t lq[4096];
    double ls[64], hraw[4096], hslack[4096];
    for (int64_t m = 0; m < M; m++) {
        oracle_x_row(&c, x, xs, -1, m, qa, sa);
        for (int64_t j = 0; j < k; j++) {
            const int64_t s = m * k + j;
            const int64_t e = or_local_expert((int32_t)tb_get(ids, m, j, 0), mapv, Eg, E);
            if (e < 0) { /* invalid: codes 0, scale bytes 0 */
                for (int64_t i = 0; i < I; i++)
                    HCHECK(*(uint8_t *)tb_el(h, m, j, i) == 0, "invalid slot %lld: h code not 0 %s", (long long)s, desc(&c));
                for (int64_t g = 0; g < GI; g++) {
                    int eb;
                    const double v = h_scale_at(hs, c.layout, 0, s, g, &eb);
                    HCHECK(v == 0.0 || eb == 0, "invalid slot %lld: scale not 0 %s", (long long)s, desc(&c));
                    HCHECK(eb <= 0, "invalid slot %lld: scale byte %d %s", (long long)s, eb, desc(&c));
                }
                if (c.layout == MOEFUSE_SCALE_PACKED_UE8M0)
                    for (int64_t g = 0; g < (GI + 3) / 4 * 4; g++) {
                        int eb;
                        h_scale_at(hs, c.layout, 0, s, g, &eb);
                        HCHECK(eb == 0, "invalid slot %lld: packed byte %lld is %d %s", (long long)s, (long long)g, eb,
                               desc(&c));
                    }
                continue;
            }
            oracle_gate(&c, qa, sa, w1, w1s, b1, e, hq + s * I, hsd + s * GI, hraw, hslack);
            for (int64_t g = 0; g < GI; g++) {
                int eb;
                ls[g] = h_scale_at(hs, c.layout, 0, s, g, &eb);
            }
            for (int64_t i = 0; i < I; i++) {
                lq[i] = *(uint8_t *)tb_el(h, m, j, i);
                const uint8_t want = hq[s * I + i];
                got_h[nh] = f8val[lq[i]] * ls[i / BLK];
                untied_h[nh] = h_tie_flip(lq[i], want, hraw[i], hsd[s * GI + i / BLK])
                                   ? f8val[want] * ls[i / BLK]
                                   : got_h[nh];
                ref_h[nh] = f8val[want] * hsd[s * GI + i / BLK];
                bound_h[nh] = h_code_step(got_h[nh], ref_h[nh], ls[i / BLK], hsd[s * GI + i / BLK]) + hslack[i];
                nh++;
            }
            oracle_final(&c, hq + s * I, hsd + s * GI, w2, w2s, b2, e, yr);
            oracle_final(&c, lq, ls, w2, w2s, b2, e, yl);
            const double wt = tb_get(wts, m, j, 0);
            for (int64_t r = 0; r < K; r++) {
                y_chain[s * K + r] = yr[r];
                y_lib[s * K + r] = yl[r];
                out_chain[m * K + r] += wt * yr[r];
                out_lib[m * K + r] += wt * yl[r];
            }
        }
    }
    const double herr = rel_err_nan("h (dequantized)", &c, got_h, ref_h, nh, 0.0);
    const int hopper = !is_cpu() && !exact_backend();
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < K; r++) got_out[m * K + r] = tb_get(out, m, r, 0);
    const double floor = h_gemm_floor(c.odt);
    /* The final alone, against the final of the backend's own h: the CPU's one f32 fmaf per
     * block, then the output's rounding; a Hopper path's block sums too. End to end, only the
     * exact paths: a Hopper path's moved codes of h are held by h's bounds, not here. */
    const double fbound = h_gemm_bound(c.odt) + (hopper ? HOPPER_BLOCK_BOUND : 0.0);
    const double oerr_own = rel_err_nan("out", &c, got_out, out_lib, (size_t)(M * K), floor);
    const double oerr = rel_err_nan("out", &c, got_out, out_chain, (size_t)(M * K), floor);
    if (getenv("MOEFUSE_FP8_REPORT")) { /* before the checks: a failing case reports too */
        size_t ncodes = 0, ndiff = 0;
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < k; j++) {
                const int64_t s = m * k + j;
                if (or_local_expert((int32_t)tb_get(ids, m, j, 0), mapv, Eg, E) < 0) continue;
                for (int64_t i = 0; i < I; i++, ncodes++)
                    ndiff += *(uint8_t *)tb_el(h, m, j, i) != hq[s * I + i];
            }
        double used = 0.0; /* of a Hopper path's bound on h, the most an element takes */
        for (size_t i = 0; i < nh; i++)
            if (!isnan(ref_h[i])) used = fmax(used, fabs(got_h[i] - ref_h[i]) / bound_h[i]);
        fprintf(stderr, "fp8 %s %s: h %.3g (%zu of %zu codes differ; %.2f of the Hopper bound), out %.3g (vs the final of its own h %.3g)\n",
                h_backend(), desc(&c), herr, ndiff, ncodes, used, oerr, oerr_own);
    }
    /* a Hopper path's h, element by element (NUMERICS.md): one code step, and what its block
     * sums' error moves h. A few codes of large values moved in a small problem can take the
     * 2-norm past FP8_BOUND, which holds the exact paths */
    HCHECK(hopper || herr <= FP8_BOUND, "h %s: rel err %.3g > %.3g", desc(&c), herr, FP8_BOUND);
    for (size_t i = 0; hopper && i < nh; i++)
        HCHECK(isnan(ref_h[i]) || fabs(got_h[i] - ref_h[i]) <= bound_h[i],
               "h %s: element %zu is %g, the oracle's %g: more than a code step and the block sums' error (%g) apart", desc(&c), i,
               got_h[i], ref_h[i], bound_h[i]);
    if (is_cpu()) {
        const double uerr = rel_err_nan("h (dequantized)", &c, untied_h, ref_h, nh, 0.0);
        HCHECK(uerr <= CPU_H_BOUND, "h on the CPU, past rounding ties %s: rel err %.3g > %.3g", desc(&c), uerr,
               CPU_H_BOUND);
    }
    h_check_scale_padding(hs, c.layout, 0, S, S, GI);
    HCHECK(oerr_own <= fbound, "out vs the final of its own h %s: %.3g > %.3g", desc(&c), oerr_own, fbound);
    HCHECK(hopper || oerr <= FP8_BOUND, "out %s: rel err %.3g > %.3g", desc(&c), oerr, FP8_BOUND);
    if (y) {
        for (int64_t i = 0; i < S * K; i++) got_y[i] = tb_get(y, i / (k * K), (i / K) % k, i % K);
        for (int64_t s = 0; s < S; s++)
            if (or_local_expert((int32_t)tb_get(ids, s / k, s % k, 0), mapv, Eg, E) < 0)
                for (int64_t r = 0; r < K; r++)
                    HCHECK(got_y[s * K + r] == 0.0 && !signbit(got_y[s * K + r]), "invalid slot %lld: y not +0 %s",
                           (long long)s, desc(&c));
        double yerr = rel_err_nan("y", &c, got_y, y_lib, (size_t)(S * K), floor);
        HCHECK(yerr <= fbound, "y vs the final of its own h %s: %.3g > %.3g", desc(&c), yerr, fbound);
        yerr = rel_err_nan("y", &c, got_y, y_chain, (size_t)(S * K), floor);
        HCHECK(hopper || yerr <= FP8_BOUND, "y %s: rel err %.3g > %.3g", desc(&c), yerr, FP8_BOUND);
    }
    /* forward is the gate then the final on the same backend, bit for bit */
    same_values("forward vs gate then final", &c, fwd, out, M, K, 1);

    if (g_ref) { /* the CPU golden backend on the same bytes */
        expect_ok(CALL(moefuse_moe_gate_fp8(g_ref, T(px.c), T(pxs.c), T(pw1.c), T(pw1s.c), T(pb1.c), &RC, T(ph.c),
                                            T(phs.c), &o)),
                  "moe_gate_fp8 on the CPU", g_ref);
        expect_ok(CALL(moefuse_moe_final_fp8(g_ref, T(ph.c), T(phs.c), T(pw2.c), T(pw2s.c), T(pb2.c), &RC,
                                             T(pout.c), &o)),
                  "moe_final_fp8 on the CPU", g_ref);
        if (y)
            expect_ok(CALL(moefuse_moe_final_fp8(g_ref, T(ph.c), T(phs.c), T(pw2.c), T(pw2s.c), T(pb2.c), &RC,
                                                 T(py.c), &o)),
                      "moe_final_fp8 un-reduced on the CPU", g_ref);
        if (exact_backend()) {
            same_codes("h", &c, h, ph.c);
            same_bytes("h_scales", &c, hs, phs.c);
            same_values("out", &c, out, pout.c, M, K, 1);
            if (y) same_values("y", &c, y, py.c, M, k, K);
        } else {
            near_h(&c, h, hs, ph.c, phs.c, M, k, 0);
            /* the CPU's final of this backend's h: the two finals on the same codes and scales */
            memcpy(ph.c->full, h->full, h->total), tb_upload(ph.c);
            memcpy(phs.c->full, hs->full, hs->total), tb_upload(phs.c);
            expect_ok(CALL(moefuse_moe_final_fp8(g_ref, T(ph.c), T(phs.c), T(pw2.c), T(pw2s.c), T(pb2.c), &RC,
                                                 T(pout.c), &o)),
                      "moe_final_fp8 on the CPU, of this backend's h", g_ref);
            const double d = rel_between(out, pout.c, M, K, 1);
            HCHECK(d <= 2 * fbound, "out vs the CPU's final of the same h %s: %.3g > %.3g", desc(&c), d, 2 * fbound);
        }
    }
    (void)ue;
    free(qa), free(hq), free(sa), free(hsd), free(got_h), free(untied_h), free(bound_h), free(ref_h), free(yr), free(yl);
    free(out_chain), free(out_lib), free(got_out), free(y_chain), free(y_lib), free(got_y), free(mapv);
    tb_free_all();
}

cfg base_cfg(void)
{
    cfg c = {0};
    c.M = 37, c.K = 256, c.I = 128, c.E = 4, c.k = 2, c.Eg = 6;
    c.xdt = MOEFUSE_BF16, c.wsdt = MOEFUSE_F32, c.odt = MOEFUSE_F32;
    c.layout = MOEFUSE_SCALE_ROW_MAJOR;
    return c;
}

/* M = 0, 1, 3, 37, 300 and k = 1..8, K and I over {128, 256, 384, 640} */
START_TEST(test_shapes)
{
    static const int64_t Ms[] = {0, 1, 3, 37, 300}, dims[] = {128, 256, 384, 640};
    for (int i = 0; i < 5; i++) {
        cfg c = base_cfg();
        c.M = Ms[i];
        c.k = i == 4 ? 2 : 1 + h_randint(0, 7);
        c.K = dims[h_randint(0, 3)];
        c.I = i == 4 ? 128 : dims[h_randint(0, 3)];
        c.unreduced = i % 2;
        c.invalid = i >= 2;
        run_routed(c);
    }
    for (int64_t k = 1; k <= 8; k++) {
        cfg c = base_cfg();
        c.M = 5, c.k = k, c.E = 3, c.K = 128, c.I = 128, c.invalid = 1, c.unreduced = 1;
        run_routed(c);
    }
    cfg c = base_cfg();
    c.K = 640, c.I = 640, c.M = 9, c.k = 3;
    run_routed(c);
}
END_TEST

/* every activation, order, limit, bias dtype, x dtype, layout and weight scale form */
START_TEST(test_options)
{
    static const moefuse_dtype xdts[] = {MOEFUSE_F32, MOEFUSE_BF16, MOEFUSE_F16, MOEFUSE_F8_E4M3};
    static const int layouts[][2] = {{MOEFUSE_SCALE_ROW_MAJOR, 0}, {MOEFUSE_SCALE_ROW_MAJOR, 1},
                                     {MOEFUSE_SCALE_COLUMN_MAJOR, 0}, {MOEFUSE_SCALE_COLUMN_MAJOR, 1},
                                     {MOEFUSE_SCALE_PACKED_UE8M0, 0}};
    for (int i = 0; i < 12; i++) {
        cfg c = base_cfg();
        c.act = i % 4;
        c.alpha = i == 7 ? 0.8f : 0.0f;
        c.up_offset = i % 5 == 2 ? 1.0f : (i == 9 ? -0.5f : 0.0f);
        c.order = (i / 4) % 3;
        c.limit = i % 4 == 3 ? 0.75f : 0.0f;
        c.bias = i % 3;
        c.xdt = xdts[i % 4];
        c.layout = layouts[i % 5][0];
        c.ue8m0 = layouts[i % 5][1];
        c.wsdt = i % 2 ? MOEFUSE_U8 : MOEFUSE_F32;
        c.odt = i % 3 == 0 ? MOEFUSE_F32 : (i % 3 == 1 ? MOEFUSE_BF16 : MOEFUSE_F16);
        c.use_map = i % 2, c.invalid = 1, c.unreduced = i % 2;
        c.eps = i == 5 ? 1e-4f : 0.0f;
        c.zero_groups = i % 4 == 1;
        c.M = 13 + i, c.k = 1 + i % 4, c.E = 3 + i % 3, c.Eg = c.E + 2;
        c.empty_expert = !c.use_map;
        run_routed(c);
    }
}
END_TEST

/* NaN codes in the weights and in x, NaN and Inf in a bf16 (and f32) x, all-zero groups */
START_TEST(test_specials)
{
    for (int i = 0; i < 5; i++) {
        cfg c = base_cfg();
        c.nan_w = i == 0 || i == 3;
        c.nan_x = i == 1 || i == 2;
        c.inf_x = i == 4;
        c.zero_groups = 1;
        c.xdt = i == 2 ? MOEFUSE_F8_E4M3 : (i == 4 ? MOEFUSE_F32 : MOEFUSE_BF16);
        c.layout = i == 3 ? MOEFUSE_SCALE_PACKED_UE8M0 : MOEFUSE_SCALE_ROW_MAJOR;
        c.unreduced = 1, c.invalid = 1;
        run_routed(c);
    }
}
END_TEST

/*
 * gpt-oss's activation (silu_alpha 1.702, up offset 1, limit 7, interleaved rows: one weight
 * scale block of 128 rows holds the gate and up rows of 64 h columns) with biases; also a
 * limit of 0.25, where these gate values (|a| below about 1.5) meet the clamp, the other
 * orders and another alpha.
 */
START_TEST(test_gpt_oss)
{
    for (int i = 0; i < 6; i++) {
        cfg c = base_cfg();
        c.act = MOEFUSE_ACT_SILU_ALPHA;
        c.alpha = i == 1 ? 1.702f : i == 4 ? 2.0f : 0.0f;
        c.up_offset = i == 5 ? 0.0f : 1.0f;
        c.limit = i % 2 ? 0.25f : 7.0f;
        c.order = i < 3 ? MOEFUSE_GATE_INTERLEAVED : i - 3;
        c.bias = 1 + i % 2;
        c.K = i % 2 ? 384 : 256, c.I = i == 2 ? 384 : 256;
        c.xdt = i == 3 ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16;
        c.wsdt = i % 2 ? MOEFUSE_U8 : MOEFUSE_F32;
        c.odt = i % 3 == 1 ? MOEFUSE_BF16 : MOEFUSE_F32;
        c.M = 9 + i, c.k = 4, c.E = 6, c.invalid = i % 2, c.unreduced = i % 2 == 0;
        run_routed(c);
    }
}
END_TEST

void moe_fp8_routed_tests(TCase *tc)
{
    tcase_add_test(tc, test_shapes);
    tcase_add_test(tc, test_options);
    tcase_add_test(tc, test_specials);
    tcase_add_test(tc, test_gpt_oss);
}
