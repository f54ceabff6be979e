/*
 * Expert parallelism's low-latency steps on the CPU (src/core/backend.h, mf_ep_ll_args; the
 * blocks as ep/ep_ll_wire.h lays them out): the reference the CUDA kernels (src/cuda/ep_ll.cu)
 * are tested against. Counts and indices that came from another rank are clamped before use.
 */
#include "cpu/cpu_internal.h"
#include "cpu/scales.h"
#include "cpu/tensor_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Block p as this rank received it: its own stays in the send blocks. */
static mf_ep_ll_block recv_block(const mf_ep_ll_args *a, int32_t p)
{
    return mf_ep_ll_block_at(&a->wire, p == a->rank ? a->send : a->recv, p);
}

/* Row q of what rank p sent back: this rank's own rows are its partial sums. */
static const float *back_row(const mf_ep_ll_args *a, int32_t p, int64_t q)
{
    const float *rows = p == a->rank ? a->partial : a->back;
    return rows + ((int64_t)p * a->wire.cap + q) * a->model_dim;
}

moefuse_status mf_cpu_ep_ll_pack(moefuse_context *ctx, void *state, const mf_ep_ll_args *a)
{
    (void)state;
    const mf_ep_ll_wire *w = &a->wire;
    const int32_t W = a->world;
    const int64_t M = a->tokens, K = a->model_dim, k = w->topk;
    const size_t xbytes = (size_t)K * moefuse_dtype_size(a->x.dtype);
    int32_t *n = calloc((size_t)W, sizeof *n);
    if (!n)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "ep_ll_pack: cannot allocate");
    for (int64_t m = 0; m < M; m++) {
        for (int32_t p = 0; p < W; p++) {
            a->pos[m * W + p] = -1;
            bool any = false;
            for (int64_t j = 0; j < k; j++) {
                const int32_t g = *(const int32_t *)mf_at2(&a->ids, m, j);
                any = any || (g >= 0 && g < a->experts && a->owner[g] == p);
            }
            if (!any)
                continue;
            const mf_ep_ll_block b = mf_ep_ll_block_at(w, a->send, p);
            const int32_t i = n[p]++;
            a->pos[m * W + p] = i;
            b.token[i] = (int32_t)m;
            for (int64_t j = 0; j < k; j++) {
                const int32_t g = *(const int32_t *)mf_at2(&a->ids, m, j);
                const bool here = g >= 0 && g < a->experts && a->owner[g] == p;
                b.expert[i * k + j] = here ? a->local[g] : -1;
                b.weight[i * k + j] = *(const float *)mf_at2(&a->weights, m, j);
            }
            char *row = b.rows + w->row_bytes * (size_t)i;
            memcpy(row, mf_at3(&a->x, 0, m, 0), xbytes);
            for (int64_t grp = 0; grp < a->groups; grp++) {
                const float v = mf_scale_read(&a->x_scales, a->x_layout, 0, m, grp);
                memcpy(row + K + (size_t)grp * sizeof v, &v, sizeof v);
            }
        }
    }
    for (int32_t p = 0; p < W; p++)
        *mf_ep_ll_block_at(w, a->send, p).count = n[p];
    free(n);
    return MOEFUSE_OK;
}

/* Each received slot of local expert e, in block order (p, then i, then j), calls visit. */
typedef void (*slot_visit)(const mf_ep_ll_args *a, int64_t e, int32_t p, int64_t i, int64_t j,
                           int64_t *fill);

static void walk_slots(const mf_ep_ll_args *a, int64_t experts, int64_t *fill, slot_visit visit)
{
    const mf_ep_ll_wire *w = &a->wire;
    for (int32_t p = 0; p < a->world; p++) {
        const mf_ep_ll_block b = recv_block(a, p);
        const int64_t n = mf_ep_ll_rows_in(w, &b);
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < w->topk; j++) {
                const int32_t e = b.expert[i * w->topk + j];
                if (e >= 0 && e < experts)
                    visit(a, e, p, i, j, fill);
                else
                    a->row_of[((int64_t)p * w->cap + i) * w->topk + j] = -1;
            }
    }
}

static void count_slot(const mf_ep_ll_args *a, int64_t e, int32_t p, int64_t i, int64_t j,
                       int64_t *fill)
{
    (void)a, (void)p, (void)i, (void)j;
    fill[e]++;
}

