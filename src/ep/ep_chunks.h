/*
 * The expert-parallel layer's experts in chunks (ep_chunks.c): each rank's local experts split
 * into C contiguous ranges, so that the outputs of one range travel back while the next one
 * runs. A chunk holds whole experts, so each expert's rows run in one GEMM call, and each
 * expert's weights are read once a layer as before.
 *
 * The rows arrive by source rank, then by local expert. The experts run them in chunk order:
 * chunk, then source, then as they arrived; so a chunk's rows from one source, and their
 * outputs, are one run. Back at the tokens' rank, a chunk's outputs from rank p are the rows it
 * sent p whose expert there lies in the chunk: one run of those rows too, as they are sorted
 * by p's local expert.
 */
#ifndef MOEFUSE_EP_CHUNKS_H
#define MOEFUSE_EP_CHUNKS_H

#include "ep/ep_internal.h"

typedef struct mf_ep_chunks {
    int32_t count, world;  /* C, W */
    /* [C, W] each: rows from rank p whose expert here is in chunk c, where they start in the
       experts' order; rows this rank sent p whose expert there is in chunk c, where they start
       among the rows sent (send order) */
    int64_t *rows, *start, *back, *back_at;
    int64_t *order;        /* [n_recv]: each received row's place in the experts' order */
    int32_t *expert;       /* [n_recv]: the local expert of each row in the experts' order */
} mf_ep_chunks;

/* Chunk of a rank's local expert e among its `local` experts, of `count` chunks. */
static inline int32_t mf_ep_chunk_of(int64_t e, int64_t local, int32_t count)
{
    return (int32_t)(e * count / (local > 0 ? local : 1));
}

/* The chunks of route r (agreed) on group g, in `count` chunks (the same on every rank). */
moefuse_status mf_ep_chunks_make(moefuse_context *ctx, const char *op, const moefuse_ep_group *g,
                                 const mf_ep_route *r, int32_t count, mf_ep_chunks *c);
void mf_ep_chunks_free(mf_ep_chunks *c);

#endif
