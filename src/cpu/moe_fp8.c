/*
 * moe_gate_fp8 and moe_final_fp8 (routed and masked layouts), the golden text of
 * docs/NUMERICS.md "FP8 MoE". The slots of each expert are processed in tiles of TILE rows
 * against one 128-row block of weight rows (the final) or one gate block and its up block
 * (the gate: one group of 128 h channels, so the item quantizes h itself). Each output is
 * written by exactly one work item and its blocks are added in order b = 0, 1, ..., so the
 * results do not depend on the thread count or the schedule.
 *
 * Block sums are exact in double: an e4m3 value is a multiple of 2^-9 below 2^9, a product
 * a multiple of 2^-18 below 2^18, and 128 of them sum below 2^25, 43 bits in all, so the
 * double additions never round, in any order (the vectorised reduction reorders freely).
 */
#include "cpu/activation.h"
#include "cpu/cpu_internal.h"
#include "cpu/moe_slots.h"
#include "cpu/numerics.h"
#include "cpu/rows_isa.h"
#include "cpu/tensor_cpu.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

enum {
    BLK = 128, /* weight block rows and depth; activation group width */
    TILE = 32, /* slots per work item */
};

/* Bytes of f32 y scratch the reduced final may use per chunk of tokens (as moe.c). */
#define FP8_FINAL_SCRATCH_BYTES ((size_t)64 << 20)

static size_t round64(size_t n) { return (n + 63) / 64 * 64; }

/* ------------------------------------------------------------ operand access */

/* Masked layout: the valid rows of expert e, its count clamped to [0, Tmax]. */
static int64_t masked_rows(const mf_moe_args *a, int64_t e)
{
    const int64_t n = *(const int32_t *)mf_at1(&a->counts, e);
    return n < 0 ? 0 : (n > a->tokens ? a->tokens : n);
}

static moefuse_scale_layout act_layout(const mf_moe_args *a) { return a->act.scale_layout; }

/* Value of a stored activation group scale: the f32, or 2^(e-127) of an exponent byte. */
static float read_act_scale(const mf_moe_args *a, const moefuse_tensor *sc, int64_t e, int64_t t,
                            int64_t g)
{
    const char *p = mf_cpu_scale_addr(sc, act_layout(a), e, t, g);
    return sc->dtype == MOEFUSE_F32 ? *(const float *)p : mf_ue8m0_read(*(const uint8_t *)p);
}

/* Value of the weight block scale [e, rb, db]. */
static float read_weight_scale(const moefuse_tensor *sc, int64_t e, int64_t rb, int64_t db)
{
    const char *p = mf_at3(sc, e, rb, db);
    return sc->dtype == MOEFUSE_F32 ? *(const float *)p : mf_ue8m0_read(*(const uint8_t *)p);
}

/*
 * A slot is a row of the activation operand: routed s = m * k + j (x row m, h row (m, j),
 * scale row s of h); masked r = e * Tmax + t (row (e, t) of x, h and out).
 */
static void slot_coords(const mf_moe_args *a, int64_t slot, int64_t *i0, int64_t *i1)
{
    const int64_t per = a->masked ? a->tokens : a->topk;
    *i0 = slot / per;
    *i1 = slot % per;
}

/* ----------------------------------------------------------------- the plan */

/* Routed: slots [s0, s1) of the valid ones (moe_slots.c). Masked: rows t < n[e] of every
 * expert, slot e * Tmax + t. */
static void plan_slots(const mf_moe_args *a, mf_slot_plan *p, int64_t s0, int64_t s1,
                       int64_t col_blocks)
{
    const int64_t E = a->experts;
    if (!a->masked) {
        mf_slot_plan_group(p, E, s0, s1, TILE, col_blocks);
        return;
    }
    p->start[0] = p->items[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = masked_rows(a, e);
        for (int64_t t = 0; t < n; t++)
            p->list[p->start[e] + t] = e * a->tokens + t;
        p->start[e + 1] = p->start[e] + n;
        p->items[e + 1] = p->items[e] + (n + TILE - 1) / TILE * col_blocks;
    }
    p->col_blocks = col_blocks;
}

/* -------------------------------------------------------------- the scratch */

