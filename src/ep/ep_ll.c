/*
 * The low-latency mode of dispatch and combine. Each rank sends every rank one block of fixed
 * size (ep/ep_ll_wire.h: up to C rows, with each row's token, local experts and weights), so
 * the exchange's sizes come from the shapes alone; the backend's four steps (pack, place,
 * partial, sum) read the route on the device. No call reads device data back or waits for the
 * host, so a dispatch and its combine can be captured in a CUDA graph once a call outside the
 * capture has sized the group's memory.
 *
 * Unlike the normal mode there is no vote: a rank whose arguments are refused returns before
 * its exchange, and the others wait for it there, as ranks do in NCCL when one leaves a
 * collective (docs/API.md says so).
 */
#include "core/core.h"
#include "ep/ep_ll.h"

#include <stdlib.h>
#include <string.h>

moefuse_status mf_ep_ll_check(moefuse_context *ctx, const char *op, const moefuse_ep_group *g,
                              const mf_ep_payload *pay, int64_t topk, int64_t cap, int64_t tmax)
{
    const moefuse_backend_i *b = ctx->backend;
    if (!b->ep_ll_pack || !b->ep_ll_place || !b->ep_ll_partial || !b->ep_ll_sum)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "%s: the %s backend has no low-latency expert-parallel path; use "
                        "MOEFUSE_EP_NORMAL",
                        op, b->name);
    if (cap < 1)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: max_tokens is %lld; the low-latency mode needs the most tokens a "
                        "rank dispatches (>= 1)",
                        op, (long long)cap);
    if (pay->tokens > cap)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: x has M = %lld tokens, more than max_tokens = %lld", op,
                        (long long)pay->tokens, (long long)cap);
    if (tmax / g->world < cap)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: recv_x has Tmax = %lld; the low-latency mode needs at least world x "
                        "max_tokens = %d x %lld, so that every row fits",
                        op, (long long)tmax, (int)g->world, (long long)cap);
    mf_ep_ll_wire w;
    const int64_t K = pay->model_dim;
    if (!mf_ep_ll_wire_of(cap, topk, pay->row_bytes, &w) || w.bytes > SIZE_MAX / (size_t)g->world ||
        (size_t)cap * (size_t)(K > 0 ? K : 1) > SIZE_MAX / sizeof(float) / (size_t)g->world)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: blocks of max_tokens = %lld rows of K = %lld overflow size_t", op,
                        (long long)cap, (long long)K);
    return MOEFUSE_OK;
}

/* The group's placement (owner, local) in backend memory: written on the first low-latency
   call, outside any capture, and kept. */
static moefuse_status placement_on_backend(moefuse_context *ctx, const char *op,
                                           moefuse_ep_group *g, void **map)
{
    const size_t bytes = sizeof(int32_t) * 2 * (size_t)g->experts;
    MF_TRY(mf_ep_scratch(ctx, op, g, MF_EP_LL_MAP, bytes, map));
    if (g->map_on_backend)
        return MOEFUSE_OK;
    MF_TRY(ctx->backend->buffer_write(ctx, ctx->state, *map, 0, g->owner, bytes / 2));
    MF_TRY(ctx->backend->buffer_write(ctx, ctx->state, *map, bytes / 2, g->local, bytes / 2));
    g->map_on_backend = true;
    return MOEFUSE_OK;
}

/* One exchange of the same number of bytes with every other rank: block p of send to rank p,
   block p of recv from rank p. This rank's own block stays where it was written (the steps
   read it there), so no link or copy carries it. */
static moefuse_status exchange_blocks(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                      const void *send, void *recv, size_t block)
{
    const int32_t W = g->world;
    size_t *sz = malloc(sizeof *sz * 2 * (size_t)W);
    if (!sz)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate", op);
    for (int32_t p = 0; p < W; p++) {
        sz[p] = p == g->rank ? 0 : block;
        sz[W + p] = block * (size_t)p;
    }
    const moefuse_status st = mf_ep_all_to_all(ctx, op, g, true, send, sz, sz + W, recv, sz,
                                               sz + W);
    free(sz);
    return st;
}

