/*
 * topk_softmax, one work-item per row of logits. Probabilities are recomputed
 * when needed instead of stored (no scratch of E floats per row): each value
 * is the same deterministic expression every time. exp is the library's
 * (mf_exp_local, rows.cl: mf_exp_f32 with its table in local memory).
 * Ranking: numbers before NaN, then p descending, then lower id first; it is a
 * strict total order, so the j-th pick is the best candidate ranking after
 * pick j-1, and nothing needs marking as taken.
 */
typedef struct mf_softmax_row {
    __global const uchar *l;
    long base;
    int dt, mode; /* 0: all NaN, 1: +-Inf shares, 2: exp */
    float mx, sum, share;
} mf_softmax_row;

inline float mf_prob(const mf_softmax_row *r, __local const float *tab, long i)
{
    float v = mf_load(r->l, r->dt, r->base + i);
    if (mf_is_nan(v) || r->mode == 0)
        return 0.0f;
    if (r->mode == 1)
        return v == r->mx ? r->share : 0.0f;
    return mf_exp_local(v - r->mx, tab) / r->sum;
}

/* Does (pa, a) rank ahead of (pb, b)? */
inline int mf_ahead(int nan_a, float pa, long a, int nan_b, float pb, long b)
{
    if (nan_a != nan_b)
        return !nan_a;
    if (pa != pb)
        return pa > pb;
    return a < b;
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
    mf_softmax_row r;
    r.l = logits;
    r.base = lo + m * ls0;
    r.dt = ldt;
    r.mx = -INFINITY;
    r.sum = 0.0f;
    r.share = 0.0f;
    int any = 0;
    for (long i = 0; i < experts; i++) {
        float v = mf_load(logits, ldt, r.base + i);
        if (!mf_is_nan(v)) {
            if (!any || v > r.mx)
                r.mx = v;
            any = 1;
        }
    }
    if (!any) {
        r.mode = 0;
    } else if (!mf_is_finite(r.mx)) { /* every +Inf, or every -Inf number, shares equally */
        long cnt = 0;
        for (long i = 0; i < experts; i++)
            cnt += mf_load(logits, ldt, r.base + i) == r.mx;
        r.share = 1.0f / (float)cnt;
        r.mode = 1;
    } else {
        float sum = 0.0f;
        for (long i = 0; i < experts; i++) {
            float v = mf_load(logits, ldt, r.base + i);
            float p = mf_is_nan(v) ? 0.0f : mf_exp_local(v - r.mx, tab);
            sum = sum + p;
        }
        r.sum = sum;
        r.mode = 2;
    }

    int prev_nan = 0;
    float prev_p = 0.0f;
    long prev = -1;
    float wsum = 0.0f;
    for (long j = 0; j < topk; j++) {
        long best = -1;
        int best_nan = 0;
        float best_p = 0.0f;
        for (long i = 0; i < experts; i++) {
            int in = mf_is_nan(mf_load(logits, ldt, r.base + i));
            float p = mf_prob(&r, tab, i);
            if (prev >= 0 && !mf_ahead(prev_nan, prev_p, prev, in, p, i))
                continue; /* ranks at or ahead of the previous pick: taken already */
            if (best < 0 || mf_ahead(in, p, i, best_nan, best_p, best)) {
                best = i;
                best_nan = in;
                best_p = p;
            }
        }
        ids[io + m * is0 + j] = best < 0 ? -1 : (int)best;
        w[wo + m * ws0 + j] = best < 0 ? 0.0f : best_p;
        wsum = wsum + (best < 0 ? 0.0f : best_p);
        prev = best;
        prev_nan = best_nan;
        prev_p = best_p;
    }
    if (renormalize && wsum > 0.0f)
        for (long j = 0; j < topk; j++)
            w[wo + m * ws0 + j] = w[wo + m * ws0 + j] / wsum;
}