/* Per thread: decoded operands of one depth block, the accumulators, h rows. */
typedef struct thread_bufs {
    double *a_blk;  /* [TILE][BLK] activation values of the block */
    double *w_blk;  /* [2 * BLK][BLK] weight values of the block */
    float *acc;     /* [TILE][2 * BLK] */
    float *a_scale; /* [TILE][D / BLK] group scales of the tile's rows */
    const uint8_t **a_rows; /* [TILE] code rows */
    float *row;     /* max(D, BLK) floats: y of one row (the final) */
    float *qtmp;    /* max(3 max(K, BLK), 5 BLK) + groups floats, then groups bytes: the
                     * quantizer's */
} thread_bufs;

typedef struct work {
    mf_cpu_scratch scratch;
    mf_slot_plan p;
    double *value;  /* [256] e4m3 code -> value (NaN codes NaN) */
    uint8_t *xq;    /* gate, x not f8: codes [rows, K] */
    float *xs;      /* and their group scales [rows, K / BLK] */
    float *y;       /* reduced final: [chunk * k, K] */
    int64_t chunk;  /* tokens per chunk (reduced final) */
    char *thread_mem;
    size_t thread_stride;
    int nt;
} work;

typedef enum step { STEP_GATE, STEP_FINAL } step;

static bool quantizes_x(const mf_moe_args *a, step st)
{
    return st == STEP_GATE && a->x.dtype != MOEFUSE_F8_E4M3;
}

/* Rows of the activation operand's own indexing: x rows (routed M) or E * Tmax (masked). */
static int64_t x_rows(const mf_moe_args *a) { return a->masked ? a->experts * a->tokens : a->tokens; }

static int64_t slot_count(const mf_moe_args *a)
{
    return a->masked ? a->experts * a->tokens : a->tokens * a->topk;
}

/* The sizes of w's parts for this call and the bytes they take together (the workspace). */
static size_t work_layout(const mf_moe_args *a, step st, work *w)
{
    const int64_t S = slot_count(a), E = a->experts, K = a->model_dim, k = a->topk;
    const int64_t depth = st == STEP_GATE ? K : a->inter_dim;
    const int64_t widest = K > BLK ? K : BLK;
    /* the quantizer's scratch: x rows of K (3 K), or the gate's interleaved [g, u] rows of
     * BLK taken apart first (5 BLK, rows_isa.h) */
    const int64_t qfloats = 3 * widest > 5 * BLK ? 3 * widest : 5 * BLK;
    w->nt = mf_cpu_max_threads();
    w->chunk = a->tokens > 0 ? a->tokens : 1;
    const bool need_y = st == STEP_FINAL && a->reduce;
    if (need_y && K > 0 && k > 0) {
        int64_t c = (int64_t)(FP8_FINAL_SCRATCH_BYTES / ((size_t)k * (size_t)K * sizeof(float)));
        c = c < 1 ? 1 : c;
        w->chunk = c < w->chunk ? c : w->chunk;
    }
    w->thread_stride = round64((size_t)TILE * BLK * 8) + round64((size_t)2 * BLK * BLK * 8) +
                       round64((size_t)TILE * 2 * BLK * 4) +
                       round64((size_t)TILE * (size_t)(depth / BLK) * 4) +
                       round64((size_t)TILE * sizeof(void *)) + round64((size_t)widest * 4) +
                       round64((size_t)(qfloats + K / BLK) * 4 + (size_t)(K / BLK));
    size_t bytes = round64(256 * 8) + mf_slot_plan_bytes(S, E);
    if (quantizes_x(a, st))
        bytes += round64((size_t)(x_rows(a) * K)) + round64((size_t)(x_rows(a) * (K / BLK)) * 4);
    if (need_y)
        bytes += round64((size_t)(w->chunk * k * K) * 4);
    return bytes + (size_t)w->nt * w->thread_stride;
}

