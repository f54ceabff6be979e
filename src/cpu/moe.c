/*
 * moe_gate and moe_final: slots (m, j) are grouped by local expert, then each
 * expert's slots are processed in tiles of at most MB rows (an expert's of near-equal
 * size) against blocks of NB weight rows (work items spread over threads). Each output
 * is written by exactly one work item, and its dot product is accumulated in a fixed
 * order (gemm.h), so results do not depend on the thread count or the schedule.
 */
#include "cpu/activation.h" /* mf_gate_at, mf_up_at, mf_gate_step */
#include "cpu/cpu_internal.h"
#include "cpu/gemm.h"
#include "cpu/moe_slots.h"
#include "cpu/numerics.h"
#include "cpu/rows_isa.h"
#include "cpu/tensor_cpu.h"

#include <stdbool.h>
#include <string.h>

enum { MB = MF_GEMM_MB, NB = MF_GEMM_NB, NR = MF_GEMM_NR, KC = MF_GEMM_KC };

/* Bytes of f32 y scratch moe_final may use per chunk of tokens (reduced output). */
#define MF_FINAL_SCRATCH_BYTES ((size_t)64 << 20)

/* Scratch of one call: plan arrays, per-thread GEMM buffers, optional y. */
typedef struct work {
    mf_cpu_scratch scratch;
    mf_slot_plan p;
    char *thread_mem;
    size_t thread_stride;
    float *y;      /* f32 [chunk slots, K] (reduced final only) */
    int64_t chunk; /* tokens per chunk */
    int nt;
} work;

typedef struct thread_bufs {
    mf_gemm_scratch g;
    float *c;      /* MB x NB */
    int64_t *cols; /* NB weight row ids */
    float *row;    /* max(2 NB, K) floats */
} thread_bufs;

static size_t round64(size_t n) { return (n + 63) / 64 * 64; }

/* The sizes of w's parts for this call, and the bytes they take together. */
static size_t work_layout(const mf_moe_args *a, bool need_y, work *w)
{
    const int64_t M = a->tokens, k = a->topk, E = a->experts, K = a->model_dim;
    const int64_t S = M * k;
    w->nt = mf_cpu_max_threads();
    w->chunk = M > 0 ? M : 1;
    if (need_y && K > 0 && k > 0) {
        int64_t c = (int64_t)(MF_FINAL_SCRATCH_BYTES / ((size_t)k * (size_t)K * sizeof(float)));
        c = c < 1 ? 1 : c;
        w->chunk = c < w->chunk ? c : w->chunk;
    }
    /* the final's y rows (K); the gate's act_mul scratch (3 x NB / 2, rows_isa.h) */
    const int64_t rowlen = K > 2 * NB ? K : 2 * NB;
    w->thread_stride = round64((size_t)MF_GEMM_A_PACK * 4) + round64((size_t)NB * KC * 4) +
                       round64((size_t)NR * KC * 4) + round64((size_t)MB * NB * 4) +
                       round64((size_t)NB * 8) + round64((size_t)rowlen * 4);
    const size_t plan_bytes = mf_slot_plan_bytes(S, E);
    const size_t y_bytes = need_y ? round64((size_t)(w->chunk * k * K) * 4) : 0;
    return plan_bytes + y_bytes + (size_t)w->nt * w->thread_stride;
}

moefuse_status mf_cpu_moe_gate_workspace(moefuse_context *ctx, void *state, const mf_moe_args *a,
                                         size_t *bytes)
{
    (void)ctx;
    (void)state;
    work w;
    *bytes = work_layout(a, false, &w);
    return MOEFUSE_OK;
}

moefuse_status mf_cpu_moe_final_workspace(moefuse_context *ctx, void *state,
                                          const mf_moe_args *a, size_t *bytes)
{
    (void)ctx;
    (void)state;
    work w;
    *bytes = work_layout(a, a->reduce, &w);
    return MOEFUSE_OK;
}

