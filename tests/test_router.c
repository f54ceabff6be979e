/*
 * topk_route against a float64 oracle of each model's routing rule, written from the models'
 * inference code (DeepSeek-V3's noaux_tc, DeepSeek-V2's group-limited greedy, gpt-oss's router)
 * with NUMERICS.md's two departures (dropped groups excluded, no 1e-20 in the renormalization):
 * ids exact on rows whose scores are well apart, weights within (E + 8 + k) ulp. Ties, the
 * defaults against topk_softmax bit for bit, and every refused option. Backends without the
 * router must refuse it (MOEFUSE_ERR_UNSUPPORTED) and write nothing.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

typedef struct rcase {
    moefuse_router_scoring scoring;
    moefuse_group_scoring group;
    int G, TG, renorm;
    float scale;
    int logit_bias, choice_bias;
} rcase;

/* Every backend has the router (a new one may refuse it until it does). */
static int routes_here(void)
{
    return 1;
}

/* The oracle's scores, choice scores and choice of one row (double). */
typedef struct oracle_row {
    double s[512], c[512];
    int32_t ids[64];
    double w[64];
    double margin; /* the smallest gap between ranked values the choice depended on */
    double cmax;   /* the largest |c| of the row */
} oracle_row;

static void oracle(const rcase *rc, const double *l0, const double *lb, const double *cb,
                   int64_t E, int64_t k, oracle_row *o)
{
    double l[512];
    for (int64_t i = 0; i < E; i++)
        l[i] = l0[i] + (lb ? lb[i] : 0.0);
    if (rc->scoring == MOEFUSE_ROUTER_SOFTMAX) {
        double mx = l[0], sum = 0.0;
        for (int64_t i = 1; i < E; i++)
            mx = l[i] > mx ? l[i] : mx;
        for (int64_t i = 0; i < E; i++)
            sum += exp(l[i] - mx);
        for (int64_t i = 0; i < E; i++)
            o->s[i] = exp(l[i] - mx) / sum;
    } else if (rc->scoring == MOEFUSE_ROUTER_SIGMOID) {
        for (int64_t i = 0; i < E; i++)
            o->s[i] = 1.0 / (1.0 + exp(-l[i]));
    } else {
        for (int64_t i = 0; i < E; i++)
            o->s[i] = l[i];
    }
    o->cmax = 0.0;
    for (int64_t i = 0; i < E; i++) {
        o->c[i] = o->s[i] + (cb ? cb[i] : 0.0);
        o->cmax = fabs(o->c[i]) > o->cmax ? fabs(o->c[i]) : o->cmax;
    }
    o->margin = INFINITY;
    /* groups: scores of the (top-2 sum | max) of each, the topk_group best kept */
    int keep[512];
    const int64_t G = rc->G > 1 ? rc->G : 1, per = E / G;
    for (int64_t i = 0; i < E; i++)
        keep[i] = G == 1;
    if (G > 1) {
        double gs[64];
        int used[64] = {0};
        for (int64_t g = 0; g < G; g++) {
            double a = -INFINITY, b = -INFINITY;
            for (int64_t i = g * per; i < (g + 1) * per; i++) {
                if (o->c[i] > a)
                    b = a, a = o->c[i];
                else if (o->c[i] > b)
                    b = o->c[i];
            }
            gs[g] = rc->group == MOEFUSE_GROUP_MAX || per == 1 ? a : a + b;
        }
        for (int t = 0; t < rc->TG; t++) {
            int64_t best = -1;
            for (int64_t g = 0; g < G; g++)
                if (!used[g] && (best < 0 || gs[g] > gs[best]))
                    best = g;
            used[best] = 1;
            for (int64_t i = best * per; i < (best + 1) * per; i++)
                keep[i] = 1;
        }
        for (int64_t g = 0; g < G; g++) /* the kept groups' scores against the others' */
            for (int64_t h = 0; h < G; h++)
                if (used[g] && !used[h] && fabs(gs[g] - gs[h]) < o->margin)
                    o->margin = fabs(gs[g] - gs[h]);
    }
    int taken[512] = {0};
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < E; i++)
            if (keep[i] && !taken[i] && (best < 0 || o->c[i] > o->c[best]))
                best = i;
        taken[best] = 1;
        o->ids[j] = (int32_t)best;
        for (int64_t i = 0; i < E; i++) /* gaps to every other candidate left */
            if (keep[i] && !taken[i] && fabs(o->c[best] - o->c[i]) < o->margin)
                o->margin = fabs(o->c[best] - o->c[i]);
    }
    if (rc->scoring == MOEFUSE_ROUTER_TOPK_SOFTMAX) {
        double mx = l[o->ids[0]], sum = 0.0;
        for (int64_t j = 0; j < k; j++)
            sum += exp(l[o->ids[j]] - mx);
        for (int64_t j = 0; j < k; j++)
            o->w[j] = exp(l[o->ids[j]] - mx) / sum;
    } else {
        for (int64_t j = 0; j < k; j++)
            o->w[j] = o->s[o->ids[j]];
    }
    if (rc->renorm) {
        double sum = 0.0;
        for (int64_t j = 0; j < k; j++)
            sum += o->w[j];
        for (int64_t j = 0; j < k; j++)
            o->w[j] /= sum;
    }
    for (int64_t j = 0; j < k; j++)
        o->w[j] *= rc->scale == 0.0f ? 1.0 : (double)rc->scale;
}

