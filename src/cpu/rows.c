/*
 * The row engine behind act_quant (2-D and masked), act_mul and quant: the
 * row kernels of the chosen instruction-set level (rows_isa.h; the scalar
 * reference is rows_ref.c) compute each row's h and round it to the output
 * dtype or quantize it group by group; this file hands out the rows and
 * writes the scales in the requested layout. Work is a flattened loop over the
 * valid (expert, row) pairs, so it scales with the number of valid tokens.
 */
#include "cpu/activation.h" /* mf_gate_at, mf_up_at */
#include "cpu/cpu_internal.h"
#include "cpu/numerics.h"
#include "cpu/rows_isa.h"
#include "cpu/tensor_cpu.h"

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

/* The plan of a call: what every row does. */
static mf_row_plan make_plan(const mf_rows_args *a, enum row_mode mode)
{
    mf_row_plan p = {0};
    p.hidden = a->hidden;
    p.group = mode == ROW_QUANT ? a->group : a->hidden;
    p.groups = mode == ROW_QUANT ? a->groups : 1;
    p.in_dtype = a->x.dtype;
    p.out_dtype = a->out.dtype;
    p.activate = a->activate;
    p.order = (int)a->act.order;
    p.activation = (int)a->act.activation;
    p.alpha = a->act.alpha;
    p.limit = a->act.limit;
    p.up_offset = a->act.up_offset;
    p.has_row_scale = a->row_scale.data != NULL;
    p.has_expert_scale = a->expert_scale.data != NULL;
    p.round_bf16 = a->act.intermediate == MOEFUSE_ROUND_BF16;
    p.ue8m0 = a->quant.ue8m0 || a->quant.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0;
    p.eps = a->quant.eps;
    if (p.activate && p.in_dtype == MOEFUSE_BF16)
        p.act_table = mf_cpu_act_table(p.activation);
    return p;
}

/* Address of the scale of (e, t, g) for ROW_MAJOR / COLUMN_MAJOR; byte address for PACKED.
 * Shared with the FP8 MoE (moe_fp8.c), whose h scales are written as quant writes them. */
char *mf_cpu_scale_addr(const moefuse_tensor *scales, moefuse_scale_layout layout, int64_t e,
                        int64_t t, int64_t g)
{
    switch (layout) {
    case MOEFUSE_SCALE_COLUMN_MAJOR: return mf_at3(scales, e, g, t);
    case MOEFUSE_SCALE_PACKED_UE8M0: return mf_at3(scales, e, g / 4, t) + (g % 4);
    case MOEFUSE_SCALE_ROW_MAJOR:
    default: return mf_at3(scales, e, t, g);
    }
}

/* Write scale s (exponent byte ue when the scales hold exponents) of (e, t, g). */
void mf_cpu_put_scale(const moefuse_tensor *scales, moefuse_scale_layout layout, int64_t e,
                      int64_t t, int64_t g, float s, uint8_t ue)
{
    char *p = mf_cpu_scale_addr(scales, layout, e, t, g);
    if (scales->dtype == MOEFUSE_F32)
        *(float *)p = s;
    else
        *(uint8_t *)p = ue; /* u8 tensor, or one byte of a packed i32 word */
}

int64_t mf_cpu_scale_slots(moefuse_scale_layout layout, int64_t groups)
{
    return layout == MOEFUSE_SCALE_PACKED_UE8M0 ? (groups + 3) / 4 * 4 : groups;
}

void mf_cpu_zero_scales_row(const moefuse_tensor *scales, moefuse_scale_layout layout,
                            int64_t groups, int64_t e, int64_t t)
{
    const int64_t slots = mf_cpu_scale_slots(layout, groups);
    for (int64_t g = 0; g < slots; g++)
        mf_cpu_put_scale(scales, layout, e, t, g, 0.0f, 0);
}

static void put_scale(const mf_rows_args *a, int64_t e, int64_t t, int64_t g, float s, uint8_t ue)
{
    mf_cpu_put_scale(&a->scales, a->quant.scale_layout, e, t, g, s, ue);
}

/* Number of scale slots per row including the unused bytes of the last packed word. */
static int64_t scale_slots(const mf_rows_args *a)
{
    return mf_cpu_scale_slots(a->quant.scale_layout, a->groups);
}

static void zero_scales_row(const mf_rows_args *a, int64_t e, int64_t t)
{
    mf_cpu_zero_scales_row(&a->scales, a->quant.scale_layout, a->groups, e, t);
}

/* Scratch of a row call: the row offsets of the experts, then per thread the row kernels'
 * floats (mf_row_scratch_floats) and the row's scales and exponent bytes. */
typedef struct rows_layout {
    size_t offs_bytes, per_thread, bytes;
} rows_layout;

static rows_layout rows_scratch(const mf_rows_args *a, enum row_mode mode, int threads)
{
    const mf_row_plan plan = make_plan(a, mode);
    rows_layout l;
    l.offs_bytes = (size_t)(a->experts + 1) * sizeof(int64_t);
    l.per_thread = ((size_t)(mf_row_scratch_floats(&plan) + plan.groups) * sizeof(float) +
                    (size_t)plan.groups + 63) /
                   64 * 64;
    l.bytes = l.offs_bytes + (size_t)threads * l.per_thread;
    return l;
}

