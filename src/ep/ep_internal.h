/*
 * Expert parallelism inside the library: the group, the handle, and the in-process transport
 * the tests make groups with (threads as ranks).
 */
#ifndef MOEFUSE_EP_INTERNAL_H
#define MOEFUSE_EP_INTERNAL_H

#include "moefuse_ep.h"
#include "ep/ep_ll_wire.h"
#include "ep/transport.h"

#include <stdbool.h>

/* The group's scratch in backend memory, one buffer per use, kept and grown across calls: a
   call's work is ordered on the context, so the next call may take the same memory. */
enum mf_ep_slot {
    MF_EP_SEND,   /* rows out (dispatch), outputs back (combine) */
    MF_EP_RECV,   /* rows in */
    MF_EP_CODES,  /* x quantized on the way: codes */
    MF_EP_SCALES, /* and scales */
    MF_EP_BACK,   /* outputs back, in send order */
    MF_EP_IDS,    /* the layer's: received rows' experts */
    MF_EP_XQ,     /* codes */
    MF_EP_XS,     /* scales */
    MF_EP_H,      /* h */
    MF_EP_HS,     /* h's scales */
    MF_EP_Y,      /* the experts' outputs */
    MF_EP_SIDS,   /* the layer's shared slots: their experts */
    MF_EP_SXQ,    /* the rank's own tokens as FP8 codes */
    MF_EP_SXS,    /* and scales */
    MF_EP_SH,     /* their h */
    MF_EP_SHS,    /* h's scales */
    MF_EP_LL_MAP, /* low-latency mode (ep_ll.c): [2 E] i32, each expert's rank, its index */
    MF_EP_LL_CODES,  /* x quantized on the way (its own: a graph captured with it must not
                        see a normal-mode call free it) */
    MF_EP_LL_SCALES, /* and scales */
    MF_EP_LL_OUT, /* the blocks sent */
    MF_EP_LL_IN,  /* the blocks received, kept for combine */
    MF_EP_LL_POS, /* [C, W] i32: each token's row in each block sent */
    MF_EP_LL_ROW, /* [W, C, k] i32: each received slot's row of its expert */
    MF_EP_LL_PARTIAL, /* [W, C, K] f32: combine's rows out */
    MF_EP_LL_BACK,    /* and in */
    MF_EP_SLOTS
};

struct moefuse_ep_group {
    moefuse_context *ctx; /* the context it was made on, the only one it takes */
    void *scratch[MF_EP_SLOTS];
    size_t scratch_bytes[MF_EP_SLOTS];
    int32_t rank, world;
    int32_t experts;       /* E, global */
    int32_t local_experts; /* E_local of this rank */
    int32_t *owner;        /* [E]: the rank of each global expert */
    int32_t *local;        /* [E]: its index among its rank's experts */
    bool map_on_backend;   /* owner and local are in MF_EP_LL_MAP */
    uint64_t ll_dispatches; /* low-latency dispatches made: a combine takes the latest's */
    mf_ep_transport transport;
};

/* ---------------------------------------------- the route of one dispatch (ep_route.c) */

/*
 * Which rows go where: this rank's valid slots, sorted by the rank holding their expert, then
 * the local expert there, then the slot; and the local experts of the rows it receives, by
 * source rank, then as the source sent them. Host memory: the rows move in the backend's.
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
    int64_t *per_expert;     /* [E]: this rank's slots of each global expert */
    int64_t *local_rows;     /* [E_local]: the rows each local expert receives */
    void *block;             /* one allocation holding sent .. per_expert (ep_route.c) */
} mf_ep_route;

