/*
 * The row engine behind act_quant (2-D and masked), act_mul and quant: one
 * pass per row computes h in f32 (activation, factors, intermediate rounding),
 * then either rounds h to the output dtype or quantizes it group by group and
 * writes the scales in the requested layout. Work is a flattened loop over the
 * valid (expert, row) pairs, so it scales with the number of valid tokens.
 */
#include "cpu/activation.h"
#include "cpu/cpu_internal.h"
#include "cpu/numerics.h"
#include "cpu/tensor_cpu.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

enum row_mode { ROW_QUANT, ROW_ACT_MUL };

/* Rows of expert e that are valid: counts clamped to [0, T], or all T rows. */
static int64_t valid_rows(const mf_rows_args *a, int64_t e)
{
    if (a->counts.data == NULL)
        return a->rows;
    int64_t n = *(const int32_t *)mf_at1(&a->counts, e);
    return n < 0 ? 0 : (n > a->rows ? a->rows : n);
}

/* h[0..H) of row (e, t) in f32. xbuf holds 2H floats. */
static void row_h(const mf_rows_args *a, int64_t e, int64_t t, float *restrict xbuf,
                  float *restrict h)
{
    const int64_t H = a->hidden;
    if (!a->activate) {
        mf_load_row(h, mf_at3(&a->x, e, t, 0), a->x.dtype, H);
        return;
    }
    mf_load_row(xbuf, mf_at3(&a->x, e, t, 0), a->x.dtype, 2 * H);
    const float *g = xbuf + (a->act.order == MOEFUSE_UP_FIRST ? H : 0);
    const float *u = xbuf + (a->act.order == MOEFUSE_UP_FIRST ? 0 : H);
    const bool has_rs = a->row_scale.data != NULL, has_es = a->expert_scale.data != NULL;
    const float rs = has_rs ? *(const float *)mf_at2(&a->row_scale, e, t) : 1.0f;
    const float es = has_es ? mf_load_elem(mf_at1(&a->expert_scale, e), a->expert_scale.dtype)
                            : 1.0f;
    const float limit = a->act.limit;
    const bool round_bf16 = a->act.intermediate == MOEFUSE_ROUND_BF16;
    const moefuse_activation act = a->act.activation;
    for (int64_t c = 0; c < H; c++) {
        float gv = g[c], uv = u[c];
        if (limit > 0.0f) {
            gv = mf_clamp_gate(gv, limit);
            uv = mf_clamp_up(uv, limit);
        }
        float av = mf_activate(act, gv);
        if (round_bf16)
            av = mf_round_bf16(av);
        float hv = av * uv;
        if (has_rs)
            hv = hv * rs;
        if (has_es)
            hv = hv * es;
        if (round_bf16)
            hv = mf_round_bf16(hv);
        h[c] = hv;
    }
}

/* Address of the scale of (e, t, g) for ROW_MAJOR / COLUMN_MAJOR; byte address for PACKED. */
static char *scale_addr(const mf_rows_args *a, int64_t e, int64_t t, int64_t g)
{
    switch (a->quant.scale_layout) {
    case MOEFUSE_SCALE_COLUMN_MAJOR: return mf_at3(&a->scales, e, g, t);
    case MOEFUSE_SCALE_PACKED_UE8M0: return mf_at3(&a->scales, e, g / 4, t) + (g % 4);
    case MOEFUSE_SCALE_ROW_MAJOR:
    default: return mf_at3(&a->scales, e, t, g);
    }
}

/* Write scale s (exponent byte ue when the scales hold exponents) of (e, t, g). */
static void put_scale(const mf_rows_args *a, int64_t e, int64_t t, int64_t g, float s, uint8_t ue)
{
    char *p = scale_addr(a, e, t, g);
    if (a->scales.dtype == MOEFUSE_F32)
        *(float *)p = s;
    else
        *(uint8_t *)p = ue; /* u8 tensor, or one byte of a packed i32 word */
}

/* Number of scale slots per row including the unused bytes of the last packed word. */
static int64_t scale_slots(const mf_rows_args *a)
{
    if (a->quant.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0)
        return (a->groups + 3) / 4 * 4;
    return a->groups;
}

static void zero_scales_row(const mf_rows_args *a, int64_t e, int64_t t)
{
    const int64_t slots = scale_slots(a);
    for (int64_t g = 0; g < slots; g++)
        put_scale(a, e, t, g, 0.0f, 0);
}

