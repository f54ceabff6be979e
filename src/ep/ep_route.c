/*
 * The steps every expert-parallel call shares: the route of a dispatch (who sends which rows
 * to whom, agreed by one exchange of counts and one of local experts, on the host), moving
 * rows out and back along it in the backend's memory, the top-k sum at the tokens' rank, and
 * the vote that makes one rank's refusal every rank's.
 */
#include "core/core.h"
#include "ep/ep_internal.h"

#include <stdlib.h>
#include <string.h>

moefuse_status mf_ep_backend_check(moefuse_context *ctx, const char *op,
                                   const moefuse_ep_group *g)
{
    const moefuse_backend_i *b = ctx->backend;
    if (!b->ep_gather || !b->ep_scatter || !b->ep_reduce || !b->ep_copy)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "%s: the %s backend has no expert-parallel path yet", op, b->name);
    if (g->ctx != ctx)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: the group was made on another context; a group takes its own", op);
    return MOEFUSE_OK;
}

moefuse_status mf_ep_scratch(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                             enum mf_ep_slot slot, size_t bytes, void **p)
{
    if (bytes > g->scratch_bytes[slot] || !g->scratch[slot]) {
        if (g->scratch[slot])
            ctx->backend->buffer_free(ctx->state, g->scratch[slot]);
        g->scratch[slot] = NULL;
        g->scratch_bytes[slot] = 0;
        const size_t want = bytes + bytes / 8 + 256; /* a little room for the next call */
        const moefuse_status st = ctx->backend->buffer_alloc(ctx, ctx->state, want,
                                                             &g->scratch[slot]);
        if (st != MOEFUSE_OK)
            return mf_error(ctx, st, "%s: cannot allocate %zu bytes of the backend's memory: %s",
                            op, want, moefuse_last_error(ctx));
        g->scratch_bytes[slot] = want;
    }
    *p = g->scratch[slot];
    return MOEFUSE_OK;
}

moefuse_status mf_ep_to_host(moefuse_context *ctx, const char *op, const moefuse_tensor *t,
                             void **host, moefuse_tensor *view)
{
    const int64_t span = moefuse_tensor_span_bytes(t);
    *host = malloc(span > 0 ? (size_t)span : 1);
    if (!*host)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate %lld bytes", op,
                        (long long)span);
    if (span > 0)
        MF_TRY(ctx->backend->buffer_read(ctx, ctx->state, t->data, (size_t)t->offset, *host,
                                         (size_t)span));
    *view = *t;
    view->data = *host;
    view->offset = 0;
    return MOEFUSE_OK;
}

void mf_ep_route_free(mf_ep_route *r)
{
    free(r->block);
    free(r->local_rows);
    free(r->recv_expert);
    memset(r, 0, sizeof *r);
}

/*
 * The send side of a route for M k slots, W ranks and E experts, with the scratch of its
 * making (`at` [E], `gid` [M k]), in one allocation: freed and made again every call, the
 * same size comes back from the allocator's free memory, where separate arrays of a 4096-token
 * route were fresh pages each call, and their page faults took most of its time.
 */
static moefuse_status route_alloc(moefuse_context *ctx, const char *op, int64_t slots,
                                  int32_t W, int32_t E, mf_ep_route *r, int64_t **at,
                                  int32_t **gid)
{
    const size_t n = (size_t)(slots > 0 ? slots : 1), w = (size_t)W, e = (size_t)E;
    /* 8-byte words: sent, received, send_slot, slot_row, per_expert, at; then weight, gid */
    const size_t bytes = 8 * (2 * w + 2 * n + 2 * e) + sizeof(float) * n + sizeof(int32_t) * n;
    char *b = malloc(bytes);
    if (!b)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                        "%s: cannot allocate the route of %lld slots", op, (long long)slots);
    r->block = b;
    r->sent = (size_t *)b;
    r->received = r->sent + w;
    r->send_slot = (int64_t *)(r->received + w);
    r->slot_row = r->send_slot + n;
    r->per_expert = r->slot_row + n;
    *at = r->per_expert + e;
    r->weight = (float *)(*at + e);
    *gid = (int32_t *)(r->weight + n);
    memset(r->sent, 0, 2 * w * sizeof *r->sent);
    memset(r->per_expert, 0, 2 * e * sizeof *r->per_expert); /* and at */
    memset(r->weight, 0, n * sizeof *r->weight);
    return MOEFUSE_OK;
}

/* Byte counts and offsets of per-rank runs of `rows` rows of `row_bytes`. */
static void runs(const size_t *rows, int32_t W, size_t row_bytes, size_t *bytes, size_t *off)
{
    size_t at = 0;
    for (int32_t p = 0; p < W; p++) {
        bytes[p] = rows[p] * row_bytes;
        off[p] = at;
        at += bytes[p];
    }
}