static moefuse_router_options options_of(const rcase *rc)
{
    moefuse_router_options opt;
    memset(&opt, 0, sizeof opt);
    opt.scoring = rc->scoring;
    opt.group_scoring = rc->group;
    opt.n_group = rc->G;
    opt.topk_group = rc->TG;
    opt.renormalize = rc->renorm;
    opt.scale = rc->scale;
    return opt;
}

/* Random rows whose choice does not hinge on a rounding: re-drawn until the oracle's margin
 * is twice the error the f32 scores may have (a softmax's grows with E; a sigmoid's does not). */
static void run(const rcase *rc, moefuse_dtype dt, int64_t M, int64_t E, int64_t k)
{
    tbuf *lg = tb_new2("logits", dt, M, E, 3, 1);
    tbuf *lb = rc->logit_bias ? tb_new1("logit_bias", dt, E, 1) : NULL;
    tbuf *cb = rc->choice_bias ? tb_new1("choice_bias", MOEFUSE_F32, E, 1) : NULL;
    double lbv[512], cbv[512], l[512];
    for (int64_t i = 0; i < E; i++) {
        if (lb) {
            tb_set(lb, i, 0, 0, h_unif(-0.5, 0.5));
            lbv[i] = tb_get(lb, i, 0, 0);
        }
        if (cb) {
            tb_set(cb, i, 0, 0, h_unif(-0.05, 0.05));
            cbv[i] = tb_get(cb, i, 0, 0);
        }
    }
    oracle_row *o = malloc(sizeof *o * (size_t)(M > 0 ? M : 1));
    const double ulps = rc->scoring == MOEFUSE_ROUTER_SOFTMAX ? (double)E + 16.0 : 16.0;
    for (int64_t m = 0; m < M; m++) {
        for (int tries = 0;; tries++) {
            for (int64_t i = 0; i < E; i++) {
                tb_set(lg, m, i, 0, h_unif(-3.0, 3.0));
                l[i] = tb_get(lg, m, i, 0);
            }
            oracle(rc, l, lb ? lbv : NULL, cb ? cbv : NULL, E, k, &o[m]);
            if (o[m].margin > 2.0 * ulps * 0x1p-23 * o[m].cmax)
                break;
            HCHECK(tries < 1000, "no row with a clear choice after 1000 draws (E=%lld)",
                   (long long)E);
        }
    }
    tb_upload(lg);
    if (lb)
        tb_upload(lb);
    if (cb)
        tb_upload(cb);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, M, k, 2, 0);
    tbuf *w = tb_new2("weights", MOEFUSE_F32, M, k, 1, 0);
    const moefuse_router_options opt = options_of(rc);
    moefuse_status st = CALL(moefuse_topk_route(g_ctx, T(lg), T(lb), T(cb), &opt, T(ids), T(w)));
    if (!routes_here()) { /* refused, unless there is nothing to write */
        HCHECK(st == (M == 0 ? MOEFUSE_OK : MOEFUSE_ERR_UNSUPPORTED),
               "topk_route on %s: %s, expected UNSUPPORTED", moefuse_backend_name(g_ctx),
               moefuse_status_name(st));
        free(o);
        tb_free_all();
        return;
    }
    HCHECK(st == MOEFUSE_OK, "topk_route: %s (%s)", moefuse_status_name(st),
           moefuse_last_error(g_ctx));
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++) {
            const int32_t gi = (int32_t)tb_get(ids, m, j, 0);
            const double gw = tb_get(w, m, j, 0);
            HCHECK(gi == o[m].ids[j],
                   "scoring %d groups %d/%d (%d) row %lld slot %lld: id %d, oracle %d (E=%lld k=%lld)",
                   rc->scoring, rc->TG, rc->G, rc->group, (long long)m, (long long)j, gi,
                   o[m].ids[j], (long long)E, (long long)k);
            const double tol = (double)(E + 8 + k) * or_ulp32(o[m].w[j]);
            HCHECK(fabs(gw - o[m].w[j]) <= tol,
                   "scoring %d row %lld slot %lld: weight %.9g, oracle %.12g (tol %.3g)",
                   rc->scoring, (long long)m, (long long)j, gw, o[m].w[j], tol);
        }
    free(o);
    tb_free_all();
}

