/*
 * topk_route (docs/NUMERICS.md, "Router (topk_route)"), one work-item per row of logits, with
 * no scratch: as in topk.cl, a score is recomputed wherever it is needed, the same expression
 * each time, so every use sees the same bits. The kept groups are bits of a ulong (at most
 * MOEFUSE_ROUTER_MAX_GROUPS = 64 groups), and the ranking is a strict total order, so the j-th
 * pick is the best candidate ranking after pick j - 1 and nothing needs marking as taken.
 */
typedef struct mf_route_row {
    __global const uchar *l, *lb, *cb; /* logits; the logit and choice biases (has_*) */
    long base, lbo, cbo;
    int dt, lbdt, cbdt, has_lb, has_cb;
    int scoring;    /* 0 softmax, 1 sigmoid, 2 softmax after the choice */
    int mode;       /* softmax over the row: 0 all NaN, 1 +-Inf shares, 2 exp */
    float mx, sum, share;
} mf_route_row;

/* The logit of expert i, plus its bias. */
inline float mf_route_logit(const mf_route_row *r, long i)
{
    float v = mf_load(r->l, r->dt, r->base + i);
    if (r->has_lb)
        v = v + mf_load(r->lb, r->lbdt, r->lbo + i);
    return v;
}

/* The score of a logit: what the weights come from (NUMERICS.md step 2). */
inline float mf_route_score(const mf_route_row *r, __local const float *tab, float l)
{
    if (r->scoring == 1)
        return mf_is_nan(l) ? 0.0f : 1.0f / (1.0f + mf_exp_local(-l, tab));
    if (r->scoring == 2)
        return l;
    if (mf_is_nan(l) || r->mode == 0)
        return 0.0f;
    if (r->mode == 1)
        return l == r->mx ? r->share : 0.0f;
    return mf_exp_local(l - r->mx, tab) / r->sum;
}

/* Expert i's choice score; *bad when it is unranked (a NaN logit or choice score). */
inline float mf_route_choice(const mf_route_row *r, __local const float *tab, long i, int *bad)
{
    const float l = mf_route_logit(r, i);
    const float s = mf_route_score(r, tab, l);
    const float c = r->has_cb ? s + mf_load(r->cb, r->cbdt, r->cbo + i) : s;
    *bad = mf_is_nan(l) || mf_is_nan(c);
    return c;
}

/* Does (a, ca) rank ahead of (b, cb)? Ranked first, then the larger score, then the lower index. */
inline int mf_route_ahead(int bad_a, float ca, long a, int bad_b, float cb, long b)
{
    if (bad_a != bad_b)
        return !bad_a;
    if (!bad_a && ca != cb)
        return ca > cb;
    return a < b;
}

/* The first-ranked expert of [lo, lo + n) other than `skip`; -1 when there is none. */
inline long mf_route_first(const mf_route_row *r, __local const float *tab, long lo, long n,
                           long skip, int *bad, float *c)
{
    long best = -1;
    for (long i = lo; i < lo + n; i++) {
        if (i == skip)
            continue;
        int b;
        const float v = mf_route_choice(r, tab, i, &b);
        if (best < 0 || mf_route_ahead(b, v, i, *bad, *c, best)) {
            best = i;
            *bad = b;
            *c = v;
        }
    }
    return best;
}

/* Softmax over the row's logits, as topk_softmax forms it (the maximum, the mode, the sum). */
inline void mf_route_softmax_setup(mf_route_row *r, __local const float *tab, long experts)
{
    int any = 0;
    r->mx = -INFINITY;
    r->sum = 0.0f;
    r->share = 0.0f;
    for (long i = 0; i < experts; i++) {
        const float v = mf_route_logit(r, i);
        if (!mf_is_nan(v)) {
            if (!any || v > r->mx)
                r->mx = v;
            any = 1;
        }
    }
    if (!any) {
        r->mode = 0;
    } else if (!mf_is_finite(r->mx)) {
        long cnt = 0;
        for (long i = 0; i < experts; i++)
            cnt += mf_route_logit(r, i) == r->mx;
        r->share = 1.0f / (float)cnt;
        r->mode = 1;
    } else {
        float sum = 0.0f;
        for (long i = 0; i < experts; i++) {
            const float v = mf_route_logit(r, i);
            sum = sum + (mf_is_nan(v) ? 0.0f : mf_exp_local(v - r->mx, tab));
        }
        r->sum = sum;
        r->mode = 2;
    }
}