/* Quantize h[0..H) of row (e, t) into q and the scales. */
static void quantize_row(const mf_rows_args *a, int64_t e, int64_t t, const float *restrict h)
{
    const int64_t G = a->group, Gn = a->groups;
    const bool fp8 = a->out.dtype == MOEFUSE_F8_E4M3;
    const bool ue8m0 = a->quant.ue8m0 || a->quant.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0;
    const float eps = a->quant.eps;
    char *q = mf_at3(&a->out, e, t, 0);
    for (int64_t g = 0; g < Gn; g++) {
        const float *hg = h + g * G;
        float amax = 0.0f;
        MF_OMP(simd reduction(max : amax))
        for (int64_t c = 0; c < G; c++) {
            float v = hg[c];
            if (isfinite(v)) {
                float av = fabsf(v);
                amax = av > amax ? av : amax;
            }
        }
        amax = amax > eps ? amax : eps;
        float s = fp8 ? amax / 448.0f : amax / 127.0f;
        uint8_t ue = 0;
        if (ue8m0) {
            uint32_t ex = mf_ue8m0_exponent(s);
            ue = (uint8_t)ex;
            s = mf_ue8m0_value(ex);
        }
        if (fp8) {
            uint8_t *qg = (uint8_t *)q + g * G;
            MF_OMP(simd)
            for (int64_t c = 0; c < G; c++) {
                float v = hg[c];
                qg[c] = isfinite(v) ? mf_f32_to_e4m3(v / s) : mf_f32_to_e4m3(v);
            }
        } else {
            int8_t *qg = (int8_t *)q + g * G;
            for (int64_t c = 0; c < G; c++) {
                float v = hg[c];
                qg[c] = isfinite(v) ? mf_f32_to_i8(v / s) : mf_f32_to_i8(v);
            }
        }
        put_scale(a, e, t, g, s, ue);
    }
    for (int64_t g = Gn; g < scale_slots(a); g++) /* unused bytes of the last packed word */
        put_scale(a, e, t, g, 0.0f, 0);
}

static moefuse_status rows_run(moefuse_context *ctx, const mf_rows_args *a, enum row_mode mode,
                               const char *op)
{
    const int64_t E = a->experts, T = a->rows, H = a->hidden;
    const int nt = mf_cpu_max_threads();
    const size_t offs_bytes = (size_t)(E + 1) * sizeof(int64_t);
    const size_t per_thread = (size_t)(3 * H) * sizeof(float);
    const size_t bytes = offs_bytes + (size_t)nt * per_thread;
    char *mem = mf_cpu_alloc(bytes);
    if (mem == NULL)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes of scratch",
                        op, bytes);
    int64_t *offs = (int64_t *)mem;
    float *bufs = (float *)(mem + offs_bytes);
    offs[0] = 0;
    for (int64_t e = 0; e < E; e++)
        offs[e + 1] = offs[e] + valid_rows(a, e);
    const int64_t total = offs[E];

MF_OMP(parallel num_threads(nt))
    {
        float *xbuf = bufs + (size_t)mf_cpu_thread_id() * (size_t)(3 * H);
        float *h = xbuf + 2 * H;
MF_OMP(for schedule(static))
        for (int64_t i = 0; i < total; i++) {
            /* expert of flattened row i: last e with offs[e] <= i */
            int64_t lo = 0, hi = E - 1;
            while (lo < hi) {
                int64_t mid = (lo + hi + 1) / 2;
                if (offs[mid] <= i)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            const int64_t e = lo, t = i - offs[e];
            row_h(a, e, t, xbuf, h);
            if (mode == ROW_ACT_MUL)
                mf_store_row(mf_at3(&a->out, e, t, 0), h, a->out.dtype, H);
            else
                quantize_row(a, e, t, h);
        }

        if (mode == ROW_QUANT) {
            const bool padded = a->quant.scale_layout != MOEFUSE_SCALE_ROW_MAJOR;
MF_OMP(for schedule(dynamic, 1))
            for (int64_t e = 0; e < E; e++) {
                if (a->zero_tail && a->counts.data != NULL) {
                    for (int64_t t = offs[e + 1] - offs[e]; t < T; t++) {
                        memset(mf_at3(&a->out, e, t, 0), 0, (size_t)H);
                        zero_scales_row(a, e, t);
                    }
                }
                if (padded)
                    for (int64_t t = T; t < a->rows_padded; t++)
                        zero_scales_row(a, e, t);
            }
        }
    }
    mf_cpu_free(mem);
    return MOEFUSE_OK;
}

moefuse_status mf_cpu_act_quant(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    (void)state;
    return rows_run(ctx, a, ROW_QUANT, a->counts.data ? "act_quant_masked" : "act_quant");
}

moefuse_status mf_cpu_quant(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    (void)state;
    return rows_run(ctx, a, ROW_QUANT, "quant");
}

moefuse_status mf_cpu_act_mul(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    (void)state;
    return rows_run(ctx, a, ROW_ACT_MUL, "act_mul");
}
