/*
 * The low-latency mode's wire: what one rank sends another in a dispatch, a block of fixed
 * size that holds up to `cap` rows whatever the routing, so that the exchange's sizes never
 * depend on device data. Read by the core, the CPU backend and the CUDA kernels alike (plain
 * C; MF_FN makes its functions host and device ones under nvcc), so that the three agree on
 * every offset and on how a count is trusted.
 *
 * A block, each part at a multiple of 16 bytes:
 *   count   int32            rows the block carries (n <= cap)
 *   token   int32 [cap]      row i's token on the sending rank (no step needs it; it makes a
 *                            block readable on its own, as the tests and a debugger read it)
 *   expert  int32 [cap, k]   row i's slot j: the receiving rank's local expert, or -1 (the
 *                            slot is invalid or its expert lives on another rank)
 *   weight  f32   [cap, k]   row i's topk_weights (kept for combine)
 *   rows    [cap] of row_bytes (ep_payload.h: x's row, or FP8 codes then f32 group scales)
 * Rows i >= count are never read.
 */
#ifndef MOEFUSE_EP_LL_WIRE_H
#define MOEFUSE_EP_LL_WIRE_H

#include "numerics/mf_portable.h" /* MF_FN: host and device functions under nvcc */

#include <stddef.h>
#include <stdint.h>

typedef struct mf_ep_ll_wire {
    int64_t cap, topk;   /* C rows a block, k slots a row */
    size_t row_bytes;
    size_t off_token, off_expert, off_weight, off_rows; /* from the block's start */
    size_t bytes;        /* a block, a multiple of 256 (NCCL moves aligned runs faster) */
} mf_ep_ll_wire;

MF_FN size_t mf_ep_ll_round(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* The layout of blocks of `cap` rows of `row_bytes` with k slots each; 0 when a size would
   overflow size_t (the core refuses such a call before any block is made). */
MF_FN int mf_ep_ll_wire_of(int64_t cap, int64_t topk, size_t row_bytes, mf_ep_ll_wire *w)
{
    const size_t c = (size_t)cap, ck = (size_t)cap * (size_t)topk;
    if (cap < 0 || topk < 0 || (topk > 0 && ck / (size_t)topk != c) || ck > SIZE_MAX / 16 ||
        (row_bytes > 0 && c > (SIZE_MAX / 2) / row_bytes))
        return 0;
    w->cap = cap;
    w->topk = topk;
    w->row_bytes = row_bytes;
    w->off_token = 16;
    w->off_expert = mf_ep_ll_round(w->off_token + 4 * c, 16);
    w->off_weight = mf_ep_ll_round(w->off_expert + 4 * ck, 16);
    w->off_rows = mf_ep_ll_round(w->off_weight + 4 * ck, 16);
    if (c * row_bytes > SIZE_MAX / 2 - w->off_rows)
        return 0;
    w->bytes = mf_ep_ll_round(w->off_rows + c * row_bytes, 256);
    return 1;
}

/* The parts of block p of a run of blocks. */
typedef struct mf_ep_ll_block {
    int32_t *count, *token, *expert;
    float *weight;
    char *rows;
} mf_ep_ll_block;

MF_FN mf_ep_ll_block mf_ep_ll_block_at(const mf_ep_ll_wire *w, const void *blocks, int p)
{
    char *b = (char *)blocks + w->bytes * (size_t)p;
    mf_ep_ll_block v = {(int32_t *)b, (int32_t *)(b + w->off_token),
                        (int32_t *)(b + w->off_expert), (float *)(b + w->off_weight),
                        b + w->off_rows};
    return v;
}

/* A block's row count as another rank wrote it, clamped to [0, C]: never trusted. */
MF_FN int64_t mf_ep_ll_rows_in(const mf_ep_ll_wire *w, const mf_ep_ll_block *b)
{
    const int64_t n = *b->count;
    return n < 0 ? 0 : n > w->cap ? w->cap : n;
}

#endif
