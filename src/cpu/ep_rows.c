/*
 * Expert parallelism's work on rows, on the CPU (src/core/backend.h, mf_ep_rows_args): pack
 * listed rows into a buffer, unpack a buffer into listed rows (with their scales in any
 * layout), the top-k sum of the rows sent back, and the in-process transport's copy.
 */
#include "cpu/cpu_internal.h"
#include "cpu/scales.h"
#include "cpu/tensor_cpu.h"

#include <stdlib.h>
#include <string.h>

moefuse_status mf_cpu_ep_gather(moefuse_context *ctx, void *state, const mf_ep_rows_args *a)
{
    (void)ctx, (void)state;
    const int64_t T = a->rows.shape[1], K = a->rows.shape[2];
    for (int64_t i = 0; i < a->n; i++) {
        const int64_t e = a->index[i] / T, t = a->index[i] % T;
        const char *src = mf_at3(&a->rows, e, t, 0);
        char *dst = (char *)a->buffer + (size_t)i * a->row_bytes;
        if (a->to_f32) {
            mf_load_row((float *)dst, src, a->rows.dtype, K);
            continue;
        }
        memcpy(dst, src, (size_t)K * moefuse_dtype_size(a->rows.dtype));
        for (int64_t g = 0; g < a->groups; g++) { /* f8 rows: their scales' values */
            const float v = mf_scale_read(&a->scales, a->layout, e, t, g);
            memcpy(dst + K + (size_t)g * sizeof v, &v, sizeof v);
        }
    }
    return MOEFUSE_OK;
}

/* The layout's padding: rows T .. Ta - 1, and the packed words of the rows to be written. */
void mf_cpu_ep_zero_padding(const mf_ep_rows_args *a)
{
    const moefuse_tensor *s = &a->scales;
    if (a->layout == MOEFUSE_SCALE_ROW_MAJOR || !a->counts)
        return;
    const int64_t T = a->rows.shape[1], inner = s->shape[1], ta = s->shape[2];
    const size_t es = moefuse_dtype_size(s->dtype);
    for (int64_t e = 0; e < s->shape[0]; e++)
        for (int64_t w = 0; w < inner; w++) {
            if (a->layout == MOEFUSE_SCALE_PACKED_UE8M0)
                memset(mf_at3(s, e, w, 0), 0, es * (size_t)a->counts[e]);
            if (ta > T)
                memset(mf_at3(s, e, w, T), 0, es * (size_t)(ta - T));
        }
}

moefuse_status mf_cpu_ep_scatter(moefuse_context *ctx, void *state, const mf_ep_rows_args *a)
{
    (void)ctx, (void)state;
    const int64_t T = a->rows.shape[1], K = a->rows.shape[2];
    if (a->groups > 0)
        mf_cpu_ep_zero_padding(a);
    for (int64_t i = 0; i < a->n; i++) {
        const int64_t e = a->index[i] / T, t = a->index[i] % T;
        const char *src = (const char *)a->buffer + (size_t)i * a->row_bytes;
        memcpy(mf_at3(&a->rows, e, t, 0), src, (size_t)K * moefuse_dtype_size(a->rows.dtype));
        for (int64_t g = 0; g < a->groups; g++) {
            float v;
            memcpy(&v, src + K + (size_t)g * sizeof v, sizeof v);
            mf_scale_write(&a->scales, a->layout, e, t, g, v);
        }
    }
    return MOEFUSE_OK;
}

moefuse_status mf_cpu_ep_reduce(moefuse_context *ctx, void *state, const mf_ep_reduce_args *a)
{
    (void)state;
    const int64_t K = a->model_dim, k = a->topk;
    float *acc = malloc(sizeof *acc * (size_t)(K > 0 ? K : 1));
    if (!acc)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "ep: cannot allocate a row of %lld floats",
                        (long long)K);
    const float *back = a->back;
    for (int64_t m = 0; m < a->tokens; m++) {
        for (int64_t c = 0; c < K; c++)
            acc[c] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const int64_t row = a->slot_row[m * k + j];
            if (row < 0)
                continue;
            const float wt = a->weight[m * k + j];
            const float *y = back + row * K;
            for (int64_t c = 0; c < K; c++) { /* the reduced final's (moe_slots.c) */
                const float prod = wt * y[c];
                acc[c] = acc[c] + prod;
            }
        }
        mf_store_row(mf_at2(&a->out, m, 0), acc, a->out.dtype, K);
    }
    free(acc);
    return MOEFUSE_OK;
}

moefuse_status mf_cpu_ep_copy(moefuse_context *ctx, void *state, void *dst, const void *src,
                              size_t bytes)
{
    (void)ctx, (void)state;
    memcpy(dst, src, bytes);
    return MOEFUSE_OK;
}
