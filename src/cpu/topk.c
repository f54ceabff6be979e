/*
 * The routers (docs/NUMERICS.md, "Router (topk_softmax)" and "Router (topk_route)"): scores of
 * each row of logits, the choice of k experts (within the best groups), their weights. One
 * row function serves both calls; topk_softmax is topk_route with its defaults.
 */
#include "cpu/cpu_internal.h"
#include "cpu/numerics.h"
#include "numerics/mf_exp.h"
#include "cpu/tensor_cpu.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

/* One thread's row buffers: E floats each of logits, scores, choice scores, group scores and
 * the k chosen logits; E bytes each of flags. */
typedef struct topk_mem {
    float *l, *s, *c, *gscore, *kl;
    unsigned char *bad, *cand, *taken, *gbad, *gtaken;
} topk_mem;

/*
 * Softmax of n f32 values in place of p (NUMERICS.md, topk_softmax steps 1 and 2): NaN values
 * get 0; a +Inf maximum shares 1 among the +Inf values, an all -Inf row among all numbers;
 * otherwise exp(v - max) / sum, summed in index order.
 */
static void softmax_row(const float *v, const unsigned char *nan, int64_t n, float *p)
{
    bool any = false;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++)
        if (!nan[i]) {
            if (!any || v[i] > mx)
                mx = v[i];
            any = true;
        }
    if (!any) {
        for (int64_t i = 0; i < n; i++)
            p[i] = 0.0f;
    } else if (mx == INFINITY || mx == -INFINITY) {
        int64_t cnt = 0;
        for (int64_t i = 0; i < n; i++)
            cnt += (!nan[i] && v[i] == mx);
        const float share = 1.0f / (float)cnt;
        for (int64_t i = 0; i < n; i++)
            p[i] = (!nan[i] && v[i] == mx) ? share : 0.0f;
    } else {
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            p[i] = nan[i] ? 0.0f : mf_exp_f32(v[i] - mx); /* the library's exp */
            sum = sum + p[i];
        }
        for (int64_t i = 0; i < n; i++)
            p[i] = nan[i] ? 0.0f : p[i] / sum;
    }
}

/* Does candidate i rank ahead of b? Rankable ones first, then the larger c, then the lower id. */
static bool ranks_before(const float *c, const unsigned char *bad, int64_t i, int64_t b)
{
    if (bad[i] != bad[b])
        return !bad[i];
    if (!bad[i] && c[i] != c[b])
        return c[i] > c[b];
    return i < b;
}

/* The first-ranked of n entries (index base + i) not yet taken; -1 when none is left. */
static int64_t first_ranked(const float *c, const unsigned char *bad, const unsigned char *taken,
                            const unsigned char *cand, int64_t base, int64_t n)
{
    int64_t best = -1;
    for (int64_t i = base; i < base + n; i++)
        if (!taken[i] && (!cand || cand[i]) && (best < 0 || ranks_before(c, bad, i, best)))
            best = i;
    return best;
}

/* Candidates: the experts of the groups_kept first-ranked groups (all without groups). */
static void keep_groups(const mf_topk_args *a, topk_mem *t)
{
    const int64_t E = a->experts, G = a->groups, per = E / G;
    if (G == 1) {
        memset(t->cand, 1, (size_t)E);
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        /* its best rankable choice score, or the sum of its two best */
        const int64_t first = first_ranked(t->c, t->bad, t->taken, NULL, g * per, per);
        t->gbad[g] = first < 0 || t->bad[first];
        t->gtaken[g] = 0;
        if (t->gbad[g])
            continue;
        float score = t->c[first];
        if (a->group_scoring == MOEFUSE_GROUP_TOP2_SUM) {
            t->taken[first] = 1; /* set back below; no expert is taken yet */
            const int64_t second = first_ranked(t->c, t->bad, t->taken, NULL, g * per, per);
            t->taken[first] = 0;
            if (second >= 0 && !t->bad[second])
                score = score + t->c[second];
        }
        t->gscore[g] = score;
        t->gbad[g] = isnan(score) != 0;
    }
    memset(t->cand, 0, (size_t)E);
    for (int64_t kept = 0; kept < a->groups_kept; kept++) {
        const int64_t g = first_ranked(t->gscore, t->gbad, t->gtaken, NULL, 0, G);
        t->gtaken[g] = 1;
        memset(t->cand + g * per, 1, (size_t)per);
    }
}

