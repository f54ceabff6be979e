/* The routing side of the CPU MoE GEMMs (moe_slots.h). */
#include "cpu/moe_slots.h"
#include "cpu/cpu_internal.h"
#include "cpu/numerics.h"
#include "cpu/tensor_cpu.h"

#include <string.h>

static size_t round64(size_t n) { return (n + 63) / 64 * 64; }

int64_t mf_slot_expert(const mf_moe_args *a, int64_t m, int64_t j)
{
    const int64_t id = *(const int32_t *)mf_at2(&a->topk_ids, m, j);
    if (id < 0 || id >= a->global_experts)
        return -1;
    if (a->expert_map.data == NULL)
        return id < a->experts ? id : -1;
    const int64_t e = *(const int32_t *)mf_at1(&a->expert_map, id);
    return (e >= 0 && e < a->experts) ? e : -1;
}

size_t mf_slot_plan_bytes(int64_t S, int64_t E)
{
    return round64((size_t)S * 8) * 2 + round64((size_t)(E + 1) * 8) * 3;
}

char *mf_slot_plan_place(mf_slot_plan *p, char *q, int64_t S, int64_t E)
{
    p->expert_of = (int64_t *)q, q += round64((size_t)S * 8);
    p->list = (int64_t *)q, q += round64((size_t)S * 8);
    p->start = (int64_t *)q, q += round64((size_t)(E + 1) * 8);
    p->fill = (int64_t *)q, q += round64((size_t)(E + 1) * 8);
    p->items = (int64_t *)q, q += round64((size_t)(E + 1) * 8);
    return q;
}

void mf_slot_plan_experts(mf_slot_plan *p, const mf_moe_args *a)
{
    for (int64_t m = 0; m < a->tokens; m++)
        for (int64_t j = 0; j < a->topk; j++)
            p->expert_of[m * a->topk + j] = mf_slot_expert(a, m, j);
}

void mf_slot_plan_group(mf_slot_plan *p, int64_t E, int64_t s0, int64_t s1, int64_t tile,
                        int64_t col_blocks)
{
    memset(p->fill, 0, (size_t)E * sizeof(int64_t));
    for (int64_t s = s0; s < s1; s++)
        if (p->expert_of[s] >= 0)
            p->fill[p->expert_of[s]]++;
    p->start[0] = 0;
    p->items[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        p->start[e + 1] = p->start[e] + p->fill[e];
        p->items[e + 1] = p->items[e] + (p->fill[e] + tile - 1) / tile * col_blocks;
        p->fill[e] = p->start[e];
    }
    for (int64_t s = s0; s < s1; s++)
        if (p->expert_of[s] >= 0)
            p->list[p->fill[p->expert_of[s]]++] = s;
    p->col_blocks = col_blocks;
}

void mf_slot_plan_item(const mf_slot_plan *p, int64_t E, int64_t w, int64_t *e,
                       const int64_t **slots, int64_t *count, int64_t *cb)
{
    int64_t lo = 0, hi = E - 1;
    while (lo < hi) { /* last e with items[e] <= w */
        const int64_t mid = (lo + hi + 1) / 2;
        if (p->items[mid] <= w)
            lo = mid;
        else
            hi = mid - 1;
    }
    /* the expert's n slots in its ceil(n / tile) tiles (items / col_blocks) of near-equal
     * size: with tiles of exactly 48, 64 slots were 48 and 16, each reading the weights */
    const int64_t r = w - p->items[lo], tile = r / p->col_blocks;
    const int64_t n = p->start[lo + 1] - p->start[lo];
    const int64_t tiles = (p->items[lo + 1] - p->items[lo]) / p->col_blocks;
    const int64_t T = (n + tiles - 1) / tiles;
    *e = lo;
    *cb = r % p->col_blocks;
    *slots = p->list + p->start[lo] + tile * T;
    *count = n - tile * T < T ? n - tile * T : T;
}

/* One token of mf_slot_reduce_tokens. */
static void reduce_token(const mf_moe_args *a, const mf_slot_plan *p, const float *y, int64_t m,
                         int64_t s0, float *acc)
{
    const int64_t K = a->model_dim, k = a->topk;
    for (int64_t r = 0; r < K; r++)
        acc[r] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        if (p->expert_of[m * k + j] < 0)
            continue;
        const float wt = *(const float *)mf_at2(&a->topk_weights, m, j);
        const float *yr = y + (m * k + j - s0) * K;
MF_OMP(simd)
        for (int64_t r = 0; r < K; r++) {
            const float prod = wt * yr[r];
            acc[r] = acc[r] + prod;
        }
    }
    mf_store_row(mf_at2(&a->out, m, 0), acc, a->out.dtype, K);
}

void mf_slot_reduce_tokens(const mf_moe_args *a, const mf_slot_plan *p, const float *y,
                           int64_t m0, int64_t m1, int64_t s0, float *acc)
{
MF_OMP(for schedule(static))
    for (int64_t m = m0; m < m1; m++)
        reduce_token(a, p, y, m, s0, acc);
}

void mf_slot_zero_invalid(const mf_slot_plan *p, const moefuse_tensor *t, int64_t k, int64_t s0,
                          int64_t s1, size_t row_bytes)
{
MF_OMP(for schedule(static))
    for (int64_t s = s0; s < s1; s++)
        if (p->expert_of[s] < 0)
            memset(mf_at3(t, s / k, s % k, 0), 0, row_bytes);
}

void mf_slot_add_bias(float *dst, const float *src, const moefuse_tensor *bias, int64_t e,
                      int64_t r0, int64_t n)
{
    const bool given = bias->data != NULL;
    for (int64_t c = 0; c < n; c++)
        dst[c] = given ? src[c] + mf_load_elem(mf_at2(bias, e, r0 + c), bias->dtype) : src[c];
}

moefuse_status mf_cpu_moe_shared_routing(moefuse_context *ctx, void *state,
                                         const mf_shared_args *a)
{
    (void)ctx;
    (void)state;
    const mf_moe_args *r = &a->route;
    const int64_t k = r->topk, n = a->n_shared, E = r->experts, slots = k + n;
    int32_t *ids = (int32_t *)mf_at1(&a->ids, 0);
    float *w = a->weights.data ? (float *)mf_at1(&a->weights, 0) : NULL;
    for (int64_t m = 0; m < r->tokens; m++) {
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = mf_slot_expert(r, m, j);
            ids[m * slots + j] = e >= 0 && e < E - n ? (int32_t)e : -1;
            if (w)
                w[m * slots + j] = *(const float *)mf_at2(&r->topk_weights, m, j);
        }
        const float f = a->shared_weights.data
                            ? a->scale * *(const float *)mf_at1(&a->shared_weights, m)
                            : a->scale;
        for (int64_t s = 0; s < n; s++) {
            ids[m * slots + k + s] = (int32_t)(E - n + s);
            if (w)
                w[m * slots + k + s] = f;
        }
    }
    return MOEFUSE_OK;
}