moefuse_status mf_cpu_rows_workspace(moefuse_context *ctx, void *state, const mf_rows_args *a,
                                     size_t *bytes)
{
    (void)ctx;
    (void)state;
    /* act_mul writes floats, act_quant and quant codes */
    const bool codes = a->out.dtype == MOEFUSE_F8_E4M3 || a->out.dtype == MOEFUSE_I8;
    *bytes = rows_scratch(a, codes ? ROW_QUANT : ROW_ACT_MUL, mf_cpu_max_threads()).bytes;
    return MOEFUSE_OK;
}

/* The input streams of a row kernel on row x: gate and up halves (one stream, the whole
 * row, without an activation or with the interleaved order, whose kernels copy it apart). */
static int row_streams(const mf_row_plan *p, const char *x, const char **start, size_t *bytes)
{
    const size_t esz = mf_cpu_elem_size(p->in_dtype), half = (size_t)p->hidden * esz;
    if (!p->activate || p->order == MOEFUSE_GATE_INTERLEAVED) {
        start[0] = x;
        bytes[0] = p->activate ? 2 * half : half;
        return 1;
    }
    start[0] = x + (size_t)mf_gate_at(p->order, p->hidden) * esz;
    start[1] = x + (size_t)mf_up_at(p->order, p->hidden) * esz;
    bytes[0] = bytes[1] = half;
    return 2;
}

/*
 * Ask for the head of each input stream of row nx, the next this thread will likely take,
 * while row x runs: the kernels prefetch MF_ROW_PREFETCH_AHEAD bytes ahead of their channel,
 * so a stream's first bytes are only asked for when a stream of x runs past its end into
 * them. With gate and up halves, x's up half runs into the next row's gate half, and nothing
 * into its up half: one thread's act_quant at H=2048 took 3.5 ms, 2.6 with this.
 */
static void prefetch_row_heads(const mf_row_plan *p, const char *x, const char *nx)
{
    const char *cur[2], *next[2];
    size_t cur_n[2], next_n[2];
    const int nc = row_streams(p, x, cur, cur_n), nn = row_streams(p, nx, next, next_n);
    for (int s = 0; s < nn; s++) {
        bool covered = false;
        for (int c = 0; c < nc; c++)
            covered |= cur[c] + cur_n[c] == next[s];
        const size_t n = next_n[s] < MF_ROW_PREFETCH_AHEAD ? next_n[s] : MF_ROW_PREFETCH_AHEAD;
        for (size_t b = 0; !covered && b < n; b += 64)
            __builtin_prefetch(next[s] + b);
    }
}

static moefuse_status rows_run(moefuse_context *ctx, const mf_rows_args *a, enum row_mode mode,
                               const char *op)
{
    const int64_t E = a->experts, T = a->rows, H = a->hidden;
    const int nt = mf_cpu_max_threads();
    const mf_row_plan plan = make_plan(a, mode);
    const mf_cpu_row_kernels *kern = mf_cpu_row_kernels_active();
    const rows_layout lay = rows_scratch(a, mode, nt);
    mf_cpu_scratch scratch_mem;
    MF_TRY(mf_cpu_scratch_take(ctx, op, lay.bytes, &scratch_mem));
    char *mem = scratch_mem.mem;
    int64_t *offs = (int64_t *)mem;
    char *bufs = mem + lay.offs_bytes;
    const size_t per_thread = lay.per_thread;
    offs[0] = 0;
    for (int64_t e = 0; e < E; e++)
        offs[e + 1] = offs[e] + valid_rows(a, e);
    const int64_t total = offs[E];

MF_OMP(parallel num_threads(nt))
    {
        char *mine = (char *)bufs + (size_t)mf_cpu_thread_id() * per_thread;
        float *scratch = (float *)mine, *s = scratch + mf_row_scratch_floats(&plan);
        uint8_t *ue = (uint8_t *)(s + plan.groups);
MF_OMP(for schedule(dynamic, 16))
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
            const void *x = mf_at3(&a->x, e, t, 0);
            if (i + 1 < total) { /* row i + 1: expert e's next, or the next expert's first */
                int64_t e2 = e;
                while (offs[e2 + 1] <= i + 1)
                    e2++;
                prefetch_row_heads(&plan, x, mf_at3(&a->x, e2, i + 1 - offs[e2], 0));
            }
            const float rs = plan.has_row_scale ? *(const float *)mf_at2(&a->row_scale, e, t) : 1.0f;
            const float es = plan.has_expert_scale
                                 ? mf_load_elem(mf_at1(&a->expert_scale, e), a->expert_scale.dtype)
                                 : 1.0f;
            if (mode == ROW_ACT_MUL) {
                kern->act_mul_row(&plan, x, rs, es, mf_at3(&a->out, e, t, 0), scratch);
                continue;
            }
            kern->quant_row(&plan, x, rs, es, mf_at3(&a->out, e, t, 0), s, ue, scratch);
            for (int64_t g = 0; g < plan.groups; g++)
                put_scale(a, e, t, g, s[g], ue[g]);
            for (int64_t g = plan.groups; g < scale_slots(a); g++) /* unused packed bytes */
                put_scale(a, e, t, g, 0.0f, 0);
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
    mf_cpu_scratch_release(&scratch_mem);
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