static void topk_row(const mf_topk_args *a, int64_t m, topk_mem *t)
{
    const int64_t E = a->experts, k = a->topk;
    mf_load_row(t->l, mf_at2(&a->logits, m, 0), a->logits.dtype, E);
    if (a->logit_bias.data) {
        mf_load_row(t->s, mf_at1(&a->logit_bias, 0), a->logit_bias.dtype, E);
        for (int64_t i = 0; i < E; i++)
            t->l[i] = t->l[i] + t->s[i];
    }
    for (int64_t i = 0; i < E; i++) {
        t->bad[i] = isnan(t->l[i]) != 0;
        t->taken[i] = 0;
    }
    /* scores: what the weights come from (gpt-oss: the logits, softmax after the choice) */
    if (a->scoring == MOEFUSE_ROUTER_SOFTMAX)
        softmax_row(t->l, t->bad, E, t->s);
    else if (a->scoring == MOEFUSE_ROUTER_SIGMOID)
        for (int64_t i = 0; i < E; i++)
            t->s[i] = t->bad[i] ? 0.0f : 1.0f / (1.0f + mf_exp_f32(-t->l[i]));
    else
        memcpy(t->s, t->l, (size_t)E * sizeof(float));
    /* choice scores: plus the correction bias; NaN ones rank after every number */
    if (a->choice_bias.data) {
        mf_load_row(t->c, mf_at1(&a->choice_bias, 0), a->choice_bias.dtype, E);
        for (int64_t i = 0; i < E; i++)
            t->c[i] = t->s[i] + t->c[i];
    } else {
        memcpy(t->c, t->s, (size_t)E * sizeof(float));
    }
    for (int64_t i = 0; i < E; i++)
        t->bad[i] = t->bad[i] || isnan(t->c[i]);
    keep_groups(a, t);

    int32_t *ids = (int32_t *)mf_at2(&a->ids, m, 0);
    float *w = (float *)mf_at2(&a->weights, m, 0);
    for (int64_t j = 0; j < k; j++) {
        const int64_t best = first_ranked(t->c, t->bad, t->taken, t->cand, 0, E);
        if (best < 0) { /* k above the candidates cannot pass validation; stay in bounds */
            ids[j] = -1;
            w[j] = 0.0f;
            t->kl[j] = NAN;
            continue;
        }
        t->taken[best] = 1;
        ids[j] = (int32_t)best;
        w[j] = t->s[best];
        t->kl[j] = t->l[best];
    }
    if (a->scoring == MOEFUSE_ROUTER_TOPK_SOFTMAX) {
        for (int64_t j = 0; j < k; j++)
            t->gbad[j] = isnan(t->kl[j]) != 0; /* the group flags are free again */
        softmax_row(t->kl, t->gbad, k, w);
    }
    if (a->renormalize) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++)
            sum = sum + w[j];
        if (sum > 0.0f)
            for (int64_t j = 0; j < k; j++)
                w[j] = w[j] / sum;
    }
    if (a->scale != 1.0f)
        for (int64_t j = 0; j < k; j++)
            w[j] = w[j] * a->scale;
}

/* Per thread: 5 E floats and 5 E bytes (topk_mem), cache-line aligned. */
static size_t thread_stride(const mf_topk_args *a)
{
    const size_t per_thread = (size_t)a->experts * (5 * sizeof(float) + 5);
    return (per_thread + 63) / 64 * 64;
}

moefuse_status mf_cpu_topk_workspace(moefuse_context *ctx, void *state, const mf_topk_args *a,
                                     size_t *bytes)
{
    (void)ctx;
    (void)state;
    *bytes = (size_t)mf_cpu_max_threads() * thread_stride(a);
    return MOEFUSE_OK;
}

moefuse_status mf_cpu_topk_route(moefuse_context *ctx, void *state, const mf_topk_args *a)
{
    (void)state;
    const int64_t E = a->experts;
    const int nt = mf_cpu_max_threads();
    const size_t stride = thread_stride(a);
    mf_cpu_scratch scratch;
    MF_TRY(mf_cpu_scratch_take(ctx, a->op, (size_t)nt * stride, &scratch));
    char *mem = scratch.mem;
MF_OMP(parallel num_threads(nt))
    {
        char *base = mem + (size_t)mf_cpu_thread_id() * stride;
        topk_mem t;
        t.l = (float *)base;
        t.s = t.l + E;
        t.c = t.s + E;
        t.gscore = t.c + E;
        t.kl = t.gscore + E;
        t.bad = (unsigned char *)(t.kl + E);
        t.cand = t.bad + E;
        t.taken = t.cand + E;
        t.gbad = t.taken + E;
        t.gtaken = t.gbad + E;
MF_OMP(for schedule(static))
        for (int64_t m = 0; m < a->tokens; m++)
            topk_row(a, m, &t);
    }
    mf_cpu_scratch_release(&scratch);
    return MOEFUSE_OK;
}