START_TEST(t_deepseek_v3)
{
    /* sigmoid, correction bias, top-2-sum groups, renormalized, scaled */
    const rcase rc = {MOEFUSE_ROUTER_SIGMOID, MOEFUSE_GROUP_TOP2_SUM, 8, 4, 1, 2.5f, 0, 1};
    run(&rc, MOEFUSE_F32, 9, 256, 8);
    run(&rc, MOEFUSE_BF16, 3, 256, 8);
    run(&rc, MOEFUSE_F16, 1, 64, 6);
    const rcase kimi = {MOEFUSE_ROUTER_SIGMOID, MOEFUSE_GROUP_TOP2_SUM, 1, 1, 1, 2.827f, 0, 1};
    run(&kimi, MOEFUSE_BF16, 4, 384, 8);
    const rcase one = {MOEFUSE_ROUTER_SIGMOID, MOEFUSE_GROUP_TOP2_SUM, 16, 3, 0, 0.0f, 0, 1};
    run(&one, MOEFUSE_F32, 5, 16, 3); /* groups of one expert */
}
END_TEST

START_TEST(t_deepseek_v2)
{
    /* softmax, max-scored groups, scaled, not renormalized */
    const rcase rc = {MOEFUSE_ROUTER_SOFTMAX, MOEFUSE_GROUP_MAX, 8, 3, 0, 16.0f, 0, 0};
    run(&rc, MOEFUSE_F32, 7, 160, 6);
    run(&rc, MOEFUSE_BF16, 2, 64, 6);
}
END_TEST

START_TEST(t_gpt_oss)
{
    /* router bias on the logits, the choice on them, softmax over the k */
    const rcase rc = {MOEFUSE_ROUTER_TOPK_SOFTMAX, MOEFUSE_GROUP_TOP2_SUM, 0, 0, 0, 0.0f, 1, 0};
    run(&rc, MOEFUSE_F32, 11, 32, 4);
    run(&rc, MOEFUSE_BF16, 3, 128, 4);
    const rcase both = {MOEFUSE_ROUTER_TOPK_SOFTMAX, MOEFUSE_GROUP_MAX, 4, 2, 1, 1.5f, 1, 1};
    run(&both, MOEFUSE_F16, 5, 32, 3);
}
END_TEST

