/*
 * The routing side of the CPU MoE GEMMs, shared by moe.c (bf16/f16/f32) and moe_fp8.c: the
 * local expert of a slot, the slots of a range grouped by expert into work items (expert,
 * tile of slots, column block), the rows of invalid slots (zeroed), the bias of a final row,
 * and the fixed-order top-k sum of the reduced final; and the gate's activation as the row
 * kernels take it.
 */
#ifndef MOEFUSE_CPU_MOE_SLOTS_H
#define MOEFUSE_CPU_MOE_SLOTS_H

#include "core/backend.h"
#include "cpu/rows_isa.h"

#include <stddef.h>
#include <stdint.h>

typedef struct mf_slot_plan {
    int64_t *expert_of; /* [S] local expert per slot, -1 invalid */
    int64_t *list;      /* [S] slot ids grouped by expert, ascending */
    int64_t *start;     /* [E+1] start of each expert's slots in list */
    int64_t *fill;      /* [E+1] */
    int64_t *items;     /* [E+1] prefix of work items per expert */
    int64_t col_blocks; /* column blocks per slot tile */
} mf_slot_plan;

/*
 * The gate's h = act(g) * u (clamp, up offset, activation of the call's options) in a row plan
 * whose rows hold [g, u] in `order`: the row kernels then compute h with the reference's bits
 * (mf_cpu_h_channel), in the level's vectors.
 */
static inline void mf_slot_gate_act(mf_row_plan *p, const mf_moe_args *a, int order)
{
    p->activate = true;
    p->order = order;
    p->activation = (int)a->opt.activation;
    p->alpha = a->opt.alpha;
    p->limit = a->opt.limit;
    p->up_offset = a->opt.up_offset;
}

/* Shared experts as slots (backend.h, mf_shared_args): the ids and weights of k + n slots. */
moefuse_status mf_cpu_moe_shared_routing(moefuse_context *ctx, void *state,
                                         const mf_shared_args *a);

/* Local expert of routed slot (m, j), or -1 when the slot is invalid (NUMERICS.md "MoE"). */
int64_t mf_slot_expert(const mf_moe_args *a, int64_t m, int64_t j);

/* Bytes of the plan's arrays for S slots and E experts (64-byte aligned each). */
size_t mf_slot_plan_bytes(int64_t S, int64_t E);
/* Lay the arrays out from mem; returns the first byte past them. */
char *mf_slot_plan_place(mf_slot_plan *p, char *mem, int64_t S, int64_t E);
/* expert_of of every routed slot of a. */
void mf_slot_plan_experts(mf_slot_plan *p, const mf_moe_args *a);
/* Group the valid slots [s0, s1) by expert, in tiles of at most `tile` (an expert's of
 * near-equal size), each in col_blocks items. */
void mf_slot_plan_group(mf_slot_plan *p, int64_t E, int64_t s0, int64_t s1, int64_t tile,
                        int64_t col_blocks);
/* Work item w: its expert, its slots [*slots, *slots + *count), its column block. */
void mf_slot_plan_item(const mf_slot_plan *p, int64_t E, int64_t w, int64_t *e,
                       const int64_t **slots, int64_t *count, int64_t *cb);

/*
 * out[m, :] = sum over valid j in order of topk_weights[m, j] * y[m, j, :], from 0 in f32,
 * rounded once, for the tokens m in [m0, m1); y holds the rows of slots from s0 on. acc: K
 * floats of the calling thread's. Work-shared: every thread of the enclosing parallel region
 * calls it (an orphaned omp for, with its closing barrier).
 */
void mf_slot_reduce_tokens(const mf_moe_args *a, const mf_slot_plan *p, const float *y,
                           int64_t m0, int64_t m1, int64_t s0, float *acc);
/* Zero t[s / k, s % k, :] (row_bytes) for each invalid slot s in [s0, s1): no expert writes
 * it. Work-shared like mf_slot_reduce_tokens. */
void mf_slot_zero_invalid(const mf_slot_plan *p, const moefuse_tensor *t, int64_t k, int64_t s0,
                          int64_t s1, size_t row_bytes);
/* dst[c] = src[c] + bias[e, r0 + c] for c < n; a plain copy when bias is absent. */
void mf_slot_add_bias(float *dst, const float *src, const moefuse_tensor *bias, int64_t e,
                      int64_t r0, int64_t n);

#endif /* MOEFUSE_CPU_MOE_SLOTS_H */