static void place_slot(const mf_ep_ll_args *a, int64_t e, int32_t p, int64_t i, int64_t j,
                       int64_t *fill)
{
    const mf_ep_ll_wire *w = &a->wire;
    const int64_t T = a->recv_x.shape[1], K = a->model_dim, t = fill[e]++;
    int32_t *row_of = &a->row_of[((int64_t)p * w->cap + i) * w->topk + j];
    if (t >= T) {
        *row_of = -2; /* lost: combine makes its token NaN */
        return;
    }
    *row_of = (int32_t)t;
    const char *src = recv_block(a, p).rows + w->row_bytes * (size_t)i;
    memcpy(mf_at3(&a->recv_x, e, t, 0), src, (size_t)K * moefuse_dtype_size(a->recv_x.dtype));
    for (int64_t g = 0; g < a->groups; g++) {
        float v;
        memcpy(&v, src + K + (size_t)g * sizeof v, sizeof v);
        mf_scale_write(&a->recv_scales, a->recv_layout, e, t, g, v);
    }
}

moefuse_status mf_cpu_ep_ll_place(moefuse_context *ctx, void *state, const mf_ep_ll_args *a)
{
    (void)state;
    const int64_t E = a->recv_x.shape[0], T = a->recv_x.shape[1];
    int64_t *fill = calloc((size_t)(E > 0 ? E : 1), sizeof *fill);
    int64_t *kept = calloc((size_t)(E > 0 ? E : 1), sizeof *kept);
    if (!fill || !kept) {
        free(fill);
        free(kept);
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "ep_ll_place: cannot allocate");
    }
    walk_slots(a, E, fill, count_slot);
    for (int64_t e = 0; e < E; e++) {
        kept[e] = fill[e] < T ? fill[e] : T;
        *(int32_t *)mf_at1(&a->recv_counts, e) = (int32_t)(fill[e] < INT32_MAX ? fill[e]
                                                                               : INT32_MAX);
    }
    if (a->groups > 0) { /* the layout's padding, as the normal mode's scatter leaves it */
        mf_ep_rows_args pad;
        memset(&pad, 0, sizeof pad);
        pad.rows = a->recv_x;
        pad.scales = a->recv_scales;
        pad.layout = a->recv_layout;
        pad.counts = kept;
        mf_cpu_ep_zero_padding(&pad);
    }
    memset(fill, 0, sizeof *fill * (size_t)(E > 0 ? E : 1));
    walk_slots(a, E, fill, place_slot);
    free(fill);
    free(kept);
    return MOEFUSE_OK;
}

moefuse_status mf_cpu_ep_ll_partial(moefuse_context *ctx, void *state, const mf_ep_ll_args *a)
{
    (void)state;
    const mf_ep_ll_wire *w = &a->wire;
    const int64_t K = a->model_dim, k = w->topk, E = a->y.shape[0], T = a->y.shape[1];
    float *acc = malloc(sizeof *acc * (size_t)(K > 0 ? 2 * K : 1));
    if (!acc)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "ep_ll_partial: cannot allocate");
    float *yrow = acc + K;
    for (int32_t p = 0; p < a->world; p++) {
        const mf_ep_ll_block b = recv_block(a, p);
        const int64_t n = mf_ep_ll_rows_in(w, &b);
        for (int64_t i = 0; i < n; i++) {
            for (int64_t c = 0; c < K; c++)
                acc[c] = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                const int32_t e = b.expert[i * k + j];
                if (e < 0 || e >= E)
                    continue;
                const int32_t t = a->row_of[((int64_t)p * w->cap + i) * k + j];
                if (t >= 0 && t < T)
                    mf_load_row(yrow, mf_at3(&a->y, e, t, 0), a->y.dtype, K);
                else
                    for (int64_t c = 0; c < K; c++)
                        yrow[c] = NAN; /* the row was lost past Tmax */
                const float wt = b.weight[i * k + j];
                for (int64_t c = 0; c < K; c++) { /* the reduced final's two roundings */
                    const float prod = wt * yrow[c];
                    acc[c] = acc[c] + prod;
                }
            }
            memcpy(a->partial + ((int64_t)p * w->cap + i) * K, acc, sizeof *acc * (size_t)K);
        }
    }
    free(acc);
    return MOEFUSE_OK;
}

moefuse_status mf_cpu_ep_ll_sum(moefuse_context *ctx, void *state, const mf_ep_ll_args *a)
{
    (void)state;
    const int64_t K = a->model_dim, C = a->wire.cap;
    float *acc = malloc(sizeof *acc * (size_t)(K > 0 ? K : 1));
    if (!acc)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "ep_ll_sum: cannot allocate");
    for (int64_t m = 0; m < a->tokens; m++) {
        for (int64_t c = 0; c < K; c++)
            acc[c] = 0.0f;
        for (int32_t p = 0; p < a->world; p++) {
            const int32_t q = a->pos[m * a->world + p];
            if (q < 0 || q >= C)
                continue;
            const float *row = back_row(a, p, q);
            for (int64_t c = 0; c < K; c++)
                acc[c] = acc[c] + row[c];
        }
        mf_store_row(mf_at2(&a->out, m, 0), acc, a->out.dtype, K);
    }
    free(acc);
    return MOEFUSE_OK;
}
