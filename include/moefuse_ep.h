/*
 * moefuse expert parallelism: the experts of a MoE layer split across the ranks of a group,
 * each token's rows sent to the ranks that hold its experts (dispatch), the experts run there
 * in the 3-D masked layout, and their outputs sent back and summed on the token's rank
 * (combine). docs/API.md "Expert parallelism" is the guide; docs/NUMERICS.md "Expert
 * parallelism" the contract (the layer's bits equal those of the one-device layer).
 *
 * Every rank calls every function of a group in the same order with matching arguments
 * (collective calls), each rank from its own context. The conventions of moefuse.h hold:
 * statuses, messages, nothing written on failure. A collective call that fails on one rank
 * because of another rank's data (a full expert, say) fails on every rank, each with a message
 * naming the rank and the expert.
 *
 * Status: the CPU and CUDA backends run dispatch and combine in both modes, and the whole
 * layer (normal mode), over a group's transport; groups over NCCL are made on CUDA contexts. A
 * backend without expert parallelism (OpenCL) returns MOEFUSE_ERR_UNSUPPORTED with a message.
 */
#ifndef MOEFUSE_EP_H
#define MOEFUSE_EP_H

#include "moefuse.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moefuse_ep_group moefuse_ep_group;
typedef struct moefuse_ep_handle moefuse_ep_handle;

/* NCCL's unique id: made on one rank, passed to every rank out of band. */
typedef struct moefuse_ep_unique_id {
    char bytes[128];
} moefuse_ep_unique_id;

/*
 * Where the experts live. Rank r holds its local experts 0 .. E_local(r) - 1: with
 * expert_owner NULL, the global experts [r E / W, (r + 1) E / W) (E a multiple of the world
 * size W); else the global experts g with expert_owner[g] == r, in ascending g. The same on
 * every rank.
 */
typedef struct moefuse_ep_config {
    int32_t rank;                /* this rank, in [0, world) */
    int32_t world;               /* ranks of the group, >= 1 */
    int32_t num_experts;         /* E, the global experts */
    const int32_t *expert_owner; /* optional host array [E] of ranks */
    uint32_t reserved[4];        /* must be 0 */
} moefuse_ep_config;

/* A new NCCL unique id (rank 0 makes it; CUDA contexts). MOEFUSE_ERR_BACKEND_UNAVAILABLE when
   NCCL cannot be loaded, naming the library looked for. */
MOEFUSE_API moefuse_status moefuse_ep_unique_id_create(moefuse_context *ctx,
                                                       moefuse_ep_unique_id *id);

/*
 * A group over NCCL (libnccl.so.2, or the library MOEFUSE_NCCL_LIBRARY names, loaded at run
 * time) on ctx's device, one rank per process and device, from the unique id every rank got.
 * The group is used with this context only; its calls run on the context's stream.
 */
MOEFUSE_API moefuse_status moefuse_ep_group_create(moefuse_context *ctx,
                                                   const moefuse_ep_unique_id *id,
                                                   const moefuse_ep_config *config,
                                                   moefuse_ep_group **out);

/* The same over the caller's communicator (an ncclComm_t of `world` ranks on ctx's device),
   which the group uses and does not destroy. */
MOEFUSE_API moefuse_status moefuse_ep_group_adopt(moefuse_context *ctx, void *nccl_comm,
                                                  const moefuse_ep_config *config,
                                                  moefuse_ep_group **out);

/* The number of local experts of this rank. */
MOEFUSE_API int32_t moefuse_ep_local_experts(const moefuse_ep_group *group);

/* Frees the group and the memory it keeps on its context: after every call on it has
   returned, before the context is destroyed. NULL is allowed. */
MOEFUSE_API void moefuse_ep_group_destroy(moefuse_ep_group *group);

typedef enum moefuse_ep_mode {
    MOEFUSE_EP_NORMAL = 0,      /* counts exchanged first, then rows of any number */
    MOEFUSE_EP_LOW_LATENCY = 1, /* fixed capacity, one exchange, graph-capturable */
    MOEFUSE_EP_MODE_COUNT_
} moefuse_ep_mode;

typedef struct moefuse_ep_dispatch_options {
    moefuse_ep_mode mode;
    /* An x of f32/f16/bf16 is sent as f8_e4m3 codes with one scale per 1 x 128 group (as
     * moefuse_quant forms them with `act`), and recv_x is f8_e4m3: half the bytes of bf16. */
    int32_t quantize;
    /* The scales of an f8_e4m3 x (x_scales) and of recv_x (recv_scales): group_size 0 or 128,
     * the layout, ue8m0, eps (quantize only). */
    moefuse_quant_options act;
    /* Low-latency mode: the most tokens any rank of the group dispatches in one call (M <=
     * max_tokens on every rank). With K, k, x's dtype and quantize it fixes every size the
     * call moves, so nothing is read back to the host: all five must be the same on every
     * rank. Normal mode: 0. */
    int32_t max_tokens;
    uint32_t reserved[3]; /* must be 0 */
} moefuse_ep_dispatch_options;

