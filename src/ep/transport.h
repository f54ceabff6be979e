/*
 * How the ranks of an expert-parallel group move bytes: one collective, every rank sending a
 * run of bytes to every rank (itself included) and receiving one from each, in the context's
 * order or beside it. Dispatch, combine and the layer are built on it alone. Two transports implement it: NCCL (the CUDA backend's,
 * src/cuda/ep_nccl.c) and an in-process one whose ranks are threads of one program
 * (transport_inproc.c; the tests').
 */
#ifndef MOEFUSE_EP_TRANSPORT_H
#define MOEFUSE_EP_TRANSPORT_H

#include "moefuse.h"

#include <stddef.h>

typedef struct mf_ep_transport_i {
    /*
     * Collective: sends send_bytes[p] bytes from send + send_off[p] to rank p and receives
     * recv_bytes[p] bytes from rank p into recv + recv_off[p], for every p < world, in the
     * backend's memory (the rows; the work that wrote send may still be queued on the rank's
     * context, and what reads recv may be queued after). Sizes must agree pairwise (what p
     * sends to q is what q expects from p). On failure `why` holds a sentence.
     */
    moefuse_status (*all_to_all)(void *t, const void *send, const size_t *send_bytes,
                                 const size_t *send_off, void *recv, const size_t *recv_bytes,
                                 const size_t *recv_off, char *why, size_t why_size);
    /*
     * [optional] The same collective of rows queued beside the rank's context: it starts once
     * the work queued on the context so far is done, and the context's later work does not
     * wait for it, so that the rows move while the context computes; `join` ends it. Default
     * (NULL): the core calls all_to_all, whose order is the context's.
     */
    moefuse_status (*all_to_all_beside)(void *t, const void *send, const size_t *send_bytes,
                                        const size_t *send_off, void *recv,
                                        const size_t *recv_bytes, const size_t *recv_off,
                                        char *why, size_t why_size);
    /* [optional, with all_to_all_beside] The context's work queued from now on waits for every
       collective queued beside it. */
    moefuse_status (*join)(void *t, char *why, size_t why_size);
    /* The same in host memory, complete on return (counts, experts, votes). */
    moefuse_status (*all_to_all_host)(void *t, const void *send, const size_t *send_bytes,
                                      const size_t *send_off, void *recv,
                                      const size_t *recv_bytes, const size_t *recv_off,
                                      char *why, size_t why_size);
    /* Frees the transport's state of this rank. */
    void (*destroy)(void *t);
} mf_ep_transport_i;

/* A transport: its functions and this rank's state. */
typedef struct mf_ep_transport {
    const mf_ep_transport_i *i;
    void *t;
} mf_ep_transport;

#endif