moefuse_status mf_ep_ll_dispatch(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                 const mf_ep_payload *pay, const moefuse_tensor *x,
                                 const moefuse_routing *routing, const moefuse_tensor *recv_x,
                                 const moefuse_tensor *recv_scales,
                                 const moefuse_tensor *recv_counts, int64_t cap,
                                 moefuse_ep_handle *h)
{
    const int32_t W = g->world;
    const int64_t k = routing->topk_ids.shape[1];
    mf_ep_ll_args a;
    memset(&a, 0, sizeof a);
    mf_ep_ll_wire_of(cap, k, pay->row_bytes, &a.wire); /* checked by mf_ep_ll_check */
    a.world = W;
    a.rank = g->rank;
    a.tokens = pay->tokens;
    a.model_dim = pay->model_dim;
    a.groups = pay->fp8 ? pay->groups : 0;
    a.x = mf_tensor_lift3(x);
    if (pay->fp8) {
        a.x_scales = pay->xs;
        a.x_layout = pay->act.scale_layout;
    }
    a.ids = routing->topk_ids;
    a.weights = routing->topk_weights;
    a.experts = g->experts;
    a.recv_x = *recv_x;
    if (pay->fp8) {
        a.recv_scales = *recv_scales;
        a.recv_layout = pay->act.scale_layout;
    }
    a.recv_counts = *recv_counts;
    void *map = NULL, *send = NULL, *recv = NULL, *pos = NULL, *row_of = NULL;
    const size_t blocks = a.wire.bytes * (size_t)W;
    MF_TRY(placement_on_backend(ctx, op, g, &map));
    MF_TRY(mf_ep_scratch(ctx, op, g, MF_EP_LL_OUT, blocks, &send));
    MF_TRY(mf_ep_scratch(ctx, op, g, MF_EP_LL_IN, blocks, &recv));
    MF_TRY(mf_ep_scratch(ctx, op, g, MF_EP_LL_POS, sizeof(int32_t) * (size_t)(cap * W), &pos));
    MF_TRY(mf_ep_scratch(ctx, op, g, MF_EP_LL_ROW,
                         sizeof(int32_t) * (size_t)W * (size_t)cap * (size_t)(k > 0 ? k : 1),
                         &row_of));
    if (pay->quantize)
        MF_TRY(mf_ep_payload_quantize(ctx, op, g, pay, x, MF_EP_LL_CODES, &a.x, &a.x_scales,
                                      &a.x_layout));
    a.owner = (const int32_t *)map;
    a.local = (const int32_t *)map + g->experts;
    a.send = send;
    a.pos = pos;
    a.recv = recv;
    a.row_of = row_of;
    MF_TRY(ctx->backend->ep_ll_pack(ctx, ctx->state, &a));
    MF_TRY(exchange_blocks(ctx, op, g, send, recv, a.wire.bytes));
    MF_TRY(ctx->backend->ep_ll_place(ctx, ctx->state, &a));
    h->low_latency = true;
    h->ll_dispatch = ++g->ll_dispatches;
    h->wire = a.wire;
    h->route.world = W;
    h->route.tokens = pay->tokens;
    h->route.topk = k;
    return MOEFUSE_OK;
}

moefuse_status mf_ep_ll_combine(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                const moefuse_ep_handle *h, const moefuse_tensor *y,
                                const moefuse_tensor *out)
{
    const int32_t W = g->world;
    const int64_t C = h->wire.cap, K = h->model_dim;
    const size_t block = sizeof(float) * (size_t)C * (size_t)K;
    if (h->ll_dispatch != g->ll_dispatches) /* its records were overwritten since */
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: the handle is from low-latency dispatch %llu of the group, not its "
                        "latest (%llu); a low-latency combine takes the latest dispatch's handle",
                        op, (unsigned long long)h->ll_dispatch,
                        (unsigned long long)g->ll_dispatches);
    mf_ep_ll_args a;
    memset(&a, 0, sizeof a);
    a.wire = h->wire;
    a.world = W;
    a.rank = g->rank;
    a.tokens = h->route.tokens;
    a.model_dim = K;
    a.y = *y;
    a.out = *out;
    void *partial = NULL, *back = NULL;
    MF_TRY(mf_ep_scratch(ctx, op, g, MF_EP_LL_PARTIAL, block * (size_t)W, &partial));
    MF_TRY(mf_ep_scratch(ctx, op, g, MF_EP_LL_BACK, block * (size_t)W, &back));
    /* the dispatch's records, where it left them */
    a.send = g->scratch[MF_EP_LL_OUT];
    a.recv = g->scratch[MF_EP_LL_IN];
    a.pos = g->scratch[MF_EP_LL_POS];
    a.row_of = g->scratch[MF_EP_LL_ROW];
    a.partial = partial;
    a.back = back;
    MF_TRY(ctx->backend->ep_ll_partial(ctx, ctx->state, &a));
    MF_TRY(exchange_blocks(ctx, op, g, partial, back, block));
    return ctx->backend->ep_ll_sum(ctx, ctx->state, &a);
}