static moefuse_status work_alloc(moefuse_context *ctx, const char *op, const mf_moe_args *a,
                                 step st, work *w)
{
    const int64_t S = slot_count(a), E = a->experts, K = a->model_dim, k = a->topk;
    MF_TRY(mf_cpu_scratch_take(ctx, op, work_layout(a, st, w), &w->scratch));
    char *q = w->scratch.mem;
    w->value = (double *)q, q += round64(256 * 8);
    q = mf_slot_plan_place(&w->p, q, S, E);
    w->xq = NULL;
    w->xs = NULL;
    if (quantizes_x(a, st)) {
        w->xq = (uint8_t *)q, q += round64((size_t)(x_rows(a) * K));
        w->xs = (float *)q, q += round64((size_t)(x_rows(a) * (K / BLK)) * 4);
    }
    w->y = NULL;
    if (st == STEP_FINAL && a->reduce) {
        w->y = (float *)q;
        q += round64((size_t)(w->chunk * k * K) * 4);
    }
    w->thread_mem = q;
    for (int c = 0; c < 256; c++)
        w->value[c] = (double)mf_e4m3_to_f32((uint8_t)c); /* exact; NaN codes stay NaN */
    if (!a->masked)
        mf_slot_plan_experts(&w->p, a);
    return MOEFUSE_OK;
}

static thread_bufs thread_scratch(const work *w, int64_t depth, int64_t K)
{
    const int64_t widest = K > BLK ? K : BLK;
    thread_bufs t;
    char *q = w->thread_mem + (size_t)mf_cpu_thread_id() * w->thread_stride;
    t.a_blk = (double *)q, q += round64((size_t)TILE * BLK * 8);
    t.w_blk = (double *)q, q += round64((size_t)2 * BLK * BLK * 8);
    t.acc = (float *)q, q += round64((size_t)TILE * 2 * BLK * 4);
    t.a_scale = (float *)q, q += round64((size_t)TILE * (size_t)(depth / BLK) * 4);
    t.a_rows = (const uint8_t **)q, q += round64((size_t)TILE * sizeof(void *));
    t.row = (float *)q, q += round64((size_t)widest * 4);
    t.qtmp = (float *)q;
    return t;
}

/* The plan of the quantizer for rows of `width` values of dtype `in` (activation groups). */
static mf_row_plan quant_plan(const mf_moe_args *a, moefuse_dtype in, int64_t width)
{
    mf_row_plan p = {0};
    p.hidden = width;
    p.group = BLK;
    p.groups = width / BLK;
    p.in_dtype = in;
    p.out_dtype = MOEFUSE_F8_E4M3;
    p.activate = false;
    p.ue8m0 = a->act.ue8m0 || a->act.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0;
    p.eps = a->act.eps;
    return p;
}

/* ------------------------------------------------------------- block GEMM */

/*
 * acc[i][r] for the ms slots of a tile and nrb blocks of 128 weight rows (block rows rb[q]
 * of expert e in w [E, N, D]): for each depth block b in order, p = the exact block sum
 * rounded once to f32, acc = fmaf(p, sa * sw, acc). a_rows / a_scale hold the tile's code
 * rows and group scales.
 */