START_TEST(t_edges)
{
    const rcase rc = {MOEFUSE_ROUTER_SIGMOID, MOEFUSE_GROUP_TOP2_SUM, 4, 2, 1, 0.0f, 1, 1};
    run(&rc, MOEFUSE_F32, 0, 8, 2);  /* no rows */
    run(&rc, MOEFUSE_F32, 1, 8, 4);  /* k = every candidate */
    run(&rc, MOEFUSE_F32, 2, 4, 1);  /* groups of one... of four experts */
    const rcase plain = {MOEFUSE_ROUTER_SIGMOID, MOEFUSE_GROUP_TOP2_SUM, 0, 0, 0, 0.0f, 0, 0};
    run(&plain, MOEFUSE_BF16, 3, 1, 1); /* one expert */
    run(&plain, MOEFUSE_F32, 2, 512, 32);
}
END_TEST

/* Equal choice scores go to the lower expert, equal groups to the lower group. */
START_TEST(t_ties)
{
    const int64_t E = 16, k = 4;
    tbuf *lg = tb_new2("logits", MOEFUSE_F32, 2, E, 0, 1);
    for (int64_t i = 0; i < E; i++) {
        tb_set(lg, 0, i, 0, (double)((i % 4) == 1)); /* row 0: experts 1, 5, 9, 13 tie */
        tb_set(lg, 1, i, 0, (double)(i % 4));        /* row 1: every group scores the same */
    }
    tb_upload(lg);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, 2, k, 0, 0);
    tbuf *w = tb_new2("weights", MOEFUSE_F32, 2, k, 0, 0);
    moefuse_router_options opt;
    memset(&opt, 0, sizeof opt);
    opt.scoring = MOEFUSE_ROUTER_SIGMOID;
    opt.n_group = 4;
    opt.topk_group = 2;
    moefuse_status st = CALL(moefuse_topk_route(g_ctx, T(lg), NULL, NULL, &opt, T(ids), T(w)));
    if (!routes_here()) {
        HCHECK(st == MOEFUSE_ERR_UNSUPPORTED, "topk_route: %s", moefuse_status_name(st));
        tb_free_all();
        return;
    }
    HCHECK(st == MOEFUSE_OK, "topk_route: %s (%s)", moefuse_status_name(st),
           moefuse_last_error(g_ctx));
    /* row 0: groups 0 and 1 kept (equal sums, lower first); their 1 and 5, then 0 and 2 */
    const int32_t want0[4] = {1, 5, 0, 2};
    /* row 1: groups 0 and 1; within them 3, 7 (logit 3), then 2, 6 */
    const int32_t want1[4] = {3, 7, 2, 6};
    for (int64_t j = 0; j < k; j++) {
        HCHECK((int32_t)tb_get(ids, 0, j, 0) == want0[j], "row 0 slot %lld: id %d, want %d",
               (long long)j, (int)tb_get(ids, 0, j, 0), want0[j]);
        HCHECK((int32_t)tb_get(ids, 1, j, 0) == want1[j], "row 1 slot %lld: id %d, want %d",
               (long long)j, (int)tb_get(ids, 1, j, 0), want1[j]);
    }
    tb_free_all();
}
END_TEST

/* Defaults are topk_softmax, bit for bit, NaN and Inf logits included. */
START_TEST(t_defaults_are_topk_softmax)
{
    const int64_t M = 6, E = 24, k = 5;
    for (int renorm = 0; renorm < 2; renorm++) {
        tbuf *lg = tb_new2("logits", MOEFUSE_BF16, M, E, 0, 1);
        tb_fill_unif(lg, -4.0, 4.0);
        tb_set(lg, 1, 3, 0, NAN);
        tb_set(lg, 2, 7, 0, INFINITY);
        tb_set(lg, 3, 0, 0, -INFINITY);
        tb_upload(lg);
        tbuf *i1 = tb_new2("ids softmax", MOEFUSE_I32, M, k, 0, 0);
        tbuf *w1 = tb_new2("weights softmax", MOEFUSE_F32, M, k, 0, 0);
        tbuf *i2 = tb_new2("ids route", MOEFUSE_I32, M, k, 0, 0);
        tbuf *w2 = tb_new2("weights route", MOEFUSE_F32, M, k, 0, 0);
        moefuse_router_options opt;
        memset(&opt, 0, sizeof opt);
        opt.renormalize = renorm;
        moefuse_status st = CALL(moefuse_topk_route(g_ctx, T(lg), NULL, NULL,
                                                    renorm ? &opt : NULL, T(i2), T(w2)));
        if (!routes_here()) {
            HCHECK(st == MOEFUSE_ERR_UNSUPPORTED, "topk_route: %s", moefuse_status_name(st));
            tb_free_all();
            continue;
        }
        st = CALL(moefuse_topk_softmax(g_ctx, T(lg), renorm, T(i1), T(w1)));
        HCHECK(st == MOEFUSE_OK, "topk_softmax: %s", moefuse_status_name(st));
        HCHECK(st == MOEFUSE_OK, "topk_route: %s (%s)", moefuse_status_name(st),
               moefuse_last_error(g_ctx));
        for (int64_t m = 0; m < M; m++)
            HCHECK(memcmp(tb_el(i1, m, 0, 0), tb_el(i2, m, 0, 0), (size_t)k * 4) == 0 &&
                       memcmp(tb_el(w1, m, 0, 0), tb_el(w2, m, 0, 0), (size_t)k * 4) == 0,
                   "row %lld (renormalize %d): topk_route's defaults differ from topk_softmax",
                   (long long)m, renorm);
        tb_free_all();
    }
}
END_TEST

