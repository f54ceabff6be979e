/*
 * Expert parallelism inside the library: the group, the handle, and the in-process transport
 * the tests make groups with (threads as ranks).
 */
#ifndef MOEFUSE_EP_INTERNAL_H
#define MOEFUSE_EP_INTERNAL_H

#include "moefuse_ep.h"
#include "ep/transport.h"

struct moefuse_ep_group {
    int32_t rank, world;
    int32_t experts;       /* E, global */
    int32_t local_experts; /* E_local of this rank */
    int32_t *owner;        /* [E]: the rank of each global expert */
    int32_t *local;        /* [E]: its index among its rank's experts */
    mf_ep_transport transport;
};

/* ---------------------------------------------- the route of one dispatch (ep_route.c) */

/*
 * Which rows go where: this rank's valid slots, sorted by the rank holding their expert (then
 * by slot), and the local experts of the rows it receives, sorted by source rank (then as
 * the source sent them). Host memory.
 */
typedef struct mf_ep_route {
    int32_t world;
    int64_t tokens, topk;    /* M, k */
    size_t *sent;            /* [world]: rows sent to each rank */
    size_t *received;        /* [world]: rows received from each rank */
    int64_t n_sent, n_recv;
    int64_t *send_slot;      /* [n_sent]: slot m k + j of each sent row */
    int64_t *slot_row;       /* [M k]: each slot's place among the sent rows, -1: invalid */
    int32_t *recv_expert;    /* [n_recv]: local expert of each received row */
    float *weight;           /* [M k]: the valid slots' topk_weights (0 elsewhere) */
} mf_ep_route;

/* What combine needs of one dispatch: its route, and where each received row went. */
struct moefuse_ep_handle {
    const moefuse_ep_group *group;
    mf_ep_route route;
    int64_t model_dim, local_experts, tmax; /* K, E_local, Tmax of its recv_x */
    int64_t *recv_row;                      /* [n_recv]: row e Tmax + t of recv_x */
};

/* ---------------------------------------------- the in-process transport (tests) */

typedef struct mf_ep_inproc_world mf_ep_inproc_world;

/* A world of `world` ranks, threads of this process; NULL when out of memory. */
mf_ep_inproc_world *mf_ep_inproc_world_create(int32_t world);
/* Frees it once every rank's group is destroyed. */
void mf_ep_inproc_world_destroy(mf_ep_inproc_world *w);

/* Rank config->rank's group on world w (each rank from its own thread and context). */
moefuse_status mf_ep_group_create_inproc(moefuse_context *ctx, mf_ep_inproc_world *w,
                                         const moefuse_ep_config *config,
                                         moefuse_ep_group **out);

/* The group's placement and state from a config and a transport (ep_group.c). */
moefuse_status mf_ep_group_make(moefuse_context *ctx, const char *op,
                                const moefuse_ep_config *config, mf_ep_transport transport,
                                moefuse_ep_group **out);

/* One collective of the group; a failure is reported on ctx with the op's name. */
moefuse_status mf_ep_all_to_all(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                const void *send, const size_t *send_bytes,
                                const size_t *send_off, void *recv, const size_t *recv_bytes,
                                const size_t *recv_off);

/* Every rank's status: each rank gives its own, and all get the first failing rank (-1:
   none) and its status and detail words, so that a collective call fails everywhere. */
typedef struct mf_ep_vote {
    int32_t status, detail[3];
} mf_ep_vote;
moefuse_status mf_ep_agree(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                           const mf_ep_vote *mine, mf_ep_vote *first, int32_t *first_rank);

/* Routes topk_ids ([M, k] i32, host) over g; weights ([M, k] f32) may be absent. Collective:
   exchanges the counts and the local experts. */
moefuse_status mf_ep_route_make(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                const moefuse_tensor *ids, const moefuse_tensor *weights,
                                mf_ep_route *r);
void mf_ep_route_free(mf_ep_route *r);

/*
 * Collective: rows of row_bytes each, out (send order to the experts' ranks, n_sent rows, into
 * n_recv rows by source) or back (n_recv rows by source, into n_sent rows in send order).
 */
moefuse_status mf_ep_exchange_rows(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                   const mf_ep_route *r, int back, const void *send,
                                   size_t row_bytes, void *recv);

/*
 * out[m] = sum over valid j in order of weight[m k + j] * y of slot (m, j), f32 from 0, rounded
 * once to out's dtype: the reduced final's sum (docs/NUMERICS.md, MoE). back: the n_sent rows of
 * K f32 in send order (mf_ep_exchange_rows back); acc: K floats of scratch.
 */
void mf_ep_reduce(const mf_ep_route *r, const float *back, int64_t K, float *acc,
                  const moefuse_tensor *out);

/* The CPU backend only, for now: the others say so. */
moefuse_status mf_ep_backend_check(moefuse_context *ctx, const char *op);

/* One rank's refusal as a vote, agreed with the others; returns the status every rank ends
   with (the message of another rank's refusal names it). */
moefuse_status mf_ep_vote_on(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                             moefuse_status mine);

#endif
