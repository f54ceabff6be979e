/*
 * topk_route (docs/NUMERICS.md, "Router (topk_route)"), one work-item per row of logits, with
 * no scratch: as in topk.cl, a score is recomputed wherever it is needed, the same expression
 * each time, so every use sees the same bits. The kept groups are bits of a ulong (at most
 * MOEFUSE_ROUTER_MAX_GROUPS = 64 groups), and the ranking is a strict total order, so the j-th
 * pick is the best candidate ranking after pick j - 1 and nothing needs marking as taken.
 */

/* mf_route_row, its scores, the ranking and the picks are topk.cl's. */

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
    mf_route_row r = mf_route_row_of(logits, lo + m * ls0, ldt);
    r.lb = lbias;
    r.lbo = lbo;
    r.lbdt = lbdt;
    r.has_lb = has_lb;
    r.cb = cbias;
    r.cbo = cbo;
    r.cbdt = cbdt;
    r.has_cb = has_cb;
    r.scoring = scoring;
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
    int bad = 0;
    float c = 0.0f;
    long pick = -1;
    for (long j = 0; j < topk; j++) {
        pick = mf_route_pick(&r, tab, keep, groups, per, pick, &bad, &c);
        ids[io + m * is0 + j] = pick < 0 ? -1 : (int)pick;
        w[wo + m * ws0 + j] =
            pick < 0 ? 0.0f : mf_route_score(&r, tab, mf_route_logit(&r, pick));
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