/* Every refused option names itself, and nothing is written. */
START_TEST(t_refusals)
{
    const int64_t M = 2, E = 12, k = 3;
    tbuf *lg = tb_upload_unif(tb_new2("logits", MOEFUSE_F32, M, E, 0, 1), -1.0, 1.0);
    tbuf *bias = tb_new1("bias", MOEFUSE_F32, E + 1, 1);
    tbuf *ibias = tb_new1("i32 bias", MOEFUSE_I32, E, 1);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, M, k, 0, 0);
    tbuf *w = tb_new2("weights", MOEFUSE_F32, M, k, 0, 0);
    struct {
        moefuse_router_options opt;
        int bias;
        moefuse_status want;
        const char *names;
    } cases[] = {
        {{.n_group = 5, .topk_group = 1}, 0, MOEFUSE_ERR_INVALID_ARGUMENT, "n_group"},
        {{.n_group = -1}, 0, MOEFUSE_ERR_INVALID_ARGUMENT, "n_group"},
        {{.n_group = 12, .topk_group = 1}, 0, MOEFUSE_ERR_SHAPE, "k = 3"},
        {{.n_group = 4, .topk_group = 0}, 0, MOEFUSE_ERR_INVALID_ARGUMENT, "topk_group"},
        {{.n_group = 4, .topk_group = 5}, 0, MOEFUSE_ERR_INVALID_ARGUMENT, "topk_group"},
        {{.topk_group = 2}, 0, MOEFUSE_ERR_INVALID_ARGUMENT, "topk_group"},
        {{.n_group = 6, .topk_group = 1}, 0, MOEFUSE_ERR_SHAPE, "k = 3"},
        {{.scoring = (moefuse_router_scoring)3}, 0, MOEFUSE_ERR_INVALID_ARGUMENT, "scoring"},
        {{.group_scoring = (moefuse_group_scoring)2}, 0, MOEFUSE_ERR_INVALID_ARGUMENT,
         "group_scoring"},
        {{.scale = INFINITY}, 0, MOEFUSE_ERR_INVALID_ARGUMENT, "scale"},
        {{.reserved = {0, 1, 0, 0}}, 0, MOEFUSE_ERR_INVALID_ARGUMENT, "reserved"},
        {{0}, 1, MOEFUSE_ERR_SHAPE, "choice_bias"},
        {{0}, 2, MOEFUSE_ERR_DTYPE, "choice_bias"},
    };
    /* more groups than MOEFUSE_ROUTER_MAX_GROUPS */
    tbuf *wide = tb_upload_unif(tb_new2("wide logits", MOEFUSE_F32, 1, 130, 0, 1), -1.0, 1.0);
    tbuf *id1 = tb_new2("one id", MOEFUSE_I32, 1, 1, 0, 0), *w1 = tb_new2("one weight", MOEFUSE_F32, 1, 1, 0, 0);
    const moefuse_router_options many = {.n_group = 65, .topk_group = 1};
    moefuse_status st0 = moefuse_topk_route(g_ctx, T(wide), NULL, NULL, &many, T(id1), T(w1));
    char msg0[512];
    snprintf(msg0, sizeof msg0, "%s", moefuse_last_error(g_ctx));
    HCHECK(st0 == MOEFUSE_ERR_INVALID_ARGUMENT && strstr(msg0, "at most 64"),
           "n_group 65: %s (%s)", moefuse_status_name(st0), msg0);
    h_check_all(1);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const moefuse_tensor *cb = cases[c].bias == 1 ? T(bias) : cases[c].bias == 2 ? T(ibias) : NULL;
        const moefuse_status st =
            moefuse_topk_route(g_ctx, T(lg), NULL, cb, &cases[c].opt, T(ids), T(w));
        char msg[512];
        snprintf(msg, sizeof msg, "%s", moefuse_last_error(g_ctx)); /* before the checks' calls */
        HCHECK(st == cases[c].want, "case %zu: %s, want %s (%s)", c, moefuse_status_name(st),
               moefuse_status_name(cases[c].want), msg);
        HCHECK(strstr(msg, cases[c].names) != NULL, "case %zu: the message \"%s\" does not name %s",
               c, msg, cases[c].names);
        h_check_all(1);
    }
    tb_free_all();
}
END_TEST

