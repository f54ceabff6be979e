/*
 * The expert-parallel group: where each global expert lives, and the transport. Also the two
 * collectives every EP call is built from: the all-to-all, and a vote that makes a failure on
 * one rank a failure on all (a rank that returned early would leave the others waiting).
 */
#include "core/core.h"
#include "ep/ep_internal.h"

#include <stdlib.h>
#include <string.h>

static moefuse_status check_config(moefuse_context *ctx, const char *op,
                                   const moefuse_ep_config *c)
{
    if (!c)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: config is NULL", op);
    for (size_t i = 0; i < sizeof c->reserved / sizeof c->reserved[0]; i++)
        if (c->reserved[i])
            return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                            "%s: config.reserved[%zu] is %u; it must be 0", op, i,
                            (unsigned)c->reserved[i]);
    if (c->world < 1)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: config.world is %d; it must be >= 1", op, (int)c->world);
    if (c->rank < 0 || c->rank >= c->world)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: config.rank is %d; it must be in [0, world = %d)", op, (int)c->rank,
                        (int)c->world);
    if (c->num_experts < 1)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: config.num_experts is %d; it must be >= 1", op, (int)c->num_experts);
    if (!c->expert_owner && c->num_experts % c->world != 0)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: %d experts do not split into %d equal blocks; pass "
                        "config.expert_owner",
                        op, (int)c->num_experts, (int)c->world);
    if (c->expert_owner)
        for (int32_t g = 0; g < c->num_experts; g++)
            if (c->expert_owner[g] < 0 || c->expert_owner[g] >= c->world)
                return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                                "%s: config.expert_owner[%d] is %d; ranks are [0, %d)", op, (int)g,
                                (int)c->expert_owner[g], (int)c->world);
    return MOEFUSE_OK;
}

moefuse_status mf_ep_group_make(moefuse_context *ctx, const char *op,
                                const moefuse_ep_config *config, mf_ep_transport transport,
                                moefuse_ep_group **out)
{
    if (!out)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: out is NULL", op);
    *out = NULL;
    MF_TRY(check_config(ctx, op, config));
    const int32_t E = config->num_experts, W = config->world;
    moefuse_ep_group *g = calloc(1, sizeof *g);
    int32_t *fill = calloc((size_t)W, sizeof *fill);
    if (g) {
        g->owner = malloc(sizeof *g->owner * (size_t)E);
        g->local = malloc(sizeof *g->local * (size_t)E);
    }
    if (!g || !fill || !g->owner || !g->local) {
        if (g) {
            free(g->owner);
            free(g->local);
        }
        free(g);
        free(fill);
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate the group", op);
    }
    for (int32_t e = 0; e < E; e++) {
        g->owner[e] = config->expert_owner ? config->expert_owner[e] : e / (E / W);
        g->local[e] = fill[g->owner[e]]++;
    }
    g->ctx = ctx;
    g->rank = config->rank;
    g->world = W;
    g->experts = E;
    g->local_experts = fill[config->rank];
    g->transport = transport;
    free(fill);
    *out = g;
    return MOEFUSE_OK;
}

moefuse_status mf_ep_all_to_all(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                bool rows, const void *send, const size_t *send_bytes,
                                const size_t *send_off, void *recv, const size_t *recv_bytes,
                                const size_t *recv_off)
{
    char why[256] = "";
    const mf_ep_transport_i *i = g->transport.i;
    const moefuse_status st =
        (rows ? i->all_to_all : i->all_to_all_host)(g->transport.t, send, send_bytes, send_off,
                                                     recv, recv_bytes, recv_off, why, sizeof why);
    if (st != MOEFUSE_OK)
        return mf_error(ctx, st, "%s: the exchange between ranks failed: %s", op, why);
    return MOEFUSE_OK;
}

moefuse_status mf_ep_all_to_all_beside(moefuse_context *ctx, const char *op,
                                       moefuse_ep_group *g, const void *send,
                                       const size_t *send_bytes, const size_t *send_off,
                                       void *recv, const size_t *recv_bytes,
                                       const size_t *recv_off)
{
    char why[256] = "";
    const mf_ep_transport_i *i = g->transport.i;
    const moefuse_status st =
        (i->all_to_all_beside ? i->all_to_all_beside : i->all_to_all)(
            g->transport.t, send, send_bytes, send_off, recv, recv_bytes, recv_off, why,
            sizeof why);
    if (st != MOEFUSE_OK)
        return mf_error(ctx, st, "%s: the exchange between ranks failed: %s", op, why);
    return MOEFUSE_OK;
}

moefuse_status mf_ep_join(moefuse_context *ctx, const char *op, moefuse_ep_group *g)
{
    char why[256] = "";
    const mf_ep_transport_i *i = g->transport.i;
    const moefuse_status st = i->join ? i->join(g->transport.t, why, sizeof why) : MOEFUSE_OK;
    if (st != MOEFUSE_OK)
        return mf_error(ctx, st, "%s: waiting for the exchange between ranks failed: %s", op,
                        why);
    return MOEFUSE_OK;
}