static moefuse_status work_alloc(moefuse_context *ctx, const char *op, const mf_moe_args *a,
                                 bool need_y, work *w)
{
    const int64_t M = a->tokens, k = a->topk, E = a->experts, K = a->model_dim;
    const int64_t S = M * k;
    const size_t bytes = work_layout(a, need_y, w);
    MF_TRY(mf_cpu_scratch_take(ctx, op, bytes, &w->scratch));
    char *q = w->scratch.mem;
    q = mf_slot_plan_place(&w->p, q, S, E);
    w->y = need_y ? (float *)q : NULL;
    q += need_y ? round64((size_t)(w->chunk * k * K) * 4) : 0;
    w->thread_mem = q;
    mf_slot_plan_experts(&w->p, a);
    return MOEFUSE_OK;
}

static thread_bufs thread_scratch(const work *w)
{
    thread_bufs t;
    char *q = w->thread_mem + (size_t)mf_cpu_thread_id() * w->thread_stride;
    t.g.a_pack = (float *)q, q += round64((size_t)MF_GEMM_A_PACK * 4);
    t.g.b_pack = (float *)q, q += round64((size_t)NB * KC * 4);
    t.g.tmp = (float *)q, q += round64((size_t)NR * KC * 4);
    t.g.a_from = NULL; /* a new call: nothing widened yet */
    t.c = (float *)q, q += round64((size_t)MB * NB * 4);
    t.cols = (int64_t *)q, q += round64((size_t)NB * 8);
    t.row = (float *)q;
    return t;
}

/* ------------------------------------------------------------------ gate */

/* One work item of the gate: h columns [i0, i0+nb) of one slot tile of expert e. */
static void gate_item(const mf_moe_args *a, int64_t e, const int64_t *slots, int64_t ms,
                      int64_t cb, thread_bufs *t)
{
    const int64_t I = a->inter_dim, half = NB / 2;
    const int64_t i0 = cb * half, nb = I - i0 < half ? I - i0 : half;
    const int64_t nbp = (nb + NR - 1) / NR * NR; /* gate columns [0, nbp), up [nbp, 2 nbp) */
    /* w1 / b1 rows of h column i: gate_row + i * step and up_row + i * step */
    const int order = (int)a->opt.order;
    const int64_t gate_row = mf_gate_at(order, I), up_row = mf_up_at(order, I);
    const int64_t step = mf_gate_step(order);
    for (int64_t c = 0; c < nbp; c++) {
        t->cols[c] = c < nb ? gate_row + (i0 + c) * step : -1;
        t->cols[nbp + c] = c < nb ? up_row + (i0 + c) * step : -1;
    }
    mf_gemm_tile(&a->x, 0, a->topk, slots, ms, &a->w1, e, t->cols, 2 * nbp, a->model_dim, t->c,
                 &t->g);
    /* h = act(g) * u by the row kernels' act_mul over each tile row, made [g + b | u + b] of
     * nb values each, rounded once to h's dtype */
    mf_row_plan act = {0};
    act.hidden = nb;
    act.in_dtype = MOEFUSE_F32;
    act.out_dtype = a->h.dtype;
    mf_slot_gate_act(&act, a, MOEFUSE_GATE_FIRST);
    const mf_cpu_row_kernels *kern = mf_cpu_row_kernels_active();
    const int64_t ldc = 2 * nbp;
    const bool bias = a->b1.data != NULL;
    for (int64_t r = 0; r < ms; r++) {
        float *cg = t->c + r * ldc, *cu = cg + nbp;
        if (bias)
            for (int64_t c = 0; c < nb; c++) {
                cg[c] = cg[c] + mf_load_elem(mf_at2(&a->b1, e, t->cols[c]), a->b1.dtype);
                cu[c] = cu[c] + mf_load_elem(mf_at2(&a->b1, e, t->cols[nbp + c]), a->b1.dtype);
            }
        if (nbp != nb) /* the up values right after the gate values */
            memmove(cg + nb, cu, (size_t)nb * sizeof(float));
        const int64_t s = slots[r];
        kern->act_mul_row(&act, cg, 1.0f, 1.0f, mf_at3(&a->h, s / a->topk, s % a->topk, i0),
                          t->row);
    }
}