/* ------------------------------------------------- every backend against the CPU's bytes */

static double cross_logit(int mode, int64_t m, int64_t i, int64_t E)
{
    switch (mode) {
    case 1: /* ties in pairs */
        return (double)((i * 7 + m) % (E / 2 + 1)) * 0.5;
    case 2: { /* NaN, +-Inf and ties sprinkled in */
        const int64_t r = h_randint(0, 39);
        if (r == 0)
            return NAN;
        if (r == 1)
            return INFINITY;
        if (r == 2)
            return -INFINITY;
        if (r < 6)
            return 1.0;
        return h_unif(-8, 8);
    }
    case 3: /* every number -Inf, one NaN */
        return i == 1 ? NAN : -INFINITY;
    case 4: /* one large logit, the rest 80-120 below: exps near the subnormals */
        return i == m % E ? 0.0 : h_unif(-120, -80);
    default:
        return h_unif(-8, 8);
    }
}

/* ids and weights of this backend equal the CPU's, byte for byte, special values included. */
static void run_cross(const rcase *rc, moefuse_dtype dt, int64_t M, int64_t E, int64_t k,
                      int mode, int nan_bias)
{
    tbuf *lg = tb_new2("logits", dt, M, E, 1, 1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < E; i++)
            tb_set(lg, m, i, 0, cross_logit(mode, m, i, E));
    tbuf *lb = rc->logit_bias ? tb_new1("logit_bias", MOEFUSE_BF16, E, 1) : NULL;
    tbuf *cb = rc->choice_bias ? tb_new1("choice_bias", MOEFUSE_F32, E, 1) : NULL;
    for (int64_t i = 0; i < E; i++) {
        if (lb)
            tb_set(lb, i, 0, 0, h_unif(-1.0, 1.0));
        if (cb)
            tb_set(cb, i, 0, 0, nan_bias && i % 5 == 2 ? NAN : h_unif(-0.1, 0.1));
    }
    tbuf *lg_r = tb_twin(lg, g_ref), *lb_r = lb ? tb_twin(lb, g_ref) : NULL;
    tbuf *cb_r = cb ? tb_twin(cb, g_ref) : NULL;
    tb_upload(lg);
    if (lb)
        tb_upload(lb);
    if (cb)
        tb_upload(cb);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, M, k, 1, 0), *w = tb_new2("weights", MOEFUSE_F32, M, k, 2, 0);
    tbuf *ids_r = tb_twin(ids, g_ref), *w_r = tb_twin(w, g_ref);
    const moefuse_router_options opt = options_of(rc);
    moefuse_status st = CALL(moefuse_topk_route(g_ctx, T(lg), T(lb), T(cb), &opt, T(ids), T(w)));
    if (!routes_here()) {
        HCHECK(st == (M == 0 ? MOEFUSE_OK : MOEFUSE_ERR_UNSUPPORTED), "topk_route: %s",
               moefuse_status_name(st));
        tb_free_all();
        return;
    }
    HCHECK(st == MOEFUSE_OK, "topk_route: %s (%s)", moefuse_status_name(st),
           moefuse_last_error(g_ctx));
    st = CALL(moefuse_topk_route(g_ref, T(lg_r), T(lb_r), T(cb_r), &opt, T(ids_r), T(w_r)));
    HCHECK(st == MOEFUSE_OK, "topk_route on the cpu: %s (%s)", moefuse_status_name(st),
           moefuse_last_error(g_ref));
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++) {
            const uint32_t *a = tb_el(ids, m, j, 0), *b = tb_el(ids_r, m, j, 0);
            const uint32_t *x = tb_el(w, m, j, 0), *y = tb_el(w_r, m, j, 0);
            HCHECK(*a == *b && *x == *y,
                   "%s scoring %d groups %lld/%d mode %d row %lld slot %lld: id %d weight %a, "
                   "cpu id %d weight %a",
                   moefuse_backend_name(g_ctx), rc->scoring, (long long)rc->TG, rc->G, mode,
                   (long long)m, (long long)j, (int)*a, (double)*(const float *)x, (int)*b,
                   (double)*(const float *)y);
        }
    tb_free_all();
}