static void block_gemm(const work *wk, thread_bufs *t, int64_t ms, const moefuse_tensor *w,
                       const moefuse_tensor *w_scales, int64_t e, const int64_t *rb, int nrb,
                       int64_t depth)
{
    const double *value = wk->value;
    const int64_t nb = depth / BLK, nr = (int64_t)nrb * BLK;
    for (int64_t i = 0; i < ms * nr; i++)
        t->acc[i] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t i = 0; i < ms; i++) {
            const uint8_t *src = t->a_rows[i] + b * BLK;
            double *dst = t->a_blk + i * BLK;
            for (int64_t c = 0; c < BLK; c++)
                dst[c] = value[src[c]];
        }
        float sw[2];
        for (int q = 0; q < nrb; q++) {
            sw[q] = read_weight_scale(w_scales, e, rb[q], b);
            for (int64_t r = 0; r < BLK; r++) {
                const uint8_t *src = (const uint8_t *)mf_at3(w, e, rb[q] * BLK + r, b * BLK);
                double *dst = t->w_blk + (q * BLK + r) * BLK;
                for (int64_t c = 0; c < BLK; c++)
                    dst[c] = value[src[c]];
            }
        }
        for (int64_t i = 0; i < ms; i++) {
            const double *av = t->a_blk + i * BLK;
            const float sa = t->a_scale[i * nb + b];
            float *acc = t->acc + i * nr;
            for (int q = 0; q < nrb; q++) {
                const float scale = sa * sw[q];
                for (int64_t r = q * BLK; r < (q + 1) * BLK; r++) {
                    const double *wv = t->w_blk + r * BLK;
                    double sum = 0.0;
MF_OMP(simd reduction(+ : sum))
                    for (int64_t c = 0; c < BLK; c++)
                        sum += av[c] * wv[c];
                    acc[r] = fmaf((float)sum, scale, acc[r]);
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ gate */

/* The gate's activation rows: x's codes (given, or quantized into the scratch). */
static void gate_tile_rows(const mf_moe_args *a, const work *wk, thread_bufs *t,
                           const int64_t *slots, int64_t ms)
{
    const int64_t K = a->model_dim, nb = K / BLK;
    for (int64_t i = 0; i < ms; i++) {
        int64_t i0, i1;
        slot_coords(a, slots[i], &i0, &i1);
        /* x row: routed m = i0, masked (e, t) = (i0, i1) */
        const int64_t xr = a->masked ? slots[i] : i0;
        float *sa = t->a_scale + i * nb;
        if (wk->xq) {
            t->a_rows[i] = wk->xq + xr * K;
            memcpy(sa, wk->xs + xr * nb, (size_t)nb * sizeof(float));
            continue;
        }
        t->a_rows[i] = (const uint8_t *)(a->masked ? mf_at3(&a->x, i0, i1, 0) : mf_at2(&a->x, i0, 0));
        for (int64_t g = 0; g < nb; g++)
            sa[g] = a->masked ? read_act_scale(a, &a->x_scales, i0, i1, g)
                              : read_act_scale(a, &a->x_scales, 0, i0, g);
    }
}

/* Where slot's h row and its scales lie: h (i0, i1), scale row (lead, row). */
static void h_coords(const mf_moe_args *a, int64_t slot, int64_t *i0, int64_t *i1, int64_t *lead,
                     int64_t *row)
{
    slot_coords(a, slot, i0, i1);
    *lead = a->masked ? *i0 : 0;
    *row = a->masked ? *i1 : slot;
}

/* One gate work item: h channels [g * 128, g * 128 + 128) of a tile of expert e's slots. */
static void gate_item(const mf_moe_args *a, const work *wk, thread_bufs *t, int64_t e,
                      const int64_t *slots, int64_t ms, int64_t g)
{
    const int64_t I = a->inter_dim, c0 = g * BLK;
    /* w1 / b1 rows of h column i: gate_row + i * step and up_row + i * step. The tile's 256
     * rows are two blocks of 128: the gate rows then the up rows of the group's columns, or,
     * interleaved, rows 2 c0 .. 2 c0 + 255, gate and up alternating */
    const int order = (int)a->opt.order;
    const int64_t gate_row = mf_gate_at(order, I), up_row = mf_up_at(order, I);
    const int64_t step = mf_gate_step(order);
    const bool interleaved = order == MOEFUSE_GATE_INTERLEAVED;
    const int64_t rb[2] = {interleaved ? 2 * g : (gate_row + c0) / BLK,
                           interleaved ? 2 * g + 1 : (up_row + c0) / BLK};
    /* where the tile keeps gate and up of column c: at tile_gate + c * step, tile_up + ... */
    const int tile_order = interleaved ? MOEFUSE_GATE_INTERLEAVED : MOEFUSE_GATE_FIRST;
    const int64_t tile_gate = mf_gate_at(tile_order, BLK), tile_up = mf_up_at(tile_order, BLK);
    gate_tile_rows(a, wk, t, slots, ms);
    block_gemm(wk, t, ms, &a->w1, &a->w1_scales, e, rb, 2, a->model_dim);

    /* h of the tile row's [g + b, u + b] in the tile's order, quantized in the same pass by
     * the row kernels' act_quant (no factors, no rounding of h) */
    mf_row_plan hq = quant_plan(a, MOEFUSE_F32, BLK);
    mf_slot_gate_act(&hq, a, tile_order);
    const mf_cpu_row_kernels *kern = mf_cpu_row_kernels_active();
    const bool bias = a->b1.data != NULL;
    const int64_t groups = I / BLK;
    for (int64_t i = 0; i < ms; i++) {
        float *tile = t->acc + i * 2 * BLK;
        if (bias)
            for (int64_t c = 0; c < BLK; c++) {
                float *gv = tile + tile_gate + c * step, *uv = tile + tile_up + c * step;
                *gv = *gv + mf_load_elem(mf_at2(&a->b1, e, gate_row + (c0 + c) * step),
                                         a->b1.dtype);
                *uv = *uv + mf_load_elem(mf_at2(&a->b1, e, up_row + (c0 + c) * step),
                                         a->b1.dtype);
            }
        int64_t i0, i1, lead, row;
        h_coords(a, slots[i], &i0, &i1, &lead, &row);
        float s;
        uint8_t ue;
        kern->quant_row(&hq, tile, 1.0f, 1.0f, mf_at3(&a->h, i0, i1, c0), &s, &ue, t->qtmp);
        mf_cpu_put_scale(&a->h_scales, act_layout(a), lead, row, g, s, ue);
        if (g == groups - 1) /* the unused bytes of the row's last packed word */
            for (int64_t u = groups; u < mf_cpu_scale_slots(act_layout(a), groups); u++)
                mf_cpu_put_scale(&a->h_scales, act_layout(a), lead, row, u, 0.0f, 0);
    }
}

/* x's codes and scales in the scratch, for the rows the gate reads, exactly as quant. */
static void quantize_x_rows(const mf_moe_args *a, work *w)
{
    const int64_t K = a->model_dim, nb = K / BLK, rows = x_rows(a);
    const mf_row_plan qp = quant_plan(a, a->x.dtype, K);
    const mf_cpu_row_kernels *kern = mf_cpu_row_kernels_active();
MF_OMP(parallel num_threads(w->nt))
    {
        thread_bufs t = thread_scratch(w, K, K);
        uint8_t *ue = (uint8_t *)(t.qtmp + 3 * K + nb);
MF_OMP(for schedule(dynamic, 8))
        for (int64_t r = 0; r < rows; r++) {
            const int64_t e = a->masked ? r / a->tokens : 0, tt = a->masked ? r % a->tokens : r;
            if (a->masked && tt >= masked_rows(a, e))
                continue; /* only the valid rows are quantized */
            const void *x = a->masked ? mf_at3(&a->x, e, tt, 0) : mf_at2(&a->x, r, 0);
            kern->quant_row(&qp, x, 1.0f, 1.0f, w->xq + r * K, w->xs + r * nb, ue, t.qtmp);
        }
    }
}

moefuse_status mf_cpu_moe_gate_fp8_workspace(moefuse_context *ctx, void *state,
                                             const mf_moe_args *a, size_t *bytes)
{
    (void)ctx;
    (void)state;
    work w;
    *bytes = work_layout(a, STEP_GATE, &w);
    return MOEFUSE_OK;
}

moefuse_status mf_cpu_moe_gate_fp8(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    (void)state;
    work w;
    MF_TRY(work_alloc(ctx, "moe_gate_fp8", a, STEP_GATE, &w));
    const int64_t I = a->inter_dim, E = a->experts, S = slot_count(a), groups = I / BLK;
    const int64_t lead_n = a->masked ? E : 1, scale_rows = a->masked ? a->tokens : S;
    const int64_t padded = (scale_rows + 3) / 4 * 4;
    if (w.xq)
        quantize_x_rows(a, &w);
    plan_slots(a, &w.p, 0, a->masked ? 0 : S, groups);
    const int64_t n_items = w.p.items[E];

MF_OMP(parallel num_threads(w.nt))
    {
        thread_bufs t = thread_scratch(&w, a->model_dim, a->model_dim);
        if (!a->masked) { /* invalid slots: codes 0, scale bytes 0 */
MF_OMP(for schedule(static))
            for (int64_t s = 0; s < S; s++)
                if (w.p.expert_of[s] < 0) {
                    memset(mf_at3(&a->h, s / a->topk, s % a->topk, 0), 0, (size_t)I);
                    mf_cpu_zero_scales_row(&a->h_scales, act_layout(a), groups, 0, s);
                }
        }
        if (act_layout(a) != MOEFUSE_SCALE_ROW_MAJOR) { /* padding rows, as quant */
MF_OMP(for schedule(static))
            for (int64_t e = 0; e < lead_n; e++)
                for (int64_t r = scale_rows; r < padded; r++)
                    mf_cpu_zero_scales_row(&a->h_scales, act_layout(a), groups, e, r);
        }
MF_OMP(for schedule(dynamic, 1))
        for (int64_t it = 0; it < n_items; it++) {
            int64_t e, ms, cb;
            const int64_t *slots;
            mf_slot_plan_item(&w.p, E, it, &e, &slots, &ms, &cb);
            gate_item(a, &w, &t, e, slots, ms, cb);
        }
    }
    mf_cpu_scratch_release(&w.scratch);
    return MOEFUSE_OK;
}

/* ----------------------------------------------------------------- final */

/* One final work item: y columns [cb * 128, cb * 128 + 128) of a tile of expert e's slots,
 * into the f32 scratch (reduced; rows relative to slot s0) or straight to out. */
static void final_item(const mf_moe_args *a, const work *wk, thread_bufs *t, int64_t e,
                       const int64_t *slots, int64_t ms, int64_t cb, int64_t s0)
{
    const int64_t K = a->model_dim, nb = a->inter_dim / BLK, r0 = cb * BLK;
    for (int64_t i = 0; i < ms; i++) {
        int64_t i0, i1, lead, row;
        h_coords(a, slots[i], &i0, &i1, &lead, &row);
        t->a_rows[i] = (const uint8_t *)mf_at3(&a->h, i0, i1, 0);
        for (int64_t g = 0; g < nb; g++)
            t->a_scale[i * nb + g] = read_act_scale(a, &a->h_scales, lead, row, g);
    }
    block_gemm(wk, t, ms, &a->w2, &a->w2_scales, e, &cb, 1, a->inter_dim);
    for (int64_t i = 0; i < ms; i++) {
        float *dst = wk->y ? wk->y + (slots[i] - s0) * K + r0 : t->row;
        mf_slot_add_bias(dst, t->acc + i * BLK, &a->b2, e, r0, BLK);
        if (!wk->y) {
            int64_t i0, i1;
            slot_coords(a, slots[i], &i0, &i1);
            mf_store_row(mf_at3(&a->out, i0, i1, r0), dst, a->out.dtype, BLK);
        }
    }
}

moefuse_status mf_cpu_moe_final_fp8_workspace(moefuse_context *ctx, void *state,
                                              const mf_moe_args *a, size_t *bytes)
{
    (void)ctx;
    (void)state;
    work w;
    *bytes = work_layout(a, STEP_FINAL, &w);
    return MOEFUSE_OK;
}

moefuse_status mf_cpu_moe_final_fp8(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    (void)state;
    work w;
    MF_TRY(work_alloc(ctx, "moe_final_fp8", a, STEP_FINAL, &w));
    const int64_t M = a->tokens, k = a->topk, K = a->model_dim, E = a->experts;
    const int64_t col_blocks = K / BLK;
    const size_t osz = mf_cpu_elem_size(a->out.dtype);
    /* the masked layout is one chunk: its slots are not tokens */
    const int64_t chunk = a->masked ? 1 : w.chunk, n_chunks = a->masked ? 1 : M;

    for (int64_t m0 = 0; m0 < n_chunks; m0 += chunk) {
        const int64_t m1 = n_chunks - m0 < chunk ? n_chunks : m0 + chunk;
        const int64_t s0 = a->masked ? 0 : m0 * k;
        plan_slots(a, &w.p, s0, a->masked ? 0 : m1 * k, col_blocks);
        const int64_t n_items = w.p.items[E];
MF_OMP(parallel num_threads(w.nt))
        {
            thread_bufs t = thread_scratch(&w, a->inter_dim, K);
            if (!a->masked && !a->reduce)
                mf_slot_zero_invalid(&w.p, &a->out, k, s0, m1 * k, (size_t)K * osz);
MF_OMP(for schedule(dynamic, 1))
            for (int64_t it = 0; it < n_items; it++) {
                int64_t e, ms, cb;
                const int64_t *slots;
                mf_slot_plan_item(&w.p, E, it, &e, &slots, &ms, &cb);
                final_item(a, &w, &t, e, slots, ms, cb, s0);
            }
            if (a->reduce)
                mf_slot_reduce_tokens(a, &w.p, w.y, m0, m1, s0, t.row);
        }
    }
    mf_cpu_scratch_release(&w.scratch);
    return MOEFUSE_OK;
}