__kernel void mf_topk_route(__global const uchar *logits, long lo, long ls0, int ldt,
                            __global const uchar *lbias, long lbo, int lbdt,
                            __global const uchar *cbias, long cbo, int cbdt,
                            __global int *ids, long io, long is0,
                            __global float *w, long wo, long ws0, long tokens, long experts,
                            long topk, int scoring, int group_scoring, long groups, long kept,
                            int renormalize, float scale, int has_lb, int has_cb)
{
    __local float tab[64];
    mf_exp_table_to_local(tab); /* before any work-item leaves: it has a barrier */
    const long m = (long)get_global_id(0);
    if (m >= tokens)
        return;
    mf_route_row r;
    r.l = logits;
    r.base = lo + m * ls0;
    r.dt = ldt;
    r.lb = lbias;
    r.lbo = lbo;
    r.lbdt = lbdt;
    r.has_lb = has_lb;
    r.cb = cbias;
    r.cbo = cbo;
    r.cbdt = cbdt;
    r.has_cb = has_cb;
    r.scoring = scoring;
    r.mode = 2;
    if (scoring == 0)
        mf_route_softmax_setup(&r, tab, experts);

    /* the kept groups (all without groups) */
    const long per = experts / groups;
    ulong keep = groups == 64 ? ~0ul : ((1ul << groups) - 1ul);
    if (groups > 1) {
        float gs[64];
        ulong gbad = 0ul;
        for (long g = 0; g < groups; g++) {
            int b1 = 0;
            float c1 = 0.0f;
            const long first = mf_route_first(&r, tab, g * per, per, -1, &b1, &c1);
            if (first < 0 || b1) {
                gbad |= 1ul << g;
                gs[g] = 0.0f;
                continue;
            }
            float score = c1;
            if (group_scoring == 0) {
                int b2 = 0;
                float c2 = 0.0f;
                const long second = mf_route_first(&r, tab, g * per, per, first, &b2, &c2);
                if (second >= 0 && !b2)
                    score = score + c2;
            }
            gs[g] = score;
            if (mf_is_nan(score))
                gbad |= 1ul << g;
        }
        keep = 0ul;
        for (long t = 0; t < kept; t++) {
            long best = -1;
            for (long g = 0; g < groups; g++) {
                if ((keep >> g) & 1ul)
                    continue;
                if (best < 0 || mf_route_ahead((int)((gbad >> g) & 1ul), gs[g], g,
                                               (int)((gbad >> best) & 1ul), gs[best], best))
                    best = g;
            }
            keep |= 1ul << best;
        }
    }

    /* the k picks among the kept groups' experts */
    int prev_bad = 0;
    float prev_c = 0.0f;
    long prev = -1;
    for (long j = 0; j < topk; j++) {
        long best = -1;
        int best_bad = 0;
        float best_c = 0.0f;
        for (long i = 0; i < experts; i++) {
            if (!((keep >> (i / per)) & 1ul))
                continue;
            int b;
            const float c = mf_route_choice(&r, tab, i, &b);
            if (prev >= 0 && !mf_route_ahead(prev_bad, prev_c, prev, b, c, i))
                continue; /* ranks at or ahead of the previous pick: taken already */
            if (best < 0 || mf_route_ahead(b, c, i, best_bad, best_c, best)) {
                best = i;
                best_bad = b;
                best_c = c;
            }
        }
        ids[io + m * is0 + j] = best < 0 ? -1 : (int)best;
        w[wo + m * ws0 + j] =
            best < 0 ? 0.0f : mf_route_score(&r, tab, mf_route_logit(&r, best));
        prev = best;
        prev_bad = best_bad;
        prev_c = best_c;
    }
    __global float *wr = w + wo + m * ws0;
    __global const int *ir = ids + io + m * is0;
    if (scoring == 2) { /* softmax over the k chosen logits, in slot order */
        int any = 0;
        float mx = -INFINITY;
        for (long j = 0; j < topk; j++) {
            const float v = ir[j] < 0 ? NAN : mf_route_logit(&r, ir[j]);
            if (!mf_is_nan(v)) {
                if (!any || v > mx)
                    mx = v;
                any = 1;
            }
        }
        if (!any) {
            for (long j = 0; j < topk; j++)
                wr[j] = 0.0f;
        } else if (!mf_is_finite(mx)) {
            long cnt = 0;
            for (long j = 0; j < topk; j++)
                cnt += ir[j] >= 0 && mf_route_logit(&r, ir[j]) == mx;
            const float share = 1.0f / (float)cnt;
            for (long j = 0; j < topk; j++)
                wr[j] = ir[j] >= 0 && mf_route_logit(&r, ir[j]) == mx ? share : 0.0f;
        } else {
            float sum = 0.0f;
            for (long j = 0; j < topk; j++) {
                const float v = ir[j] < 0 ? NAN : mf_route_logit(&r, ir[j]);
                wr[j] = mf_is_nan(v) ? 0.0f : mf_exp_local(v - mx, tab);
                sum = sum + wr[j];
            }
            for (long j = 0; j < topk; j++) {
                const float v = ir[j] < 0 ? NAN : mf_route_logit(&r, ir[j]);
                wr[j] = mf_is_nan(v) ? 0.0f : wr[j] / sum;
            }
        }
    }
    if (renormalize) {
        float sum = 0.0f;
        for (long j = 0; j < topk; j++)
            sum = sum + wr[j];
        if (sum > 0.0f)
            for (long j = 0; j < topk; j++)
                wr[j] = wr[j] / sum;
    }
    if (scale != 1.0f)
        for (long j = 0; j < topk; j++)
            wr[j] = wr[j] * scale;
}