START_TEST(t_cross)
{
    const rcase cases[] = {
        {MOEFUSE_ROUTER_SIGMOID, MOEFUSE_GROUP_TOP2_SUM, 8, 4, 1, 2.5f, 0, 1},
        {MOEFUSE_ROUTER_SOFTMAX, MOEFUSE_GROUP_MAX, 8, 3, 0, 16.0f, 0, 0},
        {MOEFUSE_ROUTER_TOPK_SOFTMAX, MOEFUSE_GROUP_TOP2_SUM, 0, 0, 0, 0.0f, 1, 0},
        {MOEFUSE_ROUTER_SIGMOID, MOEFUSE_GROUP_TOP2_SUM, 0, 0, 1, 0.0f, 1, 1},
        {MOEFUSE_ROUTER_SOFTMAX, MOEFUSE_GROUP_TOP2_SUM, 4, 1, 1, 0.0f, 1, 1},
    };
    const moefuse_dtype dts[3] = {MOEFUSE_F32, MOEFUSE_BF16, MOEFUSE_F16};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int mode = 0; mode < 5; mode++) {
            const int64_t k = cases[c].G > 1 ? 4 : 8;
            run_cross(&cases[c], dts[(c + (size_t)mode) % 3], 13, 64, k, mode, 0);
            run_cross(&cases[c], dts[(c + (size_t)mode) % 3], 5, 256, k, mode, mode == 2);
            run_cross(&cases[c], dts[(c + (size_t)mode) % 3], 7, 40, k, mode, mode == 2);
        }
    /* past the warp kernel's 512 experts; more picks than a warp has lanes */
    run_cross(&cases[1], MOEFUSE_F32, 3, 640, 8, 0, 0);
    run_cross(&cases[3], MOEFUSE_BF16, 4, 96, 40, 2, 1);
    run_cross(&cases[2], MOEFUSE_F16, 4, 96, 40, 1, 0);
    run_cross(&cases[0], MOEFUSE_F32, 0, 64, 4, 0, 0);
    run_cross(&cases[2], MOEFUSE_BF16, 3, 384, 8, 2, 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("router");
    TCase *tc = h_add_tcase(s, "router", h_setup, 60);
    tcase_add_test(tc, t_deepseek_v3);
    tcase_add_test(tc, t_deepseek_v2);
    tcase_add_test(tc, t_gpt_oss);
    tcase_add_test(tc, t_edges);
    tcase_add_test(tc, t_ties);
    tcase_add_test(tc, t_defaults_are_topk_softmax);
    tcase_add_test(tc, t_refusals);
    TCase *tx = h_add_tcase(s, "router against the cpu", h_setup_cross, 60);
    tcase_add_test(tx, t_cross);
    return h_run(s);
}