moefuse_status mf_cpu_moe_gate(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    (void)state;
    work w;
    moefuse_status st = work_alloc(ctx, "moe_gate", a, false, &w);
    if (st != MOEFUSE_OK)
        return st;
    const int64_t M = a->tokens, k = a->topk, I = a->inter_dim, E = a->experts;
    const int64_t col_blocks = (I + NB / 2 - 1) / (NB / 2);
    mf_slot_plan_group(&w.p, E, 0, M * k, MB, col_blocks);
    const int64_t n_items = E > 0 ? w.p.items[E] : 0;
    const size_t hsz = mf_cpu_elem_size(a->h.dtype);

MF_OMP(parallel num_threads(w.nt))
    {
        thread_bufs t = thread_scratch(&w);
        mf_slot_zero_invalid(&w.p, &a->h, k, 0, M * k, (size_t)I * hsz);
MF_OMP(for schedule(dynamic, 1))
        for (int64_t it = 0; it < n_items; it++) {
            int64_t e, ms, cb;
            const int64_t *slots;
            mf_slot_plan_item(&w.p, E, it, &e, &slots, &ms, &cb);
            gate_item(a, e, slots, ms, cb, &t);
        }
    }
    mf_cpu_scratch_release(&w.scratch);
    return MOEFUSE_OK;
}

/* ----------------------------------------------------------------- final */

/* One work item of final: y columns [r0, r0+nb) of one slot tile; y goes to the
 * f32 scratch (rows relative to slot s0) or, un-reduced, straight to out. */
static void final_item(const mf_moe_args *a, int64_t e, const int64_t *slots, int64_t ms,
                       int64_t cb, thread_bufs *t, float *y, int64_t s0)
{
    const int64_t K = a->model_dim, r0 = cb * NB, nb = K - r0 < NB ? K - r0 : NB;
    const int64_t nbp = (nb + NR - 1) / NR * NR;
    for (int64_t c = 0; c < nbp; c++)
        t->cols[c] = c < nb ? r0 + c : -1;
    mf_gemm_tile(&a->h, 1, a->topk, slots, ms, &a->w2, e, t->cols, nbp, a->inter_dim, t->c,
                 &t->g);
    for (int64_t r = 0; r < ms; r++) {
        const int64_t s = slots[r];
        float *dst = y ? y + (s - s0) * K + r0 : t->row;
        mf_slot_add_bias(dst, t->c + r * nbp, &a->b2, e, r0, nb);
        if (!y)
            mf_store_row(mf_at3(&a->out, s / a->topk, s % a->topk, r0), dst, a->out.dtype, nb);
    }
}

moefuse_status mf_cpu_moe_final(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    (void)state;
    work w;
    moefuse_status st = work_alloc(ctx, "moe_final", a, a->reduce, &w);
    if (st != MOEFUSE_OK)
        return st;
    const int64_t M = a->tokens, k = a->topk, K = a->model_dim, E = a->experts;
    const int64_t col_blocks = (K + NB - 1) / NB;
    const size_t osz = mf_cpu_elem_size(a->out.dtype);

    for (int64_t m0 = 0; m0 < M; m0 += w.chunk) {
        const int64_t m1 = M - m0 < w.chunk ? M : m0 + w.chunk;
        const int64_t s0 = m0 * k;
        mf_slot_plan_group(&w.p, E, s0, m1 * k, MB, col_blocks);
        const int64_t n_items = E > 0 ? w.p.items[E] : 0;
MF_OMP(parallel num_threads(w.nt))
        {
            thread_bufs t = thread_scratch(&w);
            if (!a->reduce)
                mf_slot_zero_invalid(&w.p, &a->out, k, s0, m1 * k, (size_t)K * osz);
MF_OMP(for schedule(dynamic, 1))
            for (int64_t it = 0; it < n_items; it++) {
                int64_t e, ms, cb;
                const int64_t *slots;
                mf_slot_plan_item(&w.p, E, it, &e, &slots, &ms, &cb);
                final_item(a, e, slots, ms, cb, &t, a->reduce ? w.y : NULL, s0);
            }
            if (a->reduce)
                mf_slot_reduce_tokens(a, &w.p, w.y, m0, m1, s0, t.row);
        }
    }
    mf_cpu_scratch_release(&w.scratch);
    return MOEFUSE_OK;
}
