/* topk_softmax: f32 softmax over each row of logits, then the k largest (docs/NUMERICS.md). */
#include "cpu/cpu_internal.h"
#include "cpu/numerics.h"
#include "numerics/mf_exp.h"
#include "cpu/tensor_cpu.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

/* Does candidate i rank ahead of candidate b? NaN logits last, then p descending, then id. */
static bool ranks_before(const float *p, const unsigned char *nan, int64_t i, int64_t b)
{
    if (nan[i] != nan[b])
        return !nan[i];
    if (p[i] != p[b])
        return p[i] > p[b];
    return i < b;
}

static void topk_row(const mf_topk_args *a, int64_t m, float *l, float *p, unsigned char *nan,
                     unsigned char *taken)
{
    const int64_t E = a->experts, k = a->topk;
    mf_load_row(l, mf_at2(&a->logits, m, 0), a->logits.dtype, E);
    bool any = false;
    float mx = -INFINITY;
    for (int64_t i = 0; i < E; i++) {
        nan[i] = isnan(l[i]) != 0;
        taken[i] = 0;
        if (!nan[i]) {
            if (!any || l[i] > mx)
                mx = l[i];
            any = true;
        }
    }
    if (!any) {
        for (int64_t i = 0; i < E; i++)
            p[i] = 0.0f;
    } else if (mx == INFINITY || mx == -INFINITY) {
        /* every +Inf (or, when all numbers are -Inf, every number) shares equally */
        int64_t cnt = 0;
        for (int64_t i = 0; i < E; i++)
            cnt += (!nan[i] && l[i] == mx);
        const float share = 1.0f / (float)cnt;
        for (int64_t i = 0; i < E; i++)
            p[i] = (!nan[i] && l[i] == mx) ? share : 0.0f;
    } else {
        float sum = 0.0f;
        for (int64_t i = 0; i < E; i++) {
            p[i] = nan[i] ? 0.0f : mf_exp_f32(l[i] - mx); /* the library's exp */
            sum = sum + p[i];
        }
        for (int64_t i = 0; i < E; i++)
            p[i] = nan[i] ? 0.0f : p[i] / sum;
    }

    int32_t *ids = (int32_t *)mf_at2(&a->ids, m, 0);
    float *w = (float *)mf_at2(&a->weights, m, 0);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < E; i++)
            if (!taken[i] && (best < 0 || ranks_before(p, nan, i, best)))
                best = i;
        if (best < 0) { /* k > E cannot pass validation; stay in bounds anyway */
            ids[j] = -1;
            w[j] = 0.0f;
            continue;
        }
        taken[best] = 1;
        ids[j] = (int32_t)best;
        w[j] = p[best];
    }
    if (a->renormalize) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++)
            sum = sum + w[j];
        if (sum > 0.0f)
            for (int64_t j = 0; j < k; j++)
                w[j] = w[j] / sum;
    }
}

/* Per thread: the row's logits and probabilities (f32), its NaN and taken flags (bytes). */
static size_t thread_stride(const mf_topk_args *a)
{
    const size_t per_thread = (size_t)a->experts * (2 * sizeof(float) + 2);
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

moefuse_status mf_cpu_topk_softmax(moefuse_context *ctx, void *state, const mf_topk_args *a)
{
    (void)state;
    const int64_t E = a->experts;
    const int nt = mf_cpu_max_threads();
    const size_t stride = thread_stride(a);
    mf_cpu_scratch scratch;
    MF_TRY(mf_cpu_scratch_take(ctx, "topk_softmax", (size_t)nt * stride, &scratch));
    char *mem = scratch.mem;
MF_OMP(parallel num_threads(nt))
    {
        char *base = mem + (size_t)mf_cpu_thread_id() * stride;
        float *l = (float *)base, *p = l + E;
        unsigned char *nan = (unsigned char *)(p + E), *taken = nan + E;
MF_OMP(for schedule(static))
        for (int64_t m = 0; m < a->tokens; m++)
            topk_row(a, m, l, p, nan, taken);
    }
    mf_cpu_scratch_release(&scratch);
    return MOEFUSE_OK;
}