moefuse_status mf_ep_route_local(moefuse_context *ctx, const char *op, const moefuse_ep_group *g,
                                 const moefuse_tensor *ids, const moefuse_tensor *weights,
                                 mf_ep_route *r)
{
    memset(r, 0, sizeof *r);
    const int32_t W = g->world, E = g->experts;
    const int64_t M = ids->shape[0], k = ids->shape[1], S = M * k;
    r->world = W;
    r->tokens = M;
    r->topk = k;
    int64_t *at = NULL;
    int32_t *gid = NULL;
    MF_TRY(route_alloc(ctx, op, S, W, E, r, &at, &gid));
    /* each slot's global expert (-1: invalid), counted per expert; the host views' elements
       addressed directly (a division and a call per slot took most of a 4096-token route) */
    const char *idb = (const char *)ids->data + ids->offset;
    const char *wb = weights ? (const char *)weights->data + weights->offset : NULL;
    const int64_t i0 = ids->stride[0], i1 = ids->stride[1];
    const int64_t w0 = weights ? weights->stride[0] : 0, w1 = weights ? weights->stride[1] : 0;
    for (int64_t m = 0, s = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++, s++) {
            int32_t id;
            memcpy(&id, idb + (int64_t)sizeof id * (m * i0 + j * i1), sizeof id);
            gid[s] = id >= 0 && id < E ? id : -1;
            if (gid[s] < 0)
                continue;
            r->per_expert[id]++;
            r->sent[g->owner[id]]++;
            if (wb)
                memcpy(&r->weight[s], wb + (int64_t)sizeof(float) * (m * w0 + j * w1),
                       sizeof(float));
        }
    /* rows by the experts' rank, then their local expert, then slot: each expert's first row */
    int64_t next = 0;
    for (int32_t d = 0; d < W; d++)
        for (int32_t e = 0; e < E; e++)
            if (g->owner[e] == d) {
                at[e] = next;
                next += r->per_expert[e];
            }
    r->n_sent = next;
    for (int64_t s = 0; s < S; s++) {
        r->slot_row[s] = -1;
        if (gid[s] < 0)
            continue;
        const int64_t row = at[gid[s]]++;
        r->send_slot[row] = s;
        r->slot_row[s] = row;
    }
    return MOEFUSE_OK;
}

/* One rank's record of the call's one exchange: its status, its capacity, and its slots per
   global expert. */
typedef struct rank_record {
    int64_t status, tmax;
} rank_record;

