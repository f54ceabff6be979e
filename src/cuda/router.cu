/*
 * topk_route of the CUDA backend: the CPU's bits (src/cpu/topk.c, docs/NUMERICS.md, "Router
 * (topk_route)"). Four kernels: mf_k_route_block (router_block.cu) for few rows, and for many
 * mf_k_route_lanes (router_lanes.cu: E = 128, 256, 384 with whole-lane groups) or
 * mf_k_route_warp (router_warp.cu: any E <= 512); and here mf_k_topk_route, the reference for
 * any E: a thread per row, every score recomputed where it is used (the shape of
 * kernels/router.cl). MOEFUSE_CUDA_ROUTER=block|lanes|warp|thread forces one.
 */
#include "cuda/cuda_internal.h"
#include "cuda/moe_internal.h"
#include "cuda/moe_math.cuh"
#include "cuda/numerics.cuh"
#include "cuda/pdl.cuh"
#include "cuda/router.h"
#include "cuda/router_keys.cuh"

#include <stdlib.h>
#include <string.h>

/* Rows an SM takes for the block kernel to be chosen (measured: docs/PERFORMANCE.md). */
#define ROUTE_BLOCK_ROWS_PER_SM 1

/* ------------------------------------------------------------- topk_route */


typedef struct RouteRow {
    const RouteParams *p;
    int64_t m;
    int mode; /* softmax over the row: 0 all NaN, 1 +-Inf shares, 2 exp */
    float mx, sum, share;
} RouteRow;

static __device__ float route_logit(const RouteRow &r, int64_t i)
{
    float v = mfm_load(r.p->l, r.p->ldt, r.m * r.p->ls0 + i);
    if (r.p->lb)
        v = __fadd_rn(v, mfm_load(r.p->lb, r.p->lbdt, i));
    return v;
}

static __device__ float route_score(const RouteRow &r, float l)
{
    if (r.p->scoring == MOEFUSE_ROUTER_SIGMOID)
        return rw_sigmoid_general(l);
    if (r.p->scoring == MOEFUSE_ROUTER_TOPK_SOFTMAX)
        return l;
    if (mf_is_nan(l) || r.mode == 0)
        return 0.0f;
    if (r.mode == 1)
        return l == r.mx ? r.share : 0.0f;
    return __fdiv_rn(mf_exp_f32(__fsub_rn(l, r.mx)), r.sum);
}

static __device__ float route_choice(const RouteRow &r, int64_t i, int *bad)
{
    const float l = route_logit(r, i);
    const float s = route_score(r, l);
    const float c = r.p->cb ? __fadd_rn(s, mfm_load(r.p->cb, r.p->cbdt, i)) : s;
    *bad = mf_is_nan(l) || mf_is_nan(c);
    return c;
}

static __device__ __forceinline__ bool route_ahead(int bad_a, float ca, int64_t a, int bad_b,
                                                   float cb, int64_t b)
{
    if (bad_a != bad_b)
        return !bad_a;
    if (!bad_a && ca != cb)
        return ca > cb;
    return a < b;
}

static __device__ int64_t route_first(const RouteRow &r, int64_t lo, int64_t n, int64_t skip,
                                      int *bad, float *c)
{
    int64_t best = -1;
    for (int64_t i = lo; i < lo + n; i++) {
        if (i == skip)
            continue;
        int b;
        const float v = route_choice(r, i, &b);
        if (best < 0 || route_ahead(b, v, i, *bad, *c, best)) {
            best = i;
            *bad = b;
            *c = v;
        }
    }
    return best;
}

/* topk_softmax's steps 1-2 over n values, written to w (NaN values, and ids < 0, get 0). */
static __device__ void route_softmax_k(const RouteRow &r, const int32_t *ids, float *w, int64_t n)
{
    bool any = false;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float v = ids[j] < 0 ? NAN : route_logit(r, ids[j]);
        if (!mf_is_nan(v)) {
            if (!any || v > mx)
                mx = v;
            any = true;
        }
    }
    if (!any) {
        for (int64_t j = 0; j < n; j++)
            w[j] = 0.0f;
        return;
    }
    if (!mf_is_finite(mx)) {
        int64_t cnt = 0;
        for (int64_t j = 0; j < n; j++)
            cnt += ids[j] >= 0 && route_logit(r, ids[j]) == mx;
        const float share = __fdiv_rn(1.0f, (float)cnt);
        for (int64_t j = 0; j < n; j++)
            w[j] = ids[j] >= 0 && route_logit(r, ids[j]) == mx ? share : 0.0f;
        return;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const float v = ids[j] < 0 ? NAN : route_logit(r, ids[j]);
        w[j] = mf_is_nan(v) ? 0.0f : mf_exp_f32(__fsub_rn(v, mx));
        sum = __fadd_rn(sum, w[j]);
    }
    for (int64_t j = 0; j < n; j++) {
        const float v = ids[j] < 0 ? NAN : route_logit(r, ids[j]);
        w[j] = mf_is_nan(v) ? 0.0f : __fdiv_rn(w[j], sum);
    }
}

