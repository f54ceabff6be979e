/*
 * topk_softmax, one work-item per row of logits, and the row, scores and ranking it shares with
 * topk_route (router.cl; NUMERICS.md: without biases and groups its steps, and bits, are
 * topk_softmax's). Probabilities are recomputed when needed instead of stored (no scratch of E
 * floats per row): each value is the same deterministic expression every time. exp is the
 * library's (mf_exp_local, rows.cl: mf_exp_f32 with its table in local memory).
 * Ranking: numbers before NaN, then p descending, then lower id first; it is a strict total
 * order, so the j-th pick is the best candidate ranking after pick j-1, and nothing needs
 * marking as taken.
 */

/* A row of logits: topk_softmax's, or topk_route's with its biases and scoring. */
typedef struct mf_route_row {
    __global const uchar *l, *lb, *cb; /* logits; the logit and choice biases (has_*) */
    long base, lbo, cbo;
    int dt, lbdt, cbdt, has_lb, has_cb;
    int scoring;    /* 0 softmax, 1 sigmoid, 2 softmax after the choice (topk_route) */
    int mode;       /* softmax over the row: 0 all NaN, 1 +-Inf shares, 2 exp */
    float mx, sum, share;
} mf_route_row;

/* The logits at base: no biases, softmax scoring (formed by mf_route_softmax_setup). */
inline mf_route_row mf_route_row_of(__global const uchar *l, long base, int dt)
{
    mf_route_row r;
    r.l = r.lb = r.cb = l;
    r.base = base;
    r.lbo = r.cbo = 0;
    r.dt = r.lbdt = r.cbdt = dt;
    r.has_lb = r.has_cb = 0;
    r.scoring = 0;
    r.mode = 2;
    r.mx = -INFINITY;
    r.sum = 0.0f;
    r.share = 0.0f;
    return r;
}

/* The logit of expert i, plus its bias. */
inline float mf_route_logit(const mf_route_row *r, long i)
{
    float v = mf_load(r->l, r->dt, r->base + i);
    if (r->has_lb)
        v = v + mf_load(r->lb, r->lbdt, r->lbo + i);
    return v;
}

/* The softmax probability of logit l of the row. */
inline float mf_route_softmax(const mf_route_row *r, __local const float *tab, float l)
{
    if (mf_is_nan(l) || r->mode == 0)
        return 0.0f;
    if (r->mode == 1)
        return l == r->mx ? r->share : 0.0f;
    return mf_exp_local(l - r->mx, tab) / r->sum;
}

/* Softmax over the row's logits: the maximum, the mode, the sum. */
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
    } else if (!mf_is_finite(r->mx)) { /* every +Inf, or every -Inf number, shares equally */
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

/* The score of a logit: what the weights come from (NUMERICS.md step 2). */
inline float mf_route_score(const mf_route_row *r, __local const float *tab, float l)
{
    if (r->scoring == 1)
        return mf_is_nan(l) ? 0.0f : 1.0f / (1.0f + mf_exp_local(-l, tab));
    if (r->scoring == 2)
        return l;
    return mf_route_softmax(r, tab, l);
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

/*
 * The next pick among the experts of the kept groups (bits of keep; groups of per experts):
 * the first-ranked one ranking after the previous pick (prev; *bad, *c its rank, in and out),
 * any when prev < 0. Returns it, -1 when there is none (*bad, *c then 0).
 */
inline long mf_route_pick(const mf_route_row *r, __local const float *tab, ulong keep,
                          long groups, long per, long prev, int *bad, float *c)
{
    long best = -1;
    int best_bad = 0;
    float best_c = 0.0f;
    for (long g = 0; g < groups; g++) {
        if (!((keep >> g) & 1ul))
            continue;
        for (long i = g * per; i < (g + 1) * per; i++) {
            int b;
            const float v = mf_route_choice(r, tab, i, &b);
            if (prev >= 0 && !mf_route_ahead(*bad, *c, prev, b, v, i))
                continue; /* ranks at or ahead of the previous pick: taken already */
            if (best < 0 || mf_route_ahead(b, v, i, best_bad, best_c, best)) {
                best = i;
                best_bad = b;
                best_c = v;
            }
        }
    }
    *bad = best_bad;
    *c = best_c;
    return best;
}

__kernel void mf_topk_softmax(__global const uchar *logits, long lo, long ls0, int ldt,
                              __global int *ids, long io, long is0,
                              __global float *w, long wo, long ws0, long tokens, long experts,
                              long topk, int renormalize)
{
    __local float tab[64];
    mf_exp_table_to_local(tab); /* before any work-item leaves: it has a barrier */
    const long m = (long)get_global_id(0);
    if (m >= tokens)
        return;
    mf_route_row r = mf_route_row_of(logits, lo + m * ls0, ldt);
    mf_route_softmax_setup(&r, tab, experts);

    int bad = 0;
    float p = 0.0f; /* the pick's choice score: its probability */
    long pick = -1;
    float wsum = 0.0f;
    for (long j = 0; j < topk; j++) {
        pick = mf_route_pick(&r, tab, 1ul, 1, experts, pick, &bad, &p);
        ids[io + m * is0 + j] = pick < 0 ? -1 : (int)pick;
        w[wo + m * ws0 + j] = pick < 0 ? 0.0f : p;
        wsum = wsum + (pick < 0 ? 0.0f : p);
    }
    if (renormalize && wsum > 0.0f)
        for (long j = 0; j < topk; j++)
            w[wo + m * ws0 + j] = w[wo + m * ws0 + j] / wsum;
}