moefuse_status mf_ep_refused(moefuse_context *ctx, const char *op, int32_t who,
                             moefuse_status status)
{
    return mf_error(ctx, status,
                    "%s: rank %d refused the call (%s); every rank of the group stops with it", op,
                    (int)who, moefuse_status_name(status));
}

moefuse_status mf_ep_vote_on(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                             moefuse_status mine)
{
    const int32_t W = g->world;
    int32_t *all = calloc((size_t)W * 2, sizeof *all);
    size_t *bytes = calloc((size_t)W * 2, sizeof *bytes);
    if (!all || !bytes) {
        free(all);
        free(bytes);
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate a vote", op);
    }
    int32_t *send = all + W;
    for (int32_t p = 0; p < W; p++) {
        send[p] = (int32_t)mine;
        bytes[p] = sizeof *send;
        bytes[W + p] = (size_t)p * sizeof *send;
    }
    moefuse_status st =
        mf_ep_all_to_all(ctx, op, g, false, send, bytes, bytes + W, all, bytes, bytes + W);
    int32_t who = -1;
    for (int32_t p = 0; st == MOEFUSE_OK && p < W && who < 0; p++)
        if (all[p] != MOEFUSE_OK)
            who = p;
    if (st == MOEFUSE_OK)
        st = who < 0 || mine != MOEFUSE_OK ? mine /* this rank's own message stands */
                                           : mf_ep_refused(ctx, op, who, (moefuse_status)all[who]);
    free(all);
    free(bytes);
    return st;
}

/* ------------------------------------------------------------------ public */

static moefuse_status no_nccl(moefuse_context *ctx, const char *op)
{
    return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                    "%s: the %s backend has no groups over NCCL (they need the cuda backend)", op,
                    ctx->backend->name);
}

moefuse_status moefuse_ep_unique_id_create(moefuse_context *ctx, moefuse_ep_unique_id *id)
{
    static const char op[] = "ep_unique_id_create";
    MF_TRY(mf_enter(ctx, op));
    if (!id)
        return mf_leave(ctx, mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: id is NULL", op));
    if (!ctx->backend->ep_unique_id)
        return mf_leave(ctx, no_nccl(ctx, op));
    return mf_leave(ctx, ctx->backend->ep_unique_id(ctx, ctx->state, id->bytes));
}

/* A group over NCCL from a unique id, or over the caller's comm. */
static moefuse_status nccl_group(moefuse_context *ctx, const char *op,
                                 const moefuse_ep_unique_id *id, void *comm,
                                 const moefuse_ep_config *config, moefuse_ep_group **out)
{
    if (!out)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: out is NULL", op);
    *out = NULL;
    if (!id && !comm)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: %s is NULL", op,
                        comm ? "id" : "the NCCL communicator");
    MF_TRY(check_config(ctx, op, config));
    if (!ctx->backend->ep_transport)
        return no_nccl(ctx, op);
    mf_ep_transport tr = {NULL, NULL};
    MF_TRY(ctx->backend->ep_transport(ctx, ctx->state, id ? id->bytes : NULL, comm, config->rank,
                                      config->world, &tr));
    const moefuse_status st = mf_ep_group_make(ctx, op, config, tr, out);
    if (st != MOEFUSE_OK)
        tr.i->destroy(tr.t);
    return st;
}

moefuse_status moefuse_ep_group_create(moefuse_context *ctx, const moefuse_ep_unique_id *id,
                                       const moefuse_ep_config *config, moefuse_ep_group **out)
{
    static const char op[] = "ep_group_create";
    MF_TRY(mf_enter(ctx, op));
    if (!id && out)
        *out = NULL;
    if (!id)
        return mf_leave(ctx, mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: id is NULL", op));
    return mf_leave(ctx, nccl_group(ctx, op, id, NULL, config, out));
}

moefuse_status moefuse_ep_group_adopt(moefuse_context *ctx, void *nccl_comm,
                                      const moefuse_ep_config *config, moefuse_ep_group **out)
{
    static const char op[] = "ep_group_adopt";
    MF_TRY(mf_enter(ctx, op));
    if (!nccl_comm && out)
        *out = NULL;
    if (!nccl_comm)
        return mf_leave(ctx, mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: nccl_comm is NULL", op));
    return mf_leave(ctx, nccl_group(ctx, op, NULL, nccl_comm, config, out));
}

int32_t moefuse_ep_local_experts(const moefuse_ep_group *group)
{
    return group ? group->local_experts : 0;
}

void moefuse_ep_group_destroy(moefuse_ep_group *group)
{
    if (!group)
        return;
    if (group->transport.i)
        group->transport.i->destroy(group->transport.t);
    for (int i = 0; i < MF_EP_SLOTS; i++)
        if (group->scratch[i])
            group->ctx->backend->buffer_free(group->ctx->state, group->scratch[i]);
    free(group->owner);
    free(group->local);
    free(group);
}

void moefuse_ep_handle_destroy(moefuse_ep_handle *h)
{
    if (!h)
        return;
    mf_ep_route_free(&h->route);
    free(h->recv_row);
    free(h);
}