/*
 * Dispatch: every valid slot (m, j) of this rank's tokens sends row x[m] to the rank holding
 * expert topk_ids[m, j], where it becomes row t of its local expert e in the masked layout.
 *  x [M, K] f32/f16/bf16, or f8_e4m3 with x_scales ([M, K/128] in opt->act's layout);
 *  routing: topk_ids [M, k] i32 (global ids; < 0 or >= E: invalid, sent nowhere) and
 *   topk_weights [M, k] f32 (kept for combine); no expert_map, no shared experts (the layer
 *   calls take those);
 *  recv_x [E_local, Tmax, K]: x's dtype, or f8_e4m3 (quantize, or an f8 x) with recv_scales
 *   in the 3-D layout of opt->act ([E_local, Tmax, K/128] row-major, ...);
 *  recv_counts [E_local] i32: the rows each local expert received.
 * Rows of an expert are ordered by source rank, then token, then slot. Rows t >= count are not
 * written. An expert that would receive more than Tmax rows fails the call on every rank
 * (MOEFUSE_ERR_SHAPE), before any row is written. *handle (freed by moefuse_ep_handle_destroy)
 * records where every row came from, for moefuse_ep_combine.
 *
 * Low-latency mode (opt->mode MOEFUSE_EP_LOW_LATENCY, opt->max_tokens = C): the same rows in the
 * same places, in one exchange of fixed size (C rows to each rank), with the route made on the
 * device: nothing is read back to the host, so dispatch and combine can be captured in a CUDA
 * graph. recv_x's Tmax must be at least W C (W ranks), which holds every row when a token names
 * an expert once. Rows past Tmax (a token naming an expert in several slots) are not written;
 * recv_counts then holds the number the expert should have had (more than Tmax), and combine
 * gives NaN for the tokens whose rows were lost: nothing is dropped silently. The handle's
 * records stay in the group's memory: a combine takes the handle of the group's latest
 * low-latency dispatch (an older one is refused). Before capturing, make one dispatch and one
 * combine of the same shapes outside the capture (they size that memory); a later low-latency
 * call that needs more of it (a larger max_tokens, K or k) reallocates it, and graphs captured
 * before must be captured again.
 */
MOEFUSE_API moefuse_status moefuse_ep_dispatch(
    moefuse_context *ctx, moefuse_ep_group *group, const moefuse_tensor *x,
    const moefuse_tensor *x_scales, const moefuse_routing *routing, const moefuse_tensor *recv_x,
    const moefuse_tensor *recv_scales, const moefuse_tensor *recv_counts,
    const moefuse_ep_dispatch_options *opt, moefuse_ep_handle **handle);

/*
 * Combine: y [E_local, Tmax, K] f32/f16/bf16, the local experts' outputs for the rows dispatch
 * wrote (rows t >= count are not read), goes back to the tokens' ranks, where
 * out[m] = sum over valid j = 0..k-1, in that order, of topk_weights[m, j] * y of slot (m, j),
 * in f32 from 0, rounded once to out's dtype (out [M, K] f32/f16/bf16): the sum of
 * moefuse_moe_final. After a low-latency dispatch, each rank first sums the slots it holds of a
 * token (in slot order, the same roundings) and sends that one row back; out[m] is the sum of
 * those rows over the ranks in rank order, in f32 from 0, rounded once (with one rank, the
 * same bits as above; with more, the sum is associated by rank).
 */
MOEFUSE_API moefuse_status moefuse_ep_combine(moefuse_context *ctx, moefuse_ep_group *group,
                                              const moefuse_ep_handle *handle,
                                              const moefuse_tensor *y, const moefuse_tensor *out);

/* Frees a handle. NULL is allowed. */
MOEFUSE_API void moefuse_ep_handle_destroy(moefuse_ep_handle *handle);

/*
 * The whole layer: dispatch, this rank's experts (w1 [E_local, 2I, K], w2 [E_local, K, I],
 * optional b1, b2, as moefuse_moe_forward takes them), combine. x [M, K] f32/f16/bf16,
 * out [M, K]. Shared experts (routing.n_shared = S, shared_scale, shared_weights as for
 * moefuse_moe_forward): every rank holds them after its own, w1 [E_local + S, 2I, K] and so on,
 * and runs them on its own tokens; their outputs join the sum after the routed slots. On the
 * CPU backend bit for bit the out of moefuse_moe_forward over all E experts on one context
 * (docs/NUMERICS.md "Expert parallelism" says what holds on a GPU).
 */
MOEFUSE_API moefuse_status moefuse_ep_moe_forward(
    moefuse_context *ctx, moefuse_ep_group *group, const moefuse_tensor *x,
    const moefuse_tensor *w1, const moefuse_tensor *w2, const moefuse_tensor *b1,
    const moefuse_tensor *b2, const moefuse_routing *routing, const moefuse_tensor *out,
    const moefuse_moe_options *opt);

/*
 * The same for FP8 (moefuse_moe_forward_fp8's operands, this rank's experts): x of
 * f32/f16/bf16 is quantized before it is sent (half the bytes of bf16 cross), an f8_e4m3 x is
 * sent with its x_scales. On the CPU backend bit for bit the out of moefuse_moe_forward_fp8 on
 * one context.
 */
MOEFUSE_API moefuse_status moefuse_ep_moe_forward_fp8(
    moefuse_context *ctx, moefuse_ep_group *group, const moefuse_tensor *x,
    const moefuse_tensor *x_scales, const moefuse_tensor *w1, const moefuse_tensor *w1_scales,
    const moefuse_tensor *w2, const moefuse_tensor *w2_scales, const moefuse_tensor *b1,
    const moefuse_tensor *b2, const moefuse_routing *routing, const moefuse_tensor *out,
    const moefuse_fp8_moe_options *opt);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_EP_H */