moefuse_status mf_ep_route_agree(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                 moefuse_status mine, int64_t tmax, mf_ep_route *r)
{
    const int32_t W = g->world, E = g->experts, me = g->rank;
    const size_t rec = sizeof(rank_record) + sizeof(int64_t) * (size_t)E;
    char *send = calloc((size_t)W, rec), *all = calloc((size_t)W, rec);
    size_t *b = calloc((size_t)W * 2, sizeof *b);
    if (!send || !all || !b) {
        free(send);
        free(all);
        free(b);
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate the exchange", op);
    }
    for (int32_t p = 0; p < W; p++) {
        rank_record hd = {(int64_t)mine, tmax};
        memcpy(send + (size_t)p * rec, &hd, sizeof hd);
        if (mine == MOEFUSE_OK && r->per_expert)
            memcpy(send + (size_t)p * rec + sizeof hd, r->per_expert,
                   sizeof(int64_t) * (size_t)E);
        b[p] = rec;
        b[W + p] = (size_t)p * rec;
    }
    moefuse_status st = mf_ep_all_to_all(ctx, op, g, false, send, b, b + W, all, b, b + W);
    free(send);
    free(b);
    /* the first rank (in rank order) that refused, or has an expert over its capacity: every
       rank finds the same one */
    int32_t who = -1;
    int64_t why = MOEFUSE_OK, over = -1, rows = 0, cap = 0;
    for (int32_t q = 0; st == MOEFUSE_OK && q < W && who < 0; q++) {
        const rank_record *hq = (const rank_record *)(all + (size_t)q * rec);
        if (hq->status != MOEFUSE_OK) {
            who = q;
            why = hq->status;
            break;
        }
        for (int32_t e = 0; e < E && who < 0; e++) /* another rank's bytes: not trusted */
            if (((const int64_t *)(hq + 1))[e] < 0) {
                who = q;
                why = MOEFUSE_ERR_INTERNAL;
            }
        for (int32_t e = 0; e < E && hq->tmax >= 0 && who < 0; e++) {
            if (g->owner[e] != q)
                continue;
            int64_t n = 0;
            for (int32_t p = 0; p < W; p++) {
                const rank_record *hp = (const rank_record *)(all + (size_t)p * rec);
                n += ((const int64_t *)(hp + 1))[e];
            }
            if (n > hq->tmax) {
                who = q;
                why = MOEFUSE_ERR_SHAPE;
                over = g->local[e];
                rows = n;
                cap = hq->tmax;
            }
        }
    }
    if (st == MOEFUSE_OK && who >= 0) {
        if (who == me && mine != MOEFUSE_OK)
            st = mine; /* this rank's own message stands */
        else if (over >= 0 && who == me)
            st = mf_error(ctx, MOEFUSE_ERR_SHAPE,
                          "%s: local expert %lld of rank %d receives %lld rows; recv_x holds "
                          "Tmax = %lld",
                          op, (long long)over, (int)who, (long long)rows, (long long)cap);
        else if (over >= 0)
            st = mf_error(ctx, MOEFUSE_ERR_SHAPE,
                          "%s: local expert %lld of rank %d receives %lld rows, more than its "
                          "Tmax = %lld; no rank wrote anything",
                          op, (long long)over, (int)who, (long long)rows, (long long)cap);
        else if (mine != MOEFUSE_OK)
            st = mine;
        else if (why == MOEFUSE_ERR_INTERNAL)
            st = mf_error(ctx, MOEFUSE_ERR_INTERNAL, "%s: rank %d sent a negative count of rows",
                          op, (int)who);
        else
            st = mf_ep_refused(ctx, op, who, (moefuse_status)why);
    }
    /* the rows this rank receives: from each source, by local expert, as the source sent them */
    int64_t n = 0;
    for (int32_t p = 0; st == MOEFUSE_OK && p < W; p++) {
        const int64_t *hp = (const int64_t *)(all + (size_t)p * rec + sizeof(rank_record));
        size_t from = 0;
        for (int32_t e = 0; e < E; e++)
            if (g->owner[e] == me)
                from += (size_t)hp[e];
        r->received[p] = from;
        n += (int64_t)from;
    }
    if (st == MOEFUSE_OK) {
        r->n_recv = n;
        r->recv_expert = malloc((size_t)(n > 0 ? n : 1) * sizeof *r->recv_expert);
        r->local_rows = calloc((size_t)(g->local_experts > 0 ? g->local_experts : 1),
                               sizeof *r->local_rows);
        if (!r->recv_expert || !r->local_rows)
            st = mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                          "%s: cannot allocate the experts of %lld received rows", op,
                          (long long)n);
    }
    int64_t at = 0;
    for (int32_t p = 0; st == MOEFUSE_OK && p < W; p++) {
        const int64_t *hp = (const int64_t *)(all + (size_t)p * rec + sizeof(rank_record));
        for (int32_t e = 0; e < E; e++)
            if (g->owner[e] == me) {
                r->local_rows[g->local[e]] += hp[e];
                for (int64_t i = 0; i < hp[e]; i++)
                    r->recv_expert[at++] = g->local[e];
            }
    }
    free(all);
    return st;
}

moefuse_status mf_ep_exchange_rows(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                   const mf_ep_route *r, int back, const void *send,
                                   size_t row_bytes, void *recv)
{
    const int32_t W = r->world;
    size_t *b = malloc(sizeof *b * (size_t)W * 4);
    if (!b)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate", op);
    size_t *sb = b, *so = b + W, *rb = b + 2 * W, *ro = b + 3 * W;
    runs(back ? r->received : r->sent, W, row_bytes, sb, so);
    runs(back ? r->sent : r->received, W, row_bytes, rb, ro);
    const moefuse_status st = mf_ep_all_to_all(ctx, op, g, true, send, sb, so, recv, rb, ro);
    free(b);
    return st;
}

moefuse_status mf_ep_reduce_slots(moefuse_context *ctx, const int64_t *slot_row,
                                  const float *weight, int64_t tokens, int64_t slots,
                                  const void *back, int64_t K, const moefuse_tensor *out)
{
    mf_ep_reduce_args a;
    memset(&a, 0, sizeof a);
    a.back = back;
    a.slot_row = slot_row;
    a.weight = weight;
    a.tokens = tokens;
    a.topk = slots;
    a.model_dim = K;
    a.out = *out;
    return ctx->backend->ep_reduce(ctx, ctx->state, &a);
}

moefuse_status mf_ep_reduce(moefuse_context *ctx, const mf_ep_route *r, const void *back,
                            int64_t K, const moefuse_tensor *out)
{
    return mf_ep_reduce_slots(ctx, r->slot_row, r->weight, r->tokens, r->topk, back, K, out);
}