__global__ void __launch_bounds__(64) mf_k_topk_route(const RouteParams p)
{
    mf_pdl_wait(); /* the logits may come from the kernel before */
    mf_pdl_trigger();
    const int64_t m = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= p.M)
        return;
    RouteRow r;
    r.p = &p;
    r.m = m;
    r.mode = 2;
    r.mx = -INFINITY;
    r.sum = 0.0f;
    r.share = 0.0f;
    if (p.scoring == MOEFUSE_ROUTER_SOFTMAX) {
        bool any = false;
        for (int64_t i = 0; i < p.E; i++) {
            const float v = route_logit(r, i);
            if (!mf_is_nan(v)) {
                if (!any || v > r.mx)
                    r.mx = v;
                any = true;
            }
        }
        if (!any) {
            r.mode = 0;
        } else if (!mf_is_finite(r.mx)) {
            int64_t cnt = 0;
            for (int64_t i = 0; i < p.E; i++)
                cnt += route_logit(r, i) == r.mx;
            r.share = __fdiv_rn(1.0f, (float)cnt);
            r.mode = 1;
        } else {
            float sum = 0.0f;
            for (int64_t i = 0; i < p.E; i++) {
                const float v = route_logit(r, i);
                sum = __fadd_rn(sum, mf_is_nan(v) ? 0.0f : mf_exp_f32(__fsub_rn(v, r.mx)));
            }
            r.sum = sum;
        }
    }
    const int64_t per = p.E / p.groups;
    uint64_t keep = p.groups == 64 ? ~0ull : ((1ull << p.groups) - 1ull);
    if (p.groups > 1) {
        float gs[64];
        uint64_t gbad = 0ull;
        for (int64_t g = 0; g < p.groups; g++) {
            int b1 = 0;
            float c1 = 0.0f;
            const int64_t first = route_first(r, g * per, per, -1, &b1, &c1);
            gs[g] = 0.0f;
            if (first < 0 || b1) {
                gbad |= 1ull << g;
                continue;
            }
            float score = c1;
            if (p.group_scoring == MOEFUSE_GROUP_TOP2_SUM) {
                int b2 = 0;
                float c2 = 0.0f;
                const int64_t second = route_first(r, g * per, per, first, &b2, &c2);
                if (second >= 0 && !b2)
                    score = __fadd_rn(score, c2);
            }
            gs[g] = score;
            if (mf_is_nan(score))
                gbad |= 1ull << g;
        }
        keep = 0ull;
        for (int64_t t = 0; t < p.kept; t++) {
            int64_t best = -1;
            for (int64_t g = 0; g < p.groups; g++) {
                if ((keep >> g) & 1ull)
                    continue;
                if (best < 0 || route_ahead((int)((gbad >> g) & 1ull), gs[g], g,
                                            (int)((gbad >> best) & 1ull), gs[best], best))
                    best = g;
            }
            keep |= 1ull << best;
        }
    }
    int32_t *ids = p.ids + m * p.is0;
    float *w = p.w + m * p.ws0;
    int prev_bad = 0;
    float prev_c = 0.0f;
    int64_t prev = -1;
    for (int64_t j = 0; j < p.k; j++) {
        int64_t best = -1;
        int best_bad = 0;
        float best_c = 0.0f;
        for (int64_t i = 0; i < p.E; i++) {
            if (!((keep >> (i / per)) & 1ull))
                continue;
            int b;
            const float c = route_choice(r, i, &b);
            if (prev >= 0 && !route_ahead(prev_bad, prev_c, prev, b, c, i))
                continue; /* ranks at or ahead of the previous pick: taken already */
            if (best < 0 || route_ahead(b, c, i, best_bad, best_c, best)) {
                best = i;
                best_bad = b;
                best_c = c;
            }
        }
        ids[j] = best < 0 ? -1 : (int32_t)best;
        w[j] = best < 0 ? 0.0f : route_score(r, route_logit(r, best));
        prev = best;
        prev_bad = best_bad;
        prev_c = best_c;
    }
    if (p.scoring == MOEFUSE_ROUTER_TOPK_SOFTMAX)
        route_softmax_k(r, ids, w, p.k);
    if (p.renorm) {
        float sum = 0.0f;
        for (int64_t j = 0; j < p.k; j++)
            sum = __fadd_rn(sum, w[j]);
        if (sum > 0.0f)
            for (int64_t j = 0; j < p.k; j++)
                w[j] = __fdiv_rn(w[j], sum);
    }
    if (p.scale != 1.0f)
        for (int64_t j = 0; j < p.k; j++)
            w[j] = __fmul_rn(w[j], p.scale);
}