/* What combine needs of one dispatch: its route, and where each received row went. */
struct moefuse_ep_handle {
    const moefuse_ep_group *group;
    mf_ep_route route;
    int64_t model_dim, local_experts, tmax; /* K, E_local, Tmax of its recv_x */
    int64_t *recv_row;                      /* [n_recv]: row e Tmax + t of recv_x */
    /* low-latency: route holds only tokens and topk; the records are in the group's memory
       (MF_EP_LL_IN, MF_EP_LL_POS, MF_EP_LL_ROW), laid out by wire */
    bool low_latency;
    mf_ep_ll_wire wire;
    uint64_t ll_dispatch; /* which of the group's low-latency dispatches made it */
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

/* One collective of the group, of rows in backend memory or of host memory; a failure is
   reported on ctx with the op's name. */
moefuse_status mf_ep_all_to_all(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                bool rows, const void *send, const size_t *send_bytes,
                                const size_t *send_off, void *recv, const size_t *recv_bytes,
                                const size_t *recv_off);

/* The same collective of rows queued beside ctx's work (the transport's all_to_all_beside,
   or all_to_all in ctx's order when it has none), and the wait that ends such collectives:
   ctx's work queued after mf_ep_join waits for them. */
moefuse_status mf_ep_all_to_all_beside(moefuse_context *ctx, const char *op,
                                       moefuse_ep_group *g, const void *send,
                                       const size_t *send_bytes, const size_t *send_off,
                                       void *recv, const size_t *recv_bytes,
                                       const size_t *recv_off);
moefuse_status mf_ep_join(moefuse_context *ctx, const char *op, moefuse_ep_group *g);

/* The status of a rank whose own call went well when rank `who` refused with `status`. */
moefuse_status mf_ep_refused(moefuse_context *ctx, const char *op, int32_t who,
                             moefuse_status status);

/*
 * A call's route in two steps. Local: this rank's valid slots of topk_ids ([M, k] i32, a host
 * view: mf_ep_to_host) sorted by the rank holding their expert, then the local expert there,
 * then the slot; weights ([M, k] f32, host) may be absent. Agreed: the call's one exchange of
 * host memory, each rank's status (`mine`: its arguments, buffers and packing), capacity (tmax,
 * -1: none) and slots per expert. Every rank then knows the rows it receives and the first
 * rank that refused or has an expert over its capacity, and returns the same status (the
 * message names that rank). With `mine` failing, r's send side may be empty.
 */
moefuse_status mf_ep_route_local(moefuse_context *ctx, const char *op, const moefuse_ep_group *g,
                                 const moefuse_tensor *ids, const moefuse_tensor *weights,
                                 mf_ep_route *r);
moefuse_status mf_ep_route_agree(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                 moefuse_status mine, int64_t tmax, mf_ep_route *r);
void mf_ep_route_free(mf_ep_route *r);

/*
 * Collective: rows of row_bytes each, out (send order to the experts' ranks, n_sent rows, into
 * n_recv rows by source) or back (n_recv rows by source, into n_sent rows in send order).
 */
moefuse_status mf_ep_exchange_rows(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                   const mf_ep_route *r, int back, const void *send,
                                   size_t row_bytes, void *recv);

/* The top-k sum into out of the n_sent rows of K f32 that came back (backend memory, in send
   order): the backend's ep_reduce. */
moefuse_status mf_ep_reduce(moefuse_context *ctx, const mf_ep_route *r, const void *back,
                            int64_t K, const moefuse_tensor *out);
/* The same over slots given one by one: slot_row and weight [M slots] (host), rows of back. */
moefuse_status mf_ep_reduce_slots(moefuse_context *ctx, const int64_t *slot_row,
                                  const float *weight, int64_t tokens, int64_t slots,
                                  const void *back, int64_t K, const moefuse_tensor *out);

/* The group's scratch buffer `slot` of at least `bytes` (grown when short; its contents are
   not kept when it grows). */
moefuse_status mf_ep_scratch(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                             enum mf_ep_slot slot, size_t bytes, void **p);
/* A host copy of a tensor's bytes (*host, malloc'd) and a view of it with the same strides. */
moefuse_status mf_ep_to_host(moefuse_context *ctx, const char *op, const moefuse_tensor *t,
                             void **host, moefuse_tensor *view);

/* The backend has the rows' members of the vtable (ep_gather ...), and the group was made on
   this context; else a refusal with its message. */
moefuse_status mf_ep_backend_check(moefuse_context *ctx, const char *op,
                                   const moefuse_ep_group *g);

/* One rank's refusal as a vote, agreed with the others; returns the status every rank ends
   with (the message of another rank's refusal names it). */
moefuse_status mf_ep_vote_on(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                             moefuse_status mine);

#endif