extern "C" int mf_cuda_router_from_env(void)
{
    static const char *const names[] = {"block", "lanes", "warp", "thread"};
    const char *v = getenv("MOEFUSE_CUDA_ROUTER");
    if (!v || !*v)
        return ROUTE_AUTO;
    for (int c = 0; c < 4; c++)
        if (strcmp(v, names[c]) == 0)
            return ROUTE_BLOCK + c;
    return -1;
}

/*
 * The kernel for p: the block per row while a few rows leave most SMs idle (its chains are
 * short; per row it issues the most), then 16 or 32 lanes per row for the common routers, a warp
 * per row for the others, a thread per row past 512 experts. A forced kernel that cannot take
 * p gives way to the next one in that order.
 */
static int route_kernel_for(const cuda_state *s, const RouteParams *p)
{
    int kernel = s->forced_router;
    if (kernel == ROUTE_AUTO)
        kernel = p->M <= (int64_t)ROUTE_BLOCK_ROWS_PER_SM * s->sm_count ? ROUTE_BLOCK : ROUTE_LANES;
    if (kernel == ROUTE_BLOCK && !mf_route_block_takes(p))
        kernel = ROUTE_LANES;
    if (kernel == ROUTE_LANES && !mf_route_lanes_takes(p))
        kernel = ROUTE_WARP;
    if (kernel == ROUTE_WARP && p->E > ROUTE_WARP_MAX_E)
        kernel = ROUTE_THREAD;
    return kernel;
}

moefuse_status mf_cuda_topk_route(moefuse_context *ctx, void *state, const mf_topk_args *a)
{
    cuda_state *s = (cuda_state *)state;
    if (a->tokens == 0)
        return MOEFUSE_OK;
    RouteParams p;
    memset(&p, 0, sizeof p);
    p.l = mf_cuda_base(&a->logits);
    p.ls0 = a->logits.stride[0];
    p.ldt = (int)a->logits.dtype;
    p.lb = a->logit_bias.data ? mf_cuda_base(&a->logit_bias) : NULL;
    p.lbdt = (int)a->logit_bias.dtype;
    p.cb = a->choice_bias.data ? mf_cuda_base(&a->choice_bias) : NULL;
    p.cbdt = (int)a->choice_bias.dtype;
    p.ids = (int32_t *)mf_cuda_base(&a->ids);
    p.is0 = a->ids.stride[0];
    p.w = (float *)mf_cuda_base(&a->weights);
    p.ws0 = a->weights.stride[0];
    p.M = a->tokens;
    p.E = a->experts;
    p.k = a->topk;
    p.groups = a->groups;
    p.kept = a->groups_kept;
    p.scoring = (int)a->scoring;
    p.group_scoring = (int)a->group_scoring;
    p.renorm = a->renormalize;
    p.scale = a->scale;
    const int kernel = route_kernel_for(s, &p);
    if (kernel == ROUTE_BLOCK) {
        mf_route_block_launch(&p, s->stream, s->pdl);
        return mf_cuda_launched(ctx, "topk_route", "mf_k_route_block");
    }
    if (kernel == ROUTE_LANES) {
        mf_route_lanes_launch(&p, s->stream, s->pdl);
        return mf_cuda_launched(ctx, "topk_route", "mf_k_route_lanes");
    }
    if (kernel == ROUTE_WARP) {
        mf_route_warp_launch(&p, s->stream, s->pdl);
        return mf_cuda_launched(ctx, "topk_route", "mf_k_route_warp");
    }
    const dim3 grid((unsigned)((p.M + 63) / 64));
    mf_launch_pdl(mf_k_topk_route, grid, 64, 0, s->stream, s->pdl, p);
    return mf_cuda_launched(ctx, "topk_route", "mf_k_topk_route");
}

